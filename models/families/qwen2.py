"""Qwen2 and Qwen2.5 (Qwen2ForCausalLM): q/k/v projections with biases; a use_sliding_window flag
that must be false."""

from __future__ import annotations

from typing import Any

from ..args import ModelArgs
from .base import Family, Gguf

QWEN_DEFAULTS: dict[str, Any] = {"rms_norm_eps": 1e-6, "max_position_embeddings": 32768}


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


PRESETS: dict[str, ModelArgs] = {
    # Qwen/Qwen2.5-*: q/k/v bias; small ones tie embeddings
    "qwen2_5_0_5b": _qwen2_5(896, 24, 14, 2, 4864, 151936, 1e-6, 32768, tie=True),
    "qwen2_5_1_5b": _qwen2_5(1536, 28, 12, 2, 8960, 151936, 1e-6, 131072, tie=True),
    "qwen2_5_3b": _qwen2_5(2048, 36, 16, 2, 11008, 151936, 1e-6, 32768, tie=True),
    "qwen2_5_7b": _qwen2_5(3584, 28, 28, 4, 18944, 152064, 1e-6, 131072, tie=False),
    "qwen2_5_14b": _qwen2_5(5120, 48, 40, 8, 13824, 152064, 1e-5, 131072, tie=False),
    "qwen2_5_32b": _qwen2_5(5120, 64, 40, 8, 27648, 152064, 1e-5, 131072, tie=False),
    "qwen2_5_72b": _qwen2_5(8192, 80, 64, 8, 29568, 152064, 1e-5, 131072, tie=False),
}


FAMILY = Family(
    "qwen2",
    "Qwen2ForCausalLM",
    {**QWEN_DEFAULTS, "num_key_value_heads": 32},
    qkv_bias=True,
    qwen_window_flag=True,
    gguf=Gguf("QWEN2"),
    presets=PRESETS,
)
