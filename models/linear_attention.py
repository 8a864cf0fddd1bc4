"""Gated DeltaNet linear attention: the token mixer of a "linear" layer.

x -> in_proj_qkv -> a short causal depthwise convolution (silu) -> q, k, v heads; q and k
l2-normalised, q scaled by dk^-0.5; per head a decay g = -exp(A_log) softplus(in_proj_a x +
dt_bias) and a write strength beta = sigmoid(in_proj_b x); the gated delta rule
(compiletune::gated_delta_rule, ops/gated_delta.py) over them; a per-head RMSNorm of the result
gated by silu(in_proj_z x); out_proj. Parameter names follow the HF checkpoints.

Packed rows: the convolution and the recurrent state both restart at each document's first
token (`doc_ids`), so every document is computed as if alone. The module has `Attention`'s
interface (`mask`, `forward`, `forward_cached`), so the block and the model treat both alike;
rope's cos/sin are accepted and unused.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from compiletune.ops.gated_delta import CHUNK, gated_delta_forward, gated_delta_rule


def causal_conv(x: Tensor, weight: Tensor, doc_ids: Tensor | None, past: Tensor | None = None):
    """x [b, s, c], weight [c, 1, K] -> [b, s, c]: out_t = sum_j w[j] x[t - K + 1 + j] over the
    tokens of t's document (zeros before it), as Conv1d with K - 1 left padding. `past`
    [b, K - 1, c]: the inputs before x (generation), else zeros."""
    kernel = weight.shape[-1]
    w = weight[:, 0]  # [c, K]
    s = x.shape[1]
    full = x if past is None else torch.cat((past, x), dim=1)
    offset = full.shape[1] - s
    out = x * w[:, -1]
    for d in range(1, kernel):
        shifted = F.pad(full, (0, 0, d, 0))[:, offset : offset + s]  # x[t - d]
        if doc_ids is not None:
            same = F.pad(doc_ids, (d, 0), value=-1)[:, :s] == doc_ids  # [b, s]
            shifted = shifted * same[..., None].to(shifted.dtype)
        out = out + shifted * w[:, -1 - d]
    return out


def _l2norm(x: Tensor, eps: float = 1e-6) -> Tensor:
    """x / sqrt(|x|^2 + eps) over the last dim, in fp32 (as the published kernels)."""
    x = x.float()
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


class GatedRMSNorm(nn.Module):
    """RMSNorm over the last dim times silu(gate) (weight applied before the cast back, the
    gate in fp32), as the HF checkpoints' gated norm of these layers."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor, gate: Tensor) -> Tensor:
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        h = self.weight * h.to(dtype)
        return (h * F.silu(gate.float())).to(dtype)

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)


