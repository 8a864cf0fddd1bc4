"""Gemma 3 (Gemma3ForCausalLM, and the text model of Gemma3ForConditionalGeneration): Gemma 2's
decoder with q/k norms, one full layer in six and a rope base of its own on the sliding ones."""

from __future__ import annotations

from ..args import ModelArgs, RopeScaling
from .base import Family, Gguf, Vision
from .gemma2 import GEMMA_BLOCK_NAMES, GEMMA_DEFAULTS, gemma_common
from .llama import debug_like


def gemma3_kinds(cfg: dict, n_layers: int) -> tuple[str, ...]:
    pattern = int(cfg.get("sliding_window_pattern") or cfg.get("_sliding_window_pattern") or 6)
    return tuple("full" if (i + 1) % pattern == 0 else "sliding" for i in range(n_layers))


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
        **gemma_common(n_layers, kinds),
    )


PRESETS: dict[str, ModelArgs] = {
    # google/gemma-3-{1b,4b,12b,27b}-pt (the text model of the multimodal 4b/12b/27b)
    "gemma3_1b": _gemma3(1152, 26, 4, 1, 256, 6912, 262144, 512, 32768, 256, None),
    "gemma3_4b": _gemma3(2560, 34, 8, 4, 256, 10240, 262208, 1024, 131072, 256, 8.0),
    "gemma3_12b": _gemma3(3840, 48, 16, 8, 256, 15360, 262208, 1024, 131072, 256, 8.0),
    "gemma3_27b": _gemma3(5376, 62, 32, 16, 128, 21504, 262208, 1024, 131072, 168, 8.0),
    "debug_gemma3": debug_like(
        family="gemma3_text",
        qk_norm=True,
        query_pre_attn_scalar=32.0,
        sliding_window=256,
        local_rope_theta=10000.0,
        rope_scaling=RopeScaling(8.0, rope_type="linear"),
        **gemma_common(4, ("sliding", "sliding", "sliding", "full")),
    ),
}


FAMILY = Family(
    "gemma3_text",
    "Gemma3ForCausalLM",
    {
        **GEMMA_DEFAULTS,
        "vocab_size": 262208,
        "max_position_embeddings": 131072,
        "rope_theta": 1000000.0,
        "rope_local_base_freq": 10000.0,
        "sliding_window_pattern": 6,
    },
    qk_norm=True,
    gemma=True,
    windows=True,
    local_rope=True,
    writes_attention_bias=True,
    layer_kinds=gemma3_kinds,
    gguf=Gguf("GEMMA3", norm_plus_one=True, swa_every=6, wide_scale_layers=62),
    block_names=GEMMA_BLOCK_NAMES,
    multimodal=("Gemma3ForConditionalGeneration",),
    # the published checkpoints' names; an image's tokens see each other on every layer
    vision=Vision(
        "siglip",
        "image_token_index",
        text_prefix="language_model.model.",
        head="language_model.lm_head.weight",
        image_blocks=lambda cfg: ("full", "sliding"),
    ),
    presets=PRESETS,
)
