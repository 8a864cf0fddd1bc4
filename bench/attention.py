"""Attention variants side by side, forward + backward: what windows and soft-capping cost.

    python bench/attention.py                  # CPU: s 1024 2048 4096, 8 heads x 64, fp32
    python bench/attention.py --seq 8192       # GPU: bf16 by default

Variants, each on q, k, v [1, 8, s, 64] (GPU: bf16; CPU: fp32):

    sdpa       plain causal SDPA (what a layer without window or soft-cap runs)
    window     compiletune::attention with a window of s / 4 (queries in chunks, SDPA per chunk)
    softcap    compiletune::attention with soft-cap 50 (Gemma 2): tiled fp32 kernel, own backward
    docs       a packed row of 256-token documents: one SDPA per document (the CPU path)
    ... flex   the same mask through FlexAttention (the CUDA default; GPU only: no CPU backward)
    dense      the [s, s] reference a plain implementation of soft-capping would run (eager math:
               scores, tanh, mask, softmax, matmul; autograd keeps the [h, s, s] scores)

Time: median of --iters forward + backward steps after a warm-up. Peak memory: what one step
allocates above its inputs (GPU: max_memory_allocated; CPU: torch.profiler allocator events).
Results: bench/results/attention-<device>.json and a markdown table on stdout.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # noqa: E402
    device_name,
    median_ms,
    peak_bytes,
    result_header,
    write_result,
)

from compiletune.models.attention import causal_attention  # noqa: E402


def dense(q, k, v, scale: float, softcap: float):
    s = q.shape[2]
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    scores = softcap * torch.tanh(scores / softcap)
    mask = torch.ones(s, s, dtype=torch.bool, device=q.device).tril()
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.matmul(torch.softmax(scores, -1, dtype=torch.float32).to(q.dtype), v)


def docs(s: int, device: torch.device) -> torch.Tensor:
    """doc_ids [1, s]: a packed row of 256-token examples (SFT data of short examples)."""
    return (torch.arange(s, device=device) // 256)[None].to(torch.int32)


def _attn(backend: str | None, docs_too: bool = False, window: int = 0, softcap: float = 0.0):
    def run(q, k, v, s):
        ids = docs(s, q.device) if docs_too else None
        w = s // 4 if window else 0
        return causal_attention(q, k, v, 0.125, ids, w, softcap, backend=backend)

    return run


VARIANTS = {
    "sdpa": _attn(None),
    "window": _attn("segments", window=1),
    "window flex": _attn("flex", window=1),
    "softcap": _attn("segments", softcap=50.0),
    "softcap flex": _attn("flex", softcap=50.0),
    "docs": _attn("segments", docs_too=True),
    "docs flex": _attn("flex", docs_too=True),
    "dense": lambda q, k, v, s: dense(q, k, v, 0.125, 50.0),
}


def measure(
    name: str, s: int, device: torch.device, dtype: torch.dtype, iters: int
) -> dict[str, Any]:
    g = torch.Generator(device=device).manual_seed(0)
    q, k, v = (
        torch.randn(1, 8, s, 64, device=device, dtype=dtype, generator=g).requires_grad_()
        for _ in range(3)
    )
    grad = torch.randn(1, 8, s, 64, device=device, dtype=dtype, generator=g)

    def step() -> None:
        out = VARIANTS[name](q, k, v, s)
        torch.autograd.grad(out, (q, k, v), grad)

    return {
        "variant": name,
        "seq": s,
        "ms": median_ms(step, device, iters),
        "peak_mib": round(peak_bytes(step, device) / 2**20, 1),
    }


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--seq", type=int, nargs="+", default=None)
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=None)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    seqs = a.seq or ([1024, 2048, 4096] if device.type == "cpu" else [4096, 8192, 16384])
    # FlexAttention has no CPU backward: its rows run on a GPU only
    names = a.variants or [n for n in VARIANTS if device.type == "cuda" or "flex" not in n]
    rows = [measure(n, s, device, dtype, a.iters) for s in seqs for n in names]
    print("| seq | variant | ms (fwd+bwd) | vs sdpa | peak MiB |")
    print("|---|---|---|---|---|")
    for r in rows:
        base = next((x for x in rows if x["seq"] == r["seq"] and x["variant"] == "sdpa"), r)
        print(
            f"| {r['seq']} | {r['variant']} | {r['ms']} | {r['ms'] / base['ms']:.2f}x | "
            f"{r['peak_mib']} |"
        )
    out = (
        Path(a.out)
        if a.out
        else Path(__file__).parent / "results" / f"attention-{device_name()}.json"
    )
    write_result(out, {**result_header(), "dtype": str(dtype), "rows": rows})


if __name__ == "__main__":
    main()
