"""The fuse_linear_logprobs pass: what it matches, what it refuses, and the numerics after."""

from __future__ import annotations

import copy
import json

import pytest
import torch
import torch.nn.functional as F
from graph_capture import capture
from torch import nn

from compiletune.compiler.backend import CompiletuneBackend
from compiletune.compiler.graph_dump import write_dump
from compiletune.compiler.regions import CompileOptions, head_logits_shape, head_passes
from compiletune.passes.fuse_linear_logprobs import fuse_linear_logprobs

V, D, B, S = 97, 24, 2, 11  # a vocab that is no multiple of anything; 22 tokens
IGNORE = -100
TOKEN_LOGPROBS = "compiletune.token_logprobs.default"


def inputs(seed: int = 0, dtype: torch.dtype = torch.float32):
    """h [B, S, D], w [V, D], labels [B, S] with some ignored positions."""
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(B, S, D, generator=g, dtype=dtype)
    w = torch.randn(V, D, generator=g, dtype=dtype) * 0.3
    y = torch.randint(0, V, (B, S), generator=g)
    y[1, :4] = IGNORE
    return h, w, y


def ops(gm):
    return [str(n.target) for n in gm.graph.nodes if n.op in ("call_function", "call_method")]


def run_rewritten(fn, *args, chunk_size: int = 0):
    gm = capture(fn, *args)
    rewritten, stats = fuse_linear_logprobs(copy.deepcopy(gm), chunk_size=chunk_size)
    return gm, rewritten, stats


# --------------------------------------------------------------------------- the pass on graphs


def functional(h, w, y):
    logp = F.log_softmax(F.linear(h, w).float(), dim=-1)
    return logp.gather(-1, y.clamp(min=0).unsqueeze(-1)).squeeze(-1)


def torch_gather_dim2(h, w, y):
    logp = torch.log_softmax(F.linear(h, w), 2)
    return torch.gather(logp, 2, y.clamp(min=0)[..., None]).squeeze(2)


def method_and_softcap(h, w, y):
    logits = 30.0 * torch.tanh(F.linear(h, w) / 30.0)
    return logits.log_softmax(-1).gather(-1, y.clamp(min=0)[:, :, None])[..., 0]


def aten_log_softmax(h, w, y):
    logp = torch.ops.aten._log_softmax.default(F.linear(h, w), -1, False)
    return logp.gather(-1, y.clamp(min=0).unsqueeze(-1)).squeeze(-1)


def shifted_flat(h, w, y):  # next-token form: drop the last position, flatten to [N, V]
    logits = F.linear(h, w)[:, :-1].reshape(-1, V)
    picked = F.log_softmax(logits, dim=1).gather(1, y[:, 1:].reshape(-1, 1).clamp(min=0))
    return picked.view(B, S - 1)


@pytest.mark.parametrize(
    "fn", [functional, torch_gather_dim2, method_and_softcap, aten_log_softmax, shifted_flat]
)
def test_rewrites_and_keeps_the_value(fn):
    h, w, y = inputs()
    gm, rewritten, stats = run_rewritten(fn, h, w, y, chunk_size=5)
    assert stats["matched"] == 1 and stats["skipped"] == {}, stats
    tokens = B * (S - 1) if fn is shifted_flat else B * S
    assert stats["logits_shapes"] == [[tokens, V]]
    fused = [n for n in rewritten.graph.nodes if str(n.target) == TOKEN_LOGPROBS]
    assert len(fused) == 1
    softcap = 30.0 if fn is method_and_softcap else 0.0
    assert fused[0].args[3:] == (IGNORE, 5, softcap)  # ignore_index, chunk_size, softcap
    after = ops(rewritten)
    assert not any("log_softmax" in o for o in after), after
    assert not any(o.endswith("linear") for o in after), after
    (expected,) = gm(h, w, y)
    (got,) = rewritten(h, w, y)
    assert got.shape == expected.shape and got.dtype == expected.dtype
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


