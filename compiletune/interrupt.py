"""Ctrl-C while the program starts up ends it at once, with exit status 130.

A KeyboardInterrupt raised inside an import (torch and numpy take seconds to import) can leave
a half-imported module in `sys.modules` that later fails with an unrelated error, or escape
before `cli.main` can catch it. So the `compiletune` program replaces Python's SIGINT handler
first thing with one that prints one line and exits: nothing has been published then, and
whatever a build writes is only ever published whole (checkpoint/atomic.py). The training loop takes
SIGINT over while it runs (run_dir.StopSignal: finish the step, checkpoint, return) and hands
this handler back after. Imports nothing of compiletune's, so it can run before everything.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
from typing import Any

EXIT_INTERRUPTED = 130  # 128 + SIGINT, as a shell reports it


def _exit_now(signum: int, frame: Any) -> None:
    with contextlib.suppress(Exception):  # a closed pipe: the line below matters more
        sys.stdout.flush()
    os.write(2, b"compiletune: interrupted\n")
    os._exit(EXIT_INTERRUPTED)


def exit_on_interrupt() -> None:
    """Make SIGINT end this process at once (call it from the program's entry point only)."""
    signal.signal(signal.SIGINT, _exit_now)
