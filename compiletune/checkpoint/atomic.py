"""Folders that appear whole or not at all: written under a temporary name, flushed, renamed.

A rename within one folder is atomic, so a crash mid-write leaves only a `.tmp-<name>` folder,
which readers (`--resume`, `checkpoint.list_checkpoints`) never take for a complete one.
"""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path

from compiletune import faults
from compiletune.errors import UserError


def make_folder(path: Path, flag: str) -> None:
    """Create the user-given folder `path` (and its parents); failure is one line naming
    `flag`."""

    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UserError(
            f"{flag} {path}: cannot create it ({e.strerror}); pass a writable path"
        ) from e


def write_folder_atomically(final: Path, write: Callable[[Path], None]) -> Path:
    """`write(tmp)` fills a temporary sibling `.tmp-<name>`, which then replaces `final`."""
    tmp = final.parent / f".tmp-{final.name}"
    if tmp.exists():
        shutil.rmtree(tmp)
    try:
        write(tmp)
        fsync_tree(tmp)
    except BaseException:
        # A failed write (a full disk, an interrupt) leaves nothing behind to fill the disk.
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    publish(tmp, final)
    return final


def publish(tmp: Path, final: Path) -> None:
    """Rename the finished `tmp` to `final` (atomic within one folder)."""
    if final.exists():  # re-saving a step (e.g. after a resume): swap, never delete first
        old = final.parent / f".old-{final.name}"
        if old.exists():
            shutil.rmtree(old)
        os.replace(final, old)
        faults.point("publish")  # between the two renames: recover() puts `old` back
        os.replace(tmp, final)
        shutil.rmtree(old)
    else:
        os.replace(tmp, final)


def fsync_tree(folder: Path) -> None:
    """Flush file contents to disk before the rename makes the checkpoint visible."""
    for child in folder.rglob("*"):
        if child.is_file():
            fd = os.open(child, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)


# What a run folder's writers publish (checkpoints, --merge): only their leftovers are tidied.
PUBLISHED = re.compile(r"step_\d+|merged")


def recover(folder: Path) -> list[str]:
    """Tidy what a killed writer left in run folder `folder`: a `.old-<name>` whose `<name>` is
    missing is the complete previous copy (killed mid-swap) and is renamed back; other `.old-*`
    and every `.tmp-*` are removed. Only names a run publishes (PUBLISHED) are touched: a
    user's `.tmp-notes` beside a run stays. Returns what was done, for the user."""
    done = []
    if not folder.is_dir():
        return done
    for child in sorted(folder.iterdir()):
        if not PUBLISHED.fullmatch(child.name.removeprefix(".old-").removeprefix(".tmp-")):
            continue
        if child.name.startswith(".old-"):
            final = folder / child.name.removeprefix(".old-")
            if final.exists():
                shutil.rmtree(child, ignore_errors=True)
            else:
                os.replace(child, final)
                done.append(f"restored {final.name} from an interrupted save")
        elif child.name.startswith(".tmp-"):
            shutil.rmtree(child, ignore_errors=True)
            done.append(f"removed the half-written {child.name}")
    return done
