"""compiletune::linear_cross_entropy: numerics against fp64, one node under compile, what it saves
for backward, the Triton kernels (interpreter on CPU, real on a GPU), and the two baselines.

Most tests run the row-wise torch functions eagerly (COMPILETUNE_LCE_EAGER=1) to stay fast;
`test_nested_compile_path` covers the default, compiled path.
"""

import importlib.util
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from compiletune.errors import UserError
from compiletune.ops import ce_chunks, fused_loss
from compiletune.ops.ce_chunks import chunk_tokens
from compiletune.ops.fused_loss import (
    chunked_cross_entropy,
    linear_cross_entropy,
    plain_cross_entropy,
)

IGNORE = -100
HAS_TRITON = importlib.util.find_spec("triton") is not None
HAS_CUDA = torch.cuda.is_available()


@pytest.fixture(autouse=True)
def eager_chunks(monkeypatch):
    monkeypatch.setenv("COMPILETUNE_LCE_EAGER", "1")
    monkeypatch.delenv("COMPILETUNE_LCE_CHUNK_TOKENS", raising=False)


# The head's three ways to run: the two-op head whose backward chunks over tokens or over
# vocabulary columns, and the one-pass head that computes the gradients in the forward.
PATHS = ["tokens", "vocab", "one_pass"]


def force_loop(monkeypatch, loop: str) -> None:
    """Run the head one way (a PATHS entry) whatever the sizes say."""
    monkeypatch.setenv("COMPILETUNE_LCE_ONE_PASS", "1" if loop == "one_pass" else "0")
    monkeypatch.setattr(fused_loss, "_chunk_vocab", lambda *args: loop == "vocab")


def make_case(n, d, vocab, *, bias=False, ignored=0.0, dtype=torch.float32, seed=0, device="cpu"):
    """Fresh random h [n, d], weight [V, d], bias [V] | None, targets [n] with a share ignored."""
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(n, d, generator=g)
    w = torch.randn(vocab, d, generator=g) / d**0.5
    b = torch.randn(vocab, generator=g) if bias else None
    t = torch.randint(0, vocab, (n,), generator=g)
    t[torch.rand(n, generator=g) < ignored] = IGNORE
    to = lambda x: None if x is None else x.to(device, dtype).requires_grad_()  # noqa: E731
    return to(h), to(w), to(b), t.to(device)


def reference(h, w, b, t, *, reduction="mean", z_loss=0.0, softcap=0.0):
    """Float64 autograd reference -> (loss, dh, dw, db)."""
    h64 = h.detach().double().requires_grad_()
    w64 = w.detach().double().requires_grad_()
    b64 = None if b is None else b.detach().double().requires_grad_()
    x = F.linear(h64, w64, b64)
    if softcap:
        x = softcap * torch.tanh(x / softcap)
    lse = torch.logsumexp(x, -1)
    valid = t != IGNORE
    target_logit = x.gather(1, torch.where(valid, t, 0)[:, None]).squeeze(1)
    loss = torch.where(valid, lse - target_logit + z_loss * lse * lse, 0.0).sum()
    if reduction == "mean":
        loss = loss / valid.sum().clamp(min=1)
    loss.backward()
    return loss.detach(), h64.grad, w64.grad, None if b is None else b64.grad


def loss_and_grads(fn, h, w, b, t, **kw):
    for x in (h, w, b):
        if x is not None:
            x.grad = None
    loss = fn(h, w, t, b, **kw)
    loss.backward()
    return loss.detach(), h.grad, w.grad, None if b is None else b.grad


def rel(a, b) -> float:
    """Norm-wise relative error of a against the reference b."""
    a, b = a.double().cpu(), b.double().cpu()
    assert torch.isfinite(a).all()
    return ((a - b).norm() / b.norm()).item()


def assert_close_to_reference(got, ref, tol):
    for name, a, b in zip(("loss", "dh", "dw", "db"), got, ref, strict=True):
        if b is not None:
            assert rel(a, b) <= tol, f"{name}: rel err {rel(a, b):.2e} > {tol:.0e}"


