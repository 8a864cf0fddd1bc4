"""The run folder's duties: what `OUTPUT_DIR` holds, when it is written, and how a run stops.

    OUTPUT_DIR/config.yaml      the resolved config (written once the run is built)
    OUTPUT_DIR/metrics.jsonl    one JSON object per step (metrics.py)
    OUTPUT_DIR/step_N/          checkpoints every --save-every steps and at the end
    OUTPUT_DIR/merged/          --merge: the LoRA adapters folded into the base
    OUTPUT_DIR/summary.json     the run summary, also printed as the closing line
    OUTPUT_DIR/plot.png, .html  metrics.jsonl's charts, at the end (with matplotlib; plot.py)
    OUTPUT_DIR/eval/            --eval-tasks: lm-eval's results per checkpoint (harness.py)

Everything a user can get wrong about the folder is checked (`check_output_dir`) before the
run is built, and nothing is written until the build succeeded, so a bad flag never leaves a
half-written run behind.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import re
import shutil
import signal
import socket
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from compiletune import hub, interrupt
from compiletune.checkpoint import adapter_io
from compiletune.checkpoint import steps as ckpt
from compiletune.checkpoint.atomic import make_folder, recover
from compiletune.config import (
    SAVED_CONFIG,
    TrainConfig,
    read_saved_config,
    resume_changes,
    save_yaml,
)
from compiletune.data import sources
from compiletune.errors import UserError
from compiletune.harness import EVAL_DIR, RESULTS_LOG
from compiletune.loggers import MLFLOW_DIR, MLFLOW_RUN_ID, WANDB_RUN_ID
from compiletune.metrics import strict_json
from compiletune.models.hf_config import brief
from compiletune.plot import PLOT_FILES
from compiletune.train.step import lr_factor

LOCK_FILE = ".compiletune.lock"


class OutputLock:
    """One run per output folder. `OUTPUT_DIR/.compiletune.lock` is held with `fcntl.flock` for
    the run's life: the kernel gives the lock to exactly one process, however many try at once,
    and drops it when its holder dies (a kill -9 included), so a dead run's lock is taken over
    by exactly one successor. The file's JSON record (pid, host, process start time) is for the
    messages only. On release the holder removes the file before it lets go of the lock, and a
    process that locked a file no longer at the path tries again.

    A record of another host's run (or of a live process here) is honoured even when its lock is
    free: a filesystem shared between hosts may not carry flock across them (NFS without lock
    support), and a run of an older version held the file without flock.

    Entering creates the folder if needed (an uncreatable or unwritable path is one line); a
    folder this lock created is removed again on exit if the run left nothing in it, so a run
    that fails while building writes nothing. `enabled=False` (FSDP ranks other than 0) only
    checks the path: only rank 0 ever takes the lock."""

    def __init__(self, out: Path, enabled: bool = True, say: Any = print) -> None:
        self.out, self.enabled, self.say = out, enabled, say
        self.path = out / LOCK_FILE
        self.created: list[Path] = []
        self.fd: int | None = None

    @property
    def held(self) -> bool:
        return self.fd is not None

    def __enter__(self) -> OutputLock:
        out = self.out
        if out.exists() and not out.is_dir():
            raise UserError(f"--output-dir {out} is a file; pass a folder path")
        if not self.enabled:
            return self
        missing = []
        probe = out
        while not probe.exists() and probe != probe.parent:
            missing.append(probe)
            probe = probe.parent
        make_folder(out, "--output-dir")
        self.created = missing  # deepest first
        try:
            self._take()
        except BaseException:
            self.release()
            raise
        return self

    def _open_locked(self) -> int | None:
        """A descriptor of the lock file at the path, flock'ed by this process; None when a
        live process holds it."""
        while True:
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_RDWR, 0o644)
            except OSError as e:
                raise UserError(
                    f"--output-dir {self.out}: cannot write in it ({e.strerror}); pass a "
                    "writable folder"
                ) from e
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                return None
            try:  # the holder before us may have removed the file we opened
                same = os.stat(self.path).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
            if same:
                return fd
            os.close(fd)

    def _take(self) -> None:
        fd = self._open_locked()
        if fd is None:
            raise UserError(self._in_use(_read_lock(self.path)))
        owner = _read_record(fd)
        if _alive(owner):  # another host's run, or a live one that does not flock (older)
            os.close(fd)
            raise UserError(self._in_use(owner))
        if owner:
            self.say(
                f"taking over the lock of a run that ended without releasing it (process "
                f"{owner.get('pid')} on {owner.get('host')})"
            )
        mine = {"pid": os.getpid(), "host": socket.gethostname(), "start": _start_time(os.getpid())}
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(mine).encode(), 0)
        self.fd = fd
        for done in recover(self.out):  # what a killed run left, now that it is ours
            self.say(done)

    def _in_use(self, owner: dict[str, Any]) -> str:
        who = (
            f"the run of process {owner.get('pid')} on {owner.get('host')}"
            if owner
            else "another run (starting now)"
        )
        return (
            f"--output-dir {self.out} is in use by {who}; wait for it to end, or pass another "
            f"--output-dir (if that run is gone, delete {self.path})"
        )

    def release(self) -> None:
        if self.fd is not None:
            self.path.unlink(missing_ok=True)  # before the lock goes: see _open_locked
            os.close(self.fd)
            self.fd = None
        for folder in self.created:  # deepest first; only folders left empty
            try:
                folder.rmdir()
            except OSError:
                break
        self.created = []

    def keep_folder(self) -> None:
        """The run has written into the folder: it stays whatever happens next."""
        self.created = []

    def __exit__(self, *exc: Any) -> None:
        self.release()


def _start_time(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (Linux), which tells a live owner from
    a new process that got a dead owner's pid."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]


def _parse_record(text: str) -> dict[str, Any]:
    try:
        owner = json.loads(text)
    except ValueError:
        return {}  # empty or half-written: its writer has only just taken the lock, or died
    return owner if isinstance(owner, dict) else {}


def _read_lock(path: Path) -> dict[str, Any]:
    try:
        return _parse_record(path.read_text())
    except OSError:
        return {}


def _read_record(fd: int) -> dict[str, Any]:
    return _parse_record(os.pread(fd, 4096, 0).decode("utf-8", "replace"))


def _alive(owner: dict[str, Any]) -> bool:
    """Could the lock's owner still be running? Another host's process cannot be checked, so it
    counts as alive."""
    pid = owner.get("pid")
    if not isinstance(pid, int):
        return False
    if owner.get("host") != socket.gethostname():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, another user's
    start = _start_time(pid)
    return start is None or owner.get("start") in (None, start)


def check_output_dir(cfg: TrainConfig) -> tuple[Path, list[str]]:
    """The run folder, checked: holding checkpoints only with --resume or --overwrite, and with
    --resume the changes to the saved config judged. Returns the folder and what to tell the
    user about the resumed run. Nothing is written."""
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
            notes += judge_resume(cfg, saved, int(at.name.removeprefix("step_")))
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


def is_disk_full(exc: BaseException) -> bool:
    """A write that failed for want of space: ENOSPC, or the text of it in an error that has no
    errno (torch's zip writer, safetensors' SafetensorError)."""
    return (isinstance(exc, OSError) and exc.errno == errno.ENOSPC) or "No space left" in str(exc)


def merge_error(out: Path, exc: BaseException, last: Path | None) -> str:
    """The one line for a --merge that could not be written; the adapters are saved, and a
    --resume writes merged/ without training."""
    merged = out / adapter_io.MERGED_DIR
    if is_disk_full(exc):
        free = shutil.disk_usage(out).free if out.is_dir() else 0
        return (
            f"the disk of {out} is full: {merged} could not be written ({_gib(free)} free); the "
            f"last checkpoint, {last}, is complete: free some space and run `compiletune train "
            f"--output-dir {out} --resume`, which writes {merged} without training again"
        )
    return (
        f"{merged} could not be written ({type(exc).__name__}: {brief(exc, 300)}); the last "
        f"checkpoint, {last}, is complete (an adapter folder that peft loads on the base model)"
    )


def folder_bytes(folder: Path | None) -> int:
    """Bytes of the files under `folder` (0 if none)."""
    if folder is None or not folder.is_dir():
        return 0
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())


def checkpoint_bytes(run: Any, last: Path | None) -> int:
    """About how much disk one checkpoint takes: the last one's size, else the weights it holds
    (the trainable ones for LoRA, all of them otherwise) plus the optimizer state."""
    if last is not None and (size := folder_bytes(last)):
        return size
    held = run.params if run.lora is not None else list(run.model.parameters())
    weights = sum(p.numel() * p.element_size() for p in held)
    world = run.world  # state_bytes is this rank's shards
    return weights + run.optimizer.state_bytes() * world


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**27 else f"{n / 2**20:.1f} MiB"


def space_warning(out: Path, need: int) -> str | None:
    """A warning line when the disk of `out` has less free space than one checkpoint."""
    free = shutil.disk_usage(out).free
    if free >= need:
        return None
    return (
        f"warning: {out} has {_gib(free)} free but a checkpoint needs about {_gib(need)}; "
        "saving will fail unless space is freed"
    )


def disk_full_error(out: Path, step: int, exc: BaseException, need: int) -> UserError | None:
    """The one line for a checkpoint that failed for want of disk space (None: another cause).
    The half-written folder is gone by now (checkpoint/atomic.py), the previous checkpoint intact."""
    free = shutil.disk_usage(out).free if out.is_dir() else 0
    # torch.save may report a full disk as a RuntimeError of its zip writer with neither the
    # errno nor its text: the free space tells
    full = is_disk_full(exc) or free < need
    if not full:
        return None
    last = ckpt.latest_checkpoint(out)
    then = (
        f"the last complete checkpoint is {last}; free some space and continue from it with "
        "--resume"
        if last
        else "no checkpoint was written; free some space and run the same command again (it "
        "starts over)"
    )
    return UserError(
        f"the disk of {out} is full: step_{step} could not be written ({_gib(free)} free, a "
        f"checkpoint needs about {_gib(need)}); {then}"
    )


def checkpoint_due(cfg: TrainConfig, step: int) -> bool:
    """A periodic checkpoint after `step` (the final one is written whatever --save-every)."""
    every = cfg.run.save_every
    return bool(every) and step % every == 0 and step < cfg.run.max_steps


def write_summary(out: Path, summary: dict[str, Any]) -> None:
    (out / "summary.json").write_text(strict_json(summary, indent=2) + "\n")


def closing_line(s: dict[str, Any]) -> str:
    """The summary as the one line a run ends with: what this invocation did, and after a
    resume what the whole run has done, each labelled; tokens are the data's, padding apart."""
    c = s["compile"]
    total = s.get("run_totals")
    resumed = s["first_step"] > 1
    steps = f"{s['steps']} steps"
    if resumed:
        span = f"steps {s['first_step']}-{s['step']}" if s["steps"] else "no step"
        steps = f"{span} ({s['steps']} this time, {s['step']} in all)"
    if not s["steps"] and s["interrupted"]:  # stopped before its first step ended (a reward)
        saved = f", checkpoint {s['checkpoint']}" if s["checkpoint"] else ""
        return (
            f"stopped early: no step completed (the run is at step {s['step']} of "
            f"{s['max_steps']}){saved}"
        )
    if not s["steps"]:  # a resume that only finished the merge
        parts = [f"no step to train (the run is at step {s['step']} of {s['max_steps']})"]
        if s["merged"]:
            parts.append(f"merged model {s['merged']}")
        return "done: " + ", ".join(parts)
    parts = [f"{steps}, loss {s['first_loss']:.4f} -> {s['final_loss']:.4f}"]
    if s["eval_loss"] is not None:
        ppl = f" (ppl {s['eval_ppl']:.2f})" if s.get("eval_ppl") is not None else ""
        parts.append(f"eval loss {s['eval_loss']:.4f}{ppl}")
    if s.get("eval_reward") is not None:
        parts.append(f"held-out reward {s['eval_reward']:.3f}")
    tokens = f"{s['tokens']} tokens"
    if s["padding_tokens"]:
        tokens += f" (+{s['padding_tokens']} padding)"
    this_time = " this time" if resumed else ""
    parts.append(
        f"{tokens}{this_time} in {s['seconds']:.1f}s ({s['tokens_per_s']:.0f} tok/s)"
        + (f", {total['tokens']} in all in {total['seconds']:.1f}s" if resumed and total else "")
    )
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
class _StopSignals:
    """While entered, SIGINT and SIGTERM go to `_handle`; the previous handlers come back on
    exit."""

    _previous: dict[int, Any] = field(default_factory=dict, kw_only=True)

    def _handle(self, signum: int, frame: Any) -> None:
        raise NotImplementedError

    def __enter__(self):  # noqa: ANN204 - the subclass itself
        for s in (signal.SIGINT, signal.SIGTERM):
            self._previous[s] = signal.getsignal(s)
            signal.signal(s, self._handle)
        return self

    def __exit__(self, *exc: Any) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)


