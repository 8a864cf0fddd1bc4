"""Varlen flash attention for documents-only masks: the host-side cumulative lengths, which
layers take the path, and (with the tests' CPU kernels for torch's op, tests/varlen_cpu.py)
the model's forward and gradients against the segment op, compiled under each policy."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from compiletune.models import attention as attn
from compiletune.models import build_model, from_name
from compiletune.ops import op_memory
from compiletune.train.forward import local_batch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import varlen_cpu  # noqa: E402

needs_varlen = pytest.mark.skipif(attn.VARLEN_API is None, reason="torch has no varlen_attn")


def reference_cu(doc_ids: torch.Tensor) -> list[int]:
    """Document boundaries walked token by token over the flattened batch."""
    b, s = doc_ids.shape
    cu = [0]
    for r in range(b):
        for i in range(1, s):
            if doc_ids[r, i] != doc_ids[r, i - 1]:
                cu.append(r * s + i)
        cu.append((r + 1) * s)
    return cu if b * s else [0]


def rows(*lengths_per_row: list[int]) -> torch.Tensor:
    return torch.stack(
        [
            torch.cat([torch.full((n,), d, dtype=torch.int32) for d, n in enumerate(lengths)])
            for lengths in lengths_per_row
        ]
    )


@pytest.mark.parametrize(
    "doc_ids",
    [
        rows([3, 5, 2], [1, 9]),  # several documents per row
        rows([4, 2, 4], [6, 4]),  # the last "document" of each is its padding (data/ numbers
        rows([10], [10]),  # it as one more id); rows that are one document each
        rows([10]),  # one row
        rows([1] * 10, [10]),  # one-token documents
        torch.zeros(0, 16, dtype=torch.int32),  # no rows
        torch.zeros(3, 0, dtype=torch.int32),  # empty rows
    ],
)
def test_cu_seqlens_on_the_host_against_a_reference(doc_ids):
    cu, max_seqlen = attn.cu_seqlens(doc_ids)
    assert cu.dtype == torch.int32 and cu.device.type == "cpu"
    assert cu.tolist() == reference_cu(doc_ids)
    assert max_seqlen == doc_ids.shape[1]  # a bound on every document: one compiled graph
    # the same documents as the segment op walks
    if doc_ids.numel():
        segs = attn.doc_segments(doc_ids)
        s = doc_ids.shape[1]
        assert [r * s + a for r, a, _ in segs] == cu[:-1].tolist()


def test_local_batch_carries_the_host_built_documents():
    doc_ids = rows([3, 5], [8], [2, 2, 4])
    batch = {"inputs": torch.zeros(3, 8, dtype=torch.long), "doc_ids": doc_ids}
    mine = local_batch(batch, slice(1, 3), None, torch.device("cpu"))
    cu, n = mine["documents"]
    assert cu.tolist() == reference_cu(doc_ids[1:3]) and n == 8
    assert "documents" not in local_batch({"inputs": batch["inputs"]}, slice(None), None, "cpu")


def test_local_batch_under_the_estimates_fake_mode():
    """The memory estimate runs the step under FakeTensorMode with real batches (a DPO batch
    has doc_ids): the lengths come from the real rows, no torch op (a fake nonzero raised)."""
    from compiletune.estimate import memory_internals as mi

    batch = {"inputs": torch.zeros(2, 8, dtype=torch.long), "doc_ids": rows([3, 5], [8])}
    with mi.fake_mode():
        mine = local_batch(batch, slice(None), None, torch.device("cpu"))
        fake_ids = torch.zeros(2, 8, dtype=torch.int32)  # a batch made inside the mode
        assert "documents" not in local_batch({"doc_ids": fake_ids}, slice(None), None, "cpu")
    assert mine["documents"][1] == 8 and mine["documents"][0].shape == (4,)


def test_which_layers_take_varlen():
    docs = attn.VarlenDocs(torch.zeros(1, 4), torch.tensor([0, 4]), 4)
    shared = {attn.VARLEN_KEY: docs}
    assert attn.varlen_documents(shared, 0, 0.0, False, 64) is docs  # documents only
    assert attn.varlen_documents(shared, 128, 0.0, False, 64) is None  # window: FlexAttention
    assert attn.varlen_documents(shared, 0, 50.0, False, 64) is None  # soft-cap: FlexAttention
    assert attn.varlen_documents(shared, 0, 0.0, True, 64) is None  # sinks: FlexAttention
    assert attn.varlen_documents(shared, 0, 0.0, False, 512) is None  # past flash's head dims
    assert attn.varlen_documents({}, 0, 0.0, False, 64) is None  # no host-built documents


@needs_varlen
def test_varlen_where_cuda_and_half(monkeypatch):
    monkeypatch.delenv(attn.VARLEN_ENV, raising=False)
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert attn.varlen_available(cuda, torch.bfloat16)
    assert attn.varlen_available(cuda, torch.float16)
    assert not attn.varlen_available(cuda, torch.float32)  # flash has no fp32 kernel
    assert not attn.varlen_available(cpu, torch.bfloat16)  # the segment op's device
    monkeypatch.setenv(attn.VARLEN_ENV, "off")
    assert not attn.varlen_available(cuda, torch.bfloat16)
    monkeypatch.setenv(attn.VARLEN_ENV, "force")
    assert attn.varlen_available(cpu, torch.float32)
    monkeypatch.setenv(attn.VARLEN_ENV, "on")
    with pytest.raises(ValueError, match="expected off or force"):
        attn.varlen_available(cuda, torch.bfloat16)


def test_an_older_varlen_without_scale_is_not_used(monkeypatch):
    """torch 2.9's varlen_attn takes no scale: a model's own would be lost, so no varlen."""

    class Old:
        @staticmethod
        def varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False):
            raise AssertionError

    assert attn.find_varlen_api(Old) is None
    monkeypatch.setattr(attn, "VARLEN_API", None)
    assert not attn.varlen_available(torch.device("cuda"), torch.bfloat16)


def test_the_backward_declares_its_accumulators():
    q = torch.empty(1000, 4, 60, device="meta")
    cu = torch.empty(5, dtype=torch.int32, device="meta")
    op = torch.ops.torch_attn._varlen_attn_backward.default
    args = (q, q, q, q, q, torch.empty(4, 1000), cu, cu, 1000, 1000, True, torch.empty(2))
    # fp32 dq [1000 + 128 * 4, 4, 64] and row sums [4, 4, 1024]
    assert op_memory.internal_bytes(op, args, {}) == 4 * (1512 * 4 * 64 + 4 * 4 * 1024)


LENGTHS = ([[40, 30, 58], [128]], [[100, 28], [7, 7, 7, 107]])


def _batch(lengths, vocab):
    doc_ids = rows(*lengths)
    positions = torch.cat([torch.arange(n) for row in lengths for n in row]).view(doc_ids.shape)
    tokens = torch.randint(0, vocab, doc_ids.shape)
    return tokens, positions, doc_ids


def _run(model, tokens, positions, doc_ids, documents):
    model.zero_grad(set_to_none=True)
    h = model.hidden_states(tokens, positions, doc_ids, documents=documents)
    (h * torch.linspace(-1, 1, h.shape[-1])).sum().backward()
    return [h.detach(), *(p.grad for p in model.parameters() if p.grad is not None)]


@needs_varlen
@pytest.mark.parametrize(
    "compiled, ac",
    [(False, "none"), (True, "none"), (True, "selective"), (True, "full"), (True, "offload")],
)
def test_model_through_varlen_equals_the_segment_op(monkeypatch, compiled, ac):
    """A tiny model's hidden states and every gradient through varlen attention (the tests' CPU
    kernel, fp32) equal the segment op's; compiled, every block is one graph whatever the
    documents, and the policy saves (selective) or recomputes (full) the attention."""
    from compiletune.compiler.activation import parse_ac
    from compiletune.compiler.regions import CompileOptions, compile_regions
    from compiletune.loss.head import LossHead

    varlen_cpu.register()
    calls = []
    if not compiled:  # (compiled, the graph's op counts below say it; a list would be guarded)
        original = attn.varlen_causal_attention
        monkeypatch.setattr(
            attn, "varlen_causal_attention", lambda *a: calls.append(1) or original(*a)
        )
    args = from_name("debug")
    args.n_layers = 2
    torch.manual_seed(0)
    base, other = build_model(args, seed=0), build_model(args, seed=0)
    for block in base.layers:
        block.attention.backend = "segments"
    for block in other.layers:
        block.attention.backend = "flex"  # CUDA's choice; documents-only layers take varlen
    monkeypatch.setenv(attn.VARLEN_ENV, "force")
    regions = None
    if compiled:
        # offload: selective, with what it saves moved to the host (the number of documents, a
        # symbolic size, is saved too)
        policy = parse_ac("selective" if ac == "offload" else ac)
        opts = CompileOptions(
            backend="aot_eager",
            loss="plain",
            ac=policy,
            dump=True,
            offload_blocks=len(other.layers) if ac == "offload" else 0,
        )
        regions = compile_regions(other, LossHead(other.output), opts)
    for lengths in LENGTHS:
        tokens, positions, doc_ids = _batch(lengths, args.vocab_size)
        got = _run(other, tokens, positions, doc_ids, attn.cu_seqlens(doc_ids))
        want = _run(base, tokens, positions, doc_ids, None)
        for a, w in zip(got, want, strict=True):
            # fp32, relative to each tensor's scale (the summed gradients reach 1e3)
            torch.testing.assert_close(a, w, rtol=1e-4, atol=1e-6 * float(w.abs().max()))
    assert calls or compiled  # the varlen path ran
    if regions is not None:
        backend = next(b for n, b in regions.backends.items() if n.startswith("block"))
        assert len(backend.records) == 1  # one graph for both batches' document counts
        counts = {s.name: s.counts for s in backend.records[0].stages}
        name = "torch_attn._varlen_attn.default"
        assert counts["forward"][name] == 1
        assert counts["backward"].get(name, 0) == (ac == "full")
        if ac == "offload":
            assert counts["backward.offload_activations"]["compiletune.reload_from_host.default"]
