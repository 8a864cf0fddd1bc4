"""`--offload-activations [N|all|auto]`, parsed: how many blocks send what they save for backward
to host memory. Plain data (no torch), so the CLI checks the flag before torch loads;
passes/offload_activations.py moves the tensors, estimate/offload_plan.py turns `auto` into N.

Which blocks: the first N. Block 0's saved activations live longest (saved first in the forward,
read last in the backward), so moving them frees device memory over the longest stretch of the
step, and their copy to the host overlaps the forward of every block after it. The last block's
are read back right after the loss head: moving them frees nothing at the step's peak (the turn
from forward to backward) and leaves their copy no compute to hide behind.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from compiletune.errors import UserError, closest

_WORDS = ("all", "auto")


@dataclass(frozen=True)
class OffloadTarget:
    """`blocks`: the first N blocks offload (0: none, off); None: every block (`all`, or the
    flag alone / `true` in YAML, its meaning before N existed). `auto`: N is chosen by the
    memory estimate (`estimate.offload_plan.plan_offload`) before anything is built."""

    blocks: int | None = 0
    auto: bool = False

    @classmethod
    def parse(cls, value: Any) -> OffloadTarget:
        """A flag's text, a YAML value (true / false / N / "all" / "auto") or a target."""
        if isinstance(value, OffloadTarget):
            return value
        if value is None or value is False:
            return cls(0)
        if value is True:
            return cls(None)
        text = value.strip().lower() if isinstance(value, str) else value
        if text == "all":
            return cls(None)
        if text == "auto":
            return cls(0, auto=True)
        if isinstance(text, str) and text.lstrip("-").isdigit():
            text = int(text)
        if isinstance(text, int) and text >= 0:
            return cls(text)
        near = closest(text, _WORDS) if isinstance(text, str) else None
        hint = f"; did you mean {near!r}?" if near else ""
        raise UserError(
            f"--offload-activations takes a number of blocks (0 or more), all (the flag alone) "
            f"or auto, got {value!r}{hint}"
        )

    def __bool__(self) -> bool:
        """Whether any block may offload (auto included): what needs --compile."""
        return self.auto or self.blocks != 0

    def count(self, n_layers: int) -> int:
        """How many blocks (the first ones) of a model of `n_layers` offload."""
        if self.auto:
            raise ValueError("--offload-activations auto is planned (plan_offload) before a build")
        if self.blocks is None:
            return n_layers
        if self.blocks > n_layers:
            raise UserError(
                f"--offload-activations {self.blocks}: the model has {n_layers} blocks; pass at "
                f"most {n_layers} (or all)"
            )
        return self.blocks

    def to_config(self) -> bool | int | str:
        """The YAML form (config.yaml, `cfg.replace`): false, true (all), N or "auto"."""
        if self.auto:
            return "auto"
        return True if self.blocks is None else (self.blocks or False)

    def __str__(self) -> str:
        return "auto" if self.auto else "all" if self.blocks is None else str(self.blocks)
