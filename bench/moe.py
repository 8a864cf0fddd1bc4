"""One MoE block, forward + backward: compiletune's (compiled) against transformers' own block on
the same weights, side by side in one run.

    python bench/moe.py                    # CPU: fp32, 8 experts, top-2, d 512, F 1024, 2048 tok
    python bench/moe.py --tokens 8192      # GPU: bf16 by default
    python bench/moe.py --ep 2             # --ep against FSDP2 alone on 2 gloo ranks
                                           # (bench/moe_ep.py: the trainer's whole step)

Variants (the same router, expert weights and input; top-k weights renormalised, Qwen3-MoE):

    compiletune           models.moe.MoE compiled by compiletune's backend (inductor): tokens
                          sorted by expert, one grouped matmul per projection
                          (torch._grouped_mm on a Hopper GPU in bf16, the exact fallback
                          otherwise), the counts are data: one graph for every routing
    compiletune eager     the same module without compile
    hf eager              transformers' Qwen3MoeSparseMoeBlock, experts_implementation "eager"
                          (a loop over the experts that received tokens)
    hf grouped_mm         the same block with experts_implementation "grouped_mm" (transformers'
                          default when it can dispatch it)

Each step draws a new input, so routings differ from step to step. Time: median of --iters
steps after --warmup steps, the variants taking turns on each input (a slow spell of a shared
machine hits them all alike); tokens/s = tokens / time. Peak memory: what one step allocates above
its inputs and weights (GPU: max_memory_allocated; CPU: torch.profiler allocator events).
With `--block gpt_oss` the block is gpt-oss's (router and expert biases, the clamped SwiGLU) and
transformers' side its GptOssMLP; with `--block deepseek_v3` DeepSeek-V3's (sigmoid routing with
a correction bias over 2 of 4 expert groups, weights x 2.5, a shared expert) against its
DeepseekV3MoE (same variants).
Results: bench/results/moe-<device>.json (moe-<block>-<device>.json) and a markdown table.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import device_name, peak_bytes, result_header, write_result  # noqa: E402

from compiletune.compiler.backend import CompiletuneBackend  # noqa: E402
from compiletune.models.moe import MoE  # noqa: E402
from compiletune.ops.grouped_mm import uses_native  # noqa: E402


def hf_block(ours: MoE, dim: int, ffn: int, experts: int, top_k: int, impl: str):
    import transformers
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    cfg = transformers.Qwen3MoeConfig(
        hidden_size=dim,
        moe_intermediate_size=ffn,
        num_experts=experts,
        num_experts_per_tok=top_k,
        norm_topk_prob=True,
    )
    cfg._experts_implementation = impl
    block = Qwen3MoeSparseMoeBlock(cfg)
    with torch.no_grad():
        block.gate.weight.copy_(ours.router.weight)
        block.experts.gate_up_proj.copy_(ours.experts.w13)
        block.experts.down_proj.copy_(ours.experts.w2)
    return block


def hf_gpt_oss_block(ours: MoE, dim: int, ffn: int, experts: int, top_k: int, impl: str):
    """transformers' GptOssMLP on our block's weights (the hub's layout: experts transposed,
    gate and up columns interleaved; models/hf.py maps it)."""
    import transformers
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP

    from compiletune.models.hf_names import layout

    cfg = transformers.GptOssConfig(
        hidden_size=dim, intermediate_size=ffn, num_local_experts=experts
    )
    cfg.num_experts_per_tok = top_k
    cfg._experts_implementation = impl
    block = GptOssMLP(cfg)

    def hub(name: str, t: torch.Tensor) -> torch.Tensor:
        convert = layout(f"layers.0.feed_forward.experts.{name}", "gpt_oss")
        return t if convert is None else convert[1](t)

    with torch.no_grad():
        block.router.weight.copy_(ours.router.weight)
        block.router.bias.copy_(ours.router.bias)
        block.experts.gate_up_proj.copy_(hub("w13", ours.experts.w13))
        block.experts.gate_up_proj_bias.copy_(hub("b13", ours.experts.b13))
        block.experts.down_proj.copy_(hub("w2", ours.experts.w2))
        block.experts.down_proj_bias.copy_(ours.experts.b2)
    return block


def hf_deepseek_block(ours: MoE, dim: int, ffn: int, experts: int, top_k: int, impl: str):
    """transformers' DeepseekV3MoE (router, routed and shared experts) on our block's weights."""
    import transformers
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE

    cfg = transformers.DeepseekV3Config(
        hidden_size=dim,
        moe_intermediate_size=ffn,
        n_routed_experts=experts,
        num_experts_per_tok=top_k,
        n_shared_experts=1,
        n_group=DEEPSEEK_GROUPS[0],
        topk_group=DEEPSEEK_GROUPS[1],
        routed_scaling_factor=DEEPSEEK_SCALE,
        norm_topk_prob=True,
    )
    cfg._experts_implementation = impl
    block = DeepseekV3MoE(cfg)
    with torch.no_grad():
        block.gate.weight.copy_(ours.router.weight)
        block.gate.e_score_correction_bias.copy_(ours.score_bias)
        block.experts.gate_up_proj.copy_(ours.experts.w13)
        block.experts.down_proj.copy_(ours.experts.w2)
        for hf_name, name in (("gate_proj", "w1"), ("up_proj", "w3"), ("down_proj", "w2")):
            getattr(block.shared_experts, hf_name).weight.copy_(getattr(ours.shared, name).weight)
    return block


DEEPSEEK_GROUPS = (4, 2)  # expert groups, and how many of them a token's experts come from
DEEPSEEK_SCALE = 2.5


def our_block(block: str, a: argparse.Namespace) -> MoE:
    """compiletune's MoE of `block`'s kind (see the module docstring)."""
    if block == "gpt_oss":
        return MoE(a.dim, a.ffn, a.experts, a.top_k, norm_topk=True, bias=True, clamp=7.0)
    if block == "deepseek_v3":
        return MoE(
            a.dim,
            a.ffn,
            a.experts,
            a.top_k,
            norm_topk=True,
            shared_ffn_dim=a.ffn,
            score="sigmoid",
            n_groups=DEEPSEEK_GROUPS[0],
            topk_groups=DEEPSEEK_GROUPS[1],
            routed_scale=DEEPSEEK_SCALE,
        )
    return MoE(a.dim, a.ffn, a.experts, a.top_k, norm_topk=True)


def stepper(fn):
    """One fwd+bwd of `fn` on x (gradients of the input and every trainable weight)."""
    params = [p for p in fn.parameters() if p.requires_grad]

    def step(x: torch.Tensor) -> torch.Tensor:
        out = fn(x)
        y = out[0] if isinstance(out, tuple) else out
        torch.autograd.grad(y.square().mean(), [x, *params])
        return y.detach()

    return step


def measure(
    variants: dict[str, Any], inputs: list[torch.Tensor], warmup: int, device
) -> list[dict[str, Any]]:
    """Median fwd+bwd time of each variant over `inputs` (after `warmup` of them), the variants
    taking turns input by input so that a slow spell of the machine hits them all alike; and
    each one's peak memory for one step."""
    steps = {name: stepper(fn) for name, fn in variants.items()}
    times: dict[str, list[float]] = {name: [] for name in steps}
    failed: dict[str, str] = {}
    for i, x in enumerate(inputs):
        for name, step in steps.items():
            if name in failed:
                continue
            try:
                if device.type == "cuda":
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
                step(x)
                if device.type == "cuda":
                    torch.cuda.synchronize()
            except Exception as e:  # a variant this torch/transformers cannot run: say so
                failed[name] = f"{type(e).__name__}: {str(e)[:200]}"
                continue
            if i >= warmup:
                times[name].append(time.perf_counter() - t0)
    tokens = inputs[0].shape[0] * inputs[0].shape[1]
    rows = []
    for name, step in steps.items():
        if name in failed:
            rows.append({"variant": name, "error": failed[name]})
            continue
        seconds = statistics.median(times[name])
        rows.append(
            {
                "variant": name,
                "ms": round(seconds * 1e3, 2),
                "tokens_per_s": round(tokens / seconds),
                "peak_mib": round(
                    peak_bytes(lambda step=step: step(inputs[-1]), device) / 2**20, 1
                ),
                "output": step(inputs[0]),
            }
        )
    return rows


