"""LoRA on the native decoder: frozen base projections plus trainable low-rank updates.

`apply_lora(model, spec, ...)` replaces the seven projections of every block in place:

    target projection      LoRALinear     y = x W^T + b + (alpha / r) * (dropout(x) A^T) B^T
    other projection       FrozenLinear   y = x W^T + b
                           W frozen, stored in the base dtype or as NF4 codes + scales;
                           A [r, in] and B [out, r] trainable, in the compute dtype

and freezes every other weight (embedding, norms, head). The adapters are ordinary
`nn.Parameter`s living in the same block modules as the weights they adapt, and NF4 storage is
two plain tensors (`weight_codes` uint8, `weight_scales` fp32) registered as frozen parameters,
so per-block compilation, activation policies, checkpoint names and FSDP2's per-block
`fully_shard` (which shards frozen and trainable parameters of one block in one unit) see a
module tree of ordinary parameters. Names stay HF-mappable: `layers.3.attention.wq.weight` is
still the base weight, its adapter is `layers.3.attention.wq.lora_a` / `.lora_b`.

Dtypes: the compute dtype is the activations' dtype (the run's --dtype); adapters, norms,
biases and the output head are kept in it. The frozen projections (and an untied embedding) may
be stored narrower (`base_dtype`, e.g. bf16 under fp32 compute) or, projections only, in NF4;
every matmul runs in the compute dtype, on the weight converted (or dequantized) just before it. A converted weight is never kept for
backward: `_FrozenMatmul` rebuilds it there from the stored form, so memory holds the stored
form only (plus one layer's converted weight at a time).
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from compiletune.choices import Quantize, choices
from compiletune.errors import UserError
from compiletune.gather import full_tensor
from compiletune.ops.grouped_mm import grouped_mm
from compiletune.ops.op_memory import replayable, shape_key

from .args import ModelArgs
from .decoder import RMSNorm, Transformer
from .linear_attention import GatedRMSNorm
from .lora_targets import (
    FUSED_PARTS,
    LATENT_TARGETS,
    LINEAR_ATTENTION_TARGETS,
    SPEC_TARGETS,
    TARGETS,
)
from .lora_targets import parse_targets as parse_targets  # re-exported: the build's import
from .moe import Experts
from .names import strip_wrappers
from .nf4 import BLOCK, dequantize_nf4, quantize_nf4

QUANTIZE = choices(Quantize)


@dataclass(frozen=True)
class LoRASpec:
    """What `--lora-*` asks for. targets: short names from `TARGETS`, in that order (none: the
    decoder is not adapted). vision: the vision tower's projections by the checkpoint's module
    names (`q_proj`, `fc1`, ...), sorted; a model without a tower ignores them
    (models/vision/lora.py)."""

    rank: int
    alpha: float
    dropout: float = 0.0
    targets: tuple[str, ...] = SPEC_TARGETS
    vision: tuple[str, ...] = ()

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


def model_targets(args: ModelArgs, targets: tuple[str, ...]) -> tuple[str, ...]:
    """`targets` less the projections no layer of this model has: q/k/v/o live in attention
    layers, in_proj_* / out_proj in linear-attention ones; latent attention (MLA) has o, q or
    q_a/q_b, and kv_a/kv_b instead of k/v. Targets none of the model's layers has are refused
    (one line naming them); no targets (a run that adapts the vision tower alone) stay none."""
    if not targets:
        return ()
    kinds = {args.layer_kind(i) for i in range(args.n_layers)}
    fused = ("in_proj_qkvz", "in_proj_ba")
    mixer = (*(fused if args.linear_fused else LINEAR_ATTENTION_TARGETS[:4]), "out_proj")

    def present(t: str) -> bool:
        if t in LINEAR_ATTENTION_TARGETS:
            return "linear" in kinds and t in mixer
        if t in LATENT_TARGETS:
            return bool(args.kv_rank) and (bool(args.q_rank) or not t.startswith("q"))
        if args.kv_rank and t in ("q", "k", "v"):
            return t == "q" and not args.q_rank
        if t in ("q", "k", "v", "o"):
            return bool(kinds - {"linear"})
        return True  # the MLP's (or the experts')

    keep = tuple(t for t in targets if present(t))
    if not keep:
        raise UserError(
            f"--lora-targets {','.join(targets)}: this model has none of these projections"
        )
    return keep


class _FrozenMatmul(torch.autograd.Function):
    """x [..., in] @ W^T -> [..., out] for a frozen W stored in another form: a float tensor of
    another dtype (`scales` None) or NF4 codes + scales. W is rebuilt in x's dtype in forward
    and again in backward rather than saved, so no full-precision copy of it outlives the
    matmul; under compile the rebuild fuses into one elementwise kernel."""

    @staticmethod
    def forward(ctx, x: Tensor, stored: Tensor, scales: Tensor | None) -> Tensor:
        ctx.quantized = scales is not None
        if ctx.quantized:
            ctx.save_for_backward(stored, scales)
        else:
            ctx.save_for_backward(stored)
        return _frozen_linear(x, stored, scales)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor | None, None, None]:
        if not ctx.needs_input_grad[0]:
            return None, None, None
        if ctx.quantized:
            stored, scales = ctx.saved_tensors
        else:
            (stored,), scales = ctx.saved_tensors, None
        return _frozen_linear_grad(grad, stored, scales), None, None


# The memory estimate runs these once per shape and replays their bytes (ops/op_memory.py).
@replayable(lambda x, stored, scales: shape_key(x, stored, scales))
def _frozen_linear(x: Tensor, stored: Tensor, scales: Tensor | None) -> Tensor:
    """x @ W^T for W rebuilt from its stored form (freed at once)."""
    return F.linear(x, _materialise(stored, scales, x.dtype))


@replayable(lambda grad, stored, scales: shape_key(grad, stored, scales))
def _frozen_linear_grad(grad: Tensor, stored: Tensor, scales: Tensor | None) -> Tensor:
    """grad @ W for W rebuilt from its stored form (freed at once)."""
    return grad @ _materialise(stored, scales, grad.dtype)


def _materialise(stored: Tensor, scales: Tensor | None, dtype: torch.dtype) -> Tensor:
    """The weight in `dtype` from its stored form; NF4 codes of stacked experts [E, out, in/2]
    are dequantized as the [E * out, in] matrix they were quantized as."""
    if scales is not None:
        flat = dequantize_nf4(stored.flatten(0, -2), scales.flatten(0, -2), dtype)
        return flat.view(*stored.shape[:-1], -1)
    return stored.to(dtype)


class _FrozenGroupedMatmul(torch.autograd.Function):
    """`_FrozenMatmul` for stacked experts: rows of x [n, in] grouped by expert (offs) times
    each expert's frozen W [E, out, in] transposed, W rebuilt in x's dtype in forward and again
    in backward, never saved."""

    @staticmethod
    def forward(ctx, x: Tensor, stored: Tensor, scales: Tensor | None, offs: Tensor) -> Tensor:
        ctx.quantized = scales is not None
        ctx.save_for_backward(offs, stored, *([scales] if ctx.quantized else []))
        return grouped_mm(x, _materialise(stored, scales, x.dtype).transpose(-2, -1), offs)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor | None, None, None, None]:
        if not ctx.needs_input_grad[0]:
            return None, None, None, None
        offs, stored, *scales = ctx.saved_tensors
        weight = _materialise(stored, scales[0] if scales else None, grad.dtype)
        return grouped_mm(grad.contiguous(), weight, offs), None, None, None


class FrozenLinear(nn.Module):
    """A frozen projection whose weight is stored as `weight` [out, in] (any float dtype) or, for
    NF4, as `weight_codes` uint8 [out, in // 2] + `weight_scales` fp32 [out, in // 64]; the
    output is in the input's dtype."""

    def __init__(self, linear: nn.Linear, base_dtype: torch.dtype, quantize: str | None) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        w = linear.weight.detach()
        if quantize == "nf4":
            codes, scales = quantize_nf4(w)
            self.weight = None
            self.weight_codes = nn.Parameter(codes, requires_grad=False)
            self.weight_scales = nn.Parameter(scales, requires_grad=False)
        else:
            self.weight = nn.Parameter(w.to(base_dtype), requires_grad=False)
            self.weight_codes = self.weight_scales = None
        # Biases (of q/k/v) are tiny: kept with the activations, never quantized.
        self.bias = linear.bias
        if self.bias is not None:
            self.bias.requires_grad_(False)
        # (x, weight) -> x weight^T in float8 (set by --fp8, compiletune/fp8.py); None: as stored
        self.float8: Callable[[Tensor, Tensor], Tensor] | None = None

    @property
    def quantized(self) -> bool:
        return self.weight_codes is not None

    def forward(self, x: Tensor) -> Tensor:
        """x [..., in] -> [..., out] in x's dtype."""
        if self.quantized:
            y = _FrozenMatmul.apply(x, self.weight_codes, self.weight_scales)
        elif self.float8 is not None:
            y = self.float8(x, self.weight)
        elif self.weight.dtype != x.dtype:
            y = _FrozenMatmul.apply(x, self.weight, None)
        else:
            y = F.linear(x, self.weight)
        return y if self.bias is None else y + self.bias.to(x.dtype)

    @torch.no_grad()
    def dense_weight(self, dtype: torch.dtype = torch.float32) -> Tensor:
        """The weight as a float tensor [out, in] (dequantized for NF4). Under FSDP2 the stored
        form is gathered whole first (a collective: every rank calls this)."""
        if self.quantized:
            return dequantize_nf4(_whole(self.weight_codes), _whole(self.weight_scales), dtype)
        return _whole(self.weight).to(dtype)

    def extra_repr(self) -> str:
        stored = "nf4" if self.quantized else str(self.weight.dtype).removeprefix("torch.")
        float8 = ", matmul=float8" if self.float8 is not None else ""
        return f"in={self.in_features}, out={self.out_features}, stored={stored}{float8}"


def _whole(t: Tensor) -> Tensor:
    """A parameter's whole tensor: gathered if FSDP2 sharded it (a collective), else itself."""
    if not hasattr(t, "full_tensor"):
        return t

    return full_tensor(t)


class LoRALinear(FrozenLinear):
    """A `FrozenLinear` plus a trainable low-rank update (dropout on the adapter's input only,
    as PEFT does): y = frozen(x) + scale * (dropout(x) A^T) B^T, A [r, in], B [out, r]."""

    def __init__(
        self,
        linear: nn.Linear,
        spec: LoRASpec,
        base_dtype: torch.dtype,
        quantize: str | None,
        dtype: torch.dtype,
        generator: torch.Generator,
    ) -> None:
        super().__init__(linear, base_dtype, quantize)
        self.scale = spec.scale
        self.dropout = spec.dropout
        device = linear.weight.device
        # PEFT's default init: A ~ kaiming_uniform(a=sqrt(5)) = U(-1/sqrt(in), 1/sqrt(in)),
        # B = 0, so the adapted model starts equal to the base. Drawn on the CPU so a seed gives
        # the same adapters on every device.
        bound = 1.0 / math.sqrt(self.in_features)
        a = torch.empty(spec.rank, self.in_features).uniform_(-bound, bound, generator=generator)
        self.lora_a = nn.Parameter(a.to(device=device, dtype=dtype))
        self.lora_b = nn.Parameter(
            torch.zeros(self.out_features, spec.rank, device=device, dtype=dtype)
        )

    def forward(self, x: Tensor) -> Tensor:
        """x [..., in] -> [..., out]; the adapter's hidden is [..., r]."""
        y = super().forward(x)
        a_in = F.dropout(x, self.dropout, self.training) if self.dropout > 0 else x
        return y + F.linear(F.linear(a_in, self.lora_a), self.lora_b) * self.scale

    @torch.no_grad()
    def merged_weight(self, dtype: torch.dtype = torch.float32) -> Tensor:
        """W + scale * B A [out, in], computed in fp32, returned in `dtype`."""
        delta = _whole(self.lora_b).float() @ _whole(self.lora_a).float()
        return (self.dense_weight(torch.float32) + self.scale * delta).to(dtype)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, rank={self.lora_a.shape[0]}, scale={self.scale:g}"


class FrozenExperts(Experts):
    """Frozen stacked experts (see models/moe.py): w13 [E, 2F, d] and w2 [E, d, F] stored in
    the base dtype, or as NF4 (`w13_codes` uint8 [E, 2F, d // 2] + `w13_scales` fp32
    [E, 2F, d // 64], the same for w2); every grouped matmul runs in the input's dtype."""

    def __init__(self, experts: Experts, base_dtype: torch.dtype, quantize: str | None) -> None:
        nn.Module.__init__(self)
        self.n_experts, self.dim, self.ffn_dim = experts.n_experts, experts.dim, experts.ffn_dim
        self.activation = experts.activation
        self.clamp, self.alpha = experts.clamp, experts.alpha
        self.b13, self.b2 = experts.b13, experts.b2  # the experts' biases: frozen, as they are
        for bias in (self.b13, self.b2):
            if bias is not None:
                bias.requires_grad_(False)
        for name in ("w13", "w2"):
            w = getattr(experts, name).detach()
            if quantize == "nf4":
                codes, scales = quantize_nf4(w.flatten(0, 1))
                setattr(self, name, None)
                codes, scales = codes.view(*w.shape[:2], -1), scales.view(*w.shape[:2], -1)
                setattr(self, f"{name}_codes", nn.Parameter(codes, requires_grad=False))
                setattr(self, f"{name}_scales", nn.Parameter(scales, requires_grad=False))
            else:
                setattr(self, name, nn.Parameter(w.to(base_dtype), requires_grad=False))
                setattr(self, f"{name}_codes", None)
                setattr(self, f"{name}_scales", None)

    @property
    def quantized(self) -> bool:
        return self.w13_codes is not None

    def _stored(self, name: str) -> tuple[Tensor, Tensor | None]:
        if self.quantized:
            return getattr(self, f"{name}_codes"), getattr(self, f"{name}_scales")
        return getattr(self, name), None

    def project(self, name: str, x: Tensor, offs: Tensor) -> Tensor:
        stored, scales = self._stored(name)
        if scales is None and stored.dtype == x.dtype:
            return grouped_mm(x, stored.transpose(-2, -1), offs)
        return _FrozenGroupedMatmul.apply(x, stored, scales, offs)

    @torch.no_grad()
    def dense_weight(self, name: str, dtype: torch.dtype = torch.float32) -> Tensor:
        """Stacked weight `name` as floats [E, out, in] (gathered whole under FSDP2)."""
        stored, scales = self._stored(name)
        return _materialise(_whole(stored), None if scales is None else _whole(scales), dtype)

    def shape(self, name: str) -> tuple[int, int, int]:
        rows = 2 * self.ffn_dim if name == "w13" else self.dim
        return (self.n_experts, rows, self.dim if name == "w13" else self.ffn_dim)

    def extra_repr(self) -> str:
        stored = "nf4" if self.quantized else str(self.w13.dtype).removeprefix("torch.")
        return f"{super().extra_repr()}, stored={stored}"


# LoRA target short names -> the stacked expert weight they adapt (gate and up share w13)
EXPERT_WEIGHTS = {"gate": "w13", "up": "w13", "down": "w2"}


class LoRAExperts(FrozenExperts):
    """`FrozenExperts` plus one low-rank update per expert on each adapted weight (`adapted`:
    "w13" and/or "w2"): W_e + scale * B_e A_e, A `lora_a_<w>` [E, r, in], B `lora_b_<w>`
    [E, out, r], computed as two more grouped matmuls over the same rows (PEFT's LoRA on a
    3-D expert parameter)."""

    def __init__(
        self,
        experts: Experts,
        spec: LoRASpec,
        adapted: tuple[str, ...],
        base_dtype: torch.dtype,
        quantize: str | None,
        dtype: torch.dtype,
        generator: torch.Generator,
    ) -> None:
        super().__init__(experts, base_dtype, quantize)
        self.scale, self.adapted = spec.scale, adapted
        device = experts.w13.device
        for name in adapted:
            e, out, inp = self.shape(name)
            bound = 1.0 / math.sqrt(inp)  # PEFT's kaiming_uniform(a=sqrt(5)) of lora_A, B = 0
            a = torch.empty(e, spec.rank, inp).uniform_(-bound, bound, generator=generator)
            setattr(self, f"lora_a_{name}", nn.Parameter(a.to(device=device, dtype=dtype)))
            b = torch.zeros(e, out, spec.rank, device=device, dtype=dtype)
            setattr(self, f"lora_b_{name}", nn.Parameter(b))

    def project(self, name: str, x: Tensor, offs: Tensor) -> Tensor:
        y = super().project(name, x, offs)
        if name not in self.adapted:
            return y
        a, b = getattr(self, f"lora_a_{name}"), getattr(self, f"lora_b_{name}")
        hidden = grouped_mm(x, a.transpose(-2, -1), offs)  # [n, r]
        return y + grouped_mm(hidden, b.transpose(-2, -1), offs) * self.scale

    @torch.no_grad()
    def merged_weight(self, name: str, dtype: torch.dtype = torch.float32) -> Tensor:
        """W + scale * B A per expert [E, out, in], in fp32, returned in `dtype`."""
        w = self.dense_weight(name, torch.float32)
        if name in self.adapted:
            a = _whole(getattr(self, f"lora_a_{name}")).float()
            b = _whole(getattr(self, f"lora_b_{name}")).float()
            w = w + self.scale * torch.bmm(b, a)
        return w.to(dtype)


class CastEmbedding(nn.Embedding):
    """An embedding stored in one dtype whose output is in the compute dtype."""

    compute_dtype: torch.dtype = torch.float32

    def forward(self, tokens: Tensor) -> Tensor:
        return super().forward(tokens).to(self.compute_dtype)


def nf4_unfit(args: ModelArgs) -> str | None:
    """Why the projections of `args` cannot be stored in NF4 (an input size that does not split
    into blocks of 64), or None when they can."""
    inputs = {
        "dim": args.dim,
        "n_heads * head_dim": args.n_heads * args.hd,
        "ffn_dim": args.ffn_dim,
    }
    if args.n_experts:
        inputs["moe_ffn_dim"] = args.moe_ffn_dim
    for name, size in inputs.items():
        if size % BLOCK:
            return f"{name} = {size} is not a multiple of the NF4 block of {BLOCK}"
    return None


def block_adapter(
    spec: LoRASpec,
    *,
    dtype: torch.dtype,
    base_dtype: torch.dtype | None = None,
    quantize: str | None = None,
    seed: int = 0,
) -> Callable[[nn.Module], None]:
    """A function that turns one block into its LoRA form in place: the seven projections become
    `LoRALinear` (targets) or `FrozenLinear` (the rest), norms and biases go to `dtype`, and
    every base weight is frozen. Call it on the blocks in order: adapters are drawn from one CPU
    generator seeded with `seed` (the same adapters on every device), block after block.

    Handing it to `build_model` / `from_hf` as `on_block` converts each block as soon as it is
    loaded, so a QLoRA model never exists at full size; `apply_lora` then finishes the model.
    """
    base_dtype = base_dtype or dtype
    if quantize not in (None, *QUANTIZE):
        raise ValueError(f"unknown base quantization {quantize!r}")
    generator = torch.Generator().manual_seed(seed)

    @torch.no_grad()
    def adapt(block: nn.Module) -> None:
        for p in block.parameters():
            p.requires_grad_(False)
        for short, (path, _) in TARGETS.items():
            parent_path, attr = path.rsplit(".", 1)
            parent = block.get_submodule(parent_path)
            linear = getattr(parent, attr, None)
            if linear is None:
                continue  # the other form (fused or split) of these projections
            adapted = short in spec.targets and short not in FUSED_PARTS
            if short in EXPERT_WEIGHTS and getattr(block, "in_moe_model", False) and not block.moe:
                # In a MoE model gate/up/down name the experts' weights: transformers 5 + PEFT
                # map those names to the experts (target_parameters) and cannot adapt the MLP
                # of a dense layer, so neither do we (its adapter would not load in PEFT).
                adapted = False
            if short in FUSED_PARTS:
                targeted = [t in spec.targets for t in FUSED_PARTS[short]]
                if any(targeted) and not all(targeted):
                    raise UserError(
                        f"this model fuses {'/'.join(FUSED_PARTS[short])} into one projection "
                        f"({TARGETS[short][1]}); --lora-targets must name all of them or none"
                    )
                adapted = adapted or all(targeted)
            if isinstance(linear, FrozenLinear):
                raise ValueError("this block has LoRA already")
            if linear.bias is not None:
                linear.bias.data = linear.bias.data.to(dtype)
            if adapted:
                new = LoRALinear(linear, spec, base_dtype, quantize, dtype, generator)
            else:
                new = FrozenLinear(linear, base_dtype, quantize)
            setattr(parent, attr, new)  # the old weight goes with the old module
        per_layer = getattr(
            block, "per_layer", None
        )  # per-layer input: frozen, NF4 where it divides
        if per_layer is not None and not isinstance(per_layer.gate, FrozenLinear):
            for attr in ("gate", "up"):
                linear = getattr(per_layer, attr)
                nf4 = quantize if linear.in_features % BLOCK == 0 else None
                setattr(per_layer, attr, FrozenLinear(linear, base_dtype, nf4))
        moe = getattr(block, "feed_forward", None)
        if isinstance(getattr(moe, "experts", None), Experts):
            _adapt_experts(moe, spec, base_dtype, quantize, dtype, generator)
        for module in block.modules():
            if isinstance(module, RMSNorm | GatedRMSNorm):
                module.weight.data = module.weight.data.to(dtype)

    return adapt


def _adapt_experts(
    moe: nn.Module,
    spec: LoRASpec,
    base_dtype: torch.dtype,
    quantize: str | None,
    dtype: torch.dtype,
    generator: torch.Generator,
) -> None:
    """A MoE feed-forward's LoRA form: experts frozen (LoRA on the targeted weights), the router
    frozen in the compute dtype (it is tiny, and routing decisions should not round)."""
    if isinstance(moe.experts, FrozenExperts):
        raise ValueError("this block has LoRA already")
    for p in (moe.router_scale, moe.expert_scale):  # the router's scales (experts beside an MLP)
        if p is not None:
            p.data = p.data.to(dtype)
    if moe.router.bias is not None:  # (the experts' biases stay frozen)
        moe.router.bias.data = moe.router.bias.data.to(dtype)
    if hasattr(moe, "w1"):  # experts beside an MLP: gate/up/down adapt the MLP, experts frozen
        moe.experts = FrozenExperts(moe.experts, base_dtype, quantize)
        moe.router.weight.data = moe.router.weight.data.to(dtype)
        return
    targeted = [t for t in ("gate", "up") if t in spec.targets]
    if len(targeted) == 1:
        raise UserError(
            "MoE experts keep gate and up in one weight (PEFT's gate_up_proj); --lora-targets "
            "must name both or neither"
        )
    adapted = tuple(dict.fromkeys(EXPERT_WEIGHTS[t] for t in spec.targets if t in EXPERT_WEIGHTS))
    if adapted and spec.dropout:
        raise UserError(
            f"--lora-dropout {spec.dropout}: PEFT's LoRA on expert weights has no dropout; "
            "pass --lora-dropout 0 or leave gate/up/down out of --lora-targets"
        )
    if adapted:
        moe.experts = LoRAExperts(
            moe.experts, spec, adapted, base_dtype, quantize, dtype, generator
        )
    else:
        moe.experts = FrozenExperts(moe.experts, base_dtype, quantize)
    moe.router.weight.data = moe.router.weight.data.to(dtype)


def lora_experts(model: nn.Module) -> list[tuple[str, LoRAExperts]]:
    """(native module name, module) of every adapted experts module, in model order."""
    return [(strip_wrappers(n), m) for n, m in model.named_modules() if isinstance(m, LoRAExperts)]


@torch.no_grad()
def apply_lora(
    model: Transformer,
    spec: LoRASpec,
    *,
    dtype: torch.dtype,
    base_dtype: torch.dtype | None = None,
    quantize: str | None = None,
    seed: int = 0,
    blocks_adapted: bool = False,
) -> Transformer:
    """Turn `model` into a LoRA model in place (see the module docstring) and return it.

    dtype: the compute dtype (activations, adapters, norms, biases).
    base_dtype: storage of the frozen projections (default `dtype`) and of an untied embedding;
    with quantize="nf4" the projections are NF4 and base_dtype applies to the embedding only.
    The head stays in `dtype`. The model may be in any dtype when this is called.
    blocks_adapted: the blocks went through `block_adapter(...)` while loading; only the
    embedding, final norm and head are left to do (and the vision tower's adapters, `spec.vision`,
    drawn from a generator seeded with `seed` + 1).
    """
    base_dtype = base_dtype or dtype
    if not blocks_adapted:
        adapt = block_adapter(
            spec, dtype=dtype, base_dtype=base_dtype, quantize=quantize, seed=seed
        )
        for block in model.layers:
            adapt(block)
    for p in (model.tok_embeddings.weight, model.norm.weight, model.output.weight):
        p.requires_grad_(False)
    if model.per_layer_inputs is not None:  # the per-layer embedding: frozen too
        model.per_layer_inputs.requires_grad_(False).to(dtype)
    model.norm.weight.data = model.norm.weight.data.to(dtype)
    # The head stays in the compute dtype: storing it narrower would need a full-size converted
    # copy during the loss, which is where memory peaks. An untied embedding (a lookup) is
    # stored in base_dtype; a tied one is the head. Assigning .data keeps a tie intact.
    model.output.weight.data = model.output.weight.data.to(dtype)
    if not model.args.tie_embeddings and base_dtype != dtype:
        emb = model.tok_embeddings
        cast = CastEmbedding(emb.num_embeddings, emb.embedding_dim, device="meta")
        cast.weight = emb.weight
        cast.weight.data = cast.weight.data.to(base_dtype)
        cast.compute_dtype = dtype
        model.tok_embeddings = cast
    else:
        model.tok_embeddings.weight.data = model.tok_embeddings.weight.data.to(dtype)
    if spec.vision and hasattr(model, "adapt_tower"):  # a vision-language model's tower
        model.adapt_tower(spec, dtype, seed)
    model.lora_spec = spec
    model.lora_base_dtype = base_dtype  # what a merged export is saved in
    return model


def lora_modules(model: nn.Module) -> list[tuple[str, LoRALinear]]:
    """(native module name, module) of every adapted projection, in model order; names have
    compile/checkpoint wrapper parts removed."""

    return [(strip_wrappers(n), m) for n, m in model.named_modules() if isinstance(m, LoRALinear)]


@contextlib.contextmanager
def adapters_disabled(model: nn.Module) -> Iterator[None]:
    """The base model inside the block: every adapter's scale is 0 (the LoRA reference of
    DPO/IPO: the same weights, no second copy). Compiled blocks guard on the scale, so run
    them eagerly inside (`torch.compiler.set_stance("force_eager")`)."""
    modules = [m for m in model.modules() if isinstance(m, LoRALinear | LoRAExperts)]
    scales = [m.scale for m in modules]
    for m in modules:
        m.scale = 0.0
    try:
        yield
    finally:
        for m, scale in zip(modules, scales, strict=True):
            m.scale = scale


def is_lora(model: nn.Module) -> bool:
    return getattr(model, "lora_spec", None) is not None


def dense_tensors(
    model: nn.Module, merge: bool = False
) -> list[tuple[str, tuple[int, ...], Callable[[], Tensor]]]:
    """(native name, shape, make) for every tensor of the plain model this one stands for: NF4
    weights dequantized, adapters folded into their weights when `merge` and left out otherwise.
    A plain `Transformer` gives its own parameters. `make()` builds one tensor at a time (fp32 for
    a rebuilt weight), so an exporter never holds two copies of the model. A tied head is listed
    once, as the embedding. Names keep compile/checkpoint wrapper parts (callers map them)."""
    out: list[tuple[str, tuple[int, ...], Callable[[], Tensor]]] = []
    seen: set[int] = set()
    for mod_name, module in model.named_modules():
        prefix = f"{mod_name}." if mod_name else ""
        if isinstance(module, FrozenExperts):
            for name in ("w13", "w2"):
                merged = merge and isinstance(module, LoRAExperts)
                fn = module.merged_weight if merged else module.dense_weight
                out.append((prefix + name, module.shape(name), functools.partial(fn, name)))
            for name in ("b13", "b2"):
                bias = getattr(module, name)
                if bias is not None:
                    out.append((prefix + name, tuple(bias.shape), lambda b=bias: b.detach()))
            continue
        if isinstance(module, FrozenLinear):
            make = (
                module.merged_weight
                if merge and isinstance(module, LoRALinear)
                else module.dense_weight
            )
            out.append((prefix + "weight", (module.out_features, module.in_features), make))
            if module.bias is not None:
                bias = module.bias
                out.append((prefix + "bias", tuple(bias.shape), lambda b=bias: b.detach()))
            continue
        for p_name, p in module.named_parameters(recurse=False):
            if id(p) not in seen:
                seen.add(id(p))
                out.append((prefix + p_name, *_plain_entry(p)))
    return out


def _plain_entry(p: Tensor) -> tuple[tuple[int, ...], Callable[[], Tensor]]:
    """(shape, make) of a plain parameter in `dense_tensors`. One --ep split holds E/N of the
    experts (`whole_rows` E): listed at the whole shape, made as this rank's rows that still
    name their group, so the exporter's gather (`gather.full_tensor`) joins the ranks' rows
    one tensor at a time."""
    rows = getattr(p, "whole_rows", None)
    if rows is None:
        return tuple(p.shape), p.detach

    def make() -> Tensor:
        t = p.detach()
        t.expert_group = p.expert_group
        return t

    return (rows, *p.shape[1:]), make
