"""A full disk: the warning when a checkpoint will not fit the free space, and the one line
(naming the last complete checkpoint and how to go on) when a checkpoint or --merge could not
be written; the sizes they judge by.

Its own room because a full disk shows itself in many forms (ENOSPC, torch's zip writer,
safetensors' error, nothing but the free space): recognising it is kept in one place.
"""

from __future__ import annotations

import errno
import shutil
from pathlib import Path
from typing import Any

from compiletune.checkpoint import adapter_io
from compiletune.checkpoint import steps as ckpt
from compiletune.errors import UserError
from compiletune.models.hf_config import brief


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
