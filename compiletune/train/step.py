"""`train_step`: the one training step (the trainer's and the memory estimate's), and `evaluate`.

micro-batches -> forward (hidden states) -> loss head (fused / chunked / plain) -> backward
  -> (accumulate)                                   `backward_pass`
  -> clip -> optimizer step -> zero grads           `optimizer_step`
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from compiletune import distributed as dist_
from compiletune.config import TrainConfig
from compiletune.data import prefetch
from compiletune.data.rows import PackedData, check_targets, count_targets, eval_batches
from compiletune.loss.head import IGNORE_INDEX, LossHead
from compiletune.metrics import perplexity
from compiletune.models.moe import router_losses
from compiletune.models.seq_parallel import SeqShards
from compiletune.train import objective
from compiletune.train.build import Run
from compiletune.train.forward import Batch, forward_hidden, local_batch
from compiletune.train.step_result import RouterStep, StepResult


@dataclass
class StepBatch:
    """The input of one optimizer step."""

    micro: list[Batch]  # --grad-accum global batches of world x --batch-size rows, on the host
    n_targets: int  # target tokens in all of them: what the loss is normalised by
    pairs: list[list[int]] | None = None  # preference pairs: each micro-batch's per-row counts


def next_batch(run: Run) -> StepBatch:
    """The next step's micro-batches from the run's data. Every rank draws the same global
    batches, so the target count needs no communication. For preference pairs the "targets"
    the loss averages over are the pairs."""
    micro = [run.batches.next() for _ in range(run.cfg.data.grad_accum)]
    for mb in micro:
        check_targets(mb, run.model.args.vocab_size)
    if "pairs" in micro[0]:
        pairs = [mb["pairs"].tolist() for mb in micro]
        return StepBatch(micro, sum(map(sum, pairs)), pairs)
    return StepBatch(micro, sum(count_targets(mb) for mb in micro))


def read_once(values: dict[str, Tensor]) -> dict[str, Any]:
    """Every tensor of `values` on the host in one transfer: the step's one host sync. Scalars
    come back as floats, others as nested lists of floats. Values on another device than the
    first (a norm over --cpu-offload's host-side shards) join it first: a copy, not a sync."""
    device = next(iter(values.values())).device if values else None
    parts = [v.detach().float().reshape(-1).to(device) for v in values.values()]
    numbers = torch.cat(parts).tolist() if parts else []
    out: dict[str, Any] = {}
    at = 0
    for (key, v), part in zip(values.items(), parts, strict=True):
        flat = numbers[at : at + part.numel()]
        at += part.numel()
        if v.dim() == 0:
            out[key] = flat[0]
        elif v.dim() == 1:
            out[key] = flat
        else:  # [rows, cols]
            cols = v.shape[-1]
            out[key] = [flat[i : i + cols] for i in range(0, len(flat), cols)]
    return out


# Called between backward and the optimizer step with the step's device values: `loss_sum`,
# `grad_norm` (when computed), `weights_norm` (with --optimizer-in-backward, whose update has
# already happened), the objective's sums and a MoE model's router numbers. It reads them on the
# host once; False skips the optimizer step (the trainer's check for non-finite values).
Accept = Callable[[dict[str, Tensor]], bool]


def lr_factor(step: int, cfg: TrainConfig) -> float:
    """Multiplier of the peak lr for optimizer step `step` (0-based): warmup, then decay."""
    o = cfg.optim
    warmup = o.warmup_steps or 0
    if step < warmup:
        return (step + 1) / warmup
    if o.schedule == "constant":
        return 1.0
    progress = min(1.0, (step - warmup) / max(1, cfg.run.max_steps - warmup))
    floor = o.min_lr_ratio
    if o.schedule == "linear":
        return floor + (1 - floor) * (1 - progress)
    return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))


def train_step(
    run: Run, batch: StepBatch, lr: float | None = None, accept: Accept | None = None
) -> StepResult:
    """One optimizer step over `batch` (this rank trains its slice of each global batch).
    `lr` is set before backward, since --optimizer-in-backward steps during backward.
    `accept` sees the loss and gradient norm before the optimizer step and can refuse it."""
    if lr is not None:
        run.optimizer.set_lr(lr)
    return optimizer_step(run, backward_pass(run, batch), accept)


@dataclass
class Backward:
    """What a step's micro-batches leave for its optimizer step (`backward_pass`)."""

    total: Tensor  # fp32 [], this rank's loss summed over its target tokens
    n_targets: int
    sums: dict[str, Tensor]  # the objective's per-pair or per-token values, summed
    router: list[tuple[Tensor, Tensor, Tensor]]  # per micro-batch: aux, z, expert loads


