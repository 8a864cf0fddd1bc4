"""A fresh interpreter for tests of code that forks (the memory estimate's `Forked`): compiletune
forks only from a process with one Python thread, and a pytest-xdist worker has two (execnet's
reader beside the tests). The worker process of a one-process spawn pool has only its own."""

from __future__ import annotations

import multiprocessing as mp
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor
from contextlib import contextmanager
from typing import Any


class FreshProcess:
    """Calls run one at a time in one spawned interpreter, started at the first call; what a
    call raises (an assertion) is raised here."""

    def __init__(self) -> None:
        self.before = set(mp.active_children())
        self.pool = ProcessPoolExecutor(1, mp_context=mp.get_context("spawn"))

    def __call__(self, fn: Callable[..., Any], *args: Any, timeout: float = 600) -> Any:
        return self.pool.submit(fn, *args).result(timeout=timeout)

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
        for p in set(mp.active_children()) - self.before:  # one that hung, gone for good
            p.kill()
            p.join()


@contextmanager
def fresh_process() -> Iterator[FreshProcess]:
    fresh = FreshProcess()
    try:
        yield fresh
    finally:
        fresh.close()
