"""GLM-4.5 (Glm4MoeForCausalLM): q/k/v biases (attention_bias), optional q/k norms, half of each
head rotated, sigmoid routing with a shared expert, the first layer dense."""

from __future__ import annotations

from typing import Any

from ..args import ModelArgs
from ..names import PER_EXPERT_NAMES, SIGMOID_ROUTER_NAMES
from .base import Family, Get
from .shared import read_sigmoid_moe, routed_names, write_sigmoid_moe


def read_glm4_moe(cfg: dict, n_layers: int, get: Get) -> dict[str, Any]:
    return dict(qk_norm=bool(get("use_qk_norm", False)))


def write_glm4_moe(args: ModelArgs, cfg: dict) -> None:
    cfg.update(use_qk_norm=args.qk_norm, attention_bias=args.qkv_bias)


def _glm4_5_air() -> ModelArgs:
    """zai-org/GLM-4.5-Air: 4096 wide, 46 layers (the first dense), 96 query and 8 kv heads of
    128 with q/k/v biases and half of each head rotating, 128 routed experts of 1408 (8 per
    token, sigmoid routing) and one shared."""
    return ModelArgs(
        dim=4096,
        n_layers=46,
        n_heads=96,
        n_kv_heads=8,
        vocab_size=151552,
        ffn_dim=10944,
        head_dim=128,
        norm_eps=1e-5,
        rope_theta=1000000.0,
        max_seq_len=131072,
        qkv_bias=True,
        family="glm4_moe",
        rotary_dim=64,
        n_experts=128,
        top_k=8,
        moe_ffn_dim=1408,
        dense_layers=(0,),
        shared_ffn_dim=1408,
        router_score="sigmoid",
    )


PRESETS: dict[str, ModelArgs] = {
    "glm4_5_air": _glm4_5_air(),
}


FAMILY = Family(
    "glm4_moe",
    "Glm4MoeForCausalLM",
    {
        "vocab_size": 151552,
        "hidden_size": 4096,
        "intermediate_size": 10944,
        "num_hidden_layers": 46,
        "num_attention_heads": 96,
        "num_key_value_heads": 8,
        "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "partial_rotary_factor": 0.5,
        "moe_intermediate_size": 1408,
        "num_experts_per_tok": 8,
        "n_shared_experts": 1,
        "n_routed_experts": 128,
        "routed_scaling_factor": 1.0,
        "n_group": 1,
        "topk_group": 1,
        "first_k_dense_replace": 1,
        "norm_topk_prob": True,
    },
    bias_flag=True,
    read_moe=read_sigmoid_moe,
    write_moe=write_sigmoid_moe,
    read_extra=read_glm4_moe,
    write_extra=write_glm4_moe,
    block_names=routed_names("mlp.gate.weight", SIGMOID_ROUTER_NAMES),
    expert_names=PER_EXPERT_NAMES,
    extra_layers_unused=True,
    presets=PRESETS,
)