def test_keeps_a_narrower_result_dtype():
    """log_softmax(..., dtype=bf16): the op's fp32 result is cast back to bf16."""

    def fn(h, w, y):
        logp = F.log_softmax(F.linear(h, w), -1, dtype=torch.bfloat16)
        return logp.gather(-1, y.clamp(min=0).unsqueeze(-1))

    h, w, y = inputs()
    gm, rewritten, stats = run_rewritten(fn, h, w, y)
    assert stats["matched"] == 1
    (expected,), (got,) = gm(h, w, y), rewritten(h, w, y)
    assert got.dtype == torch.bfloat16 and got.shape == expected.shape
    torch.testing.assert_close(got.float(), expected.float(), rtol=2**-7, atol=1e-2)


def entropy_too(h, w, y):
    logp = F.log_softmax(F.linear(h, w), -1)
    return logp.gather(-1, y.clamp(min=0).unsqueeze(-1)), -(logp.exp() * logp).sum(-1)


def logits_too(h, w, y):
    logits = F.linear(h, w)
    return F.log_softmax(logits, -1).gather(-1, y.clamp(min=0).unsqueeze(-1)), logits.amax()


def with_bias(h, w, y):
    b = torch.ones(V)
    return F.log_softmax(F.linear(h, w, b), -1).gather(-1, y.clamp(min=0).unsqueeze(-1))


def sub_block(h, w, y):  # gather allows an index smaller than logp: picks [:, :3] only
    return F.log_softmax(F.linear(h, w), -1).gather(-1, y[:, :3].clamp(min=0).unsqueeze(-1))


def two_classes(h, w, y):  # h, w used before y: the graph's inputs come in order of first use
    logp = F.log_softmax(F.linear(h, w), -1)
    return logp.gather(-1, torch.stack([y.clamp(min=0), y.clamp(min=0).flip(-1)], dim=-1))


def over_tokens(h, w, y):
    return F.log_softmax(F.linear(h, w), 1).gather(-1, y.clamp(min=0).unsqueeze(-1))


def nll(h, w, y):
    return F.nll_loss(F.log_softmax(F.linear(h, w).flatten(0, 1), -1), y.flatten())


def four_dims(h, w, y):
    logp = F.log_softmax(F.linear(h[None], w), -1)
    return logp.gather(-1, y.clamp(min=0)[None, ..., None])


def in_float64(h, w, y):
    logp = F.log_softmax(F.linear(h, w), -1)
    return logp.gather(-1, y.clamp(min=0).unsqueeze(-1))


def slice_after_regroup(h, w, y):  # every other token of the flattened batch
    logp = F.log_softmax(F.linear(h, w).flatten(0, 1)[::2], -1)
    return logp.gather(-1, y.clamp(min=0).flatten()[::2, None])


@pytest.mark.parametrize(
    "fn, reason",
    [
        (slice_after_regroup, "through other ops"),
        (entropy_too, "log_softmax output has other users"),
        (logits_too, "other users"),
        (with_bias, "bias"),
        (sub_block, "one class per token"),
        (two_classes, "one class per token"),
        (over_tokens, "not over the last dimension"),
        (nll, "other than a gather"),
        (four_dims, "not [N, V] or [b, s, V]"),
        (in_float64, "float64"),
    ],
)
def test_refuses_and_says_why(fn, reason):
    h, w, y = inputs(dtype=torch.float64 if fn is in_float64 else torch.float32)
    gm, rewritten, stats = run_rewritten(fn, h, w, y)
    assert stats["matched"] == 0 and stats["logits_shapes"] == []
    assert sum(stats["skipped"].values()) == 1 and any(reason in k for k in stats["skipped"]), stats
    assert TOKEN_LOGPROBS not in ops(rewritten)
    for got, expected in zip(rewritten(h, w, y), gm(h, w, y), strict=True):
        torch.testing.assert_close(got, expected, rtol=0, atol=0)


# --------------------------------------------------------------------------- through the backend


