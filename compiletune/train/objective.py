"""The loss of one micro-batch for `--objective dpo|ipo|simpo|kd` (sft is the loss head's), and
the held-out evaluation of preference pairs.

Both run the model's blocks as usual (compiled under --compile) and the heads through the
chunked ops of ops/fused_logprobs.py: no `[tokens, vocab]` logits for the policy, the reference
or the teacher. The policy's log-probabilities come from the loss head (`LossHead(...,
logprobs=True)`): eagerly the op itself, compiled plain code that the fuse_linear_logprobs pass
turns into the op. The reference (DPO, IPO) and the teacher run without gradients and eagerly,
calling the ops: a LoRA run's reference is its own model with the adapters switched off, a full
fine-tune's a frozen copy of the starting weights (`Run.reference`), sharded like the policy
under FSDP.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch
from torch import Tensor

from compiletune.config import TrainConfig
from compiletune.data.pairs import PairRows, batch_sequence_ids, row_values
from compiletune.data.rows import eval_batches
from compiletune.loss.head import IGNORE_INDEX, LossHead
from compiletune.loss.objectives import (
    PreferenceOptions,
    distillation_loss,
    preference_loss,
    sequence_sums,
)
from compiletune.models.lora import adapters_disabled
from compiletune.ops.fused_logprobs import token_divergence
from compiletune.train.build import Run
from compiletune.train.forward import forward_hidden, local_batch

PREFERENCE = ("dpo", "ipo", "simpo")
# per-pair values summed in a step, reported as means over its pairs
REWARDS = ("chosen_reward", "rejected_reward", "reward_accuracy", "reward_margin")


def count_pairs(batch: dict[str, Tensor]) -> int:
    return int(batch["pairs"].sum())


def _options(cfg: TrainConfig) -> PreferenceOptions:
    o = cfg.objective
    return PreferenceOptions(o.objective, o.beta, o.label_smoothing, o.simpo_gamma)


def logprobs(model: torch.nn.Module, hidden: Tensor, targets: Tensor) -> Tensor:
    """Per-token log-probabilities [b * s] of the targets under a model's head (the chunked op,
    as the policy's loss head gives them eagerly)."""
    head = LossHead(model.output, "chunked", model.args.final_softcap)
    return head(hidden, targets, logprobs=True)


@contextlib.contextmanager
def frozen_eager() -> Iterator[None]:
    """No autograd, and compiled blocks run eagerly (a reference or teacher pass must not
    compile the policy's blocks a second time)."""
    with torch.no_grad(), torch.compiler.set_stance("force_eager"):
        yield


@contextlib.contextmanager
def reference_model(run: Run) -> Iterator[torch.nn.Module]:
    """The reference, without autograd and eagerly: the frozen copy (resharded after its pass
    under FSDP), or a LoRA run's own model with its adapters off."""
    with frozen_eager():
        if run.reference is None:
            with adapters_disabled(run.model):
                yield run.model
            return
        yield run.reference
        if run.env is not None:
            reshard_frozen(run.reference)


def reference_sums(
    run: Run, mb: dict[str, Tensor], ids: Tensor, n_seq: int, whole: bool = True
) -> Tensor:
    """The reference model's summed response log-probabilities [n_seq] (`whole=False`: over
    this rank's tokens alone under --cp, for the caller to sum with its own)."""
    with reference_model(run) as model:
        hidden = forward_hidden(model, mb, True)
        sums = sequence_sums(logprobs(model, hidden, mb["targets"]), ids, n_seq)
    return _whole(run, sums) if whole else sums


def _sequence_ids(run: Run, mb: dict[str, Tensor]) -> Tensor:
    """Each target token's sequence (0, 1 = the first pair's chosen and rejected ...), flat;
    under --cp this rank's piece of each row's."""
    ids = batch_sequence_ids(mb["seq_ids"], mb["pairs"])
    return (run.seq.piece(ids) if run.seq is not None else ids).flatten()


def _whole(run: Run, sums: Tensor) -> Tensor:
    """Per-sequence sums over this rank's tokens -> over the whole rows (--cp)."""
    return run.seq.total(sums) if run.seq is not None else sums


