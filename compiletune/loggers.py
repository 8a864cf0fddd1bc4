"""`--log tensorboard,wandb,mlflow`: metric loggers beside `metrics.jsonl`.

metrics.jsonl is always written (it is the record `--resume` trims and tests read); these send
the same per-step records to a dashboard. Each logger has two methods, `log(record)` with the
metrics.jsonl object of one step and `close()`. Numbers are logged under `train/<field>`, the
held-out fields `eval_loss`, `eval_ppl`, ... under `eval/<field>`. Each also records the run's
parameters (`run_params`): the resolved config, the trainer's git commit and its version.

All are optional extras (`pip install "compiletune[tensorboard]"`, `"compiletune[wandb]"`,
`"compiletune[mlflow]"`), imported only when asked for; `check_available` runs before the run
folder is touched, so a missing package is one line of error and nothing written.
"""

from __future__ import annotations

import importlib
import json
import logging
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Protocol

from compiletune import __version__
from compiletune.errors import UserError

# logger name -> (module it needs, pyproject extra that installs it)
LOGGERS = {
    "tensorboard": ("tensorboard", "tensorboard"),
    "wandb": ("wandb", "wandb"),
    "mlflow": ("mlflow", "mlflow"),
}


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
        first, extra = LOGGERS[name]
        needed = [first]
        if name == "mlflow" and _mlflow_needs_sql(_mlflow_uri_env()):
            needed += ["sqlalchemy", "alembic"]  # MLflow's database store (mlflow-skinny lacks)
        for module in needed:
            try:
                importlib.import_module(module)
            except ImportError as e:
                raise UserError(
                    f"--log {name} needs the {module} package ({e}); install it with "
                    f'pip install "compiletune[{extra}]" or drop {name} from --log'
                ) from e


