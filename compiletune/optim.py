"""The optimizer the training loop drives: AdamW or 8-bit AdamW, stepped after backward or inside it.

    opt = Optimizer(model.named_parameters(), kind="adamw", lr=3e-4, device=device)
    opt.set_lr(lr)            # before the step's backward: in-backward steps happen during it
    loss.backward()
    opt.step()                # no-op with in_backward=True
    opt.zero_grad()           # no-op with in_backward=True

Kinds and how a step runs:

    adamw       `torch.optim.AdamW(fused=True)`: one multi-tensor launch per parameter group
                (the only group) on every device torch has a fused kernel for (CUDA and CPU
                among them). Where it has none, or when bf16 compensation is asked for (the fused
                kernel cannot round the parameter update our way), the step is our own
                compiled function (`adamw_update_`), one fused kernel per parameter.
    adamw8bit   AdamW whose two moments live in 8 bits with one fp32 scale per block of
                `BLOCK` values (see `quantize_exp_avg`); our own compiled step, per parameter
                chunk of whole blocks: decode, update, re-encode and write the weight in two
                passes over memory (block maxima, then codes and weights), ~2.1 ns per value
                on a 2-core CPU. CPU parameters (with compile_step, as the trainer runs) take
                one C++ kernel per parameter instead (`cpu_kernels`: each block decoded,
                updated and re-encoded in a stack buffer, one pass over memory), bit for bit
                the compiled step's numbers: ~1.1 ns per value, against ~0.85 for torch's
                fused AdamW.

`in_backward=True` registers a post-accumulate-grad hook on every parameter (under FSDP2: on
every sharded parameter, which FSDP2 calls after its reduce-scatter) that steps that parameter
with its own state and drops its gradient at once, so the full set of gradients never exists;
peak memory falls by about the size of the gradients. It cannot accumulate gradients over
micro-batches nor clip by their global norm (`check_optimizer_flags`).

State dtypes (bytes per parameter, measured by `state_bytes`; plus a 4-byte step count per
parameter tensor):

    adamw, fp32 params            exp_avg, exp_avg_sq fp32                          8
    adamw, bf16 params            exp_avg, exp_avg_sq bf16 (as torch keeps them)     4
    adamw8bit, any param dtype    int8 code of m, uint8 code of sqrt(v),            2.03
                                  2 fp32 scales per 256 values
    bf16 "kahan" compensation     + one bf16 compensation buffer                    +2

The update itself is always computed in fp32, whatever the parameter and state dtypes.

Pure-bf16 training (`bf16_compensation`, bf16 parameters only; fp32 ones ignore it). bf16 keeps
8 bits of mantissa, so an update smaller than half an ulp of its weight (0.2% of it: lr 1e-5
on a weight of 0.01, or any lr under ~4e-3 on a norm weight of 1.0) rounds away. On a tiny model
at lr 2e-5 plain bf16 makes 20% of the fp32 run's progress (tests/unit/test_optim.py):

    none        plain round-to-nearest                                   costs nothing
    kahan       each step's rounding error is kept in a bf16 buffer and   +2 bytes/param,
                added to the next update: 99% of the progress, weights    a few elementwise
                3.5x closer to fp32 than plain bf16                       ops per step
    stochastic  round up with probability (dropped bits) / 2**16: the     no memory kept; one
                expected weight is the fp32 one (99.9% of the progress)   16-bit hash per value
                but each weight carries up to an ulp of noise, so over    per step (a transient
                few steps at a tiny lr its distance to fp32 is no better  4 bytes/value in the
                than plain bf16; the noise averages out over many steps   torch step; none in
                                                                          the C++ CPU step)

Either makes `adamw` take our own compiled step instead of torch's fused kernel, which cannot
round the update our way. Stochastic draws are a hash of (torch.initial_seed(), parameter
name, step, value index) (`rounding_noise`), so they do not depend on the order parameters are
stepped in, resume exactly, and are the same in the torch step and the C++ CPU step.

`state_dict()` keys every tensor by parameter name and is the same in both modes and for both
step engines of `adamw`, so a run may resume with or without `--optimizer-in-backward`. Under
FSDP2 (or --ep) the moments are DTensors of the whole tensors (`_whole`), which a sharded
checkpoint saves once and a resume on another number of processes reshards; 8-bit codes and
scales are this rank's blocks and resume on as many processes as wrote them.
"""

from __future__ import annotations

