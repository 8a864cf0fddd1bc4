"""CPU kernels for torch's varlen flash-attention ops (`torch_attn::_varlen_attn` and its
backward), for tests only: torch ships them for CUDA, so without these the varlen path (the
model's choice of it, its compile, its activation-policy tags) could not run on the CPU CI.
Each document is attended alone, in fp32 from dense scores; the backward differentiates the
same function. Registered once per process by `register()`; COMPILETUNE_VARLEN=force then
lets the model take the path on the CPU."""

from __future__ import annotations

import torch
from torch import Tensor

_DONE: list[bool] = []


def _one(q: Tensor, k: Tensor, v: Tensor, scale: float) -> tuple[Tensor, Tensor]:
    """One document: q, k, v [n, h, d] -> out [n, h, d] (fp32), lse [h, n] (fp32)."""
    scores = torch.einsum("qhd,khd->hqk", q.float(), k.float()) * scale
    n = q.shape[0]
    hidden = torch.ones(n, n, dtype=torch.bool).triu(1)
    scores = scores.masked_fill(hidden, float("-inf"))
    lse = scores.logsumexp(-1)  # [h, n]
    out = torch.einsum("hqk,khd->qhd", (scores - lse[..., None]).exp(), v.float())
    return out, lse


def _bounds(cu: Tensor) -> list[tuple[int, int]]:
    ends = cu.tolist()
    return list(zip(ends[:-1], ends[1:], strict=True))


def _scale(q: Tensor, scale: float | None) -> float:
    return scale if scale is not None else q.shape[-1] ** -0.5


def _forward(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False, scale=None,
             *rest):  # fmt: skip
    assert is_causal, "the tests' kernel is causal only (as compiletune calls it)"
    out = torch.zeros_like(query)
    lse = torch.zeros(query.shape[1], query.shape[0], dtype=torch.float32)
    for a, e in _bounds(cu_seq_q):
        o, m = _one(query[a:e], key[a:e], value[a:e], _scale(query, scale))
        out[a:e], lse[:, a:e] = o.to(query.dtype), m
    return out, lse, torch.zeros(2, dtype=torch.uint64)


def _backward(grad_out, query, key, value, out, lse, cu_seq_q, cu_seq_k, max_q, max_k,
              is_causal, rng_state, scale=None, *rest):  # fmt: skip
    grads = [torch.zeros_like(t) for t in (query, key, value)]
    for a, e in _bounds(cu_seq_q):
        piece = [t[a:e].float() for t in (query, key, value)]
        # below autograd here (a kernel): differentiate functionally, as the segment op does
        _, pullback = torch.func.vjp(lambda *t: _one(*t, _scale(query, scale))[0], *piece)
        got = pullback(grad_out[a:e].float())
        for g, d in zip(grads, got, strict=True):
            g[a:e] = d.to(g.dtype)
    return tuple(grads)


def register() -> None:
    """Register the CPU kernels (once per process)."""
    if _DONE:
        return
    torch.library.register_kernel("torch_attn::_varlen_attn", "cpu", _forward)
    torch.library.register_kernel("torch_attn::_varlen_attn_backward", "cpu", _backward)
    _DONE.append(True)
