"""DeepSeek-V3 (and V3.1, R1; DeepseekV3ForCausalLM): multi-head latent attention, sigmoid routing
over expert groups with a shared expert, the first layers dense; the multi-token-prediction
layer its checkpoints store after the last is left unused."""

from __future__ import annotations

from typing import Any

from compiletune.errors import UserError

from ..args import ModelArgs, RopeScaling
from ..names import PER_EXPERT_NAMES, SIGMOID_ROUTER_NAMES
from .base import Family, Get
from .llama import debug_like
from .shared import read_sigmoid_moe, routed_names, write_sigmoid_moe


def read_mla(cfg: dict, n_layers: int, get: Get) -> dict[str, Any]:
    """DeepSeek-V3's multi-head latent attention: config.json's head_dim is the rope part
    (transformers sets it so), the q/k head is nope + rope wide."""
    rope, nope = int(get("qk_rope_head_dim")), int(get("qk_nope_head_dim"))
    if rope % 2 or rope <= 0 or nope <= 0:
        raise UserError(
            f"config.json qk_rope_head_dim {rope} must be even and positive, qk_nope_head_dim "
            f"{nope} positive"
        )
    dim, heads = get("hidden_size"), get("num_attention_heads")
    return dict(
        kv_rank=int(get("kv_lora_rank")),
        q_rank=int(cfg.get("q_lora_rank") or 0),
        v_head_dim=int(get("v_head_dim")),
        head_dim=nope + rope if nope + rope != dim // heads else None,
        rotary_dim=rope,
        rope_interleave=bool(get("rope_interleave", True)),
        n_kv_heads=heads,
    )


def write_mla(args: ModelArgs, cfg: dict) -> None:
    rope = args.rotary_dim or 0
    cfg.update(
        kv_lora_rank=args.kv_rank,
        q_lora_rank=args.q_rank or None,
        qk_rope_head_dim=rope,
        qk_nope_head_dim=args.hd - rope,
        v_head_dim=args.v_head_dim,
        rope_interleave=args.rope_interleave,
        head_dim=rope,
        num_key_value_heads=args.n_heads,
        attention_bias=False,
    )
    cfg.pop("partial_rotary_factor", None)
    if isinstance(cfg.get("rope_parameters"), dict):
        cfg["rope_parameters"].pop("partial_rotary_factor", None)


def _deepseek_v3() -> ModelArgs:
    """deepseek-ai/DeepSeek-V3 (and V3.1, R1: the same shape): 7168 wide, 61 layers (the first
    3 dense), MLA with 128 heads (q latent 1536, kv latent 512, heads 128 + 64 rope wide, values
    128), 256 routed experts of 2048 (8 per token within 4 of 8 groups, weights x 2.5) and one
    shared, yarn rope x40. The multi-token-prediction layer of the checkpoint is not part of it."""
    return ModelArgs(
        dim=7168,
        n_layers=61,
        n_heads=128,
        n_kv_heads=128,
        vocab_size=129280,
        ffn_dim=18432,
        head_dim=192,
        norm_eps=1e-6,
        rope_theta=10000.0,
        rope_scaling=RopeScaling(
            40.0,
            original_max_position_embeddings=4096,
            rope_type="yarn",
            mscale=1.0,
            mscale_all_dim=1.0,
        ),
        max_seq_len=163840,
        family="deepseek_v3",
        rotary_dim=64,
        n_experts=256,
        top_k=8,
        moe_ffn_dim=2048,
        dense_layers=(0, 1, 2),
        shared_ffn_dim=2048,
        kv_rank=512,
        q_rank=1536,
        v_head_dim=128,
        rope_interleave=True,
        router_score="sigmoid",
        n_groups=8,
        topk_groups=4,
        routed_scale=2.5,
    )


PRESETS: dict[str, ModelArgs] = {
    "deepseek_v3": _deepseek_v3(),
    # DeepSeek-V3's: MLA (q latent 128, kv latent 64, rope part 16), sigmoid routing over 2 of
    # 4 groups of 8 experts (2 per token), a shared expert, the first layer dense
    "debug_deepseek": debug_like(
        family="deepseek_v3",
        n_kv_heads=8,
        head_dim=48,
        rotary_dim=16,
        kv_rank=64,
        q_rank=128,
        v_head_dim=32,
        rope_interleave=True,
        n_experts=8,
        top_k=2,
        moe_ffn_dim=256,
        dense_layers=(0,),
        shared_ffn_dim=256,
        router_score="sigmoid",
        n_groups=4,
        topk_groups=2,
        routed_scale=2.5,
    ),
}


FAMILY = Family(
    "deepseek_v3",
    "DeepseekV3ForCausalLM",
    {
        "vocab_size": 129280,
        "hidden_size": 7168,
        "intermediate_size": 18432,
        "moe_intermediate_size": 2048,
        "num_hidden_layers": 61,
        "num_attention_heads": 128,
        "n_shared_experts": 1,
        "n_routed_experts": 256,
        "routed_scaling_factor": 2.5,
        "kv_lora_rank": 512,
        "q_lora_rank": 1536,
        "qk_rope_head_dim": 64,
        "v_head_dim": 128,
        "qk_nope_head_dim": 128,
        "n_group": 8,
        "topk_group": 4,
        "num_experts_per_tok": 8,
        "first_k_dense_replace": 3,
        "norm_topk_prob": True,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "rope_interleave": True,
    },
    read_moe=read_sigmoid_moe,
    write_moe=write_sigmoid_moe,
    read_extra=read_mla,
    write_extra=write_mla,
    block_names=routed_names("mlp.gate.weight", SIGMOID_ROUTER_NAMES),
    expert_names=PER_EXPERT_NAMES,
    extra_layers_unused=True,
    presets=PRESETS,
)
