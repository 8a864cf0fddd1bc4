"""The decoder's attention mask around images: an image's tokens see each other.

Gemma 3 (every layer) and Gemma 4 (its sliding layers, where its config says "vision") let the
tokens of one image attend to each other in both directions, as transformers' masks do: a
query sees a key when it is causal or both are tokens of the same run of image tokens, and
(sliding layers) the key lies within the window before the query. With packed rows both must
also be in the same document.

The decoder passes an `ImageBlocks` where it would pass `doc_ids`; each attention layer turns
it into a dense boolean mask [b, 1, s, s] for its window (`Attention.mask`, kept per window for
the other layers) and `causal_attention` runs SDPA with that mask.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor


def image_runs(tokens: Tensor, image_token_id: int) -> Tensor:
    """[b, s] -> [b, s] long: for each image token, the index of its run of consecutive image
    tokens within its row (0, 1, ...); -1 for every other token."""
    is_image = tokens == image_token_id
    before = F.pad(is_image, (1, 0), value=False)[:, :-1]
    runs = torch.cumsum((is_image & ~before).long(), dim=1) - 1
    return torch.where(is_image, runs, torch.full_like(runs, -1))


class ImageBlocks(NamedTuple):
    """What the decoder's layers take as their mask when images' tokens see each other."""

    runs: Tensor  # [b, s] long: `image_runs`
    kinds: tuple[str, ...]  # the layer kinds in which they do (others: causal only)
    doc_ids: Tensor | None = None  # [b, s] packed rows' documents

    def dense(self, window: int, kind: str) -> Tensor:
        """[b, 1, s, s] bool: query i sees key j, for a layer of `kind` and `window` (0: none)."""
        s = self.runs.shape[1]
        device = self.runs.device
        qi = torch.arange(s, device=device)[:, None]
        kj = torch.arange(s, device=device)[None, :]
        ok = (kj <= qi)[None]  # [1, s, s]
        if kind in self.kinds:
            same = self.runs[:, :, None] == self.runs[:, None, :]
            ok = ok | (same & (self.runs[:, :, None] >= 0))
        if window > 0:
            ok = ok & (qi - kj < window)[None]
        if self.doc_ids is not None:
            ok = ok & (self.doc_ids[:, :, None] == self.doc_ids[:, None, :])
        return ok[:, None]


def masked_attention(
    q: Tensor, k: Tensor, v: Tensor, scale: float, mask: Tensor, softcap: float = 0.0
) -> Tensor:
    """q, k, v [b, h, s, hd] and a boolean mask [b, 1, s, s] -> [b, h, s, hd] (scores
    soft-capped at `softcap` when > 0)."""
    if softcap <= 0:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    scores = (q.float() @ k.float().transpose(-1, -2)) * scale
    scores = softcap * torch.tanh(scores / softcap)
    scores = scores.masked_fill(~mask, float("-inf"))
    return (torch.softmax(scores, dim=-1) @ v.float()).to(q.dtype)


def is_dense_mask(mask: object) -> bool:
    """Is `mask` (what a layer got as its doc_ids) a dense boolean mask from `ImageBlocks`?"""
    return isinstance(mask, Tensor) and mask.dtype == torch.bool and mask.dim() == 4
