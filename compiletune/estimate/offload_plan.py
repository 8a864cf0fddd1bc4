"""`--offload-activations auto`: the fewest blocks whose offload makes the step fit a GPU.

Offloading costs a copy to the host and back for every byte a block saves, so a run should
offload no more blocks than its memory needs. The plan asks the memory estimate: first with
every block offloaded (if even that does not fit, no N does, and the error names what would),
then with none, then a bisection over N in between (the first N blocks offload, as
compiler/offload_target.py says why). One more block offloaded moves bytes off the device and
adds none, so the bisection's answer, N fits and N - 1 does not, is the fewest. log2(blocks) + 2
estimates (about seven for a 32-block model).
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch

from compiletune.config import TrainConfig
from compiletune.errors import UserError
from compiletune.estimate.estimator import MemoryEstimate, estimate_memory, keep, shapes_only
from compiletune.estimate.fit.advice import advice
from compiletune.estimate.fit.capacity import Capacity, fits
from compiletune.estimate.fit.printing import verdict
from compiletune.hardware import machine_host_bytes
from compiletune.launch import launched_world_size
from compiletune.train.build_model import resolve_model_args


def plan_offload(
    cfg: TrainConfig,
    gpus: int,
    capacity: Capacity,
    progress: Callable[[str], None] | None = None,
) -> tuple[TrainConfig, MemoryEstimate | None]:
    """`cfg` with `--offload-activations auto` replaced by the fewest blocks that make the step
    fit `capacity`, and the estimate at that number (None, `cfg` unchanged, when the target is
    not auto). UserError when even every block offloaded does not fit."""
    if not cfg.techniques.offload_activations.auto:
        return cfg, None
    n_layers = resolve_model_args(shapes_only(cfg)).n_layers
    say = progress or (lambda line: None)

    def at(n: int) -> MemoryEstimate:
        est = estimate_memory(cfg.replace(offload_activations=n), gpus)
        verdict_word = "fits" if fits(est, capacity) else "does not fit"
        say(f"  --offload-activations {n}: {est.peak_bytes / 2**30:.2f} GiB, {verdict_word}")
        return est

    say(f"--offload-activations auto: the fewest of {n_layers} blocks that fit...")
    every = at(n_layers)
    if not fits(every, capacity):
        fix = advice(cfg.replace(offload_activations=True), gpus, capacity)
        raise UserError(
            f"--offload-activations auto: even with all {n_layers} blocks offloaded the step "
            f"({every.peak_bytes / 2**30:.1f} GiB per GPU) {verdict(every, capacity)}; {fix}"
        )
    found, est = n_layers, every
    none = at(0)
    if fits(none, capacity):
        found, est = 0, none
    low = 0  # does not fit; `found` fits
    while found - low > 1:
        mid = (low + found) // 2
        trial = at(mid)
        if fits(trial, capacity):
            found, est = mid, trial
        else:
            low = mid
    say(f"--offload-activations auto: the first {found} of {n_layers} blocks offload")
    planned = cfg.replace(offload_activations=found)
    est.notes.append(
        f"--offload-activations auto: {found} of {n_layers} blocks, the fewest that fit "
        f"{capacity.device_bytes / 2**30:g} GiB"
    )
    keep(planned, gpus, est)  # the caller's estimate of the plan is this one
    return planned, est


def plan_for_this_gpu(cfg: TrainConfig) -> TrainConfig:
    """`train`'s plan on a GPU: auto against this GPU's memory (the share this process may
    allocate) and this machine's host memory (every rank of an FSDP job plans the same; the
    first prints it). Without a GPU there is nothing to offload, and `cfg` is returned as is."""
    if not cfg.techniques.offload_activations.auto or not torch.cuda.is_available():
        return cfg
    world = launched_world_size() if cfg.parallel.fsdp else 1
    local = int(os.environ.get("LOCAL_RANK", "0"))
    total = torch.cuda.mem_get_info(local)[1]
    # a process held to part of the GPU (torch.cuda.set_per_process_memory_fraction) plans for
    # that part: what it may allocate is the target
    share = getattr(torch.cuda, "get_per_process_memory_fraction", None)  # torch 2.8+
    total = int(total * share(local)) if share is not None else total
    capacity = Capacity(total, machine_host_bytes())
    say = print if int(os.environ.get("RANK", "0")) == 0 else None
    return plan_offload(cfg, world, capacity, say)[0]