CASES = {
    # name: (n, d, V, chunk, make_case kwargs, op kwargs)
    "mean_bias": (37, 16, 50, 8, dict(bias=True, ignored=0.2), dict(reduction="mean")),
    "sum_no_bias": (37, 16, 50, 8, dict(ignored=0.2), dict(reduction="sum")),
    "vocab_not_multiple": (32, 16, 53, 8, dict(bias=True), dict()),
    "n_not_multiple": (29, 16, 48, 8, dict(), dict()),
    "one_chunk": (29, 16, 48, 0, dict(bias=True), dict()),
    "mostly_ignored": (64, 16, 50, 8, dict(ignored=0.9, seed=3), dict()),
    "z_loss": (37, 16, 50, 8, dict(ignored=0.2), dict(z_loss=1e-2)),
    "softcap": (37, 16, 50, 8, dict(bias=True), dict(softcap=2.0)),
    "z_loss_softcap_sum": (
        37,
        16,
        50,
        8,
        dict(ignored=0.2),
        dict(z_loss=1e-3, softcap=3.0, reduction="sum"),
    ),
}


@pytest.mark.parametrize("loop", PATHS)
@pytest.mark.parametrize("case", list(CASES))
def test_fp32_matches_fp64(case, loop, monkeypatch):
    force_loop(monkeypatch, loop)
    n, d, vocab, chunk, case_kw, op_kw = CASES[case]
    h, w, b, t = make_case(n, d, vocab, **case_kw)
    got = loss_and_grads(linear_cross_entropy, h, w, b, t, chunk_size=chunk, **op_kw)
    assert_close_to_reference(got, reference(h, w, b, t, **op_kw), 1e-5)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("loop", PATHS)
def test_all_ignored_gives_zero_not_nan(reduction, loop, monkeypatch):
    force_loop(monkeypatch, loop)
    h, w, b, t = make_case(12, 8, 20, bias=True, ignored=1.0)
    assert (t == IGNORE).all()
    loss, dh, dw, db = loss_and_grads(
        linear_cross_entropy, h, w, b, t, reduction=reduction, chunk_size=4
    )
    assert loss.item() == 0.0
    for g in (dh, dw, db):
        assert torch.isfinite(g).all() and (g == 0).all()
    # The baselines share the no-NaN contract.
    for fn in (chunked_cross_entropy, plain_cross_entropy):
        assert fn(h, w, t, b, reduction=reduction).item() == 0.0


# ROW_ALIGN 1: only the counted rows are computed; 8: they are gathered and padded with ignored
# rows (45 tokens, 36 counted -> 40 rows); 64: all 45 rows are computed in place.
@pytest.mark.parametrize("align", [1, 8, 64])
@pytest.mark.parametrize("loop", PATHS)
def test_padding_rows_enter_nothing(align, loop, monkeypatch):
    """Ignored tokens computed as padding rows change neither the loss nor a gradient, even with
    non-finite hidden states and a bias whose exp overflows fp32, and their dh is 0."""
    force_loop(monkeypatch, loop)
    monkeypatch.setattr(ce_chunks, "ROW_ALIGN", align)
    h, w, b, t = make_case(45, 16, 50, bias=True, ignored=0.3, seed=5)
    ignored = t == IGNORE
    assert (~ignored).sum() == 36
    with torch.no_grad():
        b[7] = 100.0
    ref = reference(h, w, b, t, z_loss=1e-2)
    with torch.no_grad():
        h[ignored] = float("nan")
        h[ignored.nonzero()[0]] = float("inf")
    got = loss_and_grads(linear_cross_entropy, h, w, b, t, chunk_size=8, z_loss=1e-2)
    assert_close_to_reference(got, ref, 1e-5)
    assert (got[1][ignored] == 0).all()


def test_tied_embedding_gets_both_gradients():
    """Embedding and head share one weight: its gradient is the sum of both uses."""
    torch.manual_seed(0)
    vocab, d = 40, 16
    w = (torch.randn(vocab, d) / d**0.5).requires_grad_()
    mix = torch.randn(d, d, requires_grad=True)
    ids = torch.randint(0, vocab, (3, 9))
    t = torch.roll(ids, -1, dims=1)
    t[:, -1] = IGNORE

    def model(w, mix, loss_fn):
        h = torch.tanh(F.embedding(ids, w) @ mix)  # [b, s, d]
        return loss_fn(h, w, t)

    loss = model(w, mix, lambda h, w, t: linear_cross_entropy(h, w, t, chunk_size=5))
    loss.backward()
    w64 = w.detach().double().requires_grad_()
    mix64 = mix.detach().double().requires_grad_()
    ref = model(
        w64, mix64, lambda h, w, t: F.cross_entropy(F.linear(h, w).flatten(0, 1), t.flatten())
    )
    ref.backward()
    assert rel(loss, ref) <= 1e-5
    assert rel(w.grad, w64.grad) <= 1e-5 and rel(mix.grad, mix64.grad) <= 1e-5
    # Both uses contribute: the head-only gradient alone is far from the total.
    head_only = torch.autograd.grad(
        linear_cross_entropy(torch.tanh(F.embedding(ids, w) @ mix).detach(), w, t), w
    )[0]
    assert rel(head_only, w64.grad) > 1e-2


