"""How the one-pass fused head sums a bf16 weight gradient over token chunks: in fp32, or in
bf16 itself (`ce_chunks.narrow_weight_sum`), against a float64 reference on CPU.

The yardstick is one rounding: r1 = the relative error of the fp64 gradient rounded once to bf16.
A head run in one chunk has some error e1 (its bf16 logits and gradients, then one rounding of
dW); summed over k chunks it has e_k. What the sum adds, sqrt(e_k**2 - e1**2), counted in
roundings (/ r1), is the quantity the `auto` rule is built on:

    bf16 sum, the product added inside the matmul    sqrt((k - 1) / 2) roundings
    bf16 sum of products rounded first (naive)        sqrt((k + 1) / 2): one rounding more
    fp32 sum (on CPU of bf16 products)                about 1 rounding, whatever k

The bound is 15% above the first line; the naive sum, run here too, must exceed it.
Sizes are tiny (bf16 matmuls on CPUs without native bf16 are slow).
"""

import importlib.util
import math

import pytest
import torch
import torch.nn.functional as F

from compiletune.errors import UserError
from compiletune.ops import ce_chunks, fused_loss
from compiletune.ops.fused_loss import linear_cross_entropy, plain_cross_entropy
from compiletune.ops.op_memory import internal_bytes

N, D, V = 1024, 32, 512  # dW [V, d] has 16k entries: enough for the error norms to settle
MARGIN = 1.15
CUDA = torch.cuda.is_available() and importlib.util.find_spec("triton") is not None


