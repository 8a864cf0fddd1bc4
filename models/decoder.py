"""One decoder for every supported family (models/families/), with Gated DeltaNet layers
(linear_attention.py) and mixture-of-experts feed-forwards (moe.py) where a family has them.

The families differ only in data (`ModelArgs`): sizes, GQA ratio, rope base, scaling and
rotary fraction, layers without rope, q/k/v bias, q/k norms per head or over the whole
projection, (1 + w) norms, scaled embeddings, GeGLU, sandwich norms or norms after attention and
MLP only, and soft-capping, sliding windows and their layer pattern, fused q/k/v and gate/up
projections, tied embeddings, per-kind head sizes, per-layer inputs and keys/values shared
across layers, and multi-head latent attention (mla.py). Parameter layout
follows the HF checkpoints, including the "rotate_half" rope convention, so HF weights load by
renaming alone (see `hf.py`).

Shapes: b = batch, s = sequence, d = dim, h = n_heads, k = n_kv_heads, hd = head dim, v = vocab.

The model holds parameters only, no buffers (per-block output scalars are frozen parameters):
it is built on the meta device and materialised later, and rope cos/sin are recomputed from
`args` in `forward`, so every block of a kind is the same module with the same inputs (one
compiled graph serves all of them).
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from .args import ModelArgs
from .attention import attention_backend, causal_attention, flex_block_mask, varlen_documents
from .attention import shared_masks as shared_masks_for
from .cache import KVCache
from .linear_attention import GatedDeltaNet, GatedRMSNorm
from .mla import LatentAttention
from .moe import Experts, MoE, glu
from .norm import RMSNorm, norm_for, unit_rms
from .rope import apply_rope, rope_cos_sin
from .seq_parallel import SeqShards
from .vision.mask import ImageBlocks


class Attention(nn.Module):
    """Causal grouped-query attention with rope; a sliding window and score soft-capping when
    the layer has them, q/k norms when the family has them.

    Projections: wq, wk, wv, or (fused_projections) one wqkv whose output rows are q,
    then k, then v, as in the checkpoint."""

    def __init__(self, args: ModelArgs, layer: int = 0):
        super().__init__()
        self.kind = kind = args.layer_kind(layer)
        self.n_heads = args.n_heads
        self.n_kv_heads = args.kv_heads_of(kind)
        self.head_dim = hd = args.head_dim_of(kind)
        self.scale = args.attn_scale
        self.window = args.window(layer)
        self.softcap = args.attn_softcap or 0.0
        self.backend: str | None = None  # masked attention's kernel; None: attention_backend
        # None, or "store": return this layer's keys and values for later layers, or
        # "reuse": attend over those instead of projecting its own
        self.kv_mode = args.kv_mode(layer)
        own_kv = self.kv_mode != "reuse"
        self.v_from_k = args.kv_from_k and kind == "full"
        q_out, kv_out = args.n_heads * hd, self.n_kv_heads * hd
        self.fused = args.fused_projections
        self.gated = args.attn_output_gate  # wq's rows: per head, its query then its gate
        if self.fused:
            self.wqkv = nn.Linear(args.dim, q_out + 2 * kv_out, bias=args.qkv_bias)
        else:
            self.wq = nn.Linear(args.dim, q_out * (2 if self.gated else 1), bias=args.qkv_bias)
            if own_kv:
                self.wk = nn.Linear(args.dim, kv_out, bias=args.qkv_bias)
            if own_kv and not self.v_from_k:
                self.wv = nn.Linear(args.dim, kv_out, bias=args.qkv_bias)
        self.wo = nn.Linear(q_out, args.dim, bias=args.o_bias)
        self.sinks = nn.Parameter(torch.zeros(args.n_heads)) if args.attn_sinks else None
        self.rope = args.rope(layer)
        self.qk_norm_whole = args.qk_norm_whole
        self.q_norm = self.k_norm = None
        if args.qk_norm:  # per head, or (qk_norm_whole) over the whole projection
            self.q_norm = norm_for(args, q_out if args.qk_norm_whole else hd)
            if own_kv:
                self.k_norm = norm_for(args, kv_out if args.qk_norm_whole else hd)
        self.v_norm_eps = args.norm_eps if args.v_norm else 0.0
        self.seq: SeqShards | None = None  # context parallelism (seq_parallel.py)

    def _split_gate(self, q: Tensor) -> tuple[Tensor, Tensor | None]:
        """wq's output [b, s, rows] -> queries [b, s, h * hd] and a gated family's output gate
        [b, s, h * hd] (per head, the query's rows then the gate's), else None."""
        if not self.gated:
            return q, None
        b, s, _ = q.shape
        h, hd = self.n_heads, self.head_dim
        q, gate = q.view(b, s, h, 2 * hd).split(hd, dim=-1)
        return q.reshape(b, s, h * hd), gate.reshape(b, s, h * hd)

    def _q(self, x: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor | None]:
        """x [b, s, d] -> q [b, h, s, hd] (normed and rotated), and a gated family's output gate
        [b, s, h * hd] (else None): for a layer that reuses another's keys and values."""
        b, s, _ = x.shape
        q, gate = self._split_gate(self.wq(x))
        q = q.view(b, s, self.n_heads, self.head_dim)
        if self.q_norm is not None:
            q = self.q_norm(q)
        q = q.transpose(1, 2)
        return (apply_rope(q, cos, sin) if self.rope else q), gate

    def _qkv(
        self, x: Tensor, cos: Tensor, sin: Tensor
    ) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
        """x [b, s, d] -> q [b, h, s, hd], k and v [b, k, s, hd], rope applied to q and k, and
        the output gate [b, s, h * hd] of a gated family (else None)."""
        b, s, _ = x.shape
        h, k, hd = self.n_heads, self.n_kv_heads, self.head_dim
        if self.fused:
            q, kk, v = self.wqkv(x).split([h * hd, k * hd, k * hd], dim=-1)
        else:
            q, kk = self.wq(x), self.wk(x)
            v = kk if self.v_from_k else self.wv(x)
        q, gate = self._split_gate(q)
        if self.q_norm is not None and self.qk_norm_whole:
            q, kk = self.q_norm(q), self.k_norm(kk)  # over all heads at once, before rope
        q, kk, v = q.view(b, s, h, hd), kk.view(b, s, k, hd), v.view(b, s, k, hd)
        if self.q_norm is not None and not self.qk_norm_whole:
            q, kk = self.q_norm(q), self.k_norm(kk)  # per head, before rope
        if self.v_norm_eps:
            v = unit_rms(v, self.v_norm_eps)
        q, kk, v = q.transpose(1, 2), kk.transpose(1, 2), v.transpose(1, 2)  # [b, heads, s, hd]
        if not self.rope:  # a NoPE layer
            return q, kk, v, gate
        return apply_rope(q, cos, sin), apply_rope(kk, cos, sin), v, gate

    def _repeat_kv(self, t: Tensor, heads: int | None = None) -> Tensor:
        """[b, k, s, hd] -> [b, h, s, hd]: kv head j serves query heads j*n_rep .. (j+1)*n_rep-1
        (HF repeat_kv). Expanded explicitly rather than via SDPA's enable_gqa, which not every
        backend supports. `heads`: h when not all of the layer's (a context-parallel rank's)."""
        h = heads or self.n_heads
        b, k, s, hd = t.shape
        if k == h:
            return t
        return t[:, :, None].expand(b, k, h // k, s, hd).reshape(b, h, s, hd)

    def _attend(self, q: Tensor, kk: Tensor, v: Tensor, doc_ids: Any) -> Tensor:
        """q [b, h, s, hd], kk and v [b, k, s, hd] -> [b, h, s, hd]. Under context parallelism
        the ranks swap the sequence split for a head split around the attention (keys and
        values before they are repeated where the ranks divide their heads)."""
        seq, sinks = self.seq, self.sinks
        if seq is not None:
            if kk.shape[1] % seq.size:
                kk, v = self._repeat_kv(kk), self._repeat_kv(v)
            q, kk, v = seq.to_heads(q), seq.to_heads(kk), seq.to_heads(v)
            sinks = None if sinks is None else seq.heads(sinks)
        out = causal_attention(
            q,
            self._repeat_kv(kk, q.shape[1]),
            self._repeat_kv(v, q.shape[1]),
            self.scale,
            doc_ids,
            self.window,
            self.softcap,
            backend=self.backend,
            sinks=sinks,
        )
        return out if seq is None else seq.to_sequence(out)

    def mask(
        self, doc_ids: Tensor | None, shape: tuple[int, int], device: torch.device, shared: dict
    ) -> Any:
        """What `forward` takes as its mask for a batch of `shape` (b, s): doc_ids as they are,
        or, where this layer runs FlexAttention with a mask, the block mask of its window,
        built once and kept in `shared` for the other layers of the same window (a layer with
        sinks takes one even without documents or a window: FlexAttention gives it the
        log-sum-exp the sinks need)."""
        if isinstance(doc_ids, ImageBlocks):  # images' tokens see each other: a dense mask
            key = ("images", self.kind, self.window)
            if key not in shared:
                shared[key] = doc_ids.dense(self.window, self.kind)
            return shared[key]
        plain = doc_ids is None and self.window <= 0 and self.softcap <= 0
        if plain and self.sinks is None:
            return None
        if (self.backend or attention_backend(device)) != "flex":
            return doc_ids
        # documents only, with the batch's host-built cumulative lengths: varlen flash attention
        docs = varlen_documents(
            shared, self.window, self.softcap, self.sinks is not None, self.head_dim
        )
        if docs is not None:
            return docs
        if self.window not in shared:
            shared[self.window] = flex_block_mask(doc_ids, self.window, *shape, device)
        return shared[self.window]

    def forward(
        self,
        x: Tensor,
        cos: Tensor,
        sin: Tensor,
        doc_ids: Any = None,
        kv: tuple[Tensor, Tensor] | None = None,
    ) -> Tensor | tuple[Tensor, Tensor, Tensor]:
        """x [b, s, d], cos/sin [b, s, rd], doc_ids [b, s] or None -> [b, s, d].

        With `doc_ids`, a token attends only to earlier tokens of its own document. `doc_ids`
        may instead be the FlexAttention block mask from `mask`. A "reuse" layer attends over
        `kv` (keys, values [b, k, s, hd] of its "store" layer); a "store" layer returns
        (out, its keys, its values).
        """
        b, s, _ = x.shape
        if self.kv_mode == "reuse":
            assert kv is not None, "a layer that reuses keys and values needs them"
            (q, gate), (kk, v) = self._q(x, cos, sin), kv
        else:
            q, kk, v, gate = self._qkv(x, cos, sin)
        out = self._attend(q, kk, v, doc_ids).transpose(1, 2).reshape(b, s, -1)  # [b, s, h * hd]
        out = self.wo(out if gate is None else out * torch.sigmoid(gate))
        return (out, kk, v) if self.kv_mode == "store" else out

    def forward_cached(
        self, x: Tensor, cos: Tensor, sin: Tensor, cache: KVCache, layer: int
    ) -> Tensor:
        """Inference: x [b, s, d] are the tokens after the `cache.length` cached ones.

        Their keys and values are written into the cache; each new token attends to the cached
        and new tokens up to itself (within the window, if the layer has one). With per-row
        `cache.lengths` (one new token per row): each row's at its own position, attending over
        the whole static cache under a mask.
        """
        b, s, _ = x.shape
        if self.kv_mode == "reuse":  # the store layer, earlier in this step, wrote them
            q, gate = self._q(x, cos, sin)
            layer = cache.source[layer]
        else:
            q, kk, v, gate = self._qkv(x, cos, sin)
            cache.write(layer, kk, v)
        cached_k, cached_v = cache.read(layer, s)
        keys, values = self._repeat_kv(cached_k), self._repeat_kv(cached_v)  # [b, h, n, hd]
        if cache.prefill:  # the prompt: the exact segment op (prompt lengths vary; no recompiles)
            images = cache.images  # a prompt with images: their tokens see each other
            out = causal_attention(
                q,
                keys,
                values,
                self.scale,
                None if images is None else images.dense(self.window, self.kind),
                self.window,
                self.softcap,
                backend="segments",
                sinks=self.sinks,
            )
        else:
            out = self._attend_cached(q, keys, values, cache.seen(cached_k, s, self.window))
        out = out.transpose(1, 2).reshape(b, s, -1)
        return self.wo(out if gate is None else out * torch.sigmoid(gate))

    def _attend_cached(self, q: Tensor, keys: Tensor, values: Tensor, seen: Tensor | None):
        """Decode-time attention of q [b, h, s, hd] over cached keys/values [b, h, n, hd];
        `seen`: a bool mask broadcast to [b, h, s, n], or None (every key)."""
        if self.softcap > 0 or self.sinks is not None:
            scores = torch.matmul(q, keys.transpose(-1, -2)) * self.scale
            if self.softcap > 0:
                scores = self.softcap * torch.tanh(scores / self.softcap)
            if seen is not None:
                scores = scores.masked_fill(~seen, float("-inf"))
            if self.sinks is not None:  # one more logit per head, its share dropped
                sink = self.sinks.to(scores.dtype).view(1, -1, 1, 1)
                scores = torch.cat([scores, sink.expand(*scores.shape[:-1], 1)], dim=-1)
            probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
            return torch.matmul(probs[..., : keys.shape[-2]], values)
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=seen, scale=self.scale)


