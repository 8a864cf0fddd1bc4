"""Qwen3-Next (Qwen3NextForCausalLM): Qwen3.5's layers with fused Gated DeltaNet projections
(in_proj_qkvz, in_proj_ba) and Qwen3-MoE's experts beside a gated shared expert."""

from __future__ import annotations

import dataclasses
from typing import Any

from ..args import ModelArgs
from ..names import GATED_SHARED_EXPERT_NAMES, PER_EXPERT_NAMES
from .base import Family, Get
from .qwen3_5 import LINEAR_DEFAULTS, qwen3_5_args, qwen3_5_kinds
from .qwen3_moe import read_qwen3_moe, write_qwen3_moe
from .shared import read_linear, routed_names, write_linear


def read_qwen3_next(cfg: dict, n_layers: int, get: Get) -> dict[str, Any]:
    fields = read_qwen3_moe(cfg, n_layers, get)
    fields.update(
        shared_ffn_dim=get("shared_expert_intermediate_size"),
        shared_expert_gate=True,
        **read_linear(cfg, n_layers, get),
        linear_fused=True,
    )
    return fields


def write_qwen3_next(args: ModelArgs, cfg: dict) -> None:
    write_qwen3_moe(args, cfg)
    cfg["shared_expert_intermediate_size"] = args.shared_ffn_dim
    cfg.pop("num_local_experts", None)


PRESETS: dict[str, ModelArgs] = {
    # Qwen/Qwen3-Next-80B-A3B-Base: the shape transformers' config defaults to
    "qwen3_next_80b_a3b": dataclasses.replace(
        qwen3_5_args(2048, 48, 16, 2, 5120, n_experts=512, moe_ffn_dim=512, shared_ffn_dim=512),
        family="qwen3_next",
        vocab_size=151936,
        top_k=10,
        linear_fused=True,
    ),
}


FAMILY = Family(
    "qwen3_next",
    "Qwen3NextForCausalLM",
    {
        "vocab_size": 151936,
        "hidden_size": 2048,
        "intermediate_size": 5632,
        "num_hidden_layers": 48,
        "num_attention_heads": 16,
        "num_key_value_heads": 2,
        "max_position_embeddings": 32768,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False,
        **LINEAR_DEFAULTS,
        "decoder_sparse_step": 1,
        "moe_intermediate_size": 512,
        "shared_expert_intermediate_size": 512,
        "num_experts_per_tok": 10,
        "num_experts": 512,
        "num_local_experts": 512,
        "norm_topk_prob": True,
        "router_aux_loss_coef": 0.001,
    },
    qk_norm=True,
    linear_layers=True,
    writes_attention_bias=True,
    layer_kinds=qwen3_5_kinds,
    read_moe=read_qwen3_next,
    write_moe=write_qwen3_next,
    write_extra=write_linear,
    block_names=routed_names("mlp.gate.weight", GATED_SHARED_EXPERT_NAMES),
    expert_names=PER_EXPERT_NAMES,
    presets=PRESETS,
)
