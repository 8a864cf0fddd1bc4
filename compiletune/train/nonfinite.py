"""A step whose loss or gradient is not finite: what it found, and the advice that fits the run.

Every objective's step ends in the same check (`finite`) on the values it read on the host. When
it fails, `cause` looks once more, while the gradients are still there: the loss itself, which
parameters' gradients are not finite, a norm that overflowed although every gradient is finite,
or weights that are not finite. `advice` then says where to go on from, and what to change: a
lower learning rate only when an update was applied before the bad step (otherwise the weights
are the ones the run started from and the lr cannot be the cause: the model or the data is).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor, nn

from compiletune import distributed as dist_
from compiletune.config import TrainConfig, default_lr

SHOWN = 3  # parameter names a line shows before "..."


def finite(*values: float | None) -> bool:
    """True when every value read on the host (loss, norms; None: not measured) is finite."""
    return all(v is None or math.isfinite(v) for v in values)


def _local(t: Tensor) -> Tensor:
    """This rank's shard of a DTensor (FSDP), a plain tensor as it is."""
    return t.to_local() if hasattr(t, "to_local") else t


def _scan(tensors: list[Tensor], device: torch.device, distributed: bool) -> tuple[Tensor, Tensor]:
    """Per tensor: how many elements are not finite, and the largest finite magnitude; over
    every rank's shards (a collective under FSDP: every rank calls it)."""
    bad, top = [], []
    for t in tensors:  # (a shard may sit on the host under --cpu-offload, or be empty)
        local = _local(t).detach()
        bad.append((~torch.isfinite(local)).sum().double().to(device))
        peak = local.abs().nan_to_num(nan=0.0, posinf=0.0).amax() if local.numel() else None
        top.append(
            peak.double().to(device)
            if peak is not None
            else torch.zeros((), device=device, dtype=torch.float64)
        )
    if not tensors:
        return torch.zeros(0, device=device), torch.zeros(0, device=device)
    counts, peaks = torch.stack(bad), torch.stack(top)
    if distributed:
        torch.distributed.all_reduce(counts)
        torch.distributed.all_reduce(peaks, op=torch.distributed.ReduceOp.MAX)
    return counts, peaks


def _names(names: list[str]) -> str:
    shown = ", ".join(names[:SHOWN])
    return shown + (", ..." if len(names) > SHOWN else "")


def _bad_tensors(named: list[tuple[str, Tensor]], device: torch.device, distributed: bool) -> str:
    """'' when every tensor is finite, else 'K of N parameters (a, b, c, ...)'."""
    counts, _ = _scan([t for _, t in named], device, distributed)
    bad = [n for (n, _), c in zip(named, counts.tolist(), strict=True) if c > 0]
    return f"{len(bad)} of {len(named)} parameters ({_names(bad)})" if bad else ""


def cause(
    model: nn.Module,
    loss: float,
    grad_norm: float | None,
    weights_norm: float | None = None,
    env: dist_.DistEnv | None = None,
) -> str:
    """What made a step non-finite, read before its gradients are zeroed: `loss`, `grad_norm`
    and `weights_norm` are the values the step's check read, `model`'s trained parameters are
    searched. Under FSDP every rank calls it (its counts are summed over the ranks)."""
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    # the collectives' device (NCCL's, even when --cpu-offload keeps the shards on the host)
    device = env.device if env is not None else params[0][1].device if params else None
    device = device or torch.device("cpu")
    distributed = env is not None
    if not math.isfinite(loss):
        weights = _bad_tensors(params, device, distributed)
        if weights:
            return f"the loss is {loss}: the weights of {weights} are not finite"
        return f"the loss is {loss} with finite weights: the forward pass on this batch overflowed"
    if weights_norm is not None and not math.isfinite(weights_norm):
        weights = _bad_tensors(params, device, distributed)
        return "the weights became non-finite" + (f": {weights}" if weights else "")
    grads = [(n, p.grad) for n, p in params if p.grad is not None]
    if grad_norm is None or math.isfinite(grad_norm) or not grads:
        return f"the gradient norm is {grad_norm}"
    counts, peaks = _scan([g for _, g in grads], device, distributed)
    bad = [n for (n, _), c in zip(grads, counts.tolist(), strict=True) if c > 0]
    if bad:
        return (
            f"the gradient norm is {grad_norm}: the gradients of {len(bad)} of {len(grads)} "
            f"parameters are not finite ({_names(bad)})"
        )
    at = int(peaks.argmax())
    return (
        f"the gradient norm is {grad_norm}: every gradient is finite but their norm overflows "
        f"(the largest, {float(peaks[at]):.3g}, is in {grads[at][0]})"
    )


@dataclass
class Facts:
    """What the advice depends on."""

    cfg: TrainConfig
    dtype: torch.dtype
    last_good: Path | None  # the newest checkpoint fit to continue from
    started_from: Path | None  # the checkpoint this invocation resumed from (None: a new run)
    updated: bool  # an update was applied in this invocation before the bad step


def advice(f: Facts, skip_hint: bool = True) -> str:
    """Where to go on from after a non-finite step, and what to change (the command to run).
    `skip_hint`: end with --skip-nonfinite's offer (a step that was not applied can be skipped)."""
    cfg = f.cfg
    knobs = []
    if not (cfg.optim.max_grad_norm or 0.0) and not cfg.optim.optimizer_in_backward:
        knobs.append("--max-grad-norm 1")
    if f.dtype != torch.float32:
        knobs.append("--dtype fp32")
    also = f" (or {' or '.join(knobs)})" if knobs else ""
    if not f.updated:
        # The gradient of a step depends on the weights and the batch, not on the lr: resuming
        # with a lower one replays the same step and fails the same way.
        start = f.started_from or cfg.model.model_dir or f"--model {cfg.model.preset or 'debug'}"
        where = (
            f"--resume --resume-from {f.started_from.name} --skip-nonfinite 1 --accept-changes"
            if f.started_from is not None
            else "--skip-nonfinite 1 --overwrite"
        )
        return (
            f"no update was applied before it, so the weights are the ones the run started from "
            f"({start}) and the learning rate is not the cause: the model or this batch is; "
            f"check them{also}, or step over the batch: {where}"
        )
    usual = default_lr(cfg)  # the lr a run of this kind gets by default
    lr = f"{min(cfg.optim.lr / 10, usual):.3g}"
    skip = " (or --skip-nonfinite N to step over up to N such batches)" if skip_hint else ""
    if f.last_good is None:
        return (
            "no good checkpoint was written before it; start again with a lower learning rate "
            f"(--lr {lr} --overwrite){also}{skip}"
        )
    return (
        f"the last good checkpoint is {f.last_good}; continue from it with a lower learning "
        f"rate: --resume --resume-from {f.last_good.name} --lr {lr} --accept-changes{also}{skip}"
    )
