"""Output projection fused with cross-entropy: the [tokens, vocab] logits never exist.

    linear_cross_entropy(h [..., d], weight [V, d], targets [...]) -> fp32 []

is `F.cross_entropy(F.linear(h, weight, bias).float(), targets)` computed a chunk of tokens at a
time. The forward keeps only `lse [N]` (fp32 log-sum-exp per token) for backward; the backward
recomputes each chunk's logits and turns them in place into d loss / d logits, so at most one
chunk of logits is alive at any time, in the forward and in the backward.

The whole head is the custom op `compiletune::linear_cross_entropy`, with its backward the custom
op `compiletune::linear_cross_entropy_backward`: in an AOT joint graph the head is one node in the
forward and one in the backward, which is what the `fuse_linear_cross_entropy` pass emits.

Inside the op each chunk is a matmul (cuBLAS / CPU BLAS, fp32 accumulation) followed by row-wise
work (log-sum-exp, target logit, loss; or softmax - onehot): Triton kernels on CUDA
(`compiletune.ops.triton_ce`), a `torch.compile`d torch function elsewhere. The chunk sizes,
the rows a head computes and the row-wise functions live in `compiletune.ops.ce_chunks`.

When autograd will need the gradients and the sizes fit (`grads_in_forward`), the head is instead
the one-pass op `compiletune::linear_cross_entropy_with_grads`: each chunk's logits become
d loss / d logits in the forward, whose dh / dweight matmuls run there, and the backward only
scales the saved gradients (three vocabulary-sized matmuls per step instead of four).

Also here, for comparison and for `--loss chunked|plain`:
    chunked_cross_entropy   what other trainers do: logits per chunk, autograd saves them all.
    plain_cross_entropy     linear -> fp32 upcast -> cross_entropy.

Environment:
    COMPILETUNE_LCE_CHUNK_TOKENS=n   tokens per chunk when the caller passes chunk_size=0.
    COMPILETUNE_LCE_EAGER=1          run the row-wise torch functions (and the one-pass
                                     gradient scaling) eagerly (fast tests).
    COMPILETUNE_LCE_ONE_PASS=0|1     force the two-op or the one-pass head.
    COMPILETUNE_LCE_ACCUMULATOR=auto|fp32|bf16
                                     how the one-pass head sums a narrow-dtype weight gradient
                                     over token chunks (`ce_chunks.narrow_weight_sum`).
"""

import os

import torch
import torch.nn.functional as F
from torch import Tensor

from compiletune import torch_internals
from compiletune.errors import UserError
from compiletune.ops.ce_chunks import (
    DEFAULT_CHUNK_BYTES,
    MAX_CHUNK_TOKENS,
    MIN_CHUNK_TOKENS,
    accumulate_mm,
    accumulator_choice,
    check_inputs,
    checked_targets,
    chunk_tokens,
    maybe_compiled,
    narrow_weight_sum,
    row_ops,
    select_rows,
    vocab_chunk_cols,
)
from compiletune.ops.op_memory import Args, declare_memory

SCALE_BLOCK_BYTES = 64 * 2**20  # fp32 scratch when the one-pass head scales its gradients

# ---------------------------------------------------------------------------------------------
# The two-op head: loss and lse in the forward, the gradients recomputed chunk by chunk in the
# backward.


