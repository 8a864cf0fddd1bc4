"""Llama 2, Llama 3 and 3.x (LlamaForCausalLM): the plain pre-norm decoder every other family
varies, its presets, and the small Llama-3-shaped models of the tests, the embedded default run
and the benches."""

from __future__ import annotations

import dataclasses

from ..args import ModelArgs, RopeScaling
from .base import Family, Gguf


def _llama3_rope(factor: float) -> RopeScaling:
    return RopeScaling(
        factor=factor,
        low_freq_factor=1.0,
        high_freq_factor=4.0,
        original_max_position_embeddings=8192,
    )


def _llama2(dim: int, n_layers: int, n_heads: int, n_kv_heads: int, ffn_dim: int) -> ModelArgs:
    return ModelArgs(
        dim=dim,
        n_layers=n_layers,
        n_heads=n_heads,
        n_kv_heads=n_kv_heads,
        vocab_size=32000,
        ffn_dim=ffn_dim,
        norm_eps=1e-5,
        rope_theta=10000.0,
        max_seq_len=4096,
    )


def _llama3(
    dim: int,
    n_layers: int,
    n_heads: int,
    ffn_dim: int,
    rope_scaling: RopeScaling | None = None,
    tie: bool = False,
) -> ModelArgs:
    return ModelArgs(
        dim=dim,
        n_layers=n_layers,
        n_heads=n_heads,
        n_kv_heads=8,
        vocab_size=128256,
        ffn_dim=ffn_dim,
        norm_eps=1e-5,
        rope_theta=500000.0,
        rope_scaling=rope_scaling,
        max_seq_len=8192 if rope_scaling is None else 131072,
        tie_embeddings=tie,
    )


def _debug(vocab_size: int) -> ModelArgs:
    return ModelArgs(
        dim=256,
        n_layers=4,
        n_heads=8,
        n_kv_heads=2,
        vocab_size=vocab_size,
        ffn_dim=768,
        norm_eps=1e-5,
        rope_theta=500000.0,
        max_seq_len=32768,  # long-context checks on CPU (README "Long context")
    )


def debug_like(**changes) -> ModelArgs:
    """The `debug` preset with `changes`: the other families' small test models start here."""
    return dataclasses.replace(_debug(512), **changes)


PRESETS: dict[str, ModelArgs] = {
    # meta-llama/Llama-2-{7b,13b,70b}-hf
    "llama2_7b": _llama2(4096, 32, 32, 32, 11008),
    "llama2_13b": _llama2(5120, 40, 40, 40, 13824),
    "llama2_70b": _llama2(8192, 80, 64, 8, 28672),
    # meta-llama/Meta-Llama-3-{8B,70B}
    "llama3_8b": _llama3(4096, 32, 32, 14336),
    "llama3_70b": _llama3(8192, 80, 64, 28672),
    # meta-llama/Llama-3.1-{8B,70B,405B}, Llama-3.3-70B-Instruct: 128k context via llama3 rope
    "llama3_1_8b": _llama3(4096, 32, 32, 14336, _llama3_rope(8.0)),
    "llama3_1_70b": _llama3(8192, 80, 64, 28672, _llama3_rope(8.0)),
    "llama3_1_405b": _llama3(16384, 126, 128, 53248, _llama3_rope(8.0)),
    # meta-llama/Llama-3.2-{1B,3B}: tied embeddings, rope factor 32
    "llama3_2_1b": _llama3(2048, 16, 32, 8192, _llama3_rope(32.0), tie=True),
    "llama3_2_3b": _llama3(3072, 28, 24, 8192, _llama3_rope(32.0), tie=True),
    "llama3_3_70b": _llama3(8192, 80, 64, 28672, _llama3_rope(8.0)),
    # Small Llama-3-shaped models for tests, the embedded default run and benches.
    "debug": _debug(512),
    "debug_128k": _debug(128256),
    "llama3_150m": ModelArgs(
        dim=512,
        n_layers=8,
        n_heads=8,
        n_kv_heads=4,
        vocab_size=128256,
        ffn_dim=1536,
        norm_eps=1e-5,
        rope_theta=500000.0,
        max_seq_len=8192,
    ),
}

FAMILY = Family(
    "llama",
    "LlamaForCausalLM",
    {"rms_norm_eps": 1e-6, "max_position_embeddings": 2048},
    writes_attention_bias=True,
    writes_mlp_bias=True,
    presets=PRESETS,
    # llama.cpp rotates adjacent pairs where HF Llama rotates halves: q/k rows reordered
    gguf=Gguf("LLAMA", interleave_qk=True),
)
