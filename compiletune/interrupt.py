"""Ctrl-C while the program starts up ends it at once, with exit status 130.

A KeyboardInterrupt raised inside an import (torch and numpy take seconds to import) can leave
a half-imported module in `sys.modules` that later fails with an unrelated error, or escape
before `cli.main` can catch it. So the `compiletune` program replaces Python's SIGINT handler
first thing with one that prints one line and exits: nothing has been published then, and
whatever a build writes is only ever published whole (checkpoint/atomic.py). The training loop takes
SIGINT over while it runs (`StopSignal`: finish the step, checkpoint, return) and hands
this handler back after. SIGTERM is handled the same way (exit status 143).

Once a run's work is saved (`run_finished`: its checkpoint and summary written, the closing
line printed), there is nothing left to lose: a signal from then until the process is gone
(the interpreter's teardown takes seconds after torch) exits at once with the run's own status
(0 for a finished run) and one line saying that nothing was lost, never a silent 143. Imports
nothing of compiletune's, so it can run before everything.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
from typing import Any

EXIT_INTERRUPTED = 130  # 128 + SIGINT, as a shell reports it

# The exit status of a run whose work is saved (see run_finished); None while it is not.
_finished_status: int | None = None


def _exit_now(signum: int, frame: Any) -> None:
    with contextlib.suppress(Exception):  # a closed pipe: the line below matters more
        sys.stdout.flush()
    name = signal.Signals(signum).name
    if _finished_status is not None:
        os.write(2, f"compiletune: {name} after the run had finished; nothing was lost\n".encode())
        os._exit(_finished_status)
    os.write(
        2,
        b"compiletune: interrupted\n" if signum == signal.SIGINT else b"compiletune: terminated\n",
    )
    os._exit(128 + signum)  # as a shell reports a process the signal ended


def exit_on_interrupt() -> None:
    """Make SIGINT and SIGTERM end this process at once (call it from the program's entry point
    only)."""
    signal.signal(signal.SIGINT, _exit_now)
    signal.signal(signal.SIGTERM, _exit_now)


def run_finished(interrupted: bool) -> None:
    """The run's work is saved: a signal from now on ends the process with the run's status
    (EXIT_INTERRUPTED for a run stopped early, else 0) and one line, where `exit_on_interrupt`
    handles signals (the program; a library caller's handlers are its own)."""
    global _finished_status
    _finished_status = EXIT_INTERRUPTED if interrupted else 0