def preference_micro(
    run: Run, mb: dict[str, Tensor], hidden: Tensor, pairs: list[int]
) -> tuple[Tensor, dict[str, Tensor]]:
    """(per-pair losses [P], per-pair rewards) of a micro-batch of pair rows; `pairs`: its
    rows' pair counts, known on the host (sizes without a device sync)."""
    opts = _options(run.cfg)
    ids = _sequence_ids(run, mb)
    n_seq = 2 * sum(pairs)
    policy = sequence_sums(run.head(hidden, mb["targets"], logprobs=True), ids, n_seq)
    ones = torch.ones(ids.shape, dtype=torch.float32, device=ids.device)
    parts = [policy, sequence_sums(ones, ids, n_seq).to(policy.dtype)]
    ref = None
    if opts.kind != "simpo" and "ref" not in mb:
        parts.append(reference_sums(run, mb, ids, n_seq, whole=False).to(policy.dtype))
    # under --cp one all-reduce sums the pieces of all three (the gradient reaches the policy's)
    summed = _whole(run, torch.stack(parts))
    policy, lengths = summed[0], summed[1]
    if len(parts) == 3:
        ref = summed[2]
    elif opts.kind != "simpo":  # --precompute-ref
        ref = row_values(mb["ref"], pairs)
    return preference_loss(
        policy[0::2],
        policy[1::2],
        None if ref is None else ref[0::2],
        None if ref is None else ref[1::2],
        opts,
        lengths[0::2],
        lengths[1::2],
    )


def distillation_micro(
    run: Run, mb: dict[str, Tensor], hidden: Tensor, doc_mask: bool
) -> tuple[Tensor, dict[str, Tensor]]:
    """(summed per-token KD loss [], summed divergence and CE) of a micro-batch."""
    o = run.cfg.objective
    with frozen_eager():
        teacher_hidden = forward_hidden(run.teacher, mb, doc_mask)
    targets = mb["targets"].flatten()
    mask = targets != IGNORE_INDEX
    flat = hidden.flatten(0, 1)
    softcap = run.model.args.final_softcap or 0.0
    div = token_divergence(
        flat,
        run.model.output.weight,
        teacher_hidden.flatten(0, 1),
        run.teacher.output.weight,
        mask,
        temperature=o.kd_temperature,
        kind=o.kd_loss,
        softcap=softcap,
    )
    ce = -run.head(hidden, mb["targets"], logprobs=True)
    per_token = distillation_loss(ce, div, o.kd_ratio, o.kd_temperature)
    return per_token.sum(), {"kd_divergence": div.sum().detach(), "kd_ce": ce.sum().detach()}


def evaluate_pairs(run: Run, batch_size: int) -> dict[str, float]:
    """Mean loss and rewards over every held-out pair (the policy in eval mode, eagerly)."""
    sums = dict.fromkeys(("eval_loss", *(f"eval_{k}" for k in REWARDS)), 0.0)
    n = 0
    run.model.eval()
    try:
        with frozen_eager():
            for batch in eval_batches(run.eval_set, batch_size):
                mb = local_batch(batch, slice(None), run.seq, run.device)
                hidden = forward_hidden(run.model, mb, True)
                loss, rewards = preference_micro(run, mb, hidden, batch["pairs"].tolist())
                sums["eval_loss"] += float(loss.sum())
                for k in REWARDS:
                    sums[f"eval_{k}"] += float(rewards[k].sum())
                n += count_pairs(batch)
    finally:
        run.model.train()
    return {**{k: v / n for k, v in sums.items()}, "eval_pairs": n}


def precompute_reference(run: Run, say: Callable[[str], None] = print) -> None:
    """--precompute-ref: every training (and held-out) pair scored once under the reference,
    stored with the rows; the reference copy is then dropped, so steps run the policy only."""
    import time

    t0 = time.perf_counter()
    b = run.cfg.data.batch_size
    sets = [d for d in (*run.data, run.eval_set) if isinstance(d, PairRows)]
    for rows in sets:
        per_row = []
        for start in range(0, rows.rows, b):
            batch = rows.take(np.arange(start, min(rows.rows, start + b)))
            mb = local_batch(batch, slice(None), run.seq, run.device)
            ids = _sequence_ids(run, mb)
            sums = reference_sums(run, mb, ids, 2 * count_pairs(batch))
            counts = (2 * batch["pairs"]).tolist()
            per_row += list(torch.split(sums, counts))
        rows.set_reference(per_row)
    run.reference = None
    n = sum(r.n_pairs for r in sets)
    say(f"reference scores of {n} pairs precomputed in {time.perf_counter() - t0:.1f}s")


def reshard_frozen(model: Any) -> None:
    """Free a sharded frozen model's gathered parameters after its pass (FSDP reshards the
    blocks after their forward; the final norm and head stay gathered for a backward that a
    frozen model never runs)."""
    from torch.distributed.fsdp import FSDPModule

    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.reshard()