import functools
import math
import warnings
import zlib
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor, nn

from compiletune import torch_internals
from compiletune.config.checks import check_optimizer_flags
from compiletune.errors import UserError
from compiletune.ops import cpu_kernels, op_memory

# Values per quantisation block of the 8-bit moments: one fp32 scale per 256 values costs
# 4/256 = 0.016 bytes per value per moment, and a block is small enough that one outlier
# coarsens only its 255 neighbours.
BLOCK = 256
assert BLOCK == cpu_kernels.BLOCK
# The own step works through a parameter in chunks of this many blocks (4M values), so its fp32
# temporaries stay at ~16 MiB each even for a 128k-vocab embedding.
_CHUNK_BLOCKS = 16384
# An 8-bit parameter's state tensors, in the order the step functions take them.
_CODE_KEYS = ("exp_avg_codes", "exp_avg_scales", "exp_avg_sq_codes", "exp_avg_sq_scales")

_STATE_FORMAT = 1


# ----------------------------------------------------------------------------- 8-bit moments


def quantize_exp_avg(m: Tensor) -> tuple[Tensor, Tensor]:
    """m [nb, BLOCK] fp32 -> (codes int8 [nb, BLOCK], scales fp32 [nb]).

    code = round(127 * sqrt(|m| / absmax)) * sign(m): square-root companding spends the codes
    where Adam's first moment mostly lives, well below the block's largest value. The relative
    step is 2/code, so values down to 1/127**2 = 6e-5 of the block maximum keep a code
    (linear int8 loses everything under 1/254 = 4e-3 of it).
    """
    scale = _block_scale(m.abs())  # [nb]
    x = m * (1.0 / scale)[:, None]  # [-1, 1]
    codes = (x.abs().sqrt() * 127).round() * x.sign()
    return codes.to(torch.int8), scale


def _block_scale(a: Tensor) -> Tensor:
    """a [nb, BLOCK] >= 0 -> each block's maximum, at least the smallest normal fp32 (1.2e-38).

    The floor keeps 1 / scale finite: a block of zeros stays zero, and a block whose values
    are all subnormal (a moment decayed over hundreds of steps without gradient) encodes and
    decodes against the same scale. The encoders multiply by 1 / scale, one division per
    block instead of one per value: the step is bound by its arithmetic on CPU (with the
    decoders' constant reciprocals, the 8-bit step went from 2.3 to 2.1 ns per value on 2
    cores)."""
    return a.amax(dim=1).clamp_min(torch.finfo(torch.float32).tiny)


def dequantize_exp_avg(codes: Tensor, scale: Tensor) -> Tensor:
    """codes int8 [nb, BLOCK], scales fp32 [nb] -> m fp32 [nb, BLOCK]."""
    c = codes.float() * (1 / 127)
    return c * c.abs() * scale[:, None]


def quantize_exp_avg_sq(v: Tensor) -> tuple[Tensor, Tensor]:
    """v [nb, BLOCK] fp32 (>= 0) -> (codes uint8 [nb, BLOCK], scales fp32 [nb]).

    What is stored is sqrt(v), the denominator of the update: scale = its block maximum and
    code = round(255 * sqrt(sqrt(v) / scale)), square-root companding again. sqrt(v) keeps a
    relative step of 2/code (under 1% for the upper half of the codes) over a range of
    255**2 = 65025 below the block maximum. Linear codes of v would round most of a block to
    zero, and m / (0 + eps) is the blow-up 8-bit optimizers are known for. Rounding is to
    nearest: with the default beta2 = 0.95 v moves 5% a step, more than half a code step (at
    most 0.8% of v), so it decays as it should; with beta2 = 0.999 a slowly decaying v can stall
    between codes, yet on the pydocs run it still ended within 1% of fp32 AdamW's loss.
    """
    return _quantize_sqrt_exp_avg_sq(v.sqrt())


def _quantize_sqrt_exp_avg_sq(s: Tensor) -> tuple[Tensor, Tensor]:
    """s = sqrt(v) [nb, BLOCK] -> (codes uint8, scales fp32 [nb]); the step computes s anyway."""
    scale = _block_scale(s)  # [nb]
    x = s * (1.0 / scale)[:, None]  # [0, 1]
    codes = (x.sqrt() * 255).round()
    return codes.to(torch.uint8), scale


