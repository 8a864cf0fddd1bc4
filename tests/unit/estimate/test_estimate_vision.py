"""The memory estimate of an image run: a tiny Gemma 3 vision checkpoint (built from
transformers' config classes) and --data whose conversations hold images. The estimate builds
the tower as the trainer does and steps a fake batch of images; it must match the same step run
for real on CPU (its tracked peak), where the text model's estimate alone does not."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers
from vision_cases import gemma3_config

from compiletune.config import resolve
from compiletune.estimate import estimator as estimate
from compiletune.estimate.images import image_plan, images_per_row
from compiletune.train.build_model import resolve_model_args

TOLERANCE = 0.10  # as tests/unit/estimate/test_estimate.py


@pytest.fixture(autouse=True)
def _eager_loss_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COMPILETUNE_LCE_EAGER", "1")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("gemma3")
    torch.manual_seed(0)
    hf = transformers.Gemma3ForConditionalGeneration(
        gemma3_config(image_token_index=261, boi_token_index=259)
    )
    hf.save_pretrained(folder)
    return folder


def conversations(path: Path, images: list[int]) -> Path:
    """Rows whose user turn holds `images[i]` image parts (the files are never read)."""
    lines = []
    for i, n in enumerate(images):
        user = [{"type": "image", "image": f"img/{i}_{k}.png"} for k in range(n)]
        user.append({"type": "text", "text": "What is it?"})
        reply = [{"type": "text", "text": "a red square"}]
        messages = [{"role": "user", "content": user}, {"role": "assistant", "content": reply}]
        lines.append(json.dumps({"messages": messages}))
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.mark.parametrize(
    "flags",
    [
        {"lora_rank": 8},
        {"train_vision": True},
        {"lora_rank": 8, "train_vision": True},  # LoRA on the tower's projections too
        {"ac": "full", "images": [0, 2, 1]},
    ],
    ids=["lora", "train-vision", "lora-train-vision", "two-per-row-ac-full"],
)
def test_image_run_estimate_matches_the_real_cpu_step(
    tmp_path: Path, checkpoint: Path, flags: dict
) -> None:
    flags = dict(flags)
    data = conversations(tmp_path / "rows.jsonl", flags.pop("images", [1, 1]))
    base = {"model_dir": str(checkpoint), "seq_len": 64, "batch_size": 2, "dtype": "fp32"}
    base |= {"loss": "plain", **flags}
    cfg = resolve({}, {**base, "data": str(data)})
    est = estimate.estimate_memory(cfg, 1, round_bytes=1)
    real = estimate.measure_cpu_step(cfg)
    assert abs(est.peak_bytes - real) <= TOLERANCE * real, (est.peak_bytes, real)
    assert sum(est.parts.values()) == est.peak_bytes
    # the text model alone (no --data: nothing says the run has images) counts less
    text = estimate.estimate_memory(resolve({}, base), 1, round_bytes=1)
    assert text.peak_bytes < est.peak_bytes
    assert est.parts["parameters"] > text.parts["parameters"]  # the tower's weights
    if flags.get("train_vision") and not flags.get("lora_rank"):  # its gradients, AdamW state
        assert abs(text.peak_bytes - real) > TOLERANCE * real, (text.peak_bytes, real)


def test_the_plan_follows_the_data_and_the_checkpoint(tmp_path: Path, checkpoint: Path) -> None:
    two = conversations(tmp_path / "two.jsonl", [1, 2, 0])
    text = tmp_path / "text.jsonl"
    text.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    assert images_per_row(str(two)) == 2
    assert images_per_row(str(text)) == 0 and images_per_row(None) == 0
    cfg = resolve({}, {"model_dir": str(checkpoint), "data": str(two), "seq_len": 64})
    plan = image_plan(cfg, resolve_model_args(cfg))
    # 32 px images (patch 4, pooled to 16 tokens), two a row, the config's image token
    assert plan is not None and (plan.per_row, plan.tokens, plan.token_id) == (2, 16, 261)
    assert plan.pixels == (3, 32, 32)
    # a row of 20 tokens holds one image; text data or a text preset: no images
    short = cfg.replace(seq_len=20)
    assert image_plan(short, resolve_model_args(short)).per_row == 1
    tiny = cfg.replace(seq_len=16)  # no image fits: the tower without images in the step
    assert image_plan(tiny, resolve_model_args(tiny)).pixels is None
    plain = resolve({}, {"model_dir": str(checkpoint), "data": str(text)})
    assert image_plan(plain, resolve_model_args(plain)) is None
    preset = resolve({}, {"model": "debug", "data": str(two)})
    assert image_plan(preset, resolve_model_args(preset)) is None
