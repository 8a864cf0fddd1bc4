"""Named points where a test kills the process as `kill -9` would: `COMPILETUNE_KILL_AT=NAME`
(the first time NAME is reached) or `NAME:K` (the K-th time). `COMPILETUNE_FAIL_AT=NAME[:K][@R]`
makes the point raise a full disk's OSError instead (in the process of rank R only, under
torchrun): a save error on one rank, which every rank must then report alike.

The crash tests (tests/integration/test_crash.py) use them to stop a run at exact moments (in a
step, between writing a checkpoint's files, in the middle of the rename that publishes it, in
`convert` and in `--merge`) and then check that nothing is left looking complete that is not, and
that `--resume` continues from a complete checkpoint. Unset, a point costs a dict lookup.
"""

from __future__ import annotations

import errno
import os
import signal
from collections import Counter

ENV = "COMPILETUNE_KILL_AT"
FAIL_ENV = "COMPILETUNE_FAIL_AT"
_reached: Counter[str] = Counter()
_failed: Counter[str] = Counter()


def _due(env: str, name: str, counter: Counter[str]) -> bool:
    """Whether `env`'s spec NAME[:K][@RANK] names this point, its K-th time, in this rank."""
    spec, _, rank = os.environ.get(env, "").partition("@")
    target, _, nth = spec.partition(":")
    if not spec or target != name or (rank and os.environ.get("RANK", "0") != rank):
        return False
    counter[name] += 1
    return counter[name] == int(nth or 1)


def point(name: str) -> None:
    """Die here with SIGKILL if the environment names this point (and this is its K-th time);
    raise ENOSPC if COMPILETUNE_FAIL_AT names it."""
    if _due(FAIL_ENV, name, _failed):
        raise OSError(errno.ENOSPC, f"No space left on device (injected at {name})")
    if _due(ENV, name, _reached):
        os.kill(os.getpid(), signal.SIGKILL)
