"""Triton kernels for the row-wise half of `compiletune::linear_cross_entropy` on CUDA.

The op computes one chunk of logits at a time with a cuBLAS matmul; these kernels do the rest of
the chunk, reading the logits in their own dtype and doing the math in fp32 registers, so no fp32
copy of the chunk is ever allocated:

    lse_and_loss(logits [c, V], targets [c])  -> lse [c], loss [c]     (fp32, online log-sum-exp)
    dlogits_(logits [c, v], lse [c], ...)      -> logits, overwritten with d loss / d logits

Imported only when the op's inputs are on CUDA and triton is installed. Tested on CPU under
`TRITON_INTERPRET=1` (which must be set before this module is imported).

Loop bounds are `constexpr` on purpose: the interpreter of triton 3.6 cannot take a runtime
integer as a `range` bound under numpy >= 2.4 (triton-lang/triton#9171). The vocabulary size is
fixed for a run, so specializing on it costs one compile.
"""

import torch
import triton
import triton.language as tl


@triton.jit
def _tanh(x):
    # tl has no tanh and libdevice's is missing from the interpreter. The absolute error is fp32
    # rounding of a number near 1, which is what matters for a logit (softcap * tanh).
    return 1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)


@triton.jit
def _load_row_block(row_ptr, cols, n_cols, softcap, HAS_SOFTCAP: tl.constexpr):
    """One block of a row of logits as fp32, softcapped; columns past the row are -inf."""
    mask = cols < n_cols
    x = tl.load(row_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_SOFTCAP:
        x = softcap * _tanh(x / softcap)
    return tl.where(mask, x, float("-inf"))


@triton.jit
def _lse_loss_kernel(
    logits_ptr,
    row_stride,
    targets_ptr,
    lse_ptr,
    loss_ptr,
    n_cols,
    z_loss,
    softcap,
    HAS_SOFTCAP: tl.constexpr,
    BLOCK: tl.constexpr,
    N_BLOCKS: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)  # int64: row * row_stride passes 2**31 on big chunks
    row_ptr = logits_ptr + row * row_stride
    # The first block is peeled: it always holds column 0, so the running max starts finite and
    # the rescale exp(m - m_new) below never sees -inf - -inf.
    x = _load_row_block(row_ptr, tl.arange(0, BLOCK), n_cols, softcap, HAS_SOFTCAP)
    m = tl.max(x, 0)
    s = tl.sum(tl.exp(x - m), 0)
    for i in range(1, N_BLOCKS):
        cols = i * BLOCK + tl.arange(0, BLOCK)
        x = _load_row_block(row_ptr, cols, n_cols, softcap, HAS_SOFTCAP)
        m_new = tl.maximum(m, tl.max(x, 0))
        s = s * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), 0)
        m = m_new
    lse = m + tl.log(s)
    target_logit = tl.load(row_ptr + tl.load(targets_ptr + row)).to(tl.float32)
    if HAS_SOFTCAP:
        target_logit = softcap * _tanh(target_logit / softcap)
    tl.store(lse_ptr + row, lse)
    tl.store(loss_ptr + row, lse - target_logit + z_loss * lse * lse)


@triton.jit
def _dlogits_kernel(
    logits_ptr,
    row_stride,
    lse_ptr,
    targets_ptr,
    coef_p_ptr,
    coef_t_ptr,
    n_cols,
    col_offset,
    softcap,
    HAS_SOFTCAP: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    ptrs = logits_ptr + row * row_stride + cols
    x = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
    if HAS_SOFTCAP:
        t = _tanh(x / softcap)
        x = softcap * t
    p = tl.exp(x - tl.load(lse_ptr + row))
    target = tl.load(targets_ptr + row) - col_offset  # may fall outside this block of columns
    d = tl.load(coef_p_ptr + row) * p - tl.where(cols == target, tl.load(coef_t_ptr + row), 0.0)
    if HAS_SOFTCAP:
        d = d * (1.0 - t * t)  # d/dx softcap * tanh(x / softcap)
    tl.store(ptrs, d.to(logits_ptr.dtype.element_ty), mask=mask)


def _check_rows(logits: torch.Tensor, *per_row: torch.Tensor) -> None:
    if logits.dim() != 2 or logits.stride(1) != 1:
        raise ValueError(f"logits must be [rows, cols] with unit column stride, got {logits.shape}")
    for t in per_row:
        if t.shape != (logits.shape[0],) or not t.is_contiguous():
            raise ValueError(f"per-row tensors must be contiguous [{logits.shape[0]}]")


def lse_and_loss(
    logits: torch.Tensor, targets: torch.Tensor, z_loss: float, softcap: float, block: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [c, V] (fp32/fp16/bf16), targets [c] int64 in [0, V) -> (lse [c], loss [c]) fp32.

    loss = lse - target_logit + z_loss * lse**2, logits softcapped first when softcap > 0.
    block: columns per step (power of 2; 0 = auto).
    """
    _check_rows(logits, targets)
    rows, n_cols = logits.shape
    lse = torch.empty(rows, dtype=torch.float32, device=logits.device)
    loss = torch.empty_like(lse)
    if rows == 0:
        return lse, loss
    block = block or min(4096, triton.next_power_of_2(n_cols))
    _lse_loss_kernel[(rows,)](
        logits,
        logits.stride(0),
        targets,
        lse,
        loss,
        n_cols,
        float(z_loss),
        float(softcap) if softcap > 0 else 1.0,
        HAS_SOFTCAP=softcap > 0,
        BLOCK=block,
        N_BLOCKS=triton.cdiv(n_cols, block),
        num_warps=8 if block >= 2048 else 4,
    )
    return lse, loss


def dlogits_(
    logits: torch.Tensor,
    lse: torch.Tensor,
    targets: torch.Tensor,
    coef_p: torch.Tensor,
    coef_t: torch.Tensor,
    col_offset: int,
    softcap: float,
    block: int = 0,
) -> torch.Tensor:
    """Overwrite logits [c, v] (columns col_offset.. of the vocabulary) with d loss / d logits:

        coef_p[i] * softmax(x)[i, j] - coef_t[i] * (j + col_offset == targets[i]),

    taken through the softcap when softcap > 0. lse, coef_p, coef_t: fp32 [c]; targets: [c].
    Returns logits.
    """
    _check_rows(logits, lse, targets, coef_p, coef_t)
    rows, n_cols = logits.shape
    if rows == 0 or n_cols == 0:
        return logits
    block = block or min(1024, triton.next_power_of_2(n_cols))
    _dlogits_kernel[(rows, triton.cdiv(n_cols, block))](
        logits,
        logits.stride(0),
        lse,
        targets,
        coef_p,
        coef_t,
        n_cols,
        col_offset,
        float(softcap) if softcap > 0 else 1.0,
        HAS_SOFTCAP=softcap > 0,
        BLOCK=block,
        num_warps=4,
    )
    return logits