def dequantize_exp_avg_sq(codes: Tensor, scale: Tensor) -> Tensor:
    """codes uint8 [nb, BLOCK], scales fp32 [nb] -> v fp32 [nb, BLOCK]."""
    c = codes.float() * (1 / 255)
    s = c * c * scale[:, None]  # sqrt(v)
    return s * s


# ----------------------------------------------------------------------------- rounding noise


def mix32(x: Tensor | int) -> Tensor | int:
    """A 32-bit integer hash (two multiply-xorshift rounds) of x in [0, 2**32), for an int or an
    int64 tensor. Each product stays below 2**59, so int64 tensors never overflow; the C++
    kernel (`cpu_kernels`) computes the same in uint32 arithmetic."""
    x = (((x >> 16) ^ x) * 0x45D9F3B) & 0xFFFFFFFF
    x = (((x >> 16) ^ x) * 0x45D9F3B) & 0xFFFFFFFF
    return (x >> 16) ^ x


def rounding_noise(key: Tensor, start: Tensor, n: int) -> Tensor:
    """int32 [n] in [0, 2**16): the stochastic-rounding draws of values start..start+n of a
    parameter, a hash of (key, value index); key and start are int64 [] tensors on the
    parameter's device (new values never recompile the compiled form). A counter-based draw
    rather than a generator's stream: torch.randint with a CPU generator is one serial pass
    (~40% of the host optimizer step of an 8B model), and the C++ step draws the same values
    inline, in its one pass over the parameter."""
    index = torch.arange(n, dtype=torch.int64, device=key.device) + start
    return (mix32(mix32(index) ^ key) & 0xFFFF).to(torch.int32)


# ----------------------------------------------------------------------------- update math


def _write_update(
    p: Tensor, p32: Tensor, delta: Tensor, comp: Tensor | None, noise: Tensor | None
) -> None:
    """Store p32 + delta (fp32 [n]) into p [n] in p's dtype (p32 is p in fp32): round to
    nearest, or with Kahan compensation `comp` [n], or stochastically with `noise` int32 [n]
    uniform in [0, 2**16) (see the module docstring for why and what each costs)."""
    if comp is not None:
        y = delta + comp.float()
        stored = (p32 + y).to(p.dtype)
        # What the stored weight missed of y, kept for the next step (small: fits bf16 well).
        comp.copy_(y - (stored.float() - p32))
        p.copy_(stored)
    elif noise is not None:
        # A random 16-bit integer added below bf16's mantissa, then truncation: bf16 is the top
        # half of fp32, so this rounds up with probability (dropped bits) / 2**16.
        bits = (p32 + delta).view(torch.int32) + noise
        p.copy_((bits & -65536).view(torch.float32).to(p.dtype))
    else:
        p.copy_(p32 + delta)


def adamw_update_(
    p: Tensor,
    g: Tensor,
    m: Tensor,
    v: Tensor,
    step: Tensor,
    lr: Tensor,
    comp: Tensor | None,
    noise: Tensor | None,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
) -> None:
    """One AdamW step in place on a flat chunk: p, g, m, v, comp [n]; noise int32 [n];
    step (count after this step) and lr fp32 [] tensors, so new values never recompile.

    Math in fp32, moments stored in their own dtype; decoupled weight decay as in torch.
    """
    g32 = g.float()
    m32 = m.float().lerp(g32, 1 - beta1)
    v32 = v.float() * beta2 + (1 - beta2) * g32 * g32
    m.copy_(m32)
    v.copy_(v32)
    _adam_write(p, m32, v32.sqrt(), step, lr, comp, noise, beta1, beta2, eps, weight_decay)


def _adam_write(
    p: Tensor,
    m32: Tensor,
    sqrt_v32: Tensor,
    step: Tensor,
    lr: Tensor,
    comp: Tensor | None,
    noise: Tensor | None,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
) -> None:
    """p [n] += -lr * (wd * p + m_hat / (sqrt(v_hat) + eps)); m32, sqrt_v32 [n] from the new
    moments."""
    bc1 = 1 - beta1**step
    bc2 = 1 - beta2**step
    denom = sqrt_v32 * bc2.rsqrt() + eps
    p32 = p.float()
    delta = -lr * weight_decay * p32 - (lr / bc1) * m32 / denom
    _write_update(p, p32, delta, comp, noise)


