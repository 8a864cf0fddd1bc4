"""What the 2-process CPU tests share: a free port, and joining the gloo group from a worker."""

from __future__ import annotations

import os
import socket
from collections.abc import Callable

import torch.distributed as dist

from compiletune.distributed import close_group


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def join_gloo(rank: int, world: int, port: int) -> None:
    """Join the default process group as `rank` of `world` over localhost (a spawned worker)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)


def run_in_gloo(rank: int, world: int, port: int, body: Callable[[], None]) -> None:
    """Run `body` as `rank` of a gloo group, then tear the group down in a fixed order.

    All ranks meet at a barrier first (every queued collective, FSDP's asynchronous
    reduce-scatters included, has finished), then the group is closed the way the trainer
    closes it (`distributed.close_group`).
    """
    join_gloo(rank, world, port)
    try:
        body()
        dist.barrier()
    finally:
        close_group()
