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

import torch
import torch.nn.functional as F
from torch import Tensor

from compiletune.ops.op_memory import Args, declare_memory
from compiletune.torch_internals import autograd_inside_op

CHUNK = 64
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


def _prepare(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, starts: Tensor, chunk: int
) -> tuple[Tensor, ...]:
    """Everything but the state walk, for all chunks at once ([b, h, n, C, ...], fp32):
    u, w (delta = u - w S), qg (queries times their decay from the chunk start), a_qk (the
    causal, same-document, decayed q.k products), kd (keys times their decay to the chunk end,
    last document only), glast (the chunk's decay of the incoming state, [b, h, n])."""
    q, k, v = _chunked(q, chunk), _chunked(k, chunk), _chunked(v, chunk)
    g, beta = _chunked(g, chunk), _chunked(beta, chunk)
    b, s = starts.shape
    pad = (-s) % chunk
    st = F.pad(starts, (0, pad)).reshape(b, 1, -1, chunk)
    st[..., 0] = 0  # a document starting at a chunk's first token: handled by `carry` below
    seg = st.cumsum(-1)  # [b, 1, n, C]
    first = F.pad(starts, (0, pad)).reshape(b, 1, -1, chunk)[..., :1]  # [b, 1, n, 1]
    carry = ((seg == 0) & (first == 0)).float()  # continues the incoming document
    gamma = g.cumsum(-1)  # [b, h, n, C]
    idx = torch.arange(chunk, device=q.device)
    causal = idx[:, None] >= idx[None, :]
    same = (seg[..., :, None] == seg[..., None, :]) & causal  # [b, 1, n, C, C]
    diff = gamma[..., :, None] - gamma[..., None, :]
    decay = diff.masked_fill(~same, float("-inf")).exp()  # [b, h, n, C, C]
    strict = decay * (~torch.eye(chunk, dtype=torch.bool, device=q.device))
    lower = beta[..., None] * (k @ k.transpose(-1, -2)) * strict
    eye = torch.eye(chunk, device=q.device)
    eg = gamma.exp() * carry
    rhs = torch.cat((beta[..., None] * v, (beta * eg)[..., None] * k), dim=-1)
    solved = torch.linalg.solve_triangular(eye + lower, rhs, upper=False, unitriangular=True)
    u, w = solved.split([v.shape[-1], k.shape[-1]], dim=-1)
    qg = q * eg[..., None]
    a_qk = (q @ k.transpose(-1, -2)) * decay
    last = seg[..., -1:] == seg
    kd = k * ((gamma[..., -1:] - gamma).exp() * last)[..., None]
    glast = gamma[..., -1].exp() * carry[..., -1]
    return u, w, qg, a_qk, kd, glast


def _walk(u: Tensor, w: Tensor, kd: Tensor, glast: Tensor, state: Tensor) -> Tensor:
    """The chunk states: [b, h, n + 1, dk, dv], entry i the state entering chunk i."""
    states = [state]
    for i in range(u.shape[2]):
        v_new = u[:, :, i] - w[:, :, i] @ state
        state = glast[:, :, i, None, None] * state + kd[:, :, i].transpose(-1, -2) @ v_new
        states.append(state)
    return torch.stack(states, dim=2)


def _outputs(u: Tensor, w: Tensor, qg: Tensor, a_qk: Tensor, states: Tensor) -> Tensor:
    """o [b, h, n, C, dv] from the chunk states (all chunks at once)."""
    entering = states[:, :, :-1]
    v_new = u - w @ entering
    return qg @ entering + a_qk @ v_new


