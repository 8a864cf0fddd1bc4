"""Gemma 2 (Gemma2ForCausalLM): (1 + w) norms before and after attention and the MLP, GeGLU, a
sqrt(d) embedding scale, soft-capped scores and logits, windows on alternate layers. Its
defaults, names and preset parts are Gemma 3's and 4's too."""

from __future__ import annotations

from typing import Any

from ..args import ModelArgs
from ..names import BLOCK_NAMES
from .base import Family, Gguf
from .llama import debug_like

# Gemma's four norms: HF's post_attention_layernorm is the one *after* attention there.
GEMMA_BLOCK_NAMES = {
    **BLOCK_NAMES,
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "post_ffn_norm.weight": "post_feedforward_layernorm.weight",
}

# What transformers' Gemma 2 and Gemma 3 configs both assume when a key is absent.
GEMMA_DEFAULTS: dict[str, Any] = {
    "hidden_size": 2304,
    "intermediate_size": 9216,
    "num_hidden_layers": 26,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True,
    "pad_token_id": 0,
    "query_pre_attn_scalar": 256,
    "sliding_window": 4096,
    "hidden_activation": "gelu_pytorch_tanh",
}


def gemma2_kinds(cfg: dict, n_layers: int) -> tuple[str, ...]:
    return tuple("sliding" if i % 2 == 0 else "full" for i in range(n_layers))


def gemma_common(n_layers: int, kinds: tuple[str, ...]) -> dict:
    """The ModelArgs fields the Gemma presets share."""
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
        **gemma_common(n_layers, kinds),
    )


PRESETS: dict[str, ModelArgs] = {
    # google/gemma-2-{2b,9b,27b}: soft-capping, alternating 4096-token windows
    "gemma2_2b": _gemma2(2304, 26, 8, 4, 256, 9216, 256),
    "gemma2_9b": _gemma2(3584, 42, 16, 8, 256, 14336, 256),
    "gemma2_27b": _gemma2(4608, 46, 32, 16, 128, 36864, 144),
    "debug_gemma2": debug_like(
        family="gemma2",
        query_pre_attn_scalar=32.0,
        attn_softcap=50.0,
        final_softcap=30.0,
        sliding_window=256,
        **gemma_common(4, ("sliding", "full", "sliding", "full")),
    ),
}


FAMILY = Family(
    "gemma2",
    "Gemma2ForCausalLM",
    {
        **GEMMA_DEFAULTS,
        "vocab_size": 256000,
        "max_position_embeddings": 8192,
        "attn_logit_softcapping": 50.0,
        "final_logit_softcapping": 30.0,
    },
    gemma=True,
    windows=True,
    writes_attention_bias=True,
    layer_kinds=gemma2_kinds,
    gguf=Gguf("GEMMA2", norm_plus_one=True, swa_every=2, wide_scale_layers=46),
    block_names=GEMMA_BLOCK_NAMES,
    presets=PRESETS,
)