class FeedForward(nn.Module):
    """Gated MLP: w2(act(w1 x) * w3 x), act = silu (SwiGLU) or tanh-GELU (GeGLU).
    w1 = gate, w3 = up, w2 = down; fused: one w13 whose rows are gate, then up."""

    def __init__(self, dim: int, ffn_dim: int, activation: str = "silu", fused: bool = False):
        super().__init__()
        self.fused = fused
        # Registration order fixes the order init_weights draws in: w1, w2, w3 as always.
        if fused:
            self.w13 = nn.Linear(dim, 2 * ffn_dim, bias=False)
            self.w2 = nn.Linear(ffn_dim, dim, bias=False)
        else:
            self.w1 = nn.Linear(dim, ffn_dim, bias=False)
            self.w2 = nn.Linear(ffn_dim, dim, bias=False)
            self.w3 = nn.Linear(dim, ffn_dim, bias=False)
        if activation not in ACTIVATIONS:
            raise ValueError(f"unknown activation {activation!r}; expected one of {ACTIVATIONS}")
        self.activation = activation

    def forward(self, x: Tensor) -> Tensor:
        """x [b, s, d] -> [b, s, d] (hidden [b, s, ffn_dim])."""
        if self.fused:
            gate, up = self.w13(x).chunk(2, dim=-1)
        else:
            gate, up = self.w1(x), self.w3(x)
        return self.w2(glu(gate, up, self.activation))


