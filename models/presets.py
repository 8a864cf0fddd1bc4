"""Named model shapes, as data.

Published shapes are those of each model's HF config.json (base models). `head_dim` is left
None wherever it equals dim // n_heads (e.g. Llama 3.2's explicit 64 and 128) and set where it
differs (Qwen3 0.6B/4B/32B, Gemma, Mistral-Nemo), the same canonical form `args_from_hf_config`
produces, so a preset and a checkpoint's config compare equal. `num_params` counts parameters from the shape alone.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import re
from typing import Any

from compiletune.errors import UserError, closest

from .args import ModelArgs, RopeScaling
from .families import FAMILIES
from .families.llama import debug_like


def _qwen2_5(
    dim: int,
    n_layers: int,
    n_heads: int,
    n_kv_heads: int,
    ffn_dim: int,
    vocab_size: int,
    norm_eps: float,
    max_seq_len: int,
    tie: bool,
) -> ModelArgs:
    return ModelArgs(
        dim=dim,
        n_layers=n_layers,
        n_heads=n_heads,
        n_kv_heads=n_kv_heads,
        vocab_size=vocab_size,
        ffn_dim=ffn_dim,
        norm_eps=norm_eps,
        rope_theta=1000000.0,
        max_seq_len=max_seq_len,
        qkv_bias=True,
        tie_embeddings=tie,
        family="qwen2",
    )


def _mistral(
    vocab_size: int,
    rope_theta: float,
    max_seq_len: int,
    window: int | None,
    dim: int = 4096,
    n_layers: int = 32,
    hd: int | None = None,
) -> ModelArgs:
    return ModelArgs(
        dim=dim,
        n_layers=n_layers,
        n_heads=32,
        n_kv_heads=8,
        vocab_size=vocab_size,
        ffn_dim=14336,
        head_dim=hd,
        norm_eps=1e-5,
        rope_theta=rope_theta,
        max_seq_len=max_seq_len,
        sliding_window=window,
        family="mistral",
    )


def _qwen3(
    dim: int, n_layers: int, n_heads: int, ffn_dim: int, tie: bool, max_seq_len: int = 40960
) -> ModelArgs:
    return ModelArgs(
        dim=dim,
        n_layers=n_layers,
        n_heads=n_heads,
        n_kv_heads=8,
        vocab_size=151936,
        ffn_dim=ffn_dim,
        head_dim=128 if dim // n_heads != 128 else None,
        norm_eps=1e-6,
        rope_theta=1000000.0,
        max_seq_len=max_seq_len,
        tie_embeddings=tie,
        family="qwen3",
        qk_norm=True,
    )


def _qwen3_moe(dim: int, n_layers: int, n_heads: int, ffn_dim: int, moe_ffn_dim: int) -> ModelArgs:
    return dataclasses.replace(
        _qwen3(dim, n_layers, n_heads, ffn_dim, tie=False),
        n_kv_heads=4,
        family="qwen3_moe",
        n_experts=128,
        top_k=8,
        moe_ffn_dim=moe_ffn_dim,
        norm_topk=True,
        router_aux_coef=0.001,
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


def _gemma_common(n_layers: int, kinds: tuple[str, ...]) -> dict:
    return dict(
        n_layers=n_layers,
        norm_eps=1e-6,
        tie_embeddings=True,
        layer_types=kinds,
        norm_plus_one=True,
        embed_scale=True,
        activation="gelu_tanh",
        sandwich_norms=True,
    )


def _gemma2(
    dim: int, n_layers: int, n_heads: int, n_kv_heads: int, hd: int, ffn_dim: int, qpas: float
) -> ModelArgs:
    # layer 0 sliding, then alternating
    kinds = tuple("sliding" if i % 2 == 0 else "full" for i in range(n_layers))
    return ModelArgs(
        dim=dim,
        n_heads=n_heads,
        n_kv_heads=n_kv_heads,
        vocab_size=256000,
        ffn_dim=ffn_dim,
        head_dim=hd if dim // n_heads != hd else None,
        rope_theta=10000.0,
        max_seq_len=8192,
        sliding_window=4096,
        family="gemma2",
        query_pre_attn_scalar=qpas,
        attn_softcap=50.0,
        final_softcap=30.0,
        **_gemma_common(n_layers, kinds),
    )


def _gemma3(
    dim: int,
    n_layers: int,
    n_heads: int,
    n_kv_heads: int,
    hd: int,
    ffn_dim: int,
    vocab_size: int,
    window: int,
    max_seq_len: int,
    qpas: float,
    rope_factor: float | None,
) -> ModelArgs:
    # five sliding layers, then a global one
    kinds = tuple("full" if (i + 1) % 6 == 0 else "sliding" for i in range(n_layers))
    scaling = None if rope_factor is None else RopeScaling(rope_factor, rope_type="linear")
    return ModelArgs(
        dim=dim,
        n_heads=n_heads,
        n_kv_heads=n_kv_heads,
        vocab_size=vocab_size,
        ffn_dim=ffn_dim,
        head_dim=hd if dim // n_heads != hd else None,
        rope_theta=1000000.0,
        rope_scaling=scaling,
        max_seq_len=max_seq_len,
        sliding_window=window,
        family="gemma3_text",
        qk_norm=True,
        query_pre_attn_scalar=qpas,
        local_rope_theta=10000.0,
        **_gemma_common(n_layers, kinds),
    )


def _phi3(
    dim: int,
    n_layers: int,
    n_heads: int,
    n_kv_heads: int,
    ffn_dim: int,
    vocab_size: int,
    rope_theta: float,
    max_seq_len: int,
    window: int | None,
    tie: bool = False,
    rotary_dim: int | None = None,
) -> ModelArgs:
    return ModelArgs(
        dim=dim,
        n_layers=n_layers,
        n_heads=n_heads,
        n_kv_heads=n_kv_heads,
        vocab_size=vocab_size,
        ffn_dim=ffn_dim,
        norm_eps=1e-5,
        rope_theta=rope_theta,
        max_seq_len=max_seq_len,
        sliding_window=window,
        tie_embeddings=tie,
        family="phi3",
        rotary_dim=rotary_dim,
        fused_projections=True,
    )


def _smollm3(dim: int, n_layers: int, n_heads: int, ffn_dim: int) -> ModelArgs:
    return ModelArgs(
        dim=dim,
        n_layers=n_layers,
        n_heads=n_heads,
        n_kv_heads=4,
        vocab_size=128256,
        ffn_dim=ffn_dim,
        norm_eps=1e-6,
        rope_theta=5000000.0,
        max_seq_len=65536,
        tie_embeddings=True,
        family="smollm3",
        nope_layers=tuple(i for i in range(n_layers) if (i + 1) % 4 == 0),
    )


_OLMO = dict(
    family="olmo3",
    qk_norm=True,
    qk_norm_whole=True,
    sandwich_norms=True,
    pre_norms=False,
    norm_weight_fp32=True,
)


def _olmo3(dim: int, n_layers: int, n_heads: int, n_kv_heads: int, ffn_dim: int) -> ModelArgs:
    return ModelArgs(
        dim=dim,
        n_layers=n_layers,
        n_heads=n_heads,
        n_kv_heads=n_kv_heads,
        vocab_size=100278,
        ffn_dim=ffn_dim,
        norm_eps=1e-6,
        rope_theta=500000.0,
        rope_scaling=RopeScaling(8.0, original_max_position_embeddings=8192, rope_type="yarn"),
        max_seq_len=65536,
        sliding_window=4096,
        layer_types=tuple("full" if (i + 1) % 4 == 0 else "sliding" for i in range(n_layers)),
        local_rope_theta=500000.0,
        **_OLMO,
    )


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


def _qwen3_5(
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
        **{**_gemma_common(n_layers, kinds), "norm_plus_one": False},
    )


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


_REST: dict[str, ModelArgs] = {
    # Qwen/Qwen2.5-*: q/k/v bias; small ones tie embeddings
    "qwen2_5_0_5b": _qwen2_5(896, 24, 14, 2, 4864, 151936, 1e-6, 32768, tie=True),
    "qwen2_5_1_5b": _qwen2_5(1536, 28, 12, 2, 8960, 151936, 1e-6, 131072, tie=True),
    "qwen2_5_3b": _qwen2_5(2048, 36, 16, 2, 11008, 151936, 1e-6, 32768, tie=True),
    "qwen2_5_7b": _qwen2_5(3584, 28, 28, 4, 18944, 152064, 1e-6, 131072, tie=False),
    "qwen2_5_14b": _qwen2_5(5120, 48, 40, 8, 13824, 152064, 1e-5, 131072, tie=False),
    "qwen2_5_32b": _qwen2_5(5120, 64, 40, 8, 27648, 152064, 1e-5, 131072, tie=False),
    "qwen2_5_72b": _qwen2_5(8192, 80, 64, 8, 29568, 152064, 1e-5, 131072, tie=False),
    # mistralai/Mistral-7B-v0.3 (no sliding window, 32768-token vocab)
    "mistral_7b": _mistral(32768, 1000000.0, 32768, None),
    # Qwen/Qwen3-*: q/k norms, head_dim 128 always, small ones tie embeddings
    "qwen3_0_6b": _qwen3(1024, 28, 16, 3072, tie=True),
    "qwen3_1_7b": _qwen3(2048, 28, 16, 6144, tie=True),
    "qwen3_4b": _qwen3(2560, 36, 32, 9728, tie=True),
    "qwen3_8b": _qwen3(4096, 36, 32, 12288, tie=False),
    "qwen3_14b": _qwen3(5120, 40, 40, 17408, tie=False),
    "qwen3_32b": _qwen3(5120, 64, 64, 25600, tie=False),
    # google/gemma-2-{2b,9b,27b}: soft-capping, alternating 4096-token windows
    "gemma2_2b": _gemma2(2304, 26, 8, 4, 256, 9216, 256),
    "gemma2_9b": _gemma2(3584, 42, 16, 8, 256, 14336, 256),
    "gemma2_27b": _gemma2(4608, 46, 32, 16, 128, 36864, 144),
    # google/gemma-3-{1b,4b,12b,27b}-pt (the text model of the multimodal 4b/12b/27b)
    "gemma3_1b": _gemma3(1152, 26, 4, 1, 256, 6912, 262144, 512, 32768, 256, None),
    "gemma3_4b": _gemma3(2560, 34, 8, 4, 256, 10240, 262208, 1024, 131072, 256, 8.0),
    "gemma3_12b": _gemma3(3840, 48, 16, 8, 256, 15360, 262208, 1024, 131072, 256, 8.0),
    "gemma3_27b": _gemma3(5376, 62, 32, 16, 128, 21504, 262208, 1024, 131072, 168, 8.0),
    # microsoft/Phi-3-mini-4k-instruct, Phi-3.5-mini-instruct, phi-4, Phi-4-mini-instruct: fused
    # projections. Phi-3.5-mini and Phi-4-mini reach 128k positions with longrope factor lists
    # that only their checkpoints carry: the presets stop at the 4096 positions those lists
    # start from (load the checkpoint with --model-dir for the long context).
    "phi3_mini": _phi3(3072, 32, 32, 32, 8192, 32064, 10000.0, 4096, 2047),
    "phi3_5_mini": _phi3(3072, 32, 32, 32, 8192, 32064, 10000.0, 4096, 262144),
    "phi4": _phi3(5120, 40, 40, 10, 17920, 100352, 250000.0, 16384, None),
    "phi4_mini": _phi3(3072, 32, 24, 8, 8192, 200064, 10000.0, 4096, 262144, True, 96),
    # mistralai/Mistral-7B-v0.1 (4096-token window on every layer), Mistral-Nemo-Base-2407
    "mistral_7b_v0_1": _mistral(32000, 10000.0, 32768, 4096),
    "mistral_nemo_12b": _mistral(131072, 1000000.0, 128000, None, dim=5120, n_layers=40, hd=128),
    # HuggingFaceTB/SmolLM3-3B: no rope on every fourth layer
    "smollm3_3b": _smollm3(2048, 36, 16, 11008),
    # allenai/Olmo-3-1025-7B: norms after attention and MLP, q/k norms over the projections,
    # a 4096-token window on three layers of four, yarn on the full ones
    "olmo3_7b": _olmo3(4096, 32, 32, 32, 11008),
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
    # Qwen/Qwen3.5-9B and Qwen3.5-35B-A3B (their text models: the cards' totals add the vision
    # tower), Qwen/Qwen3-Next-80B-A3B-Base: the shapes transformers' configs default to
    "qwen3_5_9b": _qwen3_5(4096, 32, 16, 4, 12288),
    "qwen3_5_35b_a3b": _qwen3_5(
        2048, 40, 16, 2, 512, n_experts=256, moe_ffn_dim=512, shared_ffn_dim=512
    ),
    "qwen3_next_80b_a3b": dataclasses.replace(
        _qwen3_5(2048, 48, 16, 2, 5120, n_experts=512, moe_ffn_dim=512, shared_ffn_dim=512),
        family="qwen3_next",
        vocab_size=151936,
        top_k=10,
        linear_fused=True,
    ),
    # openai/gpt-oss-20b, gpt-oss-120b
    "gpt_oss_20b": _gpt_oss(24, 32),
    "gpt_oss_120b": _gpt_oss(36, 128),
    "deepseek_v3": _deepseek_v3(),
    "glm4_5_air": _glm4_5_air(),
    # Qwen/Qwen3-30B-A3B, Qwen3-235B-A22B: 128 experts, 8 per token, every layer MoE
    "qwen3_30b_a3b": _qwen3_moe(2048, 48, 32, 6144, 768),
    "qwen3_235b_a22b": _qwen3_moe(4096, 94, 64, 12288, 1536),
    # mistralai/Mixtral-8x7B-v0.1, Mixtral-8x22B-v0.1: 8 experts, 2 per token
    "mixtral_8x7b": _mixtral(4096, 32, 32, 14336, 32000, 32768),
    "mixtral_8x22b": _mixtral(6144, 56, 48, 16384, 32768, 65536),
    # One small model per new mechanism (tests, CPU benches): q/k norms and a wide head_dim;
    # Gemma 2's soft-caps, windows and sandwich norms; Gemma 3's layer pattern and local rope;
    # Phi-3's fused projections and partial rotary; Mistral v0.1's window on every layer.
    "debug_qwen3": debug_like(family="qwen3", qk_norm=True, head_dim=64),
    "debug_gemma2": debug_like(
        family="gemma2",
        query_pre_attn_scalar=32.0,
        attn_softcap=50.0,
        final_softcap=30.0,
        sliding_window=256,
        **_gemma_common(4, ("sliding", "full", "sliding", "full")),
    ),
    "debug_gemma3": debug_like(
        family="gemma3_text",
        qk_norm=True,
        query_pre_attn_scalar=32.0,
        sliding_window=256,
        local_rope_theta=10000.0,
        rope_scaling=RopeScaling(8.0, rope_type="linear"),
        **_gemma_common(4, ("sliding", "sliding", "sliding", "full")),
    ),
    "debug_phi3": debug_like(family="phi3", fused_projections=True, rotary_dim=24),
    "debug_window": debug_like(family="mistral", sliding_window=256),
    # SmolLM3's NoPE layer (the last of four); OLMo 3's norms and pattern (3 windowed, 1 full)
    "debug_smollm3": debug_like(family="smollm3", tie_embeddings=True, nope_layers=(3,)),
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
    # Gemma 4's: a full layer with a wider head whose keys are its values, per-layer inputs,
    # the last two layers attending over earlier layers' keys and values with wider MLPs
    "debug_gemma4": debug_like(
        family="gemma4_text",
        qk_norm=True,
        query_pre_attn_scalar=1.0,
        sliding_window=256,
        local_rope_theta=10000.0,
        rope_scaling=RopeScaling(1.0, rope_type="proportional", partial=0.25),
        **{**_gemma_common(4, ("sliding", "full", "sliding", "full")), "norm_plus_one": False},
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
    "debug_olmo3": debug_like(
        sliding_window=256,
        layer_types=("sliding", "sliding", "sliding", "full"),
        local_rope_theta=10000.0,
        **_OLMO,
    ),
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
# every family module's presets, family by family (models/families/__init__.py)
PRESETS: dict[str, ModelArgs] = {
    **{name: args for f in FAMILIES.values() for name, args in f.presets.items()},
    **_REST,
}


def from_name(name: str) -> ModelArgs:
    """A copy of preset `name` (safe to modify)."""
    if name not in PRESETS:
        near = closest(name, PRESETS)
        # a guess alone can be far off (llama9_1t -> llama2_13b): the family's presets beside it
        family = re.match(r"[a-z]+", name.lower())
        same = [p for p in PRESETS if family and p.startswith(family.group())]
        if near and difflib.SequenceMatcher(None, name, near).ratio() >= 0.85:
            same = []  # a typo of one preset: the guess is the answer
        hint = f"did you mean {near!r}?" if near else "no preset is near that name;"
        hint += f" the {family.group()} presets: {', '.join(same)}" if same else ""
        if not near and not same:
            hint = f"choose one of: {', '.join(PRESETS)}"
        raise UserError(
            f"unknown model preset {name!r}; {hint} (`compiletune models` lists them with sizes)"
        )
    return copy.deepcopy(PRESETS[name])
