"""Reward functions for `--objective grpo`, named on the command line (`--reward`).

A reward is either a Python callable, `module:function` (the module importable from the working
directory or PYTHONPATH), or a built-in that needs no code:

    exact:COLUMN     1.0 when the completion, stripped, equals the row's COLUMN (stripped)
    contains:COLUMN  1.0 when the row's COLUMN (stripped) occurs in the completion
    regex:PATTERN    1.0 when PATTERN matches the completion (re.search, DOTALL)
    length:N         -max(0, completion tokens - N) / N: a penalty for going past N tokens

A spec is checked when it is parsed (before the model loads): a built-in without its argument,
and a pattern that matches any text (an empty one, `.*`), which would reward every completion
alike, are refused. The rows a built-in reads are checked before the first step
(`check_columns`): a row whose COLUMN is null or missing is refused, naming the row, rather than
compared as the text "None".

A callable is called once per step with keyword arguments, one list entry per completion:

    fn(prompts=[str], completions=[str], completion_ids=[[int]], **columns) -> list[float | None]

where `columns` holds each of the rows' other columns (a row's value repeated for each of its
completions). It returns one value per completion, in order: a finite number (bool, int, float,
or a numpy / torch scalar), or None where the reward does not apply to that completion (it then
adds nothing to the completion's weighted sum; the step's metrics count the Nones). A list, a
tuple or a 1-d array or tensor is read; anything else (a dict, text, one number, the wrong
length, a value that is text or NaN or inf, None for every completion of a step) stops the run
with one line naming the function and what it returned. So does an exception it raises.

A reward is user code run inside the training loop, so it runs under a guard (`_Guard`): a time
limit (--reward-timeout), and Ctrl-C or SIGTERM while it runs, cut it; it calling `sys.exit` or
raising KeyboardInterrupt is the run's own stop. All of these raise `RewardStopped`, on which the
trainer abandons the step and stops as on Ctrl-C (a checkpoint, one line, a non-zero exit).
"""

from __future__ import annotations

import contextlib
import importlib
import math
import numbers
import re
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from compiletune.errors import UserError

RewardFn = Callable[..., Sequence[float | None]]
BUILTINS = ("exact", "contains", "regex", "length")
# texts a pattern that rewards something must fail on at least one of: a pattern that matches
# all of them matches the empty string at the start of any text (re.search), so every completion
_PROBES = ("", "x", "0", " \n", "The answer is 42.")


@dataclass(frozen=True)
class Reward:
    name: str  # as given on the command line
    fn: RewardFn
    weight: float = 1.0
    column: str | None = None  # the column a built-in compares with (exact:, contains:)


class RewardStopped(Exception):
    """A reward ended its step without values: it called sys.exit or raised KeyboardInterrupt,
    ran past --reward-timeout, or Ctrl-C / SIGTERM came while it ran. The message names the
    reward; the trainer abandons the step and stops as on Ctrl-C."""


def _column(row_values: dict[str, list[Any]], column: str, name: str) -> list[Any]:
    if column not in row_values:
        have = ", ".join(sorted(row_values)) or "none"
        raise UserError(
            f"reward {name!r}: the data has no column {column!r} (its other columns: {have}); "
            "name one of them"
        )
    values = row_values[column]
    if any(v is None for v in values):  # check_columns refuses these rows before training
        raise UserError(
            f"reward {name!r}: a row's {column!r} is null; fill it in or leave the row out"
        )
    return values


def _builtin(kind: str, arg: str, name: str) -> RewardFn:
    if not arg:
        what = "PATTERN" if kind == "regex" else "N" if kind == "length" else "COLUMN"
        raise UserError(f"--reward {name!r}: {kind}: needs its {what} after the colon")
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
        if all(pattern.search(t) is not None for t in _PROBES):
            raise UserError(
                f"--reward {name}: {arg!r} matches any text (it can match nothing at all), so it "
                "would give every completion the same reward; make it require something"
            )

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
            column = arg if kind in ("exact", "contains") else None
            out.append(Reward(name, _builtin(kind, arg, name), w, column))
        elif sep and kind and arg:
            out.append(Reward(name, _imported(name), w))
        else:
            raise UserError(
                f"--reward {name!r}: expected module:function or one of "
                f"{', '.join(b + ':...' for b in BUILTINS)}"
            )
    return out