def moe_options(args: ModelArgs) -> dict[str, Any]:
    """The `MoE` arguments every family's experts take from ModelArgs."""
    return dict(
        dim=args.dim,
        ffn_dim=args.moe_ffn_dim,
        n_experts=args.n_experts,
        top_k=args.top_k,
        norm_topk=args.norm_topk,
        score=args.router_score,
        n_groups=args.n_groups,
        topk_groups=args.topk_groups,
        routed_scale=args.routed_scale,
    )


class MLPAndExperts(MoE):
    """Experts beside the MLP (`mlp_beside_experts`): the dense MLP (w1, w3, w2, as
    `FeedForward`) on the normed input, beside the routed experts on the residual normed their
    own way, routed from the residual itself; each output normed, then summed.
    `forward(x, residual)` -> (y, stats)."""

    def __init__(self, args: ModelArgs, layer: int):
        super().__init__(
            **moe_options(args), activation=args.activation, router_norm_eps=args.norm_eps
        )
        dim, ffn_dim = args.dim, args.ffn_dim_of(layer)
        self.activation = args.activation
        self.w1 = nn.Linear(dim, ffn_dim, bias=False)
        self.w2 = nn.Linear(ffn_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, ffn_dim, bias=False)
        self.post_mlp_norm = norm_for(args, dim)
        self.pre_experts_norm = norm_for(args, dim)
        self.post_experts_norm = norm_for(args, dim)

    def forward(self, x: Tensor, route_from: Tensor | None = None) -> tuple[Tensor, Tensor]:
        assert route_from is not None, "the experts read the residual"
        dense = self.post_mlp_norm(self.w2(glu(self.w1(x), self.w3(x), self.activation)))
        experts, stats = super().forward(self.pre_experts_norm(route_from), route_from)
        return dense + self.post_experts_norm(experts), stats


