"""OLMo 3 (Olmo3ForCausalLM): norms after attention and the MLP only (their weights applied in
fp32), q/k norms over the whole projection, windows on three layers of four."""

from __future__ import annotations

from ..args import ModelArgs, RopeScaling
from ..names import BLOCK_NAMES
from .base import Family
from .llama import debug_like

# OLMo 3's two norms, both after: no input_layernorm, and post_attention_layernorm is after
# attention as in Gemma.
_OLMO_BLOCK_NAMES = {
    **{
        k: v
        for k, v in BLOCK_NAMES.items()
        if k not in ("attention_norm.weight", "ffn_norm.weight")
    },
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "post_ffn_norm.weight": "post_feedforward_layernorm.weight",
}


def olmo3_kinds(cfg: dict, n_layers: int) -> tuple[str, ...]:
    return tuple("full" if (i + 1) % 4 == 0 else "sliding" for i in range(n_layers))


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


PRESETS: dict[str, ModelArgs] = {
    # allenai/Olmo-3-1025-7B: norms after attention and MLP, q/k norms over the projections,
    # a 4096-token window on three layers of four, yarn on the full ones
    "olmo3_7b": _olmo3(4096, 32, 32, 32, 11008),
    # the small model: its norms and pattern (3 windowed, 1 full)
    "debug_olmo3": debug_like(
        sliding_window=256,
        layer_types=("sliding", "sliding", "sliding", "full"),
        local_rope_theta=10000.0,
        **_OLMO,
    ),
}


FAMILY = Family(
    "olmo3",
    "Olmo3ForCausalLM",
    {
        "vocab_size": 50304,
        "pad_token_id": 1,
        "hidden_size": 4096,
        "intermediate_size": 11008,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "sliding_window": 4096,
        "tie_word_embeddings": False,
    },
    qk_norm=True,
    olmo=True,
    windows=True,
    local_rope=True,
    writes_attention_bias=True,
    layer_kinds=olmo3_kinds,
    block_names=_OLMO_BLOCK_NAMES,
    presets=PRESETS,
)
