"""What a run must fit in, and whether an estimate fits it: `Capacity` (each GPU's memory and one
machine's host memory), the reserve kept for what an estimate cannot see, and --device-memory's
GPU names (this machine's memory: hardware.machine_host_bytes).

Its own room because every other room here judges by it: the ladder, the advice, the pre-flight
and the printed verdict all ask the same `fits`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from compiletune.errors import UserError
from compiletune.estimate.estimator import GPUS_PER_NODE, MemoryEstimate

# What a GPU needs beyond the tensors of the step: CUDA context, cuBLAS/NCCL workspaces,
# fragmentation. The pre-flight check keeps this much free.
RESERVE_BYTES = 2 * 2**30

# Device memory of common GPUs in GiB (the capacity the driver reports is slightly less).
GPU_MEMORY_GIB = {
    "a10g": 24,
    "l4": 24,
    "4090": 24,
    "a100-40": 40,
    "l40s": 48,
    "a6000": 48,
    "a100": 80,
    "a100-80": 80,
    "h100": 80,
    "h200": 141,
    "b200": 180,
}


@dataclass(frozen=True)
class Capacity:
    """What a run must fit in: each GPU's memory, and (optionally) one machine's host memory,
    shared by the ranks that run on it (up to GPUS_PER_NODE)."""

    device_bytes: int
    host_bytes: int | None = None


def host_needed(est: MemoryEstimate) -> int:
    """Host memory the step's offloaded tensors need on one machine: each rank's share times the
    ranks on that machine."""
    return est.host_bytes * min(est.gpus, GPUS_PER_NODE)


def device_fits(est: MemoryEstimate, capacity: Capacity) -> bool:
    """The step's peak plus the reserve for what the estimate cannot see fits each GPU."""
    return est.peak_bytes + RESERVE_BYTES <= capacity.device_bytes


def host_fits(est: MemoryEstimate, capacity: Capacity) -> bool:
    """What the step offloads fits the machine's host memory (unchecked without one)."""
    return capacity.host_bytes is None or host_needed(est) <= capacity.host_bytes


def fits(est: MemoryEstimate, capacity: Capacity) -> bool:
    return device_fits(est, capacity) and host_fits(est, capacity)


def parse_device_memory(text: str) -> int:
    """'80' (GiB) or a GPU name from GPU_MEMORY_GIB ('h100', 'a100-40') -> bytes."""
    key = text.strip().lower()
    if key in GPU_MEMORY_GIB:
        return GPU_MEMORY_GIB[key] * 2**30
    try:
        gib = float(key.removesuffix("gib").removesuffix("g"))
    except ValueError:
        gib = -1.0
    if not gib > 0 or math.isinf(gib):
        names = ", ".join(GPU_MEMORY_GIB)
        raise UserError(f"--device-memory {text!r}: pass GiB (e.g. 80) or a GPU name ({names})")
    return int(gib * 2**30)


def with_reserve(est: MemoryEstimate, capacity: Capacity) -> str:
    """The step's peak beside the reserve and the GPU it is judged against."""
    gib = 2**30
    return (
        f"{est.peak_bytes / gib:.2f} GiB + {RESERVE_BYTES / gib:.0f} GiB reserve against "
        f"{capacity.device_bytes / gib:g} GiB"
    )
