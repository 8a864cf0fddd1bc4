"""What every bench result carries: device, torch version, git commit; and how it is written."""

from __future__ import annotations

import atexit
import json
import os
import platform
import re
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch


def device_name() -> str:
    """'cpu' or a GPU's short name, e.g. 'h100' / 'h200' (used in result file names)."""
    if not torch.cuda.is_available():
        return "cpu"
    name = torch.cuda.get_device_name().lower()
    for short in ("h200", "h100", "a100", "l40s", "a10g", "4090"):
        if short in name:
            return short
    return name.replace(" ", "-")


COMMIT_ENV = "BENCH_COMMIT"


def git_commit() -> str:
    """The commit measured: $BENCH_COMMIT when set (the device tool's copy of the tree carries
    a stale .git, so the GPU call names its commit), else git's HEAD."""
    if os.environ.get(COMMIT_ENV):
        return os.environ[COMMIT_ENV]
    try:
        return subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            cwd=Path(__file__).parent,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def result_header() -> dict[str, Any]:
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else platform.processor()
    return {
        "device": device_name(),
        "device_detail": device or platform.machine(),
        "cpu_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "commit": git_commit(),
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        # What the `compiletune` command runs with unless the environment says otherwise
        # (compiletune.cli.huge_page_tensors), and whether the kernel grants huge pages.
        "thp_mem_alloc_enable": os.environ.get("THP_MEM_ALLOC_ENABLE", "1 (CLI default)"),
        "kernel_thp": _kernel_thp_mode(),
    }


def _kernel_thp_mode() -> str | None:
    """The selected transparent-huge-page mode ("always", "madvise", "never"), None off Linux."""
    path = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if not path.exists():
        return None
    text = path.read_text()
    return text[text.find("[") + 1 : text.find("]")] if "[" in text else text.strip()


