"""`--log tensorboard,wandb`: metric loggers beside `metrics.jsonl`.

metrics.jsonl is always written (it is the record `--resume` trims and tests read); these send
the same per-step records to a dashboard. Each logger has two methods, `log(record)` with the
metrics.jsonl object of one step and `close()`. Numbers are logged under `train/<field>`, the
held-out fields `eval_loss`, `eval_ppl`, ... under `eval/<field>`.

Both are optional extras (`pip install "compiletune[tensorboard]"`, `"compiletune[wandb]"`),
imported only when asked for; `check_available` runs before the run folder is touched, so a
missing package is one line of error and nothing written.
"""

from __future__ import annotations

import importlib
import os
from pathlib import Path
from typing import Any, Protocol

from compiletune.errors import UserError

# logger name -> (module it needs, pyproject extra that installs it)
LOGGERS = {"tensorboard": ("tensorboard", "tensorboard"), "wandb": ("wandb", "wandb")}


class MetricLogger(Protocol):
    def log(self, record: dict[str, Any]) -> None: ...

    def close(self) -> None: ...


def parse_loggers(text: str | list[str] | None) -> list[str]:
    """'tensorboard,wandb' (or a YAML list of names) -> ['tensorboard', 'wandb']; None -> []."""
    if isinstance(text, list):
        text = ",".join(map(str, text))
    if text is not None and not isinstance(text, str):
        raise UserError(f"--log must be names separated by commas, got {text!r}")
    names = [name.strip() for name in (text or "").split(",") if name.strip()]
    for name in names:
        if name not in LOGGERS:
            raise UserError(
                f"--log {text}: unknown logger {name!r}; choose from {', '.join(LOGGERS)} "
                "(comma-separated)"
            )
    return list(dict.fromkeys(names))


def check_available(names: list[str]) -> None:
    """Import each logger's package now, so a missing one fails before anything is written."""
    for name in names:
        module, extra = LOGGERS[name]
        try:
            importlib.import_module(module)
        except ImportError as e:
            raise UserError(
                f"--log {name} needs the {module} package ({e}); install it with "
                f'pip install "compiletune[{extra}]" or drop {name} from --log'
            ) from e


def scalars(record: dict[str, Any]) -> dict[str, float]:
    """The loggable numbers of a metrics record, named `train/...` or `eval/...`."""
    out = {}
    for key, value in record.items():
        if key == "step" or isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        name = f"eval/{key[5:]}" if key.startswith("eval_") else f"train/{key}"
        out[name] = float(value)
    return out


class TensorBoardLogger:
    """Event files under `OUTPUT_DIR/tensorboard` (`tensorboard --logdir OUTPUT_DIR`)."""

    def __init__(self, out: Path, resume_step: int | None) -> None:
        from torch.utils.tensorboard import SummaryWriter

        # purge_step: a resumed run first hides the events past its checkpoint, which it
        # replays, as MetricsLog does for metrics.jsonl.
        self.writer = SummaryWriter(log_dir=str(out / "tensorboard"), purge_step=resume_step)

    def log(self, record: dict[str, Any]) -> None:
        for name, value in scalars(record).items():
            self.writer.add_scalar(name, value, global_step=record["step"])
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


# Where a run folder keeps its W&B run id (relative to the folder).
WANDB_RUN_ID = "wandb/run_id"


class WandbLogger:
    """A Weights & Biases run in `OUTPUT_DIR/wandb`.

    The project is `$WANDB_PROJECT` (default "compiletune"), the run name the output folder's.
    `WANDB_MODE=offline` writes the run locally with no network or account
    (`wandb sync OUTPUT_DIR/wandb/offline-run-*` uploads it later). The run's id is kept in
    `OUTPUT_DIR/wandb/run_id`: a resumed training run (`resuming`) continues that W&B run
    instead of starting a new one. W&B keeps the first value logged at a step, so the steps
    between the checkpoint and a crash keep what the first attempt logged for them.
    """

    def __init__(self, out: Path, config: dict[str, Any], resuming: bool = False) -> None:
        import wandb

        id_file = out / WANDB_RUN_ID
        run_id = id_file.read_text().strip() if resuming and id_file.is_file() else None
        try:
            self.run = wandb.init(
                project=os.environ.get("WANDB_PROJECT", "compiletune"),
                name=out.name,
                dir=str(out),
                config=config,
                id=run_id,
                resume="allow" if run_id else None,
                # compiletune prints its own progress; wandb should not rewrap stdout.
                settings=wandb.Settings(console="off"),
            )
        except Exception as e:  # wandb raises its own error types for login/network trouble
            raise UserError(
                f"--log wandb: wandb.init failed ({str(e).splitlines()[0] if str(e) else e!r}); "
                "run `wandb login`, or set WANDB_MODE=offline to log without network"
            ) from e
        id_file.parent.mkdir(parents=True, exist_ok=True)
        id_file.write_text(self.run.id)

    def log(self, record: dict[str, Any]) -> None:
        self.run.log(scalars(record), step=record["step"])

    def close(self) -> None:
        import wandb

        self.run.finish()
        # finish() can return before wandb's service has written the run (offline runs in 0.31
        # do); teardown waits for it, so the run is on disk when training returns.
        wandb.teardown()


def open_loggers(
    names: list[str], out: Path, config: dict[str, Any], resume_step: int | None
) -> list[MetricLogger]:
    loggers: list[MetricLogger] = []
    for name in names:
        if name == "tensorboard":
            loggers.append(TensorBoardLogger(out, resume_step))
        else:
            loggers.append(WandbLogger(out, config, resuming=resume_step is not None))
    return loggers
