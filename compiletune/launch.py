"""What the launcher (torchrun) told this process, read without torch: the CLI checks the
parallel flags against it before torch loads (compiletune/distributed.py joins the group)."""

from __future__ import annotations

import os


def launched_world_size() -> int:
    """Processes in this job as torchrun announced it (1 when started by hand)."""
    return int(os.environ.get("WORLD_SIZE", "1"))
