"""The depth shortcut of the memory estimate: a deep model of repeating blocks estimated from
two short ones, exactly (see the comment above `ENDS`)."""

from __future__ import annotations

import contextlib
import ctypes
import os
import pickle
import select
import signal
import time
from collections.abc import Callable
from typing import Any

from compiletune.config import TrainConfig
from compiletune.estimate.tracker import Key, Segment
from compiletune.forks import fork_is_safe
from compiletune.models import ModelArgs


def can_fork() -> bool:
    """Whether `Forked` runs its work in a child process here (`forks.fork_is_safe`)."""
    return not os.environ.get("COMPILETUNE_ESTIMATE_NO_FORK") and fork_is_safe()


_PR_SET_PDEATHSIG = 1  # linux/prctl.h


def _die_with_parent(parent: int) -> None:
    """In a new child (Linux): be killed when the process that forked it ends, however it ends
    (a fork from a fork dies with its parent in turn); gone already: exit now."""
    with contextlib.suppress(Exception):  # elsewhere, or where prctl is refused: not needed
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:
        os._exit(1)


def _patience(own_seconds: float) -> float:
    """How long to wait for a child whose share of the work is no larger than this process's
    own (`own_seconds`), on a machine shared with other work."""
    return 60.0 + 4.0 * own_seconds


class Forked:
    """`work` run in a forked child (a second core) while this process goes on: `result()`
    waits for its pickled value, None when the platform cannot fork or the child failed in any
    way. Leaving the `with` block without the result kills the child, and with it what it
    forked in turn; the child dies with this process too, however this one ends."""

    def __init__(self, work: Callable[[], Any]) -> None:
        self.pid = 0
        if not can_fork():
            return
        read, write = os.pipe()
        parent = os.getpid()
        self.pid = os.fork()
        if self.pid == 0:  # the child never returns into the caller's code
            code = 1
            try:
                _die_with_parent(parent)
                os.close(read)
                with os.fdopen(write, "wb") as f:
                    pickle.dump(work(), f)
                code = 0
            finally:
                os._exit(code)
        os.close(write)
        self.read = os.fdopen(read, "rb")
        self.started = time.monotonic()

    def result(self) -> Any:
        """The child's value; None where it failed, or gave nothing within `_patience` of the
        time this process took for its own share (a child hung on an inherited lock is
        killed, and the caller does the work itself)."""
        if not self.pid:
            return None
        deadline = time.monotonic() + _patience(time.monotonic() - self.started)
        chunks = []
        ready = select.poll()  # (select.select refuses descriptors past 1023)
        ready.register(self.read.fileno(), select.POLLIN)
        while (left := deadline - time.monotonic()) > 0:
            if not ready.poll(left * 1000):
                break
            chunk = os.read(self.read.fileno(), 1 << 20)
            if not chunk:  # the child closed its end: all written, or it died
                _, status = os.waitpid(self.pid, 0)
                self.pid = 0
                data = b"".join(chunks)
                return pickle.loads(data) if status == 0 and data else None
            chunks.append(chunk)
        self.__exit__()
        return None

    def __enter__(self) -> Forked:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.pid:
            os.kill(self.pid, signal.SIGKILL)  # its own forks die with it (`_die_with_parent`)
            os.waitpid(self.pid, 0)
            self.pid = 0
        if hasattr(self, "read"):
            self.read.close()


# ---------------------------------------------------------------------------------------------
# The depth shortcut. A model of identical blocks runs the same code in every block, so each
# stretch of the step between two block marks (`_mark_blocks`) is the same from block to block,
# only at another level: a block's forward holds one more block of saved activations than the
# one before, its backward one less, and every stretch holds each block's weights, gradients
# and optimizer state. Each number a stretch holds (its peak, the totals at the peak) is then
# a + b * block + c * depth. The step runs at two small depths: the blocks away from the ends
# give b (the same step between neighbours, in both runs), the two runs give c, the blocks at
# the ends and the stretches outside the blocks are extended by their change between the runs,
# and the peak is read from all stretches at the full depth, as the whole run would give it.
# Anything that does not follow this (a different step between neighbours, a stretch in one
# run only) falls back to running the whole model. The peak itself is not linear in depth:
# it can move from one stretch to another (the last block's backward, the first's), which is
# why each stretch is extended and not the peak.


