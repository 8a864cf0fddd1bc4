"""HF tensor names and layouts: native name <-> the name in an HF checkpoint, per family, and the
tensors a family's checkpoints store otherwise than the native module (stacked experts as one
tensor per expert, gpt-oss's transposed and interleaved experts)."""

from __future__ import annotations

import re
from collections.abc import Callable

import torch
from torch import Tensor

from compiletune.errors import UserError

from .families import DEFAULT_FAMILY
from .hf_config import ARCHITECTURES
from .names import strip_wrappers

# native name <-> HF name for the tensors outside the blocks
_GLOBAL_NAMES = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    # Gemma 4's per-layer inputs
    "per_layer_inputs.embed.weight": "model.embed_tokens_per_layer.weight",
    "per_layer_inputs.projection.weight": "model.per_layer_model_projection.weight",
    "per_layer_inputs.norm.weight": "model.per_layer_projection_norm.weight",
}
# native suffix <-> HF suffix inside block i ("layers.{i}." <-> "model.layers.{i}."). A model has
# only the tensors its ModelArgs give it (q/k norms: Qwen3; wqkv and w13: Phi-3's fused ones).
_BLOCK_NAMES = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wq.bias": "self_attn.q_proj.bias",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wk.bias": "self_attn.k_proj.bias",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wv.bias": "self_attn.v_proj.bias",
    "attention.wqkv.weight": "self_attn.qkv_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "attention.q_norm.weight": "self_attn.q_norm.weight",
    "attention.k_norm.weight": "self_attn.k_norm.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "feed_forward.w13.weight": "mlp.gate_up_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    # multi-head latent attention (DeepSeek-V3, models/mla.py)
    "attention.wq_a.weight": "self_attn.q_a_proj.weight",
    "attention.q_a_norm.weight": "self_attn.q_a_layernorm.weight",
    "attention.wq_b.weight": "self_attn.q_b_proj.weight",
    "attention.wkv_a.weight": "self_attn.kv_a_proj_with_mqa.weight",
    "attention.kv_a_norm.weight": "self_attn.kv_a_layernorm.weight",
    "attention.wkv_b.weight": "self_attn.kv_b_proj.weight",
    # Gated DeltaNet layers (models/linear_attention.py)
    **{
        f"attention.{name}": f"linear_attn.{name}"
        for name in (
            "in_proj_qkv.weight",
            "in_proj_z.weight",
            "in_proj_qkvz.weight",
            "in_proj_ba.weight",
            "in_proj_b.weight",
            "in_proj_a.weight",
            "conv1d.weight",
            "dt_bias",
            "A_log",
            "norm.weight",
            "out_proj.weight",
        )
    },
}
# Gemma's four norms: HF's post_attention_layernorm is the one *after* attention there.
_GEMMA_BLOCK_NAMES = {
    **_BLOCK_NAMES,
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "post_ffn_norm.weight": "post_feedforward_layernorm.weight",
}
# Gemma 4: a block's per-layer input and its output scalar besides
_GEMMA4_BLOCK_NAMES = {
    **_GEMMA_BLOCK_NAMES,
    "per_layer.gate.weight": "per_layer_input_gate.weight",
    "per_layer.up.weight": "per_layer_projection.weight",
    "per_layer.norm.weight": "post_per_layer_input_norm.weight",
    "scalar": "layer_scalar",
    # 26B-A4B: the experts beside the dense MLP, each a single stacked tensor
    "feed_forward.router.weight": "router.proj.weight",
    "feed_forward.router_scale": "router.scale",
    "feed_forward.expert_scale": "router.per_expert_scale",
    "feed_forward.experts.w13": "experts.gate_up_proj",
    "feed_forward.experts.w2": "experts.down_proj",
    "feed_forward.post_mlp_norm.weight": "post_feedforward_layernorm_1.weight",
    "feed_forward.pre_experts_norm.weight": "pre_feedforward_layernorm_2.weight",
    "feed_forward.post_experts_norm.weight": "post_feedforward_layernorm_2.weight",
}
# gpt-oss: biases on o_proj, a sink per head, a router with a bias, experts with biases; the
# experts as one stacked tensor each, in the hub's layout (`_LAYOUTS`)
_GPT_OSS_BLOCK_NAMES = {
    **_BLOCK_NAMES,
    "attention.wo.bias": "self_attn.o_proj.bias",
    "attention.sinks": "self_attn.sinks",
    "feed_forward.router.weight": "mlp.router.weight",
    "feed_forward.router.bias": "mlp.router.bias",
    "feed_forward.experts.w13": "mlp.experts.gate_up_proj",
    "feed_forward.experts.b13": "mlp.experts.gate_up_proj_bias",
    "feed_forward.experts.w2": "mlp.experts.down_proj",
    "feed_forward.experts.b2": "mlp.experts.down_proj_bias",
}
# ... whose checkpoints keep key/value weights in the layers that reuse an earlier layer's keys
# and values, unused there (transformers ignores them too)
UNUSED_IN_REUSE = ("self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.k_norm.weight")
# OLMo 3's two norms, both after: no input_layernorm, and post_attention_layernorm is after
# attention as in Gemma.
_OLMO_BLOCK_NAMES = {
    **{
        k: v
        for k, v in _BLOCK_NAMES.items()
        if k not in ("attention_norm.weight", "ffn_norm.weight")
    },
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "post_ffn_norm.weight": "post_feedforward_layernorm.weight",
}
_NATIVE_BLOCK = re.compile(r"layers\.(\d+)\.(.+)")
HF_BLOCK = re.compile(r"model\.layers\.(\d+)\.(.+)")


