"""What one optimizer step leaves: `StepResult`, with a MoE model's `RouterStep`. Its own module
so that the step hooks (hooks.py) take it without importing the step."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from torch import Tensor


@dataclass
class StepResult:
    loss_sum: Tensor  # fp32 [], this rank's loss summed over its target tokens (not synced)
    n_targets: int  # target tokens of the whole global batch, every micro-batch
    grad_norm: Tensor | None  # before clipping; None with --optimizer-in-backward
    stepped: bool = True  # False: `accept` refused the step, the optimizer did not run
    router: RouterStep | None = None  # MoE models: this rank's router losses and expert load
    # the objective's own values, summed on this rank (not synced): fp32 [] each
    extras: dict[str, Tensor] = field(default_factory=dict)


@dataclass
class RouterStep:
    """A MoE step's router numbers on this rank (means over its micro-batches)."""

    aux_loss: Tensor  # fp32 [], the load-balancing loss
    z_loss: Tensor  # fp32 [], the router z-loss
    expert_tokens: Tensor  # fp32 [MoE layers, E], (token, slot) pairs routed to each expert

    def tensors(self) -> dict[str, Tensor]:
        """What `record` needs, read with the step's other values in one host sync."""
        return {
            "router_aux_loss": self.aux_loss,
            "router_z_loss": self.z_loss,
            "expert_tokens": self.expert_tokens,
        }

    @staticmethod
    def record(host: dict[str, Any]) -> dict[str, object]:
        """The metrics-line fields from the host values of `tensors`: losses, and each layer's
        least and most loaded expert in tokens (`mean`: every expert's share if balanced), and
        over all layers as a fraction of that share (1.0 balanced; min 0.0: an expert that got
        nothing)."""
        tokens = host["expert_tokens"]  # [layers][E] floats
        mean = sum(map(sum, tokens)) / len(tokens) / len(tokens[0])
        low, high = [min(t) for t in tokens], [max(t) for t in tokens]
        return {
            "router_aux_loss": host["router_aux_loss"],
            "router_z_loss": host["router_z_loss"],
            "expert_load_min": min(low) / mean,
            "expert_load_max": max(high) / mean,
            "expert_load": {"mean": mean, "min": low, "max": high},
        }
