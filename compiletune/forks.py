"""Whether this process may fork. A fork keeps only the thread that forks: a lock another
thread held at that moment stays held in the child for good, and the child hangs at its first
use of it (a CI worker's forked estimate hung in a futex so, beside execnet's reader thread).
So a fork only from a process with no other Python thread (an xdist worker's reader, an image
run's pixel worker, a progress bar's monitor, a logger's sender) and no live torch.distributed
group (gloo's native threads); the estimator's own fake group (--gpus) has no threads.
Elsewhere: a spawned process, or none."""

from __future__ import annotations

import os
import sys

import torch


def fork_is_safe() -> bool:
    """True where `os.fork` exists and no other thread of this process can hold a lock."""
    if not hasattr(os, "fork"):
        return False
    if len(sys._current_frames()) > 1:  # counts threads that `threading` does not know of
        return False
    dist = torch.distributed
    live = dist.is_available() and dist.is_initialized() and dist.get_backend() != "fake"
    return not live


def pool_context() -> str:
    """The multiprocessing start method for a pool of workers started here: fork where it is
    safe (cheap, nothing pickled), else spawn."""
    return "fork" if fork_is_safe() else "spawn"
