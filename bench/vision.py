"""One image-text training step of a vision-language model: compiletune's against transformers'.

    python bench/vision.py [--iters 3] [--out PATH]

For a small Gemma 3-shaped and a small Qwen3.5-shaped vision-language model (built here from
transformers' config classes, random weights, saved to a temporary folder that compiletune loads
with `from_hf(..., vision=True, train_vision=True)`), one step on CPU in fp32: forward with the
images, next-token cross entropy over the row, backward; every parameter trainable (tower
included), the same batch for both. Reported per model:
    step_ms        median wall time of the step (after one warm-up), ours and transformers'
    peak_gib       what the step allocates above the live weights (torch.profiler's CPU
                   allocator events, common.peak_bytes), ours and transformers'
    estimate_gib   `compiletune estimate-memory`'s figure for the run (--model-dir the folder,
                   full fine-tune, --train-vision, AdamW, the batch's rows and length)
    real_gib       that run's step for real: weights + what forward, backward and an AdamW step
                   allocate above them, on our image-text step
    estimate_text_gib  the same estimate without --data: the text model alone (nothing says
                   the run has images)
The estimate is given --data, a file of rows with one image part each (no pixels read): it
builds the tower and, for Gemma 3, steps fake images of the config's size; for Qwen3.5 it
counts the tower without its activations (docs/estimate-memory.md, "Image runs").
Writes bench/results/vision-<device>.json and prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import transformers  # noqa: E402
from common import bench_out, median_ms, peak_bytes, result_header, write_result  # noqa: E402

from compiletune.config import resolve  # noqa: E402
from compiletune.estimate import estimator  # noqa: E402
from compiletune.models import from_hf  # noqa: E402
from compiletune.models.vision.inputs import ImageInputs  # noqa: E402

ROWS, SEQ, VOCAB, IMAGE_TOKEN = 2, 256, 4096, 4000
TEXT = dict(
    hidden_size=256,
    intermediate_size=1024,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=1,
    head_dim=64,
    vocab_size=VOCAB,
)


def gemma3() -> tuple[Any, dict[str, Any], int]:
    """Gemma 3-shaped: SigLIP 224 px / 14 px patches, 4 blocks of 192, 64 tokens per image."""
    vision = dict(
        hidden_size=192,
        intermediate_size=768,
        num_hidden_layers=4,
        num_attention_heads=3,
        image_size=224,
        patch_size=14,
        vision_use_head=False,
    )
    config = transformers.Gemma3Config(
        text_config=TEXT,
        vision_config=vision,
        mm_tokens_per_image=64,
        image_token_index=IMAGE_TOKEN,
        boi_token_index=IMAGE_TOKEN + 1,
        eoi_token_index=IMAGE_TOKEN + 2,
    )
    config.architectures = ["Gemma3ForConditionalGeneration"]
    pixels = torch.randn(ROWS, 3, 224, 224)
    return config, {"pixel_values": pixels}, 64


def qwen35() -> tuple[Any, dict[str, Any], int]:
    """Qwen3.5-shaped: 16 px patches (x2 frames), a 16x16 grid merged 2x2 into 64 tokens per
    image, 4 blocks of 192; the decoder 3 linear-attention layers and 1 full."""
    vision = dict(
        hidden_size=192,
        intermediate_size=768,
        depth=4,
        num_heads=3,
        patch_size=16,
        temporal_patch_size=2,
        spatial_merge_size=2,
        out_hidden_size=TEXT["hidden_size"],
        num_position_embeddings=256,
    )
    text = dict(
        TEXT,
        layer_types=["linear_attention"] * 3 + ["full_attention"],
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 10000.0,
            "partial_rotary_factor": 0.5,
            "mrope_section": [11, 11, 10],
            "mrope_interleaved": True,
        },
    )
    config = transformers.Qwen3_5Config(
        text_config=text, vision_config=vision, image_token_id=IMAGE_TOKEN
    )
    config.architectures = ["Qwen3_5ForConditionalGeneration"]
    patches = 16 * 16
    pixels = torch.randn(ROWS * patches, 3 * 2 * 16 * 16)
    grid = torch.tensor([[1, 16, 16]] * ROWS)
    return config, {"pixel_values": pixels, "image_grid_thw": grid}, 64


MODELS = {"gemma3": gemma3, "qwen3_5": qwen35}


def tokens(per_image: int) -> torch.Tensor:
    """ROWS rows of SEQ ids: text, one image's tokens at position 8, text."""
    ids = torch.randint(0, 3000, (ROWS, SEQ), generator=torch.Generator().manual_seed(0))
    ids[:, 8 : 8 + per_image] = IMAGE_TOKEN
    return ids


def loss_of(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten())


