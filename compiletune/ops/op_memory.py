"""What each of compiletune's custom ops allocates inside itself: one declaration per op.

A custom op is opaque to fake tensors: the memory estimate (estimate/tracker.py) sees its outputs but
not the chunks, accumulators and temporaries its kernel holds while it runs. So every op states
them beside its definition:

    @declare_memory("compiletune::linear_cross_entropy")
    def _(a: Args) -> int:          # a["h"], a["weight"], ... by the schema's argument names
        return ...                  # bytes held at the op's highest point, beyond its outputs

The estimator calls `internal_bytes(op, args, kwargs)` for every op of the `compiletune`
namespace it meets; the arguments are bound to their schema names here, so a declaration never
reads an argument by position and a new parameter of an op cannot shift what it reads. An op
without a declaration is an error there, and `tests/unit/ops/test_op_memory.py` fails for it.

Replayable functions. Each op of the estimate's fake step costs ~150 us of Python on a small
CPU, and a few plain functions run hundreds of times a step with the same shapes (a NF4 weight
rebuilt in every forward and backward, the optimizer's update of each parameter). A function
whose memory (what it allocates and frees while it runs, and the one new tensor it may return)
follows from its arguments' shapes alone, and whose other effects the step never reads, is
marked `@replayable(key)`, `key(*args) -> hashable` naming what decides its memory. Outside the
estimate the mark costs one global read. Inside, `replaying(replayer)` hands each call to the
estimator's tracker (estimate/tracker.py `Tracker.replay`), which runs the first call of each key
and replays its bytes for the next ones, checking that it may (nothing kept but the result).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Hashable, Iterator
from typing import Any, TypeVar

import torch

NAMESPACE = "compiletune"
Args = dict[str, Any]  # an op's arguments by their schema names
_DECLARED: dict[str, Callable[[Args], int]] = {}


def declare_memory(op_name: str) -> Callable[[Callable[[Args], int]], Callable[[Args], int]]:
    """Register `fn(args) -> bytes` as what op `op_name` ("compiletune::name") holds inside
    itself beyond its outputs, as a function of its arguments."""

    def register(fn: Callable[[Args], int]) -> Callable[[Args], int]:
        if op_name in _DECLARED:
            raise ValueError(f"{op_name}: its memory is declared twice")
        _DECLARED[op_name] = fn
        return fn

    return register


def holds_nothing(args: Args) -> int:
    """The declaration of an op whose kernel allocates nothing beyond its outputs."""
    return 0


def declared() -> set[str]:
    """Names of the ops with a declaration."""
    return set(_DECLARED)


def bind(op: torch._ops.OpOverload, args: tuple, kwargs: dict[str, Any]) -> Args:
    """The call's arguments by the op's schema names (defaults filled in)."""
    schema = op._schema
    bound: Args = {}
    for i, arg in enumerate(schema.arguments):
        if i < len(args):
            bound[arg.name] = args[i]
        elif arg.name in kwargs:
            bound[arg.name] = kwargs[arg.name]
        elif arg.has_default_value():
            bound[arg.name] = arg.default_value
    return bound


def internal_bytes(op: torch._ops.OpOverload, args: tuple, kwargs: dict[str, Any]) -> int:
    """Bytes op holds inside itself beyond its outputs for this call (0 for an op outside the
    compiletune namespace that nobody declared: aten's are fake-tensor-exact)."""
    name = op._schema.name
    if name not in _DECLARED and not name.startswith(NAMESPACE + "::"):
        return 0  # not ours, and nothing declared for it (torch's varlen attention is)
    if name not in _DECLARED:
        raise KeyError(
            f"{name} declares no memory: add a @declare_memory({name!r}) function beside its "
            "definition (compiletune/ops/op_memory.py)"
        )
    return int(_DECLARED[name](bind(op, args, kwargs)))


# ---------------------------------------------------------------------------------------------
# Replayable functions (see the module's docstring).

Replayer = Callable[[Callable[..., Any], Hashable, tuple, dict[str, Any]], Any]
_REPLAYER: list[Replayer | None] = [None]
F = TypeVar("F", bound=Callable[..., Any])


def replayable(key: Callable[..., Hashable]) -> Callable[[F], F]:
    """Mark a function whose memory follows from `key(*args, **kwargs)` (see above).

    The function must not keep a reference to its result or to anything it makes (a cache, a
    list, an attribute), must not change state the step reads later (its in-place writes to
    fake tensors change nothing), and must not run block hooks: the tracker detects new
    tensors that stay alive, not other references, so a replay would then count wrong."""

    def mark(fn: F) -> F:
        name = f"{fn.__module__}.{fn.__qualname__}"

        @functools.wraps(fn)
        def call(*args: Any, **kwargs: Any) -> Any:
            replayer = _REPLAYER[0]
            if replayer is None:
                return fn(*args, **kwargs)
            return replayer(fn, (name, key(*args, **kwargs)), args, kwargs)

        return call  # type: ignore[return-value]

    return mark


@contextlib.contextmanager
def replaying(replayer: Replayer) -> Iterator[None]:
    """Hand every call of a replayable function to `replayer(fn, key, args, kwargs)` while
    inside (the memory estimate's tracker)."""
    before = _REPLAYER[0]
    _REPLAYER[0] = replayer
    try:
        yield
    finally:
        _REPLAYER[0] = before


def shape_key(*tensors: Any) -> tuple:
    """What decides a function's memory among its tensor arguments: each one's type, shape,
    strides, dtype, device and, for a DTensor, placements (None stays None). A DTensor's
    global layout and placements fix its local shard's: the estimate runs as rank 0 of one
    mesh."""
    return tuple(
        None
        if t is None
        else (
            type(t),
            tuple(t.shape),
            t.stride(),
            t.dtype,
            t.device,
            getattr(t, "placements", None),
        )
        for t in tensors
    )
