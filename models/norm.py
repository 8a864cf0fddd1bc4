"""RMSNorm as the families compute it (weight after the cast back, (1 + w) in fp32, or w in
fp32), and the weightless form."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from .args import ModelArgs


class RMSNorm(nn.Module):
    """RMSNorm over the last dim. `plus_one`: the weight is stored as w and applied as (1 + w),
    in fp32 before the cast back; `weight_fp32`: w applied in fp32 before the cast back;
    otherwise the weight multiplies after it."""

    def __init__(
        self, dim: int, eps: float = 1e-5, plus_one: bool = False, weight_fp32: bool = False
    ):
        super().__init__()
        self.eps = eps
        self.plus_one = plus_one
        self.weight_fp32 = weight_fp32
        self.weight = nn.Parameter(torch.zeros(dim) if plus_one else torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        # Same op order as HF (fp32 statistics; cast back before the weight, or after it for
        # (1 + w)) so bf16 runs round identically.
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.plus_one:
            return (x * (1.0 + self.weight.float())).to(dtype)
        if self.weight_fp32:
            return (self.weight * x).to(dtype)
        return self.weight * x.to(dtype)

    def reset_parameters(self) -> None:
        if self.plus_one:
            nn.init.zeros_(self.weight)
        else:
            nn.init.ones_(self.weight)


def unit_rms(x: Tensor, eps: float) -> Tensor:
    """RMSNorm without a weight over the last dim, in fp32 (Gemma 4's values)."""
    y = x.float()
    return (y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def norm_for(args: ModelArgs, dim: int) -> RMSNorm:
    """An RMSNorm over `dim` as the family computes it."""
    return RMSNorm(dim, args.norm_eps, args.norm_plus_one, args.norm_weight_fp32)
