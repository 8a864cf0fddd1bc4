"""Mixtral (MixtralForCausalLM): Mistral's decoder with 8 softmax top-2 experts in every layer."""

from __future__ import annotations

from typing import Any

from compiletune.errors import UserError

from ..args import ModelArgs
from .base import Family, Get
from .shared import routed_names, top_k


def read_mixtral(cfg: dict, n_layers: int, get: Get) -> dict[str, Any]:
    if get("router_jitter_noise", 0.0):
        raise UserError(
            f"config.json sets router_jitter_noise: {cfg['router_jitter_noise']}, which is "
            "not supported; set it 0 (Mixtral checkpoints ship with 0)"
        )
    n_experts = get("num_local_experts")
    return dict(
        n_experts=n_experts,
        top_k=top_k(get, n_experts),
        moe_ffn_dim=get("intermediate_size"),
        norm_topk=True,
        dense_layers=(),
        router_aux_coef=float(get("router_aux_loss_coef")),
    )


def write_mixtral(args: ModelArgs, cfg: dict) -> None:
    if not args.norm_topk or args.dense_layers or args.moe_ffn_dim != args.ffn_dim:
        raise UserError(
            "a Mixtral model renormalises its top-k weights, has no dense layers and one "
            "MLP width; these args have no Mixtral checkpoint"
        )
    cfg.update(
        num_local_experts=args.n_experts,
        num_experts_per_tok=args.top_k,
        router_aux_loss_coef=args.router_aux_coef,
        router_jitter_noise=0.0,
    )


def _mixtral(
    dim: int, n_layers: int, n_heads: int, ffn_dim: int, vocab_size: int, max_seq_len: int
) -> ModelArgs:
    return ModelArgs(
        dim=dim,
        n_layers=n_layers,
        n_heads=n_heads,
        n_kv_heads=8,
        vocab_size=vocab_size,
        ffn_dim=ffn_dim,
        norm_eps=1e-5,
        rope_theta=1000000.0,
        max_seq_len=max_seq_len,
        family="mixtral",
        n_experts=8,
        top_k=2,
        moe_ffn_dim=ffn_dim,
        router_aux_coef=0.02,
    )


PRESETS: dict[str, ModelArgs] = {
    # mistralai/Mixtral-8x7B-v0.1, Mixtral-8x22B-v0.1: 8 experts, 2 per token
    "mixtral_8x7b": _mixtral(4096, 32, 32, 14336, 32000, 32768),
    "mixtral_8x22b": _mixtral(6144, 56, 48, 16384, 32768, 65536),
}


FAMILY = Family(
    "mixtral",
    "MixtralForCausalLM",
    {
        "rms_norm_eps": 1e-5,
        "max_position_embeddings": 131072,
        "num_key_value_heads": 8,
        "rope_theta": 1000000.0,
        "num_local_experts": 8,
        "num_experts_per_tok": 2,
        "router_aux_loss_coef": 0.001,
    },
    windows=True,
    read_moe=read_mixtral,
    write_moe=write_mixtral,
    block_names=routed_names("block_sparse_moe.gate.weight"),
    expert_names=("block_sparse_moe.experts", ("w1", "w3", "w2")),
    presets=PRESETS,
)
