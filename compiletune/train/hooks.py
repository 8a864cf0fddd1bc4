"""Step hooks: a technique's per-step work, registered where the technique is applied
(`apply_techniques`) and called by the step at fixed points, in the order registered. The step
names no technique; it calls the run's `StepHooks`.

    backward_pass (every micro-batch)
      -> report(values)           a hook adds device values to the step's one host read
      -> accept? -> optimizer step -> zero grads
      -> after_optimizer_step     only when the optimizer stepped (`accept` did not refuse)
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from compiletune import fp8
from compiletune.models.moe import update_score_bias
from compiletune.train.step_result import StepResult


class StepHook:
    """One technique's per-step work. A hook overrides the points it needs; the others do
    nothing."""

    def report(self, values: dict[str, Tensor]) -> None:
        """Between backward and the optimizer step: add device values (fp32 [] each) to the
        ones the step reads on the host in one sync (`accept`). Called only when the step is
        checked; nothing may be read on the host here."""

    def after_optimizer_step(self, result: StepResult) -> None:
        """After the optimizer stepped and the gradients were zeroed (a refused step skips
        this)."""


class StepHooks:
    """The run's hooks in the order they were registered (the order techniques are applied)."""

    def __init__(self) -> None:
        self.hooks: list[StepHook] = []

    def add(self, hook: StepHook) -> None:
        self.hooks.append(hook)

    def report(self, values: dict[str, Tensor]) -> None:
        for hook in self.hooks:
            hook.report(values)

    def after_optimizer_step(self, result: StepResult) -> None:
        for hook in self.hooks:
            hook.after_optimizer_step(result)


class Fp8Scales(StepHook):
    """--fp8 tensorwise under FSDP: the next all-gather's float8 weight scales, for all weights
    in one all-reduce, once the weights have changed."""

    def __init__(self, model: nn.Module, recipe: str) -> None:
        self.model, self.recipe = model, recipe

    def after_optimizer_step(self, result: StepResult) -> None:
        fp8.precompute_scales(self.model, self.recipe)


class RouterBiasUpdate(StepHook):
    """--router-bias-update-rate: each router's correction bias moved toward balance by the
    loads of the whole global batch (every rank's), after the step that measured them."""

    def __init__(self, model: nn.Module, rate: float, world: int) -> None:
        self.model, self.rate, self.world = model, rate, world

    def after_optimizer_step(self, result: StepResult) -> None:
        if result.router is None:
            return
        tokens = result.router.expert_tokens.clone()
        if self.world > 1:
            torch.distributed.all_reduce(tokens)
        update_score_bias(self.model, tokens, self.rate)


class InBackwardCheck(StepHook):
    """--optimizer-in-backward: the update has already happened when the step is checked, and no
    whole set of gradients exists to measure, so the norm of the trainable weights (every
    rank's shards) says whether they stayed finite (`weights_norm`)."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model

    def report(self, values: dict[str, Tensor]) -> None:
        params = [p for p in self.model.parameters() if p.requires_grad]
        if params:
            norm = torch.nn.utils.get_total_norm(params)
            values["weights_norm"] = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
