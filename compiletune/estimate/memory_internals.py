"""The private PyTorch APIs the memory estimator (`estimate/`) needs, in one place.

Checked on torch 2.13 (CPU); each exists since torch 2.4 or earlier. A torch upgrade that moves
one of them touches this file only, and a missing one is reported as a `UserError` naming it.

    FakeTensorMode          tensors with shapes, dtypes and devices but no data: the whole step
                            runs without allocating its memory
    TorchDispatchMode       sees every aten op (and its output tensors) below autograd
    fake process group      collectives that do nothing, so FSDP2 runs as rank 0 of N ranks in
                            this one process (torch.testing._internal.distributed.fake_pg)
    ShardingPropagator      DTensor computes output shapes by running each op on fake tensors
                            of global shape, in the estimator's own fake mode: memory the step
                            never holds, so the estimator pauses counting around it
    UntypedStorage.resize_  FSDP2 frees and re-allocates gathered parameters by resizing their
                            storage, which no dispatch mode sees; the estimator wraps it
    _get_current_dispatch_mode  the innermost dispatch mode: the tracker replays a call only
                            when it is that mode (selective checkpointing puts its own above)
    is_traceable_wrapper_subclass  a tensor subclass that wraps others (float8) and has no
                            storage of its own
    FakeTensor, _DisableTorchDispatch  a view of a fake tensor made from its meta data directly
                            (`fake_view`): a third of FakeTensorMode's cost per op
    profiler event tree     the CPU allocator's events with their addresses
                            (`cpu_allocation_peak`: the real step's peak that tests check against)
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from compiletune.errors import UserError

try:
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
    from torch.utils._python_dispatch import (
        TorchDispatchMode,
        _get_current_dispatch_mode,
        is_traceable_wrapper_subclass,
    )
except ImportError as e:  # pragma: no cover - depends on the torch build
    raise ImportError(
        f"compiletune estimate-memory needs torch's FakeTensorMode and TorchDispatchMode ({e}); "
        "install torch >= 2.11"
    ) from e

__all__ = [
    "TorchDispatchMode",
    "VIEWS",
    "dtensor_shape_propagation",
    "fake_mode",
    "fake_view",
    "fake_process_group",
    "innermost_dispatch_mode",
    "is_traceable_wrapper_subclass",
    "watch_storage_resize",
]


def fake_mode() -> FakeTensorMode:
    """A fake tensor mode that also accepts meta tensors (the model is built on meta and
    materialised inside the mode; the meta tensors become fake ones)."""
    return FakeTensorMode(allow_non_fake_inputs=True)


aten = torch.ops.aten
# Ops whose one output is a view of their one tensor input (no memory of its own): about 45%
# of a step's ops besides `tensor.device` (`detach` alone 18%: autograd's and checkpointing's
# saved tensors).
VIEWS = frozenset(
    {
        aten.detach.default,
        aten.t.default,
        aten.view.default,
        aten._unsafe_view.default,
        aten.transpose.int,
        aten.unsqueeze.default,
        aten.expand.default,
        aten.permute.default,
        aten.slice.Tensor,
        aten.select.int,
        aten.squeeze.dim,
        aten.alias.default,
    }
)


def fake_view(func: Any, args: tuple, kwargs: dict) -> torch.Tensor | None:
    """`func` (one of VIEWS) on a fake tensor, run by the kernel of its (CPU) device on the
    tensor itself with Python dispatch off (a view kernel reads and writes metadata only) and
    wrapped as a fake tensor of the same mode and device: what FakeTensorMode returns for it
    (the same storage, shape, strides and offset), for about a third of the time. For a
    dispatch mode's handler, below autograd (autograd makes the view's autograd metadata
    above). None when the call is not that simple (another tensor argument, keywords, a fake
    tensor that holds a constant, a fake device other than the CPU): FakeTensorMode then runs
    it."""
    x = args[0] if args else None
    if type(x) is not FakeTensor or x.constant is not None or kwargs:
        return None
    if x.fake_device.type not in ("cpu", "meta"):  # the kernel run is the fake device's
        return None
    if any(isinstance(a, torch.Tensor) for a in args[1:]):
        return None
    with torch._C._DisableTorchDispatch():
        out = func(*args)
    return FakeTensor(x.fake_mode, out, x.fake_device)


def innermost_dispatch_mode() -> TorchDispatchMode | None:
    """The dispatch mode that sees an op first (the last one entered), or None."""
    return _get_current_dispatch_mode()


@contextlib.contextmanager
def fake_process_group(world: int) -> Iterator[None]:
    """The default process group as rank 0 of `world` ranks, without communication; torn down on
    exit. Refuses to run beside a real process group (they would share the default group)."""
    if dist.is_initialized():
        raise UserError(
            "the memory estimate simulates its own process group and cannot run inside a "
            "distributed job; run `compiletune estimate-memory` as a single process"
        )
    try:
        from torch.testing._internal.distributed.fake_pg import FakeStore
    except ImportError as e:
        raise UserError(
            f"this torch build has no fake process group ({e}); estimate without --fsdp/--gpus "
            "or install torch >= 2.11"
        ) from e
    dist.init_process_group("fake", rank=0, world_size=world, store=FakeStore())
    try:
        yield
    finally:
        dist.destroy_process_group()


@contextlib.contextmanager
def watch_storage_resize(on_resize: Callable[[torch.UntypedStorage], Any]) -> Iterator[None]:
    """Call `on_resize(storage)` after every `UntypedStorage.resize_` while inside."""
    original = torch.UntypedStorage.resize_

    def resize_(storage: torch.UntypedStorage, size: int) -> Any:
        out = original(storage, size)
        on_resize(storage)
        return out

    torch.UntypedStorage.resize_ = resize_  # type: ignore[method-assign]
    try:
        yield
    finally:
        torch.UntypedStorage.resize_ = original  # type: ignore[method-assign]


@contextlib.contextmanager
def dtensor_shape_propagation(paused: Callable[[], Any]) -> Iterator[None]:
    """Run DTensor's output-shape propagation inside the context `paused()` while inside."""
    from torch.distributed.tensor._sharding_prop import ShardingPropagator

    name = "_propagate_tensor_meta_non_cached"
    original = getattr(ShardingPropagator, name, None)
    if original is None:
        raise UserError(
            f"this torch build has no ShardingPropagator.{name}, which the memory estimate "
            "wraps; estimate without --fsdp/--gpus or use torch 2.11-2.13"
        )

    def wrapped(self: Any, *args: Any, **kwargs: Any) -> Any:
        with paused():
            return original(self, *args, **kwargs)

    setattr(ShardingPropagator, name, wrapped)
    try:
        yield
    finally:
        setattr(ShardingPropagator, name, original)


