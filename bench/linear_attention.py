"""The gated delta rule (Gated DeltaNet, Qwen3-Next / Qwen3.5 linear attention), forward +
backward: compiletune::gated_delta_rule against transformers' torch path on the same inputs,
side by side in one run.

    python bench/linear_attention.py                          # CPU: fp32, 4k and 16k tokens
    python bench/linear_attention.py --tokens 4096 16384 65536

Variants (one row of --tokens tokens, Qwen3-Next's linear-attention heads: 32 value heads of
128, 16 key heads of 128 repeated to 32; q and k l2-normalised outside the op):

    compiletune     compiletune::gated_delta_rule: chunks of 64, all chunks' intra-chunk parts
                    at once, one triangular solve, the state walk as a loop of small matmuls;
                    saves its inputs only and recomputes in backward
    hf torch        transformers' torch_chunk_gated_delta_rule (its fallback without
                    flash-linear-attention) differentiated by autograd
    fla             flash-linear-attention's chunk_gated_delta_rule (CUDA, where installed)

Time: median of --iters steps after one warm-up. Peak memory: what one step allocates above its
inputs (GPU: max_memory_allocated; CPU: torch.profiler allocator events).
Results: bench/results/linear-attention-<device>.json and a markdown table on stdout.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import bench_out, median_ms, peak_bytes, result_header, write_result  # noqa: E402

from compiletune.ops.gated_delta import gated_delta_rule  # noqa: E402


def _inputs(tokens: int, heads: int, dk: int, dv: int, device, dtype) -> list[torch.Tensor]:
    gen = torch.Generator(device=device).manual_seed(0)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device=device, dtype=dtype)

    q = F.normalize(randn(1, tokens, heads, dk), dim=-1)
    k = F.normalize(randn(1, tokens, heads, dk), dim=-1)
    v = randn(1, tokens, heads, dv)
    g = -F.softplus(randn(1, tokens, heads))  # log decays < 0, as the model computes them
    beta = torch.sigmoid(randn(1, tokens, heads))
    return [x.requires_grad_() for x in (q, k, v, g, beta)]


def _variants(device: torch.device) -> dict[str, Any]:
    from transformers.models.qwen3_next import modeling_qwen3_next as hf

    out = {
        # transformers scales q by dk^-0.5 inside; ours takes q scaled
        "compiletune": lambda q, k, v, g, b: gated_delta_rule(q * q.shape[-1] ** -0.5, k, v, g, b),
        "hf torch": lambda q, k, v, g, b: hf.torch_chunk_gated_delta_rule(q, k, v, g, b)[0],
    }
    if device.type == "cuda":
        try:
            from fla.ops.gated_delta_rule import chunk_gated_delta_rule

            out["fla"] = lambda q, k, v, g, b: chunk_gated_delta_rule(q, k, v, g, b)[0]
        except ImportError:
            pass
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--tokens", type=int, nargs="+", default=[4096, 16384])
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--dk", type=int, default=128)
    ap.add_argument("--dv", type=int, default=128)
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    rows = []
    for tokens in a.tokens:
        xs = _inputs(tokens, a.heads, a.dk, a.dv, device, dtype)
        grad = torch.randn(1, tokens, a.heads, a.dv, device=device, dtype=dtype)
        for name, fn in _variants(device).items():

            def step(fn=fn, xs=xs, grad=grad):
                for x in xs:
                    x.grad = None
                fn(*xs).backward(grad)

            try:
                ms = median_ms(step, device, a.iters)
                peak = peak_bytes(step, device)
            except Exception as e:  # a variant that cannot run here is a row that says why
                rows.append({"tokens": tokens, "variant": name, "error": type(e).__name__})
                continue
            row = {"tokens": tokens, "variant": name, "ms": ms, "peak_mib": peak / 2**20}
            rows.append(row)
            print(f"tokens={tokens} {name}: {ms} ms, {row['peak_mib']:.1f} MiB", flush=True)
    base = {r["tokens"]: r for r in rows if r["variant"] == "hf torch" and "ms" in r}
    for r in rows:
        if "ms" in r and r["tokens"] in base:
            r["speed_vs_hf"] = round(base[r["tokens"]]["ms"] / r["ms"], 2)
            r["memory_vs_hf"] = round(r["peak_mib"] / base[r["tokens"]]["peak_mib"], 3)
    print(f"\ngated delta rule, {a.heads} heads, dk {a.dk}, dv {a.dv}, {dtype}, fwd+bwd")
    print("| tokens | variant | ms | speed vs hf torch | peak MiB | memory vs hf torch |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        if "error" in r:
            print(f"| {r['tokens']} | {r['variant']} | {r['error']} | | | |")
            continue
        print(
            f"| {r['tokens']} | {r['variant']} | {r['ms']} | {r.get('speed_vs_hf', '')}x | "
            f"{r['peak_mib']:.1f} | {r.get('memory_vs_hf', '')}x |"
        )
    out = bench_out("linear-attention", a.out)
    write_result(out, {**result_header(), "dtype": str(dtype), "rows": rows})
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
