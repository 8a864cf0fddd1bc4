"""Multi-head latent attention: keys and values of every head from a small latent per token.

Per token, with r = kv_rank, rd = the rope part, n = hd - rd the rest, hv = the value head dim:

    q            = wq(x), or wq_b(norm(wq_a(x)))          [h, n + rd]  (q_rank: the bottleneck)
    c, k_rope    = wkv_a(x) split                         [r], [rd]    (one rope key, all heads)
    k_nope, v    = wkv_b(norm(c)) split per head          [h, n], [h, hv]
    k            = (k_nope, rope(k_rope)), q = (q_nope, rope(q_rope))
    out          = wo(attention(q, k, v))                 scores scaled by hd**-0.5 (x yarn's m^2)

Training expands k and v per head and runs the same attention as every other layer (documents,
FlexAttention or the segment op). Generation caches what MLA is for: the normed latent and the
rotated rope key per token ([b, 1, max_len, r] and [b, 1, max_len, rd], in KVCache's k and v),
and expands them for the tokens seen so far at each step. With `rope_interleave` the rope dims
come in pairs (x0, x1), (x2, x3) ...; they are de-interleaved before the rotation, as
transformers does, which gives the same scores.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .args import ModelArgs
from .attention import attention_backend, causal_attention, flex_block_mask
from .cache import KVCache
from .norm import RMSNorm
from .rope import apply_rope
from .seq_parallel import SeqShards

# transformers' DeepseekV3RMSNorm of the two latents keeps its default eps, not the config's
LATENT_NORM_EPS = 1e-6


class LatentAttention(nn.Module):
    """MLA (see the module docstring); the interface of `decoder.Attention`."""

    def __init__(self, args: ModelArgs, layer: int = 0):
        super().__init__()
        h, hd, rd = args.n_heads, args.hd, args.rotary_dim or 0
        if not 0 < rd < hd or rd % 2:
            raise ValueError(f"MLA needs an even rope part (rotary_dim {rd}) below hd {hd}")
        self.n_heads, self.head_dim, self.rope_dim = h, hd, rd
        self.nope_dim, self.v_dim, self.kv_rank = hd - rd, args.v_head_dim, args.kv_rank
        self.scale = args.attn_scale
        self.window = args.window(layer)
        self.softcap = 0.0
        self.sinks = None
        self.kv_mode = None
        self.backend: str | None = None
        self.seq: SeqShards | None = None  # context parallelism (seq_parallel.py)
        self.interleave = args.rope_interleave
        if args.q_rank:
            self.wq_a = nn.Linear(args.dim, args.q_rank, bias=args.qkv_bias)
            self.q_a_norm = RMSNorm(args.q_rank, LATENT_NORM_EPS)
            self.wq_b = nn.Linear(args.q_rank, h * hd, bias=False)
        else:
            self.wq = nn.Linear(args.dim, h * hd, bias=False)
        self.wkv_a = nn.Linear(args.dim, args.kv_rank + rd, bias=args.qkv_bias)
        self.kv_a_norm = RMSNorm(args.kv_rank, LATENT_NORM_EPS)
        self.wkv_b = nn.Linear(args.kv_rank, h * (self.nope_dim + self.v_dim), bias=False)
        self.wo = nn.Linear(h * self.v_dim, args.dim, bias=args.o_bias)

    def _rope(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        if self.interleave:  # (x0, x1), (x2, x3) ... -> (x0, x2, ...), (x1, x3, ...)
            x = torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)
        return apply_rope(x, cos, sin)

    def _q(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        """x [b, s, d] -> q [b, h, s, hd], its rope part rotated."""
        b, s, _ = x.shape
        q = self.wq_b(self.q_a_norm(self.wq_a(x))) if hasattr(self, "wq_b") else self.wq(x)
        q = q.view(b, s, self.n_heads, self.head_dim).transpose(1, 2)
        q_nope, q_rope = q.split([self.nope_dim, self.rope_dim], dim=-1)
        return torch.cat((q_nope, self._rope(q_rope, cos, sin)), dim=-1)

    def latent(self, x: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
        """x [b, s, d] -> (normed latent [b, 1, s, r], rotated rope key [b, 1, s, rd]): what
        the cache holds."""
        b, s, _ = x.shape
        c, k_rope = self.wkv_a(x).split([self.kv_rank, self.rope_dim], dim=-1)
        c = self.kv_a_norm(c).view(b, 1, s, self.kv_rank)
        return c, self._rope(k_rope.view(b, 1, s, self.rope_dim), cos, sin)

    def expand(self, c: Tensor, k_rope: Tensor) -> tuple[Tensor, Tensor]:
        """latent [b, 1, t, r], rope key [b, 1, t, rd] -> k [b, h, t, hd], v [b, h, t, hv]."""
        b, _, t, _ = c.shape
        kv = self.wkv_b(c.squeeze(1)).view(b, t, self.n_heads, self.nope_dim + self.v_dim)
        k_nope, v = kv.transpose(1, 2).split([self.nope_dim, self.v_dim], dim=-1)
        k = torch.cat((k_nope, k_rope.expand(b, self.n_heads, t, self.rope_dim)), dim=-1)
        return k, v

    def mask(
        self, doc_ids: Tensor | None, shape: tuple[int, int], device: torch.device, shared: dict
    ) -> Any:
        """As `decoder.Attention.mask`."""
        if doc_ids is None and self.window <= 0:
            return None
        if (self.backend or attention_backend(device)) != "flex":
            return doc_ids
        if self.window not in shared:
            shared[self.window] = flex_block_mask(doc_ids, self.window, *shape, device)
        return shared[self.window]

    def forward(
        self, x: Tensor, cos: Tensor, sin: Tensor, doc_ids: Any = None, kv: Any = None
    ) -> Tensor:
        """x [b, s, d], cos/sin [b, s, rd], doc_ids [b, s] (or a block mask) -> [b, s, d]."""
        b, s, _ = x.shape
        q = self._q(x, cos, sin)
        k, v = self.expand(*self.latent(x, cos, sin))
        if self.seq is not None:  # context parallelism: every token, this rank's heads
            q, k, v = self.seq.to_heads(q), self.seq.to_heads(k), self.seq.to_heads(v)
        out = causal_attention(
            q, k, v, self.scale, doc_ids, self.window, backend=self.backend
        )  # [b, h, s, hv]
        if self.seq is not None:
            out = self.seq.to_sequence(out)
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))

    def forward_cached(
        self, x: Tensor, cos: Tensor, sin: Tensor, cache: KVCache, layer: int
    ) -> Tensor:
        """Inference over the tokens after the `cache.length` cached ones (see the module
        docstring: the cache holds latents and rope keys)."""
        b, s, _ = x.shape
        q = self._q(x, cos, sin)
        c, k_rope = self.latent(x, cos, sin)
        cache.write(layer, c, k_rope)
        k, v = self.expand(*cache.read(layer, s))
        if cache.prefill:
            out = causal_attention(q, k, v, self.scale, None, self.window, backend="segments")
        else:
            seen = cache.seen(k, s, self.window)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=seen, scale=self.scale)
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))
