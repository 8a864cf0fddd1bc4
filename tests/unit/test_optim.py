"""Optimizer: in-backward equals the ordinary step, state round-trips, 8-bit and bf16 numerics."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import math
import warnings
from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from gloo import free_port, run_in_gloo
from torch.overrides import TorchFunctionMode

from compiletune.config import resolve
from compiletune.data.rows import Batches, load_examples, pack
from compiletune.data.tokenizer import byte_tokenizer
from compiletune.errors import UserError
from compiletune.loss.head import IGNORE_INDEX, LossHead
from compiletune.models import ModelArgs, Transformer, build_model, from_name
from compiletune.optim import (
    BLOCK,
    Optimizer,
    adamw8bit_update_,
    adamw_update_,
    check_optimizer_flags,
    dequantize_exp_avg,
    dequantize_exp_avg_sq,
    quantize_exp_avg,
    quantize_exp_avg_sq,
)

CPU = torch.device("cpu")


def tiny_args(**overrides) -> ModelArgs:
    args = ModelArgs(
        dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=96, ffn_dim=128, rope_theta=10000.0
    )
    return dataclasses.replace(args, **overrides)


def random_batches(n: int, vocab: int, seed: int = 1) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (2, 17), generator=g) for _ in range(n)]


def lm_loss(model: Transformer, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens[:, :-1])  # [b, s-1, v]
    return F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())


def train_steps(
    model: Transformer, opt: Optimizer, batches: list[torch.Tensor], lrs: list[float]
) -> None:
    """The trainer's order: set_lr -> backward -> step -> zero_grad."""
    for tokens, lr in zip(batches, lrs, strict=True):
        opt.set_lr(lr)
        lm_loss(model, tokens).backward()
        opt.step()
        opt.zero_grad()


def make_opt(model: Transformer, **kw) -> Optimizer:
    kw.setdefault("lr", 1e-3)
    return Optimizer(model.named_parameters(), device=CPU, compile_step=False, **kw)


def assert_params_equal(a: Transformer, b: Transformer) -> None:
    for (name, x), y in zip(a.named_parameters(), b.parameters(), strict=True):
        assert torch.equal(x, y), f"{name} differs by {(x.float() - y.float()).abs().max():.3g}"


# ----------------------------------------------------------------------------- flags


def test_check_optimizer_flags() -> None:
    check_optimizer_flags("adamw", False, 4, 1.0, "none")
    check_optimizer_flags("adamw8bit", True, 1, 0.0, "kahan")
    with pytest.raises(UserError, match="--optimizer sgd.*adamw, adamw8bit"):
        check_optimizer_flags("sgd", False, 1, 1.0, "none")
    with pytest.raises(UserError, match="--grad-accum 1"):
        check_optimizer_flags("adamw", True, 4, 0.0, "none")
    with pytest.raises(UserError, match="pass --max-grad-norm 0"):
        check_optimizer_flags("adamw", True, 1, 1.0, "none")
    with pytest.raises(UserError, match="--bf16-compensation round"):
        check_optimizer_flags("adamw", False, 1, 1.0, "round")


# ----------------------------------------------------------------------------- in backward


@pytest.mark.parametrize("kind", ["adamw", "adamw8bit"])
@pytest.mark.parametrize("tied", [False, True])
def test_in_backward_equals_step_exactly(kind: str, tied: bool) -> None:
    args = tiny_args(tie_embeddings=tied)
    batches = random_batches(4, args.vocab_size)
    lrs = [1e-3, 3e-3, 2e-3, 5e-4]  # a changing lr must reach every per-parameter step

    ref = build_model(args, seed=0)
    train_steps(ref, make_opt(ref, kind=kind, weight_decay=0.1), batches, lrs)

    model = build_model(args, seed=0)
    alive: list[int] = []
    params = list(model.parameters())
    for p in params:
        # Registered before the optimizer's hook, so it sees the moment each gradient lands:
        # the count of gradients held then is the most that ever coexist.
        p.register_post_accumulate_grad_hook(
            lambda _: alive.append(sum(q.grad is not None for q in params))
        )
    opt = make_opt(model, kind=kind, weight_decay=0.1, in_backward=True)
    assert opt.in_backward
    for tokens, lr in zip(batches, lrs, strict=True):
        opt.set_lr(lr)
        lm_loss(model, tokens).backward()
        assert all(p.grad is None for p in params)
        opt.step()
        opt.zero_grad()
    assert max(alive) == 1, f"up to {max(alive)} gradients were alive at once"
    assert len(alive) == len(batches) * len(params)  # every parameter stepped every time
    assert_params_equal(model, ref)


