"""The gated delta rule (Gated DeltaNet linear attention: Qwen3-Next, Qwen3.5) in chunked form,
as a custom op with its own backward and document resets.

Per head, a state S [dk, dv] (fp32) runs over the sequence; at token t, with a_t = exp(g_t):

    S_t = a_t S_{t-1} + k_t (beta_t (v_t - a_t S_{t-1}^T k_t))^T        o_t = S_t^T (scale q_t)

and S is zero at the first token of every document (`doc_ids`), so the documents of a packed row
are computed exactly as if each were alone (nothing leaks from one into the next).

Chunked form (chunks of C tokens; the "WY" representation of the published chunked algorithm):
within a chunk, with gamma the cumulative sum of g and Gamma_ij = exp(gamma_i - gamma_j) for
j <= i in the same document (else 0), the per-token updates delta = u - w S_0 come from one
unit lower-triangular solve, T = (I + L)^-1 with L_ij = beta_i (k_i . k_j) Gamma_ij (j < i):
u = T (beta v), w = T (beta exp(gamma) k) (rows of tokens that continue the incoming document).
Everything but the state's walk from chunk to chunk is computed for all chunks at once
(`_prepare`); the walk is one loop of small matmuls. Document starts inside a chunk become
masks: the incoming state reaches only the tokens before the chunk's first document start, and
the outgoing state carries only the chunk's last document.

Memory: the forward saves its inputs only. The backward recomputes `_prepare` under autograd and
the chunk states (one [dk, dv] per chunk and head, transient), walks the chunks backwards with
the chain rule written out, and hands the rest to autograd. compiletune::gated_delta_rule and
its backward are opaque to the compiler: a compiled block holds one node each.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from compiletune.ops.op_memory import Args, declare_memory
from compiletune.torch_internals import autograd_inside_op

CHUNK = 64
BLOCK = 8  # chunks computed at once: a block's temporaries bound the memory at any length
_F32 = 4  # bytes


def _starts(doc_ids: Tensor | None, b: int, s: int, device: torch.device) -> Tensor:
    """[b, s] int: 1 where a document starts after the row's first token, else 0."""
    starts = torch.zeros(b, s, dtype=torch.int32, device=device)
    if doc_ids is not None:
        starts[:, 1:] = (doc_ids[:, 1:] != doc_ids[:, :-1]).to(torch.int32)
    return starts


def _chunked(x: Tensor, chunk: int) -> Tensor:
    """[b, s, h, ...] -> [b, h, n, chunk, ...] in fp32, zero-padded to whole chunks."""
    x = x.float().movedim(2, 1)  # [b, h, s, ...]
    s = x.shape[2]
    pad = (-s) % chunk
    if pad:
        widths = [0, 0] * (x.dim() - 3) + [0, pad]
        x = F.pad(x, widths)
    return x.reshape(*x.shape[:2], -1, chunk, *x.shape[3:])


