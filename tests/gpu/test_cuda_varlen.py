"""Varlen flash attention on CUDA (documents-only masks): torch's kernel against the fp64
reference and the segment op, forward and gradients, eager and compiled, under each activation
policy and with offload, without a host sync. Skipped without CUDA; bench/gpu_check.py runs
them first (`--part tests`)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from compiletune.models import attention as attn
from compiletune.models import build_model, from_name

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit" / "models"))
from test_attention import doc_ids_for, reference  # noqa: E402
from test_cuda import corpus  # noqa: E402
from tiny_run import tiny_run  # noqa: E402

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(attn.VARLEN_API is None, reason="this torch has no usable varlen_attn"),
]

DOCS = [[[300, 20, 280], [600]], [[1, 599], [50, 500, 50]], [[600], [600]]]


def test_which_varlen_form_this_torch_has():
    """Printed for the GPU check's report: the signature form the path calls (2.11's)."""
    print(f"torch {torch.__version__}: varlen_attn form {attn.VARLEN_API[1]!r}")
    assert attn.varlen_available(torch.device("cuda"), torch.bfloat16)


@pytest.mark.parametrize("docs", DOCS)
def test_varlen_against_reference_and_segment_op(docs):
    g = torch.Generator(device="cuda").manual_seed(0)
    b, h, s, hd = 2, 4, 600, 64

    def rand():
        x = torch.randn(b, h, s, hd, generator=g, device="cuda", dtype=torch.bfloat16)
        return x.requires_grad_()

    q, k, v = rand(), rand(), rand()
    doc_ids = doc_ids_for(docs)
    cu, n = attn.cu_seqlens(doc_ids)
    docs_ = attn.VarlenDocs(doc_ids.cuda(), cu.cuda(), n)
    grad = torch.randn(b, h, s, hd, generator=g, device="cuda", dtype=torch.bfloat16)
    out = attn.causal_attention(q, k, v, 0.11, docs_)
    got = [out, *torch.autograd.grad(out, (q, k, v), grad)]
    seg = attn.causal_attention(q, k, v, 0.11, doc_ids.cuda(), backend="segments")
    seg_grads = [seg, *torch.autograd.grad(seg, (q, k, v), grad)]
    ref = reference(q, k, v, 0.11, doc_ids.cuda(), 0, 0.0)
    want = [ref, *torch.autograd.grad(ref, (q, k, v), grad.double())]
    for a, sg, w in zip(got, seg_grads, want, strict=True):
        # bf16: no worse than the segment op's own error against fp64, plus a little
        err, seg_err = (a.double() - w).abs().max(), (sg.double() - w).abs().max()
        assert err <= 2 * seg_err + 1e-2 * w.abs().max(), (err, seg_err)


def test_varlen_has_no_host_sync():
    q, k, v = (torch.randn(2, 4, 512, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    doc_ids = doc_ids_for([[100, 412], [512]])
    cu, n = attn.cu_seqlens(doc_ids)  # on the host, before the copy
    docs = attn.VarlenDocs(doc_ids.cuda(), cu.cuda(), n)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        attn.causal_attention(q, k, v, 0.125, docs)
    finally:
        torch.cuda.set_sync_debug_mode("default")


def _step(model, head, batch, documents):
    tokens, positions, doc_ids, targets = batch
    model.zero_grad(set_to_none=True)
    loss = head(model.hidden_states(tokens, positions, doc_ids, documents=documents), targets)
    loss.backward()
    return [loss.detach(), *(p.grad for p in model.parameters())]


@pytest.mark.parametrize("compiled", [False, True])
@pytest.mark.parametrize("ac", ["none", "selective", "full"])
def test_model_varlen_follows_segment_op(compiled, ac):
    """A bf16 model's loss and gradients through varlen (chosen by the layers themselves: CUDA,
    bf16, documents only) follow the segment op's, eager (torch.utils.checkpoint) and compiled
    (the AC pass: saved under selective, recomputed under full), one graph for any documents."""
    from compiletune.compiler.activation import apply_eager_checkpointing, parse_ac
    from compiletune.compiler.regions import CompileOptions, compile_regions
    from compiletune.loss.head import LossHead

    args = from_name("debug")
    args.n_layers = 2
    base = build_model(args, seed=0).cuda().bfloat16()
    other = build_model(args, seed=0).cuda().bfloat16()
    for block in base.layers:
        block.attention.backend = "segments"
    for block in other.layers:
        block.attention.backend = "flex"
    hb, ho = LossHead(base.output), LossHead(other.output)
    regions = None
    if compiled:
        opts = CompileOptions(loss="plain", ac=parse_ac(ac), dump=True)
        regions = compile_regions(other, ho, opts)
    elif ac != "none":
        apply_eager_checkpointing(other, parse_ac(ac))
    for lengths in ([[100, 412], [300, 12, 200]], [[512], [7, 7, 498]]):
        doc_ids = doc_ids_for(lengths)
        positions = torch.cat([torch.arange(n) for row in lengths for n in row]).view(2, 512)
        tokens = torch.randint(0, args.vocab_size, (2, 512))
        targets = torch.randint(0, args.vocab_size, (2, 512)).cuda()
        docs = attn.cu_seqlens(doc_ids)
        docs = (docs[0].cuda(), docs[1])
        batch = (tokens.cuda(), positions.cuda(), doc_ids.cuda(), targets)
        got, want = _step(other, ho, batch, docs), _step(base, hb, batch, None)
        for a, w in zip(got, want, strict=True):
            torch.testing.assert_close(
                a.float(), w.float(), rtol=5e-2, atol=2e-2 * float(w.abs().max())
            )
    if regions is not None:
        backend = regions.backends["block"]
        assert len(backend.records) == 1
        counts = {s.name: s.counts for s in backend.records[0].stages}
        name = "torch_attn._varlen_attn.default"
        assert counts["forward"][name] == 1
        assert counts["backward"].get(name, 0) == (ac == "full")


@pytest.mark.parametrize(
    "extra", [{"ac": "selective"}, {"ac": "full"}, {"offload_activations": True}]
)
def test_trainer_bf16_compiled_with_varlen(tmp_path, extra):
    """The trainer's own step (host-built documents from local_batch) compiled in bf16, under
    a policy or offload: no recompiles, a falling loss."""
    summary = tiny_run(
        tmp_path, corpus(tmp_path), "varlen", compile=True, dtype="bf16", seq_len=128,
        batch_size=4, max_steps=8, **extra,
    )  # fmt: skip
    assert summary["doc_mask"] is True
    assert summary["compile"]["recompiles"] == 0, summary["compile"]
    assert summary["final_loss"] < summary["first_loss"]