def measure(name: str, iters: int, folder: Path) -> dict[str, Any]:
    config, image_kw, per_image = MODELS[name]()
    torch.manual_seed(0)
    hf = transformers.AutoModelForImageTextToText.from_config(config).float()
    with torch.no_grad():  # transformers zero-initialises some tower weights
        for p in hf.parameters():
            p.normal_(0, 0.02)
    hf.save_pretrained(folder)
    ours = from_hf(folder, dtype=torch.float32, vision=True, train_vision=True)
    hf.train(), ours.train()
    ids = tokens(per_image)
    types = (ids == IMAGE_TOKEN).long()  # which tokens are an image's, as the processor says
    extra = {"token_type_ids" if name == "gemma3" else "mm_token_type_ids": types}
    images = ImageInputs(image_kw["pixel_values"], image_kw.get("image_grid_thw"))

    def step_ours() -> None:
        loss_of(ours(ids, images=images), ids).backward()
        ours.zero_grad(set_to_none=True)

    def step_hf() -> None:
        loss_of(hf(input_ids=ids, **image_kw, **extra).logits, ids).backward()
        hf.zero_grad(set_to_none=True)

    with torch.no_grad():  # the same model: the same loss before timing anything
        a = loss_of(ours(ids, images=images), ids).item()
        b = loss_of(hf(input_ids=ids, **image_kw, **extra).logits, ids).item()
    row: dict[str, Any] = {"model": name, "loss_ours": a, "loss_hf": b}
    row["params_m"] = sum(p.numel() for p in ours.parameters()) / 1e6
    row["step_ms"] = {"ours": median_ms(step_ours, torch.device("cpu"), iters)}
    row["step_ms"]["hf"] = median_ms(step_hf, torch.device("cpu"), iters)
    row["peak_gib"] = {
        "ours": peak_bytes(step_ours, torch.device("cpu")) / 2**30,
        "hf": peak_bytes(step_hf, torch.device("cpu")) / 2**30,
    }
    hf.zero_grad(set_to_none=True)  # (its weights stay until the function returns)

    params = [p for p in ours.parameters() if p.requires_grad]
    weights = sum(p.numel() * p.element_size() for p in ours.parameters())

    def train_step() -> None:
        optimizer = torch.optim.AdamW(params, lr=1e-5)
        loss_of(ours(ids, images=images), ids).backward()
        optimizer.step()
        ours.zero_grad(set_to_none=True)
        del optimizer

    real = weights + peak_bytes(train_step, torch.device("cpu"))
    flags = {"model_dir": str(folder), "seq_len": SEQ, "batch_size": ROWS, "dtype": "fp32"}
    flags.update(train_vision=True, loss="plain")
    text = estimator.estimate_memory(resolve({}, flags), 1, round_bytes=1)
    flags["data"] = str(image_rows(folder / "rows.jsonl"))
    est = estimator.estimate_memory(resolve({}, flags), 1, round_bytes=1)
    row.update(estimate_gib=est.peak_bytes / 2**30, real_gib=real / 2**30)
    row["estimate_text_gib"] = text.peak_bytes / 2**30
    row["estimate_error"] = est.peak_bytes / real - 1
    return row


def image_rows(path: Path) -> Path:
    """A --data file of ROWS conversations with one image part each (the estimate reads no
    pixels: the file it names need not exist)."""
    user = [{"type": "image", "image": "a.png"}, {"type": "text", "text": "What is it?"}]
    reply = [{"type": "text", "text": "a square"}]
    row = {"messages": [{"role": "user", "content": user}, {"role": "assistant", "content": reply}]}
    path.write_text((json.dumps(row) + "\n") * ROWS)
    return path


def table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| model | params (M) | step ms ours / hf | peak GiB ours / hf | estimate GiB / real GiB |",
        "| --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        s, p = r["step_ms"], r["peak_gib"]
        lines.append(
            f"| {r['model']} | {r['params_m']:.1f} | {s['ours']:.0f} / {s['hf']:.0f} | "
            f"{p['ours']:.3f} / {p['hf']:.3f} | {r['estimate_gib']:.3f} / {r['real_gib']:.3f} "
            f"({r['estimate_error']:+.0%}) |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--iters", type=int, default=3)
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--out", default=None)
    a = parser.parse_args()
    torch.set_default_dtype(torch.float32)
    rows = []
    for name in a.models.split(","):
        with tempfile.TemporaryDirectory(prefix=f"vision-{name}-") as tmp:
            rows.append(measure(name, a.iters, Path(tmp)))
        print(rows[-1], flush=True)
    write_result(bench_out("vision", a.out), {**result_header(), "rows": rows, "seq": SEQ})
    print(table(rows))


if __name__ == "__main__":
    main()
