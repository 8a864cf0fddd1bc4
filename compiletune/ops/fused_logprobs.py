"""Per-token log-probabilities and teacher-student divergences from hidden states and a head,
a chunk of tokens at a time: the `[tokens, vocab]` logits of the whole batch never exist.

These are the pieces preference tuning and distillation need (compiletune/loss/objectives.py):

    compiletune::token_logprobs(h [N, d], weight [V, d], targets [N])  -> [N] fp32
        log softmax(h W^T)[t, target_t], 0 where target_t == ignore_index (DPO/IPO/SimPO sum
        them per response)
    compiletune::token_divergence(h [N, d], weight [V, d], teacher_h [N, dt], teacher_weight
        [V, dt], mask [N], temperature, kind)  -> [N] fp32
        per token, between the teacher's and the student's distributions at `temperature`:
        kind "forward_kl": KL(p_teacher || p_student); "jsd": the Jensen-Shannon divergence
        (1/2 KL(p_t || m) + 1/2 KL(p_s || m), m the mean); 0 where mask is false

Both are custom ops with their own backward: forward keeps only fp32 per-token statistics
(the log-sum-exp), backward recomputes each chunk's logits (and, for the divergence, the
teacher's) and turns them into the gradients of h and weight at once. Logits are computed in
the input dtype and reduced in fp32, as the fused cross-entropy head does; Gemma 2's final
soft-cap applies to both. The teacher gets no gradient. Chunks follow `ce_chunks.chunk_tokens`
(the same `COMPILETUNE_LCE_CHUNK_TOKENS` override).
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from compiletune.ops.ce_chunks import chunk_tokens
from compiletune.ops.op_memory import Args, declare_memory

KINDS = ("forward_kl", "jsd")
# [c, V] fp32 tensors a divergence chunk holds at once (both log-softmaxes, probabilities, ...)
_DIV_TEMPORARIES = 8


def _logits(h: Tensor, weight: Tensor, softcap: float) -> Tensor:
    """fp32 logits [c, V] of one chunk (soft-capped when softcap > 0)."""
    logits = (h @ weight.t()).float()
    return softcap * torch.tanh(logits / softcap) if softcap > 0 else logits


def _capped_grad(grad: Tensor, logits: Tensor, softcap: float) -> Tensor:
    """d/d(raw logits) from d/d(capped logits): times 1 - tanh^2 = 1 - (capped / c)^2."""
    return grad * (1 - (logits / softcap).square()) if softcap > 0 else grad


def _chunks(n: int, vocab: int, chunk_size: int, temporaries: int = 2) -> list[slice]:
    """Row ranges of the chunks: `temporaries` [c, V] fp32 tensors of one chunk together stay
    within the fused head's chunk budget."""
    step = chunk_tokens(vocab * temporaries, chunk_size)
    return [slice(i, min(n, i + step)) for i in range(0, n, step)]


def _accumulate(
    dlogits: Tensor, h: Tensor, weight: Tensor, rows: slice, dh: Tensor, dw: Tensor
) -> None:
    """dh[rows] = dlogits @ W and dW += dlogits^T @ h[rows] (fp32 accumulation for dW)."""
    d = dlogits.to(h.dtype)
    dh[rows] = d @ weight
    dw += (d.t() @ h[rows]).float()


# --------------------------------------------------------------------------- log-probabilities


def _head_op_bytes(a: Args, divergence: bool, backward: bool) -> int:
    """What the chunked heads hold inside themselves beyond their outputs, as measured on their
    CPU implementations: a chunk's [c, V] fp32 temporaries (chunks are sized by 2 of them for
    log-probabilities, `_DIV_TEMPORARIES` for a divergence) and, in a narrow dtype, the logits
    before their fp32 copy; in backward each chunk's weight-gradient product and, in a narrow
    dtype, its fp32 copy and the fp32 accumulator (in fp32 the output itself)."""
    h, weight = a["h"], a["weight"]
    (n, d), vocab, elt = h.shape, weight.shape[0], h.element_size()
    width = vocab * (_DIV_TEMPORARIES if divergence else 2)
    c = min(n, chunk_tokens(width, a["chunk_size"]))
    chunk, grad = c * vocab, vocab * d
    narrow = weight.dtype != torch.float32
    fp32 = {(False, False): 2, (False, True): 1, (True, False): 9, (True, True): 10}
    held = fp32[divergence, backward] * chunk * 4
    if narrow:
        held += (2 if divergence else 1) * chunk * elt
    if backward:
        held += grad * elt + (grad * (4 if divergence else 8) if narrow else 0)
    return held


