"""`--ac none|full|selective|budget=F`: the activation policy, and its eager form.

Under `--compile` the policy is a joint-graph pass (`passes/activation_policy.py`) or the
partitioner's memory budget, applied by `compile.py`. Without compile the same policies run
through `torch.utils.checkpoint` around each chosen block (`apply_eager_checkpointing`), with a
selective policy function that saves the same ops the pass saves.
"""

from __future__ import annotations

import functools

import torch
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

from compiletune.compiler.ac_policy import ActivationPolicy
from compiletune.compiler.ac_policy import parse_ac as parse_ac  # re-exported: its users' import
from compiletune.errors import UserError
from compiletune.passes.activation_policy import SAVE_OPS


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
    vision = getattr(model, "vision_blocks", None)  # a vision tower's blocks: by their own index
    towers = enumerate(vision()) if vision is not None else ()
    for index, block in [*enumerate(model.layers), *towers]:
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
