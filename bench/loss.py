"""The loss head alone: fused vs chunked vs plain cross-entropy, forward + backward.

    python bench/loss.py                       # GPU: tokens 4096 16384 32768, hidden 4096, bf16
    python bench/loss.py                       # CPU: tokens 1024 4096, hidden 256, fp32
    python bench/loss.py --plot                # also bench/results/loss-<device>.png (matplotlib)

Each variant computes loss = cross_entropy(h [N, d] @ W.T [d, V]) and its gradients w.r.t. h
and W (128256 = the Llama 3 vocabulary), with 5% of the targets ignored:

    fused    compiletune's fused head, `linear_cross_entropy` as the trainer calls it: where
             the sizes fit (fp32, or all tokens in one chunk) the one-pass op, which computes
             dh and dW in the forward and saves them; else the two-op head (chunked fp32
             log-sum-exp, saves only lse [N], logits recomputed in backward).
             COMPILETUNE_LCE_ONE_PASS=0|1 forces either.
    fused_two_op     the two-op head forced (saves h and lse; four matmuls)
    fused_fp32acc    the one-pass head forced, its weight gradient summed over token chunks
                     in an fp32 [V, d] buffer (default chunks: logits up to the size of dW)
    fused_bf16acc    the same, summed in the weight's dtype (`--accumulator bf16`'s head)
    fused_bf16_128m  the bf16 sum over chunks of at most 128 MiB of logits: about the memory
                     of Liger's head, with 8 chunks at 4k tokens and 32 at 16k
    chunked  the usual chunked-logits baseline (8 chunks; autograd keeps each chunk's logits)
    plain    F.cross_entropy(F.linear(h, W).float())
    liger    Liger-Kernel's LigerFusedLinearCrossEntropyLoss   (on a GPU, where installed)
    cce      Apple's cut-cross-entropy linear_cross_entropy     (on a GPU, where installed)
A peer that cannot run here (no GPU, or its package missing) gets a row entry with `skipped`.

Peak memory is what the step allocates on top of its inputs (h, W, targets), gradients included,
measured from the allocator:
    GPU  torch.cuda.max_memory_allocated() - memory_allocated() before the step;
    CPU  the highest running total of torch.profiler's allocator events (profile_memory=True,
         every allocation and free of the CPU allocator, in order) over one step.
Time is the median of --iters steps after a warm-up (the memory step is not timed).
Results: bench/results/loss-<device>.json and a markdown table on stdout.

    python bench/loss.py --train               # also: whole training runs, fused vs plain

--train runs `compiletune train --model llama3_150m --seq-len 2048` (vocab 128256) once with
`--loss fused` and once with `--loss plain`, each in its own process, and records the run's peak
memory (GPU: max_memory_allocated; CPU: the process's peak resident memory) and tokens/s.
"""

from __future__ import annotations

import argparse
import functools
import gc
import importlib.util
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import device_name, result_header, run_train, work_dir, write_result  # noqa: E402

from compiletune.ops.ce_chunks import BF16_SUM_MAX_CHUNKS, chunk_tokens  # noqa: E402
from compiletune.ops.fused_loss import (  # noqa: E402
    chunked_cross_entropy,
    linear_cross_entropy,
    one_pass_chunk_tokens,
    plain_cross_entropy,
)


