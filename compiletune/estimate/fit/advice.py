"""The advice for a step that does not fit: the cheapest technique flags that make it fit
(`suggest`: climb the ladder, then drop the rungs not needed), else smaller micro-batches with
--grad-accum raised to keep the tokens per step, else more GPUs (`advice`).

Its own room because it is a search over the ladder with its own bound and its own shortcuts
(`_may_fit`: every rung at once before a climb), used by estimate-memory and the pre-flight.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from compiletune.config import TrainConfig
from compiletune.errors import UserError
from compiletune.estimate import expert_parallel as ep_
from compiletune.estimate.estimator import MemoryEstimate, as_trained, keep
from compiletune.estimate.fit.capacity import Capacity, device_fits, fits
from compiletune.estimate.fit.ladder import (
    LADDER,
    Bound,
    SearchCut,
    applicable_flags,
    flags_text,
    flags_to_add,
    search_optimizers,
)

# Its bound on estimates (each takes seconds; see ladder.py's bounds): all the climbs, at each
# smaller micro-batch, together.
ADVICE_ESTIMATES = 40


def suggest(
    cfg: TrainConfig,
    gpus: int,
    capacity: Capacity,
    progress: Callable[[str], None] | None = None,
    bound: Bound | None = None,
) -> tuple[str, MemoryEstimate] | None:
    """The cheapest flags that make `cfg`'s step fit, with their estimate; None when even every
    rung of the ladder does not. Rungs are added cheapest first until the step fits, then each
    earlier rung is dropped again where the step still fits without it (so `--ac full` alone is
    the answer when it is enough, not `--ac full` plus the cheaper rungs tried on the way).
    `progress` is told each candidate's flags and peak as it is estimated; `bound` counts the
    estimates (SearchCut past it)."""
    bound = bound or Bound(ADVICE_ESTIMATES)
    cfg = as_trained(cfg, gpus)
    current, added = cfg, []
    est = None
    also = search_optimizers(cfg)

    def tried(changes: list[dict[str, Any]], est: MemoryEstimate) -> None:
        if progress is not None:
            flags = flags_text({k: v for t in changes for k, v in t.items()})
            verdict = "fits" if fits(est, capacity) else "does not fit"
            progress(f"  {flags or 'as configured'}: {est.peak_bytes / 2**30:.1f} GiB, {verdict}")

    for _, changes in ep_.rungs(cfg, gpus) + LADDER:  # (--ep first for a MoE model)
        todo = applicable_flags(current, changes)
        if not todo:
            continue
        current = current.replace(**todo)
        added.append(todo)
        est = bound.estimate(current, gpus, also=also)
        tried(added, est)
        if fits(est, capacity):
            break
    else:  # every rung on, kept: at --batch-size 1 `advice` asks for it again (`_may_fit`)
        if est is not None:
            keep(current, gpus, est)
        return None
    for todo in list(reversed(added[:-1])):
        kept = [t for t in added if t is not todo]
        trial = cfg.replace(**{k: v for t in kept for k, v in t.items()})
        trial_est = bound.estimate(trial, gpus, also=also)
        tried(kept, trial_est)
        if fits(trial_est, capacity):
            added, est = kept, trial_est
    assert est is not None
    return flags_text({k: v for t in added for k, v in t.items()}), est


def _stack(
    cfg: TrainConfig, rungs: list[tuple[str, dict[str, Any]]]
) -> tuple[TrainConfig, dict[str, Any]]:
    """`cfg` with each of `rungs` added as `suggest` climbs them (those already on or invalid
    for the run skipped), and the flags that added."""
    added: dict[str, Any] = {}
    for _, changes in rungs:
        if todo := applicable_flags(cfg, changes):
            cfg = cfg.replace(**todo)
            added |= todo
    return cfg, added


def _may_fit(
    cfg: TrainConfig,
    gpus: int,
    capacity: Capacity,
    progress: Callable[[str], None] | None,
    label: str,
    bound: Bound | None = None,
) -> str:
    """Whether `suggest` can find flags that make `cfg` fit ("": it can; else what ran out,
    "GPU" or "host"), from one or two estimates instead of its climb: no rung raises the device
    peak, so the climb fits somewhere when every rung together fits, and nowhere when that
    misses the GPU. When only the host cannot take the CPU offload (the last rung), the rungs
    before it decide. An estimate that fits is kept for the climb, which reaches the same
    configuration."""
    bound = bound or Bound(2)  # (two stacks at most)
    top = as_trained(cfg, gpus)
    offload = LADDER[-1][1]
    ep = ep_.rungs(top, gpus)
    stacks = [_stack(top, ep + LADDER)]
    if flags_to_add(top, offload):  # the stack without the offload, when the run does not offload
        stacks.append(_stack(top, ep + LADDER[:-1]))
    for i, (stacked, added) in enumerate(stacks):
        try:  # (the climb's drop phase asks for the other optimizers: had from this step)
            est = bound.estimate(stacked, gpus, also=search_optimizers(cfg))
        except UserError:  # a stack this run cannot build: leave the question to the climb
            return ""
        ok = fits(est, capacity)
        if progress is not None:
            progress(
                f"  {label} with {flags_text(added) or 'no rung'}: {est.peak_bytes / 2**30:.1f} "
                f"GiB, {'fits' if ok else 'does not fit'}"
            )
        if ok:
            keep(stacked, gpus, est)
            return ""
        if not device_fits(est, capacity):
            return "GPU" if i == 0 else "host"  # (every rung fitted the GPU, not the host)
    return "host"


def advice(
    cfg: TrainConfig,
    gpus: int,
    capacity: Capacity,
    progress: Callable[[str], None] | None = None,
) -> str:
    """What to do about a step that does not fit: the cheapest technique flags that fit; when
    none do at this micro-batch, smaller micro-batches (largest first) with --grad-accum raised
    to keep the tokens per step, each with the technique flags it needs (`_may_fit` first,
    from every rung together: at the smallest micro-batch, then at each); else more GPUs.
    At most ADVICE_ESTIMATES estimates in all: past them the advice says where it stopped."""
    bound = Bound(ADVICE_ESTIMATES)
    try:
        return _advice(cfg, gpus, capacity, progress, bound)
    except SearchCut:
        return (
            f"no technique flag found to fit within the search's bound of {bound.limit} "
            "estimates; `compiletune estimate-memory --ladder` and a smaller --batch-size or "
            "--seq-len show what fits"
        )


def _advice(
    cfg: TrainConfig,
    gpus: int,
    capacity: Capacity,
    progress: Callable[[str], None] | None,
    bound: Bound,
) -> str:
    """`advice`'s search, its estimates counted by `bound`."""
    found = suggest(cfg, gpus, capacity, progress, bound)
    if found is not None:
        flags, est = found
        return f"add {flags} (then about {est.peak_bytes / 2**30:.1f} GiB per GPU)"
    batch, accum = cfg.data.batch_size, cfg.data.grad_accum
    # (accumulation is not possible with the optimizer stepping in backward)
    smaller = [] if cfg.optim.optimizer_in_backward else range(batch - 1, 0, -1)
    splits = [
        {"batch_size": d, "grad_accum": accum * batch // d} for d in smaller if batch % d == 0
    ]
    short_of: dict[int, str] = {}  # what ran out at each micro-batch with every rung

    def reachable(split: dict[str, Any]) -> bool:
        d = split["batch_size"]
        if d not in short_of:
            trial = cfg.replace(**split)
            short_of[d] = _may_fit(trial, gpus, capacity, progress, flags_text(split), bound)
        return not short_of[d]

    # The smallest micro-batch first: a larger one holds more, so when no rung fits even that,
    # none fits any of them.
    for split in splits if splits and reachable(splits[-1]) else []:
        if not reachable(split):
            continue
        trial = cfg.replace(**split)
        est = bound.estimate(as_trained(trial, gpus), gpus, also=search_optimizers(trial))
        if progress is not None:
            verdict = "fits" if fits(est, capacity) else "does not fit"
            progress(f"  {flags_text(split)}: {est.peak_bytes / 2**30:.1f} GiB, {verdict}")
        found = (
            ("", est) if fits(est, capacity) else suggest(trial, gpus, capacity, progress, bound)
        )
        if found is not None:
            flags, est = found
            return (
                f"add {' '.join(filter(None, [flags_text(split), flags]))} (the same "
                f"{batch * accum} rows per step; then about {est.peak_bytes / 2**30:.1f} GiB "
                "per GPU)"
            )
    if not splits and not cfg.optim.optimizer_in_backward:  # --batch-size 1: what ran out
        short_of[1] = _may_fit(cfg, gpus, capacity, None, "", bound)
    if short_of.get(1) == "host":
        return (
            "no technique flag makes it fit, even at --batch-size 1: with --cpu-offload the step "
            "fits the GPU but not the host memory (--host-memory); use more machines or a shorter "
            "--seq-len"
        )
    return (
        "no technique flag makes it fit, even at --batch-size 1: use more GPUs (--fsdp) or a "
        "shorter --seq-len"
    )