@dataclass
class StopSignal(_StopSignals):
    """SIGINT/SIGTERM: the loop finishes its step, checkpoints, and returns; a second Ctrl-C
    means now.

    `requested` is this process's signal, set at any moment; `agreed` is what the loop acts on.
    In one process they are the same; under FSDP `agreed` changes only through the per-step
    all-reduce, so every rank leaves the loop after the same step whenever each saw the signal.
    """

    distributed: bool = False
    requested: bool = False
    agreed: bool = False

    def should_stop(self) -> bool:
        return self.agreed if self.distributed else self.requested

    def _handle(self, signum: int, frame: Any) -> None:
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True


@dataclass
class LateSignal(_StopSignals):
    """SIGINT/SIGTERM once the run has finished (its checkpoint and merge written): noted in
    `received` (the signal's name), for the trainer to answer once the summary is written."""

    received: str | None = None

    def _handle(self, signum: int, frame: Any) -> None:
        self.received = signal.Signals(signum).name

    def finished(self, interrupted: bool) -> None:
        """The summary is written: a signal after this block, while the process ends, exits
        with the run's status and one line (compiletune.interrupt), not a silent 143."""
        interrupt.run_finished(interrupted)


# Options that may name a Hub repository: (flat key, kind, flag).
_HUB_OPTIONS = (
    ("model_dir", "model", "--model-dir"),
    ("tokenizer", "tokenizer", "--tokenizer"),
    ("teacher_dir", "model", "--teacher-dir"),
    ("data", "dataset", "--data"),
    ("eval_data", "dataset", "--eval-data"),
)


