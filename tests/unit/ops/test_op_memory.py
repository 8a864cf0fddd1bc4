"""Every custom op declares what it holds inside itself, and the estimator reads it by name."""

from __future__ import annotations

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
    assert op_memory.declared() <= ops  # and no declaration for an op that does not exist


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
