"""`compiletune estimate-memory`: the peak GPU memory of one training step, without a GPU.

The estimator runs the trainer's own step — model, activation checkpointing, FSDP2, loss head,
backward, optimizer step — on fake tensors (shapes and dtypes, no data, no memory), as rank 0 of
N ranks through a process group that does not communicate. The memory model (tracker.py) sees
every tensor the step creates and every storage it frees, keeps a running total per category,
and cuts the step into segments at block marks, each with its peak; the peak of the step is the
highest, with its breakdown at that moment. A deep model of repeating blocks runs at two small
depths and its segments are extended to the full depth (depth.py). With `--cpu-offload` the
sharded parameters, gradients and optimizer state live in host memory and are reported as host
memory, not device memory. Whether it fits, the ladder and the advice: fit/.

What is approximated (stated in the output's `notes`):
    --compile            the step runs eagerly: the compiled blocks' saved tensors are close to
                         the eager ones (the same policy), not identical; under --ac selective
                         the matmul outputs a block's backward never reads are not counted past
                         the block's forward (selective_saves.py), as no compiled block saves them
    --ac budget=F        interpolated between `--ac none` (F = 1) and `--ac full` (F = 0): the
                         partitioner's budget is that fraction of the activation memory
    --offload-activations  what each block saves is moved to the host category after the
                         block's forward and back to the device when backward first reads it
    fused loss           one chunk of logits [c, V] (c from ce_chunks.chunk_tokens, or
                         one_pass_chunk_tokens for the one-pass head) plus the weight-gradient
                         buffers, added while the op runs (all tokens counted as targets)
Not seen at all: the CUDA context and library workspaces (cuBLAS, NCCL), communication
buffers inside the process group, and allocator fragmentation (`fit/capacity.RESERVE_BYTES` covers
them in the pre-flight check).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor
from torch.utils._pytree import tree_leaves

from compiletune import distributed as dist_
from compiletune import recipes
from compiletune.config import TrainConfig, fill_defaults
from compiletune.errors import UserError
from compiletune.estimate import depth as depth_
from compiletune.estimate import expert_parallel as ep_
from compiletune.estimate import images as images_
from compiletune.estimate import memory_internals as mi
from compiletune.estimate.selective_saves import follow_selective_blocks
from compiletune.estimate.tracker import (
    ACT,
    ACT_HOST,
    CATEGORIES,
    GPU_ROUND_BYTES,
    GRAD,
    OPT,
    REPORTED,
    SHARDED,
    TEMP,
    Key,
    Peaks,
    Recorded,
    Segment,
    Tracker,
    fold,
    shifted,
)
from compiletune.loss.head import IGNORE_INDEX
from compiletune.models import num_params
from compiletune.ops import op_memory
from compiletune.optim import _local
from compiletune.train import BuildOptions, Run, StepBatch, build_run
from compiletune.train.build import build_optimizer
from compiletune.train.build_model import resolve_model_args
from compiletune.train.grpo import rollout_bytes
from compiletune.train.inputs import model_facts
from compiletune.train.step import Backward, backward_pass, optimizer_step

GPUS_PER_NODE = 8  # hybrid sharding's default shard group (one node), as torchrun would set it


# ---------------------------------------------------------------------------------------------
# The estimate.


@dataclass
class MemoryEstimate:
    """Peak memory of one training step on the busiest GPU (rank 0), in bytes."""

    peak_bytes: int  # device peak: the tensors of the step
    parts: dict[str, int]  # CATEGORIES -> bytes at the peak (they sum to peak_bytes)
    host_bytes: int  # host memory offload needs (peak)
    host_parts: dict[str, int]
    peak_phase: str  # forward | backward | step (| rollout: GRPO's)
    phase_peaks: dict[str, int]
    gpus: int
    setup: dict[str, Any]  # what was estimated: model, params, dtype, loss, ...
    notes: list[str] = field(default_factory=list)
    seconds: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        gib = 2**30
        return {
            "peak_gib": round(self.peak_bytes / gib, 3),
            "parts_gib": {k: round(v / gib, 3) for k, v in self.parts.items()},
            "host_gib": round(self.host_bytes / gib, 3),
            "host_parts_gib": {k: round(v / gib, 3) for k, v in self.host_parts.items()},
            "peak_phase": self.peak_phase,
            "phase_peaks_gib": {k: round(v / gib, 3) for k, v in self.phase_peaks.items()},
            "gpus": self.gpus,
            "setup": self.setup,
            "notes": self.notes,
            "peak_bytes": self.peak_bytes,
            "parts_bytes": self.parts,
            "host_bytes": self.host_bytes,
            "seconds": round(self.seconds, 2),
        }


def _reported(totals: dict[str, int], keep: set[str] | None = None) -> dict[str, int]:
    out = dict.fromkeys(CATEGORIES, 0)
    for k, v in totals.items():
        if keep is None or k in keep:
            out[REPORTED[k]] += v
    return out


def shapes_only(cfg: TrainConfig) -> TrainConfig:
    """`cfg` as the estimate reads it: a recipe's placeholder model folder is dropped, so its
    `--model` preset gives the architecture (the estimate needs shapes, not weights)."""
    if recipes.is_placeholder(cfg.model.model_dir):
        if cfg.model.preset is None:
            raise UserError("--model-dir is a placeholder; set it, or pass --model PRESET")
        return cfg.replace(model_dir=None)
    return cfg


def estimate_memory(
    cfg: TrainConfig,
    gpus: int = 1,
    round_bytes: int = GPU_ROUND_BYTES,
    also: tuple[str, ...] = (),
) -> MemoryEstimate:
    """Run one step of the run `cfg` describes (a resolved TrainConfig) on fake tensors, as
    rank 0 of `gpus` ranks, and return its peak device memory and the host memory offload needs.

    More than one GPU means FSDP2 (as `torchrun --nproc-per-node N ... --fsdp` would run).

    `also`: optimizers (`--optimizer`) whose estimates a search may ask for next. Where the
    step allows it (`_OptimizerSwap`) they come from this step, for a little more time, and
    the next call for one of them returns it at once.
    """
    if gpus < 1:
        raise UserError(f"--gpus must be at least 1, got {gpus}")
    cfg = shapes_only(cfg)
    if _DERIVED and (found := _DERIVED.pop(_cache_key(cfg, gpus, round_bytes), None)):
        return found
    t0 = time.perf_counter()
    policy = cfg.techniques.activation_policy
    notes = ep_.notes(cfg, gpus)
    plan = images_.image_plan(cfg, resolve_model_args(cfg))
    if plan is not None and plan.note:
        notes.append(plan.note)
    if cfg.techniques.compile:
        notes.append(
            "--compile: estimated from the eager step with the same policies (compiled blocks "
            "save about as much)"
        )
    if policy.kind == "budget":
        # The partitioner's budget is a fraction of the activation memory between recomputing
        # everything (full) and saving what min-cut saves (none).
        hi = _estimate(cfg.replace(ac="none"), gpus, round_bytes)[cfg.optim.optimizer]
        lo = _estimate(cfg.replace(ac="full"), gpus, round_bytes)[cfg.optim.optimizer]
        f = policy.budget or 0.0
        ests = {cfg.optim.optimizer: _interpolate(lo, hi, f)}
        notes.append(f"--ac {cfg.techniques.ac}: interpolated between --ac full and --ac none")
    else:
        swappable = not cfg.optim.optimizer_in_backward and depth_.can_fork()
        others = tuple(k for k in also if k != cfg.optim.optimizer) if swappable else ()
        ests = _estimate(cfg, gpus, round_bytes, others)
    if cfg.techniques.offload_activations:
        n_layers = resolve_model_args(cfg).n_layers
        notes.append(
            f"--offload-activations: what the first {offloaded(cfg, n_layers)} of {n_layers} "
            "blocks save counted on the host from the end of their forward until backward reads it"
            + (
                " (not simulated inside --ac selective blocks)"
                if policy.kind == "selective"
                else ""
            )
        )
    o = cfg.objective
    if o.objective in ("dpo", "ipo") and cfg.lora.rank and not o.precompute_ref:
        notes.append("reference: the policy with its adapters off (no second copy)")
    elif o.objective in ("dpo", "ipo"):
        notes.append(
            "reference: freed after --precompute-ref scored every pair (not in the step)"
            if o.precompute_ref
            else "reference: a frozen copy of the starting weights, counted as parameters"
        )
    elif o.objective == "kd":
        notes.append(f"teacher {o.teacher_dir}: counted as parameters")
    elif o.objective == "grpo":
        notes.append(
            f"grpo: an update over --batch-size x {o.num_generations} completions of --seq-len "
            "tokens; the rollout's KV cache (--batch-size prompts' completions at a time, "
            "freed before the updates) is not in the step"
            + ("; reference: counted as parameters" if o.beta and not cfg.lora.rank else "")
        )
    seconds = time.perf_counter() - t0
    for kind, est in ests.items():
        est.notes = notes + est.notes
        if o.objective == "grpo":
            _add_rollout(est, cfg.replace(optimizer=kind), gpus)
        est.seconds = seconds
        if kind != cfg.optim.optimizer:
            keep(cfg.replace(optimizer=kind), gpus, est, round_bytes)
    return ests[cfg.optim.optimizer]


# Estimates had alongside another (`also`), or kept by a search (`keep`), each until the call
# that asks for it.
_DERIVED: dict[tuple[str, int, int], MemoryEstimate] = {}
_DERIVED_KEPT = 16


def keep(
    cfg: TrainConfig, gpus: int, est: MemoryEstimate, round_bytes: int = GPU_ROUND_BYTES
) -> None:
    """Keep `est`, the estimate of `cfg`, for the next `estimate_memory` call that asks for it
    (a search that will ask for a configuration again)."""
    if len(_DERIVED) >= _DERIVED_KEPT:
        _DERIVED.pop(next(iter(_DERIVED)))
    _DERIVED[_cache_key(cfg, gpus, round_bytes)] = est


def _cache_key(cfg: TrainConfig, gpus: int, round_bytes: int) -> tuple[str, int, int]:
    """What the estimate of `cfg` depends on, as text: its flags with the defaults the build
    fills in (so a configuration and the same with those defaults written out share a key),
    without the run folder (a time stamp)."""
    flat = as_trained(cfg, gpus).to_dict()
    flat.pop("output_dir", None)
    flat["(shortcut)"] = depth_.can_fork()  # decides whether the depth shortcut runs
    return json.dumps(flat, sort_keys=True, default=str), gpus, round_bytes


def as_trained(cfg: TrainConfig, gpus: int) -> TrainConfig:
    """`cfg` with the defaults the build derives from the model filled in (the loss head, say,
    and document masks for preference pairs), as the estimate's build fills them: the ladder
    and the advice start from the run the estimate runs."""
    cfg = shapes_only(cfg)
    facts = model_facts(cfg, resolve_model_args(cfg), gpus)
    facts.bf16_params = gpu_dtype(cfg) == torch.bfloat16
    return fill_defaults(cfg.replace(), facts)


def gpu_dtype(cfg: TrainConfig) -> torch.dtype:
    """The dtype parameters are stored in on the GPU the estimate is for (the default is bf16,
    as on a GPU that supports it; bf16-mixed stores fp32)."""
    return {None: torch.bfloat16, "bf16": torch.bfloat16}.get(cfg.model.dtype, torch.float32)


def _add_rollout(est: MemoryEstimate, cfg: TrainConfig, gpus: int) -> None:
    """GRPO's rollout beside the update: the weights (gathered whole under FSDP), the optimizer
    state, the KV cache of --batch-size prompts' G completions each (decoded together) of
    --seq-len positions, their logits and one decode step's attention temporaries. The step's
    peak becomes the rollout's when that is larger."""
    o = cfg.objective
    kv, logits = rollout_bytes(cfg, resolve_model_args(cfg))
    weights = est.parts.get("parameters", 0) * (gpus if gpus > 1 else 1)
    parts = {
        "parameters": weights,
        "gradients": 0,
        "optimizer_state": est.parts.get("optimizer_state", 0),
        "activations": kv,
        "temporaries": logits,
    }
    rollout = sum(parts.values())
    est.phase_peaks["rollout"] = rollout
    est.notes.append(
        f"grpo rollout: KV cache {kv / 2**30:.2f} GiB ({cfg.data.batch_size} x "
        f"{o.num_generations} completions x {cfg.data.seq_len} positions)"
        + (", the weights gathered whole (FSDP)" if gpus > 1 else "")
    )
    if rollout > est.peak_bytes:
        est.peak_bytes, est.parts, est.peak_phase = rollout, parts, "rollout"