class TokenLogprobs(nn.Module):
    """Summed log-probabilities of the labels, written plainly (as a DPO loss would be).

    2-D: h [N, d], labels [N]; 3-D: h [b, s, d], labels [b, s]. Ignored labels (-100) are
    replaced by class 0 before the gather and masked out of the sum.
    """

    def __init__(self, three_d: bool, softcap: float = 0.0, entropy: bool = False) -> None:
        super().__init__()
        self.output = nn.Linear(D, V, bias=False)
        self.three_d, self.softcap, self.entropy = three_d, softcap, entropy

    def forward(self, h: torch.Tensor, labels: torch.Tensor):
        logits = self.output(h)
        if self.softcap:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        mask = labels != IGNORE
        index = torch.where(mask, labels, 0)
        if self.three_d:
            logp = torch.log_softmax(logits.float(), dim=-1)
            picked = torch.gather(logp, 2, index[..., None]).squeeze(2)
        else:
            logp = F.log_softmax(logits, dim=-1)
            picked = logp.gather(-1, index.unsqueeze(-1)).squeeze(-1)
        total = (picked * mask).sum()
        if self.entropy:
            return total, -(logp.exp() * logp).sum(-1).mean()
        return total


def forward_backward(module: nn.Module, h: torch.Tensor, labels: torch.Tensor):
    h = h.clone().requires_grad_()
    module.zero_grad(set_to_none=True)
    out = module(h, labels)
    outs = out if isinstance(out, tuple) else (out,)
    sum(o * (i + 1) for i, o in enumerate(outs)).backward()
    return [o.detach() for o in outs], h.grad, module.output.weight.grad


@pytest.mark.parametrize(
    "three_d, softcap, entropy",
    [(False, 0.0, False), (True, 0.0, False), (False, 5.0, False), (True, 5.0, False)]
    + [(True, 0.0, True)],
)
def test_compiled_head_matches_eager(three_d, softcap, entropy, tmp_path):
    torch.manual_seed(3)
    eager = TokenLogprobs(three_d, softcap, entropy)
    comp = copy.deepcopy(eager)
    opts = CompileOptions(backend="aot_eager", loss="fused", loss_chunk_size=7)
    backend = CompiletuneBackend(
        "head", head_passes(opts), mode="aot_eager", dump=True, watch=head_logits_shape
    )
    comp.compile(backend=backend, fullgraph=True, dynamic=False)
    h, _, labels = inputs(seed=1)
    h = h * 3  # logits spread enough that the soft-cap bends them
    if not three_d:
        h, labels = h.flatten(0, 1), labels.flatten()  # [22, d], [22]

    expected, got = forward_backward(eager, h, labels), forward_backward(comp, h, labels)
    for g, e in zip(got[0], expected[0], strict=True):
        torch.testing.assert_close(g, e, rtol=1e-5, atol=0)
    for name, g, e in (("h", got[1], expected[1]), ("weight", got[2], expected[2])):
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-5 * e.abs().max().item(), msg=name)
        assert (g - e).norm() <= 1e-5 * e.norm(), name

    (record,) = backend.records
    by_name = {p["pass"]: p for p in record.passes}
    stats = by_name["fuse_linear_logprobs"]
    assert not by_name["fuse_linear_cross_entropy"]["fired"]
    summary = write_dump(backend.records, tmp_path)["head"]
    pre = (tmp_path / "head" / "02_pre_grad.fuse_linear_logprobs.txt").read_text()
    diff = json.loads(pre.splitlines()[0].split(": ", 1)[1])
    forward = next((tmp_path / "head").glob("*_forward.txt")).read_text()
    if entropy:  # logp feeds the entropy too: the full tensor is needed, nothing is rewritten
        assert not stats["fired"] and stats["skipped"] == {"log_softmax output has other users": 1}
        assert diff == {} and "log_softmax" in forward
        assert summary["full_logits_exist"] is True
        return
    assert stats["fired"] and stats["matched"] == 1 and stats["skipped"] == {}
    assert stats["logits_shapes"] == [[B * S, V]]
    assert diff[TOKEN_LOGPROBS] == 1 and diff["torch._C._nn.linear"] == -1, diff
    assert any("log_softmax" in k and v == -1 for k, v in diff.items()), diff
    graph = pre.split("\n\n", 1)[1]
    assert "compiletune.token_logprobs" in graph and "log_softmax" not in graph
    assert "compiletune.token_logprobs" in forward and "log_softmax" not in forward
    assert summary["full_logits_exist"] is False, summary["logits_like_tensors"]