for _name, _divergence, _backward in (
    ("token_logprobs", False, False),
    ("token_logprobs_backward", False, True),
    ("token_divergence", True, False),
    ("token_divergence_backward", True, True),
):
    declare_memory(f"compiletune::{_name}")(
        functools.partial(_head_op_bytes, divergence=_divergence, backward=_backward)
    )


@torch.library.custom_op("compiletune::token_logprobs", mutates_args=())
def _token_logprobs(
    h: Tensor, weight: Tensor, targets: Tensor, ignore_index: int, chunk_size: int, softcap: float
) -> tuple[Tensor, Tensor]:
    n = h.shape[0]
    logp = torch.zeros(n, dtype=torch.float32, device=h.device)
    lse = torch.zeros(n, dtype=torch.float32, device=h.device)
    live = targets != ignore_index
    safe = torch.where(live, targets, 0)
    for rows in _chunks(n, weight.shape[0], chunk_size):
        logits = _logits(h[rows], weight, softcap)
        lse[rows] = torch.logsumexp(logits, dim=-1)
        picked = logits.gather(1, safe[rows, None]).squeeze(1)
        logp[rows] = torch.where(live[rows], picked - lse[rows], 0.0)
    return logp, lse


@_token_logprobs.register_fake
def _(h, weight, targets, ignore_index, chunk_size, softcap):
    n = h.shape[0]
    return h.new_empty(n, dtype=torch.float32), h.new_empty(n, dtype=torch.float32)


@torch.library.custom_op("compiletune::token_logprobs_backward", mutates_args=())
def _token_logprobs_backward(
    grad: Tensor,
    h: Tensor,
    weight: Tensor,
    targets: Tensor,
    lse: Tensor,
    ignore_index: int,
    chunk_size: int,
    softcap: float,
) -> tuple[Tensor, Tensor]:
    dh = torch.empty_like(h)
    dw = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
    live = targets != ignore_index
    g = torch.where(live, grad.float(), 0.0)  # d/d logp_t
    safe = torch.where(live, targets, 0)
    for rows in _chunks(h.shape[0], weight.shape[0], chunk_size):
        logits = _logits(h[rows], weight, softcap)
        # d logp / d logits = onehot(target) - softmax, in place on the chunk's logits
        if softcap > 0:
            cap = 1 - (logits / softcap).square()
        dlogits = logits.sub_(lse[rows, None]).exp_().mul_(-g[rows, None])
        dlogits.scatter_add_(1, safe[rows, None], g[rows, None])
        if softcap > 0:
            dlogits.mul_(cap)
        _accumulate(dlogits, h, weight, rows, dh, dw)
    return dh, dw.to(weight.dtype)


@_token_logprobs_backward.register_fake
def _(grad, h, weight, targets, lse, ignore_index, chunk_size, softcap):
    return torch.empty_like(h), torch.empty_like(weight)


def _lp_setup(ctx, inputs, output) -> None:
    h, weight, targets, ignore_index, chunk_size, softcap = inputs
    ctx.save_for_backward(h, weight, targets, output[1])
    ctx.args = (ignore_index, chunk_size, softcap)


def _lp_backward(ctx, grad_logp: Tensor, grad_lse: Tensor):
    h, weight, targets, lse = ctx.saved_tensors
    dh, dw = _token_logprobs_backward(grad_logp, h, weight, targets, lse, *ctx.args)
    return dh, dw, None, None, None, None


_token_logprobs.register_autograd(_lp_backward, setup_context=_lp_setup)


def token_logprobs(
    h: Tensor,
    weight: Tensor,
    targets: Tensor,
    *,
    ignore_index: int = -100,
    chunk_size: int = 0,
    softcap: float = 0.0,
) -> Tensor:
    """h [N, d], weight [V, d], targets [N] int64 -> log-probabilities [N] fp32 of the targets
    (0 where ignored). See the module docstring."""
    return _token_logprobs(h, weight, targets, ignore_index, chunk_size, float(softcap))[0]


# --------------------------------------------------------------------------- divergences