def _interpolate(lo: MemoryEstimate, hi: MemoryEstimate, f: float) -> MemoryEstimate:
    def mix(a: int, b: int) -> int:
        return round(a + f * (b - a))

    out = dataclasses.replace(hi)
    out.peak_bytes = mix(lo.peak_bytes, hi.peak_bytes)
    out.parts = {k: mix(lo.parts[k], hi.parts[k]) for k in CATEGORIES}
    out.host_bytes = mix(lo.host_bytes, hi.host_bytes)
    out.host_parts = {k: mix(lo.host_parts[k], hi.host_parts[k]) for k in CATEGORIES}
    return out


def _estimate(
    cfg: TrainConfig, gpus: int, round_bytes: int, others: tuple[str, ...] = ()
) -> dict[str, MemoryEstimate]:
    """The estimate of `cfg`, under its optimizer's name, and of `cfg` with each optimizer in
    `others` where it could be had from the same step (`_OptimizerSwap`)."""
    fsdp = cfg.parallel.fsdp or gpus > 1
    host = {SHARDED, GRAD, OPT} if cfg.parallel.cpu_offload else set()
    host.add(ACT_HOST)
    args = resolve_model_args(cfg)
    notes = []
    depths = depth_.shortcut_depths(cfg, args)
    found: dict[str, Peaks] = {}

    def at(depth: int | None) -> tuple[Runs, Run]:
        return _segments_at(cfg, gpus, fsdp, host, round_bytes, depth, others)

    if depths is not None:
        # The smaller depth in a forked process beside this one (a second core), when it can.
        with depth_.Forked(lambda: at(depths[0])[0]) as child:
            second, run = at(depths[1])
            first = child.result()
        if first is None:  # no fork here, or the child failed: run it in this process
            first = at(depths[0])[0]
        for kind, segs in second.items():
            if first.get(kind) is not None and segs is not None:
                extended = depth_.extend([first[kind], segs], depths, args.n_layers)
                if extended is not None:
                    found[kind] = Peaks.of(extended)
        if found:
            notes.append(
                f"{args.n_layers} repeating blocks (period {depths[2]}): run at {depths[0]} and "
                f"{depths[1]} blocks, each stretch of the step extended to {args.n_layers}"
            )
    if cfg.optim.optimizer not in found:
        # The whole model, for what the shortcut did not give (as each would run alone).
        others = tuple(k for k in others if k not in found)
        whole, run = at(None)
        shortcut = {k: notes for k in found}
        notes = []
        found |= {k: Peaks.of(s) for k, s in whole.items() if s is not None}
    else:
        shortcut = {}
    device_keep = set(REPORTED) - host
    out = {}
    for kind, peaks in found.items():
        c = cfg.replace(optimizer=kind)
        out[kind] = MemoryEstimate(
            peak_bytes=peaks.peak,
            parts=_reported(peaks.totals, device_keep),
            host_bytes=peaks.host_peak,
            host_parts=_reported(peaks.host_totals, host),
            peak_phase=peaks.phase,
            phase_peaks=peaks.phase_peaks,
            gpus=gpus,
            setup={
                "model": c.name,
                "params": num_params(args),
                "dtype": c.model.dtype or "bf16",
                "seq_len": c.data.seq_len,
                "batch_size": c.data.batch_size,
                "grad_accum": c.data.grad_accum,
                "loss": run.cfg.techniques.loss,
                "ac": c.techniques.ac,
                "offload_activations": offloaded(c, args.n_layers),  # blocks
                "optimizer": c.optim.optimizer,
                "optimizer_in_backward": c.optim.optimizer_in_backward,
                "fsdp": fsdp,
                "sharding": c.parallel.sharding if fsdp else None,
                "ep": c.parallel.ep,
                "cpu_offload": c.parallel.cpu_offload,
                "cp": c.parallel.cp,
                "objective": c.objective.objective,
            },
            notes=list(shortcut.get(kind, notes)),
        )
    return out


