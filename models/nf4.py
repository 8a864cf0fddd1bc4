"""NF4: 4-bit NormalFloat storage for frozen weights (QLoRA, Dettmers et al. 2023).

A weight [out, in] is cut into blocks of `BLOCK` = 64 consecutive values along each row. Each
block keeps its absolute maximum as an fp32 scale; each value is stored as the index (4 bits) of
the nearest of 16 code values (`CODE`, in [-1, 1]) to value / scale. Two indices share a byte,
the first in the high nibble (bitsandbytes' order):

    codes  uint8 [out, in // 2]     scales  fp32 [out, in // 64]     = 4.5 bits per weight

The code values are the quantiles of a standard normal, scaled to [-1, 1], with an exact zero:
a normally distributed block spends its codes where its values are. Blocks run along rows (not
over the flattened tensor), so a row's codes and scales travel together when FSDP2 shards dim 0;
for in % 64 == 0, which every supported architecture has, this is the same blocking as
bitsandbytes' flattened one. Scales are kept in fp32 (no second-level "double quantization" of
the scales, which would save another 0.37 bits per weight).

Round-trip error: a value is moved to the nearest code, so |w - dequantize(quantize(w))| is at
most half the widest gap between neighbouring codes (between -1 and -0.696) times its block's
scale: `MAX_ABS_ERROR` = 0.152 x scale.

Everything here is plain tensor math (no tensor subclass): the codes and scales are ordinary
tensors that can be registered, moved, saved and sharded like any other, and dequantization is a
byte-table lookup plus a multiply that torch.compile fuses into one kernel in front of the matmul.
"""

from __future__ import annotations

import torch
from torch import Tensor

from compiletune.ops.op_memory import replayable, shape_key

BLOCK = 64
# The 16 NF4 code values, as published with QLoRA (bitsandbytes' table).
CODE = (
    -1.0,
    -0.6961928009986877,
    -0.5250730514526367,
    -0.39491748809814453,
    -0.28444138169288635,
    -0.18477343022823334,
    -0.09105003625154495,
    0.0,
    0.07958029955625534,
    0.16093020141124725,
    0.24611230194568634,
    0.33791524171829224,
    0.44070982933044434,
    0.5626170039176941,
    0.7229568362236023,
    1.0,
)
# Largest |w - round trip(w)| / block scale: half the widest gap between neighbouring codes.
MAX_ABS_ERROR = max(b - a for a, b in zip(CODE, CODE[1:], strict=False)) / 2
# Rows quantized at once: bounds the fp32 and index temporaries to ~16M values.
_CHUNK_VALUES = 1 << 24


def check_shape(shape: torch.Size | tuple[int, ...], name: str = "weight") -> None:
    """NF4 stores 2-D weights whose rows split into whole blocks of 64 values."""
    if len(shape) != 2 or shape[1] % BLOCK != 0:
        raise ValueError(
            f"NF4 needs a 2-D weight with a multiple of {BLOCK} columns; {name} is {tuple(shape)}"
        )


@torch.no_grad()
def quantize_nf4(weight: Tensor) -> tuple[Tensor, Tensor]:
    """weight [out, in] (any float dtype) -> (codes uint8 [out, in // 2], scales fp32 [out, in // 64]).

    Nearest code by comparing against the midpoints between neighbouring codes. Works through the
    rows in chunks so the fp32 temporaries stay small even for a large projection.
    """
    check_shape(weight.shape)
    out, cols = weight.shape
    if weight.device.type == "meta":  # a model's structure (build_meta_model): shapes only
        return (
            torch.empty(out, cols // 2, dtype=torch.uint8, device="meta"),
            torch.empty(out, cols // BLOCK, dtype=torch.float32, device="meta"),
        )
    code = torch.tensor(CODE, dtype=torch.float32, device=weight.device)
    midpoints = (code[1:] + code[:-1]) / 2  # [15], increasing
    codes = torch.empty(out, cols // 2, dtype=torch.uint8, device=weight.device)
    scales = torch.empty(out, cols // BLOCK, dtype=torch.float32, device=weight.device)
    rows = max(1, _CHUNK_VALUES // cols)
    for start in range(0, out, rows):
        w = weight[start : start + rows].float().view(-1, cols // BLOCK, BLOCK)  # [r, nb, 64]
        scale = w.abs().amax(dim=-1)  # [r, nb]
        # An all-zero block has scale 0: divide by the smallest normal instead, giving code 0.0.
        x = w / scale.clamp_min(torch.finfo(torch.float32).tiny)[..., None]  # [-1, 1]
        index = torch.bucketize(x, midpoints).to(torch.uint8).view(x.shape[0], cols // 2, 2)
        codes[start : start + rows] = (index[..., 0] << 4) | index[..., 1]
        scales[start : start + rows] = scale
    return codes, scales


def _pair_table(device: torch.device) -> Tensor:
    """[256, 2] fp32: the two code values a byte holds (high nibble first)."""
    code = torch.tensor(CODE, dtype=torch.float32, device=device)
    byte = torch.arange(256, device=device)
    return torch.stack((code[byte >> 4], code[byte & 15]), dim=-1)


@replayable(lambda codes, scales, dtype: (shape_key(codes, scales), dtype))
def dequantize_nf4(codes: Tensor, scales: Tensor, dtype: torch.dtype) -> Tensor:
    """codes uint8 [out, in // 2], scales fp32 [out, in // 64] -> weight [out, in] in `dtype`.

    One lookup per byte in a 256-entry table of value pairs (int32 indices: uint8 indices would
    be read as a boolean mask), times the block scale, in fp32, then cast.
    """
    out, half = codes.shape
    values = _pair_table(codes.device)[codes.int()]  # [out, in // 2, 2]
    values = values.view(out, -1, BLOCK) * scales[..., None]  # [out, in // 64, 64]
    return values.view(out, 2 * half).to(dtype)
