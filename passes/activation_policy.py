"""Joint pass: decide what a block's forward saves for backward and what backward recomputes.

Matches every forward node of an AOTAutograd joint graph (a call that does not depend on a
`tangents_*` input) and tags it for the min-cut partitioner, which honours
`node.meta["recompute"]` (a `torch.utils.checkpoint.CheckpointPolicy`):

    full       every forward node MUST_RECOMPUTE: the block keeps only its inputs (the hidden
               state entering the block, rope tables, parameters) and reruns its forward inside
               the backward. Least memory, about one extra forward of compute.
    selective  outputs of matmuls (float8 ones too) and of attention (SDPA, the segment op,
               FlexAttention and varlen flash attention: output and log-sum-exp), and of
               whole-tensor maxima (--fp8's
               scales) MUST_SAVE; everything else (RMSNorm, rotary, SiLU, the
               SwiGLU product, residual adds, views) PREFER_RECOMPUTE.

Why this op list: matmuls and attention hold nearly all of a block's FLOPs (attention also grows
with s^2), so recomputing them costs a forward; the other ops are memory-bound elementwise or
reduction work whose recompute is cheap next to a matmul but whose outputs are as large as the
matmul outputs. Saving the expensive outputs and recomputing the cheap ones removes most of the
activation memory for a few percent of time. Which tensors really get saved is still the
partitioner's choice: a tag says which side of the cut a node prefers.

Why it is safe: tags only move where values come from (saved or recomputed); recomputation runs
the same deterministic ops on the same inputs, so losses and gradients are unchanged. A tensor at
the boundary of two checkpointed regions is saved (`ac_graph_id`, one id per graph).
"""

from __future__ import annotations

import operator
from typing import Any

import torch
from torch.utils.checkpoint import CheckpointPolicy

from compiletune.choices import AcKind, choices
from compiletune.models.attention import attention_op
from compiletune.ops.grouped_mm import grouped_mm_op

POLICIES = tuple(k for k in choices(AcKind) if k != "none")  # full, selective

aten = torch.ops.aten
# Expensive to recompute: FLOP-heavy. Looked up by name so a missing overload on some build is
# simply absent from the set.
_SAVE_NAMES = (
    "mm.default",
    "addmm.default",
    "bmm.default",
    "_scaled_dot_product_flash_attention.default",
    "_scaled_dot_product_flash_attention_for_cpu.default",
    "_scaled_dot_product_efficient_attention.default",
    "_scaled_dot_product_cudnn_attention.default",
    "_flash_attention_forward.default",
    "_efficient_attention_forward.default",
    "_grouped_mm.default",  # MoE experts (native)
    "_scaled_mm.default",  # --fp8: the float8 matmuls (torchao's, on a GPU)
    # --fp8: the casts' absolute maxima (tensorwise: one number; rowwise: one per row). A
    # reduction's output is far smaller than its input, and recomputing it reads all of that
    # input again: saved, backward recomputes a cast with one elementwise pass.
    "max.default",
    "amax.default",
)


def _resolve(name: str) -> Any:
    packet, overload = name.split(".")
    return getattr(getattr(aten, packet, None), overload, None)


SAVE_OPS = frozenset(op for op in map(_resolve, _SAVE_NAMES) if op is not None) | {
    # Document-masked / windowed / soft-capped attention (an opaque custom op: attention FLOPs
    # inside).
    attention_op._opoverload,
    # MoE experts' grouped matmul (the exact fallback; a custom op)
    grouped_mm_op,
}
# FlexAttention (the CUDA kernel for masked attention) is a higher-order op in the joint graph;
# saving its outputs (out and the log-sum-exp its backward reads) keeps the backward from
# rerunning the attention forward.
_FLEX = getattr(torch.ops.higher_order, "flex_attention", None)
if _FLEX is not None:
    SAVE_OPS = SAVE_OPS | {_FLEX}
# Varlen flash attention (documents-only masks on CUDA: torch's custom op, registered when
# compiletune.models.attention imports torch.nn.attention.varlen): its output, log-sum-exp and
# (empty) RNG state are what its backward reads.
_VARLEN = getattr(getattr(torch.ops.torch_attn, "_varlen_attn", None), "default", None)
if _VARLEN is not None:
    SAVE_OPS = SAVE_OPS | {_VARLEN}


def forward_nodes(gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
    """call_function nodes of a joint graph that do not depend on any tangent (the forward)."""
    backward: set[torch.fx.Node] = set()
    for n in gm.graph.nodes:
        if (
            n.op == "placeholder"
            and n.name.startswith("tangents")
            or any(a in backward for a in n.all_input_nodes)
        ):
            backward.add(n)
    return [n for n in gm.graph.nodes if n.op == "call_function" and n not in backward]


def tag_activation_policy(
    gm: torch.fx.GraphModule, policy: str
) -> tuple[torch.fx.GraphModule, dict[str, Any]]:
    """Tag the forward of joint graph `gm` per `policy`. Returns (gm, stats)."""
    if policy not in POLICIES:
        raise ValueError(f"unknown activation policy {policy!r}; expected one of {POLICIES}")
    saved = recomputed = 0
    for node in forward_nodes(gm):
        # A getitem of a multi-output op (attention returns out, logsumexp, ...) follows its op.
        source = node.args[0] if node.target is operator.getitem else node
        if policy == "selective" and getattr(source, "target", None) in SAVE_OPS:
            node.meta["recompute"] = CheckpointPolicy.MUST_SAVE
            saved += 1
        else:
            node.meta["recompute"] = (
                CheckpointPolicy.MUST_RECOMPUTE
                if policy == "full"
                else CheckpointPolicy.PREFER_RECOMPUTE
            )
            recomputed += 1
        node.meta["ac_graph_id"] = 1
    return gm, {"matched": saved + recomputed, "tagged_save": saved, "tagged_recompute": recomputed}
