"""Qwen3.5 and Qwen3.5-MoE (Qwen3_5ForCausalLM, Qwen3_5MoeForCausalLM, and the text models of their
ConditionalGeneration checkpoints): three Gated DeltaNet layers per gated full-attention one,
(1 + w) norms, a quarter of each head rotated; the MoE one with a gated shared expert."""

from __future__ import annotations

from typing import Any

from compiletune.errors import UserError

from ..args import ModelArgs
from ..names import GATED_SHARED_EXPERT_NAMES, PER_EXPERT_NAMES
from .base import Family, Get, Vision
from .llama import debug_like
from .shared import read_linear, routed_names, top_k, write_linear

# What transformers' Qwen3.5, Qwen3.5-MoE and Qwen3-Next configs assume for their
# linear-attention layers and rotary fraction.
LINEAR_DEFAULTS: dict[str, Any] = {
    "head_dim": 256,
    "partial_rotary_factor": 0.25,
    "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 32,
}


def qwen3_5_kinds(cfg: dict, n_layers: int) -> tuple[str, ...]:
    interval = cfg.get("full_attention_interval", 4)
    if not (isinstance(interval, int) and not isinstance(interval, bool) and interval >= 1):
        raise UserError("config.json full_attention_interval must be a positive integer")
    return tuple("full" if (i + 1) % interval == 0 else "linear" for i in range(n_layers))


def read_qwen3_5_moe(cfg: dict, n_layers: int, get: Get) -> dict[str, Any]:
    n_experts = get("num_experts")
    return dict(
        n_experts=n_experts,
        top_k=top_k(get, n_experts),
        moe_ffn_dim=get("moe_intermediate_size"),
        ffn_dim=get("moe_intermediate_size"),  # no dense layer: the experts' width stands in
        norm_topk=True,
        dense_layers=(),
        router_aux_coef=float(get("router_aux_loss_coef")),
        shared_ffn_dim=get("shared_expert_intermediate_size"),
        shared_expert_gate=True,
    )


def write_qwen3_5_moe(args: ModelArgs, cfg: dict) -> None:
    if args.dense_layers or not args.norm_topk or not args.shared_expert_gate:
        raise UserError(
            "a Qwen3.5-MoE model has a MoE feed-forward in every layer, renormalised top-k "
            "weights and a gated shared expert; these args have no Qwen3.5-MoE checkpoint"
        )
    cfg.update(
        num_experts=args.n_experts,
        num_experts_per_tok=args.top_k,
        moe_intermediate_size=args.moe_ffn_dim,
        shared_expert_intermediate_size=args.shared_ffn_dim,
        router_aux_loss_coef=args.router_aux_coef,
    )
    cfg.pop("intermediate_size", None)


# Qwen3.5's layers: three Gated DeltaNet layers per gated full-attention one, (1 + w) norms, a
# quarter of each head rotated
_QWEN3_5 = dict(
    family="qwen3_5_text",
    head_dim=64,
    qk_norm=True,
    norm_plus_one=True,
    attn_output_gate=True,
    rotary_dim=16,
    layer_types=("linear", "linear", "linear", "full"),
    linear_k_heads=2,
    linear_v_heads=4,
    linear_k_dim=32,
    linear_v_dim=32,
)