def _divergence(student: Tensor, teacher: Tensor, kind: str) -> tuple[Tensor, Tensor, Tensor]:
    """Per-token divergence [c] of fp32 logits already divided by the temperature, and
    d divergence / d student logits [c, V] (teacher logits get no gradient)."""
    log_s = torch.log_softmax(student, dim=-1)
    log_t = torch.log_softmax(teacher, dim=-1)
    p_s, p_t = log_s.exp(), log_t.exp()
    if kind == "forward_kl":
        div = (p_t * (log_t - log_s)).sum(-1)
        return div, p_s - p_t, p_s
    log_m = torch.logaddexp(log_s, log_t) - torch.log(torch.tensor(2.0, device=student.device))
    kl_s = (p_s * (log_s - log_m)).sum(-1)
    div = 0.5 * (p_t * (log_t - log_m)).sum(-1) + 0.5 * kl_s
    # d JSD / d log_s (through p_s and m): 1/2 p_s (log_s - log_m); then through the softmax
    g = 0.5 * p_s * (log_s - log_m)
    return div, g - p_s * g.sum(-1, keepdim=True), p_s


@torch.library.custom_op("compiletune::token_divergence", mutates_args=())
def _token_divergence(
    h: Tensor,
    weight: Tensor,
    teacher_h: Tensor,
    teacher_weight: Tensor,
    mask: Tensor,
    temperature: float,
    kind: str,
    chunk_size: int,
    softcap: float,
) -> Tensor:
    out = torch.zeros(h.shape[0], dtype=torch.float32, device=h.device)
    for rows in _chunks(h.shape[0], weight.shape[0], chunk_size, _DIV_TEMPORARIES):
        student = _logits(h[rows], weight, softcap) / temperature
        teacher = _logits(teacher_h[rows], teacher_weight, softcap) / temperature
        div, _, _ = _divergence(student, teacher, kind)
        out[rows] = torch.where(mask[rows], div, 0.0)
    return out


@_token_divergence.register_fake
def _(h, weight, teacher_h, teacher_weight, mask, temperature, kind, chunk_size, softcap):
    return h.new_empty(h.shape[0], dtype=torch.float32)


@torch.library.custom_op("compiletune::token_divergence_backward", mutates_args=())
def _token_divergence_backward(
    grad: Tensor,
    h: Tensor,
    weight: Tensor,
    teacher_h: Tensor,
    teacher_weight: Tensor,
    mask: Tensor,
    temperature: float,
    kind: str,
    chunk_size: int,
    softcap: float,
) -> tuple[Tensor, Tensor]:
    dh = torch.empty_like(h)
    dw = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
    g = torch.where(mask, grad.float(), 0.0)
    for rows in _chunks(h.shape[0], weight.shape[0], chunk_size, _DIV_TEMPORARIES):
        logits = _logits(h[rows], weight, softcap)
        teacher = _logits(teacher_h[rows], teacher_weight, softcap) / temperature
        _, dstudent, _ = _divergence(logits / temperature, teacher, kind)
        dlogits = _capped_grad(dstudent * (g[rows, None] / temperature), logits, softcap)
        _accumulate(dlogits, h, weight, rows, dh, dw)
    return dh, dw.to(weight.dtype)


@_token_divergence_backward.register_fake
def _(grad, h, weight, teacher_h, teacher_weight, mask, temperature, kind, chunk_size, softcap):
    return torch.empty_like(h), torch.empty_like(weight)


def _div_setup(ctx, inputs, output) -> None:
    h, weight, teacher_h, teacher_weight, mask, *args = inputs
    ctx.save_for_backward(h, weight, teacher_h, teacher_weight, mask)
    ctx.args = tuple(args)


def _div_backward(ctx, grad: Tensor):
    dh, dw = _token_divergence_backward(grad, *ctx.saved_tensors, *ctx.args)
    return dh, dw, None, None, None, None, None, None, None


_token_divergence.register_autograd(_div_backward, setup_context=_div_setup)


def token_divergence(
    h: Tensor,
    weight: Tensor,
    teacher_h: Tensor,
    teacher_weight: Tensor,
    mask: Tensor,
    *,
    temperature: float = 1.0,
    kind: str = "forward_kl",
    chunk_size: int = 0,
    softcap: float = 0.0,
) -> Tensor:
    """Per-token divergence [N] fp32 between the teacher's and the student's distributions
    (see the module docstring); gradients reach h and weight only."""
    if kind not in KINDS:
        raise ValueError(f"unknown divergence {kind!r}; expected one of {KINDS}")
    if teacher_weight.shape[0] != weight.shape[0]:
        raise ValueError(
            f"teacher vocabulary {teacher_weight.shape[0]} != student vocabulary {weight.shape[0]}"
        )
    if not temperature > 0:
        raise ValueError(f"temperature must be positive, got {temperature}")
    return _token_divergence(
        h,
        weight,
        teacher_h.detach(),
        teacher_weight.detach(),
        mask,
        float(temperature),
        kind,
        chunk_size,
        float(softcap),
    )