class _Parts:
    """Everything but the state walk, for all chunks at once ([b, h, n, C, ...], fp32):
    u, w (delta = u - w S), qg (queries times their decay from the chunk start), a_qk (the
    causal, same-document, decayed q.k products), kd (keys times their decay to the chunk end,
    last document only), glast (the chunk's decay of the incoming state, [b, h, n]); and, for
    the backward, the chunked inputs and the maps they came from."""

    def __init__(
        self, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, starts: Tensor, chunk: int
    ) -> None:
        self.tokens = q.shape[1]
        self.q, self.k, self.v = _chunked(q, chunk), _chunked(k, chunk), _chunked(v, chunk)
        self.beta = _chunked(beta, chunk)
        b, s = starts.shape
        st = F.pad(starts, (0, (-s) % chunk)).reshape(b, 1, -1, chunk)
        first = st[..., :1].clone()  # a document starting at the chunk's first token
        st[..., 0] = 0
        seg = st.cumsum(-1)  # [b, 1, n, C]: document starts within the chunk so far
        carry = ((seg == 0) & (first == 0)).float()  # continues the incoming document
        gamma = _chunked(g, chunk).cumsum(-1)  # [b, h, n, C]
        idx = torch.arange(chunk, device=q.device)
        same = (seg[..., :, None] == seg[..., None, :]) & (idx[:, None] >= idx[None, :])
        diff = gamma[..., :, None] - gamma[..., None, :]
        self.decay = diff.masked_fill_(~same, float("-inf")).exp_()  # [b, h, n, C, C]
        self.offdiag = ~torch.eye(chunk, dtype=torch.bool, device=q.device)
        self.kk = self.k @ self.k.transpose(-1, -2)
        lower = self.beta[..., None] * self.kk * self.decay * self.offdiag
        self.a = lower + torch.eye(chunk, device=q.device)  # I + L, unit lower triangular
        self.eg = gamma.exp() * carry
        rhs = torch.cat(
            (self.beta[..., None] * self.v, (self.beta * self.eg)[..., None] * self.k), -1
        )
        solved = torch.linalg.solve_triangular(self.a, rhs, upper=False, unitriangular=True)
        self.u, self.w = solved.split([self.v.shape[-1], self.k.shape[-1]], dim=-1)
        self.qg = self.q * self.eg[..., None]
        self.qk = self.q @ self.k.transpose(-1, -2)
        self.a_qk = self.qk * self.decay
        self.e2 = (gamma[..., -1:] - gamma).exp() * (seg[..., -1:] == seg)
        self.kd = self.k * self.e2[..., None]
        self.glast = gamma[..., -1].exp() * carry[..., -1]

    def walk(self, state: Tensor, with_outputs: bool) -> tuple[Tensor, Tensor | None]:
        """The chunk states [b, h, n + 1, dk, dv] (entry i: the state entering chunk i) and,
        `with_outputs`, o [b, h, n, C, dv]."""
        states, outs = [state], []
        for i in range(self.u.shape[2]):
            v_new = self.u[:, :, i] - self.w[:, :, i] @ state
            if with_outputs:
                outs.append(self.qg[:, :, i] @ state + self.a_qk[:, :, i] @ v_new)
            state = self.glast[:, :, i, None, None] * state + self.kd[:, :, i].mT @ v_new
            states.append(state)
        return torch.stack(states, dim=2), torch.stack(outs, dim=2) if with_outputs else None

    def backward(
        self, du: Tensor, dw: Tensor, dqg: Tensor, daqk: Tensor, dkd: Tensor, dglast: Tensor
    ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
        """The chain rule through everything `__init__` computed: (dq, dk, dv, dgamma-summed
        dg, dbeta), chunked ([b, h, n, C, ...])."""
        q, k, v, beta, decay = self.q, self.k, self.v, self.beta, self.decay
        # u = A^-1 (beta v), w = A^-1 (beta eg k): dX = A^-T dY, dA = -dX Y^T (strict lower)
        dx = torch.linalg.solve_triangular(
            self.a.mT, torch.cat((du, dw), -1), upper=True, unitriangular=True
        )
        dxu, dxw = dx.split([v.shape[-1], k.shape[-1]], dim=-1)
        dl = -(dxu @ self.u.mT + dxw @ self.w.mT) * self.offdiag
        # L = beta_i (k_i . k_j) decay_ij, off the diagonal
        dl_decay = dl * decay
        dbeta = (dl_decay * self.kk).sum(-1)
        dkk = beta[..., None] * dl_decay
        ddecay = beta[..., None] * dl * self.kk
        dk = (dkk + dkk.mT) @ k
        # the right-hand sides beta v and beta eg k
        dv = beta[..., None] * dxu
        dbeta += (dxu * v).sum(-1)
        t = (dxw * k).sum(-1)
        dk += (beta * self.eg)[..., None] * dxw
        dbeta += self.eg * t
        deg = beta * t
        # qg = q eg, a_qk = (q k^T) decay
        dq = self.eg[..., None] * dqg
        deg += (dqg * q).sum(-1)
        dqk = daqk * decay
        dq += dqk @ k
        dk += dqk.mT @ q
        ddecay += daqk * self.qk
        # decay_ij = exp(gamma_i - gamma_j) (masked), eg = exp(gamma) carry,
        # kd = k e2 with e2_j = exp(gamma_last - gamma_j) (last document), glast = exp(gamma_last)
        x = ddecay * decay
        dgamma = x.sum(-1) - x.sum(-2) + deg * self.eg
        dk += dkd * self.e2[..., None]
        de2 = (dkd * k).sum(-1) * self.e2
        dgamma -= de2
        dgamma[..., -1] += de2.sum(-1) + dglast * self.glast
        dg = dgamma.flip(-1).cumsum(-1).flip(-1)  # gamma = cumsum(g)
        return dq, dk, dv, dg, dbeta


def _unchunk(o: Tensor, s: int) -> Tensor:
    """[b, h, n, C, ...] -> [b, s, h, ...]."""
    b, h = o.shape[:2]
    return o.reshape(b, h, -1, *o.shape[4:])[:, :, :s].transpose(1, 2)


def _blocks(s: int, chunk: int) -> list[tuple[int, int]]:
    """Token ranges of BLOCK chunks each (the last one shorter): the unit of work."""
    step = BLOCK * chunk
    return [(lo, min(lo + step, s)) for lo in range(0, s, step)]


def _parts(xs: tuple[Tensor, ...], starts: Tensor, lo: int, hi: int, chunk: int) -> _Parts:
    """The parts of tokens lo:hi (a block starts on a chunk boundary, so its chunks are the
    sequence's)."""
    q, k, v, g, beta = (x[:, lo:hi] for x in xs)
    return _Parts(q, k, v, g, beta, starts[:, lo:hi], chunk)


def gated_delta_forward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    doc_ids: Tensor | None = None,
    initial_state: Tensor | None = None,
    chunk: int = CHUNK,
) -> tuple[Tensor, Tensor]:
    """(o [b, s, h, dv] in v's dtype, final state [b, h, dk, dv] fp32) without autograd; for
    the op and for generation (the state is the cache of a linear-attention layer)."""
    b, s, h, dk = k.shape
    starts = _starts(doc_ids, b, s, q.device)
    state = initial_state
    if state is None:
        state = q.new_zeros(b, h, dk, v.shape[-1], dtype=torch.float32)
    state = state.float()
    out = v.new_empty(v.shape)
    with torch.no_grad():
        for lo, hi in _blocks(s, chunk):
            states, o = _parts((q, k, v, g, beta), starts, lo, hi, chunk).walk(state, True)
            out[:, lo:hi] = _unchunk(o, hi - lo)
            state = states[:, :, -1]
    # a padded tail adds nothing (zero keys, values and decay): the last state is s - 1's
    return out, state


