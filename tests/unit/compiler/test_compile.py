"""The compile pipeline: per-block regions through compiletune's backend, numerics, dumps."""

from __future__ import annotations

import copy
import json
import math

import pytest
import torch

from compiletune.compiler.backend import CompiletuneBackend, Pass
from compiletune.compiler.regions import CompileOptions, compile_regions
from compiletune.config import resolve
from compiletune.loss.head import LossHead
from compiletune.models import build_model, from_name
from compiletune.train.loop import train


def tiny_args(layers: int = 3):
    args = from_name("debug")
    args.n_layers, args.dim, args.ffn_dim, args.n_heads, args.n_kv_heads = layers, 64, 160, 4, 2
    args.vocab_size = 300
    return args


def batch(b: int = 2, s: int = 24, vocab: int = 300, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (b, s), generator=g)
    targets = torch.randint(0, vocab, (b, s), generator=g)
    targets[0, :5] = -100  # some ignored positions
    return tokens, targets


def loss_and_grads(model, head, tokens, targets):
    model.zero_grad(set_to_none=True)
    loss = head(model.hidden_states(tokens), targets)
    loss.backward()
    return loss.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


@pytest.mark.parametrize("backend", ["aot_eager", pytest.param("inductor", marks=pytest.mark.slow)])
@pytest.mark.parametrize("tied", [False, True])
def test_compiled_matches_eager_fp32(backend, tied):
    args = tiny_args()
    args.tie_embeddings = tied
    eager = build_model(args, seed=1)
    compiled = copy.deepcopy(eager)
    if tied:
        compiled.tie_weights()
    head_e = LossHead(eager.output, "plain")
    head_c = LossHead(compiled.output, "plain")
    regions = compile_regions(compiled, head_c, CompileOptions(backend=backend, loss="plain"))
    for seed in range(2):  # two different batches: the second one reuses the compiled code
        tokens, targets = batch(seed=seed)
        le, ge = loss_and_grads(eager, head_e, tokens, targets)
        lc, gc = loss_and_grads(compiled, head_c, tokens, targets)
        assert math.isfinite(lc.item())
        assert rel_err(lc, le) <= 1e-5
        for name in ge:
            assert rel_err(gc[name], ge[name]) <= 1e-4, name
    stats = regions.stats()
    assert stats["regions"]["block"]["compiles"] == 1  # 3 identical blocks, one compile
    assert stats["regions"]["head"]["compiles"] == 1
    assert stats["recompiles"] == 0


@pytest.mark.parametrize("backend", ["aot_eager", pytest.param("inductor", marks=pytest.mark.slow)])
def test_compiled_bf16_error_no_worse_than_eager_bf16(backend):
    args = tiny_args()
    ref = build_model(args, seed=2).double()
    eager = copy.deepcopy(ref).to(torch.bfloat16)
    compiled = copy.deepcopy(eager)
    regions = compile_regions(
        compiled, LossHead(compiled.output), CompileOptions(backend=backend, loss="plain")
    )
    tokens, targets = batch(seed=3)
    lr, gr = loss_and_grads(ref, LossHead(ref.output), tokens, targets)
    le, ge = loss_and_grads(eager, LossHead(eager.output), tokens, targets)
    lc, gc = loss_and_grads(compiled, LossHead(compiled.output), tokens, targets)
    assert math.isfinite(lc.item())
    slack = 0.25
    assert rel_err(lc, lr) <= rel_err(le, lr) * (1 + slack) + 1e-3
    for name in gr:
        e_eager, e_comp = rel_err(ge[name], gr[name]), rel_err(gc[name], gr[name])
        assert e_comp <= e_eager * (1 + slack) + 2e-3, (name, e_eager, e_comp)
    assert regions.stats()["recompiles"] == 0


def test_one_backend_for_identical_blocks_even_when_deep():
    args = tiny_args(layers=8)
    model = build_model(args, seed=0)
    head = LossHead(model.output)
    regions = compile_regions(model, head, CompileOptions(backend="aot_eager", loss="plain"))
    tokens, targets = batch()
    loss_and_grads(model, head, tokens, targets)
    assert regions.backends["block"].compiles == 1


def _count_mms(gm):
    count = sum(1 for n in gm.graph.nodes if n.target in (torch.ops.aten.mm.default,))
    return gm, {"matched": count}


