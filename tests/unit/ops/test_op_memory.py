"""Every custom op declares what it holds inside itself, and the estimator reads it by name."""

from __future__ import annotations

import contextlib

import pytest
import torch

import compiletune.estimate.estimator  # noqa: F401  (imports the step, so every op module)
import compiletune.ops.fused_logprobs  # noqa: F401
import compiletune.ops.fused_loss  # noqa: F401
import compiletune.ops.gated_delta  # noqa: F401
import compiletune.ops.grouped_mm  # noqa: F401
import compiletune.ops.host_copy  # noqa: F401
from compiletune.models import attention  # noqa: F401
from compiletune.ops import op_memory


def compiletune_ops() -> set[str]:
    return {n for n in torch._C._dispatch_get_all_op_names() if n.startswith("compiletune::")}


def test_every_op_declares_its_memory():
    ops = compiletune_ops()
    assert len(ops) >= 13, ops  # the fused heads, attention, grouped mm, host copies
    missing = ops - op_memory.declared()
    assert not missing, f"ops without a @declare_memory: {sorted(missing)}"
    # and no declaration for an op that does not exist (torch's varlen attention, which the
    # model calls on CUDA, is declared too)
    assert op_memory.declared() <= ops | set(torch._C._dispatch_get_all_op_names())
    assert {"torch_attn::_varlen_attn", "torch_attn::_varlen_attn_backward"} <= op_memory.declared()


def test_arguments_are_bound_by_name_with_defaults_and_keywords():
    op = torch.ops.compiletune.linear_cross_entropy.default
    h, w, t = torch.empty(4, 8), torch.empty(16, 8), torch.zeros(4, dtype=torch.long)
    bound = op_memory.bind(
        op, (h, w, None, t, -100, "sum"), {"z_loss": 0.0, "softcap": 0.0, "chunk_size": 2}
    )
    assert bound["weight"] is w and bound["chunk_size"] == 2 and bound["reduction"] == "sum"
    # one chunk of 2 tokens' fp32 logits [2, 16] at a time
    assert op_memory.internal_bytes(op, (h, w, None, t, -100, "sum"), bound) == 2 * 16 * 4


def test_an_op_without_a_declaration_is_an_error(monkeypatch):
    op = torch.ops.compiletune.grouped_mm.default
    monkeypatch.delitem(op_memory._DECLARED, "compiletune::grouped_mm")
    with pytest.raises(KeyError, match="declares no memory"):
        op_memory.internal_bytes(op, (), {})
    assert op_memory.internal_bytes(torch.ops.aten.mm.default, (), {}) == 0  # not ours
    with pytest.raises(ValueError, match="declared twice"):
        op_memory.declare_memory("compiletune::attention")(op_memory.holds_nothing)


def _segments(replay: bool, calls: list[str]) -> list[tuple]:
    """A tracked fake step of replayable calls: one that frees its temporaries and returns a
    new tensor, one that keeps what it makes, one that returns a view of its input."""
    from compiletune.estimate import memory_internals as mi
    from compiletune.estimate.tracker import Tracker

    kept = []

    @op_memory.replayable(lambda x: op_memory.shape_key(x))
    def scratch(x: torch.Tensor) -> torch.Tensor:
        calls.append("scratch")
        return ((x * 2).exp() + 1).sum(-1)

    @op_memory.replayable(lambda x: op_memory.shape_key(x))
    def keeps(x: torch.Tensor) -> None:
        calls.append("keeps")
        kept.append(x * 3)

    @op_memory.replayable(lambda x: op_memory.shape_key(x))
    def view(x: torch.Tensor) -> torch.Tensor:
        calls.append("view")
        return (x + 1)[1:]

    tracker = Tracker(set(), 512)
    outs = []
    with mi.fake_mode():
        x = torch.empty(64, 96)
        replaying = op_memory.replaying(tracker.replay) if replay else contextlib.nullcontext()
        with replaying, tracker:
            for i in range(4):
                tracker.mark("block", i)  # (each segment's peak is the call's own)
                outs.append(view(x))
                keeps(x)
                tracker.mark("after", i)
                outs.append(scratch(x))
                if i == 1:
                    del outs[0]  # a result freed again
    assert [tuple(o.shape) for o in outs[-2:]] == [(63, 96), (64,)]
    return [(k, s.vector()) for k, s in tracker.segments.items()]


def test_replayed_calls_count_the_bytes_running_them_counts():
    """The estimate runs a replayable function once per shape and replays its bytes after: the
    segments' peaks and totals equal running every call; a call that keeps memory or returns a
    view of its input runs every time."""
    ran, replayed = [], []
    assert _segments(True, replayed) == _segments(False, ran)
    assert ran.count("scratch") == 4 and replayed.count("scratch") == 1
    assert replayed.count("keeps") == replayed.count("view") == 4
