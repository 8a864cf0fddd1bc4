"""Quantized checkpoint formats read at load time (dequantized as they load, a tensor at a time).

MXFP4 (experts as some hub checkpoints store them): a weight [..., rows, cols] is stored as
`<name>_blocks` uint8 [..., rows, cols / 32, 16], two FP4 (E2M1) values a byte, the low nibble
first, and `<name>_scales` uint8 [..., rows, cols / 32], one power-of-two scale
(E8M0: 2 ** (s - 127)) per 32 values. The hub's tensors hold [E, out, in] this way; the model's
parameter is its transpose ([E, in, out], the family's stored layout), and hf.py maps that to
the native one (`Family.layouts`).
"""

from __future__ import annotations

import torch
from torch import Tensor

# the 16 E2M1 codes (sign, two exponent bits, one mantissa bit)
FP4_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
MX_SUFFIXES = ("_blocks", "_scales")


def dequantize_mxfp4(blocks: Tensor, scales: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """blocks uint8 [..., rows, g, 16], scales uint8 [..., rows, g] -> [..., rows, g * 32] in
    `dtype` (exact in bf16 and wider: each value is an E2M1 code times a power of two)."""
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != 16:
        raise ValueError(
            f"MXFP4 blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)} do not match"
        )
    table = torch.tensor(FP4_E2M1, dtype=dtype, device=blocks.device)
    codes = blocks.to(torch.int64)
    values = torch.stack((table[codes & 0x0F], table[codes >> 4]), dim=-1)  # low nibble first
    values = values.flatten(-2)  # [..., rows, g, 32]
    exponent = scales.to(torch.int32) - 127
    out = torch.ldexp(values, exponent[..., None].to(values.dtype))
    return out.flatten(-2).to(dtype)


def mxfp4_shape(blocks_shape: tuple[int, ...]) -> tuple[int, ...]:
    """The [..., in, out] parameter a [..., out, g, 16] block tensor stands for."""
    *lead, rows, groups, _ = blocks_shape
    return (*lead, groups * 32, rows)


# fp8 with block scales (quant_method "fp8", weight_block_size):
# a weight [rows, cols] is stored as float8_e4m3fn beside `<name>_scale_inv` fp32
# [ceil(rows / br), ceil(cols / bc)], one multiplier per block of br x bc values
FP8_SCALE = "_scale_inv"


def dequantize_fp8_blocks(
    weight: Tensor, scale_inv: Tensor, block: tuple[int, int], dtype: torch.dtype
) -> Tensor:
    """weight fp8 [rows, cols], scale_inv [ceil(rows / br), ceil(cols / bc)] -> [rows, cols] in
    `dtype` (each value times its block's scale, in fp32)."""
    rows, cols = weight.shape[-2:]
    br, bc = block
    want = (-(-rows // br), -(-cols // bc))
    if tuple(scale_inv.shape[-2:]) != want:
        raise ValueError(
            f"fp8 weight [{rows}, {cols}] in blocks of {br}x{bc} needs scales {list(want)}, "
            f"got {list(scale_inv.shape)}"
        )
    scale = scale_inv.float().repeat_interleave(br, dim=-2)[..., :rows, :]
    scale = scale.repeat_interleave(bc, dim=-1)[..., :cols]
    return (weight.float() * scale).to(dtype)
