"""The ladder of techniques: the rungs (cheapest first, by what each costs), the rows --ladder
prints with each rung's estimate, the length ladder and the search for the longest --seq-len
that fits (--max-seq-len), and the bounds on how many estimates a search may run.

Its own room because the rungs and the rules for climbing them (a rung already on, one invalid
for the run) are shared by --ladder and the advice; they are defined once, here.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from compiletune.compiler.offload_target import OffloadTarget
from compiletune.config import TrainConfig, flag_text
from compiletune.errors import UserError
from compiletune.estimate import expert_parallel as ep_
from compiletune.estimate.estimator import MemoryEstimate, as_trained, estimate_memory
from compiletune.estimate.fit.capacity import (
    RESERVE_BYTES,
    Capacity,
    device_fits,
    fits,
    with_reserve,
)
from compiletune.train.build_model import resolve_model_args

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
        say(f"  --seq-len {n}: {with_reserve(est, capacity)}, {'fits' if ok else 'does not fit'}")
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


def flags_to_add(cfg: TrainConfig, changes: dict[str, Any]) -> dict[str, Any]:
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
    if changes.get("cpu_offload") and cfg.parallel.ep > 1:
        return "n/a (--ep does not take --cpu-offload yet)"
    return ""


def applicable_flags(cfg: TrainConfig, changes: dict[str, Any]) -> dict[str, Any]:
    """What a climb adds to `cfg` for a rung: its flags `cfg` lacks, none when the rung is on
    already or invalid for the run."""
    todo = flags_to_add(cfg, changes)
    return {} if _not_applicable(cfg, todo) else todo


def ladder(
    cfg: TrainConfig, gpus: int, progress: Callable[[str], None] | None = None
) -> list[Rung]:
    """The run as `train` would run it, then each rung's flags added to those before;
    `progress` is told each rung as it is estimated."""

    def measure(c: TrainConfig) -> tuple[MemoryEstimate, None, str]:
        return estimate_memory(c, gpus, also=SWAPS), None, ""

    rows: list[Rung] = []
    full = _climb(as_trained(cfg, gpus), ep_.rungs(cfg, gpus) + LADDER, progress, measure, rows)
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
    rungs = ep_.rungs(cfg, gpus) + LADDER[:3] + LENGTH_RUNGS + LADDER[3:] + LORA_RUNGS
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
            short_of = "host memory (--host-memory)" if device_fits(short, capacity) else "GPU"
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
        todo = flags_to_add(current, changes)
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
