"""SmolLM3 (SmolLM3ForCausalLM): no rope on every fourth layer (NoPE), a window only with
use_sliding_window."""

from __future__ import annotations

from typing import Any

from compiletune.errors import UserError

from ..args import ModelArgs
from .base import Family, Get
from .llama import debug_like


def smollm3_rope_layers(cfg: dict, n_layers: int) -> list[int]:
    """SmolLM3's no_rope_layers: 1 where the layer rotates, 0 where it is a NoPE layer; by
    default every `no_rope_layer_interval`-th layer is NoPE."""
    listed = cfg.get("no_rope_layers")
    if listed is None:
        interval = cfg.get("no_rope_layer_interval", 4)
        if not (isinstance(interval, int) and not isinstance(interval, bool) and interval >= 1):
            raise UserError("config.json no_rope_layer_interval must be a positive integer")
        return [int((i + 1) % interval != 0) for i in range(n_layers)]
    if not (
        isinstance(listed, list)
        and len(listed) == n_layers
        and all(v in (0, 1) and not isinstance(v, float) for v in listed)
    ):
        raise UserError(
            f"config.json no_rope_layers must list 1 (rope) or 0 (no rope) for each of the "
            f"{n_layers} layers"
        )
    return [int(v) for v in listed]


def smollm3_kinds(cfg: dict, n_layers: int) -> tuple[str, ...]:
    # transformers: with use_sliding_window, the NoPE layers are the sliding ones
    rope = smollm3_rope_layers(cfg, n_layers)
    return tuple("full" if r else "sliding" for r in rope)


def read_smollm3(cfg: dict, n_layers: int, get: Get) -> dict[str, Any]:
    rope = smollm3_rope_layers(cfg, n_layers)
    return dict(nope_layers=tuple(i for i, r in enumerate(rope) if not r))


def write_smollm3(args: ModelArgs, cfg: dict) -> None:
    cfg["no_rope_layers"] = [int(args.rope(i)) for i in range(args.n_layers)]
    cfg["use_sliding_window"] = args.sliding_window is not None


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


PRESETS: dict[str, ModelArgs] = {
    # HuggingFaceTB/SmolLM3-3B: no rope on every fourth layer
    "smollm3_3b": _smollm3(2048, 36, 16, 11008),
    # the small model: a NoPE layer, the last of four
    "debug_smollm3": debug_like(family="smollm3", tie_embeddings=True, nope_layers=(3,)),
}


FAMILY = Family(
    "smollm3",
    "SmolLM3ForCausalLM",
    {
        "vocab_size": 128256,
        "pad_token_id": 128004,
        "hidden_size": 2048,
        "intermediate_size": 11008,
        "num_hidden_layers": 36,
        "num_attention_heads": 16,
        "num_key_value_heads": 4,
        "max_position_embeddings": 32768,
        "rms_norm_eps": 1e-6,
        "rope_theta": 2000000.0,
        "tie_word_embeddings": True,
    },
    windows=True,
    window_flag=True,
    writes_attention_bias=True,
    writes_mlp_bias=True,
    layer_kinds=smollm3_kinds,
    read_extra=read_smollm3,
    write_extra=write_smollm3,
    presets=PRESETS,
)