# Each optimizer's segments of one step, in the order they ran (None: not had).
Runs = dict[str, list[tuple[Key, Segment]] | None]


def _segments_at(
    cfg: TrainConfig,
    gpus: int,
    fsdp: bool,
    host: set[str],
    round_bytes: int,
    depth: int | None,
    others: tuple[str, ...] = (),
) -> tuple[Runs, Run]:
    """The step's segments with the model cut to `depth` blocks, under the name of `cfg`'s
    optimizer and of each of `others`."""
    tracker = Tracker(host, round_bytes)
    group = mi.fake_process_group(gpus) if fsdp else contextlib.nullcontext()
    derived: Runs = dict.fromkeys(others)
    with group:
        run = run_step(cfg, gpus if fsdp else None, tracker, depth=depth, others=derived)
    return {cfg.optim.optimizer: list(tracker.segments.items()), **derived}, run


# The tracker's category for each part of the step (`BuildObserver.observe`'s phases).
_PHASES = {
    "params": ("setup", SHARDED),
    "optimizer": ("setup", OPT),
    "forward": ("forward", ACT),
    "backward": ("backward", TEMP),
    "step": ("step", TEMP),
}


def run_step(
    cfg: TrainConfig,
    world: int | None,
    tracker: Tracker | None,
    device: str = "cpu",
    depth: int | None = None,
    others: dict[str, list[tuple[Key, Segment]] | None] | None = None,
) -> Run:
    """The trainer's own build (`build_run`) and step (`backward_pass`, `optimizer_step`) as
    rank 0 of `world` FSDP ranks (a process group must exist; None: one process), with random
    weights and tokens: on fake tensors under `tracker`, or, without one, on real tensors on
    `device` (measuring the estimate). The step runs min(grad_accum, 2) micro-batches: from the
    second on, gradients are alive. Returns the run (its model and optimizer are the step's).

    `others` (under a tracker): for each optimizer named in it, the segments of the same step
    with that optimizer (`_OptimizerSwap`), or None where they could not be had."""
    cfg = cfg.replace()  # the build fills derived defaults in; the caller's config stays as is
    if cfg.techniques.activation_policy.kind == "budget":
        raise ValueError("run_step takes --ac none|full|selective; estimate_memory interpolates")
    env = None
    if world is not None:
        env = dist_.DistEnv(0, world, 0, min(world, GPUS_PER_NODE), torch.device(device), False)
        if tracker is None:
            env.rank = env.local_rank = torch.distributed.get_rank()
    fake = tracker is not None
    mode = mi.fake_mode() if fake else None

    def scope() -> contextlib.ExitStack:
        # Fake tensors (one mode for the whole step), resized storages seen, then the tracker.
        stack = contextlib.ExitStack()
        if mode is not None:
            stack.enter_context(mode)
        if tracker is not None:
            stack.enter_context(mi.watch_storage_resize(tracker.on_resize))
            if world is not None:
                stack.enter_context(mi.dtensor_shape_propagation(tracker.pause))
            stack.enter_context(op_memory.replaying(tracker.replay))
            stack.enter_context(tracker)
        return stack

    swap = _OptimizerSwap(tracker) if tracker is not None and others else None

    def observe(phase: str, params: list[torch.nn.Parameter]) -> None:
        if tracker is None:
            return
        if swap is not None and phase != "optimizer":
            swap.observe(phase)  # the optimizer's state is complete
        tracker.set_phase(*_PHASES[phase])
        if swap is not None and phase == "optimizer":
            swap.observe(phase)  # the state is recorded from here
        if phase == "optimizer":  # before the optimizer's own hooks (in-backward frees grads)
            for p in params:
                p.register_post_accumulate_grad_hook(
                    lambda p: p.grad is not None and tracker.retag(_local(p.grad), GRAD)
                )

    if cfg.objective.objective == "grpo":  # an update's micro-batch: G completions a prompt
        cfg = cfg.replace(batch_size=cfg.data.batch_size * cfg.objective.num_generations)
    plan = images_.image_plan(cfg, resolve_model_args(cfg))  # the data's images, if any
    opts = _options(cfg, device, fake, depth, plan is not None)
    run = build_run(cfg, env, opts, _Watcher(scope, observe))
    if swap is not None:
        swap.built()
    batch = _step_batch(cfg, run, plan)
    offload = None
    if tracker is not None:
        _mark_blocks(tracker, run.model)
        ep_.assume_routing(run.model, cfg.parallel.ep_skew)  # --ep: rows received, assumed
        if cfg.techniques.compile:  # what the eager selective blocks cache and never read
            policy = cfg.techniques.activation_policy
            follow_selective_blocks(run.model, policy, tracker)
    if cfg.techniques.offload_activations and tracker is not None:
        n = offloaded(cfg, resolve_model_args(cfg).n_layers)
        offload = _host_activation_hooks(tracker, run.model.layers[:n])
    with scope(), offload or contextlib.nullcontext():
        run.optimizer.set_lr(1e-4)
        done = backward_pass(run, batch)
        with contextlib.ExitStack() as children:
            # Each other optimizer's step in a forked child, beside this one's.
            forked = {
                kind: children.enter_context(
                    depth_.Forked(lambda kind=kind: swap.step_with(kind, run, done))
                )
                for kind in (others if swap is not None and others is not None else ())
            }
            optimizer_step(run, done)
            run.optimizer.remove_hooks()
            for kind, child in forked.items():
                others[kind] = child.result()  # type: ignore[index]
    return run