def adamw8bit_update_(
    p: Tensor,
    g: Tensor,
    m_codes: Tensor,
    m_scales: Tensor,
    v_codes: Tensor,
    v_scales: Tensor,
    step: Tensor,
    lr: Tensor,
    comp: Tensor | None,
    noise: Tensor | None,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
) -> None:
    """One 8-bit AdamW step in place on nb whole blocks of BLOCK values.

    p, g, comp, noise (int32) and codes [nb, BLOCK]; scales [nb]; step, lr fp32 [].
    The moments are decoded to fp32, updated, and the parameter update uses these fp32 values
    before they are encoded again, so quantisation error enters through the stored history only.
    Everything is [nb, BLOCK]-shaped, so Inductor indexes a block's values and its scale
    directly: a flat [n] layout with a padded tail made it emit masked, modulo-indexed loads,
    3.7x slower on CPU in bf16 (the caller pads a parameter's last partial block instead).
    """
    g32 = g.float()
    m32 = dequantize_exp_avg(m_codes, m_scales).lerp(g32, 1 - beta1)
    v32 = dequantize_exp_avg_sq(v_codes, v_scales) * beta2 + (1 - beta2) * g32 * g32
    sqrt_v32 = v32.sqrt()
    mc, ms = quantize_exp_avg(m32)
    vc, vs = _quantize_sqrt_exp_avg_sq(sqrt_v32)
    m_codes.copy_(mc)
    m_scales.copy_(ms)
    v_codes.copy_(vc)
    v_scales.copy_(vs)
    _adam_write(p, m32, sqrt_v32, step, lr, comp, noise, beta1, beta2, eps, weight_decay)


def _as_blocks(t: Tensor | None, nb: int) -> Tensor | None:
    """The first nb whole blocks of t [>= nb * BLOCK] as a [nb, BLOCK] view; None stays None."""
    return None if t is None else t[: nb * BLOCK].view(nb, BLOCK)


def _pad_block(t: Tensor | None) -> Tensor | None:
    """t [r] (r < BLOCK) -> a zero-padded copy [1, BLOCK]; None stays None."""
    if t is None:
        return None
    return torch.nn.functional.pad(t, (0, BLOCK - t.numel())).view(1, BLOCK)


ADAMW_BETAS = (0.9, 0.95)  # the trainer's AdamW betas (Llama's; a fine-tuning norm)


class _MaybeCompiled:
    """`fn` through `torch.compile` (from the second parameter size on, one dynamic-shape graph
    serves all sizes), falling back to eager for good, with a warning, if compiling fails."""

    def __init__(self, fn: Callable[..., None], enabled: bool) -> None:
        self.fn = fn
        # Called at every parameter size: kernels must not keep the threading of the first size.
        options = torch_internals.dynamic_cpu_kernel_options()
        self.compiled = torch.compile(fn, options=options or None) if enabled else None

    def __call__(self, *args: Any) -> None:
        if self.compiled is not None:
            try:
                return self.compiled(*args)
            except torch.OutOfMemoryError:
                raise
            except Exception as e:  # no C++ compiler, no Triton, an unsupported op...
                warnings.warn(
                    f"compiling the optimizer step failed ({type(e).__name__}: {e}); "
                    "stepping eagerly",
                    stacklevel=2,
                )
                self.compiled = None
        return self.fn(*args)


# ----------------------------------------------------------------------------- the optimizer


def _same_layout(a: Tensor, b: Tensor) -> bool:
    """Can `b` stand in for `a` as optimizer state (same device, dtype, shape and strides)?"""
    return (
        a.device == b.device
        and a.dtype == b.dtype
        and a.shape == b.shape
        and a.stride() == b.stride()
        and not b.requires_grad
    )


def _local(t: Tensor) -> Tensor:
    """This rank's shard of a DTensor (a view: in-place writes reach the DTensor); else t."""
    to_local = getattr(t, "to_local", None)
    return to_local() if to_local is not None else t


