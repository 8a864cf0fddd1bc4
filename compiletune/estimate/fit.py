"""Whether a step fits: the GPU's and the machine's capacity, the ladder of techniques, the
cheapest flags that make a step fit, the pre-flight check of `train`, and the printed tables."""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from compiletune.compiler.offload_target import OffloadTarget
from compiletune.config import TrainConfig, flag_text
from compiletune.errors import UserError
from compiletune.estimate.estimator import (
    GPUS_PER_NODE,
    MemoryEstimate,
    as_trained,
    estimate_memory,
    keep,
)
from compiletune.estimate.tracker import CATEGORIES
from compiletune.models.params import params_text
from compiletune.train.build import resolve_model_args

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


# ---------------------------------------------------------------------------------------------
# The ladder and the pre-flight check.


@dataclass(frozen=True)
class Capacity:
    """What a run must fit in: each GPU's memory, and (optionally) one machine's host memory,
    shared by the ranks that run on it (up to GPUS_PER_NODE)."""

    device_bytes: int
    host_bytes: int | None = None


def machine_host_bytes() -> int:
    """This machine's physical memory (the default of --host-memory)."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def host_needed(est: MemoryEstimate) -> int:
    """Host memory the step's offloaded tensors need on one machine: each rank's share times the
    ranks on that machine."""
    return est.host_bytes * min(est.gpus, GPUS_PER_NODE)


def _device_fits(est: MemoryEstimate, capacity: Capacity) -> bool:
    """The step's peak plus the reserve for what the estimate cannot see fits each GPU."""
    return est.peak_bytes + RESERVE_BYTES <= capacity.device_bytes


def _host_fits(est: MemoryEstimate, capacity: Capacity) -> bool:
    """What the step offloads fits the machine's host memory (unchecked without one)."""
    return capacity.host_bytes is None or host_needed(est) <= capacity.host_bytes


def fits(est: MemoryEstimate, capacity: Capacity) -> bool:
    return _device_fits(est, capacity) and _host_fits(est, capacity)


# The ladder: each rung adds flags to the ones before, cheapest first, by what a rung costs.
# Fused loss: nothing (it is also faster). 8-bit states: optimizer-state precision. Full
# activation checkpointing: about a third more compute. Optimizer in backward: no gradient
# clipping and no accumulation. CPU offload: parameters, gradients and states cross PCIe every
# step (the slowest). The ladder starts from the run as `train` would run it.
LADDER: list[tuple[str, dict[str, Any]]] = [
    ("+ fused loss", {"loss": "fused"}),
    ("+ 8-bit states", {"optimizer": "adamw8bit"}),
    ("+ activation checkpointing", {"ac": "full"}),
    ("+ optimizer in backward", {"optimizer_in_backward": True, "max_grad_norm": 0.0}),
    ("+ CPU offload", {"fsdp": True, "cpu_offload": True}),
]
# Rungs that change the optimizer alone: an estimate gets each of their estimates from its own
# step, for a little more time (`estimate_memory`'s `also`).
SWAPS = tuple(c["optimizer"] for _, c in LADDER if set(c) == {"optimizer"})


def search_optimizers(cfg: TrainConfig) -> tuple[str, ...]:
    """The optimizers a search from `cfg` may ask an estimate for next: the ladder's and, to
    drop such a rung again, `cfg`'s own."""
    return (*SWAPS, cfg.optim.optimizer)


# Rungs that change what is trained (only the adapters): shown by --ladder, never suggested,
# which keeps the run a full fine-tune.
LORA_RUNGS: list[tuple[str, dict[str, Any]]] = [
    ("+ LoRA r16 (adapters only)", {"lora_rank": 16, "lora_alpha": 32.0}),
    ("+ QLoRA (NF4 base)", {"quantize_base": "nf4"}),
]
# Float8 matmuls: a speed rung (about the same memory), shown beside the stack (with LoRA
# too: its frozen base casts; not beside QLoRA's NF4 base, which --fp8 refuses).
FP8_RUNG: tuple[str, dict[str, Any]] = ("+ fp8 (speed)", {"fp8": "rowwise"})
# Keys a rung sets along with another flag, not shown on their own (LoRA's alpha follows its
# rank; in-backward steps imply no clipping).
_IMPLIED = {"lora_alpha", "max_grad_norm"}