ACTIVATIONS = ("silu", "gelu_tanh")


def tiled(fn: Callable[[Tensor], Tensor], x: Tensor, tile: int) -> Tensor:
    """fn(x) for a token-wise `fn` over x [b, s, d], `tile` tokens at a time when 0 < tile < s:
    each tile checkpointed (its intermediates recomputed in backward), so at most one tile's
    intermediates ([b, tile, ffn] rather than [b, s, ffn]) are alive at once. The same values."""
    if tile <= 0 or x.shape[1] <= tile:
        return fn(x)
    pieces = x.split(tile, dim=1)
    if not torch.is_grad_enabled():
        return torch.cat([fn(p) for p in pieces], dim=1)
    return torch.cat([checkpoint(fn, p, use_reentrant=False) for p in pieces], dim=1)


class TransformerBlock(nn.Module):
    """Pre-norm residual block: x + attn(norm(x)), then h + ffn(norm(h)); with sandwich norms
    the attention and MLP outputs are normed again before each residual add; without pre-norms
    only those after are there. With per-layer inputs a third residual comes from the block's
    own input, and with `layer_scalar` the block's output is scaled by a stored scalar.

    `kind` is the attention's ("full" / "sliding" / "linear", which rope it takes); `region`
    names the compiled graph the block shares with the blocks of the same shape of computation.

    Inputs: (x, cos, sin, doc_ids), then the per-layer input when the family has one, then the
    keys and values of a "reuse" layer. Output: x, or a tuple (x, the router statistics of a
    MoE block, the keys and values of a "store" block), in that order, each only when there."""

    def __init__(self, args: ModelArgs, layer: int = 0):
        super().__init__()
        self.kind = args.layer_kind(layer)
        nope = not args.rope(layer) and self.kind != "linear"
        self.kv_mode = args.kv_mode(layer)
        region = [self.kind] + ["nope"] * nope + [self.kv_mode] * (self.kv_mode is not None)
        self.region = ".".join(region)
        self.attention_norm = norm_for(args, args.dim) if args.pre_norms else None
        self.attention: Attention | LatentAttention | GatedDeltaNet
        if self.kind == "linear":
            self.attention = GatedDeltaNet(args, layer)
        elif args.kv_rank:
            self.attention = LatentAttention(args, layer)
        else:
            self.attention = Attention(args, layer)
        self.ffn_norm = norm_for(args, args.dim) if args.pre_norms else None
        self.moe = args.is_moe(layer)
        self.in_moe_model = args.n_experts > 0  # a dense layer of a MoE model: LoRA skips its MLP
        self.feed_forward: FeedForward | MoE
        if self.moe and args.mlp_beside_experts:
            self.feed_forward = MLPAndExperts(args, layer)
        elif self.moe:
            self.feed_forward = MoE(
                **moe_options(args),
                shared_ffn_dim=args.shared_ffn_dim,
                shared_gate=args.shared_expert_gate,
                bias=args.expert_bias,
                clamp=args.swiglu_limit,
                alpha=args.swiglu_alpha,
            )
        else:
            self.feed_forward = FeedForward(
                args.dim, args.ffn_dim_of(layer), args.activation, args.fused_projections
            )
        if args.sandwich_norms:
            self.post_attention_norm = norm_for(args, args.dim)
            self.post_ffn_norm = norm_for(args, args.dim)
        else:
            self.post_attention_norm = self.post_ffn_norm = None
        self.per_layer: PerLayerInput | None = None
        if args.ple_dim:
            self.per_layer = PerLayerInput(args)
        self.scalar = (
            nn.Parameter(torch.ones(1), requires_grad=False) if args.layer_scalar else None
        )
        self.mlp_tile = 0  # --mlp-tile: tokens per tile of the MLP part (0: the whole row)

    def _residuals(
        self, x: Tensor, attention: Callable[[Tensor], Any], ple: Tensor | None
    ) -> tuple[Tensor, ...]:
        a = attention(x if self.attention_norm is None else self.attention_norm(x))
        kv: tuple[Tensor, ...] = ()
        if isinstance(a, tuple):  # a "store" layer's keys and values
            a, kv = a[0], a[1:]
        if self.post_attention_norm is not None:
            a = self.post_attention_norm(a)
        h = x + a
        stats: tuple[Tensor, ...] = ()
        if self.moe:
            n = h if self.ffn_norm is None else self.ffn_norm(h)
            f, router = self.feed_forward(
                n, h if isinstance(self.feed_forward, MLPAndExperts) else None
            )
            stats = (router,)
            if self.post_ffn_norm is not None:
                f = self.post_ffn_norm(f)
        else:
            f = tiled(self._mlp, h, self.mlp_tile)
        h = h + f
        if self.per_layer is not None:
            assert ple is not None, "a block with a per-layer input needs it"
            h = h + self.per_layer(h, ple)
        if self.scalar is not None:
            h = h * self.scalar.to(h.dtype)
        return (h, *stats, *kv)

    def _mlp(self, h: Tensor) -> Tensor:
        """A dense block's MLP part: norm, MLP, the norm after (where the family has them)."""
        f = self.feed_forward(h if self.ffn_norm is None else self.ffn_norm(h))
        return f if self.post_ffn_norm is None else self.post_ffn_norm(f)

    def forward(
        self, x: Tensor, cos: Tensor, sin: Tensor, doc_ids: Any = None, *extra: Tensor
    ) -> Any:
        """x [b, s, d], cos/sin [b, s, rd], doc_ids [b, s] (or the block mask from
        `Attention.mask`) or None, then the `extra` inputs (see the class) -> [b, s, d], or the
        tuple of the class's outputs (a MoE block's router statistics [2E + 2], see moe.py)."""
        ple = extra[0] if self.per_layer is not None else None
        kv = tuple(extra[1:] if self.per_layer is not None else extra) or None
        if self.kind == "linear":
            out = self._residuals(x, lambda n: self.attention(n, cos, sin, doc_ids), ple)
        else:
            out = self._residuals(x, lambda n: self.attention(n, cos, sin, doc_ids, kv), ple)
        return out[0] if len(out) == 1 else out

    def forward_cached(
        self,
        x: Tensor,
        cos: Tensor,
        sin: Tensor,
        cache: KVCache,
        layer: int,
        ple: Tensor | None = None,
    ) -> Tensor:
        """`forward` for incremental decoding with a KV cache (see `Attention.forward_cached`)."""
        return self._residuals(
            x, lambda n: self.attention.forward_cached(n, cos, sin, cache, layer), ple
        )[0]