@pytest.mark.parametrize(
    "n, one_pass, chunk",
    [
        (64, False, 16),  # n < V: the backward chunks over vocab
        (160, False, 16),  # n > V: over tokens
        (160, True, 0),  # one pass, all tokens in one chunk
        (160, True, 16),  # one pass, dweight summed over chunks in an fp32 buffer
    ],
)
def test_bf16_error_no_worse_than_plain(n, one_pass, chunk):
    h, w, b, t = make_case(n, 32, 120, bias=True, ignored=0.1, dtype=torch.bfloat16, seed=1)
    ref = reference(h, w, b, t)
    fused = loss_and_grads(linear_cross_entropy, h, w, b, t, chunk_size=chunk, one_pass=one_pass)
    plain = loss_and_grads(plain_cross_entropy, h, w, b, t)
    for name, f, p, r in zip(("loss", "dh", "dw", "db"), fused, plain, ref, strict=True):
        assert f.dtype == p.dtype
        assert rel(f, r) <= rel(p, r) + 1e-3, (name, rel(f, r), rel(p, r))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_pass_scales_by_the_incoming_gradient(dtype):
    """The one-pass backward multiplies saved gradients by grad_loss (the trainer's 1/targets),
    rounding once: no worse against fp64 than the two-op head, which folds it in."""
    h, w, b, t = make_case(48, 16, 70, bias=True, ignored=0.2, dtype=dtype, seed=2)
    scale = 0.37 / 41  # neither 1 nor a power of two
    ref = [x * scale if i else x for i, x in enumerate(reference(h, w, b, t, reduction="sum"))]

    def scaled(h, w, t, b, **kw):
        return linear_cross_entropy(h, w, t, b, reduction="sum", **kw) * scale

    one = loss_and_grads(scaled, h, w, b, t, one_pass=True)
    two = loss_and_grads(scaled, h, w, b, t, one_pass=False)
    for name, o, g, r in zip(("loss", "dh", "dw", "db"), one, two, ref, strict=True):
        if name == "loss":
            continue
        assert o.dtype == dtype
        slack = 1e-6 if dtype == torch.float32 else 1e-3
        assert rel(o, r) <= rel(g, r) + slack, (name, rel(o, r), rel(g, r))