def check_columns(rewards: list[Reward], prompts: Sequence[Any], source: str) -> None:
    """Before the first step: every row of `source` (`data.prompts.Prompt`s) has a value in
    the column each built-in compares with. A null or missing one is refused, naming the first
    such row, rather than compared as the text "None" or found missing at some later step."""
    for r in rewards:
        if r.column is None or not prompts:
            continue
        lacking = [p for p in prompts if p.columns.get(r.column) is None]
        if not lacking:
            continue
        if len(lacking) == len(prompts) and all(r.column not in p.columns for p in prompts):
            have = ", ".join(sorted({k for p in prompts for k in p.columns})) or "none"
            raise UserError(
                f"reward {r.name!r}: {source} has no column {r.column!r} (its other columns: "
                f"{have}); name one of them"
            )
        first = lacking[0]
        where = first.where or f"the row with prompt {first.text[:60]!r}"
        raise UserError(
            f"reward {r.name!r}: {len(lacking)} of {len(prompts)} rows of {source} have no "
            f"{r.column!r} (null or missing), the first at {where}; fill them in or leave "
            "those rows out"
        )


class _Cut(BaseException):
    """Raised inside a running reward by `_Guard` (a BaseException, so that the reward's own
    `except Exception` does not swallow it)."""


class _Guard:
    """While a reward runs in the main thread: SIGALRM after `seconds` (then every second, in
    case the reward swallows the first), SIGINT and SIGTERM each raise `_Cut` inside it; the
    previous handlers and timer come back after.

    Why a signal in the main thread rather than a thread with a deadline or a worker process:
    the reward keeps running where it always did (the main thread, the trainer's process: its
    imports, globals and torch state as they are, nothing pickled), and the cut lands in its
    own frames, so its `finally` blocks run and nothing is left running behind the trainer's
    back; a thread that missed its deadline could not be stopped, and a process would copy or
    re-import the user's code. What it cannot cut is C code that does not return to Python
    (one long regex match, say): the cut comes when it does. Outside the main thread (a library
    caller's thread) signals cannot be set, and the reward runs unguarded."""

    def __init__(self, seconds: float | None) -> None:
        self.seconds = seconds
        self.why: str | None = None  # set once the reward is cut
        self.armed = False
        self._previous: dict[int, Any] = {}
        self._timer: tuple[float, float] = (0.0, 0.0)
        self._t0 = 0.0

    def _handle(self, signum: int, frame: Any) -> None:
        if not self.armed:  # after the reward returned: the signal is the loop's again
            previous = self._previous.get(signum)
            if callable(previous):
                previous(signum, frame)
            return
        if signum == signal.SIGALRM:
            self.why = f"ran past --reward-timeout {self.seconds:g}s"
        else:
            self.why = f"was interrupted by {signal.Signals(signum).name}"
        raise _Cut(self.why)

    @contextlib.contextmanager
    def guarding(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        kinds = [signal.SIGINT, signal.SIGTERM] + ([signal.SIGALRM] if self.seconds else [])
        for s in kinds:
            self._previous[s] = signal.getsignal(s)
            signal.signal(s, self._handle)
        self._t0 = time.monotonic()
        if self.seconds:
            self._timer = signal.setitimer(signal.ITIMER_REAL, self.seconds, 1.0)
        self.armed = True
        try:
            yield
        finally:
            self.disarm()

    def disarm(self) -> None:
        """Handlers and timer as they were (idempotent: a signal can cut the `finally` that
        calls it, and the caller calls it again)."""
        self.armed = False
        if signal.SIGALRM in self._previous:
            delay, interval = self._timer  # someone else's timer: what was left of it
            left = max(delay - (time.monotonic() - self._t0), 1e-3) if delay else 0.0
            signal.setitimer(signal.ITIMER_REAL, left, interval)
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous = {}


def _call(reward: Reward, kwargs: dict[str, Any], timeout: float | None) -> Any:
    """`reward.fn(**kwargs)` under a `_Guard`; RewardStopped for the run's stops."""
    guard = _Guard(timeout)
    name = f"reward {reward.name!r}"
    try:
        with guard.guarding():
            values = reward.fn(**kwargs)
    except _Cut:
        guard.disarm()
        raise RewardStopped(f"{name} {guard.why}") from None
    except SystemExit as e:
        raise RewardStopped(f"{name} called sys.exit({e.code!r})") from None
    except KeyboardInterrupt:
        raise RewardStopped(f"{name} raised KeyboardInterrupt") from None
    except UserError:
        raise
    except Exception as e:
        raise UserError(f"{name} raised {type(e).__name__}: {e}; fix the function") from e
    if guard.why is not None:  # cut, but it swallowed the cut and returned anyway
        raise RewardStopped(f"{name} {guard.why}")
    return values


def _shown(value: Any) -> str:
    """A returned value for a message: its type, and a short repr."""
    text = repr(value)
    return f"{type(value).__name__} {text if len(text) <= 40 else text[:37] + '...'}"


def _number(value: Any, name: str, i: int, n: int) -> float | None:
    """One returned value -> a finite float, or None; UserError otherwise."""
    if value is None:
        return None
    got = value
    if hasattr(value, "item") and not isinstance(value, numbers.Real | str | bytes):
        # a numpy scalar or array of one, a torch tensor of one element; others stay as they are
        with contextlib.suppress(ValueError, RuntimeError, TypeError):
            value = value.item()
    if isinstance(value, numbers.Real):  # bool, int, float, numpy's numbers, Fraction
        try:
            number = float(value)
        except OverflowError:
            number = math.inf
        if math.isfinite(number):
            return number
        raise UserError(
            f"reward {name!r} returned {_shown(got)} for completion {i} of {n}; rewards must be "
            "finite numbers"
        )
    hint = " (text: convert it with float())" if isinstance(value, str | bytes) else ""
    raise UserError(
        f"reward {name!r} returned {_shown(got)} for completion {i} of {n}{hint}; return a "
        "finite number, or None where the reward does not apply"
    )


def checked(reward: Reward, values: Any, n: int) -> list[float | None]:
    """What `reward` returned for `n` completions -> one float or None each (see the module
    docstring); UserError naming the reward and what it returned otherwise."""
    name = reward.name
    if isinstance(values, Mapping):  # iterating it would train on its keys
        raise UserError(
            f"reward {name!r} returned a {type(values).__name__} of {len(values)} entries for "
            f"{n} completions; return a list, one value per completion in their order"
        )
    if hasattr(values, "tolist") and not isinstance(values, list | tuple):
        values = values.tolist()  # a numpy array, a torch tensor (a 0-d one: a number)
    unordered = isinstance(values, set | frozenset)
    if values is None or isinstance(values, str | bytes) or unordered:
        raise UserError(
            f"reward {name!r} returned {_shown(values)} for {n} completions; return a list, one "
            "value per completion in their order"
        )
    if not isinstance(values, Iterable):
        raise UserError(
            f"reward {name!r} returned {_shown(values)} for {n} completions; return a list, one "
            "value per completion in their order"
        )
    values = list(values)
    if len(values) != n:
        raise UserError(
            f"reward {name!r} returned {len(values)} values for {n} completions; return one per "
            "completion"
        )
    out = [_number(v, name, i, n) for i, v in enumerate(values)]
    if n and all(v is None for v in out):
        raise UserError(
            f"reward {name!r} returned None for all {n} completions of the step; None means it "
            "does not apply to a completion, and at least one of a step's must be scored"
        )
    return out


def score(
    reward: Reward,
    prompts: list[str],
    completions: list[str],
    completion_ids: list[list[int]],
    columns: dict[str, list[Any]],
    timeout: float | None = None,
) -> list[float | None]:
    """`reward` on one step's completions, guarded (`timeout` seconds: --reward-timeout; None:
    no limit) and checked (see the module docstring). RewardStopped: the run's stop."""
    kwargs = {"prompts": prompts, "completions": completions, "completion_ids": completion_ids}
    values = _call(reward, {**kwargs, **columns}, timeout)
    return checked(reward, values, len(completions))
