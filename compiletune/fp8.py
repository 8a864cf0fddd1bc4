"""`--fp8 rowwise|tensorwise`: the blocks' linears as torchao's float8 training linears.

torchao (the optional extra `compiletune[fp8]`) owns the scaling recipes: each converted
`nn.Linear` casts its input, weight and output gradient to float8 with dynamic scales (one per
tensor, or one per row with rowwise) and runs its three matmuls in float8, keeping its weight
(and so optimizer state and checkpoints) in the parameter dtype. What stays in high precision:

    the embedding and the LM head       the fused head does its own chunked matmuls
    routers (MoE)                       a top-k choice that float8 noise would flip
    norms, biases-only layers           not matmuls
    LoRA adapters                       small, and trained in the parameter dtype
    an NF4 base (QLoRA)                 dequantized to the compute dtype for its matmul
    experts                             stacked weights and grouped matmuls, not nn.Linear
    a linear with a dimension that is not a multiple of 16 (float8 matmuls need it)

A LoRA layer's frozen base (models/lora.py `FrozenLinear`, not an nn.Linear) gets the same
casts and matmul through torchao's float8 matmul function (`FrozenFloat8`); the adapter beside
it stays in the parameter dtype.

Float8 matmuls need compute capability 8.9 (Ada, Hopper) or newer. On a CPU, torchao's
emulation (the same casts and scales, the matmuls in high precision) runs only when
COMPILETUNE_FP8_EMULATE=1: the tests' mode.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import torch
from torch import nn

from compiletune.errors import UserError
from compiletune.models.lora import FrozenLinear  # LoRA's base (and LoRALinear's)

EMULATE_ENV = "COMPILETUNE_FP8_EMULATE"
# names of linears kept in high precision wherever they sit in a block
KEEP = ("router",)


def _torchao() -> Any:
    try:
        from torchao import float8  # an optional extra
    except ImportError as e:
        raise UserError(
            f"--fp8 needs torchao ({e}); install it with: pip install 'compiletune[fp8]'"
        ) from e
    return float8


def check_device(device: torch.device) -> bool:
    """Whether float8 runs emulated here; refuses a device without float8 matmuls."""
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        if (major, minor) < (8, 9):
            name = torch.cuda.get_device_name(device)
            raise UserError(
                f"--fp8 needs a GPU of compute capability 8.9 or newer (Ada, Hopper, Blackwell); "
                f"{name} is {major}.{minor}: drop --fp8"
            )
        return False
    if os.environ.get(EMULATE_ENV) == "1":
        return True
    raise UserError(
        f"--fp8 runs float8 matmuls on a GPU (compute capability 8.9+); on {device.type} there "
        f"are none: drop --fp8 ({EMULATE_ENV}=1 emulates them, for tests)"
    )


def config(recipe: str, emulate: bool, fsdp: bool) -> Any:
    """torchao's Float8LinearConfig for `recipe` (tensorwise under FSDP: the sharded weights
    all-gathered in float8, half the bytes of bf16)."""
    f8 = _torchao()
    cfg = f8.Float8LinearConfig.from_recipe_name(recipe)
    gather = fsdp and recipe == "tensorwise"
    return dataclasses.replace(cfg, emulate=emulate, enable_fsdp_float8_all_gather=gather)


class FrozenFloat8:
    """A frozen weight's matmul in float8: x [..., in] @ weight^T [in, out] with torchao's
    casts and scales (its float8 linear's matmul function, so the recipe is torchao's). In
    eager mode that function's backward also forms the weight's gradient, which autograd
    drops (the weight is frozen); under --compile the graph never computes it."""

    def __init__(self, cfg: Any) -> None:
        f8 = _torchao()
        t = f8.float8_training_tensor
        self.matmul = f8.float8_linear.matmul_with_hp_or_float8_args
        self.cfg = cfg

        def mm(fast: bool) -> Any:
            return t.ScaledMMConfig(cfg.emulate, fast, False, cfg.pad_inner_dim)

        self.mm_config = t.LinearMMConfig(
            mm(cfg.gemm_config_output.use_fast_accum),
            mm(cfg.gemm_config_grad_input.use_fast_accum),
            mm(cfg.gemm_config_grad_weight.use_fast_accum),
        )

    def __call__(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return self.matmul.apply(x, weight.t(), self.mm_config, self.cfg)


def _eligible(module: nn.Module, name: str) -> str | None:
    """Why `module` (at `name` inside a block) stays in high precision; None to convert it."""
    frozen = isinstance(module, FrozenLinear)
    if type(module) is not nn.Linear and not frozen:
        return "not a plain linear"
    if name.rsplit(".", 1)[-1] in KEEP:
        return "a router"
    if frozen and module.quantized:
        return "an NF4 base (dequantized for its matmul)"
    out_f, in_f = (module.out_features, module.in_features) if frozen else module.weight.shape
    if in_f % 16 or out_f % 16:
        return f"[{out_f}, {in_f}] is not a multiple of 16"
    return None


def convert_blocks(
    model: nn.Module, recipe: str, emulate: bool, fsdp: bool
) -> tuple[int, list[str]]:
    """Every eligible linear of the model's blocks -> a float8 training linear, in place.
    Returns (how many were converted, the linears kept in high precision and why)."""
    f8 = _torchao()
    cfg = config(recipe, emulate, fsdp)
    kept: dict[str, str] = {}

    def keep(module: nn.Module, fqn: str) -> bool:
        why = _eligible(module, fqn)
        if why is not None and (type(module) is nn.Linear or isinstance(module, FrozenLinear)):
            kept[fqn.split(".", 1)[-1]] = why  # the first block's name stands for all
        return why is None

    before = sum(type(m) is nn.Linear for m in model.layers.modules())
    f8.convert_to_float8_training(model.layers, module_filter_fn=keep, config=cfg)
    after = sum(type(m) is nn.Linear for m in model.layers.modules())
    # LoRA's frozen projections: the same casts through one shared float8 matmul
    frozen = [
        m for fqn, m in model.layers.named_modules() if isinstance(m, FrozenLinear) and keep(m, fqn)
    ]
    matmul = FrozenFloat8(cfg) if frozen else None
    for module in frozen:
        module.float8 = matmul
    return before - after + len(frozen), [f"{name}: {why}" for name, why in sorted(kept.items())]


def precompute_scales(model: nn.Module, recipe: str) -> None:
    """Tensorwise under FSDP: the next step's float8 weight scales, for all weights in one
    all-reduce (torchao's), after each optimizer step."""
    if recipe != "tensorwise":
        return
    _torchao().precompute_float8_dynamic_scale_for_fsdp(model)
