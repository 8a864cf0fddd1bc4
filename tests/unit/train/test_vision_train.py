"""Image conversations end to end from the CLI: a tiny Gemma 3 vision checkpoint (built from
transformers' config classes, saved with its processor), a synthetic set of shapes and colours
described in text, a 20-step LoRA run whose held-out loss falls; the saved step loads in
transformers and PEFT, with logits equal to ours for one image."""

from __future__ import annotations

import itertools
import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers
from image_cases import save_tiny_gemma3_checkpoint
from PIL import Image
from vision_cases import rel

from compiletune.checkpoint.adapter_io import load_adapter, read_adapter_spec
from compiletune.cli import main
from compiletune.data.images import ImageRef, load_image
from compiletune.errors import UserError
from compiletune.metrics import read_metrics
from compiletune.models import from_hf
from compiletune.models.lora import apply_lora, lora_modules
from compiletune.models.vision.inputs import ImageInputs

peft = pytest.importorskip("peft")

COLOURS = {"red": (220, 30, 30), "green": (30, 200, 40), "blue": (30, 40, 220)}
SHAPES = ("square", "stripe")


def picture(path: Path, colour: str, shape: str, seed: int) -> None:
    """A 32x32 image: a `colour` square or horizontal stripe on noise-tinted grey."""
    rng = np.random.default_rng(seed)
    pixels = rng.integers(100, 140, (32, 32, 3), dtype=np.uint8)
    if shape == "square":
        pixels[8:24, 8:24] = COLOURS[colour]
    else:
        pixels[13:19, :] = COLOURS[colour]
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(pixels).save(path)


