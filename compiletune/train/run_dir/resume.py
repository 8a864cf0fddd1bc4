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


def judge_resume(
    cfg: TrainConfig, saved: dict[str, Any], at_step: int, worlds: tuple[int, int] = (1, 1)
) -> list[str]:
    """Refuse a resume whose options change the result (unless --accept-changes); explain a
    changed length. `worlds`: (processes that wrote the checkpoint, processes of this run).
    Returns the lines to print."""
    kinds = resume_changes(saved, cfg)
    if kinds["fixed"]:
        raise UserError(
            f"--resume: {'; '.join(kinds['fixed'])}: the checkpoint holds the run's model, "
            "adapters and optimizer state, which a resumed run keeps; drop these options, or "
            "start a new run from the checkpoint's weights with --model-dir"
        )
    check_ep_change(cfg, saved)
    changed, notes = judge_world_change(cfg, saved, *worlds, kinds["same"])
    if changed and not cfg.run.accept_changes:
        raise UserError(
            f"--resume: these options differ from the run's {SAVED_CONFIG} and change its result: "
            f"{'; '.join(changed)}; drop them to continue the run as it was, or add "
            "--accept-changes to continue with them"
        )
    if changed:
        notes.append(f"--resume with changed options (accepted): {'; '.join(changed)}")
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


def global_batch(batch_size: int, grad_accum: int, world: int, cp: int) -> int:
    """Rows per optimizer step: --batch-size x --grad-accum x the data-parallel processes."""
    return batch_size * grad_accum * max(1, world // cp)


def judge_world_change(
    cfg: TrainConfig, saved: dict[str, Any], old_world: int, world: int, changed: list[str]
) -> tuple[list[str], list[str]]:
    """A resume on another number of processes: (the changes that alter the result, the
    lines to print). The data position is a row of the epoch's order, the same whatever the
    batch, so the run continues at the row it had reached. With the same global batch the
    steps are the ones the old run would have taken (a --batch-size or --grad-accum change
    that keeps it is no change); another global batch is a change of the result."""
    if old_world == world:
        return changed, []
    d = cfg.data
    old = global_batch(
        saved.get("batch_size", d.batch_size),
        saved.get("grad_accum", d.grad_accum),
        old_world,
        saved.get("cp", cfg.parallel.cp),
    )
    new = global_batch(d.batch_size, d.grad_accum, world, cfg.parallel.cp)
    said = (
        f"--resume on {world} process{'es' * (world > 1)} (the checkpoint's run had "
        f"{old_world}): the weights and AdamW's moments are resharded as they load, and the "
        "data continue at the row the run had reached"
    )
    if old == new:
        kept = [c for c in changed if not c.startswith(("--batch-size ", "--grad-accum "))]
        return kept, [f"{said}; the global batch stays {new} rows per step"]
    groups = max(1, world // cfg.parallel.cp)
    fits = old % (groups * d.grad_accum) == 0
    keep = f"; --batch-size {old // (groups * d.grad_accum)} keeps it" if fits else ""
    what = (
        f"the global batch {old} -> {new} rows per step (--batch-size x --grad-accum x "
        f"{groups} data-parallel process{'es' * (groups > 1)}{keep})"
    )
    return [*changed, what], [said]


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