def test_one_pass_scaling_compiled_on_cpu_equals_the_block_loop(monkeypatch):
    """In eager, a bf16 weight gradient is scaled by one Inductor-compiled pass on a CPU (the
    block loop took 4.7x as long); both round t * g once, so they agree bit for bit. Fake
    tensors (the memory estimate's) and a double backward keep the block loop."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    g = torch.tensor(0.37 / 41)
    t = torch.randn(300, 40, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    monkeypatch.setattr(fused_loss, "SCALE_BLOCK_BYTES", 4 * 333)  # blocks of 333 values
    monkeypatch.setattr(ce_chunks, "_compiled", {})
    with torch.no_grad():  # as in a backward
        looped = fused_loss._scale(t, g)  # COMPILETUNE_LCE_EAGER=1 here: the block loop
        assert fused_loss._scaled not in ce_chunks._compiled
        monkeypatch.delenv("COMPILETUNE_LCE_EAGER")
        with FakeTensorMode():  # tensors without data: never compiled code
            fake = fused_loss._scale(torch.empty(300, 40, dtype=torch.bfloat16), torch.tensor(0.5))
        assert fake.shape == t.shape and fused_loss._scaled not in ce_chunks._compiled
        compiled = fused_loss._scale(t, g)
    assert fused_loss._scaled in ce_chunks._compiled and not ce_chunks._compile_failed
    assert compiled.dtype == torch.bfloat16
    assert torch.equal(compiled, looped)
    assert torch.equal(compiled, (t.float() * g).to(torch.bfloat16))
    assert not torch.equal(compiled, t * g.to(torch.bfloat16))  # a second rounding differs
    graph = fused_loss._scale(t.clone().requires_grad_(), g)  # grad mode on: create_graph
    assert graph.grad_fn is not None and torch.equal(graph.detach(), looped)


def test_one_pass_backward_scales_as_the_block_loop(monkeypatch):
    """A whole bf16 one-pass forward and backward (bias included, mean reduction so the
    incoming gradient is 1/targets) with the compiled scaling gives the block loop's
    gradients bit for bit."""
    from compiletune import torch_internals

    monkeypatch.delenv("COMPILETUNE_LCE_EAGER")
    monkeypatch.setattr(ce_chunks, "_compiled", {})
    # 16 tokens of width 16: dh [16, 16] would specialise a 2-D graph that dW [70, 16] misses.
    h, w, b, t = make_case(16, 16, 70, bias=True, ignored=0.2, dtype=torch.bfloat16, seed=4)
    graphs = torch_internals.dynamo_graphs_compiled()
    compiled = loss_and_grads(linear_cross_entropy, h, w, b, t, one_pass=True)
    assert fused_loss._scaled in ce_chunks._compiled and not ce_chunks._compile_failed
    # Row forward, row backward, and one scaling graph for dh, dW and db.
    assert torch_internals.dynamo_graphs_compiled() - graphs == 3
    assert not compiled[2]._is_view()  # dW, as the weight's .grad: its own tensor
    monkeypatch.setattr(fused_loss, "_scale", fused_loss._scaled_by_blocks)
    looped = loss_and_grads(linear_cross_entropy, h, w, b, t, one_pass=True)
    for name, a, e in zip(("loss", "dh", "dw", "db"), compiled, looped, strict=True):
        assert torch.equal(a, e), name


def test_one_pass_only_when_it_fits(monkeypatch):
    """fp32 always (dweight accumulates in place) and a narrow dtype only where dweight needs no
    fp32 buffer (one chunk, or up to BF16_SUM_MAX_CHUNKS summed in the weight's dtype), where
    the gradients it saves are no larger than plain's log-probs."""
    vocab, d = 128256, 2048
    assert fused_loss.one_pass_chunk_tokens(vocab, d, torch.bfloat16) == 2048  # [V, d] budget
    assert fused_loss.one_pass_chunk_tokens(vocab, 512, torch.bfloat16) == 256 * 2**20 // (
        2 * vocab
    )
    assert fused_loss.grads_in_forward(2048, vocab, d, torch.bfloat16)
    assert ce_chunks.BF16_SUM_MAX_CHUNKS == 4
    assert fused_loss.grads_in_forward(4 * 2048, vocab, d, torch.bfloat16)  # bf16 sum
    assert not fused_loss.grads_in_forward(4 * 2048 + 1, vocab, d, torch.bfloat16)
    assert not fused_loss.grads_in_forward(2049, vocab, d, torch.bfloat16, accumulator="fp32")
    assert fused_loss.grads_in_forward(10**5, vocab, d, torch.bfloat16, accumulator="bf16")
    assert fused_loss.grads_in_forward(10**6, vocab, d, torch.float32)
    assert not fused_loss.grads_in_forward(500, vocab, d, torch.bfloat16, chunk_size=100)
    # few tokens: dweight [V, d] would outweigh plain's fp32 log-probs [N, V] (Llama 3 8B)
    assert not fused_loss.grads_in_forward(1024, vocab, 4096, torch.bfloat16)
    assert not fused_loss.grads_in_forward(1000, vocab, 4096, torch.float32)
    assert fused_loss.grads_in_forward(1024, vocab, 4096, torch.bfloat16, need_dweight=False)
    assert fused_loss.grads_in_forward(4096, vocab, 4096, torch.bfloat16)
    monkeypatch.setenv("COMPILETUNE_LCE_ONE_PASS", "0")
    assert not fused_loss.grads_in_forward(10, vocab, d, torch.float32)
    monkeypatch.setenv("COMPILETUNE_LCE_ONE_PASS", "yes")
    with pytest.raises(UserError, match="COMPILETUNE_LCE_ONE_PASS"):
        fused_loss.grads_in_forward(10, vocab, d, torch.float32)
    monkeypatch.setenv("COMPILETUNE_LCE_CHUNK_TOKENS", "50")  # both heads take it as it is
    assert fused_loss.one_pass_chunk_tokens(vocab, d, torch.bfloat16) == 50 == chunk_tokens(vocab)
    monkeypatch.delenv("COMPILETUNE_LCE_CHUNK_TOKENS")

    # Chosen only when autograd will use the gradients.
    monkeypatch.delenv("COMPILETUNE_LCE_ONE_PASS")
    calls = []
    for name in ("linear_cross_entropy", "linear_cross_entropy_with_grads"):
        real = getattr(torch.ops.compiletune, name)
        monkeypatch.setattr(
            torch.ops.compiletune,
            name,
            lambda *a, real=real, name=name: calls.append(name) or real(*a),
        )
    h, w, b, t = make_case(20, 8, 30)
    linear_cross_entropy(h, w, t)
    with torch.no_grad():
        linear_cross_entropy(h, w, t)
    linear_cross_entropy(h.detach(), w.detach(), t)
    linear_cross_entropy(h.bfloat16(), w.bfloat16(), t, chunk_size=4)  # 20 tokens: 5 chunks
    assert calls == [
        "linear_cross_entropy_with_grads",
        "linear_cross_entropy",
        "linear_cross_entropy",
        "linear_cross_entropy",
    ]


