"""One decoder for every supported family (Llama 2/3/3.x, Qwen2.5, Mistral).

The families differ only in data (`ModelArgs`): sizes, GQA ratio, rope base and scaling, q/k/v
bias (Qwen2) and tied embeddings. Parameter layout follows the HF checkpoints, including the
"rotate_half" rope convention, so HF weights load by renaming alone (see `hf.py`).

Shapes: b = batch, s = sequence, d = dim, h = n_heads, k = n_kv_heads, hd = head dim, v = vocab.

The model holds parameters only, no buffers: it is built on the meta device and materialised
later, and rope cos/sin are recomputed from `args` in `forward`, so every block is the same
module with the same inputs (one compiled graph serves all of them).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .attention import causal_attention


@dataclass
class RopeScaling:
    """Llama-3.1 rope frequency scaling (HF rope_type "llama3")."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclass
class ModelArgs:
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    vocab_size: int
    ffn_dim: int
    # None -> dim // n_heads (canonical: set only when it differs; read it through `hd`)
    head_dim: int | None = None
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    max_seq_len: int = 4096  # HF max_position_embeddings
    qkv_bias: bool = False  # Qwen2
    tie_embeddings: bool = False
    # Only recorded: the model attends to the full causal context, which equals sliding-window
    # attention while seq_len <= sliding_window.
    sliding_window: int | None = None
    family: str = "llama"  # "llama" | "qwen2" | "mistral": the HF architecture save_hf writes

    @property
    def hd(self) -> int:
        """Resolved head dimension."""
        return self.head_dim if self.head_dim is not None else self.dim // self.n_heads


