"""The memory estimate of an image run whose tower takes images of any size (Qwen3.5's dynamic
resolution): a tiny Qwen3.5 vision checkpoint, --data whose rows hold images of two sizes. The
estimate prepares the largest image of the data's first rows with the checkpoint's processor and
steps a fake batch of copies of it; it must match the same step run for real on CPU (its tracked
peak), and its images must be what the data path makes of the larger image."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from image_cases import png, qwen_processor, save_tiny_qwen35_checkpoint

from compiletune.config import resolve
from compiletune.data.image_batch import ImagePrep
from compiletune.data.image_tokens import encode_image_pieces
from compiletune.data.images import ImageRef
from compiletune.estimate import estimator as estimate
from compiletune.estimate import images as images_
from compiletune.train.build_model import resolve_model_args

TOLERANCE = 0.10  # as tests/unit/estimate/test_estimate.py
# a row of one small image, a row of a large and a small one: patches of 4 merged 2x2, so
# 16x16 pixels take 4 image tokens and 64x48 take 48
ROWS = [[(16, 16)], [(64, 48), (16, 16)]]


@pytest.fixture(autouse=True)
def _eager_loss_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COMPILETUNE_LCE_EAGER", "1")


@pytest.fixture(scope="module")
def processor():
    return qwen_processor(max_side=64)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory, processor) -> Path:
    folder = tmp_path_factory.mktemp("qwen35")
    save_tiny_qwen35_checkpoint(folder, processor)
    return folder


@pytest.fixture(autouse=True)
def _processor(monkeypatch: pytest.MonkeyPatch, processor) -> None:
    # AutoProcessor cannot load Qwen3.5's without torchvision (image_cases.TinyQwenProcessor)
    monkeypatch.setattr(images_, "load_processor", lambda *a: processor)
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


def config(checkpoint: Path, data: Path | None, **flags):
    base = {"model_dir": str(checkpoint), "seq_len": 128, "batch_size": 2, "dtype": "fp32"}
    base |= {"loss": "plain", **flags}
    return resolve({}, base if data is None else {**base, "data": str(data)})


def test_the_plan_is_the_data_paths_largest_image(tmp_path: Path, checkpoint: Path, processor):
    data = conversations(tmp_path, ROWS)
    assert images_.largest_image(str(data)) == (64, 48)
    cfg = config(checkpoint, data)
    plan = images_.image_plan(cfg, resolve_model_args(cfg))
    # the real data path on the larger image: its pixels, and its image tokens in the row
    ref = ImageRef(tmp_path / "img" / "1_0.png", "rows.jsonl:2")
    want = ImagePrep(processor)([[ref.to_json()]])["images"]
    pieces = [("<|vision_start|><|image_pad|><|vision_end|>", False)]
    ids = encode_image_pieces(pieces, [ref], processor, "rows.jsonl:2")[0]
    tokens = ids.count(processor.image_token_id)
    assert tokens == 48 and plan is not None
    assert (plan.per_row, plan.tokens, plan.token_id) == (2, tokens, processor.image_token_id)
    assert plan.pixels == tuple(want.pixel_values.shape)
    assert plan.image.image_grid_thw.tolist() == want.image_grid_thw.tolist()
    assert plan.note == "images as the largest of the first 256 rows': 64x48, 48 tokens each"
    # a row of 64 tokens holds one such image (and a text token after it)
    short = cfg.replace(seq_len=64)
    assert images_.image_plan(short, resolve_model_args(short)).per_row == 1


def test_without_its_processor_the_step_holds_no_images(
    tmp_path: Path, checkpoint: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(images_, "load_processor", lambda *a: None)
    cfg = config(checkpoint, conversations(tmp_path, ROWS))
    plan = images_.image_plan(cfg, resolve_model_args(cfg))
    assert plan is not None and plan.pixels is None and plan.image is None
    assert "not in the step" in plan.note


@pytest.mark.parametrize(
    "flags", [{"lora_rank": 8}, {"train_vision": True}], ids=["lora", "train-vision"]
)
def test_image_run_estimate_matches_the_real_cpu_step(
    tmp_path: Path, checkpoint: Path, flags: dict, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = config(checkpoint, conversations(tmp_path, ROWS), **flags)
    est = estimate.estimate_memory(cfg, 1, round_bytes=1)
    real = estimate.measure_cpu_step(cfg)
    print(
        f"qwen35 {flags}: estimate {est.peak_bytes} real {real} ({est.peak_bytes / real - 1:+.1%})"
    )
    assert abs(est.peak_bytes - real) <= TOLERANCE * real, (est.peak_bytes, real)
    assert any(n.startswith("images as the largest") for n in est.notes), est.notes
    # only the smaller images: less (the step's images are the data's largest)
    small = config(checkpoint, conversations(tmp_path / "small", [[(16, 16)] * 2]), **flags)
    assert estimate.estimate_memory(small, 1, round_bytes=1).peak_bytes < est.peak_bytes
    if flags.get("train_vision"):  # the tower's weights without its activations: far too few
        monkeypatch.setattr(images_, "load_processor", lambda *a: None)
        images_._prepared.cache_clear()
        weights_only = estimate.estimate_memory(cfg, 1, round_bytes=1).peak_bytes
        assert abs(weights_only - real) > TOLERANCE * real, (weights_only, real)