def qwen3_5_args(
    dim: int, n_layers: int, n_heads: int, n_kv_heads: int, ffn_dim: int, **moe: Any
) -> ModelArgs:
    """Qwen3.5 / Qwen3-Next at full size: 256-wide heads, 16 key and 32 value heads of 128 in
    the Gated DeltaNet layers, rope base 1e7 over 262144 positions."""
    fields = {
        **_QWEN3_5,
        "dim": dim,
        "n_layers": n_layers,
        "n_heads": n_heads,
        "n_kv_heads": n_kv_heads,
        "vocab_size": 248320,
        "ffn_dim": ffn_dim,
        "head_dim": 256 if dim // n_heads != 256 else None,
        "rotary_dim": 64,
        "norm_eps": 1e-6,
        "rope_theta": 10000000.0,
        "max_seq_len": 262144,
        "layer_types": _QWEN3_5["layer_types"] * (n_layers // 4),
        "linear_k_heads": 16,
        "linear_v_heads": 32,
        "linear_k_dim": 128,
        "linear_v_dim": 128,
    }
    if moe:
        fields |= dict(top_k=8, norm_topk=True, shared_expert_gate=True, router_aux_coef=0.001)
        fields |= dict(family="qwen3_5_moe_text", **moe)
    return ModelArgs(**fields)


PRESETS: dict[str, ModelArgs] = {
    # Qwen/Qwen3.5-9B and Qwen3.5-35B-A3B (their text models: the cards' totals add the vision
    # tower), Qwen/Qwen3-Next-80B-A3B-Base: the shapes transformers' configs default to
    "qwen3_5_9b": qwen3_5_args(4096, 32, 16, 4, 12288),
    "qwen3_5_35b_a3b": qwen3_5_args(
        2048, 40, 16, 2, 512, n_experts=256, moe_ffn_dim=512, shared_ffn_dim=512
    ),
    # Qwen3.5's layers: three Gated DeltaNet layers per gated full-attention one, (1 + w)
    # norms, a quarter of each head rotated
    "debug_qwen3_5": debug_like(**_QWEN3_5),
    # Qwen3.5-MoE's: those layers with 8 experts (2 per token) and a gated shared expert
    "debug_qwen3_5_moe": debug_like(
        **{**_QWEN3_5, "family": "qwen3_5_moe_text"},
        ffn_dim=256,  # = moe_ffn_dim: no dense layer
        n_experts=8,
        top_k=2,
        moe_ffn_dim=256,
        shared_ffn_dim=256,
        shared_expert_gate=True,
        router_aux_coef=0.001,
    ),
}


def _presets_of(model_type: str) -> dict[str, ModelArgs]:
    return {name: args for name, args in PRESETS.items() if args.family == model_type}


# the vision transformer, and the 3-D text positions its images give the decoder
_VISION = Vision("qwen", "image_token_id", mrope=True)

FAMILIES = (
    Family(
        "qwen3_5_text",
        "Qwen3_5ForCausalLM",
        {
            "vocab_size": 248320,
            "hidden_size": 4096,
            "intermediate_size": 12288,
            "num_hidden_layers": 32,
            "num_attention_heads": 16,
            "num_key_value_heads": 4,
            "max_position_embeddings": 32768,
            "rms_norm_eps": 1e-6,
            "tie_word_embeddings": False,
            **LINEAR_DEFAULTS,
        },
        qk_norm=True,
        linear_layers=True,
        writes_attention_bias=True,
        layer_kinds=qwen3_5_kinds,
        read_extra=read_linear,
        write_extra=write_linear,
        multimodal=("Qwen3_5ForConditionalGeneration",),
        vision=_VISION,
        presets=_presets_of("qwen3_5_text"),
    ),
    Family(
        "qwen3_5_moe_text",
        "Qwen3_5MoeForCausalLM",
        {
            "vocab_size": 248320,
            "hidden_size": 2048,
            "num_hidden_layers": 40,
            "num_attention_heads": 16,
            "num_key_value_heads": 2,
            "max_position_embeddings": 32768,
            "rms_norm_eps": 1e-6,
            "tie_word_embeddings": False,
            **LINEAR_DEFAULTS,
            "moe_intermediate_size": 512,
            "shared_expert_intermediate_size": 512,
            "num_experts_per_tok": 8,
            "num_experts": 256,
            "router_aux_loss_coef": 0.001,
        },
        qk_norm=True,
        linear_layers=True,
        writes_attention_bias=True,
        layer_kinds=qwen3_5_kinds,
        read_moe=read_qwen3_5_moe,
        write_moe=write_qwen3_5_moe,
        read_extra=read_linear,
        write_extra=write_linear,
        block_names=routed_names("mlp.gate.weight", GATED_SHARED_EXPERT_NAMES),
        expert_names=PER_EXPERT_NAMES,
        multimodal=("Qwen3_5MoeForConditionalGeneration",),
        vision=_VISION,
        presets=_presets_of("qwen3_5_moe_text"),
    ),
)
