"""compiletune::gated_delta_rule against the gated delta rule written one token at a time: outputs,
gradients of every input, document resets in packed rows, the final state, transformers' own
chunked torch path, and the op under torch.compile."""

from __future__ import annotations

import pytest
import torch
import transformers.models.qwen3_next.modeling_qwen3_next as hf_next

from compiletune.ops import op_memory
from compiletune.ops.gated_delta import gated_delta_forward, gated_delta_rule


def recurrence(q, k, v, g, beta, doc_ids=None):
    """The rule token by token (fp64): S = a S; S += k (beta (v - S^T k))^T; o = S^T q; S reset
    to zero at each document's first token."""
    b, s, h, dk = k.shape
    state = torch.zeros(b, h, dk, v.shape[-1], dtype=torch.float64)
    out = []
    for t in range(s):
        if doc_ids is not None and t > 0:
            new = (doc_ids[:, t] != doc_ids[:, t - 1]).to(torch.float64)
            state = state * (1 - new)[:, None, None, None]
        state = state * g[:, t].double().exp()[..., None, None]
        kt, vt, qt = k[:, t].double(), v[:, t].double(), q[:, t].double()
        remembered = (state * kt[..., None]).sum(-2)
        delta = (vt - remembered) * beta[:, t].double()[..., None]
        state = state + kt[..., None] * delta[..., None, :]
        out.append((state * qt[..., None]).sum(-2))
    return torch.stack(out, dim=1), state


def inputs(b=2, s=150, h=3, dk=8, dv=12, seed=0, requires_grad=False):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, s, h, dk, generator=gen) * dk**-0.5
    k = torch.nn.functional.normalize(torch.randn(b, s, h, dk, generator=gen), dim=-1)
    v = torch.randn(b, s, h, dv, generator=gen)
    g = -torch.rand(b, s, h, generator=gen) * 0.3  # log decays <= 0
    beta = torch.rand(b, s, h, generator=gen)
    out = [q, k, v, g, beta]
    if requires_grad:
        out = [x.requires_grad_() for x in out]
    return out


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def packed_docs(b, s, seed=1):
    """doc ids [b, s] with documents of assorted lengths: one ends at a chunk's last token, one
    starts at a chunk's first token, several start and end inside one chunk."""
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for r in range(b):
        cuts = sorted(set(torch.randint(1, s, (6,), generator=gen).tolist()) | {16, 64, 70 + r})
        ids = torch.zeros(s, dtype=torch.long)
        for c in cuts:
            ids[c:] += 1
        rows.append(ids)
    return torch.stack(rows)


@pytest.mark.parametrize("chunk", [16, 64])
@pytest.mark.parametrize("docs", [False, True])
def test_outputs_and_gradients_equal_the_recurrence(chunk, docs):
    q, k, v, g, beta = inputs(requires_grad=True)
    doc_ids = packed_docs(2, q.shape[1]) if docs else None
    want, _ = recurrence(q, k, v, g, beta, doc_ids)
    got = gated_delta_rule(q, k, v, g, beta, doc_ids, chunk=chunk)
    assert got.dtype == v.dtype and got.shape == v.shape
    assert rel(got, want) <= 1e-5
    weights = torch.randn(
        want.shape, generator=torch.Generator().manual_seed(7), dtype=torch.float64
    )
    grads_want = torch.autograd.grad((want * weights).sum(), (q, k, v, g, beta))
    grads_got = torch.autograd.grad((got * weights.float()).sum(), (q, k, v, g, beta))
    for name, a, b in zip(["q", "k", "v", "g", "beta"], grads_got, grads_want, strict=True):
        assert rel(a, b) <= 1e-4, (name, rel(a, b))


def test_packed_documents_equal_each_document_alone():
    q, k, v, g, beta = inputs(b=1, s=130)
    doc_ids = torch.zeros(1, 130, dtype=torch.long)
    doc_ids[:, 50:] = 1
    doc_ids[:, 70:] = 2  # 50 | 20 | 60 tokens; the second one inside one chunk of 64
    packed = gated_delta_rule(q, k, v, g, beta, doc_ids)
    for lo, hi in ((0, 50), (50, 70), (70, 130)):
        alone = gated_delta_rule(*(x[:, lo:hi] for x in (q, k, v, g, beta)))
        assert rel(packed[:, lo:hi], alone) <= 1e-6, (lo, hi)


def test_final_state_continues_the_sequence():
    """The state after a prompt, fed back as the initial state, gives what one pass gives
    (what generation relies on), and equals the recurrence's state."""
    q, k, v, g, beta = inputs(s=100)
    whole, state = gated_delta_forward(q, k, v, g, beta)
    _, want_state = recurrence(q, k, v, g, beta)
    assert rel(state, want_state) <= 1e-5
    first, mid = gated_delta_forward(*(x[:, :37] for x in (q, k, v, g, beta)))
    rest, end = gated_delta_forward(*(x[:, 37:] for x in (q, k, v, g, beta)), initial_state=mid)
    assert rel(torch.cat((first, rest), dim=1), whole) <= 1e-5
    assert rel(end, state) <= 1e-5


def test_equals_transformers_chunked_torch_path():
    q, k, v, g, beta = inputs(s=200)
    want, _ = hf_next.torch_chunk_gated_delta_rule(q, k, v, g, beta, initial_state=None)
    # transformers scales q by dk^-0.5 inside; ours takes q as the model hands it
    got = gated_delta_rule(q * q.shape[-1] ** -0.5, k, v, g, beta)
    assert rel(got, want) <= 1e-5


