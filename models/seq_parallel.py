"""Context parallelism's exchange: one sequence split over ranks, attention over all of it.

With `--cp N` each of N ranks holds N-th of every row's tokens (rank r: the r-th contiguous
piece). Everything but attention works token by token, so embeddings, norms, MLPs, experts and
the loss head run on the local piece as they are. Attention needs every earlier token, so
around it the ranks swap which dimension they split (all-to-all over heads, "Ulysses"):

    q, k, v [b, h, s/N, hd]  --to_heads-->  [b, h/N, s, hd]   (the whole sequence, h/N heads)
    attention (any kernel: documents, windows, soft-caps, sinks as in one process)
    out [b, h/N, s, hd]  --to_sequence-->  [b, h, s/N, hd]

Why heads rather than a ring of key/value blocks: each rank then runs the unchanged attention
kernels over the whole sequence, so document masks, sliding windows, soft-caps and sinks are
exact with no new kernel and no load balancing (a causal ring gives the last piece the most
work; here every rank does 1/N of the same attention). The price: N must divide the heads,
and each exchange moves q, k, v and the output once (4 x tokens x width / N per rank per layer).

`SeqShards.group` None is the memory estimate's stand-in: the same shapes, no communication.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from compiletune.errors import UserError
from compiletune.torch_internals import all_to_all_autograd

from .args import ModelArgs
from .rope import rope_type


class SeqShards:
    """This rank's place among the `size` ranks that share each sequence."""

    def __init__(self, size: int, rank: int, group: Any = None):
        self.size, self.rank, self.group = size, rank, group

    def positions(self, s: int, device: torch.device) -> Tensor:
        """[1, s] positions of this rank's piece of s tokens in an unsplit row."""
        return torch.arange(self.rank * s, (self.rank + 1) * s, device=device)[None]

    def piece(self, t: Tensor) -> Tensor:
        """This rank's piece of a [b, S, ...] tensor along the sequence."""
        s = t.shape[1] // self.size
        return t[:, self.rank * s : (self.rank + 1) * s]

    def heads(self, t: Tensor) -> Tensor:
        """This rank's heads of a per-head [h] tensor (attention sinks)."""
        return t.view(self.size, -1)[self.rank]

    def to_heads(self, t: Tensor) -> Tensor:
        """[b, h, s, hd] (local tokens, every head) -> [b, h/N, N*s, hd] (every token, this
        rank's heads: the r-th group of h/N)."""
        b, h, s, hd = t.shape
        n = self.size
        parts = t.reshape(b, n, h // n, s, hd).transpose(0, 1)  # [N (to rank), b, h/N, s, hd]
        got = self._exchange(parts)  # [N (from rank = sequence piece), b, h/N, s, hd]
        return got.permute(1, 2, 0, 3, 4).reshape(b, h // n, n * s, hd)

    def to_sequence(self, t: Tensor) -> Tensor:
        """The inverse of `to_heads`: [b, h/N, N*s, hd] -> [b, h, s, hd]."""
        b, hl, total, hd = t.shape
        n = self.size
        s = total // n
        parts = t.reshape(b, hl, n, s, hd).permute(2, 0, 1, 3, 4)  # [N (to rank), b, h/N, s, hd]
        got = self._exchange(parts)  # [N (from rank = head group), b, h/N, s, hd]
        return got.transpose(0, 1).reshape(b, n * hl, s, hd)

    def total(self, t: Tensor) -> Tensor:
        """The sum of `t` over the group's ranks (per-sequence sums of a row's pieces), with
        the gradient flowing back to every rank's piece."""
        if self.group is None:
            return t.clone()
        from torch.distributed.nn.functional import all_reduce  # distributed-only autograd

        return all_reduce(t, group=self.group)

    def _exchange(self, parts: Tensor) -> Tensor:
        if self.group is None:  # the estimate: a new tensor of the same shape
            return parts.contiguous().clone()
        return all_to_all_autograd(parts.contiguous(), self.group)


def unsplittable(args: ModelArgs, n: int, world: int) -> str | None:
    """Why `args`' model cannot split its rows over n of `world` ranks (None: it can)."""
    if world % n:
        return f"must divide the {world} processes"
    if args.n_heads % n:
        return f"must divide the model's {args.n_heads} attention heads"
    linear = [i for i in range(args.n_layers) if args.layer_kind(i) == "linear"]
    if linear:
        return (
            f"cannot split the recurrence of the model's {len(linear)} linear-attention layers "
            f"(of {args.n_layers}; Gated DeltaNet, as in Qwen3.5 and Qwen3-Next), which runs "
            "through each whole row; drop --cp (--fsdp alone shards the model, not the rows)"
        )
    if any(rope_type(args, args.layer_kind(i)) == "longrope" for i in range(args.n_layers)):
        # longrope picks its factors from the longest position in view, which differs by piece
        return (
            "cannot split a longrope model's rows (Phi-3.5, Phi-4-mini): each piece would pick "
            "its own rope factors"
        )
    return None


def split_sequence(model: torch.nn.Module, shards: SeqShards | None) -> None:
    """Make `model` (a Transformer) run on this rank's piece of each row: its attention
    layers exchange around attention, its default positions are the piece's. None undoes it."""
    for module in model.modules():
        if hasattr(module, "seq"):
            module.seq = shards


def check_splittable(n: int, world: int, args: ModelArgs, teacher: ModelArgs | None) -> None:
    """With --cp n > 1, refuse (one line) a model, or a KD teacher, whose rows cannot be split
    over n of `world` ranks (a DPO reference is a copy of the model)."""
    if n == 1:
        return
    if why := unsplittable(args, n, world):
        raise UserError(f"--cp {n} {why}")
    if teacher is not None and (why := unsplittable(teacher, n, n)):
        raise UserError(f"--cp {n}: the teacher {why}")