# MoE blocks: the router, and the experts the hub stores one tensor per expert and projection:
# (module path of the experts, names of gate, up and down); native experts.w13 holds gate and
# up of every expert, experts.w2 down (models/moe.py).
_ROUTER_NAMES = {
    "qwen3_moe": "mlp.gate.weight",
    "qwen3_5_moe_text": "mlp.gate.weight",
    "qwen3_next": "mlp.gate.weight",
    "mixtral": "block_sparse_moe.gate.weight",
    "deepseek_v3": "mlp.gate.weight",
    "glm4_moe": "mlp.gate.weight",
}
_EXPERT_NAMES = {
    "qwen3_moe": ("mlp.experts", ("gate_proj", "up_proj", "down_proj")),
    "qwen3_5_moe_text": ("mlp.experts", ("gate_proj", "up_proj", "down_proj")),
    "qwen3_next": ("mlp.experts", ("gate_proj", "up_proj", "down_proj")),
    "mixtral": ("block_sparse_moe.experts", ("w1", "w3", "w2")),
    "deepseek_v3": ("mlp.experts", ("gate_proj", "up_proj", "down_proj")),
    "glm4_moe": ("mlp.experts", ("gate_proj", "up_proj", "down_proj")),
}
_NATIVE_EXPERTS = ("feed_forward.experts.w13", "feed_forward.experts.w2")
# the gated shared expert beside the routed ones (Qwen3.5-MoE)
_SHARED_EXPERT = ("qwen3_5_moe_text", "qwen3_next")
_SHARED_NAMES = {
    "feed_forward.shared.w1.weight": "mlp.shared_expert.gate_proj.weight",
    "feed_forward.shared.w3.weight": "mlp.shared_expert.up_proj.weight",
    "feed_forward.shared.w2.weight": "mlp.shared_expert.down_proj.weight",
    "feed_forward.shared.gate.weight": "mlp.shared_expert_gate.weight",
}
# DeepSeek-V3 / GLM-4.5: the router's correction bias and the (ungated) shared experts
SIGMOID_ROUTED = ("deepseek_v3", "glm4_moe")
_SIGMOID_NAMES = {
    "feed_forward.score_bias": "mlp.gate.e_score_correction_bias",
    "feed_forward.shared.w1.weight": "mlp.shared_experts.gate_proj.weight",
    "feed_forward.shared.w3.weight": "mlp.shared_experts.up_proj.weight",
    "feed_forward.shared.w2.weight": "mlp.shared_experts.down_proj.weight",
}
_GLOBAL_NAMES_INV = {v: k for k, v in _GLOBAL_NAMES.items()}


def _block_names(family: str) -> dict[str, str]:
    if family == "gemma4_text":
        return _GEMMA4_BLOCK_NAMES
    if family == "gpt_oss":
        return _GPT_OSS_BLOCK_NAMES
    if family.startswith("gemma"):
        return _GEMMA_BLOCK_NAMES
    if family == "olmo3":
        return _OLMO_BLOCK_NAMES
    if family in _ROUTER_NAMES:
        names = {**_BLOCK_NAMES, "feed_forward.router.weight": _ROUTER_NAMES[family]}
        if family in SIGMOID_ROUTED:
            return {**names, **_SIGMOID_NAMES}
        return {**names, **_SHARED_NAMES} if family in _SHARED_EXPERT else names
    return _BLOCK_NAMES


def _block_names_inv(family: str) -> dict[str, str]:
    return {v: k for k, v in _block_names(family).items()}


def to_hf_name(native: str, family: str = DEFAULT_FAMILY) -> str:
    """`layers.3.attention.wq.weight` -> `model.layers.3.self_attn.q_proj.weight`."""
    native = strip_wrappers(native)
    if native in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[native]
    m = _NATIVE_BLOCK.fullmatch(native)
    names = _block_names(family)
    if m and m.group(2) in names:
        return f"model.layers.{m.group(1)}.{names[m.group(2)]}"
    raise UserError(
        f"parameter {native!r} has no HF name; only compiletune decoder models can be saved"
    )


