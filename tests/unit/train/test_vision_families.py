"""Gemma 4 and Qwen3.5 image conversations end to end from the CLI (Gemma 3's is in
test_vision_train.py): a tiny checkpoint of each family (transformers' config classes, random
vision weights) saved with its processor, a short LoRA run on synthetic shapes and colours whose
training loss falls, the saved step loaded by transformers + PEFT with logits equal to ours for
one image; and a compiled Qwen3.5 run over images of two sizes: 0 recompiles, the eager run's loss.

Both families' processors need a video processor, and transformers' video processors need
torchvision, which is not installed here: AutoProcessor cannot load them. The runs get the
checkpoint's processor built in the test (the families' own image processors and processor
classes, without the video part), handed to the CLI in place of its AutoProcessor load
(compiletune.train.inputs.load_processor).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers
from image_cases import (
    TinyGemma4Processor,
    gemma4_processor,
    qwen_processor,
    save_tiny_gemma4_checkpoint,
    save_tiny_qwen35_checkpoint,
)
from PIL import Image
from safetensors import safe_open
from vision_cases import rel

import compiletune.train.inputs
from compiletune.checkpoint.adapter_io import load_adapter, read_adapter_spec
from compiletune.cli import main
from compiletune.data.images import ImageRef, load_image
from compiletune.metrics import read_metrics
from compiletune.models import from_hf
from compiletune.models.lora import apply_lora
from compiletune.models.vision.inputs import ImageInputs

peft = pytest.importorskip("peft")

COLOURS = {"red": (220, 30, 30), "green": (30, 200, 40), "blue": (30, 40, 220)}


def picture(path: Path, colour: str, shape: str, seed: int, size: int = 32) -> None:
    """A `size` x `size` image: a `colour` square or stripe on noise-tinted grey."""
    rng = np.random.default_rng(seed)
    pixels = rng.integers(100, 140, (size, size, 3), dtype=np.uint8)
    q = size // 4
    if shape == "square":
        pixels[q : 3 * q, q : 3 * q] = COLOURS[colour]
    else:
        pixels[size // 2 - 2 : size // 2 + 2, :] = COLOURS[colour]
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(pixels).save(path)


def rows(folder: Path, n: int, sizes: tuple[int, ...] = (32,)) -> Path:
    """`n` image conversations in folder/train.jsonl, images beside it, sizes taken in turn."""
    lines = []
    for i in range(n):
        colour, shape = list(COLOURS)[i % 3], ("square", "stripe")[(i // 3) % 2]
        image = f"img/{i}.png"
        picture(folder / image, colour, shape, i, sizes[i % len(sizes)])
        user = [{"type": "image", "image": image}, {"type": "text", "text": "What is it?"}]
        reply = [{"type": "text", "text": f"a {colour} {shape}"}]
        messages = [{"role": "user", "content": user}, {"role": "assistant", "content": reply}]
        lines.append(json.dumps({"messages": messages}))
    path = folder / "train.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


FAMILIES = {
    "gemma4": (gemma4_processor, save_tiny_gemma4_checkpoint),
    "qwen35": (qwen_processor, save_tiny_qwen35_checkpoint),
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, tuple[Path, object]]:
    out = {}
    for name, (make_processor, save) in FAMILIES.items():
        folder = tmp_path_factory.mktemp(name)
        processor = make_processor()
        save(folder, processor)
        processor.save_pretrained(folder)  # the files a step folder carries on
        out[name] = folder, processor
    return out


def cli_run(folder: Path, processor, data: Path, out: Path, *extra: str) -> list[float]:
    """`compiletune train`, 6 LoRA steps, on the checkpoint in `folder`, its processor the
    test's (see above); the training losses."""
    seq = "192" if isinstance(processor, TinyGemma4Processor) else "128"  # Gemma 4: 64 / image
    argv = ["train", "--model-dir", str(folder), "--data", str(data), "--lora-rank", "8"]
    argv += ["--lr", "1e-2", "--batch-size", "4", "--seq-len", seq, "--dtype", "fp32"]
    argv += ["--max-steps", "6", "--save-every", "6", "--output-dir", str(out), *extra]
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(compiletune.train.inputs, "load_processor", lambda *a: processor)
        assert main(argv) == 0
    return [r["loss"] for r in read_metrics(out / "metrics.jsonl") if "loss" in r]