@pytest.fixture(autouse=True)
def eager_chunks(monkeypatch):
    monkeypatch.setenv("COMPILETUNE_LCE_EAGER", "1")
    for name in ("COMPILETUNE_LCE_CHUNK_TOKENS", "COMPILETUNE_LCE_ONE_PASS"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.delenv("COMPILETUNE_LCE_ACCUMULATOR", raising=False)


@pytest.fixture(scope="module")
def case():
    """bf16 h [N, d], weight [V, d], bias [V], targets [N] (10% ignored) and the float64
    reference (loss, dh, dw, db) computed from those bf16 values."""
    g = torch.Generator().manual_seed(0)
    h = torch.randn(N, D, generator=g).bfloat16()
    w = (torch.randn(V, D, generator=g) / D**0.5).bfloat16()
    b = torch.randn(V, generator=g).bfloat16()
    t = torch.randint(0, V, (N,), generator=g)
    t[torch.rand(N, generator=g) < 0.1] = -100
    h64, w64, b64 = (x.double().requires_grad_() for x in (h, w, b))
    loss = F.cross_entropy(F.linear(h64, w64, b64), t, ignore_index=-100)
    loss.backward()
    ref = (loss.detach(), h64.grad, w64.grad, b64.grad)
    return (h, w, b, t), ref


def run(inputs, k: int = 1, fn=linear_cross_entropy, **kw):
    """(loss, dh, dw, db) of `fn` over k chunks of tokens (one-pass head for the fused fn)."""
    h, w, b, t = (x.detach().requires_grad_() if x.is_floating_point() else x for x in inputs)
    if fn is linear_cross_entropy:
        kw = {"chunk_size": -(-N // k), "one_pass": True, **kw}
    fn(h, w, t, b, **kw).backward()
    return fn(h.detach(), w.detach(), t, b.detach(), **kw).detach(), h.grad, w.grad, b.grad


def rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    assert torch.isfinite(a).all()
    return ((a.double().cpu() - ref).norm() / ref.norm()).item()


def added_roundings(dw: torch.Tensor, dw_one_chunk: torch.Tensor, ref_dw: torch.Tensor) -> float:
    """What summing over chunks added to dW's error, in roundings of the exact gradient."""
    r1 = rel(ref_dw.bfloat16(), ref_dw)
    return math.sqrt(max(rel(dw, ref_dw) ** 2 - rel(dw_one_chunk, ref_dw) ** 2, 0.0)) / r1


def naive_sum(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    acc.add_(a @ b)  # the product rounded to bf16, then added and rounded again


def check_bf16_sum(inputs, ref, k: int, monkeypatch) -> None:
    one = run(inputs, 1, accumulator="bf16")[2]
    bound = MARGIN * math.sqrt((k - 1) / 2)
    ours = added_roundings(run(inputs, k, accumulator="bf16")[2], one, ref[2])
    assert ours <= bound, (ours, bound)
    monkeypatch.setattr(fused_loss, "accumulate_mm", naive_sum)
    naive = added_roundings(run(inputs, k, accumulator="bf16")[2], one, ref[2])
    assert naive > bound, (naive, bound)


@pytest.mark.parametrize("k", [2, 4])
def test_bf16_sum_adds_the_stated_error_and_the_naive_sum_more(case, k, monkeypatch):
    check_bf16_sum(*case, k, monkeypatch)


def check_fp32_sum(inputs, ref, k: int) -> None:
    one = run(inputs, 1, accumulator="fp32")[2]
    added = added_roundings(run(inputs, k, accumulator="fp32")[2], one, ref[2])
    assert added <= MARGIN, added
    # the bf16 sum over 8 chunks adds sqrt(3.5) roundings: why auto stops at 4
    if k == 8:
        assert added_roundings(run(inputs, k, accumulator="bf16")[2], one, ref[2]) > 1.5


@pytest.mark.parametrize("k", [2, 8])
def test_fp32_sum_error_does_not_grow_with_chunks(case, k):
    check_fp32_sum(*case, k)


# On a GPU the sums are cuBLAS's: the bf16 one in addmm's epilogue, the fp32 one through
# addmm(out_dtype=fp32) (no rounded product). Run by bench/gpu_check.py's first-gpu-tests.
@pytest.mark.cuda
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU and triton")
@pytest.mark.parametrize("k", [2, 4])
def test_cuda_weight_sum_bf16(case, k, monkeypatch):
    inputs, ref = case
    check_bf16_sum([x.cuda() for x in inputs], ref, k, monkeypatch)


@pytest.mark.cuda
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU and triton")
@pytest.mark.parametrize("k", [2, 8])
def test_cuda_weight_sum_fp32(case, k):
    inputs, ref = case
    check_fp32_sum([x.cuda() for x in inputs], ref, k)


@pytest.mark.parametrize("k", [1, 2, 4, 8])
def test_auto_keeps_the_bf16_contract(case, k):
    """auto (bf16 sum up to BF16_SUM_MAX_CHUNKS chunks, fp32 beyond): loss, dh, dW and db no
    worse against fp64 than the plain bf16 head plus 1e-3 (the numerics contract)."""
    inputs, ref = case
    fused, plain = run(inputs, k), run(inputs, fn=plain_cross_entropy)
    for name, f, p, r in zip(("loss", "dh", "dw", "db"), fused, plain, ref, strict=True):
        assert f.dtype == p.dtype
        assert rel(f, r) <= rel(p, r) + 1e-3, (name, rel(f, r), rel(p, r))


def test_the_accumulator_changes_only_dweight(case):
    inputs, _ = case
    f32, b16 = run(inputs, 4, accumulator="fp32"), run(inputs, 4, accumulator="bf16")
    for i, name in ((0, "loss"), (1, "dh"), (3, "db")):
        assert torch.equal(f32[i], b16[i]), name
    assert not torch.equal(f32[2], b16[2])


def test_auto_rule_and_choice(monkeypatch):
    bf16 = torch.bfloat16
    assert ce_chunks.narrow_weight_sum(ce_chunks.BF16_SUM_MAX_CHUNKS, bf16)
    assert not ce_chunks.narrow_weight_sum(ce_chunks.BF16_SUM_MAX_CHUNKS + 1, bf16)
    assert ce_chunks.narrow_weight_sum(1, bf16, "fp32")  # one chunk: nothing to sum
    assert ce_chunks.narrow_weight_sum(100, torch.float32, "fp32")  # fp32 sums in place
    assert ce_chunks.narrow_weight_sum(100, bf16, "bf16")
    assert not ce_chunks.narrow_weight_sum(2, bf16, "fp32")
    monkeypatch.setenv("COMPILETUNE_LCE_ACCUMULATOR", "bf16")
    assert ce_chunks.narrow_weight_sum(100, bf16)
    monkeypatch.setenv("COMPILETUNE_LCE_ACCUMULATOR", "bfloat16")
    with pytest.raises(UserError, match="COMPILETUNE_LCE_ACCUMULATOR='bfloat16' must be one of"):
        ce_chunks.narrow_weight_sum(2, bf16)
    with pytest.raises(UserError, match="accumulator='fp64' must be one of auto, fp32, bf16"):
        linear_cross_entropy(torch.randn(4, 8), torch.randn(5, 8), torch.zeros(4).long(), None,
                             accumulator="fp64")  # fmt: skip


def test_memory_declaration_follows_the_accumulator():
    """The estimator reads the op's declaration: the fp32 sum adds its [V, d] fp32 buffer and
    one bf16 product per chunk; the bf16 sum accumulates in the output (a chunk of logits)."""
    op = torch.ops.compiletune.linear_cross_entropy_with_grads.default
    h, w = torch.empty(4096, 64, dtype=torch.bfloat16), torch.empty(1000, 64, dtype=torch.bfloat16)
    t = torch.empty(4096, dtype=torch.long)
    args = (h, w, None, t, -100, "sum", 1024, 0.0, 0.0, True, True)
    chunk = 1024 * 1000 * 2
    assert internal_bytes(op, (*args, "bf16"), {}) == chunk
    assert internal_bytes(op, (*args, "fp32"), {}) == chunk + 1000 * 64 * (4 + 2)
    assert internal_bytes(op, args, {}) == chunk  # auto: 4 chunks sum in bf16