# What differs from the middle of the model: blocks at the start (at least up to the first
# block of each kind) and at the end.
ENDS = (2, 1)


def _kinds(cfg: TrainConfig, args: ModelArgs) -> list[tuple[str, bool, bool]]:
    """Each block's kind: its layer type (e.g. Gemma's sliding and global layers), whether
    the activation policy checkpoints it (--ac-every) and whether it offloads what it saves
    (the first --offload-activations N)."""
    policy = cfg.techniques.activation_policy
    target = cfg.techniques.offload_activations
    offloaded = target.count(args.n_layers) if target else 0
    return [
        (args.layer_types[i] if args.layer_types else "", policy.applies_to(i), i < offloaded)
        for i in range(args.n_layers)
    ]


def _offload_prefix(kinds: list[tuple[str, bool, bool]]) -> int:
    """How many blocks at the start offload when not all of them do (else 0): they come
    before the blocks that repeat, as a MoE model's leading dense layers do."""
    n = sum(k[2] for k in kinds)
    return n if n < len(kinds) else 0


def period(cfg: TrainConfig, args: ModelArgs) -> int | None:
    """After how many blocks the blocks' kinds repeat (after the blocks that offload, when
    only the first ones do); None when they do not."""
    n = args.n_layers
    kinds = _kinds(cfg, args)
    if args.dense_layers and not dense_prefix(args):
        return None
    head = _offload_prefix(kinds)
    for p in range(1, n // 4 + 1):
        if all(kinds[i] == kinds[head + (i - head) % p] for i in range(head, n)):
            return p
    return None


def dense_prefix(args: ModelArgs) -> int:
    """How many dense layers a MoE model starts with (DeepSeek-V3's first 3, GLM-4.5's first),
    when those are all its dense layers; else 0."""
    n = len(args.dense_layers)
    return n if args.dense_layers == tuple(range(n)) else 0


def shortcut_depths(cfg: TrainConfig, args: ModelArgs) -> tuple[int, int, int, int] | None:
    """The two depths to run at, the blocks' period and how many blocks at the start differ
    from the middle; None when the blocks do not repeat or the two depths together cost as
    much as the whole model. `ENDS`: the blocks at the start and at the end differ from the
    middle: FSDP prefetches nothing past the ends, and in backward the second block still holds
    what the first block's gather needs; the first block of each kind creates what later ones
    share (Gemma's first global layer is its sixth), and frees it in backward. A MoE model's
    leading dense layers widen the start. The smaller depth has a period and one block in the
    middle (every kind, for the change with depth); the larger is one period more (two blocks
    of each kind, for the step between them); both end with the same kind of block as the
    model."""
    n = args.n_layers
    p = period(cfg, args)
    if p is None:
        return None
    kinds = _kinds(cfg, args)
    head = _offload_prefix(kinds)
    firsts = max(kinds.index(k) for k in set(kinds[head : head + p])) + 1
    # the blocks that offload, and the first blocks that keep (one of each kind) as after a
    # model's ends, before the middle's repeats
    # (past a dense prefix, as past the first block: the first MoE block's backward still
    # holds what the last dense block's gather needs)
    dense = dense_prefix(args)
    start = max(ENDS[0], dense + ENDS[0] - 1 if dense else 0, firsts, head + ENDS[0] if head else 0)
    k1 = start + p + ENDS[1] + 1
    k1 += (n - k1) % p
    k2 = k1 + p
    # Both depths together cost less than the whole model; with the smaller one forked beside
    # the larger, the wait is the larger alone, else both, which must then save a quarter.
    return (k1, k2, p, start) if k1 + k2 <= (n - 1 if can_fork() else 0.75 * n) else None


def _canonical(key: Key, depth: int, ends: tuple[int, int]) -> tuple[str, Key]:
    """A segment key as the same stretch at any depth: among the `ends` blocks counted from the
    start ("first") or from the end ("last"), in the middle ("mid", by index), or outside the
    blocks ("outside")."""
    phase, micro, what, i = key
    if i < 0:
        return "outside", key
    if i < ends[0]:
        return "first", key
    if i >= depth - ends[1]:
        return "last", (phase, micro, what, depth - 1 - i)
    return "mid", key


Vector = tuple[int, ...]


def _sub(a: Vector, b: Vector) -> Vector:
    return tuple(x - y for x, y in zip(a, b, strict=True))


def _plus(base: Vector, *terms: tuple[Vector, int]) -> Vector:
    v = list(base)
    for d, n in terms:
        v = [x + n * y for x, y in zip(v, d, strict=True)]
    return tuple(v)


def extend(
    runs: list[list[tuple[Key, Segment]]], depths: tuple[int, int, int, int], depth: int
) -> list[tuple[Key, Segment]] | None:
    """The segments of the step at `depth` blocks from its segments at the two smaller depths
    (`shortcut_depths`), in the order they run; None when the runs do not follow the model
    above."""
    k1, k2, p, start = depths
    e = (start, ENDS[1])  # blocks at the start and at the end
    t1, t2 = (
        {_canonical(key, k, e): seg.vector() for key, seg in run}
        for k, run in zip((k1, k2), runs, strict=True)
    )
    ends = {c for c in t2 if c[0] != "mid"}
    if ends != {c for c in t1 if c[0] != "mid"}:
        return None
    per_period = {c: _sub(t2[c], t1[c]) for c in ends}  # outside and end stretches
    # Middle stretches: by (phase, micro, what, kind of block), the step from one block to the
    # same kind of block a period later (b), and the change from the smaller depth (c).
    steps: dict[Key, set[Vector]] = {}
    lifts: dict[Key, set[Vector]] = {}
    for t, k in ((t1, k1), (t2, k2)):
        for (kind, (phase, micro, what, i)), v in t.items():
            if kind != "mid":
                continue
            name = (phase, micro, what, i % p)
            steps.setdefault(name, set())
            lifts.setdefault(name, set())
            if i + p < k - e[1]:
                nxt = t.get(("mid", (phase, micro, what, i + p)))
                steps[name].add(_sub(nxt, v) if nxt is not None else ())
            if t is t2 and i < k1 - e[1]:
                had = t1.get(("mid", (phase, micro, what, i)))
                lifts[name].add(_sub(v, had) if had is not None else ())
    if any(len(steps[n]) != 1 or len(lifts[n]) != 1 or () in steps[n] | lifts[n] for n in steps):
        return None
    order = _order(runs[1], k2)
    if order is None:
        return None
    out = []
    for key in order(depth):
        kind, canon = _canonical(key, depth, e)
        if kind == "mid":
            phase, micro, what, i = key
            first = e[0] + (i - e[0]) % p
            name = (phase, micro, what, first % p)
            (b,), (c,) = steps[name], lifts[name]
            v = _plus(
                t2[("mid", (phase, micro, what, first))],
                (b, (i - first) // p),
                (c, (depth - k2) // p),
            )
        else:
            v = _plus(t2[(kind, canon)], (per_period[(kind, canon)], (depth - k2) // p))
        out.append((key, Segment.from_vector(v)))
    return out


def _order(run: list[tuple[Key, Segment]], k: int) -> Any:
    """A function giving the segment keys at any depth in the order they run, from their order
    at depth `k`: within each (phase, micro-batch), stretches outside the blocks first, then the
    blocks up (forward) or down (backward), each block's stretches in their order. None when
    the run at `k` does not have that shape."""
    groups: list[tuple[str, int]] = []
    shape: dict[tuple[str, int], tuple[list[str], list[str], int]] = {}
    for phase, micro, what, i in (key for key, _ in run):
        g = (phase, micro)
        if g not in shape:
            groups.append(g)
            shape[g] = ([], [], 0)
        outside, whats, direction = shape[g]
        if i < 0:
            outside.append(what)
        elif what not in whats:
            whats.append(what)
            if len(whats) == 1:
                direction = 1 if i == 0 else -1
                shape[g] = (outside, whats, direction)

    def keys(depth: int) -> list[Key]:
        out: list[Key] = []
        for g in groups:
            outside, whats, direction = shape[g]
            out += [(*g, w, -1) for w in outside]
            blocks = range(depth) if direction > 0 else range(depth - 1, -1, -1)
            out += [(*g, w, i) for i in blocks for w in whats]
        return out

    return keys if keys(k) == [key for key, _ in run] else None
