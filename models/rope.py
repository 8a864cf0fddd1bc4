"""Rotary position embeddings: inverse frequencies by layer kind (with llama3 / linear / yarn /
longrope / proportional scaling), cos/sin tables and their application ("rotate_half" layout)."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from .args import ModelArgs, RopeScaling


def _llama3_scale(inv_freq: Tensor, rs: RopeScaling) -> Tensor:
    # keep high frequencies (wavelength < original_ctx / high_freq_factor), divide low
    # frequencies (wavelength > original_ctx / low_freq_factor) by `factor`, and interpolate
    # smoothly in between.
    low_freq_wavelen = rs.original_max_position_embeddings / rs.low_freq_factor
    high_freq_wavelen = rs.original_max_position_embeddings / rs.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / rs.factor, inv_freq)
    smooth = (rs.original_max_position_embeddings / wavelen - rs.low_freq_factor) / (
        rs.high_freq_factor - rs.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / rs.factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn(theta: float, dim: int, rs: RopeScaling, device: torch.device | str | None) -> Tensor:
    # YaRN: frequencies that turn fewer than beta_slow times over the original context are
    # interpolated (divided by factor), those turning more than beta_fast times are kept, with a
    # linear ramp over the dimensions in between.
    def correction_dim(rotations: float) -> float:
        ctx = rs.original_max_position_embeddings
        return dim * math.log(ctx / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(rs.beta_fast), correction_dim(rs.beta_slow)
    if rs.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    pos_freqs = theta ** (torch.arange(0, dim, 2, device=device).float() / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (rs.factor * pos_freqs)
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    keep = 1 - ramp.to(device)
    return interpolation * (1 - keep) + extrapolation * keep


def rope_type(args: ModelArgs, kind: str) -> str | None:
    """The rope scaling type of layers of `kind` ("llama3", "yarn", "longrope", ...; None)."""
    rs = _rope_base(args, kind)[1]
    return None if rs is None else rs.rope_type


def _rope_base(args: ModelArgs, kind: str) -> tuple[float, RopeScaling | None]:
    """(base, scaling) of layers of `kind`: sliding layers with a base of their own
    (`local_rope_theta`) take no scaling; every other layer uses the model's."""
    if kind == "sliding" and args.local_rope_theta is not None:
        return args.local_rope_theta, None
    return args.rope_theta, args.rope_scaling


def rope_inv_freq(
    args: ModelArgs,
    device: torch.device | str | None = None,
    kind: str = "full",
    long: bool = False,
) -> Tensor:
    """Rope inverse frequencies [rotary_dim // 2] in fp32 for layers of `kind`, with the
    configured scaling (`long`: longrope's long factors).

    Computed in the same order of fp32 operations as HF so that cos/sin match bit for bit.
    Sliding layers with a base of their own (`local_rope_theta`) take no scaling.
    """
    theta, rs = _rope_base(args, kind)
    hd = args.head_dim_of(kind)
    if rs is not None and rs.rope_type == "proportional":
        pairs = int(rs.partial * hd // 2)
        exponent = torch.arange(0, 2 * pairs, 2, dtype=torch.int64, device=device).float() / hd
        still = torch.zeros(hd // 2 - pairs, device=device)
        return torch.cat((1.0 / theta**exponent, still)) / rs.factor
    dim = args.rotary_dim or hd
    if rs is not None and rs.rope_type == "yarn":
        return _yarn(theta, dim, rs, device)
    exponent = torch.arange(0, dim, 2, dtype=torch.int64, device=device).float() / dim
    if rs is not None and rs.rope_type == "longrope":
        factors = rs.long_factor if long else rs.short_factor
        ext = torch.tensor(factors, dtype=torch.float32, device=device)
        return 1.0 / (ext * theta**exponent)
    inv_freq = 1.0 / (theta**exponent)
    if rs is None:
        return inv_freq
    if rs.rope_type == "linear":
        return inv_freq / rs.factor
    return _llama3_scale(inv_freq, rs)


def rope_cos_sin(
    args: ModelArgs,
    positions: Tensor,
    dtype: torch.dtype,
    kind: str = "full",
    rowwise: bool = False,
) -> tuple[Tensor, Tensor]:
    """cos, sin [b, s, rotary_dim] for integer `positions` [b, s] and layers of `kind`, math in
    fp32, cast to `dtype`.

    longrope picks its long factors when the largest position reaches past the original
    context (as HF does), with a tensor `where`, so under compile it is data, not a guard;
    `rowwise`: each row by its own largest position (rows that are sequences of their own, as
    in a batch of generations), else by the whole batch's.
    """
    inv_freq = rope_inv_freq(args, positions.device, kind)
    _, rs = _rope_base(args, kind)
    if rs is not None and rs.rope_type == "longrope":
        long = rope_inv_freq(args, positions.device, kind, long=True)
        largest = positions.amax(dim=-1, keepdim=True)[..., None] if rowwise else positions.max()
        past = largest + 1 > rs.original_max_position_embeddings
        inv_freq = torch.where(past, long, inv_freq)
    freqs = positions[..., None].float() * inv_freq  # [b, s, rotary_dim // 2]
    # rotate_half layout: the two halves of the rotated part share frequencies.
    emb = torch.cat((freqs, freqs), dim=-1)  # [b, s, rotary_dim]
    cos, sin = emb.cos(), emb.sin()
    scale = 1.0 if rs is None else rs.cos_sin_scale()
    if scale != 1.0:
        cos, sin = cos * scale, sin * scale
    return cos.to(dtype), sin.to(dtype)


def rotate_half(x: Tensor) -> Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x [b, heads, s, hd], cos/sin [b, s, rd] -> [b, heads, s, hd]; with partial rotary
    (rd < hd) the leading rd dims rotate and the rest pass through."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    rd = cos.shape[-1]
    if rd == x.shape[-1]:
        return x * cos + rotate_half(x) * sin
    rot, rest = x[..., :rd], x[..., rd:]
    return torch.cat((rot * cos + rotate_half(rot) * sin, rest), dim=-1)
