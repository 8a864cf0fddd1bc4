"""The fuse_linear_cross_entropy pass: what it matches, what it refuses, and the numerics after."""

from __future__ import annotations

import copy
import json

import pytest
import torch
import torch.nn.functional as F
from graph_capture import capture

from compiletune.compiler.regions import CompileOptions, compile_regions
from compiletune.config import resolve
from compiletune.loss.head import LossHead
from compiletune.models import build_model, from_name
from compiletune.passes.fuse_linear_cross_entropy import fuse_linear_cross_entropy
from compiletune.train.loop import train

V, D = 97, 24  # a vocab that is no multiple of anything


def inputs(bias: bool = False, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(2, 11, D, generator=g, dtype=torch.float64)
    w = torch.randn(V, D, generator=g, dtype=torch.float64) * 0.3
    y = torch.randint(0, V, (2, 11), generator=g)
    y[1, :4] = -100
    b = torch.randn(V, generator=g, dtype=torch.float64) if bias else None
    return h, w, y, b


def ops(gm):
    return [str(n.target) for n in gm.graph.nodes if n.op in ("call_function", "call_method")]


def run_rewritten(fn, *args):
    gm = capture(fn, *args)
    rewritten, stats = fuse_linear_cross_entropy(copy.deepcopy(gm))
    return gm, rewritten, stats


def plain(h, w, y):
    return F.cross_entropy(F.linear(h, w).float().view(-1, V), y.view(-1), reduction="sum")


def shifted(h, w, y):
    logits = F.linear(h, w)
    return F.cross_entropy(logits[:, :-1].reshape(-1, V).float(), y[:, 1:].reshape(-1))


def with_bias(h, w, b, y):  # arguments in order of first use, like the dynamo graph's inputs
    return F.cross_entropy(F.linear(h, w, b).flatten(0, 1), y.flatten(), ignore_index=-100)


@pytest.mark.parametrize("fn, bias", [(plain, False), (shifted, False), (with_bias, True)])
def test_rewrites_and_keeps_the_value(fn, bias):
    h, w, y, b = inputs(bias)
    args = (h, w, b, y) if bias else (h, w, y)
    gm, rewritten, stats = run_rewritten(fn, *args)
    assert stats["matched"] == 1
    after = ops(rewritten)
    assert "compiletune.linear_cross_entropy.default" in after
    assert not any(o.split(".")[-1] == "linear" or o.endswith("_nn.linear") for o in after), after
    assert not any("cross_entropy" in o and "compiletune" not in o for o in after), after
    expected = fn(*args)
    (got,) = rewritten(*args)
    torch.testing.assert_close(got.double(), expected.double(), rtol=1e-6, atol=1e-9)


def test_one_pass_only_where_gradients_are_needed():
    """Under grad mode with inputs that require grad the pass emits the one-pass op; a graph
    traced under no_grad (evaluation) keeps the forward-only op. (160 tokens: enough that the
    gradients the one-pass op keeps are no larger than plain's log-probs.)"""
    g = torch.Generator().manual_seed(0)
    h = torch.randn(4, 40, D, generator=g, dtype=torch.float64)
    w = torch.randn(V, D, generator=g, dtype=torch.float64).requires_grad_()
    y = torch.randint(0, V, (4, 40), generator=g)
    _, rewritten, stats = run_rewritten(plain, h, w, y)
    assert stats["one_pass"] == 1
    assert "compiletune.linear_cross_entropy_with_grads.default" in ops(rewritten)
    with torch.no_grad():
        _, rewritten, stats = run_rewritten(plain, h, w, y)
    assert stats["matched"] == 1 and stats["one_pass"] == 0
    assert "compiletune.linear_cross_entropy.default" in ops(rewritten)


@pytest.mark.parametrize("env, written", [(None, "auto"), ("bf16", "bf16"), ("fp32", "fp32")])
def test_accumulator_is_resolved_once_and_written_into_the_graph(env, written, monkeypatch):
    """The one-pass node carries the weight-gradient accumulator the pass resolved
    ($COMPILETUNE_LCE_ACCUMULATOR or auto), so the op never reads the environment itself."""
    if env is None:
        monkeypatch.delenv("COMPILETUNE_LCE_ACCUMULATOR", raising=False)
    else:
        monkeypatch.setenv("COMPILETUNE_LCE_ACCUMULATOR", env)
    monkeypatch.setenv("COMPILETUNE_LCE_ONE_PASS", "1")
    h, w, y, _ = inputs()
    _, rewritten, stats = run_rewritten(plain, h, w.requires_grad_(), y)
    assert stats["one_pass"] == 1
    (node,) = [n for n in rewritten.graph.nodes if "with_grads" in str(n.target)]
    assert node.args[-1] == written


def test_skips_when_logits_have_another_user():
    def both(h, w, y):
        logits = F.linear(h, w)
        return F.cross_entropy(logits.view(-1, V), y.view(-1)), logits.amax()

    h, w, y, _ = inputs()
    _, rewritten, stats = run_rewritten(both, h, w, y)
    assert stats["matched"] == 0 and stats["skipped"]
    assert "compiletune.linear_cross_entropy.default" not in ops(rewritten)


@pytest.mark.parametrize(
    "kwargs, reason",
    [({"label_smoothing": 0.1}, "label smoothing"), ({"reduction": "none"}, "reduction")],
)
def test_skips_what_the_op_does_not_compute(kwargs, reason):
    def fn(h, w, y):
        return F.cross_entropy(F.linear(h, w).view(-1, V), y.view(-1), **kwargs)

    h, w, y, _ = inputs()
    _, _, stats = run_rewritten(fn, h, w, y)
    assert stats["matched"] == 0
    assert any(reason in k for k in stats["skipped"]), stats


def test_skips_a_slice_of_the_vocab_dimension():
    def fn(h, w, y):
        return F.cross_entropy(F.linear(h, w)[..., :50].reshape(-1, 50), y.view(-1).clamp(max=49))

    h, w, y, _ = inputs()
    _, _, stats = run_rewritten(fn, h, w, y)
    assert stats["matched"] == 0


def tiny_args(tied: bool):
    args = from_name("debug")
    args.n_layers, args.dim, args.ffn_dim, args.n_heads, args.n_kv_heads = 2, 64, 160, 4, 2
    args.vocab_size, args.tie_embeddings = 301, tied
    return args


@pytest.mark.parametrize("one_pass", [False, True])
@pytest.mark.parametrize("tied", [False, True])
def test_compiled_fused_head_matches_eager_plain_and_has_no_logits(
    tied, one_pass, tmp_path, monkeypatch
):
    monkeypatch.setenv("COMPILETUNE_LCE_ONE_PASS", str(int(one_pass)))
    eager = build_model(tiny_args(tied), seed=7)
    comp = copy.deepcopy(eager)
    if tied:
        comp.tie_weights()
    he, hc = LossHead(eager.output, "plain"), LossHead(comp.output, "plain")
    opts = CompileOptions(backend="aot_eager", loss="fused", dump=True)
    regions = compile_regions(comp, hc, opts)
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 301, (2, 20), generator=g)
    targets = torch.randint(0, 301, (2, 20), generator=g)
    targets[0, :15] = -100  # most of a row ignored
    losses, grads = [], []
    for model, head in ((eager, he), (comp, hc)):
        model.zero_grad(set_to_none=True)
        loss = head(model.hidden_states(tokens), targets)
        loss.backward()
        losses.append(loss.detach())
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-5, atol=0)
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], rtol=1e-4, atol=1e-6, msg=name)

    summary = regions.write_dump(tmp_path)["head"]
    (fuse,) = [p for p in summary["passes"] if p["pass"] == "fuse_linear_cross_entropy"]
    assert fuse["pass"] == "fuse_linear_cross_entropy" and fuse["fired"]
    assert fuse["logits_shapes"] == [[40, 301]] and fuse["one_pass"] == int(one_pass)
    assert summary["full_logits_exist"] is False, summary["logits_like_tensors"]
    pre = (tmp_path / "head" / "01_pre_grad.fuse_linear_cross_entropy.txt").read_text()
    diff = json.loads(pre.splitlines()[0].split(": ", 1)[1])
    op = "linear_cross_entropy_with_grads" if one_pass else "linear_cross_entropy"
    assert diff[f"compiletune.{op}.default"] == 1
    assert diff["torch._C._nn.linear"] == -1


def test_trainer_losses_agree_across_loss_kinds(tmp_path):
    corpus = tmp_path / "c.txt"
    corpus.write_text("The fused loss must not change the training curve. " * 150)
    base = {"data": str(corpus), "seq_len": 32, "batch_size": 2, "max_steps": 3}
    runs = {
        "plain": {"loss": "plain"},
        "chunked": {"loss": "chunked"},
        "fused": {"loss": "fused"},
        "fused_compiled": {"loss": "fused", "compile": True, "compile_backend": "aot_eager"},
    }
    finals = {}
    for name, flags in runs.items():
        out = str(tmp_path / name)
        finals[name] = train(resolve({}, {**base, **flags, "output_dir": out}))["final_loss"]
    for value in finals.values():
        assert value == pytest.approx(finals["plain"], rel=1e-4), finals
