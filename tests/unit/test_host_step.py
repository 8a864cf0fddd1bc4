"""The host optimizer the 24 GB recipes run (configs/llama3_1_8b_full_24gb.yaml: 8-bit AdamW on
CPU-offloaded shards, stepped by the C++ kernel): its steps follow torch.optim.AdamW in fp32."""

from __future__ import annotations

import pytest
import torch

from compiletune.ops import cpu_kernels
from compiletune.optim import ADAMW_BETAS, Optimizer

pytestmark = pytest.mark.skipif(not cpu_kernels.enabled(), reason="C++ kernels turned off")


def _updates(
    dtype: torch.dtype, compensation: str, lr: float = 1e-3, steps: int = 5
) -> tuple[torch.Tensor, ...]:
    """(8-bit step's total update, torch AdamW's in fp32) over `steps` steps of the same
    gradients: 2 parameters of 40,000 values, one with a partial last block."""
    g = torch.Generator().manual_seed(0)
    shapes = [(200, 200), (39_999,)]
    start = [torch.randn(s, generator=g) * 0.05 for s in shapes]
    ours = [torch.nn.Parameter(p.to(dtype, copy=True)) for p in start]
    ref = [torch.nn.Parameter(p.clone()) for p in start]
    opt = Optimizer(
        [(f"w{i}", p) for i, p in enumerate(ours)],
        kind="adamw8bit",
        lr=lr,
        weight_decay=0.1,
        bf16_compensation=compensation,
        device=torch.device("cpu"),
    )
    assert opt._cpu_kernel  # the C++ step, as the trainer runs it on host shards
    torch_opt = torch.optim.AdamW(ref, lr=lr, betas=ADAMW_BETAS, weight_decay=0.1)
    for _ in range(steps):
        for p, q in zip(ours, ref, strict=True):
            grad = torch.randn(q.shape, generator=g) * 1e-2
            p.grad, q.grad = grad.to(dtype), grad.clone()
        opt.step()
        torch_opt.step()
    ours_d = torch.cat(
        [
            (p.detach().float() - s.to(dtype).float()).flatten()
            for p, s in zip(ours, start, strict=True)
        ]
    )
    ref_d = torch.cat([(q.detach() - s).flatten() for q, s in zip(ref, start, strict=True)])
    return ours_d, ref_d


def test_cpu_8bit_step_follows_torch_adamw_fp32() -> None:
    """fp32 weights: the total update after 5 steps is within 3% (relative norm) of
    torch.optim.AdamW's, and points the same way (the 8-bit moments' rounding)."""
    ours, ref = _updates(torch.float32, "none")
    err = ((ours - ref).norm() / ref.norm()).item()
    assert err < 0.03, err
    assert torch.nn.functional.cosine_similarity(ours, ref, dim=0).item() > 0.999


def test_cpu_8bit_step_in_bf16_with_stochastic_rounding_is_unbiased() -> None:
    """bf16 weights rounded stochastically (the recipe's pure bf16): each weight carries up to
    an ulp of noise, but the update is torch AdamW's fp32 one on average, where round to
    nearest would drop most of it (updates of 2e-5 under half an ulp of weights ~0.05)."""
    ours, ref = _updates(torch.bfloat16, "stochastic", lr=2e-5, steps=10)
    slope = ((ours * ref).sum() / (ref * ref).sum()).item()
    assert slope == pytest.approx(1.0, abs=0.03)
    nearest, _ = _updates(torch.bfloat16, "none", lr=2e-5, steps=10)
    assert ((nearest * ref).sum() / (ref * ref).sum()).item() < 0.9  # what rounding away costs
