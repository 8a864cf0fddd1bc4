"""What a model family is in llama.cpp's terms: its GGUF architecture, metadata and tensors.

The families exported are the dense decoders that both llama.cpp runs and transformers' GGUF loader
reads back (so the export is tested by a round trip); each says so in its module's `Gguf` data
(models/families/): the general.architecture it is written as, and what changes on the way.

llama.cpp's LLAMA graph applies rotary embeddings to adjacent pairs (x0, x1), (x2, x3), ... where
the HF checkpoints it reads rotate the two halves of each head; with `interleave_qk` the converter
reorders each head's q and k rows from [half 0 | half 1] to [r0 of half 0, r0 of half 1, r1 of
half 0, ...], which makes both the same function. The NEOX-style graphs rotate halves in
llama.cpp too: no reorder. A family whose RMSNorm multiplies by (1 + w) (`norm_plus_one`) has
1 + w written, since llama.cpp's multiplies by w. A family written as another's architecture
keeps only what that graph has (a sliding window the LLAMA graph lacks is not applied).
Every value a family's llama.cpp graph fixes rather than reads (an attention scale, a
sliding-window pattern) is checked against the config, and a config that differs is refused.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import gguf

from compiletune.errors import UserError
from compiletune.models import families as model_families


@dataclass(frozen=True)
class Family:
    """A family the export writes: its model_type and its `Gguf` data (models/families/)."""

    model_type: str
    arch: gguf.MODEL_ARCH
    interleave_qk: bool = False  # reorder q/k rows for llama.cpp's pairwise rotary
    norm_plus_one: bool = False  # the file stores 1 + w for every RMSNorm weight
    swa_every: int = 0  # llama.cpp's fixed pattern (every n-th layer is global)
    wide_scale_layers: int = 0  # see `Gguf.wide_scale_layers`
    writes_window: bool = False  # sliding_window on every layer


FAMILIES = {
    name: Family(
        name,
        getattr(gguf.MODEL_ARCH, g.arch),
        g.interleave_qk,
        g.norm_plus_one,
        g.swa_every,
        g.wide_scale_layers,
        g.writes_window,
    )
    for name, f in model_families.FAMILIES.items()
    if (g := f.gguf) is not None
}
SUPPORTED = ", ".join(FAMILIES)


def family_of(cfg: dict[str, Any], folder: object) -> Family:
    """The family of a config.json, or one line naming what is exported."""
    model_type = cfg.get("model_type")
    if model_type not in FAMILIES:
        raise UserError(
            f"{folder}: model_type {model_type!r} is not exported to GGUF; supported: "
            f"{SUPPORTED} (dense decoders that llama.cpp runs and transformers reads back)"
        )
    return FAMILIES[model_type]


def head_dim(cfg: dict[str, Any]) -> int:
    return int(cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"])


def rope_parameters(cfg: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """(the global layers' rope parameters, the sliding layers' ones or None), from either the
    transformers 5 `rope_parameters` (per layer kind where the sliding layers have their own) or the
    older keys."""
    params = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    if "full_attention" in params:
        return params["full_attention"], params.get("sliding_attention")
    merged = dict(params)
    merged.setdefault("rope_theta", cfg.get("rope_theta", 10000.0))
    local = cfg.get("rope_local_base_freq")
    return merged, ({"rope_theta": local} if local else None)


def llama3_rope_factors(cfg: dict[str, Any]) -> list[float]:
    """llama.cpp's rope_freqs tensor for Llama 3.1-style rope scaling: per frequency, the divisor
    that turns the base frequency into the scaled one (1 for fast ones, `factor` for slow ones,
    interpolated between), [head_dim / 2]."""
    params, _ = rope_parameters(cfg)
    dim = int(head_dim(cfg) * cfg.get("partial_rotary_factor", 1.0))
    base, factor = params["rope_theta"], params["factor"]
    low, high = params.get("low_freq_factor", 1.0), params.get("high_freq_factor", 4.0)
    old_context = params.get("original_max_position_embeddings", 8192)
    out = []
    for i in range(0, dim, 2):
        wavelen = 2 * math.pi * base ** (i / dim)
        if wavelen < old_context / high:
            out.append(1.0)
        elif wavelen > old_context / low:
            out.append(float(factor))
        else:
            smooth = (old_context / wavelen - low) / (high - low)
            out.append(1.0 / ((1 - smooth) / factor + smooth))
    return out


def _check_fixed_pattern(cfg: dict[str, Any], fam: Family, folder: object) -> None:
    """Refuse a config whose attention scale or layer pattern llama.cpp's graph (one with a fixed
    sliding-window pattern) would not follow."""
    model_type, layers = cfg["model_type"], cfg["num_hidden_layers"]
    scalar = cfg.get("query_pre_attn_scalar", head_dim(cfg))
    wide = cfg["hidden_size"] // cfg["num_attention_heads"]
    if scalar != head_dim(cfg) and not (scalar == wide and layers == fam.wide_scale_layers):
        raise UserError(
            f"{folder}: query_pre_attn_scalar {scalar} is neither head_dim {head_dim(cfg)} nor "
            "the 27B model's hidden_size / heads; llama.cpp would scale attention differently"
        )
    kinds = cfg.get("layer_types")
    expected = [
        "full_attention" if (i + 1) % fam.swa_every == 0 else "sliding_attention"
        for i in range(layers)
    ]
    if kinds is not None and list(kinds) != expected:
        raise UserError(
            f"{folder}: layer_types differs from llama.cpp's fixed {model_type} pattern "
            f"(every {fam.swa_every}th layer global); this model cannot be exported to GGUF"
        )


def metadata(cfg: dict[str, Any], fam: Family, folder: object) -> dict[str, Any]:
    """The `{arch}.*` keys as GGUFWriter method name -> value (applied in order)."""
    heads = cfg["num_attention_heads"]
    dim = head_dim(cfg)
    rope, local = rope_parameters(cfg)
    rope_type = rope.get("rope_type") or rope.get("type") or "default"
    keys: dict[str, Any] = {
        "add_context_length": cfg.get("max_position_embeddings", 4096),
        "add_embedding_length": cfg["hidden_size"],
        "add_block_count": cfg["num_hidden_layers"],
        "add_feed_forward_length": cfg["intermediate_size"],
        "add_head_count": heads,
        "add_head_count_kv": cfg.get("num_key_value_heads") or heads,
        "add_key_length": dim,
        "add_value_length": dim,
        "add_layer_norm_rms_eps": cfg.get("rms_norm_eps", 1e-6),
        "add_rope_freq_base": rope["rope_theta"],
        "add_rope_dimension_count": int(dim * cfg.get("partial_rotary_factor", 1.0)),
        "add_vocab_size": cfg["vocab_size"],
    }
    if rope_type == "linear":
        keys["add_rope_scaling_type"] = gguf.RopeScalingType.LINEAR
        keys["add_rope_scaling_factor"] = rope["factor"]
    elif rope_type not in ("default", "llama3"):  # llama3: the rope_freqs tensor
        raise UserError(
            f"{folder}: rope scaling {rope_type!r} is not exported to GGUF (exported: none, "
            "linear, llama3)"
        )
    if fam.swa_every:
        _check_fixed_pattern(cfg, fam, folder)
        keys["add_sliding_window"] = cfg["sliding_window"]
        if local:
            keys["add_rope_freq_base_swa"] = local["rope_theta"]
        for name in ("attn_logit_softcapping", "final_logit_softcapping"):
            if cfg.get(name):
                keys[f"add_{name}"] = cfg[name]
    elif fam.writes_window and cfg.get("sliding_window"):
        keys["add_sliding_window"] = cfg["sliding_window"]
    return keys


def interleave_rows(weight: Any, n_heads: int) -> Any:
    """llama.cpp's q/k row order for a llama head: [r0, r0 + d/2, r1, r1 + d/2, ...] of each
    head's [d] rows (see the module docstring). `weight`: [n_heads * d, ...] (a bias: [n_heads * d])."""
    rest = weight.shape[1:]
    d = weight.shape[0] // n_heads
    return weight.reshape(n_heads, 2, d // 2, *rest).swapaxes(1, 2).reshape(weight.shape)


class TensorNames:
    """HF tensor name -> llama.cpp's, with what the value needs on the way."""

    def __init__(self, cfg: dict[str, Any], fam: Family) -> None:
        self.cfg, self.fam = cfg, fam
        self._map = gguf.get_tensor_name_map(fam.arch, cfg["num_hidden_layers"])

    def gguf_name(self, hf_name: str) -> str | None:
        """llama.cpp's name, or None for a tensor the file leaves out (a tied lm_head)."""
        if hf_name == "lm_head.weight" and self.cfg.get("tie_word_embeddings", False):
            return None
        stem, _, suffix = hf_name.rpartition(".")
        name = self._map.get_name(stem) if suffix in ("weight", "bias") else None
        if name is None:
            raise UserError(
                f"{hf_name}: no llama.cpp tensor of {self.fam.arch.name.lower()} is named for it; "
                "this checkpoint holds a tensor the GGUF export does not know"
            )
        return f"{name}.{suffix}"

    def convert(self, gguf_name: str, value: Any) -> Any:
        """The value the file holds (`value`: an fp32 numpy array as the checkpoint has it)."""
        cfg = self.cfg
        if self.fam.interleave_qk:
            if ".attn_q." in gguf_name:
                value = interleave_rows(value, cfg["num_attention_heads"])
            elif ".attn_k." in gguf_name:
                kv = cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
                value = interleave_rows(value, kv)
        if self.fam.norm_plus_one and "_norm." in gguf_name:
            value = value + 1.0
        return value
