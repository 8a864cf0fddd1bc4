"""Judging a --resume against the run's config.yaml: options that change the run's result are
refused (unless --accept-changes), options the checkpoint fixes are refused outright, and a
changed length is explained with the learning rate it gives.

Its own room because it is policy, not file handling: what a resumed run may change, decided
from the config alone (the checkpoint it resumes from is picked by checkpoint/steps.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from compiletune.checkpoint import adapter_io
from compiletune.config import SAVED_CONFIG, TrainConfig, resume_changes
from compiletune.errors import UserError
from compiletune.train.step import lr_factor


def judge_resume(cfg: TrainConfig, saved: dict[str, Any], at_step: int) -> list[str]:
    """Refuse a resume whose options change the result (unless --accept-changes); explain a
    changed length. Returns the lines to print."""
    kinds = resume_changes(saved, cfg)
    if kinds["fixed"]:
        raise UserError(
            f"--resume: {'; '.join(kinds['fixed'])}: the checkpoint holds the run's model, "
            "adapters and optimizer state, which a resumed run keeps; drop these options, or "
            "start a new run from the checkpoint's weights with --model-dir"
        )
    check_ep_change(cfg, saved)
    changed = kinds["same"]
    if changed and not cfg.run.accept_changes:
        raise UserError(
            f"--resume: these options differ from the run's {SAVED_CONFIG} and change its result: "
            f"{'; '.join(changed)}; drop them to continue the run as it was, or add "
            "--accept-changes to continue with them"
        )
    notes = [f"--resume with changed options (accepted): {'; '.join(changed)}"] if changed else []
    new, old = cfg.run.max_steps, saved.get("max_steps")
    if new is not None:
        check_length(new, at_step, merge_pending(cfg, Path(cfg.run.output_dir)))
        if isinstance(old, int) and new != old:
            notes.append(
                f"--max-steps {new} (was {old}): the {cfg.optim.schedule} learning-rate schedule "
                f"now ends at step {new}; the lr at step {at_step} becomes "
                f"{_lr_at(cfg, at_step, new):.3g} (it was {_lr_at(cfg, at_step, old):.3g})"
            )
    if cfg.run.epochs is not None and saved.get("epochs") not in (None, cfg.run.epochs):
        notes.append(
            f"--epochs {cfg.run.epochs} (was {saved['epochs']}): the run's length and "
            "learning-rate schedule are recomputed for the new number of epochs"
        )
    return notes


def check_ep_change(cfg: TrainConfig, saved: dict[str, Any]) -> None:
    """A resume may change --ep (the sharded checkpoint holds the experts and AdamW's moments
    whole), except with 8-bit AdamW, whose blocks are cut from each process's own slice."""
    old = saved.get("ep", 1)
    if old != cfg.parallel.ep and cfg.optim.optimizer == "adamw8bit":
        raise UserError(
            f"--resume: --ep {old} -> {cfg.parallel.ep}: 8-bit AdamW keeps its state in blocks "
            f"of each process's own slice of the experts, which another --ep cuts differently; "
            f"resume with --ep {old}"
        )


def merge_pending(cfg: TrainConfig, out: Path) -> bool:
    """--merge asked for and merged/ not written (a run killed while merging)."""
    return cfg.lora.merge and not (out / adapter_io.MERGED_DIR).is_dir()


def check_length(max_steps: int, at_step: int, merge_pending: bool = False) -> None:
    """A resumed run must have steps left to train, or, at its last step, a merge to finish."""
    if max_steps == at_step and merge_pending:
        return
    if max_steps <= at_step:
        raise UserError(
            f"--max-steps {max_steps}: the latest checkpoint is already at step {at_step}; pass "
            f"--max-steps above {at_step} to train on"
        )


def _lr_at(cfg: TrainConfig, step: int, max_steps: int) -> float:

    return cfg.optim.lr * lr_factor(step, cfg.replace(max_steps=max_steps, epochs=None))