def test_baselines_match_fp64():
    h, w, b, t = make_case(37, 16, 50, bias=True, ignored=0.2)
    ref = reference(h, w, b, t)
    assert_close_to_reference(loss_and_grads(plain_cross_entropy, h, w, b, t), ref, 1e-5)
    assert_close_to_reference(loss_and_grads(chunked_cross_entropy, h, w, b, t), ref, 1e-5)
    assert_close_to_reference(
        loss_and_grads(chunked_cross_entropy, h, w, b, t, chunks=5, reduction="sum"),
        reference(h, w, b, t, reduction="sum"),
        1e-5,
    )


def test_lse_output_and_its_gradient():
    h, w, b, t = make_case(30, 8, 25, bias=True, ignored=0.3)
    loss, lse = torch.ops.compiletune.linear_cross_entropy(h, w, b, t, IGNORE, "sum", 7, 0.0, 0.0)
    valid = t != IGNORE
    x64 = F.linear(h.double(), w.double(), b.double())
    assert rel(lse[valid], torch.logsumexp(x64, -1)[valid]) <= 1e-6
    assert (lse[~valid] == 0).all()
    (loss + 0.3 * lse.sum()).backward()
    h64, w64 = h.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    x64 = F.linear(h64, w64, b.detach().double())
    lse64 = torch.logsumexp(x64, -1)
    tl64 = x64.gather(1, torch.where(valid, t, 0)[:, None]).squeeze(1)
    (torch.where(valid, lse64 - tl64 + 0.3 * lse64, 0.0).sum()).backward()
    assert rel(h.grad, h64.grad) <= 1e-5 and rel(w.grad, w64.grad) <= 1e-5


@pytest.mark.parametrize("one_pass", [False, True])
def test_only_needed_gradients(one_pass, monkeypatch):
    h, w, b, t = make_case(20, 8, 30, bias=True, ignored=0.2)
    ref = reference(h, w, b, t)
    w.requires_grad_(False)  # a frozen head (LoRA): no dweight matmul
    b.requires_grad_(False)
    force_loop(monkeypatch, "one_pass" if one_pass else "tokens")
    linear_cross_entropy(h, w, t, b, chunk_size=6).backward()
    assert w.grad is None and b.grad is None and rel(h.grad, ref[1]) <= 1e-5
    h.grad = None
    h.requires_grad_(False)
    w.requires_grad_(True)
    for loop in ("one_pass",) if one_pass else ("tokens", "vocab"):
        force_loop(monkeypatch, loop)
        w.grad = None
        linear_cross_entropy(h, w, t, b, chunk_size=6).backward()
        assert h.grad is None and rel(w.grad, ref[2]) <= 1e-5


def test_wrapper_flattens_leading_dims():
    h, w, b, t = make_case(24, 8, 30, ignored=0.2)
    h3, t3 = h.detach().reshape(2, 12, 8), t.reshape(2, 12)
    loss = linear_cross_entropy(h3, w, t3, chunk_size=5)
    assert rel(loss, reference(h, w, b, t)[0]) <= 1e-5


def test_opcheck():
    for bias in (False, True):
        h, w, b, t = make_case(19, 8, 30, bias=bias, ignored=0.2)
        for args in [
            (h, w, b, t, IGNORE, "mean", 6, 0.0, 0.0),
            (h.detach(), w.detach(), b, t, IGNORE, "sum", 0, 1e-3, 2.0),
        ]:
            torch.library.opcheck(torch.ops.compiletune.linear_cross_entropy.default, args)
            torch.library.opcheck(
                torch.ops.compiletune.linear_cross_entropy_with_grads.default,
                (*args, args[0].requires_grad, args[1].requires_grad),
            )
    n = 19
    bwd_args = (
        torch.tensor(1.5),
        torch.randn(n),
        h.detach(),
        w.detach(),
        b.detach(),
        t,
        torch.randn(n),
    )
    torch.library.opcheck(
        torch.ops.compiletune.linear_cross_entropy_backward.default,
        (*bwd_args, IGNORE, "mean", 6, 0.0, 0.0, True, True),
    )