def _parts(value: str, kind: str) -> list[tuple[str, str]]:
    """(source, ":W" or "") for each source of a mixture; one for a model."""
    if kind != "dataset":
        return [(value, "")]
    out = []
    for part in value.split(","):
        head, colon, tail = part.strip().rpartition(":")
        out.append((head, colon + tail) if colon and head else (part.strip(), ""))
    return out


def _hub_ref(text: str, kind: str) -> hub.HubRef | None:
    if (
        text == "pydocs"
        or Path(text).exists()
        or (kind == "dataset" and sources.is_file_spec(text))
    ):
        return None
    return hub.parse(text, dataset=kind == "dataset")


def align_hub_specs(cfg: TrainConfig) -> TrainConfig:
    """--resume naming a Hub repository again without a revision: the commit the run's
    config.yaml holds, so the resumed run reads the same files (no network)."""
    saved = (read_saved_config(cfg.run.output_dir) if cfg.run.resume else None) or {}
    changes = {}
    for key, kind, _ in _HUB_OPTIONS:
        value, was = cfg.get(key), saved.get(key)
        if not (isinstance(value, str) and isinstance(was, str)) or value == was:
            continue
        olds = {}
        for text, _ in _parts(was, kind):
            ref = _hub_ref(text, kind)
            if ref is not None and ref.revision is not None:
                olds[(ref.repo, ref.config)] = text
        parts = []
        for text, weight in _parts(value, kind):
            ref = _hub_ref(text, kind)
            if ref is not None and ref.revision is None:
                text = olds.get((ref.repo, ref.config), text)
            parts.append(text + weight)
        aligned = ",".join(parts)
        if aligned != value:
            changes[key] = aligned
    return cfg.replace(**changes) if changes else cfg


