"""The output-folder lock under a race: processes released at once through a barrier, hundreds
of times, on a fresh folder and on one holding a dead run's lock; exactly one holds it each
time (issue 45)."""

from __future__ import annotations

import json
import multiprocessing as mp
import socket
from pathlib import Path

import pytest

from compiletune.errors import UserError
from compiletune.train.run_dir.lock import LOCK_FILE, OutputLock

TRIALS = 500
DEAD_PID = 4_194_303 + 12_345  # above Linux's largest pid: never a live process


def _contender(folders: list[str], barrier, wins, me: int, k: int) -> None:
    for trial, folder in enumerate(folders):
        barrier.wait()
        lock = OutputLock(Path(folder), say=lambda s: None)
        try:
            lock.__enter__()
            wins[trial * k + me] = 1
        except UserError:
            wins[trial * k + me] = 0
        barrier.wait()  # every contender has tried while the winner still holds it
        lock.release()
        barrier.wait()


@pytest.mark.parametrize("k", [2, 3])
@pytest.mark.parametrize("mode", ["fresh", "dead-owner"])
def test_exactly_one_of_k_racing_processes_holds_the_lock(tmp_path, mode, k):
    folders = []
    for trial in range(TRIALS):
        folder = tmp_path / f"run{trial}"
        if mode == "dead-owner":  # a run killed while it held the folder
            folder.mkdir()
            record = {"pid": DEAD_PID, "host": socket.gethostname(), "start": "1"}
            (folder / LOCK_FILE).write_text(json.dumps(record))
        folders.append(str(folder))
    ctx = mp.get_context("fork")
    barrier, wins = ctx.Barrier(k), ctx.Array("b", TRIALS * k)
    procs = [ctx.Process(target=_contender, args=(folders, barrier, wins, i, k)) for i in range(k)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=240)
    assert [p.exitcode for p in procs] == [0] * k
    held = [sum(wins[t * k : (t + 1) * k]) for t in range(TRIALS)]
    assert held == [1] * TRIALS, f"{sum(h != 1 for h in held)} of {TRIALS} trials"
    assert not any((Path(f) / LOCK_FILE).exists() for f in folders)  # all released


def test_only_rank_0_takes_the_lock(tmp_path):
    """FSDP ranks other than 0 check the path and never touch the lock, so they cannot race
    rank 0 (nor refuse because rank 0 holds it)."""
    out = tmp_path / "run"
    with OutputLock(out, say=lambda s: None):
        with OutputLock(out, enabled=False) as other:
            assert not other.held
        with pytest.raises(UserError, match="is in use by the run of process"):
            OutputLock(out, say=lambda s: None).__enter__()
    with OutputLock(out, enabled=False):
        assert not (out / LOCK_FILE).exists()
