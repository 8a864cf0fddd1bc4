"""The run folder's duties: what `OUTPUT_DIR` holds, when it is written, and how a run stops.

    OUTPUT_DIR/config.yaml      the resolved config (written once the run is built)
    OUTPUT_DIR/metrics.jsonl    one JSON object per step (metrics.py)
    OUTPUT_DIR/step_N/          checkpoints every --save-every steps and at the end
    OUTPUT_DIR/merged/          --merge: the LoRA adapters folded into the base
    OUTPUT_DIR/summary.json     the run summary, also printed as the closing line

Everything a user can get wrong about the folder is checked (`check_output_dir`) before the
run is built, and nothing is written until the build succeeded, so a bad flag never leaves a
half-written run behind.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from compiletune import adapter_io
from compiletune import checkpoint as ckpt
from compiletune.config import TrainConfig, save_yaml
from compiletune.errors import UserError
from compiletune.loggers import WANDB_RUN_ID


def check_output_dir(cfg: TrainConfig) -> Path:
    """The run folder, checked: writable, and holding checkpoints only with --resume or
    --overwrite. Nothing is created yet."""
    out = Path(cfg.run.output_dir)
    if out.exists() and not out.is_dir():
        raise UserError(f"--output-dir {out} is a file; pass a folder path")
    # The nearest existing ancestor must be a writable folder.
    probe = out
    while not probe.exists():
        probe = probe.parent
    if not probe.is_dir() or not os.access(probe, os.W_OK | os.X_OK):
        raise UserError(f"--output-dir {out}: {probe} is not a writable folder; pass another path")
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
    return out


def prepare_output_dir(cfg: TrainConfig, out: Path) -> None:
    """Rank 0, once the run is built: clear an --overwrite'n run, write config.yaml."""
    if cfg.run.overwrite and out.exists():
        for _, path in ckpt.list_checkpoints(out):
            shutil.rmtree(path)
        if (out / adapter_io.MERGED_DIR).is_dir():
            shutil.rmtree(out / adapter_io.MERGED_DIR)
        # The W&B run id too: a later --resume must not continue the discarded run.
        for stale in ("metrics.jsonl", "summary.json", WANDB_RUN_ID):
            (out / stale).unlink(missing_ok=True)
    out.mkdir(parents=True, exist_ok=True)
    save_yaml(cfg, out / "config.yaml")


def checkpoint_due(cfg: TrainConfig, step: int) -> bool:
    """A periodic checkpoint after `step` (the final one is written whatever --save-every)."""
    every = cfg.run.save_every
    return bool(every) and step % every == 0 and step < cfg.run.max_steps


def write_summary(out: Path, summary: dict[str, Any]) -> None:
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")


def closing_line(s: dict[str, Any]) -> str:
    """The summary as the one line a run ends with."""
    c = s["compile"]
    parts = [
        f"{s['steps']} steps, loss {s['first_loss']:.4f} -> {s['final_loss']:.4f}",
    ]
    if s["eval_loss"] is not None:
        parts.append(f"eval loss {s['eval_loss']:.4f} (ppl {s['eval_ppl']:.2f})")
    parts.append(f"{s['tokens']} tokens in {s['seconds']:.1f}s ({s['tokens_per_s']:.0f} tok/s)")
    parts.append(f"peak mem {s['peak_mem_gib']:.2f} GiB")
    if c:
        parts.append(
            f"{c['compiles']} compiles ({c['recompiles']} recompiles, {c['compile_seconds']:.1f}s)"
        )
    if s["helper_graphs"]:
        parts.append(f"{s['helper_graphs']} helper graphs compiled")
    last = f"checkpoint {s['checkpoint']}"
    if s["merged"]:
        last += f", merged model {s['merged']}"
    parts.append(last)
    return ("stopped early: " if s["interrupted"] else "done: ") + ", ".join(parts)


@dataclass
class StopSignal:
    """SIGINT/SIGTERM: the loop finishes its step, checkpoints, and returns; a second Ctrl-C
    means now.

    `requested` is this process's signal, set at any moment; `agreed` is what the loop acts on.
    In one process they are the same; under FSDP `agreed` changes only through the per-step
    all-reduce, so every rank leaves the loop after the same step whenever each saw the signal.
    """

    distributed: bool = False
    requested: bool = False
    agreed: bool = False
    _previous: dict[int, Any] = field(default_factory=dict)

    def should_stop(self) -> bool:
        return self.agreed if self.distributed else self.requested

    def _handle(self, signum: int, frame: Any) -> None:
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True

    def __enter__(self) -> StopSignal:
        for s in (signal.SIGINT, signal.SIGTERM):
            self._previous[s] = signal.getsignal(s)
            signal.signal(s, self._handle)
        return self

    def __exit__(self, *exc: Any) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)
