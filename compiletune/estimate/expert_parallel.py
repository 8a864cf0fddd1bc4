"""The memory estimate under `--ep N` (compiletune/expert_parallel.py).

The estimate runs the trainer's own build as rank 0 of --gpus ranks (a fake process group), so
the layout is the trainer's: each rank holds E/N experts of every MoE layer whole, their
gradients and optimizer state with them (left out of FSDP, replicated over the --gpus / N
groups), the other weights FSDP-sharded over all ranks. What fake tensors cannot give is the
routing: the rows a rank's experts receive are data (`ep_rows` reads the counts). Here the
estimate assumes them instead (`AssumedRouting`): a rank sends its own n = tokens x top-k rows
and its experts receive ceil(F x n) of the group's, F = --ep-skew capped at N (F = 1: uniform
routing, every rank receives what it sends; F = N: every row of the group goes to this rank's
experts, the worst case). The all-to-all buffers (`expert_exchange`'s declared memory), the
grouped matmul and what it saves for backward follow from that R.

The default F = 2 is a stated assumption, not a bound for N > 2: a trained router with its
load-balancing loss (or DeepSeek-V3's bias correction) keeps the busiest rank well under twice
its share in the runs torchtitan and DeepSeek report, and the bound itself (F = N) would charge
every rank N x its tokens. `estimate-memory` prints the uniform figure beside it.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

from torch import Tensor, nn

from compiletune.config import TrainConfig
from compiletune.errors import UserError
from compiletune.ops.expert_exchange import ExpertShards
from compiletune.train.build_model import resolve_model_args


@dataclass(frozen=True)
class AssumedRouting(ExpertShards):
    """`ExpertShards` whose received rows are assumed (`received_rows`), not read from the
    routing: for the estimate on fake tensors."""

    skew: float = 1.0

    def received(self, x: Tensor, counts_all: Tensor) -> Tensor:
        return x.new_empty(received_rows(x.shape[0], self.size, self.skew), 0)


def received_rows(sent: int, ep: int, skew: float) -> int:
    """Rows the busiest rank's experts receive when each rank sends `sent`: F x `sent`, F the
    skew capped at `ep` (all rows of the group)."""
    if skew < 1:
        raise UserError(f"--ep-skew must be at least 1 (uniform routing), got {skew}")
    return math.ceil(min(skew, ep) * sent)


def assume_routing(model: nn.Module, skew: float) -> None:
    """Every MoE layer split by --ep exchanges as `AssumedRouting` with `skew`; nothing without
    --ep."""
    for module in model.modules():
        exchange = getattr(module, "exchange", None)
        if isinstance(exchange, ExpertShards) and not isinstance(exchange, AssumedRouting):
            module.exchange = AssumedRouting(**asdict(exchange), skew=skew)


def notes(cfg: TrainConfig, gpus: int) -> list[str]:
    """What the estimate assumed under --ep (nothing without it)."""
    ep = cfg.parallel.ep
    if ep <= 1:
        return []
    skew = min(cfg.parallel.ep_skew, ep)
    return [
        f"--ep {ep}: each rank holds 1/{ep} of every MoE layer's experts whole (their gradients "
        f"and optimizer state too, replicated over the {gpus // ep} expert groups), the rest "
        f"FSDP-sharded over {gpus} ranks; routing: the busiest rank receives {skew:g} x its "
        "even share of the routed tokens (--ep-skew; 1 = uniform)"
    ]


def degree(cfg: TrainConfig, gpus: int) -> int:
    """The --ep the ladder and the advice try for `gpus` ranks: the most ranks that divide both
    the ranks and the experts (1: not a MoE model, one GPU, or --ep already set)."""
    if gpus <= 1 or cfg.parallel.ep > 1:
        return 1
    experts = resolve_model_args(cfg).n_experts or 0
    return math.gcd(gpus, experts) if experts else 1


def rungs(cfg: TrainConfig, gpus: int) -> list[tuple[str, dict[str, Any]]]:
    """The ladder's expert-parallel rung for `cfg` on `gpus` ranks (first: it adds no compute,
    and replaces FSDP's gathering of every expert with the all-to-alls), or none."""
    n = degree(cfg, gpus)
    return [(f"+ expert parallel ({n} ranks)", {"fsdp": True, "ep": n})] if n > 1 else []


def uniform_config(cfg: TrainConfig) -> TrainConfig | None:
    """`cfg` with uniform routing (--ep-skew 1), for the figure estimate-memory prints beside
    the skewed one; None when `cfg` assumes uniform routing already or has no --ep."""
    skew = min(cfg.parallel.ep_skew, cfg.parallel.ep)
    return cfg.replace(ep_skew=1.0) if skew > 1 else None


def uniform_line(cfg: TrainConfig, skewed_bytes: int, uniform_bytes: int) -> str:
    """estimate-memory's line for both routings: the peak per GPU under --ep-skew and under
    uniform routing."""
    skew = min(cfg.parallel.ep_skew, cfg.parallel.ep)
    return (
        f"--ep {cfg.parallel.ep} routing: {skewed_bytes / 2**30:.2f} GiB per GPU with the busiest "
        f"rank receiving {skew:g} x its share, {uniform_bytes / 2**30:.2f} GiB uniform"
    )
