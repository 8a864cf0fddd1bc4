"""`KVCache`: what generation keeps per layer between decode steps."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from .args import ModelArgs
from .attention import visible


class KVCache:
    """Keys and values of the tokens decoded so far, for generation without recomputing them.

    k[i], v[i]: [b, n_kv_heads, max_len, hd] for attention layer i (kv heads, before the GQA
    expansion, so the cache is n_heads / n_kv_heads times smaller), or for MLA (models/mla.py)
    the latent [b, 1, max_len, kv_rank] and the rope key [b, 1, max_len, rotary_dim]; a linear-attention layer
    keeps conv[i] and state[i] instead (models/linear_attention.py); the first `length` positions are
    filled. Lives beside the model: the model itself stays parameters only.

    Rows of different lengths (a batch of prompts of different lengths, decoded together):
    after each row's prefill, `lengths` [b] holds each row's filled positions. A decode step
    then writes each row's new key at its own position and attends over the whole static
    `max_len` under a mask, so the step's shapes never change (one compiled graph, one CUDA
    graph for a rollout: `compiletune/rl/rollout.py`).
    """

    def __init__(
        self,
        args: ModelArgs,
        batch: int,
        max_len: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        kinds = [args.layer_kind(i) for i in range(args.n_layers)]
        linear = [kind == "linear" for kind in kinds]
        none = torch.zeros(0, dtype=dtype, device=device)
        # a "reuse" layer reads the cache of the "store" layer of its kind
        self.source = [args.kv_source(i) for i in range(args.n_layers)]
        own = [not lin and self.source[i] == i for i, lin in enumerate(linear)]

        def kv(i: int, width: int) -> Tensor:
            shape = (batch, args.kv_heads_of(kinds[i]), max_len, width)
            if args.kv_rank:  # MLA: the latent (k) and the rope key (v), one "head" each
                shape = (batch, 1, max_len, width)
            return torch.zeros(shape, dtype=dtype, device=device) if own[i] else none

        k_width = [args.kv_rank or args.head_dim_of(kind) for kind in kinds]
        v_width = [args.rotary_dim if args.kv_rank else args.head_dim_of(kind) for kind in kinds]
        self.k = [kv(i, k_width[i]) for i in range(args.n_layers)]
        self.v = [kv(i, v_width[i]) for i in range(args.n_layers)]
        # linear-attention layers: the convolution's last inputs and the recurrent state (fp32)
        conv = (batch, args.linear_conv - 1, 2 * args.linear_k_heads * args.linear_k_dim)
        conv = (*conv[:2], conv[2] + args.linear_v_heads * args.linear_v_dim)
        state = (batch, args.linear_v_heads, args.linear_k_dim, args.linear_v_dim)
        self.conv = [
            torch.zeros(conv, dtype=dtype, device=device) if lin else none for lin in linear
        ]
        self.state = [
            torch.zeros(state, dtype=torch.float32, device=device) if lin else none
            for lin in linear
        ]
        self.max_len = max_len
        self.length = 0
        self.lengths: Tensor | None = None
        # a vision-language prompt (models/vision/model.py): its image mask for the prefill
        # (`ImageBlocks`), and how far Qwen3.5's 3-D positions run ahead of the token count
        self.images: Any = None
        self.position_offset: Tensor | int = 0

    def sized(self) -> list[tuple[Tensor, tuple[int, ...]]]:
        """Every buffer the cache holds (what a decode step reads and writes in place), each
        with its dimensions that vary from batch to batch: rows, and the keys' positions."""
        every = [(t, (0, 2)) for t in (*self.k, *self.v)]
        every += [(t, (0,)) for t in (*self.conv, *self.state)]
        if self.lengths is not None:
            every.append((self.lengths, (0,)))
        return [(t, dims) for t, dims in every if t.numel()]

    @property
    def prefill(self) -> bool:
        """Nothing cached yet and every row at position 0: a prompt's first pass."""
        return self.lengths is None and self.length == 0

    def write(self, layer: int, k: Tensor, v: Tensor) -> None:
        """Store layer `layer`'s keys and values of the new tokens, k, v [b, heads, s, w]: at
        positions `length` .. + s - 1 of every row, or, with per-row `lengths` (one token a
        step), each row's at its own position (a scatter: the static cache keeps its storage)."""
        if self.lengths is None:
            end = self.length + k.shape[2]
            self.k[layer][:, :, self.length : end] = k
            self.v[layer][:, :, self.length : end] = v
            return
        at = self.lengths.view(-1, 1, 1, 1)
        self.k[layer].scatter_(2, at.expand_as(k), k)
        self.v[layer].scatter_(2, at.expand_as(v), v)

    def read(self, layer: int, s: int) -> tuple[Tensor, Tensor]:
        """The keys and values of layer `layer` that `s` new tokens (written) attend over: the
        filled positions, or with per-row `lengths` the whole static cache (see `seen`)."""
        if self.lengths is not None:
            return self.k[layer], self.v[layer]
        end = self.length + s
        return self.k[layer][:, :, :end], self.v[layer][:, :, :end]

    def seen(self, keys: Tensor, s: int, window: int) -> Tensor | None:
        """Which of `keys` (`read`'s, [b, heads, n, w]) each of `s` new tokens sees (causal,
        within `window` when > 0): [b, 1, 1, n] per row with `lengths`, else [s, n]; None when
        one new token sees every key. (n is read from `keys`, not `max_len`: a compiled step
        takes it as a size, not as a constant to guard on.)"""
        n = keys.shape[2]
        if self.lengths is not None:
            kj = torch.arange(n, device=keys.device)
            qi = self.lengths.view(-1, 1, 1, 1)
            ok = kj <= qi
            return ok & (qi - kj < window) if window > 0 else ok
        if s == 1 and window <= 0:
            return None
        return visible(self.length, self.length + s, 0, n, window, keys.device)

    def rows(self, start: int, stop: int) -> KVCache:
        """A cache over rows start..stop-1 of this one (views: what is written through it lands
        here), empty (length 0), for prefilling those rows alone."""
        view = object.__new__(KVCache)
        view.source, view.max_len, view.length, view.lengths = self.source, self.max_len, 0, None
        view.images, view.position_offset = None, 0  # a text prefill (as __init__ sets them)
        for name in ("k", "v", "conv", "state"):
            setattr(view, name, [t[start:stop] if t.numel() else t for t in getattr(self, name)])
        return view

    def spread(self, row: int, count: int) -> None:
        """Copy row `row` into the `count - 1` rows after it (a prompt prefilled once, then
        sampled `count` times)."""
        for name in ("k", "v", "conv", "state"):
            for t in getattr(self, name):
                if t.numel():
                    t[row + 1 : row + count] = t[row : row + 1]