def _whole(local: Tensor, p: Tensor) -> Tensor:
    """A state tensor shaped like this rank's part of `p` as the whole tensor it is a part of
    (a DTensor sharing `local`'s storage), laid out as `p` is: FSDP's shards, or an --ep
    expert weight's rows (`expert_mesh`, set by expert_parallel.py). A sharded checkpoint
    saves it once, whole, so that a resume under another --ep reads its own part of it.
    Anything else (a single process's state, 8-bit codes, the step) is returned as is."""
    # deferred: torch.distributed.tensor is only wanted by a run of several processes
    from torch.distributed.tensor import DTensor, Replicate, Shard

    mesh = getattr(p, "expert_mesh", None)
    if isinstance(p, DTensor) and local.shape == p.to_local().shape:
        return DTensor.from_local(
            local, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride()
        )
    if mesh is not None and local.shape == p.shape:
        shape = (p.whole_rows, *p.shape[1:])
        stride = torch.empty(shape, device="meta").stride()
        placements = [Replicate(), Shard(0)]
        return DTensor.from_local(
            local, mesh, placements, run_check=False, shape=torch.Size(shape), stride=stride
        )
    return local


@functools.cache
def _fused_adamw_works(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether torch's fused AdamW kernel runs for this device and dtype, found by trying it on
    one value (public API only; torch checks this lazily, at a first step we pre-empt)."""
    probe = torch.zeros(1, device=device, dtype=dtype, requires_grad=True)
    probe.grad = torch.zeros_like(probe)
    try:
        torch.optim.AdamW([probe], lr=0.0, fused=True).step()
    except (RuntimeError, NotImplementedError):
        return False
    return True


def _trainable(
    params: Iterable[nn.Parameter] | Iterable[tuple[str, nn.Parameter]],
) -> list[tuple[str, nn.Parameter]]:
    """(name, parameter) for each parameter that trains; plain parameters are named "0", "1"..."""
    named: list[tuple[str, nn.Parameter]] = []
    for i, item in enumerate(params):
        name, p = item if isinstance(item, tuple) else (str(i), item)
        if p.requires_grad:  # frozen weights get no gradient, no state and no hook
            named.append((name, p))
    if not named:
        raise ValueError("the optimizer got no parameters that require grad")
    if len({id(p) for _, p in named}) != len(named):
        raise ValueError("a parameter appears twice; pass each tied weight once")
    if len({n for n, _ in named}) != len(named):
        raise ValueError("two parameters share a name")
    return named


class Optimizer:
    """AdamW / 8-bit AdamW over `params`, stepped after backward or during it (`in_backward`).

    params: `model.named_parameters()` (recommended: state is keyed by these names, so it
    survives a change in parameter order) or plain parameters (keyed "0", "1", ...). A tied
    weight must appear once (`named_parameters()` already dedups). Frozen parameters
    (requires_grad False) are left out.
    device: the training device. Each state tensor lives with its parameter (its local shard
    under FSDP2; on CPU with FSDP2's CPU offload).
    compile_step: compile our own step (8-bit, bf16 compensation, devices without a fused
    kernel) into one or two kernels per parameter chunk; eagerly it is some 25 launches and as
    many passes over memory. Compiling takes ~20 s on CPU (cached by Inductor after that);
    tests pass False. Ignored by the torch fused step.
    """

    def __init__(
        self,
        params: Iterable[nn.Parameter] | Iterable[tuple[str, nn.Parameter]],
        *,
        kind: str = "adamw",
        lr: float,
        betas: tuple[float, float] = ADAMW_BETAS,
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        in_backward: bool = False,
        bf16_compensation: str = "none",
        device: torch.device,
        compile_step: bool = True,
    ) -> None:
        check_optimizer_flags(kind, in_backward, 1, 0.0, bf16_compensation)
        named = _trainable(params)
        self._names = [n for n, _ in named]
        self._params = [p for _, p in named]

        self.kind = kind
        self.lr = float(lr)
        self.betas = (float(betas[0]), float(betas[1]))
        self.eps = float(eps)
        self.weight_decay = float(weight_decay)
        self.bf16_compensation = bf16_compensation
        self.device = torch.device(device)
        self._in_backward = in_backward
        # Stochastic rounding draws are a hash of (seed, parameter name, step, index).
        self.seed = int(torch.initial_seed()) % (1 << 62)
        self._lr_tensors: dict[torch.device, Tensor] = {}
        self._counts = [0] * len(self._params)  # host copy of each step count (no device sync)
        self._hooks: list[Any] = []

        has_bf16 = any(p.dtype == torch.bfloat16 for p in self._params)
        kinds = {(_local(p).device, p.dtype) for p in self._params}
        self.engine = (
            "torch_fused"
            if kind == "adamw"
            and (bf16_compensation == "none" or not has_bf16)
            and all(_fused_adamw_works(d, t) for d, t in kinds)
            else "own"
        )
        fn = adamw8bit_update_ if kind == "adamw8bit" else adamw_update_
        self._update = _MaybeCompiled(fn, compile_step)
        self._draw = _MaybeCompiled(rounding_noise, compile_step)
        # CPU parameters of an 8-bit run step in one hand-written C++ kernel (cpu_kernels), built
        # like the compiled step; tests that pass compile_step=False keep the torch function.
        self._cpu_kernel = kind == "adamw8bit" and compile_step and cpu_kernels.enabled()

        # State is allocated now, not at the first step: its memory shows from the start, and
        # loading a checkpoint is a copy into tensors whose shapes are already known.
        self._torch: list[torch.optim.AdamW] = []
        self._state: list[dict[str, Tensor]] = []
        if self.engine == "torch_fused":
            self._new_torch_fused()
        else:
            for p in self._params:
                self._state.append(self._new_own_state(p))
        if in_backward:
            for i, p in enumerate(self._params):
                self._hooks.append(p.register_post_accumulate_grad_hook(self._make_hook(i)))

    # --- construction helpers -------------------------------------------------------------

    def _new_torch_fused(self) -> None:
        """torch's fused AdamW: one instance, or one per parameter when stepped in backward."""
        if self._in_backward:
            groups = [[{"params": [p]}] for p in self._params]
        else:  # FSDP's DTensors and plain tensors (--ep's experts): one fused call cannot mix
            # them, and each param group of the instance is one call
            kinds = [
                [p for p in self._params if hasattr(p, "to_local") is d] for d in (True, False)
            ]
            groups = [[{"params": ps} for ps in kinds if ps]]
        for group in groups:
            self._torch.append(
                torch.optim.AdamW(
                    group,
                    lr=self.lr,
                    betas=self.betas,
                    eps=self.eps,
                    weight_decay=self.weight_decay,
                    fused=True,
                )
            )
        for i, p in enumerate(self._params):
            # What torch's fused AdamW would create at its first step (fp32 step on the
            # parameter's device, moments like the parameter), so it takes these as its own.
            st = self._torch_for(i).state[p]
            st["step"] = torch.zeros((), dtype=torch.float32, device=_local(p).device)
            st["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            st["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)

    def _torch_for(self, i: int) -> torch.optim.AdamW:
        return self._torch[i] if self._in_backward else self._torch[0]

    def _new_own_state(self, p: nn.Parameter) -> dict[str, Tensor]:
        local = _local(p.detach())
        if not local.is_contiguous():
            raise ValueError("the optimizer's own step needs contiguous parameters")
        st = {"step": torch.zeros((), dtype=torch.float32, device=local.device)}
        if self.kind == "adamw8bit":
            nb = math.ceil(local.numel() / BLOCK)
            st["exp_avg_codes"] = torch.zeros(nb, BLOCK, dtype=torch.int8, device=local.device)
            st["exp_avg_scales"] = torch.zeros(nb, dtype=torch.float32, device=local.device)
            st["exp_avg_sq_codes"] = torch.zeros(nb, BLOCK, dtype=torch.uint8, device=local.device)
            st["exp_avg_sq_scales"] = torch.zeros(nb, dtype=torch.float32, device=local.device)
        else:
            st["exp_avg"] = torch.zeros_like(local)
            st["exp_avg_sq"] = torch.zeros_like(local)
        if self.bf16_compensation == "kahan" and p.dtype == torch.bfloat16:
            st["kahan"] = torch.zeros_like(local)
        return st

    def _make_hook(self, i: int) -> Callable[[Tensor], None]:
        def hook(param: Tensor) -> None:
            with torch.no_grad():
                if self.engine == "torch_fused":
                    self._torch[i].step()
                    self._counts[i] += 1
                else:
                    self._own_step(i)
            param.grad = None  # freed now: this is the memory in-backward saves

        return hook

    # --- stepping ---------------------------------------------------------------------------

    def _lr_tensor(self, device: torch.device) -> Tensor:
        t = self._lr_tensors.get(device)
        if t is None:
            t = self._lr_tensors[device] = torch.tensor(self.lr, dtype=torch.float32, device=device)
        return t

    def _noise_key(self, i: int) -> int:
        """The stochastic-rounding key of parameter i at its current step: a 32-bit hash of
        (seed, parameter name, step), so draws do not depend on the order parameters step in."""
        key = zlib.crc32(self._names[i].encode())
        mixed = (self.seed * 1_000_003 + key) * 1_000_003 + self._counts[i]
        return mix32((mixed ^ (mixed >> 32)) & 0xFFFFFFFF)

    def _noise(self, i: int, start: int, n: int, device: torch.device) -> Tensor:
        """int32 [n] in [0, 2**16): stochastic rounding of values start..start+n of parameter i
        at its current step (`rounding_noise`, compiled with the step: one pass, no int64
        temporaries). The key and offset go in as device tensors made by a fill, not a copy:
        no host sync."""
        key = torch.full((), self._noise_key(i), dtype=torch.int64, device=device)
        offset = torch.full((), start, dtype=torch.int64, device=device)
        return self._draw(key, offset, n)

    def _own_step(self, i: int) -> None:
        if self._params[i].grad is None:
            return
        self._update_param(i)
        self._counts[i] += 1

    def _memory_key(self, i: int) -> tuple:
        """What decides the memory of `_update_param(i)`: the parameter's, its gradient's and
        its state's layouts under this optimizer's settings."""
        p = self._params[i]
        st = self._state[i]
        state = tuple((k, *op_memory.shape_key(t)) for k, t in sorted(st.items()))
        settings = (self.kind, self.bf16_compensation, self._cpu_kernel)
        return (*op_memory.shape_key(p, p.grad), state, settings)

    @op_memory.replayable(lambda self, i: self._memory_key(i))
    def _update_param(self, i: int) -> None:
        """Update parameter i (that has a gradient) and its state in place, step count aside."""
        p = self._params[i]
        st = self._state[i]
        st["step"] += 1
        local = _local(p.detach()).view(-1)  # [n]
        grad = _local(p.grad).reshape(-1)  # [n]
        comp = st["kahan"].view(-1) if "kahan" in st else None
        stochastic = self.bf16_compensation == "stochastic" and p.dtype == torch.bfloat16
        lr = self._lr_tensor(local.device)
        hyper = (*self.betas, self.eps, self.weight_decay)
        if self._cpu_kernel and comp is None and cpu_kernels.supports(local, grad):
            key = self._noise_key(i) if stochastic else None
            cpu_kernels.adamw8bit_step_(
                local, grad, *(st[k] for k in _CODE_KEYS), st["step"], lr, *hyper, noise_key=key
            )
            return
        chunk = _CHUNK_BLOCKS * BLOCK
        n = local.numel()
        starts = range(0, n, chunk)
        if torch_internals.is_fake(local):
            # The memory estimate: every chunk allocates and frees the same temporaries, so
            # the first and the last (possibly partial) chunk give the step's peak.
            starts = sorted({0, starts[-1]})
        for start in starts:
            end = min(start + chunk, n)
            piece = slice(start, end)
            extra = (
                comp[piece] if comp is not None else None,
                self._noise(i, start, end - start, local.device) if stochastic else None,
            )
            if self.kind != "adamw8bit":
                moments = [st["exp_avg"].view(-1)[piece], st["exp_avg_sq"].view(-1)[piece]]
                self._update(local[piece], grad[piece], *moments, st["step"], lr, *extra, *hyper)
                continue
            whole = (end - start) // BLOCK * BLOCK  # chunks are whole blocks but for the last
            b0 = start // BLOCK
            if whole:
                nb = whole // BLOCK
                rows = slice(b0, b0 + nb)
                self._update(
                    _as_blocks(local[piece], nb),
                    _as_blocks(grad[piece], nb),
                    *(st[k][rows] for k in _CODE_KEYS),
                    st["step"],
                    lr,
                    *(_as_blocks(t, nb) for t in extra),
                    *hyper,
                )
            if end - start > whole:
                # The parameter's last partial block: padded copies (zero gradient, so the
                # padded moments stay zero), and the values written back.
                tail = slice(start + whole, end)
                p_tail = _pad_block(local[tail])
                comp_tail = _pad_block(extra[0][whole:]) if extra[0] is not None else None
                noise_tail = _pad_block(extra[1][whole:]) if extra[1] is not None else None
                rows = slice(b0 + whole // BLOCK, b0 + whole // BLOCK + 1)
                self._update(
                    p_tail,
                    _pad_block(grad[tail]),
                    *(st[k][rows] for k in _CODE_KEYS),
                    st["step"],
                    lr,
                    comp_tail,
                    noise_tail,
                    *hyper,
                )
                r = end - start - whole
                local[tail].copy_(p_tail.view(-1)[:r])
                if comp_tail is not None:
                    comp[tail].copy_(comp_tail.view(-1)[:r])

    @property
    def in_backward(self) -> bool:
        return self._in_backward

    def set_lr(self, lr: float) -> None:
        """The lr of the next step; call before its backward (in-backward steps run inside it)."""
        self.lr = float(lr)
        for opt in self._torch:
            for group in opt.param_groups:
                group["lr"] = self.lr
        for t in self._lr_tensors.values():
            t.fill_(self.lr)

    @torch.no_grad()
    def step(self) -> None:
        """Step every parameter that has a gradient; with in_backward this already happened."""
        if self._in_backward:
            return
        if self.engine == "torch_fused":
            self._torch[0].step()
            for i, p in enumerate(self._params):
                self._counts[i] += p.grad is not None
        else:
            for i in range(len(self._params)):
                self._own_step(i)

    def zero_grad(self) -> None:
        """Drop the gradients (set to None); with in_backward the hooks already did."""
        if self._in_backward:
            return
        for p in self._params:
            p.grad = None

    def remove_hooks(self) -> None:
        """Detach the in-backward hooks (e.g. before building another optimizer on the model)."""
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()

    # --- state ------------------------------------------------------------------------------

    def _param_state(self, i: int) -> dict[str, Tensor]:
        if self.engine == "torch_fused":
            return self._torch_for(i).state[self._params[i]]
        return self._state[i]

    def state_bytes(self) -> int:
        """Bytes of every optimizer state tensor held (this rank's shards under FSDP2)."""
        total = 0
        for i in range(len(self._params)):
            for t in self._param_state(i).values():
                local = _local(t)
                total += local.numel() * local.element_size()
        return total

    def state_dict(self) -> dict[str, Any]:
        """Tensors (this rank's shards, not copies), ints, floats and strings only, so
        `torch.load(weights_only=True)` reads it back. Under FSDP or --ep the moments shaped
        like a parameter's part are DTensors of the whole (`_whole`), which a sharded
        checkpoint saves once and reads back under another --ep."""
        return {
            "format": _STATE_FORMAT,
            "kind": self.kind,
            "lr": self.lr,
            "seed": self.seed,
            "state": {
                name: {
                    k: _whole(_local(t).detach(), self._params[i])
                    for k, t in self._param_state(i).items()
                }
                for i, name in enumerate(self._names)
            },
        }

    @torch.no_grad()
    def load_state_dict(self, sd: dict[str, Any]) -> None:
        """Copy a `state_dict()` in. The saved run must have had the same optimizer kind and
        parameters (names and shard shapes); the lr and in-backward setting may differ."""
        if sd.get("kind") != self.kind:
            raise UserError(
                f"the saved optimizer state is for --optimizer {sd.get('kind')} but this run uses "
                f"--optimizer {self.kind}; pass --optimizer {sd.get('kind')} or start a new run"
            )
        saved = sd["state"]
        if set(saved) != set(self._names):
            missing = sorted(set(self._names) - set(saved))[:3]
            extra = sorted(set(saved) - set(self._names))[:3]
            raise UserError(
                f"the saved optimizer state does not match this model's parameters (missing "
                f"{missing}, unexpected {extra}); resume with the same model or start a new run"
            )
        for i, name in enumerate(self._names):
            state = self._param_state(i)
            for key, t in list(state.items()):
                if key == "kahan" and key not in saved[name]:
                    t.zero_()  # compensation switched on at resume: start with no residue
                    continue
                value = saved[name].get(key)
                value = None if value is None else _local(value)
                local = _local(t)
                if value is None or value.shape != local.shape:
                    have = None if value is None else tuple(value.shape)
                    raise UserError(
                        f"the saved optimizer state {name}.{key} has shape {have} but this run "
                        f"needs {tuple(local.shape)}; resume with the same model and number of "
                        "GPUs, or start a new run"
                    )
                if t is local and _same_layout(t, value):
                    # Take the loaded tensor as the state (the zeros it replaces are freed): a
                    # resume then never holds the optimizer state twice. A checkpoint loaded
                    # memory-mapped stays a private copy-on-write mapping of the file.
                    state[key] = value
                else:
                    local.copy_(value)
            self._counts[i] = int(state["step"].item())
        self.seed = int(sd.get("seed", self.seed))
        self.set_lr(float(sd.get("lr", self.lr)))
