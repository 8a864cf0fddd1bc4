"""`--ac none|full|selective|budget=F`, parsed: which blocks keep what for backward. Plain data
(no torch), so the CLI checks the flag before torch loads; compiler/activation.py applies it."""

from __future__ import annotations

from dataclasses import dataclass

from compiletune.choices import AcKind, choices
from compiletune.errors import UserError, closest


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
    near = closest(text, choices(AcKind))
    hint = f"; did you mean {near!r}?" if near else ""
    raise UserError(f"--ac must be {named} or budget=F, got {text!r}{hint}")