def test_passes_run_in_order_and_report_stats():
    seen = []

    def pre(gm):
        seen.append(("pre_grad", sum(1 for _ in gm.graph.nodes)))
        return gm, {"matched": 0}

    def joint(gm):
        seen.append(("joint", sum(1 for _ in gm.graph.nodes)))
        return _count_mms(gm)

    backend = CompiletuneBackend(
        "block",
        [Pass("count_mm", "joint", joint), Pass("look", "pre_grad", pre)],
        mode="aot_eager",
    )
    block = build_model(tiny_args(1), seed=0).layers[0]
    block.compile(backend=backend, fullgraph=True)
    x = torch.randn(2, 8, 64, requires_grad=True)
    cos, sin = torch.ones(1, 8, 16), torch.zeros(1, 8, 16)
    block(x, cos, sin).sum().backward()
    assert [s for s, _ in seen] == [
        "pre_grad",
        "joint",
    ]  # pre-grad before joint, whatever order given
    (record,) = backend.records
    by_name = {p["pass"]: p for p in record.passes}
    assert by_name["count_mm"]["fired"] and by_name["count_mm"]["matched"] >= 7  # 7 linears fwd
    assert not by_name["look"]["fired"]


def test_dump_graphs_writes_every_stage(tmp_path):
    model = build_model(tiny_args(2), seed=0)
    head = LossHead(model.output)
    regions = compile_regions(
        model, head, CompileOptions(backend="aot_eager", loss="plain", dump=True)
    )
    tokens, targets = batch()
    loss_and_grads(model, head, tokens, targets)
    summary = regions.write_dump(tmp_path)
    for region in ("block", "head"):
        names = sorted(p.name for p in (tmp_path / region).iterdir())
        assert names[:4] == ["00_dynamo.txt", "01_joint.txt", "02_forward.txt", "03_backward.txt"]
        joint = (tmp_path / region / "01_joint.txt").read_text()
        assert joint.startswith("# op-count diff against the previous stage:")
        assert "def forward" in joint
    on_disk = json.loads((tmp_path / "summary.json").read_text())
    assert on_disk.keys() == summary.keys() == {"block", "head"}
    block = on_disk["block"]
    assert block["saved_activation_bytes"] > 0
    assert block["largest_tensor"]["forward"]["bytes"] > 0
    # The plain head keeps [tokens, vocab] logits: the summary says so.
    assert on_disk["head"]["logits_shape"] == [48, 300]
    assert on_disk["head"]["full_logits_exist"] is True


def test_train_with_compile_reports_compiles_and_no_recompiles(tmp_path):
    corpus = tmp_path / "c.txt"
    corpus.write_text("compiled training on a tiny corpus. " * 200)
    common = {"data": str(corpus), "seq_len": 32, "batch_size": 2, "max_steps": 3, "loss": "plain"}
    eager = train(resolve({}, {**common, "output_dir": str(tmp_path / "e")}))
    comp = train(
        resolve(
            {},
            {
                **common,
                "output_dir": str(tmp_path / "c"),
                "compile": True,
                "compile_backend": "aot_eager",
                "dump_graphs": str(tmp_path / "dump"),
            },
        )
    )
    assert comp["compile"]["compiles"] == 2 and comp["compile"]["recompiles"] == 0
    assert comp["final_loss"] == pytest.approx(eager["final_loss"], rel=1e-4)
    assert (tmp_path / "dump" / "summary.json").is_file()


def test_fused_head_row_functions_compile_once(tmp_path, monkeypatch):
    """Under --compile the fused head's custom op runs inside the compiled head, and
    AOTAutograd runs its first call under a checking dispatch mode. The head's compiled row
    functions must not be compiled again for the later steps (they were: ~0.5 s once)."""
    from compiletune.ops import ce_chunks
    from compiletune.train import device, loop

    for module in (device, loop):  # a GPU would take the Triton path
        monkeypatch.setattr(module, "pick_device", lambda: torch.device("cpu"))
    compiles = []
    real_compile = torch.compile

    def counting_compile(fn, **kwargs):
        if not getattr(fn, "__name__", "").startswith("_rows_"):
            return real_compile(fn, **kwargs)
        kwargs.pop("options", None)

        def backend(gm, example_inputs):  # what dynamo captured, run as traced
            compiles.append(fn.__name__)
            return gm.forward

        return real_compile(fn, backend=backend, **kwargs)

    monkeypatch.setattr(torch, "compile", counting_compile)
    monkeypatch.setattr(ce_chunks, "_compiled", {})
    corpus = tmp_path / "c.txt"
    corpus.write_text("compiled training on a tiny corpus. " * 200)
    cfg = {"data": str(corpus), "seq_len": 32, "batch_size": 2, "max_steps": 3, "loss": "fused"}
    cfg |= {"output_dir": str(tmp_path / "c"), "compile": True, "compile_backend": "aot_eager"}
    summary = train(resolve({}, cfg))
    assert sorted(compiles) == ["_rows_backward_", "_rows_forward"]
    assert summary["compile"]["recompiles"] == 0 and not ce_chunks._compile_failed
    assert summary["helper_graphs"] == 2  # the run summary counts them
