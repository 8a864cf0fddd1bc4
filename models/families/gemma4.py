"""Gemma 4 (Gemma4ForCausalLM, and the text model of Gemma4ForConditionalGeneration): full layers
with their own head size and kv heads (keys as values), values normed, kv sharing, per-layer
inputs, and 26B-A4B's experts beside every layer's dense MLP."""

from __future__ import annotations

import dataclasses
from typing import Any

from compiletune.errors import UserError

from ..args import ModelArgs, RopeScaling
from .base import Family, Get, Vision
from .gemma2 import GEMMA_BLOCK_NAMES, GEMMA_DEFAULTS, gemma_common
from .gemma3 import gemma3_kinds
from .llama import debug_like

# Gemma 4: a block's per-layer input and its output scalar besides
_BLOCK_NAMES = {
    **GEMMA_BLOCK_NAMES,
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


def gemma4_kinds(cfg: dict, n_layers: int) -> tuple[str, ...]:
    """Five sliding layers per full one, and the last layer full (transformers' default)."""
    kinds = gemma3_kinds({}, n_layers)
    return (*kinds[:-1], "full")


def read_gemma4(cfg: dict, n_layers: int, get: Get) -> dict[str, Any]:
    """Gemma 4: plain-weight norms applied in fp32, unit scores scale, values normed; the full
    layers' own head size and kv heads (`global_head_dim` / `num_global_key_value_heads`, or
    transformers 5.2x's `per_layer_config`), keys as values there (`attention_k_eq_v`); kv
    sharing, double-wide MLPs, per-layer inputs."""
    kinds = [cfg.get("layer_types") or [], gemma4_kinds(cfg, n_layers)]
    kinds = [k.removesuffix("_attention") for k in (kinds[0] or kinds[1])]
    head_dim = get("head_dim")
    k_eq_v = bool(get("attention_k_eq_v", False))
    global_dim = get("global_head_dim")
    global_kv = get("num_global_key_value_heads") if k_eq_v else None
    overrides = cfg.get("per_layer_config")
    if overrides is not None:
        if not isinstance(overrides, dict):
            raise UserError("config.json per_layer_config must be an object")
        full = {str(i) for i, kind in enumerate(kinds) if kind == "full"}
        values = [overrides.get(i, overrides.get(int(i))) for i in full]
        extra = set(map(str, overrides)) - full
        if extra or any(v != values[0] for v in values) or not values:
            raise UserError(
                "config.json per_layer_config must give every full-attention layer the same "
                "overrides and no other layer any (Gemma 4's pattern)"
            )
        unknown = set(values[0] or {}) - {"head_dim", "num_key_value_heads"}
        if unknown:
            raise UserError(
                f"config.json per_layer_config sets {sorted(unknown)[0]!r}, which is not supported"
            )
        # it replaces global_head_dim: a full layer it leaves alone has the common sizes
        # (transformers 5.25 writes {} when they are equal)
        global_dim = (values[0] or {}).get("head_dim", head_dim)
        global_kv = (values[0] or {}).get("num_key_value_heads")
    shared = int(get("num_kv_shared_layers", 0))
    if not 0 <= shared < n_layers:
        raise UserError(
            f"config.json num_kv_shared_layers {shared} must be below num_hidden_layers {n_layers}"
        )
    first = n_layers - shared
    if shared and set(kinds[first:]) - set(kinds[:first]):
        raise UserError(
            "config.json num_kv_shared_layers: a shared layer has no earlier layer of its kind "
            "to take keys and values from"
        )
    ple = int(get("hidden_size_per_layer_input", 0) or 0)
    rope = cfg.get("rope_parameters") or {}
    full_rope = rope.get("full_attention") or {} if isinstance(rope, dict) else {}
    rope_type = full_rope.get("rope_type", "default")
    fields: dict[str, Any] = dict(
        norm_plus_one=False,
        norm_weight_fp32=True,
        query_pre_attn_scalar=1.0,
        v_norm=True,
        global_head_dim=global_dim if global_dim and global_dim != head_dim else None,
        global_kv_heads=global_kv
        if global_kv and global_kv != get("num_key_value_heads")
        else None,
        kv_from_k=k_eq_v,
        kv_shared_layers=shared,
        wide_shared_mlp=bool(get("use_double_wide_mlp", False)),
        ple_dim=ple,
        ple_vocab=int(get("vocab_size_per_layer_input") or get("vocab_size")) if ple else 0,
        layer_scalar=True,
    )
    if rope_type == "proportional":
        fields["rotary_dim"] = None  # the rotated fraction is the rope scaling's own
    return fields


def read_gemma4_moe(cfg: dict, n_layers: int, get: Get) -> dict[str, Any]:
    """Gemma 4 26B-A4B: experts beside every layer's dense MLP (`enable_moe_block`)."""
    if not get("enable_moe_block", False):
        return {}
    n_experts = get("num_experts", required=True)
    top_k = cfg.get("top_k_experts")
    if not (isinstance(top_k, int) and 0 < top_k <= n_experts):
        raise UserError(
            f"config.json top_k_experts {top_k!r} must be between 1 and num_experts {n_experts}"
        )
    return dict(
        n_experts=n_experts,
        top_k=top_k,
        moe_ffn_dim=get("moe_intermediate_size", required=True),
        norm_topk=True,
        mlp_beside_experts=True,
    )


def write_gemma4(args: ModelArgs, cfg: dict) -> None:
    for key in ("query_pre_attn_scalar", "attn_logit_softcapping", "rope_local_base_freq"):
        cfg.pop(key, None)
    cfg.pop("rope_scaling", None)  # the per-kind rope_parameters say it
    cfg.pop("partial_rotary_factor", None)
    global_dim = args.head_dim_of("full")
    global_kv = args.kv_heads_of("full")
    overrides = {"head_dim": global_dim}
    if args.kv_from_k:
        overrides["num_key_value_heads"] = global_kv
    full = [i for i in range(args.n_layers) if args.layer_kind(i) == "full"]
    cfg.update(
        global_head_dim=global_dim,
        num_global_key_value_heads=global_kv if args.kv_from_k else None,
        per_layer_config={str(i): dict(overrides) for i in full},
        attention_k_eq_v=args.kv_from_k,
        num_kv_shared_layers=args.kv_shared_layers,
        use_double_wide_mlp=args.wide_shared_mlp,
        hidden_size_per_layer_input=args.ple_dim,
        vocab_size_per_layer_input=args.ple_vocab or args.vocab_size,
        enable_moe_block=args.mlp_beside_experts,
        num_experts=args.n_experts or None,
        top_k_experts=args.top_k or None,
        moe_intermediate_size=args.moe_ffn_dim or None,
    )


def _gemma4(
    dim: int,
    n_layers: int,
    n_heads: int,
    n_kv_heads: int,
    global_kv_heads: int,
    ffn_dim: int,
) -> ModelArgs:
    """Gemma 4 31B's layout: five 1024-token sliding layers (head 256) per full one (head 512,
    keys as values, proportional rope over a quarter of the pairs), 262144 positions."""
    kinds = tuple("full" if (i + 1) % 6 == 0 else "sliding" for i in range(n_layers))
    return ModelArgs(
        dim=dim,
        n_heads=n_heads,
        n_kv_heads=n_kv_heads,
        vocab_size=262144,
        ffn_dim=ffn_dim,
        head_dim=256,
        rope_theta=1000000.0,
        rope_scaling=RopeScaling(1.0, rope_type="proportional", partial=0.25),
        max_seq_len=262144,
        sliding_window=1024,
        family="gemma4_text",
        qk_norm=True,
        query_pre_attn_scalar=1.0,
        local_rope_theta=10000.0,
        final_softcap=30.0,
        norm_weight_fp32=True,
        v_norm=True,
        global_head_dim=512,
        global_kv_heads=global_kv_heads,
        kv_from_k=True,
        layer_scalar=True,
        **{**gemma_common(n_layers, kinds), "norm_plus_one": False},
    )


PRESETS: dict[str, ModelArgs] = {
    # google/gemma-4-31B, gemma-4-26B-A4B (their text models; the MoE keeps each layer's dense
    # MLP beside 128 experts, 8 per token)
    "gemma4_31b": _gemma4(5376, 60, 32, 16, 4, 21504),
    "gemma4_26b_a4b": dataclasses.replace(
        _gemma4(2816, 30, 16, 8, 2, 2112),
        n_experts=128,
        top_k=8,
        moe_ffn_dim=704,
        mlp_beside_experts=True,
    ),
    # Gemma 4's: a full layer with a wider head whose keys are its values, per-layer inputs,
    # the last two layers attending over earlier layers' keys and values with wider MLPs
    "debug_gemma4": debug_like(
        family="gemma4_text",
        qk_norm=True,
        query_pre_attn_scalar=1.0,
        sliding_window=256,
        local_rope_theta=10000.0,
        rope_scaling=RopeScaling(1.0, rope_type="proportional", partial=0.25),
        **{**gemma_common(4, ("sliding", "full", "sliding", "full")), "norm_plus_one": False},
        final_softcap=30.0,
        norm_weight_fp32=True,
        v_norm=True,
        global_head_dim=64,
        global_kv_heads=1,
        kv_from_k=True,
        kv_shared_layers=2,
        wide_shared_mlp=True,
        ple_dim=32,
        ple_vocab=512,
        layer_scalar=True,
    ),
}


def gemma4_image_blocks(cfg: dict) -> tuple[str, ...]:
    """An image's tokens see each other on the sliding layers only, and only where the text
    config says "vision" (transformers' Gemma 4 keeps its full layers causal)."""
    text = cfg.get("text_config") or {}
    return ("sliding",) if text.get("use_bidirectional_attention") == "vision" else ()


FAMILY = Family(
    "gemma4_text",
    "Gemma4ForCausalLM",
    {
        **GEMMA_DEFAULTS,
        "vocab_size": 262144,
        "num_hidden_layers": 30,
        "max_position_embeddings": 131072,
        "sliding_window": 512,
        "query_pre_attn_scalar": None,
        "global_head_dim": 512,
        "hidden_size_per_layer_input": 256,
        "vocab_size_per_layer_input": 262144,
    },
    qk_norm=True,
    gemma=True,
    windows=True,
    local_rope=True,
    writes_attention_bias=True,
    layer_kinds=gemma4_kinds,
    read_moe=read_gemma4_moe,
    read_extra=read_gemma4,
    write_extra=write_gemma4,
    block_names=_BLOCK_NAMES,
    multimodal=("Gemma4ForConditionalGeneration",),
    vision=Vision("gemma4", "image_token_id", image_blocks=gemma4_image_blocks),
    presets=PRESETS,
)