@pytest.fixture(scope="module")
def runs(checkpoints, tmp_path_factory) -> Callable[[str], tuple[Path, list[float]]]:
    """A family's eager run (data folder, losses; the step in data/run), made once, when a test
    first asks for it (under -n auto a worker runs only the families its tests need): 12
    examples, Qwen3.5's images of 32x32 and 16x16 pixels (16 and 4 image tokens), 2 epochs."""
    made: dict[str, tuple[Path, list[float]]] = {}

    def run(name: str) -> tuple[Path, list[float]]:
        if name not in made:
            folder, processor = checkpoints[name]
            data = tmp_path_factory.mktemp(f"{name}_data")
            sizes = (32, 16) if name == "qwen35" else (32,)
            losses = cli_run(folder, processor, rows(data, 12, sizes), data / "run")
            made[name] = data, losses
        return made[name]

    return run


@pytest.mark.slow
@pytest.mark.parametrize("family", ["gemma4", "qwen35"])
def test_lora_run_on_images_and_peft_loads_the_step(family, checkpoints, runs):
    folder, processor = checkpoints[family]
    data, losses = runs(family)
    assert len(losses) == 6 and losses[-1] < losses[0] - 0.1, losses

    assert_peft_loads(folder, processor, data, data / "run" / "step_6")


def assert_peft_loads(folder: Path, processor, data: Path, step: Path) -> None:
    """transformers + PEFT on the step give our logits for one image; trained adapters."""
    messages = [
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is it?"}]}
    ]
    text = processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    image = load_image(ImageRef(data / "img" / "0.png", ""))
    inputs = processor(text=[text], images=[image], add_special_tokens=False, return_tensors="pt")
    base = transformers.AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32)
    adapted = peft.PeftModel.from_pretrained(base.eval(), step).eval()
    ours = from_hf(folder, dtype=torch.float32, vision=True)
    apply_lora(ours, read_adapter_spec(step), dtype=torch.float32)
    load_adapter(ours, step)
    ours.eval()
    with torch.no_grad():
        want = adapted(**inputs).logits
        got = ours(inputs["input_ids"], images=ImageInputs.from_processor(inputs))
        assert rel(got, want) <= 1e-5
        with adapted.disable_adapter():  # the adapter is trained: without it the logits differ
            assert rel(got, adapted(**inputs).logits) > 1e-3


@pytest.mark.parametrize("family", ["gemma4", pytest.param("qwen35", marks=pytest.mark.slow)])
def test_lora_on_the_towers_projections_from_the_cli(family, checkpoints, tmp_path):
    """--lora-targets naming tower projections as PEFT does (vision.NAME): 6 steps lower the
    training loss, the step's adapter holds them (trained) beside the decoder's, and PEFT loads
    it on transformers' model with our logits. Qwen3.5's run is compiled (aot_eager), over
    images of two sizes: the tower's adapted blocks compile too, with 0 recompiles."""
    folder, processor = checkpoints[family]
    data = tmp_path / "data"
    tower = {"qwen35": ("linear_fc1", "qkv"), "gemma4": ("down_proj", "q_proj")}[family]
    flags = ["--lora-targets", ",".join(("q", "v", *(f"vision.{n}" for n in tower)))]
    if family == "qwen35":
        flags += ["--compile", "--compile-backend", "aot_eager"]
    sizes = (32, 16) if family == "qwen35" else (32,)
    losses = cli_run(folder, processor, rows(data, 8, sizes), data / "run", *flags)
    assert len(losses) == 6 and losses[-1] < losses[0] - 0.1, losses
    if family == "qwen35":
        summary = json.loads((data / "run" / "summary.json").read_text())
        assert summary["compile"]["recompiles"] == 0, summary["compile"]
    step = data / "run" / "step_6"
    spec = read_adapter_spec(step)
    assert (spec.targets, spec.vision) == (("q", "v"), tower)
    with safe_open(str(step / "adapter_model.safetensors"), "pt") as f:
        names = [k for k in f.keys() if ".lora_B." in k]  # noqa: SIM118 (not a dict)
        b = {k: f.get_tensor(k) for k in names if ".language_model." not in k}
    assert len(b) > 2 and all(t.abs().max() > 0 for t in b.values()), sorted(b)
    assert_peft_loads(folder, processor, data, step)


@pytest.mark.slow
def test_compiled_qwen35_image_run_equals_eager_without_recompiles(checkpoints, runs, tmp_path):
    """The eager run's argv with --compile: images of two sizes over the run's 6 batches (every
    example twice), one graph per region, the eager run's losses."""
    folder, processor = checkpoints["qwen35"]
    data, eager = runs("qwen35")
    out = tmp_path / "compiled"
    compiled = cli_run(
        folder, processor, data / "train.jsonl", out, "--compile", "--compile-backend", "aot_eager"
    )
    summary = json.loads((out / "summary.json").read_text())
    assert summary["compile"]["recompiles"] == 0, summary["compile"]
    assert len(compiled) == 6 and rel(torch.tensor(compiled), torch.tensor(eager)) <= 1e-5
