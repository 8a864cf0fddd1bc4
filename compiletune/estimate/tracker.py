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
from collections.abc import Iterator
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

    # --- the dispatch hook ------------------------------------------------------------------

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        if func is _DEVICE:  # `tensor.device`: half the calls of an FSDP step, no memory
            return func(*args, **(kwargs or {}))
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented  # let DTensor run its local ops, which come back here
        kwargs = kwargs or {}
        if self.paused:
            return func(*args, **kwargs)  # DTensor's shape propagation, not the step's memory
        name = str(func)
        out = func(*args, **kwargs)
        category = TEMP if "all_gather_copy_in" in name else None
        for t in tree_leaves(out):
            if isinstance(t, Tensor) and not isinstance(t, DTensor):
                self.add(t, category)
        if "split_with_sizes_copy" in name:
            # FSDP2 copies a unit's gathered parameters out of the all-gather buffer into
            # their own storages (allocated here the first time, by resize_ after that).
            for t in tree_leaves(kwargs.get("out", ())):
                if isinstance(t, Tensor):
                    self.retag(t, GATHERED)
        if isinstance(func, torch._ops.OpOverload):
            # A custom op's outputs exist (it allocates them first) while what it holds inside
            # itself comes and goes: each op declares that (ops/op_memory.py).
            self.transient(op_memory.internal_bytes(func, args, kwargs))
        return out

    def set_phase(self, phase: str, category: str) -> None:
        self.phase, self.category = phase, category
        if phase == "forward":
            self.micro += 1
        self._enter((phase, self.micro, "start", -1))