def backward_pass(run: Run, batch: StepBatch) -> Backward:
    """Forward and backward over each micro-batch: the gradients accumulate in .grad."""
    cfg, device = run.cfg, run.device
    b = cfg.data.batch_size
    rows = slice(run.dp_rank * b, (run.dp_rank + 1) * b)
    # The loss is normalised by the target tokens of the whole accumulated batch, so
    # accumulation gives the same gradient as one big batch; FSDP averages gradients over
    # ranks, which the factor `world` undoes.
    # MoE router losses are means over the tokens of each micro-batch: each adds 1/grad_accum of
    # its weighted value (FSDP's average over ranks makes it the mean over the global batch).
    n_targets = batch.n_targets
    total = torch.zeros((), device=device, dtype=torch.float32)
    n_experts = run.model.args.n_experts
    router: list[tuple[Tensor, Tensor, Tensor]] = []
    sums: dict[str, Tensor] = {}  # the objective's per-pair or per-token values, summed
    for i, mb in enumerate(batch.micro):
        run.observe("forward")
        pairs = batch.pairs[i][rows] if batch.pairs is not None else None
        mb = local_batch(mb, rows, run.seq, device)
        stats: list[Tensor] | None = [] if n_experts else None
        hidden = forward_hidden(run.model, mb, bool(cfg.data.doc_mask), stats)  # [b, s, d]
        loss = _micro_loss(run, mb, pairs, hidden, sums)  # fp32 [], summed over targets/pairs
        objective = loss * (run.world / max(1, n_targets))
        if stats:
            aux, z = router_losses(stats, n_experts)
            weighted = (cfg.optim.router_aux_coef or 0.0) * aux + cfg.optim.router_z_coef * z
            objective = objective + weighted / len(batch.micro)
            load = torch.stack([s[:n_experts] for s in stats]).detach()
            router.append((aux.detach(), z.detach(), load))
        run.observe("backward")
        objective.backward()
        total += loss.detach()
        del hidden, loss, objective, stats
    return Backward(total, n_targets, sums, router)


def optimizer_step(run: Run, done: Backward, accept: Accept | None = None) -> StepResult:
    """Clip (or measure) the gradients `backward_pass` left, then step the optimizer and zero
    them, unless `accept` refuses the step's values."""
    cfg = run.cfg
    total, n_targets, sums, router = done.total, done.n_targets, done.sums, done.router
    run.observe("step")
    max_norm = cfg.optim.max_grad_norm or 0.0
    grad_norm = None
    split = getattr(run.model, "expert_parallel", None)  # --ep: torch's norm cannot mix them
    if max_norm > 0 and split is not None:
        grad_norm = split.clip_grad_norm(run.params, max_norm)
    elif max_norm > 0:
        grad_norm = torch.nn.utils.clip_grad_norm_(run.params, max_norm)
    else:  # the norm alone: a non-finite one is caught. None when no gradient is left (an
        # optimizer that steps in backward has dropped each one; its hook reports instead)
        grads = [p.grad for p in run.params if p.grad is not None]
        grad_norm = torch.nn.utils.get_total_norm(grads) if grads else None
        if grads and split is not None:
            grad_norm = split.grad_norm(run.params)
    extras = {k: torch.as_tensor(v).detach() for k, v in sums.items()}
    moe = None
    if router:
        aux, z, load = (torch.stack(parts) for parts in zip(*router, strict=True))
        moe = RouterStep(aux.mean(), z.mean(), load.sum(dim=0))
    if accept is not None and not accept(step_values(run, total, grad_norm, extras, moe)):
        run.optimizer.zero_grad()
        return StepResult(total, n_targets, grad_norm, stepped=False, router=moe, extras=extras)
    run.optimizer.step()  # a no-op with --optimizer-in-backward: already stepped
    run.optimizer.zero_grad()
    result = StepResult(total, n_targets, grad_norm, router=moe, extras=extras)
    run.hooks.after_optimizer_step(result)  # the techniques' per-step work (hooks.py)
    return result


def step_values(
    run: Run,
    loss_sum: Tensor,
    grad_norm: Tensor | None,
    extras: dict[str, Tensor],
    router: RouterStep | None,
) -> dict[str, Tensor]:
    """The device values a step reports, for `accept` to read in one host sync: its own, the
    run's step hooks' (`report`: e.g. --optimizer-in-backward's `weights_norm`), and the
    objective's sums, keyed `extra.<name>`."""
    values = {"loss_sum": loss_sum}
    if grad_norm is not None:
        values["grad_norm"] = _full(grad_norm)
    run.hooks.report(values)
    values |= {f"extra.{k}": v for k, v in extras.items()}
    if router is not None:
        values |= router.tensors()
    return values