def test_saved_for_backward_is_inputs_and_lse(monkeypatch):
    force_loop(monkeypatch, "tokens")
    n, d, vocab = 64, 16, 300
    h, w, b, t = make_case(n, d, vocab, bias=True, ignored=0.1)
    saved = []

    def pack(x):
        saved.append(x)
        return x

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        loss = linear_cross_entropy(h, w, t, b, chunk_size=8)
    nbytes = sum(x.numel() * x.element_size() for x in saved)
    expected = sum(x.numel() * x.element_size() for x in (h, w, b, t)) + n * 4  # + lse fp32 [N]
    assert nbytes == expected, [tuple(x.shape) for x in saved]
    assert max(x.numel() for x in saved) < n * vocab
    loss.backward()  # and they are enough
    assert_close_to_reference((loss, h.grad, w.grad, b.grad), reference(h, w, b, t), 1e-5)


def test_one_pass_saves_only_the_gradients(monkeypatch):
    force_loop(monkeypatch, "one_pass")
    n, d, vocab = 64, 16, 300
    h, w, b, t = make_case(n, d, vocab, bias=True, ignored=0.1)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda x: saved.append(x) or x, lambda x: x):
        loss = linear_cross_entropy(h, w, t, b, chunk_size=8)
    assert sorted(tuple(x.shape) for x in saved) == [(n, d), (vocab,), (vocab, d)]
    loss.backward()
    assert_close_to_reference((loss, h.grad, w.grad, b.grad), reference(h, w, b, t), 1e-5)