class GatedDeltaNet(nn.Module):
    def __init__(self, args: Any, layer: int = 0) -> None:
        super().__init__()
        self.k_heads, self.v_heads = args.linear_k_heads, args.linear_v_heads
        self.dk, self.dv = args.linear_k_dim, args.linear_v_dim
        key_dim, value_dim = self.k_heads * self.dk, self.v_heads * self.dv
        self.conv_dim = 2 * key_dim + value_dim
        self.fused = args.linear_fused  # two fused projections, grouped per key head
        if self.fused:
            self.in_proj_qkvz = nn.Linear(args.dim, 2 * key_dim + 2 * value_dim, bias=False)
            self.in_proj_ba = nn.Linear(args.dim, 2 * self.v_heads, bias=False)
        else:
            self.in_proj_qkv = nn.Linear(args.dim, self.conv_dim, bias=False)
            self.in_proj_z = nn.Linear(args.dim, value_dim, bias=False)
            self.in_proj_b = nn.Linear(args.dim, self.v_heads, bias=False)
            self.in_proj_a = nn.Linear(args.dim, self.v_heads, bias=False)
        self.conv1d = nn.Conv1d(
            self.conv_dim, self.conv_dim, args.linear_conv, groups=self.conv_dim, bias=False
        )
        self.dt_bias = nn.Parameter(torch.ones(self.v_heads))
        self.A_log = nn.Parameter(torch.zeros(self.v_heads))
        self.norm = GatedRMSNorm(self.dv, args.norm_eps)
        self.out_proj = nn.Linear(value_dim, args.dim, bias=False)
        self.window = 0  # the block's attention interface
        self.softcap = 0.0

    def mask(self, doc_ids: Tensor | None, shape: Any, device: Any, shared: dict) -> Any:
        """What `forward` takes: the document ids as they are."""
        return doc_ids

    def _project(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """x [b, s, d] -> (q|k|v [b, s, conv_dim] (all q, then all k, then all v), z [b, s,
        v_heads, dv], the write strengths' and decays' inputs [b, s, v_heads]). The two fused
        projections (`linear_fused`) hold, per key head, its q, k, then its value heads' v and
        z (and b, a)."""
        b, s, _ = x.shape
        if not self.fused:
            z = self.in_proj_z(x).view(b, s, self.v_heads, self.dv)
            return self.in_proj_qkv(x), z, self.in_proj_b(x), self.in_proj_a(x)
        r = self.v_heads // self.k_heads
        qkvz = self.in_proj_qkvz(x).view(b, s, self.k_heads, -1)
        q, k, v, z = qkvz.split([self.dk, self.dk, r * self.dv, r * self.dv], dim=-1)
        bb, a = self.in_proj_ba(x).view(b, s, self.k_heads, 2 * r).split([r, r], dim=-1)
        qkv = torch.cat([t.reshape(b, s, -1) for t in (q, k, v)], dim=-1)
        z = z.reshape(b, s, self.v_heads, self.dv)
        return qkv, z, bb.reshape(b, s, self.v_heads), a.reshape(b, s, self.v_heads)

    def _heads(self, mixed: Tensor, b_in: Tensor, a_in: Tensor) -> tuple[Tensor, ...]:
        """The convolved projections and the b / a inputs -> q, k [b, s, v_heads, dk], v, g,
        beta."""
        b, s, _ = mixed.shape
        key_dim = self.k_heads * self.dk
        q, k, v = mixed.split([key_dim, key_dim, self.v_heads * self.dv], dim=-1)
        q, k = (
            _l2norm(q.view(b, s, self.k_heads, self.dk)),
            _l2norm(k.view(b, s, self.k_heads, self.dk)),
        )
        if self.v_heads != self.k_heads:  # each q/k head serves consecutive value heads
            q = q.repeat_interleave(self.v_heads // self.k_heads, dim=2)
            k = k.repeat_interleave(self.v_heads // self.k_heads, dim=2)
        q = q * self.dk**-0.5
        v = v.reshape(b, s, self.v_heads, self.dv)
        beta = torch.sigmoid(b_in)
        g = -self.A_log.float().exp() * F.softplus(a_in.float() + self.dt_bias)
        return q, k, v, g, beta

    def _out(self, o: Tensor, z: Tensor) -> Tensor:
        b, s = o.shape[:2]
        return self.out_proj(self.norm(o, z).reshape(b, s, -1))

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, doc_ids: Any = None) -> Tensor:
        """x [b, s, d], doc_ids [b, s] or None -> [b, s, d]."""
        qkv, z, b_in, a_in = self._project(x)
        mixed = F.silu(causal_conv(qkv, self.conv1d.weight, doc_ids))
        q, k, v, g, beta = self._heads(mixed, b_in, a_in)
        o = gated_delta_rule(q, k, v, g, beta, doc_ids)  # fp32 inside, v's dtype out
        return self._out(o, z)

    def forward_cached(self, x: Tensor, cos: Tensor, sin: Tensor, cache: Any, layer: int):
        """Inference: x [b, s, d] after the cached tokens; the cache holds this layer's last
        K - 1 projected inputs (the convolution's) and its recurrent state."""
        projected, z, b_in, a_in = self._project(x)
        past = cache.conv[layer]
        mixed = F.silu(causal_conv(projected, self.conv1d.weight, None, past))
        keep = self.conv1d.weight.shape[-1] - 1
        # in place, as the state below: a CUDA graph replays over the same storage
        past.copy_(torch.cat((past, projected), dim=1)[:, -keep:])
        q, k, v, g, beta = self._heads(mixed, b_in, a_in)
        # a decode step of one token is a chunk of one (no padding to a whole chunk)
        chunk = min(CHUNK, x.shape[1])
        o, state = gated_delta_forward(q, k, v, g, beta, None, cache.state[layer], chunk=chunk)
        cache.state[layer].copy_(state)
        return self._out(o, z)