def rope_inv_freq(args: ModelArgs, device: torch.device | str | None = None) -> Tensor:
    """Rope inverse frequencies [hd // 2] in fp32, with Llama-3.1 scaling when configured.

    Computed in the same order of fp32 operations as HF so that cos/sin match bit for bit.
    """
    hd = args.hd
    exponent = torch.arange(0, hd, 2, dtype=torch.int64, device=device).float() / hd
    inv_freq = 1.0 / (args.rope_theta**exponent)
    rs = args.rope_scaling
    if rs is None:
        return inv_freq
    # Llama 3.1: keep high frequencies (wavelength < original_ctx / high_freq_factor), divide low
    # frequencies (wavelength > original_ctx / low_freq_factor) by `factor`, and interpolate
    # smoothly in between.
    low_freq_wavelen = rs.original_max_position_embeddings / rs.low_freq_factor
    high_freq_wavelen = rs.original_max_position_embeddings / rs.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / rs.factor, inv_freq)
    smooth = (rs.original_max_position_embeddings / wavelen - rs.low_freq_factor) / (
        rs.high_freq_factor - rs.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / rs.factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def rope_cos_sin(args: ModelArgs, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """cos, sin [b, s, hd] for integer `positions` [b, s], math in fp32, cast to `dtype`."""
    inv_freq = rope_inv_freq(args, positions.device)
    freqs = positions[..., None].float() * inv_freq  # [b, s, hd // 2]
    # rotate_half layout: the two halves of a head share frequencies.
    emb = torch.cat((freqs, freqs), dim=-1)  # [b, s, hd]
    return emb.cos().to(dtype), emb.sin().to(dtype)


def rotate_half(x: Tensor) -> Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x [b, heads, s, hd], cos/sin [b, s, hd] -> [b, heads, s, hd]."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return x * cos + rotate_half(x) * sin


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        # Same op order as HF LlamaRMSNorm (fp32 statistics, cast back before the weight) so bf16
        # runs round identically.
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)


class Attention(nn.Module):
    """Causal grouped-query attention with rope."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.n_heads = args.n_heads
        self.n_kv_heads = args.n_kv_heads
        self.head_dim = args.hd
        self.wq = nn.Linear(args.dim, args.n_heads * self.head_dim, bias=args.qkv_bias)
        self.wk = nn.Linear(args.dim, args.n_kv_heads * self.head_dim, bias=args.qkv_bias)
        self.wv = nn.Linear(args.dim, args.n_kv_heads * self.head_dim, bias=args.qkv_bias)
        self.wo = nn.Linear(args.n_heads * self.head_dim, args.dim, bias=False)

    def _qkv(self, x: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """x [b, s, d] -> q [b, h, s, hd], k and v [b, k, s, hd], rope applied to q and k."""
        b, s, _ = x.shape
        h, k, hd = self.n_heads, self.n_kv_heads, self.head_dim
        q = self.wq(x).view(b, s, h, hd).transpose(1, 2)  # [b, h, s, hd]
        kk = self.wk(x).view(b, s, k, hd).transpose(1, 2)  # [b, k, s, hd]
        v = self.wv(x).view(b, s, k, hd).transpose(1, 2)  # [b, k, s, hd]
        return apply_rope(q, cos, sin), apply_rope(kk, cos, sin), v

    def _repeat_kv(self, t: Tensor) -> Tensor:
        """[b, k, s, hd] -> [b, h, s, hd]: kv head j serves query heads j*n_rep .. (j+1)*n_rep-1
        (HF repeat_kv). Expanded explicitly rather than via SDPA's enable_gqa, which not every
        backend supports."""
        b, k, s, hd = t.shape
        if k == self.n_heads:
            return t
        n_rep = self.n_heads // k
        return t[:, :, None].expand(b, k, n_rep, s, hd).reshape(b, self.n_heads, s, hd)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, doc_ids: Tensor | None = None) -> Tensor:
        """x [b, s, d], cos/sin [b, s, hd], doc_ids [b, s] or None -> [b, s, d].

        With `doc_ids`, a token attends only to earlier tokens of its own document.
        """
        b, s, _ = x.shape
        q, kk, v = self._qkv(x, cos, sin)
        kk, v = self._repeat_kv(kk), self._repeat_kv(v)  # [b, h, s, hd]
        out = causal_attention(q, kk, v, self.head_dim**-0.5, doc_ids)  # [b, h, s, hd]
        out = out.transpose(1, 2).reshape(b, s, -1)  # [b, s, h * hd]
        return self.wo(out)

    def forward_cached(
        self, x: Tensor, cos: Tensor, sin: Tensor, cache: KVCache, layer: int
    ) -> Tensor:
        """Inference: x [b, s, d] are the tokens after the `cache.length` cached ones.

        Their keys and values are written into the cache; each new token attends to every
        cached token and to the new ones up to itself.
        """
        b, s, _ = x.shape
        q, kk, v = self._qkv(x, cos, sin)
        start, end = cache.length, cache.length + s
        cache.k[layer][:, :, start:end] = kk
        cache.v[layer][:, :, start:end] = v
        keys = self._repeat_kv(cache.k[layer][:, :, :end])  # [b, h, end, hd]
        values = self._repeat_kv(cache.v[layer][:, :, :end])
        scale = self.head_dim**-0.5
        if start == 0:  # the prompt: ordinary causal attention
            out = F.scaled_dot_product_attention(q, keys, values, is_causal=True, scale=scale)
        else:
            # new token i sits at position start + i and sees keys 0 .. start + i: [s, end]
            visible = (
                torch.arange(end, device=x.device)[None, :]
                <= torch.arange(start, end, device=x.device)[:, None]
            )
            out = F.scaled_dot_product_attention(q, keys, values, attn_mask=visible, scale=scale)
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x). w1 = gate, w3 = up, w2 = down."""

    def __init__(self, dim: int, ffn_dim: int):
        super().__init__()
        self.w1 = nn.Linear(dim, ffn_dim, bias=False)
        self.w2 = nn.Linear(ffn_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, ffn_dim, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        """x [b, s, d] -> [b, s, d] (hidden [b, s, ffn_dim])."""
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    """Pre-norm residual block: x + attn(norm(x)), then h + ffn(norm(h))."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.attention = Attention(args)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)
        self.feed_forward = FeedForward(args.dim, args.ffn_dim)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, doc_ids: Tensor | None = None) -> Tensor:
        """x [b, s, d], cos/sin [b, s, hd], doc_ids [b, s] or None -> [b, s, d]."""
        h = x + self.attention(self.attention_norm(x), cos, sin, doc_ids)
        return h + self.feed_forward(self.ffn_norm(h))

    def forward_cached(
        self, x: Tensor, cos: Tensor, sin: Tensor, cache: KVCache, layer: int
    ) -> Tensor:
        """`forward` for incremental decoding with a KV cache (see `Attention.forward_cached`)."""
        h = x + self.attention.forward_cached(self.attention_norm(x), cos, sin, cache, layer)
        return h + self.feed_forward(self.ffn_norm(h))


class KVCache:
    """Keys and values of the tokens decoded so far, for generation without recomputing them.

    k[i], v[i]: [b, n_kv_heads, max_len, hd] for layer i (kv heads, before the GQA expansion,
    so the cache is n_heads / n_kv_heads times smaller); the first `length` positions are
    filled. Lives beside the model: the model itself stays parameters only.
    """

    def __init__(
        self,
        args: ModelArgs,
        batch: int,
        max_len: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        shape = (batch, args.n_kv_heads, max_len, args.hd)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(args.n_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(args.n_layers)]
        self.max_len = max_len
        self.length = 0


class Transformer(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleList(TransformerBlock(args) for _ in range(args.n_layers))
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
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
    ) -> None:
        """Normal(0, std) for linear and embedding weights, zeros for biases, ones for norms.

        Modules are visited in a fixed order and a tied tensor is drawn once, so a seeded
        `generator` gives the same weights every time. When the generator lives on another
        device than the weights, values are drawn there in fp32 and copied over.
        `modules`: only these (and their children); calling it on consecutive parts of the model
        in order with one generator draws the same values as one call on the whole.
        """
        seen: set[int] = set()

        def normal_(p: Tensor) -> None:
            if id(p) in seen or p.is_meta:
                return
            seen.add(id(p))
            if generator is None or generator.device == p.device:
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
            elif isinstance(module, RMSNorm):
                module.reset_parameters()

    def hidden_states(
        self, tokens: Tensor, positions: Tensor | None = None, doc_ids: Tensor | None = None
    ) -> Tensor:
        """tokens [b, s] (int) -> final-normed hidden states [b, s, d].

        positions [b, s] default to 0..s-1 for every row. doc_ids [b, s] (packed rows: 0, 1, 2
        ... per document) confine attention to each document; pass positions that restart at
        each document with them, and every document is computed exactly as if alone. Every
        block gets the same inputs (h, cos, sin, doc_ids), so one compiled graph serves all.
        """
        h = self.tok_embeddings(tokens)  # [b, s, d]
        if positions is None:
            positions = torch.arange(tokens.shape[1], device=tokens.device)[None]  # [1, s]
        cos, sin = rope_cos_sin(self.args, positions, h.dtype)  # [b, s, hd]
        for layer in self.layers:
            h = layer(h, cos, sin, doc_ids)
        return self.norm(h)

    def forward(
        self, tokens: Tensor, positions: Tensor | None = None, doc_ids: Tensor | None = None
    ) -> Tensor:
        """tokens [b, s] -> logits [b, s, v] in the parameter dtype."""
        return self.output(self.hidden_states(tokens, positions, doc_ids))

    def hidden_states_cached(self, tokens: Tensor, cache: KVCache) -> Tensor:
        """Inference: tokens [b, s] following the `cache.length` cached ones -> hidden [b, s, d].

        The same blocks and weights as `hidden_states`, at positions cache.length .. + s - 1;
        the tokens' keys and values are appended to `cache`. The training path is untouched.
        """
        start, s = cache.length, tokens.shape[1]
        if start + s > cache.max_len:
            raise ValueError(f"KV cache of {cache.max_len} positions cannot take {start + s}")
        h = self.tok_embeddings(tokens)  # [b, s, d]
        positions = torch.arange(start, start + s, device=tokens.device)[None]  # [1, s]
        cos, sin = rope_cos_sin(self.args, positions, h.dtype)
        for i, layer in enumerate(self.layers):
            h = layer.forward_cached(h, cos, sin, cache, i)
        cache.length += s
        return self.norm(h)


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
    # Parts in init_weights' visiting order: embedding, blocks, final norm and head.
    head = [model.norm] if args.tie_embeddings else [model.norm, model.output]
    for part in [[model.tok_embeddings], *[[b] for b in model.layers], head]:
        for module in part:
            module.to_empty(device=device)
        model.tie_weights()
        if draw:
            model.init_weights(generator=generator, modules=part)
        if on_block is not None and isinstance(part[0], TransformerBlock):
            on_block(part[0])
    return model
