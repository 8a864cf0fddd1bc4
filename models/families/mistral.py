"""Mistral 7B (v0.1 with a 4096-token window on every layer, v0.3 without) and Mistral-Nemo
(MistralForCausalLM): Llama's decoder with a sliding window."""

from __future__ import annotations

from ..args import ModelArgs
from .base import Family, Gguf
from .llama import debug_like


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


PRESETS: dict[str, ModelArgs] = {
    # mistralai/Mistral-7B-v0.3 (no sliding window, 32768-token vocab)
    "mistral_7b": _mistral(32768, 1000000.0, 32768, None),
    # mistralai/Mistral-7B-v0.1 (4096-token window on every layer), Mistral-Nemo-Base-2407
    "mistral_7b_v0_1": _mistral(32000, 10000.0, 32768, 4096),
    "mistral_nemo_12b": _mistral(131072, 1000000.0, 128000, None, dim=5120, n_layers=40, hd=128),
    # the small model: a window on every layer
    "debug_window": debug_like(family="mistral", sliding_window=256),
}


FAMILY = Family(
    "mistral",
    "MistralForCausalLM",
    {
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 4096 * 32,
        "num_key_value_heads": 8,
        "sliding_window": 4096,
    },
    windows=True,
    gguf=Gguf("LLAMA", interleave_qk=True),  # written as llama: no window,
    presets=PRESETS,
)
