"""`--ac none|full|selective|budget=F`: the activation policy, and its eager form.

Under `--compile` the policy is a joint-graph pass (`passes/activation_policy.py`) or the
partitioner's memory budget, applied by `compile.py`. Without compile the same policies run
through `torch.utils.checkpoint` around each chosen block (`apply_eager_checkpointing`), with a
selective policy function that saves the same ops the pass saves.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

from compiletune.choices import AcKind, choices
from compiletune.errors import UserError
from compiletune.passes.activation_policy import SAVE_OPS


@dataclass(frozen=True)
class ActivationPolicy:
    kind: str = "none"  # none | full | selective | budget
    budget: float | None = None  # for kind == "budget": 0 = recompute all, 1 = fastest
    every: int = 1  # apply to every K-th block (blocks 0, K, 2K, ...)

    def applies_to(self, index: int) -> bool:
        return self.kind != "none" and index % self.every == 0


def parse_ac(text: str, every: int = 1) -> ActivationPolicy:
    """'none' | 'full' | 'selective' | 'budget=F' (0 <= F <= 1) -> ActivationPolicy."""
    if every < 1:
        raise UserError(f"--ac-every must be at least 1, got {every}")
    if text in choices(AcKind):
        return ActivationPolicy(text, None, every)
    if text.startswith("budget="):
        try:
            budget = float(text.split("=", 1)[1])
        except ValueError:
            budget = -1.0
        if not 0.0 <= budget <= 1.0:
            raise UserError(f"--ac {text}: the budget must be a number in [0, 1], e.g. budget=0.5")
        return ActivationPolicy("budget", budget, every)
    named = ", ".join(choices(AcKind))
    raise UserError(f"--ac must be {named} or budget=F, got {text!r}")


def _selective_policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in SAVE_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def apply_eager_checkpointing(model: torch.nn.Module, policy: ActivationPolicy) -> int:
    """Wrap the forward of each chosen block in `torch.utils.checkpoint`; returns how many.

    The wrapper replaces the block's `forward` attribute rather than the module, so parameter
    names (and so checkpoints) are unchanged.
    """
    if policy.kind == "budget":
        raise UserError(
            f"--ac budget={policy.budget} is a setting of the compiler's partitioner; "
            "add --compile, or use --ac full|selective without it"
        )
    count = 0
    for index, block in enumerate(model.layers):
        if not policy.applies_to(index):
            continue
        context_fn = (
            functools.partial(create_selective_checkpoint_contexts, _selective_policy)
            if policy.kind == "selective"
            else None
        )
        block.forward = functools.partial(_checkpointed, block.forward, context_fn)
        count += 1
    return count


def _checkpointed(forward, context_fn, *args, **kwargs):
    if context_fn is None:
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)
    return checkpoint(forward, *args, use_reentrant=False, context_fn=context_fn, **kwargs)
