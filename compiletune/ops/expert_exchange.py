"""Expert parallelism's token exchange: rows grouped by expert travel to the rank that holds
their expert and come back, through `all_to_all_single` with variable splits.

With N ranks in an expert-parallel group and E experts, rank r holds experts
[r * E/N, (r + 1) * E/N) whole. A MoE layer on rank r has sorted its (token, slot) pairs by
global expert ([n, d], `counts` [E] rows per expert); then

    ep_counts        counts of every rank of the group           [E] -> [N, E]  (all_gather)
    ep_rows          a [R, 0] placeholder whose size R is the rows this rank receives
    ep_to_experts    rows to their experts' ranks, reordered so that this rank's rows are
                     grouped by local expert (source ranks in order within one)  [n, d] -> [R, d]
    ep_from_experts  the reverse: expert outputs back to the ranks and order they came from
                                                                                 [R, d] -> [n, d]

Each of the two exchanges is the other's backward (the gradient of an all_to_all is the
reverse all_to_all), so autograd is exact. The split sizes reach the host once per layer per
direction: each op reads the [N, E] counts with `.tolist()` (a sync on a GPU) to build its
splits and permutation; forward and backward of a layer read the same counts. docs/moe.md says
why this and not padding every rank's share to a fixed capacity.

The ops are opaque to the compiler. R is data, so `ep_rows` makes it an unbacked size in a
compiled block: the grouped matmul and everything between the two exchanges is traced once
for any R (a placeholder of zero columns carries it, costing no memory, and lets each backward
know its output's row count without a second symbol).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor, nn

from compiletune.ops.op_memory import Args, declare_memory, holds_nothing

# Process groups by name: a custom op cannot take a ProcessGroup, so ops name theirs.
_GROUPS: dict[str, dist.ProcessGroup] = {}


def register_group(group: dist.ProcessGroup) -> str:
    """The name under which the exchange ops find `group`."""
    name = group.group_name
    _GROUPS[name] = group
    return name


def process_group(name: str) -> dist.ProcessGroup:
    """The group registered as `name`."""
    return _GROUPS[name]


def _plan(counts_all: Tensor, group: dist.ProcessGroup) -> tuple[list[int], list[int], Tensor]:
    """(rows this rank sends to each rank, rows it receives from each, the permutation taking
    the received buffer, grouped by source rank, to local-expert-major order)."""
    me, n = dist.get_rank(group), dist.get_world_size(group)
    c = counts_all.to("cpu", torch.int64)  # the host read: one per exchange
    e_local = c.shape[1] // n
    send = c[me].view(n, e_local).sum(dim=1).tolist()
    mine = c[:, me * e_local : (me + 1) * e_local]  # [source rank, local expert]
    recv = mine.sum(dim=1).tolist()
    # start of each (source, expert) run in the buffer, taken in (expert, source) order
    starts = (mine.flatten().cumsum(0) - mine.flatten()).view(n, e_local).t().flatten()
    lengths = mine.t().flatten()
    dest = lengths.cumsum(0) - lengths  # where each run starts in the expert-major output
    total = int(lengths.sum())
    perm = torch.arange(total) + torch.repeat_interleave(starts - dest, lengths)
    return send, recv, perm.to(counts_all.device)


@torch.library.custom_op("compiletune::ep_counts", mutates_args=())
def ep_counts(counts: Tensor, group: str) -> Tensor:
    """counts [E] of every rank of `group` -> [N, E] (row r: rank r's)."""
    g = _GROUPS[group]
    parts = [torch.empty_like(counts) for _ in range(dist.get_world_size(g))]
    dist.all_gather(parts, counts.contiguous(), group=g)
    return torch.stack(parts)


@ep_counts.register_fake
def _(counts: Tensor, group: str) -> Tensor:
    return counts.new_empty(dist.get_world_size(_GROUPS[group]), counts.shape[0])


@torch.library.custom_op("compiletune::ep_rows", mutates_args=())
def ep_rows(counts_all: Tensor, group: str) -> Tensor:
    """A [R, 0] tensor, R = rows this rank's experts receive (no storage: its shape is the
    message)."""
    g = _GROUPS[group]
    me, n = dist.get_rank(g), dist.get_world_size(g)
    e_local = counts_all.shape[1] // n
    rows = int(counts_all[:, me * e_local : (me + 1) * e_local].sum())
    return counts_all.new_empty(rows, 0)


@ep_rows.register_fake
def _(counts_all: Tensor, group: str) -> Tensor:
    rows = torch.library.get_ctx().new_dynamic_size()
    return counts_all.new_empty(rows, 0)


def _to_experts(x: Tensor, counts_all: Tensor, group: str) -> Tensor:
    g = _GROUPS[group]
    send, recv, perm = _plan(counts_all, g)
    buf = x.new_empty(sum(recv), x.shape[1])
    dist.all_to_all_single(buf, x.contiguous(), recv, send, group=g)
    return buf[perm]


def _from_experts(y: Tensor, counts_all: Tensor, group: str) -> Tensor:
    g = _GROUPS[group]
    send, recv, perm = _plan(counts_all, g)
    buf = torch.empty_like(y)
    buf[perm] = y
    out = y.new_empty(sum(send), y.shape[1])
    dist.all_to_all_single(out, buf, send, recv, group=g)
    return out


@torch.library.custom_op("compiletune::ep_to_experts", mutates_args=())
def ep_to_experts(x: Tensor, counts_all: Tensor, group: str, rows: Tensor) -> Tensor:
    """x [n, d] grouped by global expert -> [R, d] grouped by this rank's experts (`rows`: the
    [R, 0] placeholder of `ep_rows`)."""
    return _to_experts(x, counts_all, group)


@ep_to_experts.register_fake
def _(x: Tensor, counts_all: Tensor, group: str, rows: Tensor) -> Tensor:
    return x.new_empty(rows.shape[0], x.shape[1])


@torch.library.custom_op("compiletune::ep_from_experts", mutates_args=())
def ep_from_experts(y: Tensor, counts_all: Tensor, group: str, rows: Tensor) -> Tensor:
    """y [R, d] grouped by this rank's experts -> [n, d] in the order `ep_to_experts` read
    them (`rows`: a [n, 0] placeholder)."""
    return _from_experts(y, counts_all, group)


@ep_from_experts.register_fake
def _(y: Tensor, counts_all: Tensor, group: str, rows: Tensor) -> Tensor:
    return y.new_empty(rows.shape[0], y.shape[1])


def _save(ctx, inputs, output) -> None:
    x, counts_all, group, _ = inputs
    ctx.save_for_backward(counts_all)
    ctx.group, ctx.rows = group, x.shape[0]  # the gradient has the input's rows


def _to_experts_backward(ctx, grad: Tensor) -> tuple[Tensor, None, None, None]:
    (counts_all,) = ctx.saved_tensors
    rows = grad.new_empty(ctx.rows, 0)
    return ep_from_experts(grad.contiguous(), counts_all, ctx.group, rows), None, None, None


def _from_experts_backward(ctx, grad: Tensor) -> tuple[Tensor, None, None, None]:
    (counts_all,) = ctx.saved_tensors
    rows = grad.new_empty(ctx.rows, 0)
    return ep_to_experts(grad.contiguous(), counts_all, ctx.group, rows), None, None, None


ep_to_experts.register_autograd(_to_experts_backward, setup_context=_save)
ep_from_experts.register_autograd(_from_experts_backward, setup_context=_save)


@dataclass(frozen=True)
class ExpertShards:
    """This rank's place in its expert-parallel group; a MoE layer given one (`MoE.exchange`)
    runs its local experts on the rows every rank of the group routes to them."""

    group: str  # `register_group`'s name
    size: int  # N ranks in the group
    rank: int  # this rank's index in it
    n_experts: int  # E, all of them

    @property
    def local(self) -> slice:
        """The experts this rank holds."""
        per = self.n_experts // self.size
        return slice(self.rank * per, (self.rank + 1) * per)

    def received(self, x: Tensor, counts_all: Tensor) -> Tensor:
        """The [R, 0] placeholder of the rows this rank's experts receive (the memory estimate
        assumes a routing here instead: compiletune/estimate/expert_parallel.py)."""
        return ep_rows(counts_all, self.group)

    def __call__(self, experts: nn.Module, x: Tensor, counts: Tensor) -> Tensor:
        """x [n, d] grouped by global expert (counts [E] int64) -> the experts' outputs [n, d],
        through this rank's `experts` (E/N of them) and every other rank's."""
        counts_all = ep_counts(counts, self.group)  # [N, E]
        rows = self.received(x, counts_all)  # [R, 0]
        offs = counts_all[:, self.local].sum(dim=0).cumsum(0).to(torch.int32)  # [E/N]
        y = experts(ep_to_experts(x, counts_all, self.group, rows), offs)  # [R, d]
        return ep_from_experts(y, counts_all, self.group, x.new_empty(x.shape[0], 0))


# Beyond their outputs: to_experts holds the received buffer before it is reordered, and
# from_experts the reordered one before it is sent ([R, d] each, the size of y / the output).
@declare_memory("compiletune::ep_to_experts")
def _to_experts_holds(a: Args) -> int:
    return a["rows"].shape[0] * a["x"].shape[1] * a["x"].element_size()


@declare_memory("compiletune::ep_from_experts")
def _from_experts_holds(a: Args) -> int:
    return a["y"].numel() * a["y"].element_size()


declare_memory("compiletune::ep_counts")(holds_nothing)
declare_memory("compiletune::ep_rows")(holds_nothing)
