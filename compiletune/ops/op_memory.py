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
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

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
    """Bytes op holds inside itself beyond its outputs for this call (0 for ops outside the
    compiletune namespace)."""
    name = op._schema.name
    if not name.startswith(NAMESPACE + "::"):
        return 0
    if name not in _DECLARED:
        raise KeyError(
            f"{name} declares no memory: add a @declare_memory({name!r}) function beside its "
            "definition (compiletune/ops/op_memory.py)"
        )
    return int(_DECLARED[name](bind(op, args, kwargs)))