def _small_chunks(h, w, t, **kw):
    """The one-pass head with its bf16 sum over chunks of <= 128 MiB of logits."""
    chunk = max(1, 128 * 2**20 // (w.shape[0] * w.element_size()))
    return linear_cross_entropy(h, w, t, one_pass=True, accumulator="bf16", chunk_size=chunk)


VARIANTS = {
    "fused": linear_cross_entropy,
    "fused_two_op": functools.partial(linear_cross_entropy, one_pass=False),
    "fused_fp32acc": functools.partial(linear_cross_entropy, one_pass=True, accumulator="fp32"),
    "fused_bf16acc": functools.partial(linear_cross_entropy, one_pass=True, accumulator="bf16"),
    "fused_bf16_128m": _small_chunks,
    "chunked": chunked_cross_entropy,
    "plain": plain_cross_entropy,
}


def _liger(h, w, t):
    """Liger-Kernel's fused linear cross-entropy (mean over counted tokens)."""
    from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

    return LigerFusedLinearCrossEntropyLoss(ignore_index=-100)(w, h, t)


def _cce(h, w, t):
    """Apple's cut-cross-entropy (mean over counted tokens)."""
    from cut_cross_entropy import linear_cross_entropy as cce

    return cce(h, w, t, ignore_index=-100)


# Peers on a GPU, where their wheels are installed (the GPU check carries them): same inputs,
# same step (loss, then dh and dW).
PEERS = {"liger": ("liger_kernel", _liger), "cce": ("cut_cross_entropy", _cce)}


def available_peers() -> list[str]:
    return [name for name in PEERS if not peer_missing(name)]


def peer_missing(name: str) -> str | None:
    """Why peer `name` cannot run here (None: it can, or `name` is not a peer)."""
    if name not in PEERS:
        return None
    if not torch.cuda.is_available():
        return "needs a CUDA GPU"
    module = PEERS[name][0]
    return None if importlib.util.find_spec(module) else f"{module} is not installed"


VARIANTS |= {name: fn for name, (_, fn) in PEERS.items()}
RESULTS = Path(__file__).resolve().parent / "results"
MIB = 2**20


def make_inputs(tokens: int, hidden: int, vocab: int, dtype: torch.dtype, device: str):
    g = torch.Generator().manual_seed(0)
    h = torch.randn(tokens, hidden, generator=g).to(device, dtype).requires_grad_()
    w = (torch.randn(vocab, hidden, generator=g) / hidden**0.5).to(device, dtype).requires_grad_()
    t = torch.randint(0, vocab, (tokens,), generator=g)
    t[torch.rand(tokens, generator=g) < 0.05] = -100
    return h, w, t.to(device)


def step(fn, h, w, t) -> None:
    h.grad = w.grad = None
    fn(h, w, t).backward()


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def peak_bytes(fn, h, w, t, device: str) -> int:
    """Bytes the step allocates above what is live before it (inputs), at its highest."""
    h.grad = w.grad = None
    gc.collect()
    if device == "cuda":
        sync(device)
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        step(fn, h, w, t)
        sync(device)
        return torch.cuda.max_memory_allocated() - base
    from compiletune.estimate.memory_internals import cpu_allocation_peak

    return cpu_allocation_peak(lambda: step(fn, h, w, t))


def seconds(fn, h, w, t, device: str, iters: int) -> float:
    times = []
    for _ in range(iters):
        sync(device)
        start = time.perf_counter()
        step(fn, h, w, t)
        sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def run(args: argparse.Namespace, out: Path | None = None) -> dict[str, Any]:
    """Every variant at every size; with `out`, the result is written there after each size
    (a run cut short keeps the rows it finished)."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = getattr(torch, args.dtype)
    rows: list[dict[str, Any]] = []
    result = {
        **result_header(),
        "bench": "loss",
        "config": {
            "hidden": args.hidden,
            "vocab": args.vocab,
            "dtype": args.dtype,
            "iters": args.iters,
            "ignored_targets": 0.05,
            "fused_chunk_tokens": chunk_tokens(args.vocab),
            "one_pass_chunk_tokens": one_pass_chunk_tokens(args.vocab, args.hidden, dtype),
            "bf16_128m_chunk_tokens": 128 * 2**20 // (args.vocab * dtype.itemsize),
            "auto_bf16_sum_max_chunks": BF16_SUM_MAX_CHUNKS,
            "peak_memory": (
                "torch.cuda.max_memory_allocated above the inputs"
                if device == "cuda"
                else "torch.profiler CPU allocator events: highest live total above the inputs"
            ),
        },
        "targets": {
            "fused/plain memory at 16k tokens": "<= 0.10",
            "fused/plain time at 16k tokens (GPU)": "<= 1.15",
            "fused/plain time at 4k tokens (GPU)": "<= 1.05",
            "a fused variant vs liger at 4k and 16k (GPU)": "time <= 1.0 at memory <= 1.0",
        },
        "rows": rows,
    }
    for tokens in args.tokens:
        row: dict[str, Any] = {"tokens": tokens}
        for name in args.variants:
            fn = VARIANTS[name]
            if missing := peer_missing(name):
                row[name] = {"peak_mib": None, "time_ms": None, "skipped": missing}
                print(f"tokens={tokens} {name}: skipped, {missing}", file=sys.stderr)
                continue
            h, w, t = make_inputs(tokens, args.hidden, args.vocab, dtype, device)
            try:
                # Warm-up on a short batch (compiles the fused op's chunk functions; dynamic
                # shapes, so the full size does not recompile), then memory, then time.
                short = min(tokens, chunk_tokens(args.vocab) + 7)
                step(fn, h[:short].detach().requires_grad_(), w, t[:short])
                peak = peak_bytes(fn, h, w, t, device)
                secs = seconds(fn, h, w, t, device, args.iters)
                row[name] = {"peak_mib": round(peak / MIB, 1), "time_ms": round(secs * 1e3, 2)}
            except torch.OutOfMemoryError:
                row[name] = {"peak_mib": None, "time_ms": None, "error": "out of memory"}
            del h, w, t
            gc.collect()
            if device == "cuda":
                torch.cuda.empty_cache()
            print(f"tokens={tokens} {name}: {row[name]}", file=sys.stderr, flush=True)
        for name in args.variants:
            if (
                name != "plain"
                and "plain" in row
                and row["plain"]["peak_mib"]
                and row[name]["peak_mib"]
                and row[name]["time_ms"]
            ):
                row[f"{name}/plain"] = {
                    "memory": round(row[name]["peak_mib"] / row["plain"]["peak_mib"], 4),
                    "time": round(row[name]["time_ms"] / row["plain"]["time_ms"], 3),
                }
        rows.append(row)
        if out is not None:
            write_result(out, result)
    return result


def markdown(result: dict[str, Any]) -> str:
    variants = [v for v in VARIANTS if v in result["rows"][0]]
    head = ["tokens"] + [f"{v} MiB" for v in variants] + [f"{v} ms" for v in variants]
    ratios = [k for k in result["rows"][0] if "/" in k]
    head += [f"{r} mem" for r in ratios] + [f"{r} time" for r in ratios]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in result["rows"]:
        cells = [str(row["tokens"])]
        cells += [str(row[v]["peak_mib"]) for v in variants]
        cells += [str(row[v]["time_ms"]) for v in variants]
        cells += [str(row.get(r, {}).get("memory")) for r in ratios]
        cells += [str(row.get(r, {}).get("time")) for r in ratios]
        lines.append("| " + " | ".join(cells) + " |")
    c = result["config"]
    title = (
        f"loss head on {result['device']} ({result['device_detail']}), torch {result['torch']}, "
        f"commit {result['commit']}: hidden {c['hidden']}, vocab {c['vocab']}, {c['dtype']}"
    )
    return title + "\n\n" + "\n".join(lines)


def plot(result: dict[str, Any], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("--plot needs matplotlib (pip install matplotlib); skipped", file=sys.stderr)
        return
    rows = result["rows"]
    variants = [v for v in VARIANTS if v in rows[0]]
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, key, label in ((axes[0], "peak_mib", "peak MiB"), (axes[1], "time_ms", "ms / step")):
        for v in variants:
            points = [(r["tokens"], r[v][key]) for r in rows if r[v][key] is not None]
            if not points:  # a peer skipped at every size
                continue
            ax.plot(*zip(*points, strict=True), marker="o", label=v)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("tokens")
        ax.set_ylabel(label)
        ax.legend()
    fig.suptitle(f"loss head fwd+bwd, {result['device']}, vocab {result['config']['vocab']}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}", file=sys.stderr)


def training_runs(args: argparse.Namespace) -> dict[str, Any]:
    """Whole `compiletune train` runs, fused vs plain loss, same model, data and shapes."""
    import tempfile

    work = work_dir("ct-bench-loss-")
    runs: dict[str, Any] = {"model": args.train_model, "seq_len": args.train_seq_len}
    for loss in ("fused", "plain"):
        flags = ["--model", args.train_model, "--seq-len", str(args.train_seq_len)]
        flags += ["--batch-size", "1", "--max-steps", str(args.train_steps), "--loss", loss]
        s = run_train(flags, tempfile.mkdtemp(dir=work), work)
        steady = statistics.median(s["step_times"][1:])
        runs[loss] = {
            "peak_mem_gib": s["peak_mem_gib"],
            "tokens_per_s": s["tokens_per_step"] / steady,
            "final_loss": s["final_loss"],
        }
        print(f"train {loss}: {runs[loss]}", file=sys.stderr, flush=True)
    runs["fused_over_plain_peak_mem"] = (
        runs["fused"]["peak_mem_gib"] / runs["plain"]["peak_mem_gib"]
    )
    return runs


def profile(args) -> None:
    """Where a step's time goes: the 15 ops with the most device time (CPU time on a CPU)."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = getattr(torch, args.dtype)
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    sort = "cuda_time_total" if device == "cuda" else "cpu_time_total"
    for tokens in args.tokens:
        h, w, t = make_inputs(tokens, args.hidden, args.vocab, dtype, device)
        for name in args.variants:
            fn = VARIANTS[name]
            step(fn, h, w, t)  # warm-up: compiles
            sync(device)
            with torch.profiler.profile(activities=activities) as prof:
                step(fn, h, w, t)
                sync(device)
            print(f"\n### {name}, {tokens} tokens")
            print(prof.key_averages().table(sort_by=sort, row_limit=15, max_name_column_width=60))


def main() -> None:
    gpu = torch.cuda.is_available()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument(
        "--tokens", type=int, nargs="+", default=[4096, 16384, 32768] if gpu else [1024, 4096]
    )
    p.add_argument("--hidden", type=int, default=4096 if gpu else 256)
    p.add_argument("--vocab", type=int, default=128256)
    p.add_argument("--dtype", default="bfloat16" if gpu else "float32")
    p.add_argument("--iters", type=int, default=5 if gpu else 3)
    p.add_argument(
        "--variants",
        nargs="+",
        default=["fused", "chunked", "plain", *available_peers()],
        choices=list(VARIANTS),
        help="default: ours, and the peers (liger, cce) where installed on a GPU",
    )
    p.add_argument(
        "--out", type=Path, default=None, help="default bench/results/loss-<device>.json"
    )
    p.add_argument("--plot", action="store_true")
    p.add_argument("--train", action="store_true", help="also whole training runs")
    p.add_argument("--train-model", default="llama3_150m")
    p.add_argument("--train-seq-len", type=int, default=2048)
    p.add_argument("--train-steps", type=int, default=3)
    p.add_argument(
        "--profile",
        action="store_true",
        help="only print torch.profiler's busiest kernels of one step per variant and size",
    )
    args = p.parse_args()
    if args.profile:
        profile(args)
        return
    out = args.out or RESULTS / f"loss-{device_name()}.json"
    result = run(args, out)
    if args.train:
        result["training_run"] = training_runs(args)
        tr = result["training_run"]
        print(
            f"\nwhole run ({tr['model']}, seq {tr['seq_len']}): peak memory fused "
            f"{tr['fused']['peak_mem_gib']:.2f} GiB vs plain {tr['plain']['peak_mem_gib']:.2f} GiB "
            f"({tr['fused_over_plain_peak_mem']:.2f}x)"
        )
    write_result(out, result)
    print(markdown(result))
    print(f"\nwrote {out}", file=sys.stderr)
    if args.plot:
        plot(result, out.with_suffix(".png"))


if __name__ == "__main__":
    main()