def test_compiled_once_and_declares_its_memory():
    assert {"compiletune::gated_delta_rule", "compiletune::gated_delta_rule_backward"} <= (
        op_memory.declared()
    )
    calls = []

    def backend(gm, example_inputs):
        calls.append(gm)
        return gm.forward

    fn = torch.compile(
        lambda *xs: gated_delta_rule(*xs).sum(), backend=backend, fullgraph=True, dynamic=False
    )
    for seed in range(3):
        xs = inputs(s=96, seed=seed, requires_grad=True)
        fn(*xs).backward()
        grads = [x.grad for x in xs]
        ref = [x.detach().requires_grad_() for x in xs]
        gated_delta_rule(*ref).sum().backward()
        assert all(rel(a, r.grad) <= 1e-6 for a, r in zip(grads, ref, strict=True))
    assert len(calls) == 1


@pytest.mark.parametrize(("s", "h", "dk", "dv"), [(1500, 4, 32, 48), (700, 2, 128, 128)])
def test_declared_memory_covers_what_the_op_allocates(s, h, dk, dv):
    """What the estimate adds for each op (ops/op_memory.py) against the allocator's peak of a
    call above its inputs and outputs: never less, at most a third more."""
    from compiletune.estimate.memory_internals import cpu_allocation_peak

    q, k, v, g, beta = inputs(b=1, s=s, h=h, dk=dk, dv=dv)
    grad = torch.randn(v.shape)
    calls = [
        (torch.ops.compiletune.gated_delta_rule.default, (q, k, v, g, beta, None, 64), v.numel()),
        (
            torch.ops.compiletune.gated_delta_rule_backward.default,
            (q, k, v, g, beta, None, grad, 64),
            sum(x.numel() for x in (q, k, v, g, beta)),
        ),
    ]
    for op, args, out_numel in calls:
        measured = cpu_allocation_peak(lambda op=op, args=args: op(*args)) - 4 * out_numel
        declared = op_memory.internal_bytes(op, args, {})
        assert 0.75 * declared <= measured <= declared, (op, measured, declared)


def test_fla_path_lays_documents_end_to_end(monkeypatch):
    """The flash-linear-attention path (CUDA) hands the kernel every document of every row as
    one row with their offsets, q unscaled further, and differentiates through a recomputed
    forward. Checked here with a stand-in kernel (the recurrence per document) against the
    op on the packed rows; bench/gpu_check.py compares the real kernels on a GPU."""
    from compiletune.ops import gated_delta

    def kernel(q, k, v, g, beta, scale, cu_seqlens):
        assert q.shape[0] == 1 and cu_seqlens.dtype == torch.int64
        bounds = cu_seqlens.tolist()
        parts = [
            recurrence(*(x[:, lo:hi] for x in (q * scale, k, v, g, beta)))[0]
            for lo, hi in zip(bounds[:-1], bounds[1:], strict=True)
        ]
        return torch.cat(parts, dim=1).float(), None

    q, k, v, g, beta = inputs(requires_grad=True)
    doc_ids = packed_docs(2, q.shape[1])
    want = gated_delta_rule(q, k, v, g, beta, doc_ids)
    monkeypatch.setattr(gated_delta, "use_fla", lambda q: True)
    monkeypatch.setattr(gated_delta, "fla_kernel", lambda: kernel)
    got = gated_delta_rule(q, k, v, g, beta, doc_ids)
    assert rel(got, want) <= 1e-5
    grad = torch.randn(want.shape, generator=torch.Generator().manual_seed(7))
    for a, b in zip(
        torch.autograd.grad(got, (q, k, v, g, beta), grad),
        torch.autograd.grad(want, (q, k, v, g, beta), grad),
        strict=True,
    ):
        assert rel(a, b) <= 1e-4
    offsets = gated_delta.document_offsets(doc_ids, 2, q.shape[1], q.device)
    starts = (doc_ids[:, 1:] != doc_ids[:, :-1]).sum() + 2  # each row opens one
    assert offsets[0] == 0 and offsets[-1] == 2 * q.shape[1] and len(offsets) == starts + 1
    monkeypatch.undo()  # the real lookup: turned off by the variable
    monkeypatch.setenv("COMPILETUNE_NO_FLA", "1")
    assert gated_delta.fla_kernel() is None


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_fla_kernels_equal_the_op_on_packed_rows(monkeypatch):
    """On a GPU with flash-linear-attention: its kernels (documents as offsets) give the op's
    outputs and gradients on packed rows (bench/gpu_check.py --part 1 runs this)."""
    from compiletune.ops import gated_delta

    pytest.importorskip("fla")
    xs = [x.cuda().requires_grad_() for x in inputs(s=300, h=4, dk=64, dv=64)]
    doc_ids = packed_docs(2, 300).cuda()
    grad = torch.randn(xs[2].shape, device="cuda")
    assert gated_delta.use_fla(xs[0])
    got = gated_delta_rule(*xs, doc_ids)
    got_grads = torch.autograd.grad(got, xs, grad)
    monkeypatch.setenv("COMPILETUNE_NO_FLA", "1")
    want = gated_delta_rule(*xs, doc_ids)
    want_grads = torch.autograd.grad(want, xs, grad)
    # fla runs its matmuls in tf32 / bf16 where it can: a looser bound than the CPU checks'
    assert rel(got, want) <= 2e-3
    for a, b in zip(got_grads, want_grads, strict=True):
        assert rel(a, b) <= 5e-3