@torch.library.custom_op("compiletune::linear_cross_entropy", mutates_args=())
def linear_cross_entropy_op(
    h: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    targets: Tensor,
    ignore_index: int,
    reduction: str,
    chunk_size: int,
    z_loss: float,
    softcap: float,
) -> tuple[Tensor, Tensor]:
    """h [N, d] (any float dtype), weight [V, d], bias [V] or None, targets [N] int64.

    Returns (loss: fp32 scalar, lse: fp32 [N]); lse is 0 for ignored tokens.
    reduction: "sum" | "mean" (mean over non-ignored tokens; 0.0 when all are ignored).
    chunk_size: tokens per chunk; 0 = auto (`chunk_tokens`).
    z_loss: coefficient of z_loss * lse**2 added per token (0 = off).
    softcap: logits = softcap * tanh(logits / softcap) before the softmax (0 = off).
    """
    check_inputs(h, weight, bias, targets, reduction)
    n_tokens, vocab = h.shape[0], weight.shape[0]
    sel = select_rows(targets, ignore_index)
    if sel.empty:
        zero = torch.zeros((), dtype=torch.float32, device=h.device)
        return zero, torch.zeros(n_tokens, dtype=torch.float32, device=h.device)
    hv, tv = sel.inputs(h, targets)  # [m, d], [m]
    tv = checked_targets(tv, vocab, ignore_index)
    m = hv.shape[0]

    rows_forward, _ = row_ops(h.device)
    chunk = chunk_tokens(vocab, chunk_size)
    lse_v = torch.empty(m, dtype=torch.float32, device=h.device)
    loss_v = torch.empty(m, dtype=torch.float32, device=h.device)
    for s in range(0, m, chunk):
        logits = F.linear(hv[s : s + chunk], weight, bias)  # [c, V], the only big tensor
        lse_c, loss_c = rows_forward(logits, tv[s : s + chunk], z_loss, softcap)
        lse_v[s : s + chunk] = lse_c
        loss_v[s : s + chunk] = loss_c
        del logits
    lse_v = sel.dead(lse_v, 0.0)  # lse is 0 for ignored tokens
    if sel.index is None:
        lse = lse_v
    else:
        lse = torch.zeros(n_tokens, dtype=torch.float32, device=h.device)
        lse.index_copy_(0, sel.index, lse_v)
    loss = sel.dead(loss_v, 0.0).sum()
    return (sel.mean(loss) if reduction == "mean" else loss), lse


@linear_cross_entropy_op.register_fake
def _(h, weight, bias, targets, ignore_index, reduction, chunk_size, z_loss, softcap):
    check_inputs(h, weight, bias, targets, reduction)
    return h.new_empty((), dtype=torch.float32), h.new_empty(h.shape[0], dtype=torch.float32)


def _chunk_vocab(
    n: int, vocab: int, d_model: int, dtype: torch.dtype, need_dh: bool, need_dweight: bool
) -> bool:
    """Whether the backward chunks over vocabulary columns (True) or over tokens (False).

    One of dh / dweight is a sum over chunks, kept in an fp32 buffer when the input dtype is
    narrower; the other comes from one matmul per chunk (fp32 accumulation inside the matmul).
    Over tokens dweight is the sum ([V, d] fp32), over vocabulary columns dh is ([n, d] fp32):
    take the smaller buffer. With 16k tokens and a 128k vocabulary that is 8x less memory.
    """
    wide = dtype == torch.float32
    token_acc = vocab * d_model * 4 if need_dweight and not wide else 0
    vocab_acc = n * d_model * 4 if need_dh and not wide else 0
    return vocab_acc < token_acc


