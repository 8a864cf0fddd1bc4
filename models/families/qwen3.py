"""Qwen3 (Qwen3ForCausalLM): Qwen2 without biases, with an RMSNorm over each q and k head and
128-wide heads."""

from __future__ import annotations

from ..args import ModelArgs
from .base import Family, Gguf
from .llama import debug_like
from .qwen2 import QWEN_DEFAULTS


def qwen3_args(
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


PRESETS: dict[str, ModelArgs] = {
    # Qwen/Qwen3-*: q/k norms, head_dim 128 always, small ones tie embeddings
    "qwen3_0_6b": qwen3_args(1024, 28, 16, 3072, tie=True),
    "qwen3_1_7b": qwen3_args(2048, 28, 16, 6144, tie=True),
    "qwen3_4b": qwen3_args(2560, 36, 32, 9728, tie=True),
    "qwen3_8b": qwen3_args(4096, 36, 32, 12288, tie=False),
    "qwen3_14b": qwen3_args(5120, 40, 40, 17408, tie=False),
    "qwen3_32b": qwen3_args(5120, 64, 64, 25600, tie=False),
    # the small model of the tests and CPU benches: q/k norms and a wide head_dim
    "debug_qwen3": debug_like(family="qwen3", qk_norm=True, head_dim=64),
}


FAMILY = Family(
    "qwen3",
    "Qwen3ForCausalLM",
    {**QWEN_DEFAULTS, "num_key_value_heads": 32, "head_dim": 128},
    qk_norm=True,
    qwen_window_flag=True,
    writes_attention_bias=True,
    gguf=Gguf("QWEN3"),
    presets=PRESETS,
)