def _unchunk(o: Tensor, s: int) -> Tensor:
    """[b, h, n, C, dv] -> [b, s, h, dv]."""
    b, h = o.shape[:2]
    return o.reshape(b, h, -1, o.shape[-1])[:, :, :s].transpose(1, 2)


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
    with torch.no_grad():
        u, w, qg, a_qk, kd, glast = _prepare(q, k, v, g, beta, starts, chunk)
        state = initial_state
        if state is None:
            state = q.new_zeros(b, h, dk, v.shape[-1], dtype=torch.float32)
        states = _walk(u, w, kd, glast, state.float())
        o = _outputs(u, w, qg, a_qk, states)
    # the padded tail adds nothing (zero keys, values and decay): the last state is s - 1's
    return _unchunk(o, s).to(v.dtype), states[:, :, -1]


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
    b, s, h, dk = k.shape
    starts = _starts(doc_ids, b, s, q.device)
    with autograd_inside_op():
        leaves = [x.detach().requires_grad_() for x in (q, k, v, g, beta)]
        parts = _prepare(*leaves, starts, chunk)
    u, w, qg, a_qk, kd, glast = (p.detach() for p in parts)
    state = q.new_zeros(b, h, dk, v.shape[-1], dtype=torch.float32)
    states = _walk(u, w, kd, glast, state)
    do = _chunked(grad, chunk)  # [b, h, n, C, dv]
    entering = states[:, :, :-1]
    v_new = u - w @ entering
    # o = qg S + a_qk v_new, v_new = u - w S: the parts that need no walk, for all chunks
    d_qg = do @ entering.transpose(-1, -2)
    d_aqk = do @ v_new.transpose(-1, -2)
    d_vnew = a_qk.transpose(-1, -2) @ do
    d_kd = torch.empty_like(kd)
    d_glast = torch.empty_like(glast)
    d_u = torch.empty_like(u)
    d_w = torch.empty_like(w)
    d_state = torch.zeros_like(state)  # dL/dS leaving the chunk being walked
    for i in reversed(range(u.shape[2])):
        s_in, vn = entering[:, :, i], v_new[:, :, i]
        # S_out = glast S_in + kd^T v_new
        d_glast[:, :, i] = (d_state * s_in).sum((-1, -2))
        d_kd[:, :, i] = vn @ d_state.transpose(-1, -2)
        dv_i = d_vnew[:, :, i] + kd[:, :, i] @ d_state
        d_u[:, :, i] = dv_i
        d_w[:, :, i] = -dv_i @ s_in.transpose(-1, -2)
        d_state = (
            glast[:, :, i, None, None] * d_state
            + qg[:, :, i].transpose(-1, -2) @ do[:, :, i]
            - w[:, :, i].transpose(-1, -2) @ dv_i
        )
    with autograd_inside_op():
        grads = torch.autograd.grad(
            parts, leaves, [d_u, d_w, d_qg, d_aqk, d_kd, d_glast], allow_unused=True
        )
    return tuple(
        torch.zeros_like(x) if d is None else d.to(x.dtype)
        for d, x in zip(grads, (q, k, v, g, beta), strict=True)
    )


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
    See the module docstring."""
    return gated_delta_rule_op(q, k, v, g, beta, doc_ids, chunk)


# --- memory, for the estimate (ops/op_memory.py) -------------------------------------------


def _sizes(a: Args) -> tuple[int, int, int, int, int, int]:
    b, s, h, dk = a["k"].shape
    dv = a["v"].shape[-1]
    chunk = a["chunk"]
    padded = -(-s // chunk) * chunk
    return b, padded, h, dk, dv, chunk


@declare_memory("compiletune::gated_delta_rule")
def _(a: Args) -> int:
    # fp32 chunked copies of q, k, v; u, w, qg, kd; three [C, C] maps per chunk; the states
    b, s, h, dk, dv, chunk = _sizes(a)
    per_token = 3 * dk + 2 * dv + (dk + dv) + 2 * dk + dv + 4 * chunk
    states = (s // chunk + 1) * dk * dv
    return _F32 * b * h * (s * per_token + states)


@declare_memory("compiletune::gated_delta_rule_backward")
def _(a: Args) -> int:
    # the forward's temporaries kept for autograd (twice: values and what autograd saves),
    # the states, the chunked gradient and the gradients of each part
    b, s, h, dk, dv, chunk = _sizes(a)
    per_token = 2 * (3 * dk + 2 * dv + (dk + dv) + 2 * dk + dv + 4 * chunk) + dv
    per_token += 2 * dk + 2 * dv + 2 * chunk
    states = 2 * (s // chunk + 1) * dk * dv
    return _F32 * b * h * (s * per_token + states)