def trainer_commit(package: Path | None = None) -> str:
    """The git commit of the trainer: `git rev-parse HEAD` of the checkout holding the
    compiletune package (`package`, default this one), `-dirty` appended when tracked files
    differ from it (`git status --porcelain --untracked-files=no`, as `git describe --dirty`
    counts: a run folder or a scratch file in the checkout does not make it dirty). When the
    package is not tracked by a git checkout (an installed wheel, or a site-packages that
    happens to sit inside someone's repository), or git is absent: the installed version."""
    package = package or Path(__file__).resolve().parent

    def git(*args: str) -> str:
        done = subprocess.run(
            ["git", "-C", str(package), *args],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
            env={**os.environ, "GIT_OPTIONAL_LOCKS": "0"},  # status must not take index.lock
        )
        return done.stdout.strip()

    try:
        git("ls-files", "--error-unmatch", "__init__.py")  # the package is the repo's own
        commit = git("rev-parse", "HEAD")
        dirty = git("status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.SubprocessError):  # no git, not a checkout, no commit yet
        return __version__
    return commit + ("-dirty" if dirty else "")


def _param_text(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, default=str)


def run_params(config: dict[str, Any]) -> dict[str, str]:
    """The run's parameters as the trackers record them: every config key (as in config.yaml;
    a nested mapping becomes `key.sub`), the values as text (strings as they are, others as
    JSON: `null`, `true`, `[1, 2]`), plus `trainer_commit` and `compiletune_version`."""
    out: dict[str, str] = {}

    def add(prefix: str, value: Any) -> None:
        if isinstance(value, dict) and value:
            for key, sub in value.items():
                add(f"{prefix}.{key}", sub)
        else:
            out[prefix] = _param_text(value)

    for key, value in config.items():
        add(str(key), value)
    out["trainer_commit"] = trainer_commit()
    out["compiletune_version"] = __version__
    return out


def scalars(record: dict[str, Any]) -> dict[str, float]:
    """The loggable numbers of a metrics record, named `train/...` or `eval/...`."""
    out = {}
    for key, value in record.items():
        if key == "step" or isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        name = f"eval/{key[5:]}" if key.startswith("eval_") else f"train/{key}"
        out[name] = float(value)
    return out


def _markdown_table(params: dict[str, str]) -> str:
    rows = [f"| {k} | {v.replace('|', chr(92) + '|')} |" for k, v in params.items()]
    return "\n".join(["| parameter | value |", "|---|---|", *rows])


class TensorBoardLogger:
    """Event files under `OUTPUT_DIR/tensorboard` (`tensorboard --logdir OUTPUT_DIR`).

    The parameters are a markdown table in the TEXT tab (tag `params`), at step 0, or at the
    checkpoint's step for a resumed run (so each invocation's parameters show where it began).
    """

    def __init__(
        self, out: Path, resume_step: int | None, params: dict[str, str] | None = None
    ) -> None:
        from torch.utils.tensorboard import SummaryWriter

        # purge_step: a resumed run first hides the events past its checkpoint, which it
        # replays, as MetricsLog does for metrics.jsonl.
        self.writer = SummaryWriter(log_dir=str(out / "tensorboard"), purge_step=resume_step)
        if params:
            self.writer.add_text("params", _markdown_table(params), global_step=resume_step or 0)
            self.writer.flush()

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

    The project is `$WANDB_PROJECT` (default "compiletune"), the run name the output folder's,
    the run's config `config` (open_loggers adds `trainer_commit` and `compiletune_version`).
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


# Where a run folder keeps its MLflow run id, and its local MLflow store (relative to it).
MLFLOW_DIR = "mlflow"
MLFLOW_RUN_ID = f"{MLFLOW_DIR}/run_id"


def _mlflow_uri_env() -> str | None:
    return os.environ.get("MLFLOW_TRACKING_URI") or None


def _mlflow_needs_sql(uri: str | None) -> bool:
    """Does this tracking URI (None: compiletune's default, a SQLite file) need SQLAlchemy?"""
    scheme = (uri or "sqlite:").split(":", 1)[0].split("+", 1)[0].lower()
    return scheme in ("sqlite", "postgresql", "mysql", "mssql")


def _redact(text: str) -> str:
    """`text` without the user and password of a URI (`http://user:pw@host` -> `http://***@host`)."""
    return re.sub(r"//[^/@\s]*@", "//***@", text)


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else repr(e)


class MlflowLogger:
    """An MLflow run, through `MlflowClient` (no global active run).

    The tracking store is `$MLFLOW_TRACKING_URI` when set (a server `http://...`, a database,
    Databricks), else a SQLite file in the run folder, `sqlite:///OUTPUT_DIR/mlflow/mlflow.db`
    (MLflow 3 refuses its old `./mlruns` file store unless told to; SQLite needs no server,
    only SQLAlchemy and Alembic, which the `mlflow` extra installs beside mlflow-skinny).
    Artifacts of that local store go to `OUTPUT_DIR/mlflow/artifacts` (compiletune logs none).
    The experiment is `$MLFLOW_EXPERIMENT_NAME` (default "compiletune"), the run name the
    output folder's. Parameters: `run_params` (values cut to MLflow's length limit).

    The run id is kept in `OUTPUT_DIR/mlflow/run_id`: a resumed training run (`resume_step`)
    continues that run (status back to RUNNING; a run the store no longer has is started
    anew). MLflow parameters cannot change, so a resumed run with changed options records
    the new values as tags `resumed_at_step_N.<key>`. MLflow keeps every value logged at a
    step, so the steps between the checkpoint and a crash hold both attempts' values (a clean
    resume, from the last step logged, has one value per step).

    A store that cannot be reached at the start is one line of error; a failure while
    logging a step is a warning (once) and training goes on: metrics.jsonl has every step.
    """

    def __init__(self, out: Path, params: dict[str, str], resume_step: int | None = None) -> None:
        from mlflow.entities import Param, RunTag
        from mlflow.tracking import MlflowClient
        from mlflow.utils import validation

        uri = _mlflow_uri_env()
        local = uri is None
        folder = out / MLFLOW_DIR
        if local:
            folder.mkdir(parents=True, exist_ok=True)
            uri = f"sqlite:///{(folder / 'mlflow.db').resolve()}"
            # its "Creating initial MLflow database tables..." lines are no news here
            logging.getLogger("mlflow.store.db.utils").setLevel(logging.WARNING)
        name = os.environ.get("MLFLOW_EXPERIMENT_NAME") or "compiletune"
        id_file = out / MLFLOW_RUN_ID
        kept = id_file.read_text().strip() if resume_step is not None and id_file.is_file() else ""
        limit = getattr(validation, "MAX_PARAM_VAL_LENGTH", 500)
        params = {k: v if len(v) <= limit else v[: limit - 3] + "..." for k, v in params.items()}
        self.warned = False
        try:
            self.client = client = MlflowClient(tracking_uri=uri)
            run = None
            if kept:
                try:
                    run = client.get_run(kept)
                except Exception as e:
                    if getattr(e, "error_code", None) != "RESOURCE_DOES_NOT_EXIST":
                        raise  # not reachable: the line below
                    # the store has no such run (MLFLOW_TRACKING_URI changed since, deleted)
                    print(
                        _redact(
                            f"--log mlflow: the run {kept} of {id_file} is not in {uri} "
                            f"({_first_line(e)}); starting a new MLflow run"
                        ),
                        flush=True,
                    )
            if run is None:
                experiment = client.get_experiment_by_name(name)
                if experiment is not None:
                    experiment_id = experiment.experiment_id
                else:
                    where = (folder / "artifacts").resolve().as_uri() if local else None
                    experiment_id = client.create_experiment(name, artifact_location=where)
                run = client.create_run(experiment_id, run_name=out.name)
                new, changed = params, {}
            else:
                client.update_run(run.info.run_id, status="RUNNING")
                old = run.data.params
                new = {k: v for k, v in params.items() if k not in old}
                changed = {k: v for k, v in params.items() if k in old and old[k] != v}
            self.run_id = run.info.run_id
            tags = [RunTag(f"resumed_at_step_{resume_step}.{k}", v) for k, v in changed.items()]
            entries = [Param(k, v) for k, v in new.items()] + tags
            for i in range(0, len(entries), 100):  # MLflow takes 100 params and tags a batch
                batch = entries[i : i + 100]
                client.log_batch(
                    self.run_id,
                    params=[e for e in batch if isinstance(e, Param)],
                    tags=[e for e in batch if isinstance(e, RunTag)],
                )
        except Exception as e:  # MlflowException, requests' connection errors, SQL errors
            if local:
                then = (
                    f"check that {folder} is writable, or set MLFLOW_TRACKING_URI to a tracking "
                    "server"
                )
            else:
                then = (
                    "start the tracking server or correct MLFLOW_TRACKING_URI (unset, runs log "
                    f"into OUTPUT_DIR/{MLFLOW_DIR}/)"
                )
            raise UserError(
                _redact(
                    f"--log mlflow: the MLflow tracking store {uri} failed ({_first_line(e)}); "
                    f"{then}, or drop mlflow from --log"
                )
            ) from e
        id_file.parent.mkdir(parents=True, exist_ok=True)
        id_file.write_text(self.run_id)

    def log(self, record: dict[str, Any]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [
            Metric(_mlflow_name(k), v, now, record["step"]) for k, v in scalars(record).items()
        ]
        try:
            self.client.log_batch(self.run_id, metrics=metrics)
        except Exception as e:  # the dashboard is not worth the run: metrics.jsonl has it
            if not self.warned:
                self.warned = True
                print(
                    f"warning: --log mlflow: logging step {record['step']} failed "
                    f"({_first_line(e)}); training goes on (metrics.jsonl has every step)",
                    flush=True,
                )

    def close(self) -> None:
        # close() runs in the trainer's `finally`: an exception on its way out is the run's end
        error = sys.exc_info()[0]
        status = "FINISHED"
        if error is not None:
            status = "KILLED" if issubclass(error, KeyboardInterrupt) else "FAILED"
        try:
            self.client.set_terminated(self.run_id, status=status)
        except Exception as e:
            print(f"warning: --log mlflow: ending the run failed ({_first_line(e)})", flush=True)


def _mlflow_name(name: str) -> str:
    """A metric name MLflow accepts (letters, digits, `_ - . / space`)."""
    return re.sub(r"[^\w\-./ ]", "_", name)


def open_loggers(
    names: list[str], out: Path, config: dict[str, Any], resume_step: int | None
) -> list[MetricLogger]:
    """The loggers `names` for the run in `out`; `config` is the run's (`cfg.to_dict()`)."""
    if not names:
        return []
    params = run_params(config)
    trainer = {k: params[k] for k in ("trainer_commit", "compiletune_version")}
    loggers: list[MetricLogger] = []
    try:
        for name in names:
            if name == "tensorboard":
                loggers.append(TensorBoardLogger(out, resume_step, params))
            elif name == "wandb":
                loggers.append(
                    WandbLogger(out, {**config, **trainer}, resuming=resume_step is not None)
                )
            else:
                loggers.append(MlflowLogger(out, params, resume_step))
    except BaseException:  # one that cannot start: close the ones already open
        for logger in loggers:
            logger.close()
        raise
    return loggers