def _step_batch(cfg: TrainConfig, run: Run, plan: images_.ImagePlan | None) -> StepBatch:
    """The step's min(grad_accum, 2) random global batches, as the trainer draws them (each
    rank trains its slice), with `plan`'s images where the data holds images."""
    rows = cfg.data.batch_size * run.dp_world
    micro = [
        _random_batch(cfg, rows, run.args.vocab_size) for _ in range(min(cfg.data.grad_accum, 2))
    ]
    if plan is not None:
        micro = [images_.add_images(mb, plan) for mb in micro]
    if "pairs" in micro[0]:
        pairs = [mb["pairs"].tolist() for mb in micro]
        batch = StepBatch(micro, sum(sum(p) for p in pairs), pairs)
    else:
        batch = StepBatch(micro, len(micro) * rows * (cfg.data.seq_len - 1))
    return batch


def _options(
    cfg: TrainConfig, device: str, fake: bool, depth: int | None, images: bool = False
) -> BuildOptions:
    """run_step's build: on `device` in the dtype of the GPU estimated for, nothing read (random
    weights and tokens), fake tensors under a tracker, the first `depth` blocks, an eager step
    (compiled blocks modelled by the same policies run eagerly), float8 emulated; with the
    vision tower where the data holds `images`."""
    return BuildOptions(
        device=torch.device(device),
        dtype=gpu_dtype(cfg),
        read_inputs=False,
        fake=fake,
        depth=depth,
        compile=False,
        emulate_fp8=True,
        images=images,
    )