class PerLayerInput(nn.Module):
    """The per-layer input of one block: h -> norm(up(act(gate(h)) * ple)), added to the
    residual (gate [p, d], up [d, p]; the block's per-layer input ple [b, s, p])."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.gate = nn.Linear(args.dim, args.ple_dim, bias=False)
        self.up = nn.Linear(args.ple_dim, args.dim, bias=False)
        self.norm = norm_for(args, args.dim)
        self.activation = args.activation

    def forward(self, h: Tensor, ple: Tensor) -> Tensor:
        g = self.gate(h)
        g = F.silu(g) if self.activation == "silu" else F.gelu(g, approximate="tanh")
        return self.norm(self.up(g * ple))


def rounded(value: float, dtype: torch.dtype) -> float:
    """`value` as a float32 tensor converted to `dtype` would hold it (round to nearest even),
    as a Python float: the embedding scales, which HF keeps as tensors in the weights'
    dtype. In plain Python, so a compiled graph takes it as a constant (no .item()), and the
    constant is already exact in `dtype` (a compiler need not round it)."""
    f32 = struct.unpack("<f", struct.pack("<f", value))[0]
    if dtype == torch.float16:
        return struct.unpack("<e", struct.pack("<e", f32))[0]
    if dtype == torch.bfloat16:
        bits = struct.unpack("<I", struct.pack("<f", f32))[0]
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        return struct.unpack("<f", struct.pack("<I", bits))[0]
    return f32 if dtype == torch.float32 else value


class PerLayerInputs(nn.Module):
    """The per-layer inputs of every block [b, s, L, p], from the tokens (an embedding
    of L * p per token, times sqrt(p)) and the embedded tokens (projected, times d**-0.5, then
    RMS-normed per layer), summed and scaled by 2**-0.5."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.n_layers, self.width, self.dim = args.n_layers, args.ple_dim, args.dim
        pad = args.pad_id if args.pad_id is not None and args.pad_id < args.ple_vocab else None
        self.embed = nn.Embedding(args.ple_vocab, args.n_layers * args.ple_dim, padding_idx=pad)
        self.projection = nn.Linear(args.dim, args.n_layers * args.ple_dim, bias=False)
        self.norm = norm_for(args, args.ple_dim)

    def forward(self, tokens: Tensor, h: Tensor) -> Tensor:
        """tokens [b, s], the embedded tokens h [b, s, d] -> [b, s, L, p]."""
        shape = (*tokens.shape, self.n_layers, self.width)
        own = self.embed(tokens) * rounded(self.width**0.5, h.dtype)
        proj = self.projection(h) * self.dim**-0.5
        return (self.norm(proj.reshape(shape)) + own.reshape(shape)) * 2**-0.5