# Length's own rungs: a block's MLP part a tile of tokens at a time (its transient no longer
# grows with the row), and what each block keeps for backward moved to host memory (the
# compiled pass).
LENGTH_RUNGS: list[tuple[str, dict[str, Any]]] = [
    ("+ MLP tiles", {"mlp_tile": 4096}),
    # every block (typed as the config holds it, so a run that offloads all has this rung)
    ("+ activation offload", {"compile": True, "offload_activations": OffloadTarget(None)}),
]
MEMORY_LIMIT = 2**20  # the longest length --max-seq-len looks for, past the model's positions

# Bounds on the estimates of one search. An estimate takes seconds, and more the longer the row
# (the chunked loss, MLP tiles and attention tiles run chunk by chunk on fake tensors), so a
# search without one ran for minutes (--max-seq-len --ladder: ten rungs of searches up to
# MEMORY_LIMIT tokens). A search that reaches its bound stops and says so.
SEARCH_ESTIMATES = 12  # one --max-seq-len search (its secant steps take about five)
LADDER_ESTIMATES = 48  # all of --max-seq-len --ladder's searches together
ADVICE_ESTIMATES = 40  # the advice's climbs, at each smaller micro-batch


class SearchCut(Exception):
    """A search reached its bound of estimates (`Bound`)."""


class Bound:
    """How many estimates a search may run (`limit`), how many it ran (`used`), and whether
    the bound stopped it (`cut`)."""

    def __init__(self, limit: int) -> None:
        self.limit, self.used, self.cut = limit, 0, False

    def take(self) -> bool:
        """Count one more estimate; False (and `cut` set) when none is left."""
        if self.used >= self.limit:
            self.cut = True
            return False
        self.used += 1
        return True

    def estimate(self, cfg: TrainConfig, gpus: int, **kwargs: Any) -> MemoryEstimate:
        """`estimate_memory`, counted; SearchCut when the bound is reached."""
        if not self.take():
            raise SearchCut
        return estimate_memory(cfg, gpus, **kwargs)


@dataclass
class Rung:
    name: str
    flags: str  # the flags this rung adds ("" for the start)
    est: MemoryEstimate | None  # None: not estimated (see `why`)
    longest: int | None = None  # the length ladder's: the longest --seq-len that fits
    why: str = ""  # "already on", or why the rung does not apply


def flags_text(changes: dict[str, Any]) -> str:
    return " ".join(t for k, v in changes.items() if k not in _IMPLIED and (t := flag_text(k, v)))


SEQ_STEP = 256  # --max-seq-len answers in multiples of this


def positions(cfg: TrainConfig) -> int:
    """The model's positions: the longest --seq-len train takes."""
    return resolve_model_args(cfg).max_seq_len