def rows(folder: Path, name: str, n: int, seed: int) -> Path:
    """`n` image conversations in folder/name.jsonl, images beside it."""
    lines = []
    for i in range(n):
        colour, shape = list(COLOURS)[i % 3], SHAPES[(i // 3) % 2]
        image = f"img/{name}_{i}.png"
        picture(folder / image, colour, shape, seed * 1000 + i)
        user = [{"type": "image", "image": image}, {"type": "text", "text": "What is it?"}]
        reply = [{"type": "text", "text": f"a {colour} {shape}"}]
        messages = [{"role": "user", "content": user}, {"role": "assistant", "content": reply}]
        lines.append(json.dumps({"messages": messages}))
    path = folder / f"{name}.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("gemma3")
    save_tiny_gemma3_checkpoint(folder)
    return folder


def _peft_on_one_image(step: Path, checkpoint: Path, image: Path) -> tuple[dict, object]:
    """A one-image question prepared by the step's saved processor, and transformers' model
    of `checkpoint` with the step's adapter loaded by PEFT."""
    processor = transformers.AutoProcessor.from_pretrained(step)
    messages = [
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is it?"}]}
    ]
    text = processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    picture = load_image(ImageRef(image, ""))
    inputs = processor(text=[text], images=[picture], add_special_tokens=False, return_tensors="pt")
    base = transformers.AutoModelForImageTextToText.from_pretrained(
        checkpoint, dtype=torch.float32
    ).eval()
    return inputs, peft.PeftModel.from_pretrained(base, step).eval()


@pytest.mark.slow
def test_lora_run_on_images_lowers_held_out_loss_and_loads_in_peft(tmp_path, checkpoint, capsys):
    train = rows(tmp_path / "data", "train", 24, seed=1)
    held = rows(tmp_path / "data", "held", 6, seed=2)
    out = tmp_path / "run"
    argv = ["train", "--model-dir", str(checkpoint), "--data", str(train)]
    argv += ["--eval-data", str(held), "--eval-every", "5", "--lora-rank", "8"]
    argv += ["--lr", "1e-2", "--max-steps", "20", "--batch-size", "4", "--seq-len", "128"]
    argv += ["--dtype", "fp32", "--save-every", "20", "--output-dir", str(out)]
    assert main(argv) == 0, capsys.readouterr().err
    evals = [r["eval_loss"] for r in read_metrics(out / "metrics.jsonl") if "eval_loss" in r]
    # held-out loss at steps 5, 10, 15, 20: falls at every eval, by more than 0.1 nats overall
    assert len(evals) == 4 and all(b < a for a, b in itertools.pairwise(evals)), evals
    assert evals[-1] < evals[0] - 0.1, evals

    step = out / "step_20"
    inputs, adapted = _peft_on_one_image(step, checkpoint, tmp_path / "data/img/held_0.png")
    ours = from_hf(checkpoint, dtype=torch.float32, vision=True)
    apply_lora(ours, read_adapter_spec(step), dtype=torch.float32)
    load_adapter(ours, step)
    ours.eval()
    with torch.no_grad():
        want = adapted(**inputs).logits
        got = ours(inputs["input_ids"], images=ImageInputs.from_processor(inputs))
    assert rel(got, want) <= 1e-5
    # the adapter is trained: without it the logits differ
    with torch.no_grad(), adapted.disable_adapter():
        assert rel(got, adapted(**inputs).logits) > 1e-3


def test_the_tower_loads_for_image_data_only(tmp_path, checkpoint):
    """wants_vision: a vision checkpoint with image data; a text-only run on it, or a preset,
    loads the text model as before."""
    from compiletune.config import resolve
    from compiletune.train.build_model import wants_vision

    cfg = resolve({}, {"model_dir": str(checkpoint)})
    assert wants_vision(cfg, images=True) and not wants_vision(cfg, images=False)
    assert not wants_vision(resolve({}, {"model": "debug"}), images=True)
    lora = resolve({}, {"model_dir": str(checkpoint), "lora_rank": 4, "train_vision": True})
    assert wants_vision(lora, images=True) and not wants_vision(lora, images=False)


def test_lora_targets_in_the_tower(checkpoint):
    """--train-vision in a LoRA run: adapters on all of the tower's projections; vision.NAME
    entries name some of them (without --train-vision too); a text-only run drops the ones
    --train-vision implied and refuses named ones; a name the tower lacks, or a tower target on
    a checkpoint without one, is one line."""
    from compiletune.config import resolve
    from compiletune.train.build_model import lora_spec, resolve_model_args, tower_lora

    def spec(**flags):
        cfg = resolve({}, {"model_dir": str(checkpoint), "lora_rank": 4, **flags})
        return cfg, lora_spec(cfg, resolve_model_args(cfg))

    everything = ("fc1", "fc2", "k_proj", "out_proj", "q_proj", "v_proj")
    cfg, implied = spec(train_vision=True)
    assert implied.vision == everything and implied.targets[:4] == ("q", "k", "v", "o")
    assert tower_lora(cfg, implied, vision=True) == implied
    assert tower_lora(cfg, implied, vision=False).vision == ()
    cfg, named = spec(lora_targets="q,v,vision.v_proj,vision.q_proj")
    assert (named.targets, named.vision) == (("q", "v"), ("q_proj", "v_proj"))
    with pytest.raises(UserError, match="a run loads for image data only"):
        tower_lora(cfg, named, vision=False)
    assert spec(lora_targets="vision.all-linear")[1].vision == everything
    with pytest.raises(UserError, match="no linear projection named qkv; it has vision.fc1,"):
        spec(lora_targets="q,vision.qkv")
    preset = resolve({}, {"model": "debug", "lora_rank": 4, "lora_targets": "q,vision.fc1"})
    with pytest.raises(UserError, match="vision.* targets adapt a vision tower"):
        lora_spec(preset, resolve_model_args(preset))


def test_estimate_memory_on_a_vision_checkpoint(checkpoint):
    """The estimate reads no data: a vision checkpoint is estimated as its text model (with
    --train-vision too), not refused."""
    from compiletune.config import resolve
    from compiletune.estimate.estimator import estimate_memory

    flags = {"model_dir": str(checkpoint), "seq_len": 64, "batch_size": 2, "dtype": "fp32"}
    for extra in ({"lora_rank": 8}, {"train_vision": True}):
        est = estimate_memory(resolve({}, {**flags, **extra}), 1, round_bytes=1)
        assert est.peak_bytes > 0


@pytest.mark.parametrize("train_vision", [False, True])
def test_the_meta_build_of_an_image_run_has_the_loaded_models_tensors(checkpoint, train_vision):
    """FSDP ranks build the model on the meta device and fill it from rank 0's state dict: with
    the tower, the same names and shapes as the model loaded with its weights; with
    --train-vision the tower's adapters are its only trainable tensors."""
    from compiletune.config import resolve
    from compiletune.train.build_model import (
        build_meta_model,
        build_model_weights,
        lora_spec,
        resolve_model_args,
    )

    flags = {"model_dir": str(checkpoint), "lora_rank": 4, "dtype": "fp32"}
    cfg = resolve({}, {**flags, "train_vision": train_vision})
    args = resolve_model_args(cfg)
    spec = lora_spec(cfg, args)
    kw = {"dtype": torch.float32, "base_dtype": torch.float32, "quantize": None}
    loaded = build_model_weights(cfg, args, spec, kw, "cpu", None, vision=True)
    meta = build_meta_model(cfg, args, spec, kw, vision=True)
    shapes = lambda m: {k: tuple(v.shape) for k, v in m.state_dict().items()}  # noqa: E731
    assert shapes(meta) == shapes(loaded) and any(
        k.startswith("vision_tower.") for k in shapes(meta)
    )
    trainable = lambda m: {n for n, p in m.named_parameters() if p.requires_grad}  # noqa: E731
    assert trainable(meta) == trainable(loaded)
    tower = {n for n in trainable(meta) if n.startswith("vision_tower.")}
    assert len(tower) == (2 * 6 * 2 if train_vision else 0)  # A and B, 6 projections, 2 layers
    assert all(n.endswith(("lora_a", "lora_b")) for n in tower)


def test_train_vision_lora_run_adapts_the_tower_and_loads_in_peft(tmp_path, checkpoint, capsys):
    """`--train-vision --lora-rank 8`: LoRA on the decoder and on every projection of the
    tower; 6 steps lower the training loss, the tower's adapters are trained (B left zero), and
    PEFT puts the step on transformers' model with logits equal to ours for one image."""
    train = rows(tmp_path / "data", "train", 12, seed=1)
    out = tmp_path / "run"
    argv = ["train", "--model-dir", str(checkpoint), "--data", str(train), "--lora-rank", "8"]
    argv += ["--train-vision", "--lr", "1e-2", "--max-steps", "6", "--batch-size", "4"]
    argv += ["--seq-len", "128", "--dtype", "fp32", "--save-every", "6"]
    assert main([*argv, "--output-dir", str(out)]) == 0, capsys.readouterr().err
    assert "vision.fc1,vision.fc2,vision.k_proj" in capsys.readouterr().out
    losses = [r["loss"] for r in read_metrics(out / "metrics.jsonl") if "loss" in r]
    assert len(losses) == 6 and losses[-1] < losses[0] - 0.1, losses

    step = out / "step_6"
    spec = read_adapter_spec(step)
    assert spec.vision == ("fc1", "fc2", "k_proj", "out_proj", "q_proj", "v_proj")
    ours = from_hf(checkpoint, dtype=torch.float32, vision=True)
    apply_lora(ours, spec, dtype=torch.float32)
    load_adapter(ours, step)
    tower_b = [m.lora_b for n, m in lora_modules(ours) if n.startswith("vision_tower.")]
    assert len(tower_b) == 12 and all(b.abs().max() > 0 for b in tower_b)

    inputs, adapted = _peft_on_one_image(step, checkpoint, tmp_path / "data/img/train_0.png")
    with torch.no_grad():
        want = adapted(**inputs).logits
        got = ours.eval()(inputs["input_ids"], images=ImageInputs.from_processor(inputs))
    assert rel(got, want) <= 1e-5


def test_resume_with_tower_adapters_equals_the_straight_run(tmp_path, checkpoint, capsys):
    """--resume from step 2 of a run with adapters on the tower's q/v projections: the step-4
    adapters (the tower's among them) equal the straight run's."""
    from safetensors.torch import load_file

    train = rows(tmp_path / "data", "train", 8, seed=3)
    out = tmp_path / "run"
    argv = ["train", "--model-dir", str(checkpoint), "--data", str(train), "--lora-rank", "4"]
    argv += ["--lora-targets", "q,v,vision.q_proj,vision.v_proj", "--lr", "1e-2"]
    argv += ["--max-steps", "4", "--save-every", "2", "--batch-size", "2", "--seq-len", "128"]
    argv += ["--dtype", "fp32", "--output-dir", str(out)]
    assert main(argv) == 0, capsys.readouterr().err
    straight = load_file(out / "step_4" / "adapter_model.safetensors")
    assert sum(".vision_tower." in k for k in straight) == 2 * 2 * 2  # q, v; 2 layers; A, B
    shutil.rmtree(out / "step_4")  # made again by the resumed run
    assert main([*argv, "--resume", "--resume-from", "2"]) == 0, capsys.readouterr().err
    assert "resuming from step_2" in capsys.readouterr().out
    resumed = load_file(out / "step_4" / "adapter_model.safetensors")
    assert resumed.keys() == straight.keys()
    for k, v in straight.items():
        assert rel(resumed[k], v) <= 1e-5 if v.abs().max() > 0 else torch.equal(resumed[k], v), k


@pytest.mark.parametrize(
    "targets, data, needle",
    [
        ("q,vision.qkv", "images", "vision tower has no linear projection named qkv; it has "),
        ("q,vision.fc1", "text", "vision.\\* targets adapt the vision tower, which a run loads"),
    ],
    ids=["unknown-name", "text-only-data"],
)
def test_bad_tower_targets_one_line_exit_2(tmp_path, checkpoint, capsys, targets, data, needle):
    if data == "images":
        path = rows(tmp_path / "data", "train", 2, seed=4)
    else:
        path = tmp_path / "text.jsonl"
        path.write_text(json.dumps({"text": "a red square " * 8}) + "\n")
    out = tmp_path / "run"
    argv = ["train", "--model-dir", str(checkpoint), "--data", str(path), "--lora-rank", "4"]
    argv += ["--lora-targets", targets, "--max-steps", "1", "--dtype", "fp32"]
    assert main([*argv, "--seq-len", "128", "--output-dir", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("compiletune: error: "), err
    assert re.search(needle, err[0]), err[0]
    assert not out.exists()  # refused before anything is written


def test_a_text_only_train_vision_lora_run_resumes(tmp_path, checkpoint, capsys):
    """--train-vision on text-only data has no tower to adapt: its checkpoint holds decoder
    adapters only, and --resume (the saved config says --train-vision) takes them as they are."""
    data = tmp_path / "chat.jsonl"
    reply = [{"role": "assistant", "content": "a red square " * 4}]
    rows = [{"messages": [{"role": "user", "content": f"hi {i}"}, *reply]} for i in range(16)]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "run"
    argv = ["train", "--model-dir", str(checkpoint), "--data", str(data), "--lora-rank", "4"]
    argv += ["--train-vision", "--batch-size", "2", "--seq-len", "64", "--dtype", "fp32"]
    assert main([*argv, "--max-steps", "2", "--output-dir", str(out)]) == 0
    assert main(["train", "--output-dir", str(out), "--resume", "--max-steps", "3"]) == 0, (
        capsys.readouterr().err
    )
    assert (out / "step_3" / "adapter_model.safetensors").is_file()