class Transformer(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim, padding_idx=args.pad_id)
        # every block's per-layer input, made once from the tokens
        self.per_layer_inputs = PerLayerInputs(args) if args.ple_dim else None
        self.layers = nn.ModuleList(TransformerBlock(args, i) for i in range(args.n_layers))
        self.norm = norm_for(args, args.dim)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        self.seq: SeqShards | None = None  # context parallelism (seq_parallel.py)
        self.tie_weights()

    def tie_weights(self) -> None:
        """Make `output.weight` the embedding tensor when tied. Call again after `to_empty`,
        which gives every module its own fresh tensor."""
        if self.args.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight

    @torch.no_grad()
    def init_weights(
        self,
        std: float = 0.02,
        generator: torch.Generator | None = None,
        modules: list[nn.Module] | None = None,
        fill_normal: Callable[[Tensor, float], None] | None = None,
    ) -> None:
        """Normal(0, std) for linear and embedding weights, zeros for biases, ones for norms.

        Modules are visited in a fixed order and a tied tensor is drawn once, so a seeded
        `generator` gives the same weights every time. When the generator lives on another
        device than the weights, values are drawn there in fp32 and copied over.
        `modules`: only these (and their children); calling it on consecutive parts of the model
        in order with one generator draws the same values as one call on the whole.
        `fill_normal(p, std)`: fills p in place instead of the generator (the trainer's hashed draws,
        `compiletune.weight_init`, which any FSDP shard draws for itself).
        """
        seen: set[int] = set()

        def normal_(p: Tensor) -> None:
            if id(p) in seen or p.is_meta:
                return
            seen.add(id(p))
            if fill_normal is not None:
                fill_normal(p, std)
            elif generator is None or generator.device == p.device:
                p.normal_(0.0, std, generator=generator)
            else:
                draw = torch.empty(p.shape, dtype=torch.float32, device=generator.device)
                p.copy_(draw.normal_(0.0, std, generator=generator))

        roots = [self] if modules is None else modules
        for module in (m for root in roots for m in root.modules()):
            if isinstance(module, nn.Embedding):
                normal_(module.weight)
            elif isinstance(module, nn.Linear):
                normal_(module.weight)
                if module.bias is not None:
                    module.bias.zero_()
            elif isinstance(module, RMSNorm | GatedRMSNorm):
                module.reset_parameters()
            elif isinstance(module, nn.Conv1d):
                normal_(module.weight)
            elif isinstance(module, GatedDeltaNet):
                module.dt_bias.fill_(1.0)
                module.A_log.zero_()  # a decay of softplus(.) per token to start from
            elif isinstance(module, Experts):
                normal_(module.w13)
                normal_(module.w2)
                for bias in (module.b13, module.b2):
                    if bias is not None:
                        bias.zero_()
            elif isinstance(module, Attention) and module.sinks is not None:
                module.sinks.zero_()
            elif isinstance(module, MoE):
                module.reset_parameters()
            elif isinstance(module, TransformerBlock) and module.scalar is not None:
                module.scalar.fill_(1.0)

    def hidden_states(
        self,
        tokens: Tensor,
        positions: Tensor | None = None,
        doc_ids: Tensor | None = None,
        router_stats: list[Tensor] | None = None,
        documents: tuple[Tensor, int] | None = None,
        images: Any = None,
    ) -> Tensor:
        """tokens [b, s] (int) -> final-normed hidden states [b, s, d].

        positions [b, s] default to 0..s-1 for every row. doc_ids [b, s] (packed rows: 0, 1, 2
        ... per document) confine attention to each document; pass positions that restart at
        each document with them, and every document is computed exactly as if alone. Every
        block gets the same inputs (h, cos, sin, doc_ids), so one compiled graph serves all.
        MoE blocks' router statistics are appended to `router_stats` when it is given.
        `documents`: doc_ids' `cu_seqlens`, built on the host before the batch was copied; on
        CUDA the layers whose mask is documents only then run varlen flash attention.

        Under context parallelism (`seq`, see seq_parallel.py) tokens and positions are this
        rank's piece of each row and doc_ids the whole row's. `images` (an `ImageInputs`) go to a
        vision-language model's tower (models/vision/model.py); doc_ids may then be its
        `ImageBlocks`.
        """
        h, ple = self.inputs(tokens, images)  # [b, s, d], per-layer inputs or None
        b, s = tokens.shape
        if positions is None:
            positions = torch.arange(s, device=tokens.device)[None]  # [1, s]
            if self.seq is not None:
                positions = self.seq.positions(s, tokens.device)
        ropes = self.ropes(positions, h.dtype)
        shape = (b, s * (self.seq.size if self.seq is not None else 1))  # the whole rows
        # FlexAttention block masks, one per window size, and the batch's varlen documents
        shared_masks = shared_masks_for(documents, doc_ids, tokens.device, h.dtype)
        shared_kv: dict[str, tuple[Tensor, ...]] = {}  # a "store" layer's, per kind
        for i, layer in enumerate(self.layers):
            mask = layer.attention.mask(doc_ids, shape, tokens.device, shared_masks)
            extra = () if ple is None else (ple[:, :, i],)
            if layer.kv_mode == "reuse":
                extra += shared_kv[layer.kind]
            out = layer(h, *ropes[layer.kind], mask, *extra)
            if not isinstance(out, tuple):
                h = out
                continue
            h, rest = out[0], out[1:]
            if layer.moe:
                if router_stats is not None:
                    router_stats.append(rest[0])
                rest = rest[1:]
            if layer.kv_mode == "store":
                shared_kv[layer.kind] = rest
        return self.norm(h)

    def inputs(self, tokens: Tensor, images: Any = None) -> tuple[Tensor, Tensor | None]:
        """The first block's input [b, s, d] and the per-layer inputs (None without them)."""
        if images is not None:
            raise ValueError("images were given to a text model; load the checkpoint for vision")
        h = self.embed(tokens)
        return h, self.per_layer_inputs(tokens, h) if self.per_layer_inputs is not None else None

    def embed(self, tokens: Tensor) -> Tensor:
        """tokens [b, s] -> [b, s, d], times sqrt(dim) rounded to the dtype when the family
        scales embeddings (as HF: the scale is a tensor in the weight's dtype)."""
        h = self.tok_embeddings(tokens)
        if self.args.embed_scale:
            h = h * rounded(self.args.dim**0.5, h.dtype)
        return h

    def ropes(
        self, positions: Tensor, dtype: torch.dtype, rowwise: bool = False
    ) -> dict[str, tuple[Tensor, Tensor]]:
        """(cos, sin) per layer kind present, each [b, s, rd] (`rowwise`: see rope_cos_sin)."""
        kinds = {layer.kind for layer in self.layers}
        return {kind: rope_cos_sin(self.args, positions, dtype, kind, rowwise) for kind in kinds}

    def forward(
        self,
        tokens: Tensor,
        positions: Tensor | None = None,
        doc_ids: Tensor | None = None,
        images: Any = None,
    ) -> Tensor:
        """tokens [b, s] -> logits [b, s, v] in the parameter dtype (soft-capped when the
        family caps them); `images`: see `hidden_states`."""
        return self.logits(self.hidden_states(tokens, positions, doc_ids, images=images))

    def logits(self, h: Tensor) -> Tensor:
        """Final hidden [.., d] -> logits [.., v]: the head, then the final soft-cap if any."""
        logits = self.output(h)
        cap = self.args.final_softcap
        return cap * torch.tanh(logits / cap) if cap else logits

    def hidden_states_cached(self, tokens: Tensor, cache: KVCache, images: Any = None) -> Tensor:
        """Inference: tokens [b, s] following the `cache.length` cached ones -> hidden [b, s, d].

        The same blocks and weights as `hidden_states`, at positions cache.length .. + s - 1;
        the tokens' keys and values are appended to `cache`. The training path is untouched.
        `images`: a prompt's, for a vision-language model's prefill (models/vision/model.py).
        """
        positions = self.cached_positions(tokens, cache, images)
        h, ple = self.inputs(tokens, images)  # [b, s, d], per-layer inputs or None
        ropes = self.ropes(positions, h.dtype, rowwise=cache.lengths is not None)
        for i, layer in enumerate(self.layers):
            mine = None if ple is None else ple[:, :, i]
            h = layer.forward_cached(h, *ropes[layer.kind], cache, i, mine)
        if cache.lengths is not None:
            cache.lengths.add_(1)
        else:
            cache.length += tokens.shape[1]
        return self.norm(h)

    def cached_positions(self, tokens: Tensor, cache: KVCache, images: Any = None) -> Tensor:
        """The positions of `tokens` after the cached ones: [1, s], or [b, 1] per row."""
        start, s = cache.length, tokens.shape[1]
        if cache.lengths is not None:  # rows of their own lengths: one token each, in place
            if s != 1:
                raise ValueError(f"a cache with per-row lengths decodes 1 token a step, not {s}")
            positions = cache.lengths[:, None]  # [b, 1]
        elif start + s > cache.max_len:
            raise ValueError(f"KV cache of {cache.max_len} positions cannot take {start + s}")
        else:
            positions = torch.arange(start, start + s, device=tokens.device)[None]  # [1, s]
        return positions


