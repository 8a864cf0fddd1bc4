"""The memory estimate of an image run whose tower takes images of any size (Qwen3.5's dynamic
resolution, Gemma 4's variable patch counts): a tiny vision checkpoint of each, --data whose
rows hold images of two sizes. The estimate prepares the largest image of the data's first rows
with the checkpoint's processor and steps a fake batch of copies of it; it must match the same
step run for real on CPU (its tracked peak), and its images must be what the data path makes
of the larger image."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from image_cases import (
    gemma4_processor,
    png,
    qwen_processor,
    save_tiny_gemma4_checkpoint,
    save_tiny_qwen35_checkpoint,
)

from compiletune.config import resolve
from compiletune.data.image_batch import ImagePrep
from compiletune.data.image_tokens import encode_image_pieces
from compiletune.data.images import ImageRef
from compiletune.estimate import estimator as estimate
from compiletune.estimate import images as images_
from compiletune.train.build_model import resolve_model_args

TOLERANCE = 0.10  # as tests/unit/estimate/test_estimate.py
# a row of one small image, a row of a large and a small one
ROWS = [[(16, 16)], [(64, 48), (16, 16)]]
# each family: its processor and checkpoint, where its chat template places an image, the
# image tokens of a 64x48 image (Qwen3.5: patches of 4 merged 2x2; Gemma 4: patches of 4
# pooled 2x2, scaled to at most 70 tokens) and a --seq-len that holds two
FAMILIES = {
    "qwen35": (
        lambda: qwen_processor(max_side=64),
        save_tiny_qwen35_checkpoint,
        "<|vision_start|><|image_pad|><|vision_end|>",
        48,
        128,
    ),
    "gemma4": (gemma4_processor, save_tiny_gemma4_checkpoint, "<|image|>", 63, 192),
}


@pytest.fixture(autouse=True)
def _eager_loss_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COMPILETUNE_LCE_EAGER", "1")


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path, object]:
    """(name, checkpoint folder, processor) of each family."""
    make, save = FAMILIES[request.param][:2]
    processor = make()
    folder = tmp_path_factory.mktemp(request.param)
    save(folder, processor)
    return request.param, folder, processor


@pytest.fixture(autouse=True)
def _processor(monkeypatch: pytest.MonkeyPatch, family) -> None:
    # AutoProcessor cannot load these without torchvision (image_cases.TinyQwenProcessor)
    monkeypatch.setattr(images_, "load_processor", lambda *a: family[2])
    images_._prepared.cache_clear()


def conversations(folder: Path, rows: list[list[tuple[int, int]]]) -> Path:
    """A row of images of each list's sizes (PNGs beside the data file)."""
    lines = []
    for i, sizes in enumerate(rows):
        user = []
        for k, (w, h) in enumerate(sizes):
            png(folder / "img" / f"{i}_{k}.png", w, h, seed=i)
            user.append({"type": "image", "image": f"img/{i}_{k}.png"})
        user.append({"type": "text", "text": "Which?"})
        reply = [{"type": "text", "text": "a red square"}]
        messages = [{"role": "user", "content": user}, {"role": "assistant", "content": reply}]
        lines.append(json.dumps({"messages": messages}))
    path = folder / "rows.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def config(family, data: Path | None, **flags):
    name, folder, _ = family
    base = {"model_dir": str(folder), "seq_len": FAMILIES[name][4], "batch_size": 2}
    base |= {"dtype": "fp32", "loss": "plain", **flags}
    return resolve({}, base if data is None else {**base, "data": str(data)})


def test_the_plan_is_the_data_paths_largest_image(tmp_path: Path, family) -> None:
    name, _, processor = family
    placeholder, want_tokens = FAMILIES[name][2:4]
    data = conversations(tmp_path, ROWS)
    assert images_.largest_image(str(data)) == (64, 48)
    cfg = config(family, data)
    plan = images_.image_plan(cfg, resolve_model_args(cfg))
    # the real data path on the larger image: its pixels, and its image tokens in the row
    ref = ImageRef(tmp_path / "img" / "1_0.png", "rows.jsonl:2")
    want = ImagePrep(processor)([[ref.to_json()]])["images"]
    ids = encode_image_pieces([(placeholder, False)], [ref], processor, "rows.jsonl:2")[0]
    tokens = ids.count(processor.image_token_id)
    assert tokens == want_tokens and plan is not None
    assert (plan.per_row, plan.tokens, plan.token_id) == (2, tokens, processor.image_token_id)
    assert plan.pixels == tuple(want.pixel_values.shape)
    for key in ("image_grid_thw", "image_position_ids"):
        got, expected = getattr(plan.image, key), getattr(want, key)
        assert (got is None) == (expected is None) and (got is None or got.equal(expected))
    note = f"images as the largest of the first 256 rows': 64x48, {tokens} tokens each"
    assert plan.note == note
    # a row of one such image (and a text token after it) holds one
    short = cfg.replace(seq_len=tokens + 2)
    assert images_.image_plan(short, resolve_model_args(short)).per_row == 1


def test_without_its_processor_the_step_holds_no_images(
    tmp_path: Path, family, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(images_, "load_processor", lambda *a: None)
    cfg = config(family, conversations(tmp_path, ROWS))
    plan = images_.image_plan(cfg, resolve_model_args(cfg))
    assert plan is not None and plan.pixels is None and plan.image is None
    assert "not in the step" in plan.note


@pytest.mark.parametrize(
    "flags", [{"lora_rank": 8}, {"train_vision": True}], ids=["lora", "train-vision"]
)
def test_image_run_estimate_matches_the_real_cpu_step(
    tmp_path: Path, family, flags: dict, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = config(family, conversations(tmp_path, ROWS), **flags)
    est = estimate.estimate_memory(cfg, 1, round_bytes=1)
    real = estimate.measure_cpu_step(cfg)
    print(
        f"{family[0]} {flags}: estimate {est.peak_bytes} real {real} ({est.peak_bytes / real - 1:+.1%})"
    )
    assert abs(est.peak_bytes - real) <= TOLERANCE * real, (est.peak_bytes, real)
    assert any(n.startswith("images as the largest") for n in est.notes), est.notes
    if family[0] == "qwen35":  # only the smaller images: less (the step's are the largest)
        # (Gemma 4 scales every image to its token budget, its patches padded to one count: a
        # 16x16 image takes 64 tokens, a 64x48 one 63)
        small = config(family, conversations(tmp_path / "small", [[(16, 16)] * 2]), **flags)
        assert estimate.estimate_memory(small, 1, round_bytes=1).peak_bytes < est.peak_bytes
    if flags.get("train_vision"):  # the tower's weights without its activations: far too few
        monkeypatch.setattr(images_, "load_processor", lambda *a: None)
        images_._prepared.cache_clear()
        weights_only = estimate.estimate_memory(cfg, 1, round_bytes=1).peak_bytes
        assert abs(weights_only - real) > TOLERANCE * real, (weights_only, real)


def test_without_readable_images_the_step_holds_no_images(tmp_path: Path, family) -> None:
    data = conversations(tmp_path, ROWS)
    for image in (tmp_path / "img").iterdir():
        image.write_bytes(b"not an image")
    assert images_.largest_image(str(data)) is None
    cfg = config(family, data)
    plan = images_.image_plan(cfg, resolve_model_args(cfg))
    assert plan is not None and plan.per_row == 2 and plan.image is None
    assert plan.note.startswith("images: not in the step (no image file")
