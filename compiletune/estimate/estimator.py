"""`compiletune estimate-memory`: the peak GPU memory of one training step, without a GPU.

The estimator runs the trainer's own step — model, activation checkpointing, FSDP2, loss head,
backward, optimizer step — on fake tensors (shapes and dtypes, no data, no memory), as rank 0 of
N ranks through a process group that does not communicate. A dispatch mode below autograd sees
every tensor the step creates and every storage it frees, and keeps a running total per
category:

    parameters        the model's (sharded) weights, and the blocks FSDP gathers for compute
    gradients         .grad of each (sharded) parameter
    optimizer_state   AdamW moments / 8-bit codes and scales, created with the optimizer
    activations       tensors created in the forward (what backward keeps, and forward scratch)
    temporaries       tensors created in backward and in the optimizer step (activation
                      gradients, recomputed activations, gather/scatter buffers), plus the
                      fused loss's internal chunks, which a custom op hides from fake tensors

The peak is the highest device total seen, with its breakdown at that moment. With
`--cpu-offload` the sharded parameters, gradients and optimizer state live in host memory and
are reported as host memory, not device memory.

What is approximated (stated in the output's `notes`):
    --compile            the step runs eagerly: the compiled blocks' saved tensors are close to
                         the eager ones (the same policy), not identical
    --ac budget=F        interpolated between `--ac none` (F = 1) and `--ac full` (F = 0): the
                         partitioner's budget is that fraction of the activation memory
    --offload-activations  what each block saves is moved to the host category after the
                         block's forward and back to the device when backward first reads it
    fused loss           one chunk of logits [c, V] (c from fused_loss.chunk_tokens, or
                         one_pass_chunk_tokens for the one-pass head) plus the weight-gradient
                         buffers, added while the op runs (all tokens counted as targets)
Not seen at all: the CUDA context and library workspaces (cuBLAS, NCCL), communication
buffers inside the process group, and allocator fragmentation (`RESERVE_BYTES` covers them in
the pre-flight check).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import time
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_leaves

from compiletune import distributed as dist_
from compiletune import recipes
from compiletune.compiler.activation import parse_ac
from compiletune.config import RunFacts, TrainConfig, fill_defaults, flag_text
from compiletune.errors import UserError
from compiletune.estimate import memory_internals as mi
from compiletune.loss.head import IGNORE_INDEX
from compiletune.models import num_params
from compiletune.ops import op_memory
from compiletune.optim import _local
from compiletune.train import Probe, Run, StepBatch, build_run, train_step
from compiletune.train.build import probe_dtype, resolve_model_args

CATEGORIES = ("parameters", "gradients", "optimizer_state", "activations", "temporaries")
# Internal categories: where FSDP keeps a tensor decides whether --cpu-offload moves it.
_SHARDED, _GATHERED, _GRAD, _OPT, _ACT, _ACT_HOST, _TEMP = (
    "params_sharded",
    "params_gathered",
    "grads",
    "opt",
    "act",
    "act_host",
    "temp",
)
_REPORTED = {
    _SHARDED: "parameters",
    _GATHERED: "parameters",
    _GRAD: "gradients",
    _OPT: "optimizer_state",
    _ACT: "activations",
    _ACT_HOST: "activations",
    _TEMP: "temporaries",
}
# The CUDA caching allocator hands out blocks in multiples of 512 bytes.
GPU_ROUND_BYTES = 512
# What a GPU needs beyond the tensors of the step: CUDA context, cuBLAS/NCCL workspaces,
# fragmentation. The pre-flight check keeps this much free.
RESERVE_BYTES = 2 * 2**30
GPUS_PER_NODE = 8  # hybrid sharding's default shard group (one node), as torchrun would set it

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
# The tracker.


class _Tracker(mi.TorchDispatchMode):
    """Running bytes per category of every storage alive, and the device peak with its parts.

    New storages take the category of the current phase (`self.category`); `retag` moves a
    storage to another category (a gradient is created in backward as a temporary and becomes a
    gradient when it lands in .grad). Storages are identified by their StorageImpl and counted
    once, however many tensors view them; a weak reference tells when one is freed.
    """

    def __init__(self, host: set[str], round_bytes: int = 1) -> None:
        super().__init__()
        self.category = _SHARDED
        self.host = host
        self.round_bytes = round_bytes
        self.entries: dict[int, list[Any]] = {}  # storage key -> [bytes, category, seq, weakref]
        self.totals = dict.fromkeys(_REPORTED, 0)
        self.seq = 0
        self.device_now = self.host_now = 0
        self.peak = 0
        self.peak_totals = dict(self.totals)
        self.peak_phase = ""
        self.host_peak = 0
        self.host_peak_totals = dict(self.totals)
        self.phase = "setup"
        self.phase_peaks: dict[str, int] = {}
        self.paused = 0

    @contextlib.contextmanager
    def pause(self) -> Iterator[None]:
        self.paused += 1
        try:
            yield
        finally:
            self.paused -= 1

    # --- bookkeeping ------------------------------------------------------------------------

    def _bytes(self, storage: torch.UntypedStorage) -> int:
        n = storage.nbytes()
        r = self.round_bytes
        return n if r <= 1 else -(-n // r) * r

    def _change(self, category: str, delta: int) -> None:
        self.totals[category] += delta
        if category in self.host:
            self.host_now += delta
            if self.host_now > self.host_peak:
                self.host_peak = self.host_now
                self.host_peak_totals = dict(self.totals)
            return
        self.device_now += delta
        if delta > 0:
            self._note_peak(self.device_now, None)

    def _note_peak(self, total: int, extra: tuple[str, int] | None) -> None:
        if total > self.phase_peaks.get(self.phase, 0):
            self.phase_peaks[self.phase] = total
        if total > self.peak:
            self.peak = total
            self.peak_totals = dict(self.totals)
            if extra is not None:
                self.peak_totals[extra[0]] += extra[1]
            self.peak_phase = self.phase

    def _freed(self, key: int, _ref: Any) -> None:
        entry = self.entries.pop(key, None)
        if entry is not None:
            self._change(entry[1], -entry[0])

    def add(self, t: Tensor, category: str | None = None) -> None:
        """Count t's storage (once) under `category` (default: the current phase's)."""
        storage = t.untyped_storage()
        key = storage._cdata
        if key in self.entries:
            return
        category = category or self.category
        nbytes = self._bytes(storage)
        self.seq += 1
        ref = weakref.ref(storage, lambda r, key=key: self._freed(key, r))
        self.entries[key] = [nbytes, category, self.seq, ref]
        self._change(category, nbytes)

    def retag(self, t: Tensor, category: str) -> None:
        entry = self.entries.get(t.untyped_storage()._cdata)
        if entry is None:
            self.add(t, category)
        elif entry[1] != category:
            self._change(entry[1], -entry[0])
            entry[1] = category
            self._change(category, entry[0])

    def category_of(self, t: Tensor) -> tuple[str, int] | None:
        entry = self.entries.get(t.untyped_storage()._cdata)
        return None if entry is None else (entry[1], entry[2])

    def transient(self, nbytes: int) -> None:
        """Temporaries an opaque op holds while it runs (not seen as tensors)."""
        if nbytes > 0:
            self._note_peak(self.device_now + nbytes, (_TEMP, nbytes))

    def on_resize(self, storage: torch.UntypedStorage) -> None:
        """FSDP2 gathers a parameter by growing its storage and frees it by shrinking it."""
        key = storage._cdata
        entry = self.entries.get(key)
        nbytes = self._bytes(storage)
        if entry is None:
            if nbytes == 0:
                return
            self.seq += 1
            ref = weakref.ref(storage, lambda r, key=key: self._freed(key, r))
            self.entries[key] = [0, _GATHERED, self.seq, ref]
            entry = self.entries[key]
        if entry[1] != _GATHERED:
            self._change(entry[1], -entry[0])
            entry[1] = _GATHERED
            self._change(_GATHERED, entry[0])
        delta = nbytes - entry[0]
        entry[0] = nbytes
        self._change(_GATHERED, delta)

    # --- the dispatch hook ------------------------------------------------------------------

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented  # let DTensor run its local ops, which come back here
        kwargs = kwargs or {}
        if self.paused:
            return func(*args, **kwargs)  # DTensor's shape propagation, not the step's memory
        name = str(func)
        out = func(*args, **kwargs)
        category = _TEMP if "all_gather_copy_in" in name else None
        for t in tree_leaves(out):
            if isinstance(t, Tensor) and not isinstance(t, DTensor):
                self.add(t, category)
        if "split_with_sizes_copy" in name:
            # FSDP2 copies a unit's gathered parameters out of the all-gather buffer into
            # their own storages (allocated here the first time, by resize_ after that).
            for t in tree_leaves(kwargs.get("out", ())):
                if isinstance(t, Tensor):
                    self.retag(t, _GATHERED)
        if isinstance(func, torch._ops.OpOverload):
            # A custom op's outputs exist (it allocates them first) while what it holds inside
            # itself comes and goes: each op declares that (ops/op_memory.py).
            self.transient(op_memory.internal_bytes(func, args, kwargs))
        return out

    def set_phase(self, phase: str, category: str) -> None:
        self.phase, self.category = phase, category


# ---------------------------------------------------------------------------------------------
# The estimate.


@dataclass
class MemoryEstimate:
    """Peak memory of one training step on the busiest GPU (rank 0), in bytes."""

    peak_bytes: int  # device peak: the tensors of the step
    parts: dict[str, int]  # CATEGORIES -> bytes at the peak (they sum to peak_bytes)
    host_bytes: int  # host memory offload needs (peak)
    host_parts: dict[str, int]
    peak_phase: str  # forward | backward | step
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
            out[_REPORTED[k]] += v
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
    cfg: TrainConfig, gpus: int = 1, round_bytes: int = GPU_ROUND_BYTES
) -> MemoryEstimate:
    """Run one step of the run `cfg` describes (a resolved TrainConfig) on fake tensors, as
    rank 0 of `gpus` ranks, and return its peak device memory and the host memory offload needs.

    More than one GPU means FSDP2 (as `torchrun --nproc-per-node N ... --fsdp` would run).
    """
    if gpus < 1:
        raise UserError(f"--gpus must be at least 1, got {gpus}")
    cfg = shapes_only(cfg)
    t0 = time.perf_counter()
    policy = parse_ac(cfg.techniques.ac, cfg.techniques.ac_every)
    notes = []
    if cfg.techniques.compile:
        notes.append(
            "--compile: estimated from the eager step with the same policies (compiled blocks "
            "save about as much)"
        )
    if policy.kind == "budget":
        # The partitioner's budget is a fraction of the activation memory between recomputing
        # everything (full) and saving what min-cut saves (none).
        hi = _estimate(cfg.replace(ac="none"), gpus, round_bytes)
        lo = _estimate(cfg.replace(ac="full"), gpus, round_bytes)
        f = policy.budget or 0.0
        est = _interpolate(lo, hi, f)
        notes.append(f"--ac {cfg.techniques.ac}: interpolated between --ac full and --ac none")
    else:
        est = _estimate(cfg, gpus, round_bytes)
    if cfg.techniques.offload_activations:
        notes.append(
            "--offload-activations: saved activations counted on the host from the end of their "
            "block's forward until backward reads them"
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
    est.notes = notes + est.notes
    est.seconds = time.perf_counter() - t0
    return est


def _interpolate(lo: MemoryEstimate, hi: MemoryEstimate, f: float) -> MemoryEstimate:
    def mix(a: int, b: int) -> int:
        return round(a + f * (b - a))

    out = dataclasses.replace(hi)
    out.peak_bytes = mix(lo.peak_bytes, hi.peak_bytes)
    out.parts = {k: mix(lo.parts[k], hi.parts[k]) for k in CATEGORIES}
    out.host_bytes = mix(lo.host_bytes, hi.host_bytes)
    out.host_parts = {k: mix(lo.host_parts[k], hi.host_parts[k]) for k in CATEGORIES}
    return out


def _estimate(cfg: TrainConfig, gpus: int, round_bytes: int) -> MemoryEstimate:
    fsdp = cfg.parallel.fsdp or gpus > 1
    host = {_SHARDED, _GRAD, _OPT} if cfg.parallel.cpu_offload else set()
    host.add(_ACT_HOST)
    tracker = _Tracker(host, round_bytes)
    group = mi.fake_process_group(gpus) if fsdp else contextlib.nullcontext()
    with group:
        run = run_step(cfg, gpus if fsdp else None, tracker)
    device_keep = set(_REPORTED) - host
    parts = _reported(tracker.peak_totals, device_keep)
    return MemoryEstimate(
        peak_bytes=tracker.peak,
        parts=parts,
        host_bytes=tracker.host_peak,
        host_parts=_reported(tracker.host_peak_totals, host),
        peak_phase=tracker.peak_phase,
        phase_peaks=dict(tracker.phase_peaks),
        gpus=gpus,
        setup={
            "model": cfg.name,
            "params": num_params(run.args),
            "dtype": cfg.model.dtype or "bf16",
            "seq_len": cfg.data.seq_len,
            "batch_size": cfg.data.batch_size,
            "grad_accum": cfg.data.grad_accum,
            "loss": run.cfg.techniques.loss,
            "ac": cfg.techniques.ac,
            "offload_activations": cfg.techniques.offload_activations,
            "optimizer": cfg.optim.optimizer,
            "optimizer_in_backward": cfg.optim.optimizer_in_backward,
            "fsdp": fsdp,
            "sharding": cfg.parallel.sharding if fsdp else None,
            "cpu_offload": cfg.parallel.cpu_offload,
            "objective": cfg.objective.objective,
        },
    )


# The tracker's category for each part of the step (`Probe.observe`'s phases).
_PHASES = {
    "params": ("setup", _SHARDED),
    "optimizer": ("setup", _OPT),
    "forward": ("forward", _ACT),
    "backward": ("backward", _TEMP),
    "step": ("step", _TEMP),
}


def run_step(
    cfg: TrainConfig, world: int | None, tracker: _Tracker | None, device: str = "cpu"
) -> Run:
    """The trainer's own build (`build_run`) and step (`train_step`) as rank 0 of `world` FSDP
    ranks (a process group must exist; None: one process), with random weights and tokens: on
    fake tensors under `tracker`, or, without one, on real tensors on `device` (measuring the
    estimate). The step runs min(grad_accum, 2) micro-batches: from the second on, gradients
    are alive. Returns the run (its model and optimizer are the step's)."""
    cfg = cfg.replace()  # the build fills derived defaults in; the caller's config stays as is
    if parse_ac(cfg.techniques.ac, cfg.techniques.ac_every).kind == "budget":
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
            stack.enter_context(tracker)
        return stack

    def observe(phase: str, params: list[torch.nn.Parameter]) -> None:
        if tracker is None:
            return
        tracker.set_phase(*_PHASES[phase])
        if phase == "optimizer":  # before the optimizer's own hooks (in-backward frees grads)
            for p in params:
                p.register_post_accumulate_grad_hook(
                    lambda p: p.grad is not None and tracker.retag(_local(p.grad), _GRAD)
                )

    run = build_run(cfg, env, fake=fake, probe=Probe(scope, observe, device))
    rows = cfg.data.batch_size * run.world
    # global batches, as the trainer draws them; each rank trains its slice
    micro = [
        _random_batch(cfg, rows, run.args.vocab_size) for _ in range(min(cfg.data.grad_accum, 2))
    ]
    if "pairs" in micro[0]:
        pairs = [mb["pairs"].tolist() for mb in micro]
        batch = StepBatch(micro, sum(sum(p) for p in pairs), pairs)
    else:
        batch = StepBatch(micro, len(micro) * rows * (cfg.data.seq_len - 1))
    offload = None
    if cfg.techniques.offload_activations and tracker is not None:
        offload = _host_activation_hooks(tracker, run.model)
    with scope(), offload or contextlib.nullcontext():
        train_step(run, batch, lr=1e-4)
        run.optimizer.remove_hooks()
    return run


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


def _host_activation_hooks(tracker: _Tracker, model: Any) -> Any:
    """saved_tensors_hooks that move what a block saves to the host category (and back when
    backward reads it): `--offload-activations` without the compiler."""
    start = {"seq": 0}

    def block_start(module: Any, inputs: Any) -> None:
        start["seq"] = tracker.seq

    for block in model.layers:
        block.register_forward_pre_hook(block_start)

    def pack(t: Tensor) -> Tensor:
        got = tracker.category_of(t)
        if got is not None and got[0] == _ACT and got[1] > start["seq"]:
            tracker.retag(t, _ACT_HOST)
        return t

    def unpack(t: Tensor) -> Tensor:
        got = tracker.category_of(t)
        if got is not None and got[0] == _ACT_HOST:
            tracker.retag(t, _ACT)
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
# Rungs that change what is trained (only the adapters): shown by --ladder, never suggested,
# which keeps the run a full fine-tune.
LORA_RUNGS: list[tuple[str, dict[str, Any]]] = [
    ("+ LoRA r16 (adapters only)", {"lora_rank": 16, "lora_alpha": 32.0}),
    ("+ QLoRA (NF4 base)", {"quantize_base": "nf4"}),
]
# Keys a rung sets along with another flag, not shown on their own (LoRA's alpha follows its
# rank; in-backward steps imply no clipping).
_IMPLIED = {"lora_alpha", "max_grad_norm"}


@dataclass
class Rung:
    name: str
    flags: str  # the flags this rung adds ("" for the start)
    est: MemoryEstimate | None  # None: not estimated (see `why`)
    why: str = ""  # "already on", or why the rung does not apply


def flags_text(changes: dict[str, Any]) -> str:
    return " ".join(t for k, v in changes.items() if k not in _IMPLIED and (t := flag_text(k, v)))


def _todo(cfg: TrainConfig, changes: dict[str, Any]) -> dict[str, Any]:
    """The part of a rung's flags that `cfg` does not already have (any --ac policy counts as
    activation checkpointing being on)."""
    if "ac" in changes and cfg.techniques.ac != "none":
        return {}
    return {k: v for k, v in changes.items() if cfg.get(k) != v}


def _not_applicable(cfg: TrainConfig, changes: dict[str, Any]) -> str:
    """Why a rung's flags are invalid for this run ("" when they are valid)."""
    if changes.get("lora_rank") and cfg.model.dtype == "bf16-mixed":
        return "n/a (LoRA takes --dtype bf16, not bf16-mixed)"
    if changes.get("optimizer_in_backward") and cfg.data.grad_accum > 1:
        return "n/a (needs --grad-accum 1)"
    return ""


def as_trained(cfg: TrainConfig, gpus: int) -> TrainConfig:
    """`cfg` with the defaults `train` derives from the model filled in (the loss head, say), so
    the ladder and the advice start from the run `train` would run."""
    cfg = shapes_only(cfg)
    vocab = resolve_model_args(cfg).vocab_size
    facts = RunFacts(vocab, packs_documents=False, world=gpus)
    facts.bf16_params = probe_dtype(cfg) == torch.bfloat16
    return fill_defaults(cfg.replace(), facts)


def ladder(cfg: TrainConfig, gpus: int) -> list[Rung]:
    """The run as `train` would run it, then each rung's flags added to those before."""
    current = as_trained(cfg, gpus)
    rows = [Rung("as configured", "", estimate_memory(current, gpus))]
    for name, changes in LADDER + LORA_RUNGS:
        todo = _todo(current, changes)
        if not todo:
            rows.append(Rung(name, flags_text(changes), None, "already on"))
            continue
        if why := _not_applicable(current, todo):
            rows.append(Rung(name, flags_text(todo), None, why))
            continue
        candidate = current.replace(**todo)
        try:
            est = estimate_memory(candidate, gpus)
        except UserError as e:  # e.g. NF4 blocks that do not divide this model's rows
            rows.append(Rung(name, flags_text(todo), None, f"n/a ({e})"))
            continue
        current = candidate
        rows.append(Rung(name, flags_text(todo), est))
    return rows


def suggest(cfg: TrainConfig, gpus: int, capacity: Capacity) -> tuple[str, MemoryEstimate] | None:
    """The cheapest flags that make `cfg`'s step fit, with their estimate; None when even every
    rung of the ladder does not. Rungs are added cheapest first until the step fits, then each
    earlier rung is dropped again where the step still fits without it (so `--ac full` alone is
    the answer when it is enough, not `--ac full` plus the cheaper rungs tried on the way)."""
    cfg = as_trained(cfg, gpus)
    current, added = cfg, []
    est = None
    for _, changes in LADDER:
        todo = _todo(current, changes)
        if not todo or _not_applicable(current, todo):
            continue
        current = current.replace(**todo)
        added.append(todo)
        est = estimate_memory(current, gpus)
        if fits(est, capacity):
            break
    else:
        return None
    for todo in list(reversed(added[:-1])):
        keep = [t for t in added if t is not todo]
        trial = cfg.replace(**{k: v for t in keep for k, v in t.items()})
        trial_est = estimate_memory(trial, gpus)
        if fits(trial_est, capacity):
            added, est = keep, trial_est
    assert est is not None
    return flags_text({k: v for t in added for k, v in t.items()}), est


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


def advice(cfg: TrainConfig, gpus: int, capacity: Capacity) -> str:
    """What to do about a step that does not fit: the cheapest flags that fit, or more GPUs."""
    found = suggest(cfg, gpus, capacity)
    if found is None:
        return "no technique flag makes it fit: use more GPUs (--fsdp), a shorter --seq-len or --batch-size"
    flags, est = found
    return f"add {flags} (then about {est.peak_bytes / 2**30:.1f} GiB per GPU)"


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


def format_estimate(
    est: MemoryEstimate, capacity: Capacity | None = None, fix: str | None = None
) -> str:
    gib = 2**30
    s = est.setup
    lines = [
        f"{s['model']} ({s['params'] / 1e9:.2f}B parameters), {est.gpus} GPU(s)"
        + (f", FSDP2 {s['sharding']}" if s["fsdp"] else "")
        + (" + CPU offload" if s["cpu_offload"] else "")
        + f"; {s['dtype']}, seq {s['seq_len']} x batch {s['batch_size']} per GPU, loss "
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
    lines.append(f"(estimated in {est.seconds:.1f}s on fake tensors)")
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
