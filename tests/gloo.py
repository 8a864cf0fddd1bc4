"""What the 2-process CPU tests share: a free port, and joining the gloo group from a worker."""

from __future__ import annotations

import os
import socket

import torch.distributed as dist


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def join_gloo(rank: int, world: int, port: int) -> None:
    """Join the default process group as `rank` of `world` over localhost (a spawned worker)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