def capture_aot_graphs():
    """An aot_eager-like backend that records the forward and backward graphs it sees."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.aot_autograd import make_boxed_func

    graphs = {}

    def keep(name):
        def compiler(gm, example_inputs):
            graphs[name] = gm
            return make_boxed_func(gm.forward)

        return compiler

    return aot_autograd(fw_compiler=keep("fw"), bw_compiler=keep("bw")), graphs


def count_targets(gm, target) -> int:
    return sum(1 for node in gm.graph.nodes if node.target == target)


@pytest.mark.parametrize("one_pass", [False, True])
def test_one_node_under_compile(one_pass, monkeypatch):
    force_loop(monkeypatch, "one_pass" if one_pass else "tokens")
    torch._dynamo.reset()
    n, d, vocab = 40, 16, 64
    h, w, b, t = make_case(n, d, vocab, bias=True, ignored=0.2)
    eager = loss_and_grads(linear_cross_entropy, h, w, b, t, chunk_size=8)
    backend, graphs = capture_aot_graphs()
    fn = torch.compile(
        lambda h, w, t, b: linear_cross_entropy(h, w, t, b, chunk_size=8),
        backend=backend,
        fullgraph=True,
    )
    compiled = loss_and_grads(fn, h, w, b, t)
    for a, e in zip(compiled, eager, strict=True):
        assert rel(a, e) <= 1e-6
    ops = torch.ops.compiletune
    if one_pass:  # the forward is one node; the backward only scales, no matmul
        assert count_targets(graphs["fw"], ops.linear_cross_entropy_with_grads.default) == 1
        assert count_targets(graphs["bw"], torch.ops.aten.mm.default) == 0
        assert not any("compiletune" in str(node.target) for node in graphs["bw"].graph.nodes)
    else:
        assert count_targets(graphs["fw"], ops.linear_cross_entropy.default) == 1
        assert count_targets(graphs["bw"], ops.linear_cross_entropy_backward.default) == 1
    assert count_targets(graphs["fw"], torch.ops.aten.mm.default) == 0
    # What the forward hands to the backward: no [N, V] tensor among it.
    (fw_out,) = [node for node in graphs["fw"].graph.nodes if node.op == "output"]
    shapes = [x.meta["val"].shape for x in fw_out.args[0] if isinstance(x, torch.fx.Node)]
    assert all(s.numel() < n * vocab for s in shapes), shapes


@pytest.mark.slow
def test_inductor_matches_eager():
    torch._dynamo.reset()
    h, w, b, t = make_case(40, 16, 64, bias=True, ignored=0.2)
    eager = loss_and_grads(linear_cross_entropy, h, w, b, t, chunk_size=8, z_loss=1e-3)
    fn = torch.compile(
        lambda h, w, t, b: linear_cross_entropy(h, w, t, b, chunk_size=8, z_loss=1e-3),
        fullgraph=True,
    )
    for a, e in zip(loss_and_grads(fn, h, w, b, t), eager, strict=True):
        assert rel(a, e) <= 1e-6


def test_nested_compile_path(monkeypatch):
    """The default CPU path: the row-wise functions run through torch.compile (Inductor)."""
    monkeypatch.delenv("COMPILETUNE_LCE_EAGER")
    monkeypatch.setattr(ce_chunks, "_compiled", {})
    h, w, b, t = make_case(37, 16, 50, bias=True, ignored=0.2)
    got = loss_and_grads(linear_cross_entropy, h, w, b, t, chunk_size=8, softcap=3.0)
    assert not ce_chunks._compile_failed
    assert set(ce_chunks._compiled) == {ce_chunks._rows_forward, ce_chunks._rows_backward_}
    assert_close_to_reference(got, reference(h, w, b, t, softcap=3.0), 1e-5)


def test_chunk_tokens(monkeypatch):
    assert chunk_tokens(128256) == 256 * 2**20 // (4 * 128256)  # 523 tokens of fp32 logits
    assert chunk_tokens(128256, budget_bytes=2**20) == ce_chunks.MIN_CHUNK_TOKENS
    assert chunk_tokens(10) == fused_loss.MAX_CHUNK_TOKENS
    assert chunk_tokens(128256, chunk_size=100) == 100
    monkeypatch.setenv("COMPILETUNE_LCE_CHUNK_TOKENS", "777")
    assert chunk_tokens(128256) == 777 and chunk_tokens(128256, chunk_size=5) == 5
    monkeypatch.setenv("COMPILETUNE_LCE_CHUNK_TOKENS", "lots")
    with pytest.raises(UserError, match="COMPILETUNE_LCE_CHUNK_TOKENS"):
        chunk_tokens(128256)


def test_bad_inputs():
    h, w, b, t = make_case(10, 8, 20)
    for one_pass in (False, True):
        with pytest.raises(UserError, match=r"\[0, 20\)"):
            linear_cross_entropy(h, w, torch.full((10,), 20), one_pass=one_pass)
    with pytest.raises(ValueError, match="token dimensions"):
        linear_cross_entropy(h, w, t[:5])
    with pytest.raises(ValueError, match="weight"):
        linear_cross_entropy(h, w[:, :4], t)
    with pytest.raises(ValueError, match="reduction"):
        linear_cross_entropy(h, w, t, reduction="none")
    with pytest.raises(ValueError, match="dtype"):
        linear_cross_entropy(h, w.double(), t)


# ---------------------------------------------------------------------------------------------
# Triton: the interpreter on CPU (in a subprocess, since TRITON_INTERPRET must be set before
# triton is first imported), the real kernels on a GPU.


def _interpreter_checks() -> None:
    """Run under TRITON_INTERPRET=1: the kernels alone, then the whole op through them."""
    from compiletune.ops import triton_ce

    torch.manual_seed(0)
    for dtype in (torch.float32, torch.float16):
        for softcap in (0.0, 3.0):
            x = (3 * torch.randn(5, 37)).to(dtype)  # 37 columns in blocks of 8: a ragged tail
            t = torch.randint(0, 37, (5,))
            lse, loss = triton_ce.lse_and_loss(x, t, 1e-2, softcap, block=8)
            x64 = x.double()
            if softcap:
                x64 = softcap * torch.tanh(x64 / softcap)
            lse64 = torch.logsumexp(x64, -1)
            loss64 = lse64 - x64.gather(1, t[:, None]).squeeze(1) + 1e-2 * lse64**2
            assert rel(lse, lse64) <= 1e-6 and rel(loss, loss64) <= 1e-6, (dtype, softcap)

            cols = x[:, 10:30].contiguous()  # a slice of the vocabulary, as the backward sees it
            coef_p, coef_t = torch.rand(5), torch.rand(5)
            d = triton_ce.dlogits_(cols.clone(), lse, t, coef_p, coef_t, 10, softcap, block=8)
            c64 = cols.double().requires_grad_()
            y = softcap * torch.tanh(c64 / softcap) if softcap else c64
            onehot = (torch.arange(10, 30)[None] == t[:, None]).double()
            dy = coef_p.double()[:, None] * torch.exp(y - lse.double()[:, None])
            dy = dy - coef_t.double()[:, None] * onehot
            d64 = torch.autograd.grad(y, c64, dy)[0]
            tol = 1e-6 if dtype == torch.float32 else 1e-3
            assert d.dtype == dtype and rel(d, d64) <= tol, (dtype, softcap, rel(d, d64))

    ce_chunks._FORCE_TRITON = True
    for loop in PATHS:
        fused_loss._chunk_vocab = lambda *args, loop=loop: loop == "vocab"
        os.environ["COMPILETUNE_LCE_ONE_PASS"] = "1" if loop == "one_pass" else "0"
        # ROW_ALIGN 4: the ~17 counted of 21 rows gathered and padded with ignored ones (64:
        # all 21 rows in place).
        for align in (64, 4):
            ce_chunks.ROW_ALIGN = align
            for kw in (dict(), dict(z_loss=1e-2, softcap=2.0, reduction="sum")):
                h, w, b, t = make_case(21, 8, 37, bias=True, ignored=0.2)
                got = loss_and_grads(linear_cross_entropy, h, w, b, t, chunk_size=6, **kw)
                assert_close_to_reference(got, reference(h, w, b, t, **kw), 1e-5)
        ce_chunks.ROW_ALIGN = 64
    h, w, b, t = make_case(21, 8, 37, bias=True, ignored=0.2, dtype=torch.float16)
    ref = reference(h, w, b, t)
    plain = loss_and_grads(plain_cross_entropy, h, w, b, t)
    for one_pass in (False, True):
        fused = loss_and_grads(linear_cross_entropy, h, w, b, t, chunk_size=6, one_pass=one_pass)
        for f, p, r in zip(fused, plain, ref, strict=True):
            assert rel(f, r) <= rel(p, r) + 1e-3
    print("interpreter checks passed")


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
def test_triton_kernels_in_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1", "COMPILETUNE_LCE_EAGER": "1"}
    out = subprocess.run(
        [sys.executable, __file__, "--triton-interpret"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "interpreter checks passed" in out.stdout


@pytest.mark.cuda
@pytest.mark.skipif(not (HAS_CUDA and HAS_TRITON), reason="needs a CUDA GPU and triton")
@pytest.mark.parametrize("loop", PATHS)
def test_cuda_fp32_matches_fp64(loop, monkeypatch):
    force_loop(monkeypatch, loop)
    for kw in (dict(), dict(z_loss=1e-3, softcap=30.0, reduction="sum")):
        h, w, b, t = make_case(300, 64, 1000, bias=True, ignored=0.2, device="cuda")
        got = loss_and_grads(linear_cross_entropy, h, w, b, t, chunk_size=64, **kw)
        assert_close_to_reference(got, reference(h, w, b, t, **kw), 1e-5)


@pytest.mark.cuda
@pytest.mark.skipif(not (HAS_CUDA and HAS_TRITON), reason="needs a CUDA GPU and triton")
@pytest.mark.parametrize("one_pass", [False, True])
def test_cuda_bf16_no_worse_than_plain(one_pass):
    h, w, b, t = make_case(1024, 256, 5000, ignored=0.1, dtype=torch.bfloat16, device="cuda")
    ref = reference(h, w, b, t)
    fused = loss_and_grads(linear_cross_entropy, h, w, b, t, one_pass=one_pass)
    plain = loss_and_grads(plain_cross_entropy, h, w, b, t)
    for f, p, r in zip(fused, plain, ref, strict=True):
        if r is not None:
            assert rel(f, r) <= rel(p, r) + 1e-3


@pytest.mark.cuda
@pytest.mark.skipif(not (HAS_CUDA and HAS_TRITON), reason="needs a CUDA GPU and triton")
def test_cuda_peak_memory_below_plain():
    h, w, b, t = make_case(4096, 256, 32000, dtype=torch.bfloat16, device="cuda")
    peaks = {}
    for name, fn in (
        ("fused", lambda *a: linear_cross_entropy(*a, one_pass=False)),
        ("one_pass", lambda *a: linear_cross_entropy(*a, one_pass=True)),  # one 4096-token chunk
        ("plain", plain_cross_entropy),
    ):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        loss_and_grads(fn, h, w, b, t)
        torch.cuda.synchronize()
        peaks[name] = torch.cuda.max_memory_allocated() - base
    assert peaks["fused"] < 0.25 * peaks["plain"], peaks
    assert peaks["one_pass"] < 0.5 * peaks["plain"], peaks


if __name__ == "__main__" and "--triton-interpret" in sys.argv:
    assert os.environ.get("TRITON_INTERPRET") == "1"
    _interpreter_checks()
