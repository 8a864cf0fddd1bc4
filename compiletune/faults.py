"""Named points where a test kills the process as `kill -9` would: `COMPILETUNE_KILL_AT=NAME`
(the first time NAME is reached) or `NAME:K` (the K-th time).

The crash tests (tests/integration/test_crash.py) use them to stop a run at exact moments (in a
step, between writing a checkpoint's files, in the middle of the rename that publishes it, in
`convert` and in `--merge`) and then check that nothing is left looking complete that is not, and
that `--resume` continues from a complete checkpoint. Unset, a point costs a dict lookup.
"""

from __future__ import annotations

import os
import signal
from collections import Counter

ENV = "COMPILETUNE_KILL_AT"
_reached: Counter[str] = Counter()


def point(name: str) -> None:
    """Die here with SIGKILL if the environment names this point (and this is its K-th time)."""
    spec = os.environ.get(ENV)
    if not spec:
        return
    target, _, nth = spec.partition(":")
    if target != name:
        return
    _reached[name] += 1
    if _reached[name] == int(nth or 1):
        os.kill(os.getpid(), signal.SIGKILL)
