"""The time a trainer waits for an image batch, with and without the data worker
(data/prefetch.py).

    python bench/pixel_worker.py [--batches 12] [--size 448] [--step-ms 0] [--trainer] [--out PATH]

A set of image conversations (two JPEGs of 640x480 each, made here) through the token cache and
`ExampleRows` with a Gemma 3 image processor resizing to --size, served 4 rows a batch (8
images). For each of two steps, a loop takes a batch (`next()`: the wait measured) then "steps":
    sleep  the host idle for --step-ms, as while an accelerator runs an asynchronous step
    cpu    a matmul loop on the main thread for --step-ms (the step's work on this CPU)
once with the pixels prepared when the batch is taken (`prefetch.DEPTH = 0`, as before the
worker) and once with the worker 2 batches ahead. --step-ms 0: the step lasts as long as one
batch's preparation measured first. Prints take_ms (mean wait per batch) and batch_ms (wait +
step) per mode; the first batch (the worker's start) is left out.

--trainer: instead, `compiletune train` itself (LoRA, fp32, CPU) on a small Gemma 3-shaped
vision checkpoint made here (224-pixel tower, text 256 wide x 4 layers), --batches steps of 4
rows (8 images); prints the mean time the trainer waits in `next_batch` and the mean step
(first step left out), with and without the worker.

Writes bench/results/pixel-worker[-trainer]-<device>.json (rows as printed) unless --out says
where.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import transformers
from PIL import Image
from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from common import bench_out, result_header, write_result  # noqa: E402
from image_cases import save_tiny_gemma3_processor  # noqa: E402

from compiletune.data.image_batch import ImagePrep  # noqa: E402
from compiletune.data.prefetch import PixelPrefetch  # noqa: E402
from compiletune.data.rows import Batches  # noqa: E402
from compiletune.data.token_cache import cached_store  # noqa: E402
from compiletune.data.token_store import ExampleRows  # noqa: E402


def make_data(folder: Path, n: int) -> Path:
    rng = np.random.default_rng(0)
    lines = []
    for i in range(n):
        names = [f"img/{i}_{k}.jpg" for k in range(2)]
        for name in names:
            y, x = np.mgrid[0:480, 0:640]
            base = np.stack([(x + 7 * i) % 256, (y + 3 * i) % 256, (x + y) % 256], -1)
            noise = rng.integers(0, 40, base.shape)
            (folder / name).parent.mkdir(parents=True, exist_ok=True)
            Image.fromarray((base + noise).clip(0, 255).astype(np.uint8)).save(
                folder / name, quality=90
            )
        user = [{"type": "image", "image": name} for name in names]
        user.append({"type": "text", "text": "Describe both."})
        reply = [{"type": "text", "text": f"two gradients, number {i}"}]
        messages = [{"role": "user", "content": user}, {"role": "assistant", "content": reply}]
        lines.append(json.dumps({"messages": messages}))
    path = folder / "train.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def stream(source: Path, processor, cache: Path, worker: bool):
    store = cached_store(
        str(source),
        processor.tokenizer,
        processor=processor,
        workers=0,
        cache_dir=str(cache),
        say=lambda line: None,
    )
    rows = ExampleRows(store, 256, images=ImagePrep(processor))
    batches = Batches(rows, 4, seed=0)
    return PixelPrefetch(batches, [rows], depth=2) if worker else batches


def cpu_work(seconds: float) -> None:
    a = torch.randn(256, 256)
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        a = torch.tanh(a @ a * 1e-3)


def run(source, processor, cache, worker: bool, kind: str, step_s: float, n: int):
    s = stream(source, processor, cache, worker)
    takes, totals = [], []
    try:
        for i in range(n + 1):
            t0 = time.perf_counter()
            s.next()
            t1 = time.perf_counter()
            if kind == "sleep":
                time.sleep(step_s)
            else:
                cpu_work(step_s)
            if i:  # the first: the worker's start, nothing ahead yet
                takes.append(t1 - t0)
                totals.append(time.perf_counter() - t0)
    finally:
        if worker:
            s.close()
    return 1e3 * float(np.mean(takes)), 1e3 * float(np.mean(totals))


def trainer_wait(tmp: Path, source: Path, steps: int) -> list[dict]:
    from compiletune.cli import main as cli
    from compiletune.data import prefetch
    from compiletune.train import strategy

    folder = tmp / "ckpt"
    vision = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4)
    vision |= dict(image_size=224, patch_size=14, vision_use_head=False)
    text = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=4, head_dim=64)
    text |= dict(num_attention_heads=4, num_key_value_heads=2, vocab_size=300)
    config = transformers.Gemma3Config(
        text_config=text,
        vision_config=vision,
        mm_tokens_per_image=16,
        image_token_index=261,
        boi_token_index=259,
        eoi_token_index=298,
    )
    torch.manual_seed(0)
    transformers.Gemma3ForConditionalGeneration(config).save_pretrained(folder)
    save_tiny_gemma3_processor(folder)
    processor = transformers.AutoProcessor.from_pretrained(folder)
    processor.image_processor = Gemma3ImageProcessorPil(size={"height": 224, "width": 224})
    processor.save_pretrained(folder)
    taken = strategy.next_batch
    print("| worker | wait_ms | step_ms |\n|---|---|---|")
    rows = []
    for depth in (0, 2):
        waits, starts = [], []

        def timed(run, waits=waits, starts=starts):
            starts.append(time.perf_counter())
            batch = taken(run)
            waits.append(time.perf_counter() - starts[-1])
            return batch

        prefetch.DEPTH, strategy.next_batch = depth, timed
        argv = ["train", "--model-dir", str(folder), "--data", str(source), "--lora-rank", "8"]
        argv += ["--max-steps", str(steps + 1), "--batch-size", "4", "--seq-len", "256"]
        argv += ["--dtype", "fp32", "--no-save", "--output-dir", str(tmp / f"run{depth}")]
        argv += ["--cache-dir", str(tmp / "cache")]  # this folder's images, not a past run's
        assert cli(argv) == 0
        wait = 1e3 * float(np.mean(waits[1:]))
        step = 1e3 * float(np.mean(np.diff(starts[1:])))
        print(f"| {'yes' if depth else 'no'} | {wait:.1f} | {step:.1f} |")
        rows.append({"worker": bool(depth), "wait_ms": wait, "step_ms": step})
    strategy.next_batch = taken
    return rows


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--batches", type=int, default=12)
    p.add_argument("--size", type=int, default=448)
    p.add_argument("--step-ms", type=float, default=0.0)
    p.add_argument("--trainer", action="store_true")
    p.add_argument("--out", default=None)
    a = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        source = make_data(tmp / "data", 16)
        if a.trainer:
            rows = trainer_wait(tmp, source, a.batches)
            out = bench_out("pixel-worker-trainer", a.out)
            write_result(out, {**result_header(), "steps": a.batches, "rows": rows})
            return
        torch.set_num_threads(1)  # the synthetic CPU step on one core, the worker on another
        save_tiny_gemma3_processor(tmp / "proc")
        processor = transformers.AutoProcessor.from_pretrained(tmp / "proc")
        processor.image_processor = Gemma3ImageProcessorPil(
            size={"height": a.size, "width": a.size}
        )
        prep_ms, _ = run(source, processor, tmp / "cache", False, "sleep", 0.0, a.batches)
        step_s = (a.step_ms or prep_ms) / 1e3
        print(f"one batch's pixels (8 images 640x480 -> {a.size}): {prep_ms:.1f} ms")
        print(f"step {1e3 * step_s:.1f} ms; mean over {a.batches} batches\n")
        print("| step | worker | take_ms | batch_ms |\n|---|---|---|---|")
        rows = []
        for kind in ("sleep", "cpu"):
            for worker in (False, True):
                take, total = run(source, processor, tmp / "cache", worker, kind, step_s, a.batches)
                print(f"| {kind} | {'yes' if worker else 'no'} | {take:.1f} | {total:.1f} |")
                rows.append({"step": kind, "worker": worker, "take_ms": take, "batch_ms": total})
        head = {"size": a.size, "batches": a.batches, "prep_ms": prep_ms, "step_ms": 1e3 * step_s}
        write_result(bench_out("pixel-worker", a.out), {**result_header(), **head, "rows": rows})


if __name__ == "__main__":
    main()