@dataclass
class _Watcher:
    """run_step's BuildObserver (train/observer.py): its scope and its phases' observer."""

    scope: Callable[[], contextlib.AbstractContextManager[Any]]
    observe: Callable[[str, list[torch.nn.Parameter]], None]


class _OptimizerSwap:
    """The same step with another optimizer (`--optimizer`), without running the model again.

    The optimizer's only part in the build is its state, created last, and only its step
    follows the backward: in between, the model runs the same ops whatever the optimizer, with
    the state alive as so many bytes (the bytes a tensor holds change nothing else the tracker
    sees). So after the backward a forked child builds the other optimizer, recording what its
    state did to the memory; the setup's stretch takes that in place of this optimizer's (from
    the moment this one was built), every stretch up to the step changes by the difference in
    state, and the child runs the optimizer step itself. The tests compare every number with
    running the other optimizer's step whole."""

    def __init__(self, tracker: Tracker) -> None:
        self.tracker = tracker
        self.before: tuple[Key, Segment, dict[str, int], int, int] | None = None
        self.mine: Recorded | None = None  # this optimizer's state being built
        self.tail: Recorded | None = None  # the rest of the setup's stretch
        self._recording: Any = None

    def _record(self) -> Recorded:
        self._stop()
        self._recording = self.tracker.recording()
        return self._recording.__enter__()

    def _stop(self) -> None:
        if self._recording is not None:
            self._recording.__exit__(None, None, None)
            self._recording = None

    def observe(self, phase: str) -> None:
        """At the "optimizer" phase (just entered) the state is about to be built: record it;
        at the next phase the setup's stretch ends."""
        t = self.tracker
        if phase == "optimizer":
            key = next(k for k, s in t.segments.items() if s is t.segment)
            seg = dataclasses.replace(t.segment)
            self.before = (key, seg, dict(t.totals), t.device_now, t.host_now)
            self.mine = self._record()
        else:
            self._stop()

    def built(self) -> None:
        """The build is done (the state with it): record the rest of the setup apart."""
        if self._recording is not None:
            self.tail = self._record()

    def step_with(self, kind: str, run: Run, done: Backward) -> list[tuple[Key, Segment]] | None:
        """In the forked child: this step's segments with optimizer `kind`; None when the
        state did not follow the pattern above."""
        t = self.tracker
        if self.before is None or self.mine is None or self.tail is None:
            return None
        if not _only_state(self.mine.change):
            return None
        key, setup, totals, device, host = self.before
        phase, category = t.phase, t.category
        with t.recording(merge=False) as dropped:
            run.optimizer.remove_hooks()
            run.optimizer = None  # type: ignore[assignment]
            gc.collect()
        if dropped.change != {k: -v for k, v in self.mine.change.items()}:
            return None
        t.phase, t.category = "setup", OPT
        cfg = run.cfg.replace(optimizer=kind)
        named = [(n, p) for n, p in run.model.named_parameters() if p.requires_grad]
        with t.recording(merge=False) as theirs:
            run.optimizer = build_optimizer(cfg, named, run.device, compile_step=False)
        t.phase, t.category = phase, category
        if not _only_state(theirs.change):
            return None
        fold(setup, theirs, totals, device, host)
        totals = {k: v + theirs.change[k] for k, v in totals.items()}
        device += sum(v for k, v in theirs.change.items() if k not in t.host)
        host += sum(v for k, v in theirs.change.items() if k in t.host)
        fold(setup, self.tail, totals, device, host)
        change = {k: theirs.change[k] - self.mine.change[k] for k in theirs.change}
        after = False
        for k, seg in list(t.segments.items()):
            if k == key:
                t.segments[k], after = setup, True
            elif after:
                t.segments[k] = shifted(seg, change, t.host)
        run.cfg = cfg
        run.optimizer.set_lr(1e-4)
        optimizer_step(run, done)
        run.optimizer.remove_hooks()
        return list(t.segments.items())