def main() -> None:
    if "--ep" in sys.argv[1:]:  # --ep N: the trainer's step on N gloo ranks (bench/moe_ep.py)
        from moe_ep import main as ep_main  # deferred: it spawns ranks; this bench does not

        ep_main(sys.argv[1:])
        return
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--dim", type=int, default=512)
    ap.add_argument("--ffn", type=int, default=1024)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument(
        "--block",
        choices=["qwen3_moe", "gpt_oss", "deepseek_v3"],
        default="qwen3_moe",
        help="gpt_oss: router and expert biases, the clamped SwiGLU (limit 7), against "
        "transformers' GptOssMLP; deepseek_v3: sigmoid routing in expert groups, a shared "
        "expert, against DeepseekV3MoE",
    )
    ap.add_argument(
        "--compile-backend",
        choices=["inductor", "aot_eager"],
        default="inductor",
        help="aot_eager: the same passes without code generation (the CPU dry run's plumbing)",
    )
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    torch.manual_seed(0)
    ours = our_block(a.block, a)
    with torch.no_grad():
        for p in ours.parameters():
            p.normal_(0.0, 0.02)
    ours = ours.to(device=device, dtype=dtype)
    g = torch.Generator(device=device).manual_seed(1)
    inputs = [
        torch.randn(1, a.tokens, a.dim, device=device, dtype=dtype, generator=g).requires_grad_()
        for _ in range(a.warmup + a.iters)
    ]
    backend = CompiletuneBackend("block", [], mode=a.compile_backend)
    compiled = torch.compile(ours, backend=backend, fullgraph=True, dynamic=False)
    hf = {"gpt_oss": hf_gpt_oss_block, "deepseek_v3": hf_deepseek_block}.get(a.block, hf_block)
    variants = {
        "compiletune": compiled,
        "compiletune eager": ours,
        "hf eager": hf(ours, a.dim, a.ffn, a.experts, a.top_k, "eager").to(device, dtype),
        "hf grouped_mm": hf(ours, a.dim, a.ffn, a.experts, a.top_k, "grouped_mm").to(device, dtype),
    }
    rows = measure(variants, inputs, a.warmup, device)
    reference = next(r["output"] for r in rows if r["variant"] == "hf eager" and "output" in r)
    for r in rows:
        out = r.pop("output", None)
        if out is not None:
            diff = (out.double() - reference.double()).norm() / reference.double().norm()
            r["rel_diff_vs_hf_eager"] = float(f"{diff.item():.2e}")
    base = next(r for r in rows if r["variant"] == "hf eager")
    print(
        f"{a.block} block: {a.tokens} tokens, d {a.dim}, F {a.ffn}, {a.experts} experts, "
        f"top-{a.top_k}, {dtype}"
    )
    print("| variant | ms (fwd+bwd) | tokens/s | vs hf eager | peak MiB | vs hf eager |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        if "error" in r:
            print(f"| {r['variant']} | {r['error']} | | | | |")
            continue
        speed = r["tokens_per_s"] / base["tokens_per_s"]
        mem = r["peak_mib"] / base["peak_mib"]
        print(
            f"| {r['variant']} | {r['ms']} | {r['tokens_per_s']} | {speed:.2f}x | "
            f"{r['peak_mib']} | {mem:.2f}x |"
        )
    kind = {"gpt_oss": "gpt-oss-", "deepseek_v3": "deepseek-v3-"}.get(a.block, "")
    name = f"moe-{kind}{device_name()}.json"
    out = Path(a.out) if a.out else Path(__file__).parent / "results" / name
    shape = {k: getattr(a, k) for k in ("block", "tokens", "dim", "ffn", "experts", "top_k")}
    result = {**result_header(), "dtype": str(dtype), "shape": shape, "rows": rows}
    result["compiles"] = backend.compiles
    result["compile_backend"] = a.compile_backend
    result["native_grouped_mm"] = uses_native(inputs[0][0], ours.experts.w13.transpose(-2, -1))
    write_result(out, result)


if __name__ == "__main__":
    main()