def pin_hub_specs(cfg: TrainConfig) -> TrainConfig:
    """Download what the options name on the Hub and write each as `ORG/NAME@<commit>`, so the
    run's config.yaml (and `--resume`) reads the same files. A value a resumed run keeps as its
    config.yaml has it is left as it is (pinned already, or a run from before pinning)."""
    saved = (read_saved_config(cfg.run.output_dir) if cfg.run.resume else None) or {}
    changes = {}
    for key, kind, flag in _HUB_OPTIONS:
        value = cfg.get(key)
        if not isinstance(value, str) or value == saved.get(key):
            continue
        parts = []
        for text, weight in _parts(value, kind):
            ref = _hub_ref(text, kind)
            if ref is not None and kind == "dataset":
                split = cfg.data.data_split if key == "data" else cfg.data.eval_split
                text = sources.pinned_source(text, split or cfg.data.data_split)
            elif ref is not None:
                folder = hub.model_folder(text, flag, weights=kind == "model")
                text = ref.pinned(folder.name)
            parts.append(text + weight)
        pinned = ",".join(parts) if kind == "dataset" else parts[0]
        if pinned != value:
            changes[key] = pinned
    return cfg.replace(**changes) if changes else cfg


def hub_specs(cfg: TrainConfig) -> str:
    """The run's Hub-capable options, as one string (to compare across processes)."""
    return repr([cfg.get(key) for key, _, _ in _HUB_OPTIONS])
