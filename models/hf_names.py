"""HF tensor names and layouts: native name <-> the name in an HF checkpoint, and the tensors a
family's checkpoints store otherwise than the native module (stacked experts as one tensor per
expert, experts transposed or with gate and up interleaved). The names every family shares are
in models/names.py; a family's own names and layouts are data of its module (models/families/)."""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping

import torch
from torch import Tensor

from compiletune.errors import UserError

from .families import DEFAULT_FAMILY, FAMILIES, Family
from .hf_config import ARCHITECTURES
from .names import BLOCK_NAMES, GLOBAL_NAMES, strip_wrappers

# Checkpoints keep key/value weights in the layers that reuse an earlier layer's keys and
# values, unused there (transformers ignores them too)
UNUSED_IN_REUSE = ("self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.k_norm.weight")
_NATIVE_BLOCK = re.compile(r"layers\.(\d+)\.(.+)")
HF_BLOCK = re.compile(r"model\.layers\.(\d+)\.(.+)")
# native stacked experts: experts.w13 holds gate and up of every expert, experts.w2 down
_NATIVE_EXPERTS = ("feed_forward.experts.w13", "feed_forward.experts.w2")
_GLOBAL_NAMES_INV = {v: k for k, v in GLOBAL_NAMES.items()}


def _family(family: str) -> Family | None:
    return FAMILIES.get(family)


def _block_names(family: str) -> Mapping[str, str]:
    fam = _family(family)
    return fam.block_names if fam is not None and fam.block_names else BLOCK_NAMES


def _block_names_inv(family: str) -> dict[str, str]:
    return {v: k for k, v in _block_names(family).items()}


def to_hf_name(native: str, family: str = DEFAULT_FAMILY) -> str:
    """`layers.3.attention.wq.weight` -> `model.layers.3.self_attn.q_proj.weight`."""
    native = strip_wrappers(native)
    if native in GLOBAL_NAMES:
        return GLOBAL_NAMES[native]
    m = _NATIVE_BLOCK.fullmatch(native)
    names = _block_names(family)
    if m and m.group(2) in names:
        return f"model.layers.{m.group(1)}.{names[m.group(2)]}"
    raise UserError(
        f"parameter {native!r} has no HF name; only compiletune decoder models can be saved"
    )


def to_native_name(hf: str, family: str = DEFAULT_FAMILY) -> str:
    """`model.layers.3.mlp.gate_proj.weight` -> `layers.3.feed_forward.w1.weight`."""
    if hf in _GLOBAL_NAMES_INV:
        return _GLOBAL_NAMES_INV[hf]
    m = HF_BLOCK.fullmatch(hf)
    inverse = _block_names_inv(family)
    if m and m.group(2) in inverse:
        return f"layers.{m.group(1)}.{inverse[m.group(2)]}"
    experts = fam.expert_names if (fam := _family(family)) is not None else None
    if m and experts is not None:
        prefix, (gate, up, down) = experts
        e = re.fullmatch(re.escape(prefix) + r"\.\d+\.(\w+)\.weight", m.group(2))
        if e and e.group(1) in (gate, up, down):
            return f"layers.{m.group(1)}.{_NATIVE_EXPERTS[e.group(1) == down]}"
    raise UserError(
        f"checkpoint tensor {hf!r} is not part of a supported decoder "
        f"({', '.join(ARCHITECTURES)}); use a checkpoint of a supported architecture"
    )


Index = tuple[int | slice, ...]


def layout(
    native: str, family: str
) -> tuple[Callable[[Tensor], Tensor], Callable[[Tensor], Tensor]] | None:
    """(to native, to HF) for a tensor the family's checkpoints lay out otherwise, else None."""
    m = _NATIVE_BLOCK.fullmatch(strip_wrappers(native))
    fam = _family(family)
    return fam.layouts.get(m.group(2)) if m and fam is not None else None


def hf_pieces(
    native: str, shape: tuple[int, ...], family: str = DEFAULT_FAMILY
) -> list[tuple[str, Index, tuple[int, ...]]]:
    """The HF tensors a native tensor is stored as: (HF name, index into the native tensor, the
    piece's shape). One piece, the whole tensor, except for stacked experts, which the hub keeps
    as one tensor per expert and projection: w13 [E, 2F, d] -> gate and up [F, d] of each expert
    (rows :F and F:), w2 [E, d, F] -> down [d, F] of each."""
    native = strip_wrappers(native)
    m = _NATIVE_BLOCK.fullmatch(native)
    fam = _family(family)
    experts = fam.expert_names if fam is not None else None
    if not (m and m.group(2) in _NATIVE_EXPERTS and experts is not None):
        convert = layout(native, family)
        if convert is not None:  # the stored shape
            shape = tuple(convert[1](torch.empty(shape, device="meta")).shape)
        return [(to_hf_name(native, family), (), tuple(shape))]
    prefix, (gate, up, down) = experts
    base = f"model.layers.{m.group(1)}.{prefix}"
    n_experts, rows, cols = shape
    if m.group(2) == _NATIVE_EXPERTS[1]:
        return [(f"{base}.{e}.{down}.weight", (e,), (rows, cols)) for e in range(n_experts)]
    half = rows // 2
    return [
        (f"{base}.{e}.{name}.weight", (e, part), (half, cols))
        for e in range(n_experts)
        for name, part in ((gate, slice(0, half)), (up, slice(half, rows)))
    ]


def state_dict_to_hf(
    sd: dict[str, Tensor], tie_embeddings: bool = False, family: str = DEFAULT_FAMILY
) -> dict[str, Tensor]:
    """Rename a native state dict to HF names (dropping `output.weight` when tied; stacked
    experts split into the hub's per-expert tensors)."""
    out = {}
    for k, v in sd.items():
        convert = layout(k, family)
        for hf, index, _ in hf_pieces(k, tuple(v.shape), family):
            if not (tie_embeddings and hf == "lm_head.weight"):
                out[hf] = v[index] if convert is None else convert[1](v).contiguous()
    return out