def cpu_allocation_peak(fn: Callable[[], Any]) -> int:
    """Run `fn` and return the highest running total of the CPU allocator's events during it
    (bytes above what was live before): torch.profiler with profile_memory=True, read through
    the profiler's event tree (not a documented structure).

    Only frees of blocks allocated during `fn` count. The allocator's size table outlives a
    profiling session, so a block allocated under an earlier profiler and freed during this one
    (the garbage collector reclaiming an earlier step's model, at a moment that depends on
    which tests ran before in the process) would otherwise be subtracted from this step.
    """
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted(
        (e.start_time_ns, e.extra_fields.ptr, e.extra_fields.alloc_size)
        for e in _event_tree(prof.profiler.kineto_results.experimental_event_tree())
        if isinstance(e.extra_fields, torch._C._profiler._ExtraFields_Allocation)
        and e.extra_fields.device.type == "cpu"
    )
    held: dict[int, int] = {}  # address -> bytes, of blocks allocated in the window
    live = peak = 0
    for _, ptr, nbytes in events:
        if nbytes > 0:
            held[ptr] = nbytes
        elif ptr in held:
            nbytes = -held.pop(ptr)
        else:
            continue  # allocated before the window
        live += nbytes
        peak = max(peak, live)
    return peak


def _event_tree(roots: list[Any]) -> Iterator[Any]:
    """Every event of the profiler's event tree, parents before their children."""
    stack = list(reversed(roots))
    while stack:
        event = stack.pop()
        yield event
        stack.extend(reversed(event.children))
