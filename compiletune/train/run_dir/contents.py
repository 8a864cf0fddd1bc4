"""What a run folder may hold and when a run writes to it: the checks before the build
(`check_output_dir`: checkpoints only with --resume or --overwrite, a user's own folder
refused), the folder prepared once the run is built (`prepare_output_dir`: an --overwrite'n
run's files cleared, config.yaml written), and the cadence of periodic checkpoints.

Its own room because it alone knows which entries are a run's (`foreign_files`,
`_written_by_a_run`): the rules for what may be deleted live in one place.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

from compiletune.checkpoint import adapter_io
from compiletune.checkpoint import steps as ckpt
from compiletune.config import SAVED_CONFIG, TrainConfig, read_saved_config, save_yaml
from compiletune.errors import UserError
from compiletune.harness import EVAL_DIR, RESULTS_LOG
from compiletune.loggers import MLFLOW_DIR, MLFLOW_RUN_ID, WANDB_RUN_ID
from compiletune.plot import PLOT_FILES
from compiletune.train.run_dir.lock import LOCK_FILE
from compiletune.train.run_dir.resume import judge_resume


def check_output_dir(cfg: TrainConfig, world: int = 1) -> tuple[Path, list[str]]:
    """The run folder, checked: holding checkpoints only with --resume or --overwrite, and with
    --resume the changes to the saved config judged (`world`: this run's processes, against
    the checkpoint's). Returns the folder and what to tell the user about the resumed run.
    Nothing is written."""
    out = Path(cfg.run.output_dir)
    if out.exists() and not out.is_dir():
        raise UserError(f"--output-dir {out} is a file; pass a folder path")
    existing = ckpt.list_checkpoints(out)
    if cfg.run.resume and not existing:
        raise UserError(
            f"--resume: {out} holds no complete checkpoint (step_N/ with {ckpt.STATE_FILE}); "
            "drop --resume to start a new run"
        )
    if existing and not cfg.run.resume and not cfg.run.overwrite:
        raise UserError(
            f"--output-dir {out} already holds checkpoints (up to {existing[-1][1].name}); "
            "pass --resume to continue, --overwrite to start over, or another --output-dir"
        )
    notes: list[str] = []
    foreign = foreign_files(out)
    if foreign and not cfg.run.overwrite:
        raise UserError(
            f"--output-dir {out} holds files that are not a compiletune run's "
            f"({_names(foreign)}); pass a new folder (a subfolder such as {out / 'run'} is "
            "fine), or --overwrite to train into it beside them (they are never deleted)"
        )
    if foreign and cfg.run.overwrite:
        notes.append(
            f"--overwrite: {out} holds {len(foreign)} entries that are not this run's "
            f"({_names(foreign)}); they are kept, and only a run's own files are replaced"
        )
    if cfg.run.resume:
        # the checkpoint the build will resume from (it says why, if not the newest)
        at = ckpt.pick_resume(out, cfg.run.resume_from, lambda line: None)
        saved = read_saved_config(out)
        if saved is not None:
            # a sharded checkpoint without --fsdp, or a single-process one with it: refused by
            # checkpoint/steps.check_resumable (no advice on the batch before that refusal)
            sharded = cfg.parallel.fsdp and ckpt.is_sharded(at)
            written = ckpt.load_train_state(at).get("world_size", 1) if sharded else world
            step = int(at.name.removeprefix("step_"))
            notes += judge_resume(cfg, saved, step, (written, world))
    return out, notes


# What a run folder holds (besides what a user may add to a run's folder afterwards).
_RUN_ENTRIES = {
    SAVED_CONFIG,
    "metrics.jsonl",
    "summary.json",
    "tensorboard",
    "wandb",
    MLFLOW_DIR,
    *PLOT_FILES,
    EVAL_DIR,
}


def foreign_files(out: Path) -> list[Path]:
    """The entries of `out` that no compiletune run writes, when `out` is not a run's folder
    ([] for a run's folder, an empty folder or none): a user's own folder that a run must not
    fill with checkpoints."""
    if not out.is_dir():
        return []
    entries = sorted(e for e in out.iterdir() if e.name != LOCK_FILE)  # (this run's, by now)
    ours = [
        e
        for e in entries
        if e.name in _RUN_ENTRIES or re.fullmatch(r"(\.tmp-|\.old-)?(step_\d+|merged)", e.name)
    ]
    if ours:  # a run's folder, whatever else the user put beside it
        return []
    return entries


def _names(paths: list[Path], most: int = 3) -> str:
    names = ", ".join(p.name for p in paths[:most])
    return names + (f" and {len(paths) - most} more" if len(paths) > most else "")


def prepare_output_dir(cfg: TrainConfig, out: Path) -> None:
    """Rank 0, once the run is built: clear an --overwrite'n run, write config.yaml."""
    if cfg.run.overwrite and out.exists():
        # Only what a run wrote, recognised by its contents: a user's folder that happens to be
        # named step_N, merged or eval stays.
        for _, path in ckpt.list_checkpoints(out):  # each holds a compiletune training state
            shutil.rmtree(path)
        for folder in (out / adapter_io.MERGED_DIR, out / EVAL_DIR):
            if _written_by_a_run(folder):
                shutil.rmtree(folder)
        # The W&B and MLflow run ids too: a later --resume must not continue the discarded
        # run (the runs themselves stay in their stores).
        for stale in ("metrics.jsonl", "summary.json", WANDB_RUN_ID, MLFLOW_RUN_ID):
            (out / stale).unlink(missing_ok=True)
    out.mkdir(parents=True, exist_ok=True)
    for stale in PLOT_FILES:  # charts of metrics.jsonl as it was; redrawn at the run's end
        (out / stale).unlink(missing_ok=True)
    save_yaml(cfg, out / SAVED_CONFIG)


def _written_by_a_run(folder: Path) -> bool:
    """Whether `folder` (OUTPUT_DIR/merged or OUTPUT_DIR/eval) holds only what a run writes:
    merged/ an HF export (config.json, safetensors weights, tokenizer and generation files),
    eval/ lm-eval's log and a results folder per checkpoint."""
    if not folder.is_dir():
        return False
    names = [e.name for e in folder.iterdir()]
    if folder.name == EVAL_DIR:
        return all(n == RESULTS_LOG or re.fullmatch(r"step_\d+|merged", n) for n in names)
    weights = [n for n in names if re.fullmatch(r"model.*\.safetensors", n)]
    export = re.compile(
        r"config\.json|generation_config\.json|model.*\.safetensors(\.index\.json)?|"
        r"tokenizer.*|special_tokens_map\.json|chat_template\.j(inja|son)|vocab\..*|merges\.txt|"
        r"added_tokens\.json|(video_)?(pre)?processor_config\.json"
    )
    return "config.json" in names and bool(weights) and all(export.fullmatch(n) for n in names)


def checkpoint_due(cfg: TrainConfig, step: int) -> bool:
    """A periodic checkpoint after `step` (the final one is written whatever --save-every)."""
    every = cfg.run.save_every
    return bool(every) and step % every == 0 and step < cfg.run.max_steps
