"""Grouped matmul for mixture-of-experts layers: rows grouped by expert, each group times its
expert's weight, in one call.

`grouped_mm(x [n, k], w [E, k, m], offs [E] int32) -> [n, m]`: rows offs[e-1]:offs[e] of x
(offs[-1] = 0 before the first) are multiplied by w[e]; an expert with no rows contributes
nothing, and rows past offs[E-1] come out as zeros. The counts are data, not shapes: every
call with n rows has the same output shape, so a compiled block never recompiles as routing
changes from batch to batch.

Two implementations, picked per call from the inputs:
    native    torch._grouped_mm (one CUTLASS kernel on Hopper+ GPUs for bf16; our caller sees
              only this module's name for it, in `torch_internals`)
    fallback  compiletune::grouped_mm, a custom op that multiplies the groups one after another
              with plain matmuls (exact: the same products as a per-expert loop). It reads
              the offsets on the host once per call (free on CPU; one sync on a GPU whose dtype
              the native kernel lacks). Opaque to the compiler, with its own backward
              (compiletune::grouped_mm_weight_grad for dW), so a compiled block holds one node.
"""

from __future__ import annotations

import torch
from torch import Tensor

from compiletune.ops.op_memory import declare_memory, holds_nothing
from compiletune.torch_internals import native_grouped_mm

# dtypes the native kernel takes on every torch from 2.11 (2.14 adds fp16 on some GPUs)
_NATIVE_DTYPES = (torch.bfloat16,)


def _groups(offs: Tensor) -> list[tuple[int, int, int]]:
    """(expert, start, end) of every expert that has rows."""
    out, start = [], 0
    for e, end in enumerate(offs.tolist()):
        if end > start:
            out.append((e, start, end))
        start = end
    return out


@torch.library.custom_op("compiletune::grouped_mm", mutates_args=())
def _grouped_mm_fallback(x: Tensor, w: Tensor, offs: Tensor) -> Tensor:
    # every row is written by its expert's matmul; only rows past the last group are zeroed
    out = x.new_empty(x.shape[0], w.shape[-1])
    end = 0
    for e, start, end in _groups(offs):
        torch.mm(x[start:end], w[e], out=out[start:end])
    out[end:].zero_()
    return out


@_grouped_mm_fallback.register_fake
def _(x: Tensor, w: Tensor, offs: Tensor) -> Tensor:
    return x.new_empty(x.shape[0], w.shape[-1])


@torch.library.custom_op("compiletune::grouped_mm_weight_grad", mutates_args=())
def _weight_grad(x: Tensor, grad: Tensor, offs: Tensor, n_experts: int) -> Tensor:
    """dW [E, k, m] of grouped_mm: x_e^T @ grad_e per expert; zeros for an expert with no rows."""
    out = x.new_empty(n_experts, x.shape[1], grad.shape[1])
    filled = set()
    for e, start, end in _groups(offs):
        torch.mm(x[start:end].t(), grad[start:end], out=out[e])
        filled.add(e)
    for e in set(range(n_experts)) - filled:
        out[e].zero_()
    return out


@_weight_grad.register_fake
def _(x: Tensor, grad: Tensor, offs: Tensor, n_experts: int) -> Tensor:
    return x.new_empty(n_experts, x.shape[1], grad.shape[1])


def _setup(ctx, inputs, output) -> None:
    x, w, offs = inputs
    ctx.save_for_backward(x, w, offs)


def _backward(ctx, grad: Tensor) -> tuple[Tensor | None, Tensor | None, None]:
    x, w, offs = ctx.saved_tensors
    grad = grad.contiguous()
    dx = dw = None
    if ctx.needs_input_grad[0]:
        dx = _grouped_mm_fallback(grad, w.transpose(-2, -1), offs)
    if ctx.needs_input_grad[1]:
        dw = _weight_grad(x, grad, offs, w.shape[0])
    return dx, dw, None


_grouped_mm_fallback.register_autograd(_backward, setup_context=_setup)


grouped_mm_op = torch.ops.compiletune.grouped_mm.default  # what the fallback is in a graph


def uses_native(x: Tensor, w: Tensor) -> bool:
    """Does `grouped_mm(x, w, ...)` run torch._grouped_mm (else the exact fallback)?"""
    if native_grouped_mm is None or not x.is_cuda or x.dtype not in _NATIVE_DTYPES:
        return False
    if w.dtype != x.dtype or torch.cuda.get_device_capability(x.device) < (9, 0):
        return False
    # every row stride a multiple of 16 bytes
    return x.shape[1] % 8 == 0 and w.shape[-1] % 8 == 0


def grouped_mm(x: Tensor, w: Tensor, offs: Tensor) -> Tensor:
    """x [n, k] (rows grouped by expert), w [E, k, m], offs [E] int32 (cumulative row counts)
    -> [n, m]. See the module docstring."""
    if uses_native(x, w):
        return native_grouped_mm(x, w, offs=offs)
    return _grouped_mm_fallback(x, w, offs)


# What these ops hold beyond their outputs (the memory estimate reads it): nothing; one expert's slice at a time, views of its inputs, written into the output.
declare_memory("compiletune::grouped_mm")(holds_nothing)
declare_memory("compiletune::grouped_mm_weight_grad")(holds_nothing)
