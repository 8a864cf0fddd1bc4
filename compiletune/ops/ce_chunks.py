"""The chunk machinery shared by the fused cross-entropy heads (`compiletune.ops.fused_loss`):
how many tokens a chunk holds, which rows a head computes, the row-wise work on one chunk of
logits, and the sums over chunks.

Row-wise work (log-sum-exp, target logit and loss; or softmax - onehot in place) runs as Triton
kernels on CUDA (`compiletune.ops.triton_ce`) and as `torch.compile`d torch functions elsewhere;
`COMPILETUNE_LCE_EAGER=1` runs the torch functions eagerly.
"""

import os
import warnings
from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import Tensor

from compiletune import torch_internals
from compiletune.errors import UserError
from compiletune.hardware import host_reads_free

DEFAULT_CHUNK_BYTES = 256 * 2**20  # one chunk of fp32 logits
MIN_CHUNK_TOKENS, MAX_CHUNK_TOKENS = 128, 65536

# Tests set this to run the Triton kernels on CPU tensors under TRITON_INTERPRET=1.
_FORCE_TRITON = False


def chunk_tokens(vocab: int, chunk_size: int = 0, budget_bytes: int = DEFAULT_CHUNK_BYTES) -> int:
    """Tokens per chunk: chunk_size if > 0, else $COMPILETUNE_LCE_CHUNK_TOKENS, else as many
    tokens as keep one chunk's fp32 logits [tokens, vocab] under budget_bytes, clamped to
    [MIN_CHUNK_TOKENS, MAX_CHUNK_TOKENS] (a huge vocabulary still gets matmuls worth running)."""
    if chunk_size > 0:
        return chunk_size
    env = os.environ.get("COMPILETUNE_LCE_CHUNK_TOKENS", "").strip()
    if env:
        if not env.isdigit() or int(env) <= 0:
            raise UserError(
                f"COMPILETUNE_LCE_CHUNK_TOKENS={env!r} is not a positive integer; "
                "set it to a token count such as 4096, or unset it for the automatic size"
            )
        return int(env)
    return max(MIN_CHUNK_TOKENS, min(MAX_CHUNK_TOKENS, budget_bytes // (4 * vocab)))


# ---------------------------------------------------------------------------------------------
# Row-wise work on one chunk of logits: torch versions (compiled on first use) and Triton ones.


def _rows_forward(
    logits: Tensor, targets: Tensor, z_loss: float, softcap: float
) -> tuple[Tensor, Tensor]:
    """logits [c, V] (any float dtype), targets [c] in [0, V) -> (lse [c], loss [c]) fp32."""
    x = logits.float()
    if softcap > 0:
        x = softcap * torch.tanh(x / softcap)
    lse = torch.logsumexp(x, dim=-1)
    loss = lse - x.gather(1, targets[:, None]).squeeze(1)
    if z_loss != 0:
        loss = loss + z_loss * lse * lse
    return lse, loss


def _rows_backward_(
    logits: Tensor,
    lse: Tensor,
    targets: Tensor,
    coef_p: Tensor,
    coef_t: Tensor,
    col_offset: int,
    softcap: float,
) -> Tensor:
    """Overwrite logits [c, v] (columns col_offset.. of the vocabulary) with d loss / d logits:
    coef_p[i] * softmax[i, j] - coef_t[i] * (j + col_offset == targets[i]), through the softcap.
    lse, coef_p, coef_t: fp32 [c]. Returns logits. In place so that, compiled, a chunk needs one
    [c, v] buffer, not two."""
    x = logits.float()
    if softcap > 0:
        t = torch.tanh(x / softcap)
        x = softcap * t
    p = torch.exp(x - lse[:, None])
    cols = torch.arange(x.shape[1], device=x.device) + col_offset
    d = coef_p[:, None] * p - torch.where(cols == targets[:, None], coef_t[:, None], 0.0)
    if softcap > 0:
        d = d * (1 - t * t)
    return logits.copy_(d)


_compiled: dict[Callable, Callable] = {}
_compile_failed = False


def _compiling_allowed() -> bool:
    """False when COMPILETUNE_LCE_EAGER=1 or compiling failed once (no C++ compiler, say)."""
    return not _compile_failed and os.environ.get("COMPILETUNE_LCE_EAGER") != "1"


def maybe_compiled(fn: Callable, eager: Callable | None = None) -> Callable:
    """fn compiled with Inductor (dynamic shapes: the short last chunk must not recompile), or
    `eager` (default fn itself: the same numbers) when COMPILETUNE_LCE_EAGER=1 or compiling
    failed once (no C++ compiler, say)."""
    eager = eager or fn
    if not _compiling_allowed():
        return eager
    if fn not in _compiled:
        # Chunks vary in size (the last is short): the CPU kernels thread by the size they get.
        options = torch_internals.dynamic_cpu_kernel_options() or None
        _compiled[fn] = torch.compile(fn, dynamic=True, fullgraph=True, options=options)
    compiled = _compiled[fn]

    def run(*args):
        global _compile_failed
        try:
            # Every call in one dispatch state, so the first training step (which AOTAutograd
            # runs under a checking mode) and the later ones share one compiled function.
            with torch_internals.below_inplace_or_view():
                return compiled(*args)
        except Exception as e:  # eager gives the same numbers; a genuine error re-raises there
            _compile_failed = True
            warnings.warn(
                f"compiletune: compiling the fused cross-entropy chunks failed ({e!r:.200}); "
                "running them eagerly",
                stacklevel=2,
            )
            return eager(*args)

    return run


def row_ops(device: torch.device) -> tuple[Callable, Callable]:
    """(forward, backward) row-wise functions for tensors on `device`."""
    if device.type == "cuda" or _FORCE_TRITON:
        try:
            from compiletune.ops import triton_ce  # needs triton, an optional dependency on CPU
        except ImportError:
            pass
        else:
            return triton_ce.lse_and_loss, triton_ce.dlogits_
    return maybe_compiled(_rows_forward), maybe_compiled(_rows_backward_)


# ---------------------------------------------------------------------------------------------
# The rows a head computes, and its checks.


def check_inputs(h: Tensor, weight: Tensor, bias: Tensor | None, targets: Tensor, reduction: str):
    """Shape/dtype checks shared by the real and the fake implementation (no data is read)."""
    if h.dim() != 2 or weight.dim() != 2 or h.shape[1] != weight.shape[1]:
        raise ValueError(
            f"linear_cross_entropy: h must be [N, d] and weight [V, d], got h {tuple(h.shape)} "
            f"and weight {tuple(weight.shape)}"
        )
    if not h.is_floating_point() or weight.dtype != h.dtype:
        raise ValueError(
            f"linear_cross_entropy: h and weight must share one float dtype, got {h.dtype} and "
            f"{weight.dtype}"
        )
    if bias is not None and (bias.shape != (weight.shape[0],) or bias.dtype != h.dtype):
        raise ValueError(
            f"linear_cross_entropy: bias must be [V] = [{weight.shape[0]}] of {h.dtype}, "
            f"got {tuple(bias.shape)} of {bias.dtype}"
        )
    if targets.shape != (h.shape[0],) or targets.dtype != torch.int64:
        raise ValueError(
            f"linear_cross_entropy: targets must be int64 [N] = [{h.shape[0]}], "
            f"got {targets.dtype} {tuple(targets.shape)}"
        )
    if reduction not in ("mean", "sum"):
        raise ValueError(
            f"linear_cross_entropy: reduction must be 'mean' or 'sum', not {reduction!r}"
        )


# The head computes the counted tokens' rows, padded with ignored ones to a multiple of
# ROW_ALIGN (or to all tokens): with 1023 of 1024 tokens counted (a packed row with one
# document boundary), oneDNN's AMX matmuls over 1023 rows ran 5-35% slower than over 1024.
ROW_ALIGN = 64


class Rows(NamedTuple):
    """The rows the head computes, from `select_rows`."""

    index: Tensor | None  # [m] indices into the N tokens; None: all N, in order (no copy)
    live: Tensor | None  # bool [m]: which of them count; None: all of them
    n: int | Tensor  # how many count (the mean's divisor): a host int, or fp32 [] on the device

    def take(self, t: Tensor) -> Tensor:
        """t's entries (along dim 0) for the computed rows."""
        return t if self.index is None else t.index_select(0, self.index)

    def inputs(self, h: Tensor, targets: Tensor) -> tuple[Tensor, Tensor]:
        """h [m, d] and targets [m] of the computed rows, padding rows zeroed / target 0."""
        return self.dead(self.take(h), 0.0), self.dead(self.take(targets), 0)

    def dead(self, t: Tensor, fill: float) -> Tensor:
        """t [m, ...] with the padding rows set to `fill` (a copy; t itself when none)."""
        if self.live is None:
            return t
        live = self.live.view(-1, *(1,) * (t.dim() - 1))
        return torch.where(live, t, fill)

    @property
    def empty(self) -> bool:
        """Known on the host that no token counts (never known without a host read)."""
        return isinstance(self.n, int) and self.n == 0

    def mean(self, total: Tensor) -> Tensor:
        """total / the count (0 when nothing counts)."""
        return total / (self.n if isinstance(self.n, int) else self.n.clamp(min=1))


def select_rows(targets: Tensor, ignore_index: int) -> Rows:
    """Which of the N tokens the head computes.

    Where host reads are free (a CPU): those that count, padded with ignored tokens to a
    multiple of ROW_ALIGN (all N when that reaches N); ignored tokens beyond the padding never
    reach the projection. Padding rows are computed on zeroed hidden states with target 0 and
    enter nothing: their loss is dropped and their gradient coefficients are 0.

    On an accelerator: all N rows, the ignored ones as padding rows. Selecting would need the
    count on the host (a sync per call, forward and backward); the count stays on the device.
    """
    valid = targets != ignore_index
    n_tokens = targets.numel()
    if not host_reads_free(targets.device):
        return Rows(None, valid, valid.sum(dtype=torch.float32))
    n = int(valid.sum())
    m = min(n_tokens, -(-n // ROW_ALIGN) * ROW_ALIGN)
    if m == n_tokens:
        return Rows(None, None if n == n_tokens else valid, n)
    # The counted tokens first, then ignored ones, each in their order.
    index = torch.argsort((~valid).to(torch.uint8), stable=True)[:m]
    live = None if m == n else torch.arange(m, device=targets.device) < n
    return Rows(index, live, n)


def checked_targets(tv: Tensor, vocab: int, ignore_index: int) -> Tensor:
    """The targets of the counted tokens, contiguous; a clear error for one outside [0, V)
    where host reads are free (on an accelerator the trainer checks each batch on the host
    before copying it: `compiletune.data.rows.check_targets`)."""
    if host_reads_free(tv.device):
        bad = (tv < 0) | (tv >= vocab)
        if bad.any():
            raise UserError(
                f"cross-entropy targets must lie in [0, {vocab}) or equal "
                f"ignore_index={ignore_index}; found {tv[bad][0].item()}. Check that the "
                "tokenizer matches the model's vocabulary"
            )
    return tv.contiguous()


_ADDMM_OUT_DTYPE: bool | None = None  # addmm(..., out_dtype=) works here: unknown until tried


def accumulate_mm(acc: Tensor, a: Tensor, b: Tensor) -> None:
    """acc += a @ b, where acc may be fp32 and a, b narrower (bf16): on CUDA one cuBLAS call that
    accumulates into acc (`addmm` with `out_dtype`, torch >= 2.9), no [m, n] temporary;
    elsewhere (and where that overload is missing) through the product in a's dtype, which a
    CPU copies to fp32 before adding. With acc in a's dtype, one `addmm_`: the product summed in
    fp32 and added to acc before its one rounding."""
    global _ADDMM_OUT_DTYPE
    if acc.dtype == a.dtype:
        acc.addmm_(a, b)
        return
    if acc.is_cuda and _ADDMM_OUT_DTYPE is not False:
        try:
            torch.addmm(acc, a, b, out_dtype=acc.dtype, out=acc)
            _ADDMM_OUT_DTYPE = True
            return
        except (RuntimeError, TypeError, NotImplementedError):
            _ADDMM_OUT_DTYPE = False
    acc.add_(a @ b)


# ---------------------------------------------------------------------------------------------
# The weight gradient's sum over token chunks, in a narrow dtype: fp32 or the weight's own.

ACCUMULATORS = ("auto", "fp32", "bf16")
# The sum in the weight's dtype (bf16) rounds the running sum once per chunk. Those roundings are
# a random walk over a sum that itself grows like sqrt(chunks seen), so over k chunks dW's
# rounding error is sqrt((k + 1) / 2) times that of a gradient rounded once (measured on CPU,
# tests/unit/ops/test_fused_loss.py; rounding to bf16 is the same on a GPU). `auto` allows it up
# to 4 chunks: at most 1.6x the one-rounding error, inside the numerics contract's slack for
# bf16 (the plain bf16 head's error + 1e-3). Beyond that the fp32 sum costs a [V, d] fp32 buffer
# that the two-op head, which needs none, avoids.
BF16_SUM_MAX_CHUNKS = 4


def accumulator_choice(accumulator: str = "") -> str:
    """`accumulator` if given, else $COMPILETUNE_LCE_ACCUMULATOR, else "auto"; one of
    ACCUMULATORS."""
    source = "accumulator"
    if not accumulator:
        accumulator = os.environ.get("COMPILETUNE_LCE_ACCUMULATOR", "").strip() or "auto"
        source = "COMPILETUNE_LCE_ACCUMULATOR"
    if accumulator not in ACCUMULATORS:
        raise UserError(
            f"{source}={accumulator!r} must be one of {', '.join(ACCUMULATORS)} (how the fused "
            "head sums the weight gradient over token chunks); unset it for auto"
        )
    return accumulator


def narrow_weight_sum(n_chunks: int, dtype: torch.dtype, accumulator: str = "") -> bool:
    """Whether a weight gradient summed over `n_chunks` token chunks is kept in `dtype` itself
    (True) rather than in an fp32 buffer. fp32 weights and one chunk need no separate buffer
    either way (True); else `accumulator_choice(accumulator)`: bf16 -> True, fp32 -> False,
    auto -> n_chunks <= BF16_SUM_MAX_CHUNKS."""
    choice = accumulator_choice(accumulator)
    if dtype == torch.float32 or n_chunks <= 1:
        return True
    return choice == "bf16" or (choice == "auto" and n_chunks <= BF16_SUM_MAX_CHUNKS)


COL_ALIGN = 128  # vocabulary columns per backward chunk come in multiples of this


def vocab_chunk_cols(chunk: int, vocab: int, m: int) -> int:
    """Vocabulary columns per chunk of the backward over columns: as many logits as a chunk of
    `chunk` tokens holds, in multiples of COL_ALIGN. A chunk's logits [m, cols] are the leading
    operand of two matmuls: with a row of e.g. 4094 bf16 values (not 16-byte aligned) cuBLAS
    falls back to slow kernels (seen on an H200: the head's backward took 4.6x plain's)."""
    return max(COL_ALIGN, chunk * vocab // m // COL_ALIGN * COL_ALIGN)
