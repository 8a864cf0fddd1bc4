"""Causal attention, optionally confined to documents: packed rows without cross-contamination.

A packed row holds several examples back to back. `doc_ids [b, s]` numbers them (0, 1, 2, ...
within a row, contiguous); with it, token i attends to token j only when j <= i and both
belong to the same document, so each example sees exactly what it would see alone.

How: `compiletune::doc_causal_attention` runs ordinary causal SDPA on each document's slice of
the row (block-diagonal attention). That is
    exact      each document is the same SDPA call it would be on its own;
    lean       no [s, s] mask or score matrix exists: SDPA's fused kernels run per document,
               so a 32k-token row costs what its longest document costs;
    data       doc_ids is a tensor argument of an opaque custom op, so under torch.compile a
               new set of boundaries is a new input value, not a new graph (no recompiles),
               and every block still traces to the same graph.
Why not flex attention: on CPU (torch 2.13) FlexAttention refuses backward, and uncompiled it
computes the full [b, h, s, s] score matrix; a dense SDPA mask is [s, s] too. The price of the
per-document loop is one kernel launch per document and layer, small next to the matmuls on
CPU. The backward recomputes each document's forward under `torch.func.vjp` (the custom op's
kernel runs below autograd, where `torch.autograd.grad` sees no graph).

Shapes: b = batch, h = heads, s = sequence, hd = head dim.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def doc_segments(doc_ids: Tensor) -> list[tuple[int, int, int]]:
    """(row, start, end) of every document in `doc_ids [b, s]`, row by row, in order."""
    b, s = doc_ids.shape
    starts = torch.ones(b, s, dtype=torch.bool, device=doc_ids.device)
    starts[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
    flat = starts.flatten().nonzero().squeeze(1)  # [n_docs], every row start included
    ends = torch.cat([flat[1:], flat.new_tensor([b * s])])
    rows, cols = flat // s, flat % s
    # A document ends at the next start, or at the end of its row.
    lengths = torch.minimum(ends - flat, s - cols)
    return [
        (r, c, c + n)
        for r, c, n in zip(rows.tolist(), cols.tolist(), lengths.tolist(), strict=True)
    ]


def _sdpa(q: Tensor, k: Tensor, v: Tensor, scale: float) -> Tensor:
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)


@torch.library.custom_op("compiletune::doc_causal_attention", mutates_args=())
def doc_causal_attention_op(
    q: Tensor, k: Tensor, v: Tensor, doc_ids: Tensor, scale: float
) -> Tensor:
    """q, k, v [b, h, s, hd], doc_ids [b, s] -> out [b, h, s, hd] (contiguous)."""
    segments = doc_segments(doc_ids)
    out = q.new_empty(q.shape)
    if len(segments) == q.shape[0]:  # one document per row: a single causal call
        out.copy_(_sdpa(q, k, v, scale))
        return out
    for r, a, e in segments:
        sl = (slice(r, r + 1), slice(None), slice(a, e))
        out[sl] = _sdpa(q[sl], k[sl], v[sl], scale)
    return out


@doc_causal_attention_op.register_fake
def _(q, k, v, doc_ids, scale):
    return q.new_empty(q.shape)


@torch.library.custom_op("compiletune::doc_causal_attention_backward", mutates_args=())
def doc_causal_attention_backward_op(
    grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, doc_ids: Tensor, scale: float
) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients (dq, dk, dv) [b, h, s, hd] of `doc_causal_attention`, document by document."""
    dq, dk, dv = q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)

    def vjp(sl: tuple) -> None:
        _, pullback = torch.func.vjp(
            lambda q_, k_, v_: _sdpa(q_, k_, v_, scale), q[sl], k[sl], v[sl]
        )
        dq[sl], dk[sl], dv[sl] = pullback(grad_out[sl].contiguous())

    segments = doc_segments(doc_ids)
    if len(segments) == q.shape[0]:
        vjp((slice(None),))
    else:
        for r, a, e in segments:
            vjp((slice(r, r + 1), slice(None), slice(a, e)))
    return dq, dk, dv


@doc_causal_attention_backward_op.register_fake
def _(grad_out, q, k, v, doc_ids, scale):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup_context(ctx, inputs, output) -> None:
    q, k, v, doc_ids, scale = inputs
    ctx.save_for_backward(q, k, v, doc_ids)
    ctx.scale = scale


def _backward(ctx, grad_out):
    q, k, v, doc_ids = ctx.saved_tensors
    dq, dk, dv = torch.ops.compiletune.doc_causal_attention_backward(
        grad_out, q, k, v, doc_ids, ctx.scale
    )
    return dq, dk, dv, None, None


doc_causal_attention_op.register_autograd(_backward, setup_context=_setup_context)


def causal_attention(
    q: Tensor, k: Tensor, v: Tensor, scale: float, doc_ids: Tensor | None = None
) -> Tensor:
    """q, k, v [b, h, s, hd] -> [b, h, s, hd]: causal, and within documents when `doc_ids`.

    Without `doc_ids` this is plain causal SDPA, the same call as before document masking
    existed, so unmasked runs keep their numerics.
    """
    if doc_ids is None:
        return _sdpa(q, k, v, scale)
    return doc_causal_attention_op(q, k, v, doc_ids, scale)
