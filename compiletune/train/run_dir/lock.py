"""One run per output folder: `OutputLock`, held for the run's life.

Its own room because it is the one part of the folder's duties that deals with other processes
(flock, the lock file's record, telling a live owner from a dead one); nothing else here does.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
from pathlib import Path
from typing import Any

from compiletune.checkpoint.atomic import make_folder, recover
from compiletune.errors import UserError

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