def longest_seq_len(
    cfg: TrainConfig,
    gpus: int,
    capacity: Capacity,
    say: Callable[[str], None] = print,
    limit: int | None = None,
    first: int | None = None,
    bound: Bound | None = None,
) -> tuple[int, MemoryEstimate | None]:
    """The longest --seq-len, a multiple of SEQ_STEP (and of --cp) up to `limit` (default: the
    model's positions), whose step fits `capacity`, and its estimate; (0, None) when none fits.

    Every answer is an estimate that fits with the next multiple one that does not (or the
    limit). Between them the search guesses where the peak meets the capacity on the line
    through the two nearest lengths tried (the peak grows about linearly with the length once
    attention is tiled), bisecting instead when a guess does not halve the interval: about
    five estimates rather than the fifteen of doubling and bisecting. A search from `first`
    (the ladder's length before) tries one step past it next: a rung that gains nothing is
    settled in two estimates, and one that gains has a short line to extrapolate from.

    At most `bound.limit` estimates (default SEARCH_ESTIMATES): when it stops the search,
    `bound.cut` is set and the answer is the longest found to fit so far."""
    bound = bound or Bound(SEARCH_ESTIMATES)
    step = math.lcm(SEQ_STEP, cfg.parallel.cp)  # --cp N: rows of N equal pieces
    top = (limit or positions(cfg)) // step * step
    room = capacity.device_bytes - RESERVE_BYTES
    seen: dict[int, MemoryEstimate] = {}

    def tried(n: int) -> bool:
        est = seen[n] = estimate_memory(cfg.replace(seq_len=n), gpus)
        ok = fits(est, capacity)
        say(f"  --seq-len {n}: {_with_reserve(est, capacity)}, {'fits' if ok else 'does not fit'}")
        return ok

    good, bad = 0, top + step  # the longest that fits, the shortest that does not
    guess, width = min(top, max(step, (first or 16 * step) // step * step)), None
    while bad - good > step and bound.take():
        if tried(guess):
            good = guess
        else:
            bad = guess
        if bad - good <= step:
            break
        # the line through the nearest fit and miss, else (extrapolating) the two longest fits
        bracketed = bad in seen and good > 0
        line = (good, bad) if bracketed else sorted(seen)[-2:]
        halved = not bracketed or width is None or bad - good <= width // 2
        width = bad - good if bracketed else None
        if not halved or len(line) < 2 or line[0] == 0:
            guess = (good + bad) // 2 if bad in seen else 2 * good
            if first and len(seen) == 1 and good:
                guess = good + step
        else:
            (n0, n1), (p0, p1) = line, (seen[line[0]].peak_bytes, seen[line[1]].peak_bytes)
            if p1 > p0:
                guess = int(n0 + (room - p0) * (n1 - n0) / (p1 - p0))
            else:
                guess = (good + bad) // 2 if bad in seen else 2 * good
        guess = min(max(guess // step * step, good + step), bad - step)
    return good, seen.get(good)


def _todo(cfg: TrainConfig, changes: dict[str, Any]) -> dict[str, Any]:
    """The part of a rung's flags that `cfg` does not already have (any --ac policy counts as
    activation checkpointing being on)."""
    if "ac" in changes and cfg.techniques.activation_policy.kind != "none":
        return {}
    return {k: v for k, v in changes.items() if cfg.get(k) != v}


def _not_applicable(cfg: TrainConfig, changes: dict[str, Any]) -> str:
    """Why a rung's flags are invalid for this run ("" when they are valid)."""
    if changes.get("lora_rank") and cfg.model.dtype == "bf16-mixed":
        return "n/a (LoRA takes --dtype bf16, not bf16-mixed)"
    if changes.get("optimizer_in_backward") and cfg.data.grad_accum > 1:
        return "n/a (needs --grad-accum 1)"
    return ""


def _climbed(cfg: TrainConfig, changes: dict[str, Any]) -> dict[str, Any]:
    """What a climb adds to `cfg` for a rung: its flags `cfg` lacks, none when the rung is on
    already or invalid for the run."""
    todo = _todo(cfg, changes)
    return {} if _not_applicable(cfg, todo) else todo


def ladder(
    cfg: TrainConfig, gpus: int, progress: Callable[[str], None] | None = None
) -> list[Rung]:
    """The run as `train` would run it, then each rung's flags added to those before;
    `progress` is told each rung as it is estimated."""

    def measure(c: TrainConfig) -> tuple[MemoryEstimate, None, str]:
        return estimate_memory(c, gpus, also=SWAPS), None, ""

    rows: list[Rung] = []
    full = _climb(as_trained(cfg, gpus), LADDER, progress, measure, rows)
    _climb(full, [FP8_RUNG], progress, measure, rows)  # speed: beside the stack, not on it
    _climb(full, LORA_RUNGS, progress, measure, rows)
    return rows


def length_ladder(
    cfg: TrainConfig,
    gpus: int,
    capacity: Capacity,
    progress: Callable[[str], None] | None = None,
) -> list[Rung]:
    """`ladder` aimed at length: the longest --seq-len (`longest_seq_len`, up to MEMORY_LIMIT
    tokens) the run reaches as configured and with each rung added to those before, length's
    own rungs (MLP tiles, activation offload, and with several GPUs --cp over all of them)
    among them. Each rung's search starts from the length before it. All of them together run
    at most LADDER_ESTIMATES estimates: the rungs past the bound are shown as not estimated,
    and a rung whose search the bound cut as "at least"."""
    say = progress or (lambda line: None)
    total = Bound(LADDER_ESTIMATES)
    rungs = LADDER[:3] + LENGTH_RUNGS + LADDER[3:] + LORA_RUNGS
    if gpus > 1:
        rungs = rungs + [("+ context parallel", {"fsdp": True, "cp": gpus})]
    last = [0]

    def measure(c: TrainConfig) -> tuple[MemoryEstimate | None, int, str]:
        left = total.limit - total.used
        if left <= 0:
            total.cut = True
            return None, 0, f"not estimated (the bound of {LADDER_ESTIMATES} estimates)"
        bound = Bound(min(SEARCH_ESTIMATES, left))
        longest, est = longest_seq_len(c, gpus, capacity, say, MEMORY_LIMIT, last[0] or None, bound)
        total.used += bound.used
        if est is None and not bound.cut:  # say what ran out at the shortest length
            total.used += 1
            short = estimate_memory(c.replace(seq_len=SEQ_STEP), gpus)
            short_of = "host memory (--host-memory)" if _device_fits(short, capacity) else "GPU"
            return None, 0, f"nothing fits: {short_of}"
        if est is None:
            total.cut = True
            return None, 0, f"not found in {bound.used} estimates (the bound)"
        last[0] = longest
        total.cut |= bound.cut
        return est, longest, "at least: the search's bound stopped it" if bound.cut else ""

    rows: list[Rung] = []
    _climb(as_trained(cfg, gpus), rungs, progress, measure, rows)
    if total.cut:
        say(
            f"  the search stopped at its bound of {LADDER_ESTIMATES} estimates "
            f"({total.used} run); rungs marked so are not final"
        )
    return rows


def _climb(
    current: TrainConfig,
    rungs: list[tuple[str, dict[str, Any]]],
    progress: Callable[[str], None] | None,
    measure: Callable[[TrainConfig], tuple[MemoryEstimate | None, int | None, str]],
    rows: list[Rung],
) -> TrainConfig:
    """The ladder's rows, appended to `rows`: `current` (when `rows` is empty), then each rung's
    flags added to those before (a rung already on, or invalid for the run, is shown and
    skipped), each `measure`d. Returns the configuration with every applicable rung."""
    if not rows:
        if progress is not None:  # the first estimate takes seconds too
            progress("  estimating as configured...")
        first = measure(current)
        rows.append(Rung("as configured", "", first[0], first[1], why=first[2]))
    for name, changes in rungs:
        if progress is not None:
            progress(f"  {rows[-1].name}: done; estimating {name}...")
        todo = _todo(current, changes)
        if not todo:
            rows.append(Rung(name, flags_text(changes), None, why="already on"))
            continue
        if why := _not_applicable(current, todo):
            rows.append(Rung(name, flags_text(todo), None, why=why))
            continue
        candidate = current.replace(**todo)
        try:
            result = measure(candidate)
        except UserError as e:  # e.g. NF4 blocks that do not divide this model's rows
            rows.append(Rung(name, flags_text(todo), None, why=f"n/a ({e})"))
            continue
        current = candidate
        rows.append(Rung(name, flags_text(todo), result[0], result[1], why=result[2]))
    return current


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

    for _, changes in LADDER:
        todo = _climbed(current, changes)
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
        if todo := _climbed(cfg, changes):
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
    stacks = [_stack(top, LADDER)]
    if _todo(top, offload):  # the stack without the offload, when the run does not offload
        stacks.append(_stack(top, LADDER[:-1]))
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
        if not _device_fits(est, capacity):
            return "GPU" if i == 0 else "host"  # (every rung fitted the GPU, not the host)
    return "host"


def verdict(est: MemoryEstimate, capacity: Capacity) -> str:
    """One line: whether the step fits each GPU and, when it offloads, the machine's host memory."""
    gib = 2**30
    line = (
        f"{'fits' if _device_fits(est, capacity) else 'does NOT fit'} in {capacity.device_bytes / gib:.0f} GiB "
        f"per GPU (with {RESERVE_BYTES / gib:.0f} GiB kept for the CUDA context, workspaces and "
        "fragmentation)"
    )
    if est.host_bytes and capacity.host_bytes is not None:
        ranks = min(est.gpus, GPUS_PER_NODE)
        line += (
            f"; host memory: {host_needed(est) / gib:.1f} GiB for {ranks} rank(s) on one machine "
            f"{'fits' if _host_fits(est, capacity) else 'does NOT fit'} in {capacity.host_bytes / gib:.0f} GiB "
            "(--host-memory)"
        )
    return line


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


def preflight(cfg: TrainConfig, gpus: int, capacity: Capacity) -> MemoryEstimate:
    """Refuse (UserError) a run whose step will not fit, naming the flags that would make it fit;
    returns the estimate when it fits."""
    est = estimate_memory(cfg, gpus)
    if fits(est, capacity):
        return est
    gib = 2**30
    why = []
    if not _device_fits(est, capacity):
        why.append(
            f"the step needs about {est.peak_bytes / gib:.1f} GiB per GPU (+"
            f"{RESERVE_BYTES / gib:.0f} GiB reserve) but the GPU has "
            f"{capacity.device_bytes / gib:.1f} GiB"
        )
    if not _host_fits(est, capacity):
        why.append(
            f"what the step offloads needs {host_needed(est) / gib:.1f} GiB of host memory but "
            f"the machine has {capacity.host_bytes / gib:.1f} GiB"
        )
    raise UserError(
        f"{' and '.join(why)}; {advice(cfg, gpus, capacity)} "
        "(`compiletune estimate-memory --ladder` shows each technique; --no-preflight skips "
        "this check)"
    )


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


# ---------------------------------------------------------------------------------------------
# Output.


def _seq(setup: dict[str, Any]) -> str:
    """The row length, and under --cp the piece of it each GPU holds."""
    cp = setup.get("cp", 1)
    if cp == 1:
        return str(setup["seq_len"])
    return f"{setup['seq_len']} ({setup['seq_len'] // cp} each, --cp {cp})"


def format_estimate(
    est: MemoryEstimate,
    capacity: Capacity | None = None,
    fix: str | None = None,
    total_seconds: float | None = None,
) -> str:
    """The estimate as printed; `total_seconds`: the command's whole time, start-up and the
    advice search included."""
    gib = 2**30
    s = est.setup
    lines = [
        f"{s['model']} ({params_text(s['params'])} parameters), {est.gpus} GPU(s)"
        + (f", FSDP2 {s['sharding']}" if s["fsdp"] else "")
        + (" + CPU offload" if s["cpu_offload"] else "")
        + f"; {s['dtype']}, seq {_seq(s)} x batch {s['batch_size']} per GPU, loss "
        f"{s['loss']}, ac {s['ac']}, {s['optimizer']}"
        + (" in backward" if s["optimizer_in_backward"] else "")
        + (f"; objective {s['objective']}" if s.get("objective", "sft") != "sft" else ""),
        f"peak per GPU: {est.peak_bytes / gib:.2f} GiB (in {est.peak_phase})",
    ]
    for k in CATEGORIES:
        lines.append(f"  {k:<16} {est.parts[k] / gib:8.2f} GiB")
    if est.host_bytes:
        parts = ", ".join(f"{k} {v / gib:.2f}" for k, v in est.host_parts.items() if v)
        lines.append(f"host memory per GPU (offload): {est.host_bytes / gib:.2f} GiB ({parts})")
    if capacity is not None:
        lines.append(verdict(est, capacity))
        if fix is not None:
            lines.append(f"to fit: {fix}")
    lines += [f"note: {n}" for n in est.notes]
    took = f"estimated in {est.seconds:.1f}s on fake tensors"
    if total_seconds is not None:
        took += f"; {total_seconds:.1f}s in all, start-up and any advice search included"
    lines.append(f"({took})")
    return "\n".join(lines)


def format_ladder(rows: list[Rung], capacity: Capacity | None = None) -> str:
    gib = 2**30
    head = "| rung | flags added | peak GiB / GPU | host GiB / GPU |"
    sep = "|---|---|---:|---:|"
    if capacity is not None:
        head += f" fits {capacity.device_bytes / gib:.0f} GiB |"
        sep += "---|"
    lines = [head, sep]
    for r in rows:
        if r.est is None:
            lines.append(f"| {r.name} | {r.flags} | {r.why} | |" + (" |" if capacity else ""))
            continue
        row = (
            f"| {r.name} | {r.flags or '—'} | {r.est.peak_bytes / gib:.2f} | "
            f"{r.est.host_bytes / gib:.2f} |"
        )
        if capacity is not None:
            row += f" {'yes' if fits(r.est, capacity) else 'no'} |"
        lines.append(row)
    return "\n".join(lines)


def _with_reserve(est: MemoryEstimate, capacity: Capacity) -> str:
    """The step's peak beside the reserve and the GPU it is judged against."""
    gib = 2**30
    return (
        f"{est.peak_bytes / gib:.2f} GiB + {RESERVE_BYTES / gib:.0f} GiB reserve against "
        f"{capacity.device_bytes / gib:g} GiB"
    )


def longest_line(
    longest: int, est: MemoryEstimate, positions: int, capacity: Capacity | None = None
) -> str:
    """--max-seq-len's answer, and where memory would go past the model's positions."""
    line = f"longest --seq-len that fits: {min(longest, positions)}"
    peak = _with_reserve(est, capacity) if capacity else f"{est.peak_bytes / 2**30:.2f} GiB"
    if longest <= positions:
        return line + f" (peak {peak})"
    return (
        line + f", the model's positions; memory would take {longest} (peak "
        f"{peak}) with positions extended past the checkpoint's"
    )


def no_length_line(capacity: Capacity) -> str:
    """--max-seq-len's answer when no length fits: what the reserve leaves for a step."""
    gib = 2**30
    room = max(0, capacity.device_bytes - RESERVE_BYTES) / gib
    return (
        f"no --seq-len of {SEQ_STEP} tokens or more fits: {capacity.device_bytes / gib:g} GiB per "
        f"GPU less the {RESERVE_BYTES / gib:.0f} GiB reserve (the CUDA context, workspaces, "
        f"fragmentation) leaves {room:.2f} GiB for the step; see the ladder (--ladder)"
    )


def format_length_ladder(rows: list[Rung], positions: int) -> str:
    """The length ladder as a markdown table; lengths past the model's `positions` marked."""
    lines = [
        "| rung | flags added | longest --seq-len | peak GiB / GPU |",
        "|---|---|---:|---:|",
    ]
    for r in rows:
        if r.est is None:
            lines.append(f"| {r.name} | {r.flags or '—'} | {r.why} | |")
            continue
        mark = " (past the positions)" if (r.longest or 0) > positions else ""
        mark += f" ({r.why})" if r.why else ""
        lines.append(
            f"| {r.name} | {r.flags or '—'} | {r.longest}{mark} | {r.est.peak_bytes / 2**30:.2f} |"
        )
    lines.append(f"\nthe model's positions: {positions} (train refuses a longer --seq-len)")
    return "\n".join(lines)
