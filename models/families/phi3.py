"""Phi-3, Phi-3.5 and Phi-4 (Phi3ForCausalLM): fused qkv and gate_up projections, longrope."""

from __future__ import annotations

from ..args import ModelArgs
from .base import Family, Gguf
from .llama import debug_like


def write_phi3(args: ModelArgs, cfg: dict) -> None:
    rs = args.rope_scaling
    cfg["original_max_position_embeddings"] = (
        rs.original_max_position_embeddings if rs is not None else args.max_seq_len
    )
    if rs is not None and rs.rope_type == "longrope" and rs.attention_factor is None:
        # the only form transformers 4.x's Phi-3 validation accepts
        cfg["rope_scaling"] = {
            "type": "longrope",
            "short_factor": list(rs.short_factor),
            "long_factor": list(rs.long_factor),
        }


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


PRESETS: dict[str, ModelArgs] = {
    # microsoft/Phi-3-mini-4k-instruct, Phi-3.5-mini-instruct, phi-4, Phi-4-mini-instruct: fused
    # projections. Phi-3.5-mini and Phi-4-mini reach 128k positions with longrope factor lists
    # that only their checkpoints carry: the presets stop at the 4096 positions those lists
    # start from (load the checkpoint with --model-dir for the long context).
    "phi3_mini": _phi3(3072, 32, 32, 32, 8192, 32064, 10000.0, 4096, 2047),
    "phi3_5_mini": _phi3(3072, 32, 32, 32, 8192, 32064, 10000.0, 4096, 262144),
    "phi4": _phi3(5120, 40, 40, 10, 17920, 100352, 250000.0, 16384, None),
    "phi4_mini": _phi3(3072, 32, 24, 8, 8192, 200064, 10000.0, 4096, 262144, True, 96),
    # the small model: fused projections and partial rotary
    "debug_phi3": debug_like(family="phi3", fused_projections=True, rotary_dim=24),
}


FAMILY = Family(
    "phi3",
    "Phi3ForCausalLM",
    {
        "vocab_size": 32064,
        "pad_token_id": 32000,
        "rms_norm_eps": 1e-5,
        "max_position_embeddings": 4096,
        "tie_word_embeddings": False,
        "original_max_position_embeddings": 4096,  # longrope's, kept at the top level
    },
    windows=True,
    fused_projections=True,
    write_extra=write_phi3,
    gguf=Gguf("PHI3", writes_window=True),
    presets=PRESETS,
)
