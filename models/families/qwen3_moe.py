"""Qwen3-MoE (Qwen3MoeForCausalLM): Qwen3's attention, softmax top-k experts stored one tensor per
expert, dense layers listed in mlp_only_layers."""

from __future__ import annotations

import dataclasses
from typing import Any

from compiletune.errors import UserError

from ..args import ModelArgs
from ..names import PER_EXPERT_NAMES
from .base import Family, Get
from .llama import debug_like
from .qwen2 import QWEN_DEFAULTS
from .qwen3 import qwen3_args
from .shared import routed_names, top_k


def read_qwen3_moe(cfg: dict, n_layers: int, get: Get) -> dict[str, Any]:
    # the hub's configs say num_experts; transformers 5 saves num_local_experts
    n_experts = cfg.get("num_experts") or get("num_local_experts") or get("num_experts")
    step = int(get("decoder_sparse_step") or 1)
    only = cfg.get("mlp_only_layers") or []
    if not isinstance(only, list) or not all(
        isinstance(i, int) and 0 <= i < n_layers for i in only
    ):
        raise UserError(f"config.json mlp_only_layers must list layer indices in 0..{n_layers - 1}")
    return dict(
        n_experts=n_experts,
        top_k=top_k(get, n_experts),
        moe_ffn_dim=get("moe_intermediate_size"),
        norm_topk=bool(get("norm_topk_prob")),
        dense_layers=tuple(i for i in range(n_layers) if i in only or (i + 1) % step),
        router_aux_coef=float(get("router_aux_loss_coef")),
    )


def write_qwen3_moe(args: ModelArgs, cfg: dict) -> None:
    cfg.update(
        num_experts=args.n_experts,
        num_local_experts=args.n_experts,  # transformers 5's name; both read either
        num_experts_per_tok=args.top_k,
        moe_intermediate_size=args.moe_ffn_dim,
        norm_topk_prob=args.norm_topk,
        decoder_sparse_step=1,
        mlp_only_layers=list(args.dense_layers),
        router_aux_loss_coef=args.router_aux_coef,
    )


def _qwen3_moe_args(
    dim: int, n_layers: int, n_heads: int, ffn_dim: int, moe_ffn_dim: int
) -> ModelArgs:
    return dataclasses.replace(
        qwen3_args(dim, n_layers, n_heads, ffn_dim, tie=False),
        n_kv_heads=4,
        family="qwen3_moe",
        n_experts=128,
        top_k=8,
        moe_ffn_dim=moe_ffn_dim,
        norm_topk=True,
        router_aux_coef=0.001,
    )


PRESETS: dict[str, ModelArgs] = {
    # Qwen/Qwen3-30B-A3B, Qwen3-235B-A22B: 128 experts, 8 per token, every layer MoE
    "qwen3_30b_a3b": _qwen3_moe_args(2048, 48, 32, 6144, 768),
    "qwen3_235b_a22b": _qwen3_moe_args(4096, 94, 64, 12288, 1536),
    # Qwen3-MoE-shaped: 8 experts, 2 per token, q/k norms; layer 1 dense (mlp_only_layers)
    "debug_moe": debug_like(
        family="qwen3_moe",
        qk_norm=True,
        n_experts=8,
        top_k=2,
        moe_ffn_dim=256,
        dense_layers=(1,),
        router_aux_coef=0.001,
    ),
}


FAMILY = Family(
    "qwen3_moe",
    "Qwen3MoeForCausalLM",
    {
        **QWEN_DEFAULTS,
        "num_key_value_heads": 4,
        "num_experts": 128,
        "num_local_experts": 128,
        "num_experts_per_tok": 8,
        "moe_intermediate_size": 768,
        "norm_topk_prob": False,
        "decoder_sparse_step": 1,
        "router_aux_loss_coef": 0.001,
    },
    qk_norm=True,
    qwen_window_flag=True,
    writes_attention_bias=True,
    read_moe=read_qwen3_moe,
    write_moe=write_qwen3_moe,
    block_names=routed_names("mlp.gate.weight"),
    expert_names=PER_EXPERT_NAMES,
    presets=PRESETS,
)