def _full(norm: Tensor) -> Tensor:
    """A norm over every rank's shards (a DTensor's full value; a plain tensor as it is)."""
    return norm.full_tensor() if hasattr(norm, "full_tensor") else norm


def _micro_loss(
    run: Run, mb: Batch, pairs: list[int] | None, hidden: Tensor, sums: dict[str, Tensor]
) -> Tensor:
    """The micro-batch's loss, summed (over its target tokens, or its pairs): the loss head's
    cross-entropy, or the --objective's (train/objective.py), whose other values are added
    into `sums`. `pairs`: the rows' pair counts of a preference batch (host ints)."""
    kind = run.cfg.objective.objective
    if kind in ("sft", "grpo"):  # grpo's updates run in train/grpo.py: this is the memory
        # estimate's stand-in, a head over a micro-batch of completions of the same shape
        return run.head(hidden, mb["targets"])
    if kind == "kd":
        loss, values = objective.distillation_micro(run, mb, hidden, bool(run.cfg.data.doc_mask))
    else:
        per_pair, values = objective.preference_micro(run, mb, hidden, pairs or [])
        loss, values = per_pair.sum(), {k: v.sum() for k, v in values.items()}
        if run.seq is not None:  # every rank of a --cp group holds the whole pairs' values
            loss, values = loss / run.seq.size, {k: v / run.seq.size for k, v in values.items()}
    for k, v in values.items():
        sums[k] = sums.get(k, 0.0) + v
    return loss


def weights_norm(params: list[torch.nn.Parameter]) -> float:
    """The L2 norm of these parameters (every rank's shards together; nan or inf when one is not
    finite). One pass, one host sync."""
    if not params:
        return 0.0
    return float(_full(torch.nn.utils.get_total_norm(params)))


def evaluate(
    model: torch.nn.Module,
    data: PackedData,
    loss_kind: str,
    batch_size: int,
    device: torch.device,
    doc_mask: bool,
    env: dist_.DistEnv | None = None,
    seq: SeqShards | None = None,
    on_batch: Callable[[], None] | None = None,
) -> dict[str, float]:
    """Mean loss per target token (and its perplexity) over every row of `data`; `on_batch` is
    called after each batch (`compiletune eval`'s progress).

    Runs eagerly even under --compile (`force_eager`): the compiled regions were traced with
    gradients on, so calling them under no_grad would compile them a second time, and a short
    last batch a third. Eager gives the same loss (the numerics contract), and without autograd
    nothing is kept for a backward. Under --cp (`seq`) each rank of a group runs its piece of
    the group's rows.

    Under FSDP the rows are split over the ranks as training batches are (each global batch of
    world x batch_size rows, each rank its slice), and the sums are added up at the end. Every
    rank runs the same number of forwards (FSDP's gathers are collectives): a rank whose slice
    of the last global batch is empty runs one row with no targets.
    """
    rank, world, b = (env.rank, env.world, batch_size) if env is not None else (0, 1, batch_size)
    if seq is not None:  # the groups of --cp ranks share their rows
        rank, world = rank // seq.size, world // seq.size
    # shares the weight; the eager form of the head
    head = LossHead(model.output, loss_kind, model.args.final_softcap)
    total = torch.zeros((), device=device, dtype=torch.float32)
    n_targets = 0
    model.eval()
    try:
        with (
            torch.no_grad(),
            torch.compiler.set_stance("force_eager"),
            prefetch.ahead(data, eval_batches(data, b * world)) as batches,
        ):
            for batch in batches:  # an image set's pixels prepared ahead (data/prefetch.py)
                rows = slice(rank * b, (rank + 1) * b)
                if batch["inputs"][rows].shape[0] == 0:
                    rows = slice(0, 1)
                    batch["targets"] = torch.full_like(batch["targets"], IGNORE_INDEX)
                mine = local_batch(batch, rows, seq, device)
                total += head(forward_hidden(model, mine, doc_mask), mine["targets"])
                n_targets += int((mine["targets"] != IGNORE_INDEX).sum())
                if on_batch is not None:
                    on_batch()
    finally:
        model.train()
    loss_sum = total.item()
    if env is not None:
        loss_sum, n_targets = dist_.all_reduce_sum([loss_sum, n_targets], device)
        n_targets = int(n_targets)
    loss = loss_sum / n_targets
    return {"eval_loss": loss, "eval_ppl": perplexity(loss), "eval_targets": n_targets}