def build_model(
    args: ModelArgs,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    init: bool = True,
    seed: int = 0,
    on_block: Callable[[TransformerBlock], None] | None = None,
) -> Transformer:
    """Build on the meta device, allocate on `device` in `dtype`, tie, and (if `init`) draw
    weights from a generator seeded with `seed`. Without `init` the weights are uninitialised
    memory, for callers that load a checkpoint next.

    `on_block(block)` is called on each block as soon as its weights exist, before the next one
    is allocated: a caller that shrinks blocks (QLoRA quantizes them) never holds the whole model
    at full size. The weights drawn are the same with or without it."""
    with torch.device("meta"):
        model = Transformer(args)
    model.to(dtype)  # free on meta; avoids allocating fp32 then casting
    draw = init and torch.device(device).type != "meta"
    generator = None
    if draw:
        generator = torch.Generator(device=device)
        generator.manual_seed(seed)
    # Parts in init_weights' visiting order: embedding(s), blocks, final norm and head.
    head = [model.norm] if args.tie_embeddings else [model.norm, model.output]
    embeddings = [model.tok_embeddings]
    if model.per_layer_inputs is not None:
        embeddings.append(model.per_layer_inputs)
    for part in [embeddings, *[[b] for b in model.layers], head]:
        for module in part:
            module.to_empty(device=device)
        model.tie_weights()
        if draw:
            model.init_weights(generator=generator, modules=part)
        if on_block is not None and isinstance(part[0], TransformerBlock):
            on_block(part[0])
    return model
