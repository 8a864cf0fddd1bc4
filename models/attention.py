"""Causal attention with the masks the supported families need, without a [seq, seq] matrix.

    documents      doc_ids [b, s] numbers the examples of a packed row (0, 1, 2 ... contiguous);
                   token i attends to token j only when both belong to the same document, so each
                   example sees exactly what it would see alone.
    sliding window window W > 0: token i attends to
                   j only when i - W < j <= i (HF's convention: W tokens, itself included).
                   Composes with documents: a token sees its own document within the window.
    soft-capping   softcap c > 0: scores become c * tanh(scores / c) before the
                   softmax. SDPA cannot do this, so it has its own exact kernel (below).

`attention(q, k, v, scale, doc_ids, window, softcap)` runs plain causal SDPA when none of the
three is in play (the numerics of a run without them are unchanged). Otherwise it calls the
opaque custom op `compiletune::attention`, which works segment by segment (a segment is one
document, or one whole row without doc_ids):

    causal       a segment no longer than the window and without softcap: one causal SDPA call
                 on the segment (SDPA's fused kernels, no mask tensor);
    windowed     longer segments: queries in chunks of `_CHUNK`; each chunk calls SDPA on the
                 keys it can see (at most chunk + W - 1) with a [chunk, keys] mask;
    soft-capped  tiles of `_TILE` queries x `_TILE` keys with an online (streaming) softmax in
                 fp32; the backward is its own (flash-attention style: recompute each tile's
                 probabilities from the saved log-sum-exp), so neither direction ever holds more
                 than one [b, h, tile, tile] block of scores.

Everything is data: doc_ids is a tensor argument, window and softcap are constants of the
layer, so under torch.compile new document boundaries are new input values (no recompiles) and
a layer kind (local or global) traces to one graph. The backward of the SDPA paths recomputes
each piece's forward under `torch.func.vjp` (the op's kernel runs below autograd).

Shapes: b = batch, h = heads, s = sequence, hd = head dim.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import inspect
import math
import os
from typing import Any, NamedTuple

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from compiletune.ops.op_memory import declare_memory, holds_nothing

from .vision.mask import is_dense_mask, masked_attention

try:  # torch's varlen flash attention (2.9 on); importing it registers torch_attn::_varlen_attn
    from torch.nn.attention import varlen as _varlen
except ImportError:
    _varlen = None

_CHUNK = 512  # queries per SDPA call on a windowed segment
_TILE = 256  # queries and keys per block of the soft-capped kernel


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


def _segments(q: Tensor, doc_ids: Tensor | None) -> list[tuple[slice, int, int]]:
    """(rows, start, end): the whole batch at once without doc_ids, else one per document."""
    if doc_ids is None:
        return [(slice(None), 0, q.shape[2])]
    return [(slice(r, r + 1), a, e) for r, a, e in doc_segments(doc_ids)]


def _sdpa(q: Tensor, k: Tensor, v: Tensor, scale: float, mask: Tensor | None = None) -> Tensor:
    if mask is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)


def visible(
    q_start: int, q_end: int, k_start: int, k_end: int, window: int, device: torch.device
) -> Tensor:
    """[q, k] bool: query position i sees key position j (causal, within `window` when > 0)."""
    qi = torch.arange(q_start, q_end, device=device)[:, None]
    kj = torch.arange(k_start, k_end, device=device)[None, :]
    ok = kj <= qi
    return ok & (qi - kj < window) if window > 0 else ok


def _windowed_pieces(a: int, e: int, window: int) -> list[tuple[int, int, int]]:
    """(query start, query end, first key) of the chunks of segment [a, e) under `window`."""
    return [(qa, min(qa + _CHUNK, e), max(a, qa - window + 1)) for qa in range(a, e, _CHUNK)]


# --- soft-capped tiles -------------------------------------------------------------------


def _tile_scores(
    q: Tensor, k: Tensor, qa: int, ka: int, scale: float, softcap: float, window: int
) -> tuple[Tensor, Tensor | None]:
    """Scores [.., tq, tk] (fp32, -inf where hidden), capped when softcap > 0, and the tanh of
    the cap (for the backward; None without one)."""
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    t = None
    if softcap > 0:
        t = torch.tanh(scores / softcap)
        scores = softcap * t
    seen = visible(qa, qa + q.shape[-2], ka, ka + k.shape[-2], window, q.device)
    return scores.masked_fill(~seen, -math.inf), t


def _key_tiles(qa: int, qe: int, window: int) -> range:
    """Start of every key tile a query tile [qa, qe) of a segment (positions from 0) can see."""
    first = max(0, qa - window + 1) if window > 0 else 0
    return range(first, qe, _TILE)


def _tiled_forward(
    q: Tensor, k: Tensor, v: Tensor, scale: float, softcap: float, window: int
) -> tuple[Tensor, Tensor]:
    """One segment, q k [.., n, hd], v [.., n, hv] -> out [.., n, hv] (q's dtype), lse [.., n]
    (fp32)."""
    n = q.shape[-2]
    out = q.new_empty(_out_shape(q, v))
    lse = q.new_empty(q.shape[:-1], dtype=torch.float32)
    for qa in range(0, n, _TILE):
        qe = min(qa + _TILE, n)
        qt = q[..., qa:qe, :]
        m = torch.full(qt.shape[:-1], -math.inf, dtype=torch.float32, device=q.device)
        total = torch.zeros_like(m)
        acc = torch.zeros(_out_shape(qt, v), dtype=torch.float32, device=q.device)
        for ka in _key_tiles(qa, qe, window):
            ke = min(ka + _TILE, qe)
            scores, _ = _tile_scores(qt, k[..., ka:ke, :], qa, ka, scale, softcap, window)
            m_new = torch.maximum(m, scores.amax(-1))
            base = torch.where(m_new == -math.inf, 0.0, m_new)  # rows with nothing seen yet
            p = torch.exp(scores - base[..., None])
            keep = torch.exp(m - base)
            total = total * keep + p.sum(-1)
            acc = acc * keep[..., None] + torch.matmul(p, v[..., ka:ke, :].float())
            m = m_new
        out[..., qa:qe, :] = (acc / total[..., None]).to(q.dtype)
        lse[..., qa:qe] = m + torch.log(total)
    return out, lse


def _tiled_backward(
    grad: Tensor,
    grad_lse: Tensor | None,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    scale: float,
    softcap: float,
    window: int,
) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients of one segment of `_tiled_forward` (given those of out and of lse), tile by
    tile (fp32 accumulators)."""
    n = q.shape[-2]
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    dk = torch.zeros(k.shape, dtype=torch.float32, device=q.device)
    dv = torch.zeros(v.shape, dtype=torch.float32, device=q.device)
    # [.., n]: rowsum(dO * O), less dL/dlse (d lse / d score_ij = p_ij)
    delta = (grad.float() * out.float()).sum(-1)
    if grad_lse is not None:
        delta = delta - grad_lse.float()
    for qa in range(0, n, _TILE):
        qe = min(qa + _TILE, n)
        qt, gt = q[..., qa:qe, :], grad[..., qa:qe, :].float()
        for ka in _key_tiles(qa, qe, window):
            ke = min(ka + _TILE, qe)
            kt, vt = k[..., ka:ke, :], v[..., ka:ke, :]
            scores, t = _tile_scores(qt, kt, qa, ka, scale, softcap, window)
            p = torch.exp(scores - lse[..., qa:qe, None])  # hidden entries: exp(-inf) = 0
            dv[..., ka:ke, :] += torch.matmul(p.transpose(-1, -2), gt)
            dp = torch.matmul(gt, vt.float().transpose(-1, -2))
            # through the softmax, then through c * tanh(x / c) (derivative 1 - tanh^2)
            ds = p * (dp - delta[..., qa:qe, None]) * scale
            if t is not None:
                ds = ds * (1 - t * t)
            dq[..., qa:qe, :] += torch.matmul(ds, kt.float())
            dk[..., ka:ke, :] += torch.matmul(ds.transpose(-1, -2), qt.float())
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


# --- the op ------------------------------------------------------------------------------


def _out_shape(q: Tensor, v: Tensor) -> tuple[int, ...]:
    """The output's shape: q's, with the values' head dim (MLA's differs from the keys')."""
    return (*q.shape[:-1], v.shape[-1])


def _lse_shape(q: Tensor, tiled: bool) -> tuple[int, ...]:
    return (*q.shape[:-1],) if tiled else (0,)


@torch.library.custom_op("compiletune::attention", mutates_args=())
def attention_op(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    doc_ids: Tensor | None,
    scale: float,
    window: int,
    softcap: float,
    tiled: bool = False,
) -> tuple[Tensor, Tensor]:
    """q, k [b, h, s, hd], v [b, h, s, hv] -> (out [b, h, s, hv], lse [b, h, s] fp32, or [0]
    from the SDPA paths). The tiled kernel runs with a softcap, or when `tiled` (the log-sum-exp is wanted:
    attention sinks)."""
    tiled = tiled or softcap > 0
    out = q.new_empty(_out_shape(q, v))
    lse = q.new_empty(_lse_shape(q, tiled), dtype=torch.float32)
    for rows, a, e in _segments(q, doc_ids):
        sl = (rows, slice(None), slice(a, e))
        if tiled:
            out[sl], lse[sl] = _tiled_forward(q[sl], k[sl], v[sl], scale, softcap, window)
        elif window <= 0 or e - a <= window:
            out[sl] = _sdpa(q[sl], k[sl], v[sl], scale)
        else:
            for qa, qe, ka in _windowed_pieces(a, e, window):
                mask = visible(qa, qe, ka, qe, window, q.device)
                out[rows, :, qa:qe] = _sdpa(
                    q[rows, :, qa:qe], k[rows, :, ka:qe], v[rows, :, ka:qe], scale, mask
                )
    return out, lse


@attention_op.register_fake
def _(q, k, v, doc_ids, scale, window, softcap, tiled=False):
    lse_shape = _lse_shape(q, tiled or softcap > 0)
    return q.new_empty(_out_shape(q, v)), q.new_empty(lse_shape, dtype=torch.float32)


@torch.library.custom_op("compiletune::attention_backward", mutates_args=())
def attention_backward_op(
    grad_out: Tensor,
    grad_lse: Tensor | None,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    doc_ids: Tensor | None,
    scale: float,
    window: int,
    softcap: float,
    tiled: bool = False,
) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients (dq, dk, dv) [b, h, s, hd] of `attention` (given those of out and, from the
    tiled kernel, of lse), segment by segment."""
    tiled = tiled or softcap > 0
    # fp32 accumulators (overlapping windowed chunks add into dk, dv), contiguous as the fake
    # says; cast to the inputs' dtype at the end
    dq, dk, dv = (q.new_zeros(t.shape, dtype=torch.float32) for t in (q, k, v))

    def vjp(rows: slice, qa: int, qe: int, ka: int, mask: Tensor | None) -> None:
        qs, ks = (rows, slice(None), slice(qa, qe)), (rows, slice(None), slice(ka, qe))
        _, pullback = torch.func.vjp(
            lambda q_, k_, v_: _sdpa(q_, k_, v_, scale, mask), q[qs], k[ks], v[ks]
        )
        gq, gk, gv = pullback(grad_out[qs].contiguous())
        dq[qs] += gq
        dk[ks] += gk
        dv[ks] += gv

    for rows, a, e in _segments(q, doc_ids):
        sl = (rows, slice(None), slice(a, e))
        if tiled:
            dq[sl], dk[sl], dv[sl] = _tiled_backward(
                grad_out[sl],
                None if grad_lse is None else grad_lse[sl],
                q[sl],
                k[sl],
                v[sl],
                out[sl],
                lse[sl],
                scale,
                softcap,
                window,
            )
        elif window <= 0 or e - a <= window:
            vjp(rows, a, e, a, None)
        else:
            for qa, qe, ka in _windowed_pieces(a, e, window):
                vjp(rows, qa, qe, ka, visible(qa, qe, ka, qe, window, q.device))
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


@attention_backward_op.register_fake
def _(grad_out, grad_lse, q, k, v, out, lse, doc_ids, scale, window, softcap, tiled=False):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup_context(ctx, inputs, output) -> None:
    q, k, v, doc_ids, scale, window, softcap, tiled = inputs
    out, lse = output
    tiled = tiled or softcap > 0
    ctx.save_for_backward(q, k, v, out if tiled else None, lse, doc_ids)
    ctx.constants = (scale, window, softcap, tiled)


def _backward(ctx, grad_out, grad_lse):
    q, k, v, out, lse, doc_ids = ctx.saved_tensors
    if out is None:
        out = q.new_empty(0)
    if grad_lse is not None and grad_lse.numel() == 0:
        grad_lse = None
    dq, dk, dv = torch.ops.compiletune.attention_backward(
        grad_out, grad_lse, q, k, v, out, lse, doc_ids, *ctx.constants
    )
    return dq, dk, dv, None, None, None, None, None


attention_op.register_autograd(_backward, setup_context=_setup_context)

# What the segment op holds beyond its outputs, for the memory estimate: not modelled. It works
# one document (or one window chunk, or one tile) at a time, so what it holds is one segment's
# SDPA workspace or [b, h, tile, tile] scores: small next to the step's activations.
declare_memory("compiletune::attention")(holds_nothing)
declare_memory("compiletune::attention_backward")(holds_nothing)


# --- varlen flash attention (CUDA, documents only) -----------------------------------------


class VarlenDocs(NamedTuple):
    """The documents of a packed batch as one varlen flash-attention call reads them: the
    whole batch is one sequence of b * s tokens, document i is tokens cu_seqlens[i] ..
    cu_seqlens[i + 1] - 1. Built on the host from the batch before it is copied (`cu_seqlens`),
    so no step reads the device to find its documents. `doc_ids` [b, s] stays beside them for
    a layer that cannot take the varlen kernel (it falls back to FlexAttention)."""

    doc_ids: Tensor
    cu_seqlens: Tensor  # int32 [n_docs + 1]: 0, the end of each document, ..., b * s
    max_seqlen: int  # s: an upper bound on every document's length (see `cu_seqlens`)


def cu_seqlens(doc_ids: Tensor | np.ndarray) -> tuple[Tensor, int]:
    """Host side: `doc_ids` [b, s] (a document starts wherever the id changes along a row, and
    every row starts one) -> (int32 [n_docs + 1] cumulative lengths over the flattened batch,
    max_seqlen). A row's padding is a document of its own (as data/ numbers it), a row that is
    one document is one entry, and an empty batch gives [0]. Computed in numpy: no torch op
    runs, so neither a device nor the memory estimate's fake-tensor mode sees it.

    max_seqlen is the row length s, not the longest document: flash attention only sizes its
    grid from it (blocks past a document's end return at once), and a constant keeps the
    compiled block to one graph (a new value under dynamic=False would compile a new one)."""
    ids = doc_ids.numpy() if isinstance(doc_ids, Tensor) else np.asarray(doc_ids)
    b, s = ids.shape
    starts = np.ones((b, s), dtype=bool)
    starts[:, 1:] = ids[:, 1:] != ids[:, :-1]
    cu = np.append(np.flatnonzero(starts), b * s).astype(np.int32)
    return torch.from_numpy(cu), s


VARLEN_KEY = "varlen"  # where `hidden_states` hands the batch's VarlenDocs to the layers' `mask`
VARLEN_ENV = "COMPILETUNE_VARLEN"  # "off": never; "force": any device and dtype (CPU tests)
_HALF = (torch.float16, torch.bfloat16)


def find_varlen_api(module: Any) -> tuple[Any, str] | None:
    """(varlen_attn, how it takes causality) of `module` (torch.nn.attention.varlen, or None
    where this torch lacks it) when it takes a `scale`, else None. The signature moved between
    releases: 2.9's documented one takes `is_causal=` and no scale (a model's own scale would
    be lost: not used); the later documented ones (main from late 2025, 2.12,
    and this CPU's 2.13) take keyword-only `scale=` and `window_size=(-1, 0)` for causal.
    2.11's page was not found: its form is decided here by the signature, both accepted, and
    the GPU check's CUDA tests print which one ran (tests/gpu/test_cuda_varlen.py)."""
    if module is None:
        return None
    varlen_attn = module.varlen_attn
    params = inspect.signature(varlen_attn).parameters
    if "scale" not in params:
        return None
    if "window_size" in params:
        return varlen_attn, "window"
    if "is_causal" in params:
        return varlen_attn, "is_causal"
    return None


VARLEN_API = find_varlen_api(_varlen)  # resolved once: the compiled blocks read a constant


def varlen_available(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether a forward on `device` in `dtype` can run documents through torch's varlen flash
    attention: CUDA, fp16/bf16 (flash attention's dtypes) and a torch that has it (see
    `find_varlen_api`). COMPILETUNE_VARLEN=off turns it off, =force on for any device and dtype
    (tests that register a CPU kernel for torch's op)."""
    mode = os.environ.get(VARLEN_ENV, "")
    if mode not in ("", "off", "force"):
        raise ValueError(f"{VARLEN_ENV}={mode!r}: expected off or force")
    if mode == "off" or VARLEN_API is None:
        return False
    return mode == "force" or (device.type == "cuda" and dtype in _HALF)


def shared_masks(
    documents: tuple[Tensor, int] | None,
    doc_ids: Tensor | None,
    device: torch.device,
    dtype: torch.dtype,
) -> dict:
    """The masks every layer of a forward shares, to start with: the batch's VarlenDocs
    (`documents`: `cu_seqlens` of its doc_ids, built on the host) where varlen attention can
    run, so the layers' `mask` finds them; FlexAttention's block masks are added per window."""
    if documents is None or doc_ids is None or not varlen_available(device, dtype):
        return {}
    cu, max_seqlen = documents
    cu = cu.to(device, non_blocking=True)
    if cu.shape[0] >= 2:
        # one compiled graph for any number of documents (dynamo specialises sizes 0 and 1)
        torch._dynamo.mark_dynamic(cu, 0)
    return {VARLEN_KEY: VarlenDocs(doc_ids, cu, max_seqlen)}


def varlen_documents(
    shared: dict, window: int, softcap: float, sinks: bool, head_dim: int
) -> VarlenDocs | None:
    """The VarlenDocs a layer attends with, if it can: its mask is documents only (no window,
    soft-cap or sinks: those stay with FlexAttention) and its head dim is one flash attention
    takes (<= 256, a multiple of 8)."""
    docs = shared.get(VARLEN_KEY)
    fits = window <= 0 and softcap <= 0 and not sinks and head_dim <= 256 and head_dim % 8 == 0
    return docs if fits else None


def varlen_causal_attention(q: Tensor, k: Tensor, v: Tensor, scale: float, docs: VarlenDocs):
    """q, k, v [b, h, s, hd] -> [b, h, s, hd]: causal attention within each document, as one
    varlen flash-attention call over the batch's b * s tokens (torch's op
    `torch_attn::_varlen_attn`, traced by dynamo as one node whatever the documents; its
    backward is torch's). Keys and values come with q's heads (`Attention` repeats them)."""
    api = VARLEN_API
    if api is None:
        raise RuntimeError("this torch has no torch.nn.attention.varlen with a scale argument")
    fn, form = api
    b, h, s, _ = q.shape

    def tokens(t: Tensor) -> Tensor:  # [b, heads, s, d] -> [b * s, heads, d]
        return t.transpose(1, 2).reshape(b * s, t.shape[1], t.shape[-1])

    cu, n = docs.cu_seqlens, docs.max_seqlen
    causal = {"window_size": (-1, 0)} if form == "window" else {"is_causal": True}
    out = fn(tokens(q), tokens(k), tokens(v), cu, cu, n, n, scale=scale, **causal)
    return out.view(b, s, h, v.shape[-1]).transpose(1, 2)


@declare_memory("torch_attn::_varlen_attn")
def _(a: dict[str, Any]) -> int:
    """Flash attention's forward holds nothing beyond its outputs (out, lse [h, tokens])."""
    return 0


@declare_memory("torch_attn::_varlen_attn_backward")
def _(a: dict[str, Any]) -> int:
    """Flash attention's varlen backward: an fp32 dq accumulator [tokens + 128 * docs, h, hd
    rounded up to 8] and the fp32 row sums of dO * O [docs, h, max_q rounded up to 128]."""
    tokens, h, hd = a["query"].shape
    docs = a["cu_seq_q"].shape[0] - 1
    rounded_hd = -(-hd // 8) * 8
    rounded_q = -(-int(a["max_q"]) // 128) * 128
    return 4 * ((tokens + 128 * docs) * h * rounded_hd + docs * h * rounded_q)


# --- FlexAttention (the GPU path) -----------------------------------------------------------

BACKEND_ENV = "COMPILETUNE_ATTENTION"
_HAS_FLEX = importlib.util.find_spec("torch.nn.attention.flex_attention") is not None


def attention_backend(device: torch.device, eager_selective: bool = False) -> str:
    """How masked attention (documents, windows, soft-caps) runs on `device`: "flex" (one
    FlexAttention kernel per layer, the mask a block mask built from the tensors, no host sync)
    on CUDA under every activation policy and offload, "segments" (the exact op above)
    elsewhere. One exception: a block under eager selective checkpointing
    (`eager_selective`: `--ac selective` without `--compile`), where PyTorch's dispatch-mode
    checkpointing cannot run a compiled FlexAttention (pytorch#147879, #159970) and would fall
    back to its dense [s, s] form. Compiled, the activation policy is a graph pass
    (passes/activation_policy.py) that saves FlexAttention's output and log-sum-exp.
    COMPILETUNE_ATTENTION=flex|segments overrides (tests run the flex path on CPU)."""
    forced = os.environ.get(BACKEND_ENV, "")
    if forced in ("flex", "segments"):
        return forced
    if forced:
        raise ValueError(f"{BACKEND_ENV}={forced!r}: expected flex or segments")
    flex = device.type == "cuda" and _HAS_FLEX and not eager_selective
    return "flex" if flex else "segments"


@functools.cache
def _flex_api():
    """(flex_attention, create_block_mask), compiled for use outside a compiled region; None
    where this torch has no FlexAttention."""
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    except ImportError:
        return None
    # The mask builder compiled too: eagerly, create_block_mask evaluates a dense [b, s, s]
    # mask first (2.5 GiB at 16k tokens on an H200).
    return torch.compile(flex_attention, dynamic=False), torch.compile(create_block_mask)


def _outside_regions():
    """Outside a compiled region, the compiled wrappers of `_flex_api` run even under
    set_stance("force_eager") (the stance of a DPO reference or KD teacher pass): eager
    FlexAttention materialises the whole [b, h, s, s] score matrix."""
    if torch.compiler.is_compiling():
        return contextlib.nullcontext()
    return torch.compiler.set_stance("default")


def _flex_functions():
    """(flex_attention, create_block_mask): traced as they are inside a compiled region (they
    compile with it), the compiled wrappers outside."""
    if torch.compiler.is_compiling():
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        return flex_attention, create_block_mask
    api = _flex_api()
    if api is None:
        raise RuntimeError("this torch has no torch.nn.attention.flex_attention")
    return api


def flex_block_mask(doc_ids: Tensor | None, window: int, b: int, s: int, device: torch.device):
    """The FlexAttention `BlockMask` of a [b, s] batch: causal, within documents when `doc_ids`
    [b, s], within `window` tokens when > 0. Whole [128, 128] blocks outside it are skipped;
    partial ones evaluate the mask per element (reading doc_ids), so no [s, s] tensor exists.

    The model builds one per window size per forward (`Transformer.hidden_states`) and every
    layer of that kind shares it: the mask is computed once, outside the compiled blocks, so a
    block's graph holds only the attention kernel, and a checkpointed block has no mask to
    recompute."""

    def mask_mod(bi, _hi, qi, kj):
        ok = kj <= qi
        if window > 0:
            ok = ok & (qi - kj < window)
        if doc_ids is not None:
            ok = ok & (doc_ids[bi, qi] == doc_ids[bi, kj])
        return ok

    _, create_block_mask = _flex_functions()
    with _outside_regions():
        return create_block_mask(
            mask_mod, b if doc_ids is not None else None, None, s, s, device=device
        )


def is_block_mask(mask: object) -> bool:
    """Whether `mask` is a FlexAttention BlockMask (rather than doc_ids or None)."""
    return type(mask).__name__ == "BlockMask"


def flex_causal_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    scale: float,
    doc_ids: Tensor | None = None,
    window: int = 0,
    softcap: float = 0.0,
    block_mask: Any = None,
    return_lse: bool = False,
) -> Any:
    """`causal_attention` as one FlexAttention call: causal, document and window terms in the
    block mask (`block_mask`, or built here from doc_ids and window), the soft-cap as a score
    modifier. `return_lse`: (out, the scores' log-sum-exp [b, h, s] in fp32, differentiable)."""
    run, _ = _flex_functions()
    b, _, s, _ = q.shape
    if block_mask is None:
        block_mask = flex_block_mask(doc_ids, window, b, s, q.device)

    def cap(score, _bi, _hi, _qi, _kj):
        return softcap * torch.tanh(score / softcap)

    with _outside_regions():
        return run(
            q,
            k,
            v,
            score_mod=cap if softcap > 0 else None,
            block_mask=block_mask,
            scale=scale,
            return_lse=return_lse,
        )


def causal_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    scale: float,
    doc_ids: Tensor | None = None,
    window: int = 0,
    softcap: float = 0.0,
    backend: str | None = None,
    sinks: Tensor | None = None,
) -> Tensor:
    """q, k, v [b, h, s, hd] -> [b, h, s, hd]: causal; within documents when `doc_ids`; within
    `window` tokens when > 0; scores soft-capped at `softcap` when > 0; with `sinks` [h]
    one more logit per head in every softmax's denominator (`_with_sinks`).

    With none of them this is plain causal SDPA, the same call as before any of them existed,
    so unmasked runs keep their numerics. Otherwise `backend` ("flex" or "segments"; default:
    `attention_backend` of q's device) picks FlexAttention or the segment op. `doc_ids` may
    also be a prepared FlexAttention block mask (`flex_block_mask`, holding the documents and
    the window), which FlexAttention then uses as it is, or the batch's `VarlenDocs` (a layer
    whose mask is documents only, on CUDA in fp16/bf16), which runs one varlen flash call.
    """
    if is_dense_mask(doc_ids):  # images' tokens see each other (models/vision/mask.py)
        return masked_attention(q, k, v, scale, doc_ids, softcap)
    if sinks is not None:
        return _with_sinks(q, k, v, scale, doc_ids, window, softcap, sinks)
    if isinstance(doc_ids, VarlenDocs):
        if q.dtype in _HALF or os.environ.get(VARLEN_ENV) == "force":
            return varlen_causal_attention(q, k, v, scale, doc_ids)
        doc_ids = doc_ids.doc_ids  # fp32 on a GPU: flash attention has no kernel for it
    if is_block_mask(doc_ids):
        return flex_causal_attention(q, k, v, scale, softcap=softcap, block_mask=doc_ids)
    if doc_ids is None and window <= 0 and softcap <= 0:
        return _sdpa(q, k, v, scale)
    if (backend or attention_backend(q.device)) == "flex":
        return flex_causal_attention(q, k, v, scale, doc_ids, window, softcap)
    return attention_op(q, k, v, doc_ids, scale, int(window), float(softcap))[0]


def _with_sinks(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    scale: float,
    doc_ids: Tensor | None,
    window: int,
    softcap: float,
    sinks: Tensor,
) -> Tensor:
    """Attention with a sink logit per head: softmax over the visible scores and the
    sink, the sink's share dropped. With lse the log-sum-exp of the visible scores, that is the
    plain attention times exp(lse) / (exp(lse) + exp(sink)) = sigmoid(lse - sink). Both
    attention paths give the output and a differentiable log-sum-exp: FlexAttention (on CUDA;
    `doc_ids` is then the layer's block mask, see `Attention.mask`) and the segment op's tiled
    kernel (every device; its backward takes both gradients)."""
    if is_block_mask(doc_ids):
        out, lse = flex_causal_attention(
            q, k, v, scale, softcap=softcap, block_mask=doc_ids, return_lse=True
        )
    else:
        out, lse = attention_op(q, k, v, doc_ids, scale, int(window), float(softcap), True)
    keep = torch.sigmoid(lse - sinks.float()[None, :, None])  # [b, h, s]
    return (out.float() * keep[..., None]).to(q.dtype)
