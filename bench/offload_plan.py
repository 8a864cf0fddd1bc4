"""Offload only what a memory target needs: `--offload-activations auto` on a real target, its
step time beside the copy time the host link implies.

    python bench/offload_plan.py                           # GPU: llama3_2_1b, seq 2048 x 4, 16 GiB
    python bench/offload_plan.py --device-memory 24 --model llama3_1_8b --batch-size 1
    python bench/offload_plan.py --model debug --n-layers 2 --seq-len 64 --steps 2 \\
        --dtype fp32 --compile-backend aot_eager --device-memory 3   # CPU: the plumbing

One row, three measurements, in this process and two `compiletune train` processes:

1. the host link: pinned host <-> device copies of 256 MiB, each way, timed with CUDA events
   (the median of 5), as offload_to_host / reload_from_host copy (compiletune/ops/host_copy.py);
2. the baseline: the flags below, no offload, on the whole GPU (the step that does not fit the
   target);
3. the plan: the same flags with `--offload-activations auto` in a process held to
   `--device-memory` GiB (torch.cuda.set_per_process_memory_fraction), so the trainer's planner
   picks the fewest blocks that fit that share (the run's config.yaml holds the N it chose), with
   `--dump-graphs` for what each compiled block really offloads.

The row: N of L blocks, both steady-state step times and their ratio, the bytes offloaded per
step (N x the block graph's offloaded bytes x micro-batches) and the copy time they imply at the
measured bandwidth (device-to-host out, host-to-device back), beside the step time it hides in,
and the peaks measured against the estimate. On a CPU there is no link and nothing to offload
(the trainer ignores the flag): the row checks the plumbing, its copy figures are None.

Flags: --compile with 8-bit AdamW stepping in backward and no activation checkpointing, the
memory offload replaces (the ladder's "+ 8-bit AdamW" rung without its selective AC): at seq
2048 x 4 the 1B step needs ~20 GiB, ~6 GiB with every block offloaded (the estimate), so 16 GiB
is a target some blocks must offload for.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # noqa: E402
    bench_out,
    device_name,
    result_header,
    run_train,
    steady_state,
    work_dir,
    write_result,
)

FLAGS = ["--compile", "--optimizer-in-backward", "--max-grad-norm", "0", "--optimizer", "adamw8bit"]
COPY_BYTES = 256 * 2**20


def link_gib_per_s(size: int = COPY_BYTES, iters: int = 5) -> dict[str, float] | None:
    """Pinned host <-> device bandwidth in GiB/s each way (None without CUDA)."""
    if not torch.cuda.is_available():
        return None
    host = torch.empty(size, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(size, dtype=torch.uint8, device="cuda")
    out: dict[str, float] = {}
    for name, dst, src in (("d2h", host, dev), ("h2d", dev, host)):
        times = []
        for _ in range(iters + 1):  # the first warms up
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            dst.copy_(src, non_blocking=True)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        out[f"{name}_gib_per_s"] = size / 2**30 / statistics.median(times[1:])
    return out


def _row(s: dict[str, Any]) -> dict[str, Any]:
    if "error" in s:
        return s
    row = steady_state(s["step_times"], s["tokens_per_step"])
    row["peak_mem_gib"] = s["step_peak_mem_gib"]
    if s.get("estimate_peak_gib") is not None:
        row["estimate_peak_gib"] = s["estimate_peak_gib"]
    return row


def offloaded_bytes_per_block(graphs: Path) -> int:
    """What one offloading block's compiled graph moves to the host (the pass's own count)."""
    path = graphs / "summary.json"
    if not path.exists():  # nothing compiled with the pass (a CPU run, or N = 0)
        return 0
    summary = json.loads(path.read_text())
    return int(summary.get("block", {}).get("offloaded_bytes", 0))


def planned_blocks(work: Path) -> Any:
    """The N the last run's planner chose: its config.yaml (written after the plan) holds it."""
    newest = max(work.glob("run*/config.yaml"), key=lambda path: path.stat().st_mtime)
    return yaml.safe_load(newest.read_text())["offload_activations"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="llama3_2_1b")
    p.add_argument("--n-layers", type=int, default=None)
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--dtype", default="bf16")
    p.add_argument("--device-memory", type=float, default=16.0, metavar="GIB")
    p.add_argument("--compile-backend", default=None)
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    work = work_dir("offload-plan-")
    cache = tempfile.mkdtemp(prefix="inductor-cache-", dir=work)
    common = ["--model", a.model, "--seq-len", str(a.seq_len), "--batch-size", str(a.batch_size)]
    common += ["--max-steps", str(a.steps), "--dtype", a.dtype, *FLAGS, "--no-save"]
    if a.n_layers:
        common += ["--n-layers", str(a.n_layers)]
    if a.compile_backend:
        common += ["--compile-backend", a.compile_backend]
    path = bench_out("offload-plan", a.out)
    result: dict[str, Any] = {
        **result_header(),
        "bench": "offload-plan",
        "argv": sys.argv[1:] if argv is None else argv,
        "flags": FLAGS,
        "device_memory_gib": a.device_memory,
        "link": link_gib_per_s(),
    }
    write_result(path, result)
    print("host link:", result["link"], flush=True)
    base = run_train(common, cache, work, allow_failure=True, doc_mask=True)
    result["baseline"] = _row(base)
    write_result(path, result)
    print("baseline:", result["baseline"], flush=True)
    graphs = work / "graphs"
    planned = common + ["--offload-activations", "auto", "--dump-graphs", str(graphs)]
    run = run_train(planned, cache, work, True, doc_mask=True, memory_cap_gib=a.device_memory)
    row = _row(run)
    if "error" not in run:
        n = planned_blocks(work)
        row["blocks"] = None if n == "auto" else int(n)  # auto left as is: no GPU to plan for
        per_block = offloaded_bytes_per_block(graphs)
        moved = per_block * (row["blocks"] or 0)  # one micro-batch a step (no --grad-accum)
        row["offloaded_bytes_per_step"] = moved
        link = result["link"]
        if link is not None and moved:
            out_s = moved / 2**30 / link["d2h_gib_per_s"]
            back_s = moved / 2**30 / link["h2d_gib_per_s"]
            row["copy_s"] = out_s + back_s  # the link's time for the step's copies, both ways
            row["copy_vs_step"] = row["copy_s"] / row["steady_step_s"]
        if "steady_step_s" in result["baseline"]:
            row["speed_vs_baseline"] = result["baseline"]["steady_step_s"] / row["steady_step_s"]
    result["planned"] = row
    result["device"] = device_name()
    write_result(path, result)
    print("planned:", {k: v for k, v in row.items() if k != "step_times"}, flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
