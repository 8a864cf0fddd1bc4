"""gpt-oss (GptOssForCausalLM): a sink per head, o_proj with a bias, 128-token windows on
alternate layers, experts with biases and a clamped SwiGLU, stored stacked, transposed and
with gate and up interleaved (MXFP4 on the hub)."""

from __future__ import annotations

from typing import Any

from ..args import ModelArgs, RopeScaling
from ..layouts import deinterleave, interleave
from ..names import BLOCK_NAMES
from .base import Family, Get
from .llama import debug_like
from .shared import top_k

# gpt-oss: biases on o_proj, a sink per head, a router with a bias, experts with biases; the
# experts as one stacked tensor each, in the hub's layout (`_LAYOUTS`)
_GPT_OSS_BLOCK_NAMES = {
    **BLOCK_NAMES,
    "attention.wo.bias": "self_attn.o_proj.bias",
    "attention.sinks": "self_attn.sinks",
    "feed_forward.router.weight": "mlp.router.weight",
    "feed_forward.router.bias": "mlp.router.bias",
    "feed_forward.experts.w13": "mlp.experts.gate_up_proj",
    "feed_forward.experts.b13": "mlp.experts.gate_up_proj_bias",
    "feed_forward.experts.w2": "mlp.experts.down_proj",
    "feed_forward.experts.b2": "mlp.experts.down_proj_bias",
}


def _gpt_oss_w13_to_native(t):
    return deinterleave(t.transpose(1, 2), 1)


def _gpt_oss_w13_to_hf(t):
    return interleave(t, 1).transpose(1, 2)


def _transpose(t):
    return t.transpose(1, 2)


# gpt-oss keeps its experts' weights transposed ([E, in, out]) with the gate and up columns
# interleaved (gate, up, gate, up, ...); native w13 is [E, 2F, d], gate rows then up rows.
_GPT_OSS_LAYOUTS = {
    "feed_forward.experts.w13": (_gpt_oss_w13_to_native, _gpt_oss_w13_to_hf),
    "feed_forward.experts.b13": (lambda t: deinterleave(t, 1), lambda t: interleave(t, 1)),
    "feed_forward.experts.w2": (_transpose, _transpose),
}


def _alternating(cfg: dict, n_layers: int) -> tuple[str, ...]:
    """The default layer kinds: sliding first, then alternating."""
    return tuple("sliding" if i % 2 == 0 else "full" for i in range(n_layers))


def read_gpt_oss_moe(cfg: dict, n_layers: int, get: Get) -> dict[str, Any]:
    n_experts = cfg.get("num_local_experts") or get("num_experts") or get("num_local_experts")
    return dict(
        n_experts=n_experts,
        top_k=top_k(get, n_experts),
        moe_ffn_dim=get("intermediate_size"),
        norm_topk=True,  # softmax over the chosen logits = renormalised top-k probabilities
        router_aux_coef=float(get("router_aux_loss_coef")),
    )


def read_gpt_oss(cfg: dict, n_layers: int, get: Get) -> dict[str, Any]:
    """gpt-oss: sinks, o_proj's bias, the experts' biases and clamped SwiGLU, norms whose
    weight multiplies in fp32."""
    return dict(
        attn_sinks=True,
        o_bias=bool(get("attention_bias", True)),
        expert_bias=True,
        swiglu_limit=float(get("swiglu_limit")),
        swiglu_alpha=float(get("swiglu_alpha")),
        norm_weight_fp32=True,
    )


def write_gpt_oss(args: ModelArgs, cfg: dict) -> None:
    cfg.update(
        num_local_experts=args.n_experts,
        num_experts_per_tok=args.top_k,
        intermediate_size=args.moe_ffn_dim,
        router_aux_loss_coef=args.router_aux_coef,
        swiglu_limit=args.swiglu_limit,
        swiglu_alpha=args.swiglu_alpha,
        attention_bias=True,
    )
    cfg.pop("num_experts", None)


def _gpt_oss(n_layers: int, n_experts: int) -> ModelArgs:
    """openai/gpt-oss: 2880 wide, 64 query and 8 kv heads of 64 with a sink each, 128-token
    windows on alternate layers (the first windowed), yarn rope, experts with biases and a
    clamped SwiGLU, 4 per token."""
    return ModelArgs(
        dim=2880,
        n_layers=n_layers,
        n_heads=64,
        n_kv_heads=8,
        vocab_size=201088,
        ffn_dim=2880,
        head_dim=64,
        norm_eps=1e-5,
        rope_theta=150000.0,
        rope_scaling=RopeScaling(
            32.0, original_max_position_embeddings=4096, rope_type="yarn", truncate=False
        ),
        max_seq_len=131072,
        qkv_bias=True,
        sliding_window=128,
        layer_types=tuple("sliding" if i % 2 == 0 else "full" for i in range(n_layers)),
        family="gpt_oss",
        norm_weight_fp32=True,
        n_experts=n_experts,
        top_k=4,
        moe_ffn_dim=2880,
        router_aux_coef=0.001,
        attn_sinks=True,
        o_bias=True,
        expert_bias=True,
        swiglu_limit=7.0,
    )


PRESETS: dict[str, ModelArgs] = {
    # openai/gpt-oss-20b, gpt-oss-120b
    "gpt_oss_20b": _gpt_oss(24, 32),
    "gpt_oss_120b": _gpt_oss(36, 128),
    # gpt-oss's: sinks, 64-token windows on alternate layers, 8 experts (2 per token) with
    # biases and the clamped SwiGLU
    "debug_gpt_oss": debug_like(
        family="gpt_oss",
        qkv_bias=True,
        o_bias=True,
        attn_sinks=True,
        sliding_window=64,
        layer_types=("sliding", "full", "sliding", "full"),
        norm_weight_fp32=True,
        ffn_dim=256,
        n_experts=8,
        top_k=2,
        moe_ffn_dim=256,
        expert_bias=True,
        swiglu_limit=7.0,
        router_aux_coef=0.001,
    ),
}


FAMILY = Family(
    "gpt_oss",
    "GptOssForCausalLM",
    {
        "vocab_size": 201088,
        "hidden_size": 2880,
        "intermediate_size": 2880,
        "num_hidden_layers": 36,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
        "head_dim": 64,
        "sliding_window": 128,
        "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-5,
        "rope_theta": 150000.0,
        "tie_word_embeddings": False,
        "num_local_experts": 128,
        "num_experts_per_tok": 4,
        "router_aux_loss_coef": 0.001,
        "swiglu_limit": 7.0,
        "swiglu_alpha": 1.702,
        "attention_bias": True,
    },
    qkv_bias=True,
    windows=True,
    layer_kinds=_alternating,
    read_moe=read_gpt_oss_moe,
    write_moe=write_gpt_oss,
    read_extra=read_gpt_oss,
    block_names=_GPT_OSS_BLOCK_NAMES,
    layouts=_GPT_OSS_LAYOUTS,
    gate_up_interleaved=True,
    quantizations=("mxfp4",),
    presets=PRESETS,
)
