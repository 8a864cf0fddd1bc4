"""LoRA on a vision tower's linear projections, named as PEFT names them.

`--lora-targets vision.NAME` adapts every linear projection of the tower whose module in
transformers' model is called NAME (PEFT's target_modules matching on the last part of the
name): `vision.q_proj,vision.v_proj` on Gemma 3's SigLIP layers, `vision.qkv` on Qwen3.5's
blocks; `vision.all-linear` adapts all of them, which is also what `--train-vision` asks for in a
LoRA run. The tower's names by family:

    Gemma 3    q_proj k_proj v_proj out_proj fc1 fc2 (SigLIP's layers; the projector is a
               plain matrix, not a linear module, so PEFT cannot adapt it and neither do we)
    Qwen3.5    qkv proj linear_fc1 linear_fc2 (linear_fc1/2: the blocks' MLP and the merger)
    Gemma 4    q_proj k_proj v_proj o_proj gate_proj up_proj down_proj input_proj
               embedding_projection

An adapted projection becomes a `LoRALinear` (models/lora.py) in the tower, the other tower
weights are frozen; adapters are saved under the tower's module names in transformers' model
(`base_model.model.model.vision_tower.encoder.layers.0.self_attn.q_proj.lora_A.weight`), so
`PeftModel.from_pretrained` on the family's ForConditionalGeneration loads them. Gemma 4 wraps
each projection's Linear in a clipping module (`q_proj.linear`): PEFT adapts the inner Linear,
inside the clipping, and so does `ClippedLoRALinear`.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

import torch
from torch import Tensor, nn

from compiletune.errors import UserError

from ..lora import FrozenLinear, LoRALinear, LoRASpec
from ..lora_targets import ALL_LINEAR, VISION_PREFIX
from ..names import strip_wrappers
from .gemma4 import ClippedLinear

# the module prefixes of the towers (and projectors) in transformers' models, as PEFT names them
PEFT_TOWER_PREFIXES = (
    "model.vision_tower.",
    "model.visual.",
    "model.embed_vision.",
    "model.multi_modal_projector.",
)
WRAPPED = ".linear"  # Gemma 4's projections: the Linear inside transformers' clipping module


def is_tower_module(peft_module: str) -> bool:
    """Is `peft_module` (a module name in transformers' model) in a vision tower?"""
    return peft_module.startswith(PEFT_TOWER_PREFIXES)


def target_name(peft_module: str) -> str:
    """The name --lora-targets gives a tower module: the last part of its name, its wrapper's
    for Gemma 4's `q_proj.linear`."""
    return peft_module.removesuffix(WRAPPED).rsplit(".", 1)[-1]


def resolve(requested: Iterable[str], available: Iterable[str], where: str) -> tuple[str, ...]:
    """`requested` tower names (`all-linear`: every one) checked against the tower's
    `available` ones; sorted. An unknown name is a UserError listing the tower's."""
    available = sorted(set(available))
    requested = tuple(requested)
    if ALL_LINEAR in requested:
        return tuple(available)
    unknown = [n for n in requested if n not in available]
    if unknown:
        raise UserError(
            f"--lora-targets {VISION_PREFIX}{unknown[0]}: {where}'s vision tower has no linear "
            f"projection named {unknown[0]}; it has "
            + ",".join(VISION_PREFIX + n for n in available)
            + f" ({VISION_PREFIX}all-linear: all of them)"
        )
    return tuple(sorted(requested))


def tower_linears(tower: nn.Module, names: dict[str, str], prefixes: tuple) -> list[tuple]:
    """(native module name, module name in transformers' model) of every linear projection of
    `tower`, in module order. `names`: native tensor name -> checkpoint name (the tower's
    `NameMap`); `prefixes`: (checkpoint prefix, transformers' in-memory prefix) pairs where the
    two differ (Gemma 3's checkpoints say `vision_tower.vision_model.`)."""
    out = []
    for native, module in tower.named_modules():
        if not isinstance(module, nn.Linear | FrozenLinear):
            continue
        native = strip_wrappers(native)
        hf = names[f"{native}.weight"].removesuffix(".weight")
        for stored, memory in prefixes:
            if hf.startswith(stored):
                hf = memory + hf[len(stored) :]
                break
        out.append((native, hf))
    return out


class ClippedLoRALinear(LoRALinear):
    """A `LoRALinear` inside Gemma 4's clipping: y = clamp(frozen(x') + lora(x')) with
    x' = clamp(x), the bounds kept as buffers under their checkpoint names."""

    def __init__(self, linear: ClippedLinear, spec: LoRASpec, dtype: torch.dtype, gen) -> None:
        super().__init__(linear, spec, linear.weight.dtype, None, dtype, gen)
        for name in ("input_min", "input_max", "output_min", "output_max"):
            self.register_buffer(name, getattr(linear, name))

    def forward(self, x: Tensor) -> Tensor:
        y = super().forward(torch.clamp(x, self.input_min, self.input_max))
        return torch.clamp(y, self.output_min, self.output_max)


@torch.no_grad()
def adapt(
    tower: nn.Module, adapted: list[str], spec: LoRASpec, dtype: torch.dtype, seed: int
) -> None:
    """Freeze `tower` and turn its projections `adapted` (native module names, module order)
    into `LoRALinear`s: adapters in `dtype`, A drawn from a CPU generator seeded with `seed`
    (PEFT's init, B zero: the adapted tower starts equal to the base)."""
    tower.requires_grad_(False)
    generator = torch.Generator().manual_seed(seed)
    for native in adapted:
        parent_name, _, attr = native.rpartition(".")
        parent = tower.get_submodule(parent_name) if parent_name else tower
        linear = getattr(parent, attr)
        if isinstance(linear, FrozenLinear):
            raise ValueError("this tower has LoRA already")
        if isinstance(linear, ClippedLinear) and linear.clip:
            new = ClippedLoRALinear(linear, spec, dtype, generator)
        else:
            new = LoRALinear(linear, spec, linear.weight.dtype, None, dtype, generator)
        setattr(parent, attr, new)


def peft_pattern(modules: Iterable[str]) -> str:
    """A regex PEFT's target_modules fullmatches to exactly these tower modules (in-memory
    names), with block indices as `\\d+`: the same projections in every block."""
    escaped = (re.escape(m) for m in modules)
    return "|".join(dict.fromkeys(re.sub(r"\\\.\d+\\\.", r"\\.\\d+\\.", e) for e in escaped))
