"""train's pre-flight check: before a run on a GPU, refuse (one line) a step whose estimate
will not fit, naming the flags that would make it fit.

Its own room because it is called from outside the estimator (before_train.py, above both
train/ and estimate/, for the CLI's train command) and needs only the estimate, the capacity and
the advice.
"""

from __future__ import annotations

from compiletune.config import TrainConfig
from compiletune.errors import UserError
from compiletune.estimate.estimator import MemoryEstimate, estimate_memory
from compiletune.estimate.fit.advice import advice
from compiletune.estimate.fit.capacity import (
    RESERVE_BYTES,
    Capacity,
    device_fits,
    fits,
    host_fits,
    host_needed,
)


def preflight(cfg: TrainConfig, gpus: int, capacity: Capacity) -> MemoryEstimate:
    """Refuse (UserError) a run whose step will not fit, naming the flags that would make it fit;
    returns the estimate when it fits."""
    est = estimate_memory(cfg, gpus)
    if fits(est, capacity):
        return est
    gib = 2**30
    why = []
    if not device_fits(est, capacity):
        why.append(
            f"the step needs about {est.peak_bytes / gib:.1f} GiB per GPU (+"
            f"{RESERVE_BYTES / gib:.0f} GiB reserve) but the GPU has "
            f"{capacity.device_bytes / gib:.1f} GiB"
        )
    if not host_fits(est, capacity):
        why.append(
            f"what the step offloads needs {host_needed(est) / gib:.1f} GiB of host memory but "
            f"the machine has {capacity.host_bytes / gib:.1f} GiB"
        )
    raise UserError(
        f"{' and '.join(why)}; {advice(cfg, gpus, capacity)} "
        "(`compiletune estimate-memory --ladder` shows each technique; --no-preflight skips "
        "this check)"
    )
