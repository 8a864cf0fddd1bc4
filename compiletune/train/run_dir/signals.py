"""SIGINT and SIGTERM during a run: `StopSignal` while training (finish the step, checkpoint,
return; a second Ctrl-C means now), `LateSignal` once the run has finished.

Its own room because signal handlers are process state: installed and restored in one place,
apart from the code that writes files.
"""

from __future__ import annotations

import signal
from dataclasses import dataclass, field
from typing import Any

from compiletune import interrupt


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