@torch.library.custom_op("compiletune::gated_delta_rule", mutates_args=())
def gated_delta_rule_op(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, doc_ids: Tensor | None, chunk: int
) -> Tensor:
    return gated_delta_forward(q, k, v, g, beta, doc_ids, chunk=chunk)[0]


@gated_delta_rule_op.register_fake
def _(q, k, v, g, beta, doc_ids, chunk):
    return v.new_empty(v.shape)


@torch.library.custom_op("compiletune::gated_delta_rule_backward", mutates_args=())
def gated_delta_rule_backward_op(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    doc_ids: Tensor | None,
    grad: Tensor,
    chunk: int,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    xs = (q, k, v, g, beta)
    b, s, h, dk = k.shape
    starts = _starts(doc_ids, b, s, q.device)
    blocks = _blocks(s, chunk)
    # the state entering each block, walking forwards (nothing else is kept)
    entering_block = [q.new_zeros(b, h, dk, v.shape[-1], dtype=torch.float32)]
    for lo, hi in blocks[:-1]:
        states, _ = _parts(xs, starts, lo, hi, chunk).walk(entering_block[-1], False)
        entering_block.append(states[:, :, -1])
    grads = tuple(torch.empty_like(x) for x in xs)
    d_state = torch.zeros_like(entering_block[0])  # dL/dS leaving the block being walked
    for (lo, hi), state in zip(reversed(blocks), reversed(entering_block), strict=True):
        p = _parts(xs, starts, lo, hi, chunk)
        states, _ = p.walk(state, False)
        d_state = _block_backward(p, states, _chunked(grad[:, lo:hi], chunk), d_state, grads, lo)
    return grads


def _block_backward(
    p: _Parts, states: Tensor, do: Tensor, d_state: Tensor, grads: tuple[Tensor, ...], lo: int
) -> Tensor:
    """One block's gradients written into `grads` at tokens lo:..; returns dL/dS entering it."""
    entering = states[:, :, :-1]
    v_new = p.u - p.w @ entering
    # o = qg S + a_qk v_new, v_new = u - w S: the parts that need no walk, for all chunks
    d_qg = do @ entering.mT
    d_aqk = do @ v_new.mT
    d_vnew = p.a_qk.mT @ do
    d_kd, d_glast = torch.empty_like(p.kd), torch.empty_like(p.glast)
    d_u, d_w = torch.empty_like(p.u), torch.empty_like(p.w)
    for i in reversed(range(p.u.shape[2])):
        s_in, vn = entering[:, :, i], v_new[:, :, i]
        # S_out = glast S_in + kd^T v_new
        d_glast[:, :, i] = (d_state * s_in).sum((-1, -2))
        d_kd[:, :, i] = vn @ d_state.mT
        dv_i = d_vnew[:, :, i] + p.kd[:, :, i] @ d_state
        d_u[:, :, i] = dv_i
        d_w[:, :, i] = -dv_i @ s_in.mT
        d_state = (
            p.glast[:, :, i, None, None] * d_state
            + p.qg[:, :, i].mT @ do[:, :, i]
            - p.w[:, :, i].mT @ dv_i
        )
    n = min(p.tokens, grads[0].shape[1] - lo)
    for out, d in zip(grads, p.backward(d_u, d_w, d_qg, d_aqk, d_kd, d_glast), strict=True):
        out[:, lo : lo + n] = _unchunk(d, n)
    return d_state


@gated_delta_rule_backward_op.register_fake
def _(q, k, v, g, beta, doc_ids, grad, chunk):
    return tuple(x.new_empty(x.shape) for x in (q, k, v, g, beta))


def _setup(ctx, inputs, output) -> None:
    q, k, v, g, beta, doc_ids, chunk = inputs
    ctx.save_for_backward(q, k, v, g, beta, doc_ids)
    ctx.chunk = chunk


def _backward(ctx, grad: Tensor):
    q, k, v, g, beta, doc_ids = ctx.saved_tensors
    dq, dk, dv, dg, dbeta = gated_delta_rule_backward_op(
        q, k, v, g, beta, doc_ids, grad.contiguous(), ctx.chunk
    )
    return dq, dk, dv, dg, dbeta, None, None


gated_delta_rule_op.register_autograd(_backward, setup_context=_setup)


def gated_delta_rule(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    doc_ids: Tensor | None = None,
    chunk: int = CHUNK,
) -> Tensor:
    """q, k [b, s, h, dk] (scaled and normalised as the model wants them), v [b, s, h, dv],
    g [b, s, h] (log decay, <= 0), beta [b, s, h], doc_ids [b, s] or None -> o [b, s, h, dv].
    See the module docstring. On CUDA with flash-linear-attention installed (the `linear`
    extra), its kernels compute it (`gated_delta_rule_fla`)."""
    if use_fla(q):
        return gated_delta_rule_fla_op(q, k, v, g, beta, doc_ids)
    return gated_delta_rule_op(q, k, v, g, beta, doc_ids, chunk)


# --- flash-linear-attention's kernels, on CUDA where installed ----------------------------------
# Its chunk_gated_delta_rule takes the documents of all rows laid end to end as one row with
# their offsets (`cu_seqlens`), so document resets are the kernel's own. Wrapped as an op of
# ours, opaque to the compiler like the one above: the forward saves its inputs only and the
# backward recomputes the kernel's forward under autograd (the same memory shape as ours; the
# estimate counts ours, which it runs on the CPU). COMPILETUNE_NO_FLA=1 turns it off.


def fla_kernel() -> Any:
    """flash-linear-attention's chunk_gated_delta_rule, or None (not installed, or turned off)."""
    if os.environ.get("COMPILETUNE_NO_FLA"):
        return None
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except ImportError:
        return None
    return chunk_gated_delta_rule


def use_fla(q: Tensor) -> bool:
    return q.is_cuda and fla_kernel() is not None


def document_offsets(doc_ids: Tensor | None, b: int, s: int, device: torch.device) -> Tensor:
    """cu_seqlens [n + 1] (int64) of the documents of b rows of s tokens laid end to end: every
    row starts a document, and so does every token whose document id differs from the one
    before it."""
    starts = _starts(doc_ids, b, s, device)
    starts[:, 0] = 1
    where = starts.flatten().nonzero().flatten()
    return torch.cat([where, where.new_full((1,), b * s)])


def _fla(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, doc_ids: Tensor | None):
    b, s = q.shape[:2]
    flat = [x.reshape(1, b * s, *x.shape[2:]) for x in (q, k, v, g, beta)]
    offsets = document_offsets(doc_ids, b, s, q.device)
    o, _ = fla_kernel()(*flat, scale=1.0, cu_seqlens=offsets)  # q comes scaled
    return o.reshape(v.shape)


@torch.library.custom_op("compiletune::gated_delta_rule_fla", mutates_args=())
def gated_delta_rule_fla_op(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, doc_ids: Tensor | None
) -> Tensor:
    with torch.no_grad():
        return _fla(q, k, v, g, beta, doc_ids).to(v.dtype)


@gated_delta_rule_fla_op.register_fake
def _(q, k, v, g, beta, doc_ids):
    return v.new_empty(v.shape)


@torch.library.custom_op("compiletune::gated_delta_rule_fla_backward", mutates_args=())
def gated_delta_rule_fla_backward_op(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, doc_ids: Tensor | None, grad: Tensor
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    with autograd_inside_op():
        xs = [x.detach().requires_grad_() for x in (q, k, v, g, beta)]
        o = _fla(*xs, doc_ids)
        grads = torch.autograd.grad(o, xs, grad.to(o.dtype))
    return tuple(d.to(x.dtype) for d, x in zip(grads, (q, k, v, g, beta), strict=True))


@gated_delta_rule_fla_backward_op.register_fake
def _(q, k, v, g, beta, doc_ids, grad):
    return tuple(x.new_empty(x.shape) for x in (q, k, v, g, beta))


def _fla_setup(ctx, inputs, output) -> None:
    ctx.save_for_backward(*inputs)


def _fla_backward(ctx, grad: Tensor):
    q, k, v, g, beta, doc_ids = ctx.saved_tensors
    grads = gated_delta_rule_fla_backward_op(q, k, v, g, beta, doc_ids, grad.contiguous())
    return (*grads, None)


gated_delta_rule_fla_op.register_autograd(_fla_backward, setup_context=_fla_setup)


# --- memory, for the estimate (ops/op_memory.py) -------------------------------------------


def _sizes(a: Args) -> tuple[int, int, int, int, int, int, int]:
    """(batch, heads, dk, dv, chunk, tokens of one block, blocks)."""
    b, s, h, dk = a["k"].shape
    chunk = a["chunk"]
    padded = -(-s // chunk) * chunk
    return b, h, dk, a["v"].shape[-1], chunk, min(padded, BLOCK * chunk), len(_blocks(s, chunk))


@declare_memory("compiletune::gated_delta_rule")
def _(a: Args) -> int:
    # one block at a time: its fp32 chunked inputs, the solve's operands, u, w, qg, kd, the
    # [C, C] maps (decay, k.k, q.k, decayed q.k, I + L, the difference of decays) and its states
    b, h, dk, dv, chunk, tokens, _ = _sizes(a)
    per_token = 6 * dk + 4 * dv + 7 * chunk
    return _F32 * b * h * (tokens * per_token + (BLOCK + 1) * dk * dv)


@declare_memory("compiletune::gated_delta_rule_backward")
def _(a: Args) -> int:
    # the forward's block, plus its gradients by part, the output gradient and the new values
    # in fp32; the states of the block and the state entering every block
    b, h, dk, dv, chunk, tokens, blocks = _sizes(a)
    per_token = 10 * dk + 9 * dv + 14 * chunk
    return _F32 * b * h * (tokens * per_token + (BLOCK + 2 + blocks) * dk * dv)


def _fla_bytes(a: Args) -> int:
    # flash-linear-attention's forward (run on CUDA only; the estimate runs the op above): a
    # [dk, dv] fp32 state per chunk of 64 tokens and head, and the [64, 64] solve per chunk
    b, s, h, dk = a["k"].shape
    chunks = -(-s // CHUNK)
    return _F32 * b * h * chunks * (dk * a["v"].shape[-1] + CHUNK * CHUNK)


@declare_memory("compiletune::gated_delta_rule_fla")
def _(a: Args) -> int:
    return _fla_bytes(a)


@declare_memory("compiletune::gated_delta_rule_fla_backward")
def _(a: Args) -> int:
    # the recomputed forward with what its autograd saves (about the inputs again), then the
    # kernel's backward (about as much as its forward)
    inputs = sum(a[n].numel() * a[n].element_size() for n in ("q", "k", "v", "g", "beta"))
    return 2 * _fla_bytes(a) + inputs
