"""Progress of work that takes a while: a tqdm bar on a terminal, else plain lines.

The training loop's convention, shared by every other long phase (tokenising into the token
cache, `eval`, Hub downloads): on a terminal a bar on stderr; when stderr is a file or a pipe
(a log, CI) a bar's carriage returns would be noise, so a line at each tenth of a known total
instead, and for work of unknown size (a streamed source) a line each time the count doubles,
so a long phase never goes silent and a log never floods.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any, TextIO

from tqdm import tqdm


def _stderr_line(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


class Progress:
    """`update(n)` as work is done; `close()` at the end (or use it as a context manager).

    `total`: the work's size in `unit`s (None: unknown). `say` receives the plain lines
    (default: stderr). `stream`: where the bar goes and whose isatty() picks bar or lines.
    `first_line`: of work of unknown size, the count of the first line (small work that ends
    before it says nothing but its own summary).
    """

    def __init__(
        self,
        desc: str,
        total: int | None,
        unit: str,
        say: Callable[[str], None] | None = None,
        stream: TextIO | None = None,
        unit_scale: bool = False,
        first_line: int = 1,
    ) -> None:
        stream = stream or sys.stderr
        self.interactive = bool(getattr(stream, "isatty", lambda: False)())
        self.desc, self.total, self.unit = desc, total, unit
        self.say = say or _stderr_line
        self.done = 0
        self.unit_scale = unit_scale
        # the next count that earns a line: a tenth of the total, or (unknown size) a doubling
        self.next_line = self._step() if total else first_line
        self.bar = tqdm(
            total=total,
            desc=desc,
            unit=unit,
            unit_scale=unit_scale,
            disable=not self.interactive,
            file=stream,
            ncols=100,
        )

    def _step(self) -> int:
        return max(1, -(-(self.total or 1) // 10))

    def _count(self, n: float) -> str:
        if not self.unit_scale:
            return f"{int(n):,}"
        return tqdm.format_sizeof(n)  # (powers of 1000, as the bar shows them)

    def update(self, n: int = 1) -> None:
        self.done += n
        self.bar.update(n)
        if self.interactive or self.done < self.next_line:
            return
        if self.total:
            pct = 100 * self.done // self.total
            self.say(
                f"{self.desc}: {self._count(self.done)}/{self._count(self.total)} {self.unit} "
                f"({pct}%)"
            )
            while self.next_line <= self.done:
                self.next_line += self._step()
        else:
            self.say(f"{self.desc}: {self._count(self.done)} {self.unit} so far")
            while self.next_line <= self.done:
                self.next_line *= 2

    def close(self) -> None:
        self.bar.close()

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