def _only_state(change: dict[str, int]) -> bool:
    """Whether a change of the totals is optimizer state alone."""
    return all(v == 0 for k, v in change.items() if k != OPT)


def _random_batch(cfg: TrainConfig, rows: int, vocab: int) -> dict[str, Tensor]:
    """A global batch of random tokens. Preference objectives get rows as pairs pack them: one
    pair per row, prompt + chosen then prompt + rejected, each half a row, the first quarter of
    each a prompt without targets (a shorter pair leaves more room; the step's memory follows
    the row, not the split)."""
    seq = cfg.data.seq_len
    tokens = torch.randint(0, vocab, (rows, seq))
    targets = torch.randint(0, vocab, (rows, seq))
    targets[:, :1] = IGNORE_INDEX
    if cfg.objective.objective not in ("dpo", "ipo", "simpo"):
        return {"inputs": tokens, "targets": targets}
    half = seq // 2
    pos = torch.arange(seq)
    doc = (pos >= half).long()
    positions = pos - doc * half
    response = positions >= half // 4
    seq_ids = torch.where(response, doc, -1).expand(rows, seq).clone()
    batch = {
        "inputs": tokens,
        "targets": torch.where(seq_ids >= 0, targets, IGNORE_INDEX),
        "positions": positions.expand(rows, seq).clone(),
        "doc_ids": doc.int().expand(rows, seq).clone(),
        "seq_ids": seq_ids,
        "pairs": torch.ones(rows, dtype=torch.long),
    }
    if cfg.objective.precompute_ref:
        batch["ref"] = torch.randn(rows, 2)
    return batch