def write_result(path: Path, result: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")


KEEP_ENV = "COMPILETUNE_BENCH_KEEP"
# A plumbing check (bench/gpu_check.py --dry-run) has every run share one Inductor cache: its
# runs test that each step works, not compile times, which a fresh cache per bench measures.
SHARED_CACHE_ENV = "COMPILETUNE_BENCH_SHARED_INDUCTOR_CACHE"


def work_dir(prefix: str) -> Path:
    """A fresh scratch directory for a bench's runs (their outputs, checkpoints and Inductor
    caches: tens of GB over a whole bench), removed when the bench's process exits normally or
    by an uncaught exception (not when it is killed), unless $COMPILETUNE_BENCH_KEEP=1 (then its
    path is printed to stderr)."""
    work = Path(tempfile.mkdtemp(prefix=prefix))
    if os.environ.get(KEEP_ENV) == "1":
        print(f"{KEEP_ENV}=1: keeping the bench's runs in {work}", file=sys.stderr)
    else:
        atexit.register(shutil.rmtree, work, ignore_errors=True)
    return work


# `compiletune train` with the caching allocator capped at GIB of the GPU (a 24 GB card's budget
# on a larger one: a peak over it fails as out of memory); no cap without CUDA.
_CAPPED = (
    "import runpy, torch\n"
    "if torch.cuda.is_available():\n"
    "    total = torch.cuda.get_device_properties(0).total_memory\n"
    "    torch.cuda.set_per_process_memory_fraction(min(1.0, GIB * 2**30 / total))\n"
    "runpy.run_module('compiletune', run_name='__main__', alter_sys=True)\n"
)


def run_train(
    args: list[str],
    cache_dir: str,
    workdir: Path,
    allow_failure: bool = False,
    remove_output: bool = False,
    processes: int = 0,
    doc_mask: bool = False,
    memory_cap_gib: float | None = None,
) -> dict[str, Any]:
    """One `compiletune train` process with its own Inductor cache folder; returns the run's
    summary.json plus `step_times`, `tokens_per_step`, `step_peak_mem_gib` (the peak after
    the last step, before the final checkpoint is written) and `first_step_peak_mem_gib` (after
    the first: when the two are equal, the peak came in the first step, which compiles) from
    its metrics.jsonl.

    A failed run exits the bench, or with `allow_failure` returns `{"error": ...}` naming it
    ("out of memory" or the last line of its stderr) so a bench can record it and go on.
    `remove_output` deletes the run folder once read: the final checkpoint of a large model
    (weights and optimizer state) would otherwise fill the disk over a bench's runs.
    `processes` > 0 launches that many ranks with torchrun (add --fsdp to `args`).
    `doc_mask`: keep the trainer's default document masking; off (plain causal attention over
    the packed rows), the benches measure what their committed baselines measured before
    document masking became the default, and what transformers trains in bench/peers.py.
    `memory_cap_gib`: one process under torch.cuda.set_per_process_memory_fraction of that.
    The summary's `wall_s` is the whole process (imports, set-up, steps) and `setup_s` that
    less its steps (the first step, which compiles, counts as a step).
    """
    out = workdir / f"run{len(list(workdir.iterdir()))}"
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": os.environ.get(SHARED_CACHE_ENV) or cache_dir}
    launch = [sys.executable, "-m", "compiletune"]
    if memory_cap_gib is not None and not processes:  # the snippet runs compiletune itself
        launch = [sys.executable, "-c", _CAPPED.replace("GIB", repr(float(memory_cap_gib)))]
    if processes:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        launch = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={processes}"]
        launch += [f"--master-port={port}", "-m", "compiletune"]
    mask = [] if doc_mask else ["--no-doc-mask"]
    cmd = [*launch, "train", *args, *mask, "--output-dir", str(out)]
    started = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - started
    if proc.returncode != 0:
        if not allow_failure:
            raise SystemExit(f"bench run failed: {' '.join(cmd)}\n{proc.stderr[-3000:]}")
        return {"error": failure_reason(proc.stderr), "returncode": proc.returncode}
    summary = json.loads((out / "summary.json").read_text())
    steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    summary["step_times"] = [r["step_time_s"] for r in steps]
    summary["tokens_per_step"] = steps[0]["tokens"]
    summary["step_peak_mem_gib"] = steps[-1]["peak_mem_gib"]
    summary["first_step_peak_mem_gib"] = steps[0]["peak_mem_gib"]
    summary["wall_s"] = wall
    summary["setup_s"] = wall - sum(summary["step_times"])
    if remove_output:
        shutil.rmtree(out)
    return summary


def failure_reason(stderr: str) -> str:
    """One line saying why a bench subprocess failed: 'out of memory' or its last stderr line."""
    if "OutOfMemoryError" in stderr or "out of memory" in stderr.lower():
        return "out of memory"
    lines = [line for line in stderr.splitlines() if line.strip()]
    return lines[-1][-300:] if lines else "failed without output"


def steady_state(step_times: list[float], tokens_per_step: int) -> dict[str, Any]:
    """Steady-state speed of a run: the median of the steps after the first (which compiles and
    warms the allocator). `step_spread` is (slowest - fastest) / median over those steps: the
    run's own noise, which `bench/regress.py` uses as its tolerance. `best_tokens_per_s` is
    the fastest of those steps: on a machine shared with other work, the least disturbed."""
    steady = step_times[1:] or step_times
    median = statistics.median(steady)
    return {
        "tokens_per_s": tokens_per_step / median,
        "best_tokens_per_s": tokens_per_step / min(steady),
        "steady_step_s": median,
        "step_spread": (max(steady) - min(steady)) / median,
        "step_times": step_times,
    }


def ratio_cell(row: dict[str, Any], key: str) -> str:
    """A ratio of a row as a markdown table cell ("0.84x"), empty where the row has none."""
    return f"{row[key]:.2f}x" if key in row else ""


def best_of_repeats(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """One configuration run several times (`--repeats`, the runs of all configurations taken in
    turn) -> one row: the repeat with the highest steady-state tokens/s, since work from outside
    only ever slows a run, with peak memory the median over the repeats (RSS moves by a few
    tenths of a GiB between identical runs). Every repeat's tokens/s and peak stay in the row."""
    ran = [r for r in rows if "tokens_per_s" in r]
    if not ran:
        return rows[0]
    best = dict(max(ran, key=lambda r: r["tokens_per_s"]))
    if len(rows) > 1:
        best["repeat_tokens_per_s"] = [r.get("tokens_per_s") for r in rows]
        best["repeat_peak_mem_gib"] = [r.get("peak_mem_gib") for r in rows]
        best["peak_mem_gib"] = statistics.median(r["peak_mem_gib"] for r in ran)
    return best


def train_flags() -> set[str]:
    """The long options `compiletune train --help` lists (benches skip what is not there yet)."""
    cmd = [sys.executable, "-m", "compiletune", "train", "--help"]
    text = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    return set(re.findall(r"(--[a-z][a-z0-9-]*)", text))


# Dense bf16 peak of one GPU, for model FLOPs utilisation (the vendors' datasheet numbers).
PEAK_BF16_FLOPS = {"h100": 989e12, "h200": 989e12, "a100": 312e12, "l40s": 362e12}


def model_flops_per_token(args: Any, seq_len: int) -> float:
    """Training FLOPs per token of a decoder (forward + backward), torchtitan's convention:
    6 * (parameters that multiply: all but the embedding lookup) + 12 * layers * heads *
    head_dim * seq_len for attention scores and values (causal masking not discounted)."""
    from compiletune.models import num_params

    matmul_params = num_params(args) - (0 if args.tie_embeddings else args.vocab_size * args.dim)
    attention = 12 * args.n_layers * args.n_heads * args.hd * seq_len
    return 6 * matmul_params + attention


def mfu(tokens_per_s: float, flops_per_token: float) -> float | None:
    """Model FLOPs utilisation against this GPU's bf16 peak; None on CPU or an unknown GPU."""
    peak = PEAK_BF16_FLOPS.get(device_name())
    return tokens_per_s * flops_per_token / peak if peak else None


def bench_out(bench: str, out: str | None) -> Path:
    """Where a bench writes: --out if given, else bench/results/<bench>-<device>.json."""
    return Path(out) if out else Path(__file__).parent / "results" / f"{bench}-{device_name()}.json"


def peak_bytes(step: Callable[[], Any], device: torch.device) -> int:
    """What one call of `step` allocates above what is live before it (GPU:
    max_memory_allocated; CPU: torch.profiler allocator events)."""
    if device.type == "cuda":
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        step()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base
    from compiletune.estimate.memory_internals import cpu_allocation_peak

    return cpu_allocation_peak(step)


def median_ms(step: Callable[[], Any], device: torch.device, iters: int) -> float:
    """Median wall time of `iters` calls of `step` after one warm-up call, in ms (synchronised
    on a GPU)."""
    step()
    times = []
    for _ in range(iters):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return round(statistics.median(times) * 1e3, 2)