# ----------------------------------------------------------------------------- state


@pytest.mark.parametrize(
    ("kind", "in_backward", "dtype", "compensation"),
    [
        ("adamw", False, torch.float32, "none"),
        ("adamw", True, torch.float32, "none"),
        ("adamw8bit", False, torch.float32, "none"),
        ("adamw8bit", True, torch.float32, "none"),
        ("adamw", True, torch.bfloat16, "stochastic"),
        ("adamw8bit", False, torch.bfloat16, "kahan"),
    ],
)
def test_state_dict_round_trip(
    kind: str, in_backward: bool, dtype: torch.dtype, compensation: str
) -> None:
    args = tiny_args()
    batches = random_batches(6, args.vocab_size)
    lrs = [1e-3 * (i + 1) for i in range(6)]
    kw = dict(kind=kind, in_backward=in_backward, bf16_compensation=compensation, weight_decay=0.1)

    ref = build_model(args, dtype=dtype, seed=0)
    train_steps(ref, make_opt(ref, **kw), batches, lrs)

    first = build_model(args, dtype=dtype, seed=0)
    opt = make_opt(first, **kw)
    train_steps(first, opt, batches[:3], lrs[:3])
    buf = io.BytesIO()
    torch.save({"model": first.state_dict(), "optimizer": opt.state_dict()}, buf)
    opt.remove_hooks()
    del first, opt

    buf.seek(0)
    saved = torch.load(buf, weights_only=True)
    resumed = build_model(args, dtype=dtype, seed=123)  # other weights, overwritten by the load
    resumed.load_state_dict(saved["model"])
    opt = make_opt(resumed, **kw)
    opt.load_state_dict(saved["optimizer"])
    train_steps(resumed, opt, batches[3:], lrs[3:])
    assert_params_equal(resumed, ref)


def test_state_resumes_across_modes() -> None:
    """A run saved with the ordinary step continues exactly with in-backward (and back)."""
    args = tiny_args()
    batches = random_batches(4, args.vocab_size)
    ref = build_model(args, seed=0)
    train_steps(ref, make_opt(ref), batches, [1e-3] * 4)
    model = build_model(args, seed=0)
    opt = make_opt(model)
    train_steps(model, opt, batches[:2], [1e-3] * 2)
    opt2 = make_opt(model, in_backward=True)
    opt2.load_state_dict(opt.state_dict())
    train_steps(model, opt2, batches[2:], [1e-3] * 2)
    assert_params_equal(model, ref)


def test_load_state_dict_rejects_mismatch() -> None:
    model = build_model(tiny_args(), seed=0)
    sd = make_opt(model, kind="adamw8bit").state_dict()
    with pytest.raises(UserError, match="--optimizer adamw8bit"):
        make_opt(model, kind="adamw").load_state_dict(sd)
    other = build_model(tiny_args(dim=32, n_heads=2, n_kv_heads=1), seed=0)
    with pytest.raises(UserError, match="same model"):
        make_opt(other, kind="adamw8bit").load_state_dict(sd)


def test_state_bytes_per_param() -> None:
    model = build_model(from_name("debug"), seed=0)
    n = sum(p.numel() for p in model.parameters())
    n_params = len(list(model.parameters()))
    scalars = 4 * n_params  # one fp32 step count per parameter
    assert make_opt(model).state_bytes() == 8 * n + scalars
    per_param = (make_opt(model, kind="adamw8bit").state_bytes() - scalars) / n
    # 2 bytes of codes + 2 fp32 scales per 256 values (+ padding of the last block)
    assert 2 + 8 / BLOCK <= per_param < 2 + 8 / BLOCK + 0.01, per_param
    bf16 = build_model(from_name("debug"), dtype=torch.bfloat16, seed=0)
    assert make_opt(bf16).state_bytes() == 4 * n + scalars
    assert make_opt(bf16, bf16_compensation="kahan").state_bytes() == 6 * n + scalars


# ----------------------------------------------------------------------------- numerics


