"""Layout transforms between a checkpoint's tensors and the native modules' (gate and up halves
interleaved or not). Tensor methods only, no torch import: the family modules that name these
load with the presets, before torch."""

from __future__ import annotations

from typing import Any

Tensor = Any  # a torch.Tensor (see the module docstring)


def interleave(t: Tensor, dim: int) -> Tensor:
    """The two halves of `dim` (gate, up) -> alternating (gate, up, gate, up ...)."""
    return t.unflatten(dim, (2, -1)).transpose(dim, dim + 1).flatten(dim, dim + 1)


def deinterleave(t: Tensor, dim: int) -> Tensor:
    """The inverse of `interleave`: alternating rows -> the gate half, then the up half."""
    return t.unflatten(dim, (-1, 2)).transpose(dim, dim + 1).flatten(dim, dim + 1)