# Over 100 lines, on purpose: the chunk loop (recompute a chunk's logits, its gradient, the two
# matmuls into dh and dweight) is the memory pattern ops/op_memory.py declares for this op, and
# reads best as one loop; its helpers are the row-wise functions in ce_chunks.
@torch.library.custom_op("compiletune::linear_cross_entropy_backward", mutates_args=())
def linear_cross_entropy_backward_op(
    grad_loss: Tensor | None,
    grad_lse: Tensor | None,
    h: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    targets: Tensor,
    lse: Tensor,
    ignore_index: int,
    reduction: str,
    chunk_size: int,
    z_loss: float,
    softcap: float,
    need_dh: bool,
    need_dweight: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients of `linear_cross_entropy_op` from its saved inputs and lse [N].

    grad_loss: fp32 [] or None; grad_lse: [N] or None (None = zero).
    Returns (dh [N, d] or [0], dweight [V, d] or [0], dbias [V] or [0]) in the input dtypes;
    [0] where not needed (need_* False, or no bias). dbias is computed with dweight.

    One body on purpose (~110 lines): its two loops, over chunks of tokens or of vocabulary
    columns, share the selected rows, the softmax coefficients and the output buffers; apart,
    each would take a dozen of them as arguments.
    """
    d_model = h.shape[1]
    vocab = weight.shape[0]
    dev, f32 = h.device, torch.float32
    need_dbias = need_dweight and bias is not None
    dh = torch.zeros(h.shape, dtype=h.dtype, device=dev) if need_dh else h.new_empty(0)
    # Not zeroed here: chunks over vocabulary columns write every row of it; the paths that
    # accumulate into it or skip the chunks zero it first.
    dw = (
        torch.empty(weight.shape, dtype=weight.dtype, device=dev)
        if need_dweight
        else h.new_empty(0)
    )
    db = torch.zeros(vocab, dtype=h.dtype, device=dev) if need_dbias else h.new_empty(0)
    sel = select_rows(targets, ignore_index)
    if sel.empty or not (need_dh or need_dweight):
        return dh, dw.zero_(), db
    hv, tv = sel.inputs(h, targets)  # [m, d], [m]
    tv = tv.contiguous()
    # lse = inf on padding rows: their softmax is exactly 0 whatever their logits.
    lse_v = sel.dead(sel.take(lse), float("inf")).contiguous()  # [m]
    m = hv.shape[0]

    # d loss_i / d logit_ij = g * ((1 + 2 z lse_i) softmax_ij - onehot_ij) + grad_lse_i softmax_ij
    g = torch.zeros((), dtype=f32, device=dev) if grad_loss is None else grad_loss.float()
    if reduction == "mean":
        g = sel.mean(g)
    coef_p = g * (1 + 2 * z_loss * lse_v) if z_loss != 0 else g.expand(m)
    if grad_lse is not None:
        coef_p = coef_p + sel.take(grad_lse).float()
    coef_p = sel.dead(coef_p, 0.0).contiguous()
    coef_t = sel.dead(g.expand(m), 0.0).contiguous()

    _, rows_backward = row_ops(dev)
    chunk = chunk_tokens(vocab, chunk_size)
    wide = weight.dtype == f32
    dh_v = dh if sel.index is None or not need_dh else h.new_empty(m, d_model)  # computed rows
    if not _chunk_vocab(m, vocab, d_model, weight.dtype, need_dh, need_dweight):
        # Chunks of tokens: logits [c, V]; dh rows are final per chunk, dweight accumulates.
        dw_acc = (
            (dw.zero_() if wide else torch.zeros(weight.shape, dtype=f32, device=dev))
            if need_dweight
            else None
        )
        db_acc = torch.zeros(vocab, dtype=f32, device=dev) if need_dbias else None
        for s in range(0, m, chunk):
            e = min(s + chunk, m)
            h_c = hv[s:e]
            logits = F.linear(h_c, weight, bias)  # [c, V]
            dl = rows_backward(logits, lse_v[s:e], tv[s:e], coef_p[s:e], coef_t[s:e], 0, softcap)
            del logits
            if need_dh:
                torch.mm(dl, weight, out=dh_v[s:e])
            if need_dweight:
                accumulate_mm(dw_acc, dl.t(), h_c)
            if need_dbias:
                db_acc.add_(dl.sum(0, dtype=f32))
            del dl
        if need_dweight and not wide:
            dw.copy_(dw_acc)
        if need_dbias:
            db.copy_(db_acc)
    else:
        # Chunks of vocabulary columns, as many logits per chunk as a token chunk would hold:
        # logits [m, v]; dweight/dbias rows are final per chunk, dh accumulates in fp32.
        cols = vocab_chunk_cols(chunk, vocab, m)
        if need_dh:
            dh_acc = dh_v.zero_() if wide else torch.zeros(m, d_model, dtype=f32, device=dev)
        for v0 in range(0, vocab, cols):
            v1 = min(v0 + cols, vocab)
            w_c = weight[v0:v1]
            logits = F.linear(hv, w_c, None if bias is None else bias[v0:v1])  # [m, v]
            dl = rows_backward(logits, lse_v, tv, coef_p, coef_t, v0, softcap)
            del logits
            if need_dh:
                accumulate_mm(dh_acc, dl, w_c)
            if need_dweight:
                torch.mm(dl.t(), hv, out=dw[v0:v1])
            if need_dbias:
                db[v0:v1] = dl.sum(0, dtype=f32)
            del dl
        if need_dh and not wide:
            dh_v.copy_(dh_acc)
    if need_dh and sel.index is not None:
        dh.index_copy_(0, sel.index, dh_v)
    return dh, dw, db


@linear_cross_entropy_backward_op.register_fake
def _(
    grad_loss,
    grad_lse,
    h,
    weight,
    bias,
    targets,
    lse,
    ignore_index,
    reduction,
    chunk_size,
    z_loss,
    softcap,
    need_dh,
    need_dweight,
):
    dh = h.new_empty(h.shape) if need_dh else h.new_empty(0)
    dw = weight.new_empty(weight.shape) if need_dweight else h.new_empty(0)
    need_dbias = need_dweight and bias is not None
    db = h.new_empty(weight.shape[0]) if need_dbias else h.new_empty(0)
    return dh, dw, db


@declare_memory("compiletune::linear_cross_entropy")
def _(a: Args) -> int:
    """One chunk of logits [c, V] in h's dtype (the row kernels read it in place; all tokens
    counted as targets)."""
    (n, _), vocab = a["h"].shape, a["weight"].shape[0]
    return min(n, chunk_tokens(vocab, a["chunk_size"])) * vocab * a["h"].element_size()


@declare_memory("compiletune::linear_cross_entropy_backward")
def _(a: Args) -> int:
    """The chunk of logits turned into their gradient, and the sum over chunks: over token
    chunks the weight gradient's fp32 accumulator and one product per chunk; over vocabulary
    columns a chunk [n, cols], the fp32 dh accumulator and one product per chunk. In fp32 the
    output itself accumulates."""
    h, weight = a["h"], a["weight"]
    (n, d), vocab, elt = h.shape, weight.shape[0], h.element_size()
    chunk = chunk_tokens(vocab, a["chunk_size"])
    logits = min(n, chunk) * vocab * elt
    need_dh, need_dw = a["need_dh"], a["need_dweight"]
    if weight.dtype == torch.float32:
        return logits
    if _chunk_vocab(n, vocab, d, weight.dtype, need_dh, need_dw):
        cols = min(vocab, vocab_chunk_cols(chunk, vocab, n))
        return n * cols * elt + n * d * 4 + n * d * elt
    return logits + (vocab * d * (4 + elt) if need_dw else 0)


def _setup_context(ctx, inputs, output) -> None:
    h, weight, bias, targets, ignore_index, reduction, chunk_size, z_loss, softcap = inputs
    # Inputs and lse [N]: the whole saved state of the head (no [N, V] tensor).
    ctx.save_for_backward(h, weight, bias, targets, output[1])
    ctx.args = (ignore_index, reduction, chunk_size, z_loss, softcap)
    ctx.set_materialize_grads(False)  # an unused lse then costs nothing in backward


def _backward(ctx, grad_loss, grad_lse):
    h, weight, bias, targets, lse = ctx.saved_tensors
    need_dh, need_dweight, need_dbias = ctx.needs_input_grad[:3]
    dh, dw, db = torch.ops.compiletune.linear_cross_entropy_backward(
        grad_loss,
        grad_lse,
        h,
        weight,
        bias,
        targets,
        lse,
        *ctx.args,
        need_dh,
        need_dweight or need_dbias,
    )
    return (
        dh if need_dh else None,
        dw if need_dweight else None,
        db if need_dbias else None,
        None,
        None,
        None,
        None,
        None,
        None,
    )


linear_cross_entropy_op.register_autograd(_backward, setup_context=_setup_context)


# ---------------------------------------------------------------------------------------------
# The one-pass head: gradients computed in the forward.
#
# The two-op head above runs four [tokens, vocab]-sized matmuls per step: logits in the
# forward, and again in the backward (recomputed from lse), then dh and dweight. When the
# gradient will be needed anyway, the forward can turn each chunk's logits into d loss / d logits
# right away (lse is known once a chunk holds whole rows) and run the dh and dweight matmuls
# there: three matmuls, the same as the unfused head. The backward only scales the saved
# gradients by the incoming grad_loss. What it saves is dh [N, d] and dweight [V, d] (what the
# backward would allocate anyway) instead of h and lse.
#
# Chunks must hold whole rows, so they go over tokens and dweight sums over chunks. In fp32 it
# accumulates in place. In a narrow dtype it sums either in the output itself (one rounding per
# chunk, `ce_chunks.narrow_weight_sum`) or in an fp32 [V, d] buffer; the one-pass head is chosen
# there only when no fp32 buffer is needed (`grads_in_forward`).


def one_pass_chunk_tokens(vocab: int, d_model: int, dtype: torch.dtype, chunk_size: int = 0) -> int:
    """Tokens per chunk of the one-pass head: chunk_size or $COMPILETUNE_LCE_CHUNK_TOKENS if set,
    else as many tokens as keep a chunk of logits [tokens, vocab] in `dtype` under the larger of
    DEFAULT_CHUNK_BYTES and the size of the weight gradient [V, d] that the head produces anyway
    (clamped like `chunk_tokens`)."""
    if chunk_size > 0 or os.environ.get("COMPILETUNE_LCE_CHUNK_TOKENS", "").strip():
        return chunk_tokens(vocab, chunk_size)
    elt = torch.empty((), dtype=dtype).element_size()
    budget = max(DEFAULT_CHUNK_BYTES, vocab * d_model * elt)
    return max(MIN_CHUNK_TOKENS, min(MAX_CHUNK_TOKENS, budget // (elt * vocab)))


def grads_in_forward(
    n_tokens: int,
    vocab: int,
    d_model: int,
    dtype: torch.dtype,
    chunk_size: int = 0,
    need_dweight: bool = True,
    accumulator: str = "",
) -> bool:
    """Whether the head computes its gradients in the forward (the one-pass op). Two conditions:

    it fits     no fp32 [V, d] accumulator: fp32 (dweight accumulates in place), all n_tokens
                in one chunk, or a sum in the weight's dtype that `narrow_weight_sum` allows
                (`accumulator`: see `ce_chunks.accumulator_choice`);
    it is small the gradients it saves from forward to backward (dweight [V, d] when the
                weight trains, dh [N, d]) are no larger than the fp32 log-probabilities
                [N, V] that the plain head saves. At few tokens a [V, d] gradient outweighs
                them (1 GiB for Llama 3 8B against 0.5 GiB at 1024 tokens), and the two-op
                head, which saves only lse [N], is what keeps fused <= plain.

    COMPILETUNE_LCE_ONE_PASS=0|1 overrides both."""
    env = os.environ.get("COMPILETUNE_LCE_ONE_PASS", "").strip()
    if env in ("0", "1"):
        return env == "1"
    if env:
        raise UserError(
            f"COMPILETUNE_LCE_ONE_PASS={env!r} must be 0 (two-op head) or 1 (one-pass head); "
            "unset it to let the sizes decide"
        )
    elt = torch.empty((), dtype=dtype).element_size()
    saved = ((vocab if need_dweight else 0) + n_tokens) * d_model * elt
    if saved > n_tokens * vocab * 4:
        return False
    chunk = one_pass_chunk_tokens(vocab, d_model, dtype, chunk_size)
    return narrow_weight_sum(-(-n_tokens // chunk), dtype, accumulator)


@torch.library.custom_op("compiletune::linear_cross_entropy_with_grads", mutates_args=())
def linear_cross_entropy_with_grads_op(
    h: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    targets: Tensor,
    ignore_index: int,
    reduction: str,
    chunk_size: int,
    z_loss: float,
    softcap: float,
    need_dh: bool,
    need_dweight: bool,
    accumulator: str = "",
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The loss of `linear_cross_entropy_op` and its gradients for grad_loss = 1, in one pass.

    Returns (loss fp32 [], dh [N, d] or [0], dweight [V, d] or [0], dbias [V] or [0]) in the
    input dtypes; [0] where not needed (dbias comes with dweight when there is a bias).
    chunk_size: tokens per chunk; 0 = `one_pass_chunk_tokens`.
    accumulator: how dweight sums over chunks in a narrow dtype ("" = the environment's or
    auto; `ce_chunks.narrow_weight_sum`). dbias always sums in fp32 (a [V] buffer).
    """
    check_inputs(h, weight, bias, targets, reduction)
    d_model = h.shape[1]
    vocab = weight.shape[0]
    dev, f32 = h.device, torch.float32
    need_dbias = need_dweight and bias is not None
    dh = torch.zeros(h.shape, dtype=h.dtype, device=dev) if need_dh else h.new_empty(0)
    # Not zeroed here: one chunk writes all of it; the paths that accumulate zero it first.
    dw = torch.empty(weight.shape, dtype=weight.dtype, device=dev) if need_dweight else None
    db = torch.zeros(vocab, dtype=h.dtype, device=dev) if need_dbias else h.new_empty(0)
    sel = select_rows(targets, ignore_index)
    if sel.empty:
        zero = torch.zeros((), dtype=f32, device=dev)
        return zero, dh, h.new_empty(0) if dw is None else dw.zero_(), db
    hv, tv = sel.inputs(h, targets)  # [m, d], [m]
    tv = checked_targets(tv, vocab, ignore_index)
    m = hv.shape[0]

    rows_forward, rows_backward = row_ops(dev)
    chunk = one_pass_chunk_tokens(vocab, d_model, weight.dtype, chunk_size)
    # d loss / d (per-token loss) of each computed row: 0 on padding rows.
    ones = torch.ones((m,), dtype=f32, device=dev)
    units = sel.dead(sel.mean(ones) if reduction == "mean" else ones, 0.0)
    one_chunk = m <= chunk
    if dw is None or one_chunk:
        dw_acc = dw
    elif narrow_weight_sum(-(-m // chunk), weight.dtype, accumulator):
        # In the output: addmm adds each chunk's product, summed in fp32 inside the matmul, to
        # the running sum and rounds once (a cuBLAS epilogue on a GPU: no [V, d] temporary).
        # Rounding the product first and adding it after rounds twice per chunk; a Kahan
        # compensation would need a second [V, d] buffer, more than the two-op head holds.
        dw_acc = dw.zero_()
    else:
        dw_acc = torch.zeros(dw.shape, dtype=f32, device=dev)
    db_acc = torch.zeros(vocab, dtype=f32, device=dev) if need_dbias else None
    dh_v = dh if sel.index is None or not need_dh else h.new_empty(m, d_model)
    loss_v = torch.empty(m, dtype=f32, device=dev)
    for s in range(0, m, chunk):
        e = min(s + chunk, m)
        h_c = hv[s:e]
        logits = F.linear(h_c, weight, bias)  # [c, V]
        lse_c, loss_v[s:e] = rows_forward(logits, tv[s:e], z_loss, softcap)
        coef_t = units[s:e]
        coef_p = coef_t * (1 + 2 * z_loss * lse_c) if z_loss != 0 else coef_t
        dl = rows_backward(logits, lse_c, tv[s:e], coef_p, coef_t, 0, softcap)  # in place
        del logits
        if need_dh:
            torch.mm(dl, weight, out=dh_v[s:e])
        if need_dweight:
            if one_chunk:
                torch.mm(dl.t(), h_c, out=dw_acc)
            else:
                accumulate_mm(dw_acc, dl.t(), h_c)
        if need_dbias:
            db_acc.add_(dl.sum(0, dtype=f32))
        del dl
    if need_dweight and dw_acc is not dw:
        dw.copy_(dw_acc)
    if need_dbias:
        db.copy_(db_acc)
    if need_dh and sel.index is not None:
        dh.index_copy_(0, sel.index, dh_v)
    loss = sel.dead(loss_v, 0.0).sum()
    return (
        (sel.mean(loss) if reduction == "mean" else loss),
        dh,
        h.new_empty(0) if dw is None else dw,
        db,
    )


@linear_cross_entropy_with_grads_op.register_fake
def _(
    h,
    weight,
    bias,
    targets,
    ignore_index,
    reduction,
    chunk_size,
    z_loss,
    softcap,
    need_dh,
    need_dweight,
    accumulator="",
):
    check_inputs(h, weight, bias, targets, reduction)
    dh = h.new_empty(h.shape) if need_dh else h.new_empty(0)
    dw = weight.new_empty(weight.shape) if need_dweight else h.new_empty(0)
    db = h.new_empty(weight.shape[0]) if need_dweight and bias is not None else h.new_empty(0)
    return h.new_empty((), dtype=torch.float32), dh, dw, db


@declare_memory("compiletune::linear_cross_entropy_with_grads")
def _(a: Args) -> int:
    """A chunk of logits (turned into their gradient in place) and, where a narrow dweight sums
    over chunks in fp32, that buffer and one product per chunk. The gradients it returns are
    outputs (a sum in the weight's dtype accumulates in one of them)."""
    h, weight = a["h"], a["weight"]
    (n, d), vocab, elt = h.shape, weight.shape[0], h.element_size()
    c = min(n, one_pass_chunk_tokens(vocab, d, weight.dtype, a["chunk_size"]))
    fp32_sum = a["need_dweight"] and not narrow_weight_sum(
        -(-n // c), weight.dtype, a["accumulator"]
    )
    return c * vocab * elt + (vocab * d * (4 + elt) if fp32_sum else 0)


def _scaled(t: Tensor, g: Tensor) -> Tensor:
    """t * g formed in fp32, rounded once to t's dtype (compiled: one pass, no fp32 copy)."""
    return (t.float() * g).to(t.dtype)


def _scaled_by_blocks(t: Tensor, g: Tensor) -> Tensor:
    """`_scaled` a block at a time: at most SCALE_BLOCK_BYTES of fp32 scratch."""
    flat, out = t.reshape(-1), torch.empty(t.shape, dtype=t.dtype, device=t.device)
    step = max(1, SCALE_BLOCK_BYTES // 4)
    for i in range(0, flat.numel(), step):
        out.view(-1)[i : i + step] = flat[i : i + step].float() * g
    return out


def _scale(t: Tensor, g: Tensor) -> Tensor:
    """t * g (g fp32 []) rounded once to t's dtype, with no fp32 copy of a [V, d] gradient.
    Inside a compiled graph Inductor fuses the expression. In eager on a CPU it is one
    Inductor-compiled pass (in a microbenchmark 48 ms for a bf16 [128256, 512] gradient,
    against 224 ms for the block loop). Elsewhere, and for fake tensors (the memory estimate's,
    which therefore counts the loop's fp32 blocks) or a double backward, the block loop."""
    if t.dtype == torch.float32:
        return t * g
    if torch.compiler.is_compiling():
        return _scaled(t, g)
    if (
        type(t) is Tensor
        and type(g) is Tensor
        and t.device.type == "cpu"
        and not torch.is_grad_enabled()  # backward(create_graph=True) records the loop's graph
    ):
        # Flat: one compiled graph serves dh [N, d], dW [V, d] and db [V] (2-D shapes that
        # happen to share a size, N == d, would specialise and compile again). Reshaped below
        # ADInplaceOrView, the flat tensor is a plain alias: not a view that Dynamo would
        # trace back to its 2-D base, and the result is no view either.
        with torch_internals.below_inplace_or_view():
            flat = t.reshape(-1)
        out = maybe_compiled(_scaled, eager=_scaled_by_blocks)(flat, g)
        with torch_internals.below_inplace_or_view():
            return out.view(t.shape)
    return _scaled_by_blocks(t, g)


def _setup_context_one_pass(ctx, inputs, output) -> None:
    ctx.save_for_backward(*output[1:])  # the unit gradients: all that backward needs
    ctx.set_materialize_grads(False)


def _backward_one_pass(ctx, grad_loss, _grad_dh, _grad_dw, _grad_db):
    dh, dw, db = ctx.saved_tensors
    need_dh, need_dweight, need_dbias = ctx.needs_input_grad[:3]
    if grad_loss is None:
        return (None,) * 12

    def scaled(g: Tensor, needed: bool) -> Tensor | None:
        return _scale(g, grad_loss) if needed and g.numel() else None

    return (
        scaled(dh, need_dh),
        scaled(dw, need_dweight),
        scaled(db, need_dbias),
        *(None,) * 9,
    )


linear_cross_entropy_with_grads_op.register_autograd(
    _backward_one_pass, setup_context=_setup_context_one_pass
)


# ---------------------------------------------------------------------------------------------
# Public functions: the fused head and the two baselines it is measured against.


def _flatten(h: Tensor, targets: Tensor) -> tuple[Tensor, Tensor]:
    """h [..., d], targets [...] -> h [N, d], targets [N]."""
    if h.shape[:-1] != targets.shape:
        raise ValueError(
            f"h [..., d] and targets [...] must agree on the token dimensions, got h "
            f"{tuple(h.shape)} and targets {tuple(targets.shape)}"
        )
    return h.reshape(-1, h.shape[-1]), targets.reshape(-1)


def linear_cross_entropy(
    h: Tensor,
    weight: Tensor,
    targets: Tensor,
    bias: Tensor | None = None,
    *,
    ignore_index: int = -100,
    reduction: str = "mean",
    chunk_size: int = 0,
    z_loss: float = 0.0,
    softcap: float = 0.0,
    one_pass: bool | None = None,
    accumulator: str = "",
) -> Tensor:
    """Fused cross_entropy(linear(h, weight, bias), targets): h [..., d], weight [V, d],
    targets [...] -> fp32 []. See `linear_cross_entropy_op` for the arguments.

    one_pass: compute the gradients in the forward (`linear_cross_entropy_with_grads_op`);
    None = when autograd will need them and `grads_in_forward` says the sizes fit.
    accumulator: auto | fp32 | bf16, how the one-pass head sums a narrow weight gradient over
    chunks ("" = $COMPILETUNE_LCE_ACCUMULATOR or auto; `ce_chunks.narrow_weight_sum`).
    """
    accumulator = accumulator_choice(accumulator)
    h2, t2 = _flatten(h, targets)
    need = [
        torch.is_grad_enabled() and x is not None and x.requires_grad for x in (h, weight, bias)
    ]
    if one_pass is None:
        one_pass = any(need) and grads_in_forward(
            h2.shape[0],
            weight.shape[0],
            weight.shape[1],
            weight.dtype,
            chunk_size,
            need[1],
            accumulator,
        )
    if one_pass:
        loss, *_ = torch.ops.compiletune.linear_cross_entropy_with_grads(
            h2,
            weight,
            bias,
            t2,
            ignore_index,
            reduction,
            chunk_size,
            z_loss,
            softcap,
            need[0],
            need[1] or need[2],
            accumulator,
        )
        return loss
    loss, _ = torch.ops.compiletune.linear_cross_entropy(
        h2, weight, bias, t2, ignore_index, reduction, chunk_size, z_loss, softcap
    )
    return loss


def _reduce(total: Tensor, targets: Tensor, ignore_index: int, reduction: str) -> Tensor:
    """Sum of per-token losses -> the requested reduction (mean is 0, not NaN, when all are
    ignored)."""
    if reduction == "sum":
        return total
    if reduction != "mean":
        raise ValueError(f"reduction must be 'mean' or 'sum', not {reduction!r}")
    return total / (targets != ignore_index).sum().clamp(min=1)


def chunked_cross_entropy(
    h: Tensor,
    weight: Tensor,
    targets: Tensor,
    bias: Tensor | None = None,
    *,
    ignore_index: int = -100,
    reduction: str = "mean",
    chunks: int = 8,
    softcap: float = 0.0,
) -> Tensor:
    """The chunked-logits baseline (torchtune's CEWithChunkedOutputLoss): h [..., d] split into
    `chunks` pieces of tokens, each projected and upcast to fp32 on its own. Avoids holding the
    input-dtype and the fp32 logits of all tokens at once, but autograd still saves every
    chunk's fp32 log-probabilities: [N, V] fp32 in total. -> fp32 []."""
    h2, t2 = _flatten(h, targets)

    def logits(h_c: Tensor) -> Tensor:
        x = F.linear(h_c, weight, bias).float()
        return softcap * torch.tanh(x / softcap) if softcap > 0 else x

    total = sum(
        F.cross_entropy(logits(h_c), t_c, ignore_index=ignore_index, reduction="sum")
        for h_c, t_c in zip(h2.chunk(chunks), t2.chunk(chunks), strict=True)
    )
    return _reduce(total, t2, ignore_index, reduction)


def plain_cross_entropy(
    h: Tensor,
    weight: Tensor,
    targets: Tensor,
    bias: Tensor | None = None,
    *,
    ignore_index: int = -100,
    reduction: str = "mean",
) -> Tensor:
    """The reference: F.cross_entropy(F.linear(h, weight, bias).float(), targets).
    h [..., d] -> fp32 []; [N, V] logits in the input dtype and in fp32 both exist."""
    h2, t2 = _flatten(h, targets)
    logits = F.linear(h2, weight, bias).float()  # [N, V]
    total = F.cross_entropy(logits, t2, ignore_index=ignore_index, reduction="sum")
    return _reduce(total, t2, ignore_index, reduction)
