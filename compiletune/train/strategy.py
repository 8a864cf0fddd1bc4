"""How the loop runs one optimizer step: a `StepStrategy`, chosen by the objective when the
trainer starts. The loop calls it and keeps the run's counters (step, tokens, first and last
loss) from the `StepOutcome` it returns; a strategy never reaches into the trainer.

    SupervisedStep   sft, the DPO family, kd: micro-batches -> `train_step` (step.py)
    GrpoStep         grpo: rollout -> rewards -> updates (grpo.py)
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from compiletune import distributed as dist_
from compiletune import faults
from compiletune.train.build import Run
from compiletune.train.nonfinite import cause, finite
from compiletune.train.run_dir.signals import StopSignal
from compiletune.train.step import lr_factor, next_batch, read_once, train_step
from compiletune.train.step_result import RouterStep


@dataclass
class StepOutcome:
    """What one optimizer step tells the loop."""

    record: dict[str, Any]  # the metrics line, "step" first (the step's 1-based number)
    tokens: int  # the data's tokens this step trained on (padding aside)
    targets: int  # target tokens (completions' tokens for grpo)
    padding: int = 0  # padding beside `tokens` in the step's rows
    loss: float | None = None  # the step's loss when finite; None: the step was not finite


class StepStrategy(Protocol):
    """One optimizer step of an objective, as the loop calls it."""

    def one_step(self, step: int, stop: StopSignal) -> StepOutcome | None:
        """Run optimizer step `step` (0-based: the record's "step" is `step + 1`). None: the
        step was abandoned and the run stops (`stop` is set), nothing counted."""
        ...


class SupervisedStep:
    """sft, the DPO family and kd: the step's micro-batches from the run's batches through
    `train_step`, with one host sync (and under FSDP one collective) to check its values."""

    def __init__(self, run: Run, env: dist_.DistEnv | None, peak_gib: Callable[[], float]) -> None:
        self.run, self.env, self.peak_gib = run, env, peak_gib

    def one_step(self, step: int, stop: StopSignal) -> StepOutcome:
        """The step's metrics line. A step whose loss or gradient norm is not finite is not
        applied (`nonfinite` in its line)."""
        run, cfg = self.run, self.run.cfg
        t0 = time.perf_counter()
        served = run.batches.served_inputs
        batch = next_batch(run)
        # The lr is a function of the step alone, so a resume needs no schedule state.
        lr = cfg.optim.lr * lr_factor(step, cfg)
        seen: dict[str, Any] = {}

        def accept(values: dict[str, torch.Tensor]) -> bool:
            # The step's one host sync and, under FSDP, its one collective: the global loss,
            # the objective's sums, and a stop request seen by any rank (so every rank leaves
            # after the same step). The norms are already global; so every rank takes the
            # same decision.
            host = read_once(values)
            if self.env is not None:
                extra = [k for k in host if k.startswith("extra.")]
                summed = dist_.all_reduce_sum(
                    [host["loss_sum"], stop.requested, *(host[k] for k in extra)], run.device
                )
                host["loss_sum"], votes = summed[0], summed[1]
                host.update(zip(extra, summed[2:], strict=True))
                stop.agreed = votes > 0
            seen.update(host)
            values = host["loss_sum"], host.get("grad_norm"), host.get("weights_norm")
            ok = finite(*values)
            if not ok:  # named now: the gradients are zeroed when the step is refused
                seen["cause"] = cause(run.model, *values, self.env)
            return ok

        result = train_step(run, batch, lr, accept)
        faults.point("step")
        loss = seen["loss_sum"] / result.n_targets
        nonfinite = seen.get("cause")
        dt = time.perf_counter() - t0
        # the data's tokens, padding aside (whole-example packing and pairs pad their rows)
        n_tokens = run.batches.served_inputs - served
        padding = cfg.data.grad_accum * cfg.data.batch_size * run.dp_world * cfg.data.seq_len
        padding -= n_tokens
        record = {
            "step": step + 1,
            "loss": loss,
            "lr": lr,
            "grad_norm": seen.get("grad_norm"),
            "tokens": n_tokens,
            "padding": padding,
            "targets": result.n_targets,
            "tokens_per_s": n_tokens / dt,
            "step_time_s": dt,
            "peak_mem_gib": self.peak_gib(),
            "epoch": run.batches.epoch,
        }
        if result.router is not None:
            record.update(RouterStep.record(seen))
        n = max(1, result.n_targets)  # the objective's sums over the pairs or tokens: means
        record.update({k: seen[f"extra.{k}"] / n for k in result.extras})
        if nonfinite is not None:
            record["nonfinite"] = nonfinite
            # --optimizer-in-backward updated during backward, before the check could refuse
            record["applied"] = bool(result.stepped or cfg.optim.optimizer_in_backward)
        finite_loss = loss if nonfinite is None else None
        return StepOutcome(record, n_tokens, result.n_targets, padding, finite_loss)
