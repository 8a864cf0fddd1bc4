"""Named model shapes, as data.

Published shapes are those of each model's HF config.json (base models). `head_dim` is left
None wherever it equals dim // n_heads (true for every published preset here, e.g. Llama 3.2's
explicit 64 and 128), the same canonical form `args_from_hf_config` produces, so a preset and a
checkpoint's config compare equal. `num_params` counts parameters from the shape alone.
"""

from __future__ import annotations

import copy

from compiletune.errors import UserError

from .decoder import ModelArgs, RopeScaling


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
    # Qwen/Qwen2.5-*: q/k/v bias; small ones tie embeddings
    "qwen2_5_0_5b": _qwen2_5(896, 24, 14, 2, 4864, 151936, 1e-6, 32768, tie=True),
    "qwen2_5_1_5b": _qwen2_5(1536, 28, 12, 2, 8960, 151936, 1e-6, 131072, tie=True),
    "qwen2_5_3b": _qwen2_5(2048, 36, 16, 2, 11008, 151936, 1e-6, 32768, tie=True),
    "qwen2_5_7b": _qwen2_5(3584, 28, 28, 4, 18944, 152064, 1e-6, 131072, tie=False),
    "qwen2_5_14b": _qwen2_5(5120, 48, 40, 8, 13824, 152064, 1e-5, 131072, tie=False),
    "qwen2_5_32b": _qwen2_5(5120, 64, 40, 8, 27648, 152064, 1e-5, 131072, tie=False),
    "qwen2_5_72b": _qwen2_5(8192, 80, 64, 8, 29568, 152064, 1e-5, 131072, tie=False),
    # mistralai/Mistral-7B-v0.3 (no sliding window, 32768-token vocab)
    "mistral_7b": ModelArgs(
        dim=4096,
        n_layers=32,
        n_heads=32,
        n_kv_heads=8,
        vocab_size=32768,
        ffn_dim=14336,
        norm_eps=1e-5,
        rope_theta=1000000.0,
        max_seq_len=32768,
        sliding_window=None,
        family="mistral",
    ),
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


def from_name(name: str) -> ModelArgs:
    """A copy of preset `name` (safe to modify)."""
    if name not in PRESETS:
        raise UserError(
            f"unknown model preset {name!r}; choose one of: {', '.join(PRESETS)} "
            "(`compiletune models` lists them with sizes)"
        )
    return copy.deepcopy(PRESETS[name])


def num_params(args: ModelArgs) -> int:
    """Parameter count from the shape alone; a tied embedding counts once."""
    d, hd = args.dim, args.hd
    q_out, kv_out = args.n_heads * hd, args.n_kv_heads * hd
    attention = d * q_out + 2 * d * kv_out + q_out * d
    if args.qkv_bias:
        attention += q_out + 2 * kv_out
    feed_forward = 3 * d * args.ffn_dim
    block = attention + feed_forward + 2 * d  # two norms
    embeddings = args.vocab_size * d * (1 if args.tie_embeddings else 2)
    return embeddings + args.n_layers * block + d  # + final norm