def _mark_blocks(tracker: Tracker, model: Any) -> None:
    """Tell the tracker where each block's forward begins and ends and where its backward
    begins (the gradient of its output is ready); recomputation in backward is not a mark."""

    def begin(i: int, module: Any, inputs: Any) -> None:
        if tracker.phase == "forward":
            tracker.mark("block", i)

    def end(i: int, module: Any, inputs: Any, out: Any) -> None:
        if tracker.phase != "forward":
            return
        tracker.mark("after", i)
        for t in tree_leaves(out):
            if isinstance(t, Tensor) and t.requires_grad:
                t.register_hook(lambda g, i=i: tracker.mark("bwd", i))
                break

    for i, block in enumerate(model.layers):
        block.register_forward_pre_hook(functools.partial(begin, i))
        block.register_forward_hook(functools.partial(end, i))


def offloaded(cfg: TrainConfig, n_layers: int) -> int:
    """How many blocks (the first ones) of a model of `n_layers` offload what they save."""
    return cfg.techniques.offload_activations.count(n_layers)


def _host_activation_hooks(tracker: Tracker, blocks: Any) -> Any:
    """saved_tensors_hooks that move what `blocks` save to the host category (and back when
    backward reads it): `--offload-activations` without the compiler. What each block computes
    and its input (the hidden state), as passes/offload_activations.py moves them; what other
    blocks save stays on the device."""
    start: dict[str, Any] = {"seq": 0, "input": None}

    def block_start(module: Any, inputs: Any) -> None:
        start["seq"] = tracker.seq
        hidden = inputs[0] if inputs and isinstance(inputs[0], Tensor) else None
        start["input"] = None if hidden is None else hidden.untyped_storage()._cdata

    def block_end(module: Any, inputs: Any, output: Any) -> None:  # outside the blocks: kept
        start["seq"], start["input"] = math.inf, None

    for block in blocks:
        block.register_forward_pre_hook(block_start)
        block.register_forward_hook(block_end)

    def pack(t: Tensor) -> Tensor:
        got = tracker.category_of(t)
        mine = got is not None and (
            got[1] > start["seq"] or t.untyped_storage()._cdata == start["input"]
        )
        if mine and got[0] == ACT:
            tracker.retag(t, ACT_HOST)
        return t

    def unpack(t: Tensor) -> Tensor:
        got = tracker.category_of(t)
        if got is not None and got[0] == ACT_HOST:
            tracker.retag(t, ACT)
        return t

    return torch.autograd.graph.saved_tensors_hooks(pack, unpack)


def measure_cpu_step(cfg: TrainConfig, world: int | None = None) -> int:
    """Peak bytes of the same step run for real on CPU tensors: the highest running total of
    the CPU allocator's events (torch.profiler, profile_memory=True) from before the model is
    materialised to after the optimizer step. How the estimate is checked (tests, bench).

    world: FSDP2 over the process group the caller has set up (gloo), or None.
    """
    return mi.cpu_allocation_peak(lambda: run_step(cfg, world, None))


def measure_cuda_step(cfg: TrainConfig) -> int:
    """Peak bytes the same step allocates on the GPU, one process: torch.cuda's
    max_memory_allocated over the step, less what was allocated before it."""
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    run_step(cfg, None, None, device="cuda")
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - before
