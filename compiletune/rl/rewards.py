"""Reward functions for `--objective grpo`, named on the command line (`--reward`).

A reward is either a Python callable, `module:function` (the module importable from the working
directory or PYTHONPATH), or a built-in that needs no code:

    exact:COLUMN     1.0 when the completion, stripped, equals the row's COLUMN (stripped)
    contains:COLUMN  1.0 when the row's COLUMN (stripped) occurs in the completion
    regex:PATTERN    1.0 when PATTERN matches the completion (re.search, DOTALL)
    length:N         -max(0, completion tokens - N) / N: a penalty for going past N tokens

A callable is called once per step with keyword arguments, one list entry per completion:

    fn(prompts=[str], completions=[str], completion_ids=[[int]], **columns) -> list[float]

where `columns` holds each of the rows' other columns (a row's value repeated for each of its
completions). It must return one finite number per completion. Anything else (it raises, the
wrong length, a non-number, NaN or inf) stops the run with one line naming the function.
"""

from __future__ import annotations

import importlib
import math
import re
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from compiletune.errors import UserError

RewardFn = Callable[..., Sequence[float]]
BUILTINS = ("exact", "contains", "regex", "length")


@dataclass(frozen=True)
class Reward:
    name: str  # as given on the command line
    fn: RewardFn
    weight: float = 1.0


def _column(row_values: dict[str, list[Any]], column: str, name: str) -> list[Any]:
    if column not in row_values:
        have = ", ".join(sorted(row_values)) or "none"
        raise UserError(
            f"reward {name!r}: the data has no column {column!r} (its other columns: {have}); "
            "name one of them"
        )
    return row_values[column]


def _builtin(kind: str, arg: str, name: str) -> RewardFn:
    if kind in ("exact", "contains"):

        def match(completions: list[str], **cols: Any) -> list[float]:
            want = [str(v).strip() for v in _column(cols, arg, name)]
            got = [c.strip() for c in completions]
            if kind == "exact":
                return [float(g == w) for g, w in zip(got, want, strict=True)]
            return [float(w in g) for g, w in zip(got, want, strict=True)]

        return match
    if kind == "regex":
        try:
            pattern = re.compile(arg, re.DOTALL)
        except re.error as e:
            raise UserError(f"--reward {name}: {arg!r} is not a regular expression ({e})") from e

        def fmt(completions: list[str], **_: Any) -> list[float]:
            return [float(pattern.search(c) is not None) for c in completions]

        return fmt
    try:
        limit = int(arg)
    except ValueError:
        limit = 0
    if limit <= 0:
        raise UserError(f"--reward {name}: length:N needs a positive token count N")

    def length(completion_ids: list[list[int]], **_: Any) -> list[float]:
        return [-max(0, len(ids) - limit) / limit for ids in completion_ids]

    return length


def _imported(spec: str) -> RewardFn:
    module_name, _, attr = spec.partition(":")
    if str(Path.cwd()) not in sys.path:  # a rewards.py beside the user, as `python -m` would
        sys.path.insert(0, str(Path.cwd()))
    try:
        module = importlib.import_module(module_name)
    except Exception as e:
        raise UserError(
            f"--reward {spec}: cannot import module {module_name!r} ({type(e).__name__}: {e}); "
            "put it on PYTHONPATH or in the working directory"
        ) from e
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise UserError(f"--reward {spec}: module {module_name!r} has no function {attr!r}")
    return fn


def load_rewards(specs: str, weights: str | None = None) -> list[Reward]:
    """`--reward` (comma-separated) and `--reward-weights` -> the run's rewards."""
    names = [s.strip() for s in specs.split(",") if s.strip()] if specs else []
    if not names:
        raise UserError(
            "--objective grpo needs --reward (module:function, or a built-in: "
            f"{', '.join(b + ':...' for b in BUILTINS)})"
        )
    if weights:
        try:
            ws = [float(w) for w in weights.split(",")]
        except ValueError as e:
            raise UserError(f"--reward-weights {weights!r} must be numbers, comma-separated") from e
        if len(ws) != len(names) or not all(math.isfinite(w) for w in ws):
            raise UserError(
                f"--reward-weights gives {len(ws)} finite weights for {len(names)} rewards; "
                "give one per --reward"
            )
    else:
        ws = [1.0] * len(names)
    out = []
    for name, w in zip(names, ws, strict=True):
        kind, sep, arg = name.partition(":")
        if sep and kind in BUILTINS:
            out.append(Reward(name, _builtin(kind, arg, name), w))
        elif sep and kind and arg:
            out.append(Reward(name, _imported(name), w))
        else:
            raise UserError(
                f"--reward {name!r}: expected module:function or one of "
                f"{', '.join(b + ':...' for b in BUILTINS)}"
            )
    return out


def score(
    reward: Reward,
    prompts: list[str],
    completions: list[str],
    completion_ids: list[list[int]],
    columns: dict[str, list[Any]],
) -> list[float]:
    """`reward` on one step's completions, checked (see the module docstring)."""
    try:
        values = reward.fn(
            prompts=prompts, completions=completions, completion_ids=completion_ids, **columns
        )
    except UserError:
        raise
    except Exception as e:
        raise UserError(
            f"reward {reward.name!r} raised {type(e).__name__}: {e}; fix the function"
        ) from e
    try:
        values = [float(v) for v in values]
    except (TypeError, ValueError) as e:
        raise UserError(
            f"reward {reward.name!r} returned {type(values).__name__}, not a list of numbers"
        ) from e
    if len(values) != len(completions):
        raise UserError(
            f"reward {reward.name!r} returned {len(values)} values for {len(completions)} "
            "completions; return one per completion"
        )
    bad = [v for v in values if not math.isfinite(v)]
    if bad:
        raise UserError(f"reward {reward.name!r} returned {bad[0]}; rewards must be finite")
    return values
