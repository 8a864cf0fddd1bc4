"""The estimate's memory model: every storage a fake training step creates and frees, with a
running total per category, and the step cut into segments, each with its peak.

    parameters        the model's (sharded) weights, and the blocks FSDP gathers for compute
    gradients         .grad of each (sharded) parameter
    optimizer_state   AdamW moments / 8-bit codes and scales, created with the optimizer
    activations       tensors created in the forward (what backward keeps, and forward scratch)
    temporaries       tensors created in backward and in the optimizer step (activation
                      gradients, recomputed activations, gather/scatter buffers), plus what a
                      custom op holds inside itself, which it declares (ops/op_memory.py)
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Hashable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_leaves

from compiletune.estimate import memory_internals as mi
from compiletune.ops import op_memory

CATEGORIES = ("parameters", "gradients", "optimizer_state", "activations", "temporaries")
# Internal categories: where FSDP keeps a tensor decides whether --cpu-offload moves it.
SHARDED, GATHERED, GRAD, OPT, ACT, ACT_HOST, TEMP = (
    "params_sharded",
    "params_gathered",
    "grads",
    "opt",
    "act",
    "act_host",
    "temp",
)
REPORTED = {
    SHARDED: "parameters",
    GATHERED: "parameters",
    GRAD: "gradients",
    OPT: "optimizer_state",
    ACT: "activations",
    ACT_HOST: "activations",
    TEMP: "temporaries",
}
_DEVICE = torch.ops.prim.device.default
# The CUDA caching allocator hands out blocks in multiples of 512 bytes.
GPU_ROUND_BYTES = 512


# What the dispatch hook does beyond counting outputs, per op (looked up once per op).
_KINDS: dict[Any, str] = {}


def _kind(func: Any) -> str:
    if func in mi.VIEWS:
        return "view"  # made from the fake tensor's metadata (`mi.fake_view`)
    name = str(func)
    if "all_gather_copy_in" in name:
        return "gather_in"  # FSDP2's all-gather input buffer: a temporary
    if "split_with_sizes_copy" in name:
        return "split_copy"
    if isinstance(func, torch._ops.OpOverload) and func._schema.name.startswith(
        op_memory.NAMESPACE + "::"
    ):
        return "custom"
    return ""


# ---------------------------------------------------------------------------------------------
# The tracker.


Key = tuple[
    str, int, str, int
]  # a segment: (phase, micro-batch, "start" | "block" | "after" | "bwd", block)


@dataclass
class Segment:
    """A stretch of the step: its device peak and host peak (-1: no allocation counted in
    it), each with the totals per category at the moment it was first reached."""

    peak: int = -1
    totals: dict[str, int] = field(default_factory=dict)
    host_peak: int = -1
    host_totals: dict[str, int] = field(default_factory=dict)

    def vector(self) -> tuple[int, ...]:
        """Every number the segment holds, in a fixed order (what the depth shortcut fits)."""
        return (
            self.peak,
            self.host_peak,
            *(self.totals.get(k, 0) for k in REPORTED),
            *(self.host_totals.get(k, 0) for k in REPORTED),
        )

    @classmethod
    def from_vector(cls, v: tuple[int, ...]) -> Segment:
        n = len(REPORTED)
        return cls(
            v[0],
            dict(zip(REPORTED, v[2 : 2 + n], strict=True)),
            v[1],
            dict(zip(REPORTED, v[2 + n :], strict=True)),
        )


@dataclass
class Peaks:
    """The step's device and host peaks, read from its segments in the order they ran: the
    first segment that reaches the highest value holds the totals at that moment."""

    peak: int = 0
    totals: dict[str, int] = field(default_factory=lambda: dict.fromkeys(REPORTED, 0))
    phase: str = ""
    phase_peaks: dict[str, int] = field(default_factory=dict)
    host_peak: int = 0
    host_totals: dict[str, int] = field(default_factory=lambda: dict.fromkeys(REPORTED, 0))

    @classmethod
    def of(cls, segments: list[tuple[Key, Segment]]) -> Peaks:
        out = cls()
        for key, seg in segments:
            phase = key[0]
            if seg.peak > 0 and seg.peak > out.phase_peaks.get(phase, 0):
                out.phase_peaks[phase] = seg.peak
            if seg.peak > out.peak:
                out.peak, out.totals, out.phase = seg.peak, seg.totals, phase
            if seg.host_peak > out.host_peak:
                out.host_peak, out.host_totals = seg.host_peak, seg.host_totals
        return out


class Tracker(mi.TorchDispatchMode):
    """Running bytes per category of every storage alive, and the device peak with its parts.

    New storages take the category of the current phase (`self.category`); `retag` moves a
    storage to another category (a gradient is created in backward as a temporary and becomes a
    gradient when it lands in .grad). Storages are identified by their StorageImpl and counted
    once, however many tensors view them; a weak reference tells when one is freed.
    """

    def __init__(self, host: set[str], round_bytes: int = 1) -> None:
        super().__init__()
        self.category = SHARDED
        self.host = host
        self.round_bytes = round_bytes
        self.entries: dict[int, list[Any]] = {}  # storage key -> [bytes, category, seq, weakref]
        self.totals = dict.fromkeys(REPORTED, 0)
        self.seq = 0
        self.device_now = self.host_now = 0
        self.phase = "setup"
        self.paused = 0
        # The step cut into segments, in the order they run: (phase, micro-batch, what runs,
        # block index) -> its device and host peaks with the totals at each. The step's peaks
        # are read from them (`Peaks`), and so is the depth shortcut.
        self.micro = 0
        self.segments: dict[Key, Segment] = {}
        # Replayable functions (ops/op_memory.py): what each key's call did to the memory, or
        # how many of its calls could not be replayed.
        self.replays: dict[Hashable, _Replay | int] = {}
        self.segment = self._enter(("setup", 0, "start", -1))

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
            seg = self.segment
            if self.host_now > seg.host_peak:
                seg.host_peak = self.host_now
                seg.host_totals = dict(self.totals)
            return
        self.device_now += delta
        if delta > 0:
            self._note_peak(self.device_now, None)

    def _enter(self, key: Key) -> Segment:
        seg = self.segments.get(key)
        if seg is None:
            seg = self.segments[key] = Segment()
        self.segment = seg
        return seg

    def mark(self, what: str, index: int) -> None:
        """A block begins ("block"), ends ("after") or begins its backward ("bwd")."""
        self._enter((self.phase, self.micro, what, index))

    def _note_peak(self, total: int, extra: tuple[str, int] | None) -> None:
        seg = self.segment
        if total > seg.peak:
            seg.peak = total
            seg.totals = dict(self.totals)
            if extra is not None:
                seg.totals[extra[0]] += extra[1]

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

    def forget(self, t: Tensor) -> None:
        """Stop counting t's storage from now on, as if it were freed: a tensor the eager step
        keeps that the compiled step it stands for does not (selective_saves.py)."""
        entry = self.entries.get(t.untyped_storage()._cdata)
        if entry is not None and entry[0]:
            self._change(entry[1], -entry[0])
            entry[0] = 0

    def transient(self, nbytes: int) -> None:
        """Temporaries an opaque op holds while it runs (not seen as tensors)."""
        if nbytes > 0:
            self._note_peak(self.device_now + nbytes, (TEMP, nbytes))

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
            self.entries[key] = [0, GATHERED, self.seq, ref]
            entry = self.entries[key]
        if entry[1] != GATHERED:
            self._change(entry[1], -entry[0])
            entry[1] = GATHERED
            self._change(GATHERED, entry[0])
        delta = nbytes - entry[0]
        entry[0] = nbytes
        self._change(GATHERED, delta)

    @contextlib.contextmanager
    def recording(self, merge: bool = True) -> Iterator[Recorded]:
        """What the code inside the block does to the memory (`Recorded`, complete when the
        block ends). merge: its peaks count in the current segment, as if it ran there
        unrecorded; else they count nowhere (the caller folds them in elsewhere). A block mark
        inside (`rec.moved`) leaves the segment it entered current."""
        seg, probe, rec = self.segment, Segment(), Recorded(None, None, {})
        totals, device, host = dict(self.totals), self.device_now, self.host_now
        self.segment = probe
        try:
            yield rec
        finally:
            rec.moved = self.segment is not probe
            if not rec.moved:
                self.segment = seg
            if merge:
                _merge(seg, probe)
            rec.device, rec.host = _excess(probe, totals, device, host)
            rec.change = {k: v - totals[k] for k, v in self.totals.items()}

    # --- replayable functions ------------------------------------------------------------

    def replay(
        self, fn: Callable[..., Any], key: Hashable, args: tuple, kwargs: dict[str, Any]
    ) -> Any:
        """Run `fn(*args, **kwargs)`, a replayable function (ops/op_memory.py), or replay what
        an earlier call of the same key did to the memory: its highest point over the call's
        start (device and host, with the totals' change there) and the one new tensor it
        returned (an empty one of the same layout, counted like any op's output). A call
        runs as it is when the tracker is paused or another dispatch mode sees ops first
        (selective checkpointing's, which caches every op of the forward for its recompute),
        and a key always runs after `_REPLAY_TRIES` calls that kept or freed anything else,
        returned something else, or held a block mark."""
        if self.paused or mi.innermost_dispatch_mode() is not self:
            return fn(*args, **kwargs)
        key = (key, self.phase, self.category)
        memo = self.replays.get(key, 0)
        if isinstance(memo, _Replay):
            return self._replay(memo)
        if memo >= _REPLAY_TRIES:
            return fn(*args, **kwargs)
        seq = self.seq
        with self.recording() as rec:
            out = fn(*args, **kwargs)
        made = _made(out)
        kept = []  # entries made by the call and still alive (entries are in `seq` order)
        for e in reversed(self.entries.values()):
            if e[2] <= seq:
                break
            kept.append(e)
        change = rec.change
        if rec.moved:  # a block mark inside: no replay
            ok = False
        elif out is None:
            ok = not kept and not any(change.values())
        else:
            entry = self.entries.get(out.untyped_storage()._cdata) if made else None
            ok = (
                len(kept) == 1
                and entry is kept[0]
                and entry[1] == self.category
                and change == {k: entry[0] if k == entry[1] else 0 for k in change}
            )
        if ok:
            self.replays[key] = _Replay(rec.device, rec.host, made)
        else:
            self.replays[key] = memo + 1
        return out

    def _replay(self, memo: _Replay) -> Tensor | None:
        fold(self.segment, memo, self.totals, self.device_now, self.host_now)
        if memo.out is None:
            return None
        shape, stride, dtype, device = memo.out
        return torch.empty_strided(shape, stride, dtype=dtype, device=device)

    # --- the dispatch hook ------------------------------------------------------------------

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        if func is _DEVICE:  # `tensor.device`: half the calls of a step, no memory
            # A fake tensor's, without a dispatch. (FakeTensorMode answers "meta" inside its
            # kernels, which run with Python dispatch off: never here.)
            device = getattr(args[0], "fake_device", None)
            return device if device is not None else func(*args, **(kwargs or {}))
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented  # let DTensor run its local ops, which come back here
        kwargs = kwargs or {}
        if self.paused:
            return func(*args, **kwargs)  # DTensor's shape propagation, not the step's memory
        kind = _KINDS.get(func)
        if kind is None:
            kind = _KINDS[func] = _kind(func)
        out = mi.fake_view(func, args, kwargs) if kind == "view" else None
        if out is None:
            out = func(*args, **kwargs)
        category = TEMP if kind == "gather_in" else None
        if isinstance(out, Tensor):  # most ops: one tensor out
            if not isinstance(out, DTensor):
                self.add(out, category)
        else:
            for t in tree_leaves(out):
                if isinstance(t, Tensor) and not isinstance(t, DTensor):
                    self.add(t, category)
        if kind == "split_copy":
            # FSDP2 copies a unit's gathered parameters out of the all-gather buffer into
            # their own storages (allocated here the first time, by resize_ after that).
            for t in tree_leaves(kwargs.get("out", ())):
                if isinstance(t, Tensor):
                    self.retag(t, GATHERED)
        elif kind == "custom":
            # A custom op's outputs exist (it allocates them first) while what it holds inside
            # itself comes and goes: each op declares that (ops/op_memory.py).
            self.transient(op_memory.internal_bytes(func, args, kwargs))
        return out

    def set_phase(self, phase: str, category: str) -> None:
        self.phase, self.category = phase, category
        if phase == "forward":
            self.micro += 1
        self._enter((phase, self.micro, "start", -1))


# ---------------------------------------------------------------------------------------------
# Replays (`Tracker.replay`).

_REPLAY_TRIES = 2  # calls of a key that could not be replayed before it always runs
# a tensor's shape, strides, dtype and device
Layout = tuple[tuple[int, ...], tuple[int, ...], torch.dtype, torch.device]


Excess = tuple[int, dict[str, int]]  # a highest point over a start, and the totals' change there


@dataclass
class _Replay:
    """What a replayable call did to the memory: its highest device and host points over its
    start, each with the change of the totals there (None: nothing counted), and the layout of
    the new tensor it returned (shape, strides, dtype, device), or None."""

    device: Excess | None
    host: Excess | None
    out: Layout | None


@dataclass
class Recorded:
    """What a stretch of code did to the memory (`Tracker.recording`): its highest device and
    host points over its start, each with the totals' change there (None: nothing counted),
    and the totals' change at its end."""

    device: Excess | None
    host: Excess | None
    change: dict[str, int]
    moved: bool = False  # a block mark inside: the stretch ended in another segment


def _excess(
    probe: Segment, totals: dict[str, int], device: int, host: int
) -> tuple[Excess | None, Excess | None]:
    """A probe segment's peaks as (excess over the start, change of the totals there)."""
    return (
        None if probe.peak < 0 else (probe.peak - device, _diff(probe.totals, totals)),
        None if probe.host_peak < 0 else (probe.host_peak - host, _diff(probe.host_totals, totals)),
    )


def fold(
    seg: Segment, rec: _Replay | Recorded, totals: dict[str, int], device: int, host: int
) -> None:
    """Count in `seg` the peaks of a recorded stretch run from the state (`totals`, `device`
    and `host` bytes in use), as if it had run there."""
    if rec.device is not None:
        excess, change = rec.device
        if device + excess > seg.peak:
            seg.peak = device + excess
            seg.totals = {k: v + change.get(k, 0) for k, v in totals.items()}
    if rec.host is not None:
        excess, change = rec.host
        if host + excess > seg.host_peak:
            seg.host_peak = host + excess
            seg.host_totals = {k: v + change.get(k, 0) for k, v in totals.items()}


def shifted(seg: Segment, change: dict[str, int], host: set[str]) -> Segment:
    """`seg` as it would be with `change` more bytes per category alive throughout it."""
    device_up = sum(v for k, v in change.items() if k not in host)
    host_up = sum(v for k, v in change.items() if k in host)
    out = Segment()
    if seg.peak >= 0:
        out.peak = seg.peak + device_up
        out.totals = {k: v + change.get(k, 0) for k, v in seg.totals.items()}
    if seg.host_peak >= 0:
        out.host_peak = seg.host_peak + host_up
        out.host_totals = {k: v + change.get(k, 0) for k, v in seg.host_totals.items()}
    return out


def _made(out: Any) -> Layout | None:
    """The layout of `out` when it is a plain tensor that an empty one of the same shape and
    strides stands for (its own whole storage, no autograd history); else None."""
    if not isinstance(out, Tensor) or isinstance(out, DTensor) or out.requires_grad:
        return None
    if mi.is_traceable_wrapper_subclass(out):  # no storage of its own (float8)
        return None
    if out.storage_offset() != 0 or any(n == 0 for n in out.shape):
        return None
    span = 1 + sum((n - 1) * st for n, st in zip(out.shape, out.stride(), strict=True))
    if span * out.element_size() != out.untyped_storage().nbytes():
        return None
    return tuple(out.shape), out.stride(), out.dtype, out.device


def _merge(seg: Segment, probe: Segment) -> None:
    """Fold the peaks a call reached (`probe`) into the segment it ran in."""
    if probe.peak > seg.peak:
        seg.peak, seg.totals = probe.peak, probe.totals
    if probe.host_peak > seg.host_peak:
        seg.host_peak, seg.host_totals = probe.host_peak, probe.host_totals


def _diff(a: dict[str, int], b: dict[str, int]) -> dict[str, int]:
    return {k: a.get(k, 0) - b.get(k, 0) for k in b}