def test_own_adamw_matches_torch() -> None:
    """The compiled/eager step our 8-bit and compensated paths share the math of equals torch's."""
    g = torch.Generator().manual_seed(0)
    p0 = torch.randn(1000, generator=g)
    ref = torch.nn.Parameter(p0.clone())
    torch_opt = torch.optim.AdamW([ref], lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
    p, m, v = p0.clone(), torch.zeros(1000), torch.zeros(1000)
    step, lr = torch.zeros(()), torch.tensor(1e-2)
    for _ in range(5):
        grad = torch.randn(1000, generator=g)
        ref.grad = grad.clone()
        torch_opt.step()
        step += 1
        adamw_update_(p, grad, m, v, step, lr, None, None, 0.9, 0.95, 1e-8, 0.1)
    torch.testing.assert_close(p, ref.detach(), rtol=1e-6, atol=1e-7)


def test_quantization_keeps_small_moments() -> None:
    """Companded codes: relative error of m and sqrt(v) stays small far below the block max."""
    g = torch.Generator().manual_seed(0)
    # Magnitudes spread over 4 decades within each block, as Adam moments are.
    mag = 10 ** (-4 * torch.rand(64, BLOCK, generator=g))
    sign = torch.randint(0, 2, (64, BLOCK), generator=g) * 2 - 1
    m = mag * sign
    m_hat = dequantize_exp_avg(*quantize_exp_avg(m))
    big = mag > 1e-2
    assert ((m_hat - m).abs() / mag)[big].max() < 0.08
    assert (m_hat != 0)[mag > 1e-4].all()
    v = mag**2
    v_hat = dequantize_exp_avg_sq(*quantize_exp_avg_sq(v))
    assert ((v_hat.sqrt() - mag).abs() / mag)[big].max() < 0.08
    assert (v_hat != 0)[mag > 1e-4].all()


def test_quantization_of_zero_and_subnormal_blocks() -> None:
    """A block of zeros encodes to zero codes (its scale floors at the smallest normal, no
    NaN); a block whose values are all subnormal (~1e-39: a moment decayed for hundreds of
    steps without gradient) decodes within its code step, with its sign."""
    pairs = ((quantize_exp_avg, dequantize_exp_avg), (quantize_exp_avg_sq, dequantize_exp_avg_sq))
    for q, dq in pairs:
        codes, scales = q(torch.zeros(2, BLOCK))
        assert (codes == 0).all() and torch.isfinite(scales).all()
        assert torch.equal(dq(codes, scales), torch.zeros(2, BLOCK))
    tiny = torch.linspace(0.5, 1.0, BLOCK)[None] * 1e-39  # subnormal in fp32
    for sign in (1, -1):
        m_hat = dequantize_exp_avg(*quantize_exp_avg(sign * tiny))
        assert ((m_hat - sign * tiny).abs() / tiny).max() < 0.08
    s_hat = dequantize_exp_avg_sq(*quantize_exp_avg_sq(tiny)).sqrt()  # v itself subnormal
    assert ((s_hat - tiny.sqrt()).abs() / tiny.sqrt()).max() < 0.08


def test_bf16_compensation_tracks_fp32() -> None:
    """At an lr whose updates are under half a bf16 ulp of most weights, plain bf16 loses most
    of each update; with Kahan or stochastic rounding the weights follow the fp32 run.

    progress: the bf16 run's displacement projected on the fp32 run's, over the latter's
    length (1 = all of the fp32 move happened). distance: |bf16 - fp32| / |fp32 - init|.
    Stochastic rounding is unbiased but leaves every weight up to an ulp off, so its distance
    over a few steps at a tiny lr is no better than plain bf16; its progress is.
    """
    args = tiny_args(n_layers=1)
    batches = random_batches(30, args.vocab_size)
    lrs = [2e-5] * len(batches)
    bf16_init = build_model(args, dtype=torch.bfloat16, seed=0)
    init = [p.detach().float() for p in bf16_init.parameters()]

    ref = build_model(args, seed=0)
    with torch.no_grad():
        for p, p0 in zip(ref.parameters(), init, strict=True):
            p.copy_(p0)  # the same, bf16-representable, start
    train_steps(ref, make_opt(ref), batches, lrs)
    ref_move = [p.detach() - p0 for p, p0 in zip(ref.parameters(), init, strict=True)]
    moved_sq = sum((d * d).sum().item() for d in ref_move)

    progress, distance = {}, {}
    for compensation in ("none", "kahan", "stochastic"):
        model = build_model(args, dtype=torch.bfloat16, seed=0)
        train_steps(model, make_opt(model, bf16_compensation=compensation), batches, lrs)
        move = [p.detach().float() - p0 for p, p0 in zip(model.parameters(), init, strict=True)]
        dot = sum((a * b).sum().item() for a, b in zip(move, ref_move, strict=True))
        dist_sq = sum(((a - b) ** 2).sum().item() for a, b in zip(move, ref_move, strict=True))
        progress[compensation] = dot / moved_sq
        distance[compensation] = math.sqrt(dist_sq / moved_sq)
    msg = f"after {len(batches)} steps at lr 2e-5: " + "; ".join(
        f"{k}: progress {progress[k]:.3f}, distance {distance[k]:.3f}" for k in progress
    )
    print(msg)
    assert progress["none"] < 0.5, msg
    assert progress["kahan"] > 0.9 and progress["stochastic"] > 0.9, msg
    assert distance["kahan"] < 0.5 * distance["none"], msg
    # What a run with bf16 parameters gets by default (the GPU default) is one that learns.
    assert progress[resolve({}, {"dtype": "bf16"}).optim.bf16_compensation] > 0.9, msg


@pytest.mark.slow
def test_compiled_step_matches_eager(monkeypatch: pytest.MonkeyPatch) -> None:
    """The compiled own step (8-bit, in backward; bf16 + Kahan) follows the eager one. (With the
    C++ kernel off: this is the Inductor step that GPUs run.)"""
    monkeypatch.setenv("COMPILETUNE_CPU_KERNELS", "0")
    args = tiny_args()
    batches = random_batches(3, args.vocab_size)
    for dtype, compensation, atol in (
        (torch.float32, "none", 1e-5),
        (torch.bfloat16, "kahan", 1e-2),
    ):
        eager = build_model(args, dtype=dtype, seed=0)
        train_steps(
            eager,
            make_opt(eager, kind="adamw8bit", bf16_compensation=compensation),
            batches,
            [1e-3] * 3,
        )
        model = build_model(args, dtype=dtype, seed=0)
        opt = Optimizer(
            model.named_parameters(),
            kind="adamw8bit",
            lr=1e-3,
            in_backward=True,
            bf16_compensation=compensation,
            device=CPU,
            compile_step=True,
        )
        train_steps(model, opt, batches, [1e-3] * 3)
        assert opt._update.compiled is not None, "compiling fell back to eager"
        for p, q in zip(model.parameters(), eager.parameters(), strict=True):
            torch.testing.assert_close(p, q, atol=atol, rtol=0)


@pytest.mark.parametrize("dtype,compensation", [(torch.float32, "none"), (torch.bfloat16, "kahan")])
def test_adamw8bit_chunks_and_partial_block_match_one_padded_step(
    monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype, compensation: str
) -> None:
    """The own 8-bit step cuts a parameter into chunks of whole blocks and pads only its last
    partial block: the result equals one step over the whole parameter zero-padded to blocks."""
    monkeypatch.setattr("compiletune.optim._CHUNK_BLOCKS", 2)  # chunks of 512: 512 + 256 + 37
    n = 3 * BLOCK + 37
    g = torch.Generator().manual_seed(0)
    p = torch.nn.Parameter(torch.randn(n, generator=g).to(dtype))
    opt = Optimizer(
        [("w", p)],
        kind="adamw8bit",
        lr=1e-2,
        weight_decay=0.1,
        device=CPU,
        compile_step=False,
        bf16_compensation=compensation,
    )
    ref = torch.nn.functional.pad(p.detach().clone(), (0, BLOCK - 37)).view(4, BLOCK)
    state = [torch.zeros(4, BLOCK, dtype=torch.int8), torch.zeros(4)]
    state += [torch.zeros(4, BLOCK, dtype=torch.uint8), torch.zeros(4)]
    comp = torch.zeros_like(ref) if compensation == "kahan" else None
    for step in range(1, 4):
        grad = torch.randn(n, generator=g).to(dtype)
        p.grad = grad.clone()
        opt.step()
        opt.zero_grad()
        padded = torch.nn.functional.pad(grad, (0, BLOCK - 37)).view(4, BLOCK)
        adamw8bit_update_(
            ref,
            padded,
            *state,
            torch.tensor(float(step)),
            torch.tensor(1e-2),
            comp,
            None,
            0.9,
            0.95,
            1e-8,
            0.1,
        )
        assert torch.equal(p.detach(), ref.view(-1)[:n]), f"step {step}"
    st = opt._state[0]
    assert torch.equal(st["exp_avg_codes"], state[0]) and torch.equal(
        st["exp_avg_scales"], state[1]
    )
    assert torch.equal(st["exp_avg_sq_codes"], state[2])
    if comp is not None:
        assert torch.equal(st["kahan"], comp.view(-1)[:n])


def step_8bit_runs(
    monkeypatch: pytest.MonkeyPatch,
    n: int,
    dtype: torch.dtype,
    beta1: float,
    steps: int,
    settings: dict[str, tuple[bool, str]],
    seed: int = 0,
    modes: dict[str, Callable[[], contextlib.AbstractContextManager]] | None = None,
    compensation: str = "none",
) -> dict[str, tuple[torch.nn.Parameter, Optimizer]]:
    """One 8-bit optimizer per entry of settings (name: (compile_step, COMPILETUNE_CPU_KERNELS)),
    each on its own copy of one random [n] weight, stepped on the same gradients (the env var
    set as each one steps, and modes[name]() entered around its steps where given)."""
    g = torch.Generator().manual_seed(seed)
    init = torch.randn(n, generator=g).to(dtype)
    runs = {}
    for name, (compile_step, kernels) in settings.items():
        monkeypatch.setenv("COMPILETUNE_CPU_KERNELS", kernels)
        p = torch.nn.Parameter(init.clone())
        opt = Optimizer(
            [("w", p)],
            kind="adamw8bit",
            lr=1e-2,
            betas=(beta1, 0.95),
            weight_decay=0.1,
            device=CPU,
            compile_step=compile_step,
            bf16_compensation=compensation,
        )
        runs[name] = p, opt
    for step in range(steps):
        grad = (torch.randn(n, generator=g) * 10.0**-step).to(dtype)
        for name, (p, opt) in runs.items():
            monkeypatch.setenv("COMPILETUNE_CPU_KERNELS", settings[name][1])
            p.grad = grad.clone()
            with (modes or {}).get(name, contextlib.nullcontext)():
                opt.step()
            opt.zero_grad()
    return runs


class RoundedOncePerOp(TorchFunctionMode):
    """Eager torch with its two CPU-dependent fp32 ops computed as Inductor's C++ and the C++
    kernel compute them, one IEEE rounding per operation; eager's other ops in the 8-bit step
    (+, -, *, /, max, round, rsqrt) round once already.

    - sqrt: ATen sends fp32 sqrt to MKL VML (vmsSqrt with VML_HA: within 1 ulp, not correctly
      rounded), whose code path MKL picks per CPU: on a 2-core AMD EPYC 16% of fp32 square roots
      come back 1 ulp off, whether ATen runs AVX-512 or AVX2. Here in fp64 (also within 1 ulp, of
      fp64) rounded to fp32: that is the correctly rounded sqrt, since the square root of a
      24-bit number is never within 2**-50 of a halfway point between fp32 values without
      being on it.
    - lerp with a float weight: ATen's vectorized lerp is one fused multiply-add (vec::fmadd)
      on AVX2 and AVX-512, two roundings on CPUs without FMA. Here sub, mul, add, as Inductor
      decomposes it on CPU, in torch.lerp's two forms."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if (
            func in (torch.sqrt, torch.Tensor.sqrt)
            and args[0].dtype == torch.float32
            and not kwargs
        ):
            return torch.sqrt(args[0].double()).float()
        if func in (torch.lerp, torch.Tensor.lerp) and isinstance(args[2], float) and not kwargs:
            start, end, weight = args
            diff = end - start
            return start + diff * weight if abs(weight) < 0.5 else end - diff * (1 - weight)
        return func(*args, **kwargs)


@pytest.mark.slow
# torch.lerp's two forms: weight 1 - beta1 < 0.5 or not
@pytest.mark.parametrize("beta1", [0.9, 0.3])
@pytest.mark.parametrize("n", [3 * BLOCK + 37, 37])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_cpu_kernel_matches_the_torch_step(
    monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype, n: int, beta1: float
) -> None:
    """The C++ 8-bit step (cpu_kernels, what CPU runs use) is the torch step's arithmetic over 4
    steps: bit for bit against eager torch with each op rounded once (RoundedOncePerOp), on
    any x86-64 CPU; against plain eager torch, whose sqrt and lerp round differently per CPU,
    weights, scales and codes within what a few ulps of m and sqrt(v) can move them."""
    from compiletune.ops import cpu_kernels

    calls = []
    real = cpu_kernels.adamw8bit_step_
    monkeypatch.setattr(
        cpu_kernels, "adamw8bit_step_", lambda *a, **k: calls.append(1) or real(*a, **k)
    )
    settings = {"kernel": (True, "1"), "eager": (False, "1"), "rounded_once": (False, "1")}
    runs = step_8bit_runs(
        monkeypatch, n, dtype, beta1, 4, settings, modes={"rounded_once": RoundedOncePerOp}
    )
    assert len(calls) == 4, "the compiled-step optimizer did not use the C++ kernel"
    (p, fast), (q, ref), (r, exact) = runs["kernel"], runs["eager"], runs["rounded_once"]
    assert p._version == 4, "autograd did not see the kernel's writes"
    a, b = fast._state[0], ref._state[0]
    assert torch.equal(p, r)
    for k, t in a.items():
        assert torch.equal(t, exact._state[0][k]), k
    # Plain eager: m and sqrt(v) differ by an ulp or so (MKL's sqrt, the fused lerp), so a scale
    # (a block maximum) by as much, a code by at most one step where round() sat near .5, and
    # a weight by that code step: ~1% of lr at most. How many weights or codes differ has no
    # bound: one scale an ulp apart changes the decoded m of its whole block (23 of 805 fp32
    # weights on an AMD EPYC, 7 with sqrt correctly rounded), so they are not counted here;
    # the bit-exact comparison above is the exact check.
    torch.testing.assert_close(p.detach(), q.detach(), rtol=torch.finfo(dtype).eps, atol=1e-4)
    for k in ("exp_avg_scales", "exp_avg_sq_scales"):
        torch.testing.assert_close(a[k], b[k], rtol=1e-6, atol=0)
    for k in ("exp_avg_codes", "exp_avg_sq_codes"):
        assert (a[k].int() - b[k].int()).abs().max() <= 1, k
        assert (a[k].view(-1)[n:] == 0).all(), "the padding of the last block moved"


@pytest.mark.slow
@pytest.mark.parametrize("beta1", [0.9, 0.3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_kernel_equals_the_compiled_step(
    monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype, beta1: float
) -> None:
    """Against the Inductor-compiled torch step (fp contraction off in both) the C++ kernel
    is exact: weights, codes and scales bit for bit over 3 steps, a partial last block
    included. A constant rounded differently (1 - beta1 in fp32, say) fails this."""
    settings = {"kernel": (True, "1"), "compiled": (True, "0")}
    runs = step_8bit_runs(monkeypatch, 3 * BLOCK + 37, dtype, beta1, 3, settings, seed=1)
    (p, fast), (q, ref) = runs["kernel"], runs["compiled"]
    assert ref._update.compiled is not None, "the reference fell back to eager"
    assert torch.equal(p, q)
    for k, t in fast._state[0].items():
        assert torch.equal(t, ref._state[0][k]), k


@pytest.mark.slow
def test_cpu_kernel_rounds_stochastically_as_the_compiled_step(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Stochastic bf16 rounding in the C++ kernel draws what the compiled torch step draws
    (`rounding_noise`, a hash of the key and the value's index): weights and states bit for
    bit over 3 steps, and the kernel is what stepped (no fallback to the torch step)."""
    from compiletune.ops import cpu_kernels

    calls = []
    real = cpu_kernels.adamw8bit_step_
    monkeypatch.setattr(
        cpu_kernels, "adamw8bit_step_", lambda *a, **k: calls.append(k) or real(*a, **k)
    )
    settings = {"kernel": (True, "1"), "compiled": (True, "0")}
    runs = step_8bit_runs(
        monkeypatch, 3 * BLOCK + 37, torch.bfloat16, 0.9, 3, settings, compensation="stochastic"
    )
    assert len(calls) == 3 and all(k["noise_key"] is not None for k in calls)
    (p, fast), (q, ref) = runs["kernel"], runs["compiled"]
    assert torch.equal(p, q)
    for k, t in fast._state[0].items():
        assert torch.equal(t, ref._state[0][k]), k
    # and the draws did round: nearest rounding gives other weights
    nearest = step_8bit_runs(monkeypatch, 3 * BLOCK + 37, torch.bfloat16, 0.9, 3, settings)
    assert not torch.equal(p, nearest["kernel"][0])


def test_rounding_noise_is_uniform_and_keyed() -> None:
    """The hashed draws: 16 bits each, every bit set about half the time, the mean where a
    uniform draw puts it, independent of neighbours, and a different sequence for another key
    (step, parameter) or offset; the same for the same key and index, however the parameter
    is cut into chunks."""
    from compiletune.optim import rounding_noise

    def draws(key: int, start: int, n: int) -> torch.Tensor:
        return rounding_noise(torch.tensor(key), torch.tensor(start), n).long()

    n = 1 << 16
    a = draws(12345, 0, n)
    assert a.min() >= 0 and a.max() < 1 << 16
    bits = torch.stack([(a >> b) & 1 for b in range(16)]).float().mean(dim=1)
    assert ((bits - 0.5).abs() < 0.01).all(), bits
    assert abs(a.float().mean().item() / (1 << 16) - 0.5) < 0.005
    lag = torch.corrcoef(torch.stack([a[:-1].float(), a[1:].float()]))[0, 1]
    assert abs(lag) < 0.02
    b = draws(12346, 0, n)
    assert (a == b).float().mean() < 0.001
    assert torch.equal(draws(12345, 100, 50), a[100:150])


@pytest.mark.slow
def test_cpu_kernel_build_failure_falls_back(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the C++ kernel cannot be built the optimizer keeps the compiled torch step, with a
    warning, and steps exactly as with the kernel turned off; tensors without data (the memory
    estimate's fake tensors) never reach it."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from compiletune import torch_internals
    from compiletune.ops import cpu_kernels

    with FakeTensorMode():
        fake = torch.zeros(300)
    assert not cpu_kernels.supports(fake, fake)

    def fail(*args):
        raise RuntimeError("no C++ compiler")

    monkeypatch.setattr(torch_internals, "load_cpp_kernel", fail)
    monkeypatch.setattr(cpu_kernels, "_kernels", {})
    settings = {"failed": (True, "1"), "off": (True, "0")}
    with pytest.warns(UserWarning, match="no C\\+\\+ compiler"):
        runs = step_8bit_runs(monkeypatch, BLOCK + 44, torch.float32, 0.9, 2, settings)
    (p, failed), (q, off) = runs["failed"], runs["off"]
    assert failed._update.compiled is not None, "the fallback is not the compiled torch step"
    assert torch.equal(p, q)
    for k, t in failed._state[0].items():
        assert torch.equal(t, off._state[0][k]), k
    monkeypatch.setenv("COMPILETUNE_CPU_KERNELS", "1")  # the "off" run set it to 0 last
    w = p.detach()  # a plain tensor, as the optimizer passes (a Parameter is refused first)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not cpu_kernels.supports(w, w)  # decided once: no second build, no warning
    monkeypatch.setenv("COMPILETUNE_CPU_KERNELS", "0")
    monkeypatch.setattr(cpu_kernels, "_kernels", {})
    assert not cpu_kernels.supports(w, w) and cpu_kernels._kernels == {}


@pytest.mark.slow
def test_adamw8bit_follows_adamw_on_debug_preset() -> None:
    """300 steps of the debug preset (1 of its 4 layers, to keep this near half a minute) on the
    pydocs corpus: the final loss of 8-bit AdamW is within 2% of fp32 AdamW's (same init, same
    batches, warmup then constant lr)."""
    data = pack(load_examples("pydocs", byte_tokenizer()), 64)
    args = from_name("debug")
    args.n_layers = 1

    def run(kind: str) -> float:
        model = build_model(args, seed=0)
        head = LossHead(model.output, "plain")
        opt = make_opt(model, kind=kind)
        batches = Batches(data, 8, seed=0)
        losses = []
        for step in range(300):
            opt.set_lr(1e-3 * min(1.0, (step + 1) / 20))
            batch = batches.next()
            n_targets = (batch["targets"] != IGNORE_INDEX).sum()
            loss = head(model.hidden_states(batch["inputs"]), batch["targets"]) / n_targets
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        return sum(losses[-20:]) / 20  # the last 20 batches: one batch is a noisy estimate

    threads = torch.get_num_threads()
    # One thread: ~300 small steps on a shared 2-core machine spend less time waiting at
    # OpenMP barriers; the numbers do not depend on it.
    torch.set_num_threads(1)
    try:
        fp32, q8 = run("adamw"), run("adamw8bit")
    finally:
        torch.set_num_threads(threads)
    msg = f"final loss: adamw {fp32:.4f}, adamw8bit {q8:.4f} ({(q8 - fp32) / fp32:+.2%})"
    print(msg)
    assert abs(q8 - fp32) / fp32 < 0.02, msg


def _fsdp_worker(rank: int, world: int, port: int, results: dict) -> None:
    torch.set_num_threads(1)
    from torch.distributed.fsdp import fully_shard

    args = tiny_args(vocab_size=97)  # an odd row count: uneven shards
    batches = random_batches(3, args.vocab_size, seed=rank + 1)  # each rank its own data
    lrs = [1e-3, 3e-3, 2e-3]

    def sharded() -> Transformer:
        model = build_model(args, seed=0)
        for layer in model.layers:
            fully_shard(layer)
        return fully_shard(model)

    def body() -> None:
        for kind in ("adamw", "adamw8bit"):
            results[rank, kind] = _fsdp_case(kind, sharded, batches, lrs)

    run_in_gloo(rank, world, port, body)


def _fsdp_case(
    kind: str, sharded: Callable[[], Transformer], batches: list[torch.Tensor], lrs: list[float]
) -> tuple[bool, bool]:
    ref = sharded()
    train_steps(ref, make_opt(ref, kind=kind, weight_decay=0.1), batches, lrs)

    # In backward for one step, saved and loaded through bytes into an ordinary optimizer
    # for the other two: the same weights as three ordinary steps.
    model = sharded()
    opt = make_opt(model, kind=kind, weight_decay=0.1, in_backward=True)
    train_steps(model, opt, batches[:1], lrs[:1])
    grads_freed = all(p.grad is None for p in model.parameters())
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    buf.seek(0)
    opt.remove_hooks()
    opt = make_opt(model, kind=kind, weight_decay=0.1)
    opt.load_state_dict(torch.load(buf, weights_only=True))
    train_steps(model, opt, batches[1:], lrs[1:])
    same = all(
        torch.equal(p.full_tensor(), q.full_tensor())
        for p, q in zip(model.parameters(), ref.parameters(), strict=True)
    )
    return grads_freed, same


@pytest.mark.slow
def test_fsdp2_in_backward() -> None:
    """Under FSDP2 (2 CPU processes, gloo) the hooks step the sharded parameters, and state
    saved in backward resumes in the ordinary step with identical weights."""
    if not dist.is_available():
        pytest.skip("torch.distributed is not available")
    port = free_port()
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(_fsdp_worker, args=(2, port, results), nprocs=2)
        assert dict(results) == {
            (rank, kind): (True, True) for rank in (0, 1) for kind in ("adamw", "adamw8bit")
        }


@pytest.mark.parametrize("kind", ["adamw", "adamw8bit"])
def test_loaded_state_is_taken_not_copied(tmp_path, kind):
    """A resume holds the optimizer state once: the tensors loaded (memory-mapped) from the
    checkpoint become the state, and stepping on from them equals stepping on from a copy."""
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(300, 70))

    def make(param):
        return Optimizer([("w", param)], kind=kind, lr=1e-2, device=torch.device("cpu"))

    opt = make(p)
    p.grad = torch.randn_like(p)
    opt.step()
    torch.save(opt.state_dict(), tmp_path / "state.pt")
    loaded = torch.load(tmp_path / "state.pt", weights_only=True, mmap=True)
    q = torch.nn.Parameter(p.detach().clone())
    taken = make(q)
    taken.load_state_dict(loaded)
    for key, t in taken.state_dict()["state"]["w"].items():
        assert t.data_ptr() == loaded["state"]["w"][key].data_ptr(), key
    grad = torch.randn_like(p)
    p.grad, q.grad = grad.clone(), grad.clone()
    opt.step()
    taken.step()
    assert torch.equal(p, q)
