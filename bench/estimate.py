"""How accurate `compiletune estimate-memory` is, and how fast.

    python bench/estimate.py [--model llama3_150m] [--n-layers 4] [--seq-len 512] [--speed]

For each configuration the same training step runs three ways:
    estimate   fake tensors, no memory (what `estimate-memory` reports; no allocator rounding)
    cpu        for real on CPU tensors: the peak of the CPU allocator's events (torch.profiler),
               from before the model is materialised to after the optimizer step
    gpu        (only when a GPU is present) for real on the GPU: max_memory_allocated; compared
               with the estimate under the GPU allocator's 512-byte rounding
FSDP rows run 2 ranks: gloo processes on CPU against a fake world of 2 (GPU rows: n/a).
`--speed` times `compiletune estimate-memory` on llama3_1_8b (8 GPUs, seq 8192) and
llama3_1_70b (8 GPUs, seq 8192) in fresh processes.
Writes bench/results/estimate-<device>.json and prints a markdown table.
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
from common import bench_out, result_header, write_result  # noqa: E402

from compiletune.config import resolve  # noqa: E402
from compiletune.distributed import close_group  # noqa: E402
from compiletune.estimate import estimator as estimate  # noqa: E402

CONFIGS: dict[str, dict[str, Any]] = {
    "plain loss": {"loss": "plain"},
    "plain loss, ac full": {"loss": "plain", "ac": "full"},
    "fused loss": {"loss": "fused"},
    "fused, ac selective": {"loss": "fused", "ac": "selective"},
    "fused, adamw8bit": {"loss": "fused", "optimizer": "adamw8bit"},
    "fused, in-backward": {"loss": "fused", "optimizer_in_backward": True},
    "fused, LoRA r16": {"loss": "fused", "lora_rank": 16},
    "fused, QLoRA r16": {"loss": "fused", "lora_rank": 16, "quantize_base": "nf4"},
    # --objective: random pair rows; the frozen reference counted (none with LoRA)
    "fused, DPO": {"loss": "fused", "objective": "dpo"},
    "fused, DPO, LoRA r16": {"loss": "fused", "objective": "dpo", "lora_rank": 16},
    "fused, FSDP 2 ranks": {"loss": "fused", "fsdp": True, "_world": 2},
    "plain, ac full, FSDP 2 ranks": {"loss": "plain", "ac": "full", "fsdp": True, "_world": 2},
}


def _gloo_rank(rank: int, port: int, flags: dict, queue: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        peak = estimate.measure_cpu_step(resolve({}, flags), 2)
        if rank == 0:
            queue.put(peak)
        dist.barrier()  # no collective in flight when the group is closed
    finally:
        close_group()


def _gloo_peak(flags: dict) -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    queue = mp.get_context("spawn").SimpleQueue()
    mp.start_processes(_gloo_rank, args=(port, flags, queue), nprocs=2, start_method="spawn")
    return queue.get()


def _speed(model: str) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "compiletune", "estimate-memory", "--model", model]
    cmd += ["--gpus", "8", "--seq-len", "8192", "--batch-size", "1", "--json"]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, check=True)
    import json

    out = json.loads(proc.stdout)
    return {
        "command": "compiletune " + " ".join(cmd[3:]),
        "wall_s": round(time.perf_counter() - t0, 1),
        "estimate_s": out["seconds"],
        "peak_gib": out["peak_gib"],
    }


def _measure(flags: dict, world: int | None, gpu: bool, gpu_only: bool) -> dict[str, Any]:
    """One configuration: the estimate, and the real step on CPU (unless gpu_only) and GPU."""
    cfg = resolve({}, flags)
    est = estimate.estimate_memory(cfg, world or 1, round_bytes=1)
    row: dict[str, Any] = {
        "estimate_gib": est.peak_bytes / 2**30,
        "parts_gib": {k: v / 2**30 for k, v in est.parts.items()},
        "estimate_s": est.seconds,
    }
    if not gpu_only:
        real = _gloo_peak(flags) if world else estimate.measure_cpu_step(cfg)
        row.update(cpu_gib=real / 2**30, cpu_error=est.peak_bytes / real - 1)
    if gpu and not world:
        gcfg = resolve({}, {**flags, "dtype": "bf16"})
        gest = estimate.estimate_memory(gcfg, 1)
        greal = estimate.measure_cuda_step(gcfg)
        row.update(
            gpu_estimate_gib=gest.peak_bytes / 2**30,
            gpu_gib=greal / 2**30,
            gpu_error=gest.peak_bytes / greal - 1,
        )
    return row


def _row_text(row: dict[str, Any]) -> str:
    if "error" in row:
        return row["error"]
    text = f"estimate {row['estimate_gib']:.3f} GiB"
    if "cpu_gib" in row:
        text += f", cpu {row['cpu_gib']:.3f} GiB ({row['cpu_error']:+.1%})"
    if "gpu_gib" in row:
        text += f", gpu {row['gpu_estimate_gib']:.3f} / {row['gpu_gib']:.3f} GiB"
        text += f" ({row['gpu_error']:+.1%})"
    return text


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama3_150m")
    ap.add_argument("--n-layers", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--batch-size", type=int, default=2)
    ap.add_argument("--dtype", default="fp32", help="CPU rows (a GPU run uses bf16)")
    ap.add_argument("--only", nargs="*", help="configuration names to run")
    ap.add_argument("--speed", action="store_true", help="also time the 8B and 70B estimates")
    ap.add_argument(
        "--gpu-only", action="store_true", help="skip the CPU rows (the GPU check's fast run)"
    )
    ap.add_argument("--out", default=None)
    ns = ap.parse_args()

    base = {"model": ns.model, "n_layers": ns.n_layers, "seq_len": ns.seq_len}
    base["batch_size"] = ns.batch_size
    gpu = torch.cuda.is_available()
    rows = []
    for name, flags in CONFIGS.items():
        if ns.only and name not in ns.only:
            continue
        flags = dict(flags)
        world = flags.pop("_world", None)
        if world and ns.gpu_only:
            continue  # FSDP rows measure on CPU ranks only
        cpu_flags = {**base, **flags, "dtype": ns.dtype}
        row: dict[str, Any] = {"config": name, "flags": cpu_flags, "gpus": world or 1}
        try:
            row.update(_measure(cpu_flags, world, gpu, ns.gpu_only))
        except Exception as exc:  # a row that fails is recorded, the others still run
            row["error"] = f"{type(exc).__name__}: {exc}"
        rows.append(row)
        print(f"{name}: {_row_text(row)}", flush=True)
    speed = [_speed(m) for m in ("llama3_1_8b", "llama3_1_70b")] if ns.speed else []
    result = {
        **result_header(),
        "bench": "estimate",
        "args": vars(ns),
        "method": "estimate: fake tensors + storage tracker; cpu: torch.profiler CPU allocator "
        "events over the real step; gpu: torch.cuda.max_memory_allocated over the real step",
        "target": "|error| <= 10%",
        "rows": rows,
        "speed": speed,
    }
    path = bench_out("estimate", ns.out)
    write_result(path, result)
    print(
        "\n| configuration | ranks | estimate GiB | CPU measured GiB | error | GPU est / measured |"
    )
    print("|---|---:|---:|---:|---:|---|")
    for r in rows:
        if "error" in r:
            print(f"| {r['config']} | {r['gpus']} | {r['error']} | | | |")
            continue
        g = (
            f"{r['gpu_estimate_gib']:.3f} / {r['gpu_gib']:.3f} ({r['gpu_error']:+.1%})"
            if "gpu_gib" in r
            else "n/a"
        )
        cpu = f"{r['cpu_gib']:.3f} | {r['cpu_error']:+.1%}" if "cpu_gib" in r else "skipped | "
        print(f"| {r['config']} | {r['gpus']} | {r['estimate_gib']:.3f} | {cpu} | {g} |")
    for s in speed:
        print(f"`{s['command']}`: {s['wall_s']} s wall ({s['estimate_s']} s estimating)")
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