def to_native_name(hf: str, family: str = DEFAULT_FAMILY) -> str:
    """`model.layers.3.mlp.gate_proj.weight` -> `layers.3.feed_forward.w1.weight`."""
    if hf in _GLOBAL_NAMES_INV:
        return _GLOBAL_NAMES_INV[hf]
    m = HF_BLOCK.fullmatch(hf)
    inverse = _block_names_inv(family)
    if m and m.group(2) in inverse:
        return f"layers.{m.group(1)}.{inverse[m.group(2)]}"
    if m and family in _EXPERT_NAMES:
        prefix, (gate, up, down) = _EXPERT_NAMES[family]
        e = re.fullmatch(re.escape(prefix) + r"\.\d+\.(\w+)\.weight", m.group(2))
        if e and e.group(1) in (gate, up, down):
            return f"layers.{m.group(1)}.{_NATIVE_EXPERTS[e.group(1) == down]}"
    raise UserError(
        f"checkpoint tensor {hf!r} is not part of a supported decoder "
        f"({', '.join(ARCHITECTURES)}); use a checkpoint of a supported architecture"
    )


Index = tuple[int | slice, ...]


# Tensors a family's checkpoints lay out otherwise than the native module: (to native, to HF).
# gpt-oss keeps its experts' weights transposed ([E, in, out]) with the gate and up columns
# interleaved (gate, up, gate, up, ...); native w13 is [E, 2F, d], gate rows then up rows.
def interleave(t: Tensor, dim: int) -> Tensor:
    """The two halves of `dim` (gate, up) -> alternating (gate, up, gate, up ...)."""
    gate, up = t.chunk(2, dim=dim)
    return torch.stack((gate, up), dim=dim + 1).flatten(dim, dim + 1)


def deinterleave(t: Tensor, dim: int) -> Tensor:
    """The inverse of `interleave`."""
    index = [slice(None)] * t.dim()
    gate, up = (tuple(index[:dim] + [slice(i, None, 2)]) for i in (0, 1))
    return torch.cat((t[gate], t[up]), dim=dim)


_LAYOUTS: dict[str, dict[str, tuple[Callable[[Tensor], Tensor], Callable[[Tensor], Tensor]]]] = {
    "gpt_oss": {
        "feed_forward.experts.w13": (
            lambda t: deinterleave(t.transpose(1, 2), 1),
            lambda t: interleave(t, 1).transpose(1, 2),
        ),
        "feed_forward.experts.b13": (
            lambda t: deinterleave(t, 1),
            lambda t: interleave(t, 1),
        ),
        "feed_forward.experts.w2": (lambda t: t.transpose(1, 2), lambda t: t.transpose(1, 2)),
    }
}


def layout(
    native: str, family: str
) -> tuple[Callable[[Tensor], Tensor], Callable[[Tensor], Tensor]] | None:
    """(to native, to HF) for a tensor the family's checkpoints lay out otherwise, else None."""
    m = _NATIVE_BLOCK.fullmatch(strip_wrappers(native))
    return _LAYOUTS.get(family, {}).get(m.group(2)) if m else None


def hf_pieces(
    native: str, shape: tuple[int, ...], family: str = DEFAULT_FAMILY
) -> list[tuple[str, Index, tuple[int, ...]]]:
    """The HF tensors a native tensor is stored as: (HF name, index into the native tensor, the
    piece's shape). One piece, the whole tensor, except for stacked experts, which the hub keeps
    as one tensor per expert and projection: w13 [E, 2F, d] -> gate and up [F, d] of each expert
    (rows :F and F:), w2 [E, d, F] -> down [d, F] of each."""
    native = strip_wrappers(native)
    m = _NATIVE_BLOCK.fullmatch(native)
    if not (m and m.group(2) in _NATIVE_EXPERTS and family in _EXPERT_NAMES):
        convert = layout(native, family)
        if convert is not None:  # the stored shape
            shape = tuple(convert[1](torch.empty(shape, device="meta")).shape)
        return [(to_hf_name(native, family), (), tuple(shape))]
    prefix, (gate, up, down) = _EXPERT_NAMES[family]
    base = f"model.layers.{m.group(1)}.{prefix}"
    n_experts, rows, cols = shape
    if m.group(2) == _NATIVE_EXPERTS[1]:
        return [(f"{base}.{e}.{down}.weight", (e,), (rows, cols)) for e in range(n_experts)]
    half = rows // 2
    return [
        (f"{base}.{e}.{name}.weight", (e, part), (half, cols))
        for e in range(n_experts)
        for name, part in ((gate, slice(0, half)), (up, slice(half, rows)))
    ]


def state_dict_to_hf(
    sd: dict[str, Tensor], tie_embeddings: bool = False, family: str = DEFAULT_FAMILY
) -> dict[str, Tensor]:
    """Rename a native state dict to HF names (dropping `output.weight` when tied; stacked
    experts split into the hub's per-expert tensors)."""
    out = {}
    for k, v in sd.items():
        convert = layout(k, family)
        for hf, index, _ in hf_pieces(k, tuple(v.shape), family):
            if not (tie_embeddings and hf == "lm_head.weight"):
                out[hf] = v[index] if convert is None else convert[1](v).contiguous()
    return out
