"""What `compiletune train` does on a GPU before the trainer starts: `--offload-activations auto`'s
plan (estimate/offload_plan.py) and the memory pre-flight (estimate/fit/preflight.py), each from
the memory estimate.

Its own module above both train/ and estimate/: the estimator builds the trainer's run (estimate
imports train), so the trainer cannot ask the estimator itself without an import circle. The
CLI's train command calls `prepare` and passes the trainer what it needs: the planned config and
the estimated peak.
"""

from __future__ import annotations

import os
import warnings

import torch

from compiletune import distributed as dist_
from compiletune import recipes
from compiletune.config import TrainConfig
from compiletune.errors import UserError
from compiletune.estimate import offload_plan
from compiletune.estimate.fit.capacity import Capacity
from compiletune.estimate.fit.preflight import preflight
from compiletune.hardware import machine_host_bytes
from compiletune.train.device import pick_device
from compiletune.train.run_dir import hub_pin


def prepare(cfg: TrainConfig) -> tuple[TrainConfig, float | None]:
    """`cfg` as the trainer will run it (on a GPU, `--offload-activations auto` planned) and the
    pre-flight's estimated peak in GiB (None without a GPU, with --no-preflight, or when the
    estimate failed). Refuses (UserError) a step that cannot fit this GPU. The config's own checks
    come first, as `train` makes them: a recipe's placeholder, --resume's Hub commit."""
    recipes.check_no_placeholders(cfg)
    cfg = hub_pin.align_hub_specs(cfg)  # --resume naming a Hub repo again: the run's commit
    if pick_device().type != "cuda":
        return cfg, None
    cfg = offload_plan.plan_for_this_gpu(cfg)  # --offload-activations auto: N from the estimate
    return cfg, (preflight_check(cfg) if cfg.run.preflight else None)


def preflight_check(cfg: TrainConfig) -> float | None:
    """Before anything is allocated: refuse a step that cannot fit this GPU, naming flags that
    would make it fit (estimate/fit/preflight.py, fake tensors; seconds for an 8B model). Runs
    before the process group exists, since the estimate simulates its own. An estimator failure (a
    torch version without one of its private APIs, say) warns and lets the run go on. Returns the
    estimated peak in GiB (None when the estimate failed)."""

    local = int(os.environ.get("LOCAL_RANK", "0"))
    capacity = Capacity(torch.cuda.mem_get_info(local)[1], machine_host_bytes())
    world = dist_.launched_world_size() if cfg.parallel.fsdp else 1
    try:
        return preflight(cfg, world, capacity).peak_bytes / 2**30
    except UserError:
        raise
    except Exception as e:  # the estimate is advice; never block a run on its own bug
        warnings.warn(
            f"compiletune: the memory pre-flight check failed ({type(e).__name__}: {e}); "
            "continuing without it",
            stacklevel=2,
        )
        return None
