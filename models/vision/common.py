"""What the vision towers share: activations by their config name, and loading / saving a tower
under its checkpoint's own tensor names.

A tower's module names are ours (short, the same in every tower); its checkpoint names are data,
a `NameMap` built beside the tower, covering its parameters and the buffers the checkpoint
stores (Gemma 4's clipping bounds). Saving writes the names the published checkpoints use, which
every transformers version loads; loading also accepts the prefixes other writers use for the same
tensors (transformers 5's `save_pretrained`, a model's in-memory `state_dict`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from compiletune.errors import UserError

# hidden_act as the vision configs spell it -> the function. "gelu_pytorch_tanh" and "gelu_new"
# are the same tanh approximation.
_ACTIVATIONS: dict[str, Callable[[Tensor], Tensor]] = {
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x),
    "silu": F.silu,
}


def activation(name: str, where: str) -> Callable[[Tensor], Tensor]:
    """The activation a vision config names as `hidden_act` (`where` names the config)."""
    if name not in _ACTIVATIONS:
        raise UserError(
            f"{where}: hidden_act {name!r} is not supported by compiletune's vision towers "
            f"(supported: {', '.join(_ACTIVATIONS)}); use a checkpoint with one of these"
        )
    return _ACTIVATIONS[name]


def block_input(x: Tensor, blocks: nn.ModuleList) -> Tensor:
    """`x` as the first block's input: marked as requiring grad when the blocks train (LoRA on
    the tower) but nothing before them does, so that the first block's input requires grad as
    every later one's, and the compiled blocks keep one graph (dynamo guards on it; the decoder's
    frozen embedding output is marked so too, compiler/regions.py). Costs the first block's input
    gradient in the backward."""
    trains = torch.is_grad_enabled() and not x.requires_grad
    if trains and any(p.requires_grad for p in blocks.parameters()):
        return x.detach().requires_grad_()
    return x


def rotate_half(x: Tensor) -> Tensor:
    """[..., d] -> [..., d]: (x1, x2) -> (-x2, x1), the halves rotary embeddings pair."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


@dataclass(frozen=True)
class NameMap:
    """Native parameter name -> the checkpoint's name, and the prefixes loading also accepts.

    `aliases` holds (canonical prefix, other prefix) pairs: a checkpoint name that starts with the
    canonical prefix is also looked up with the other one in its place.
    """

    names: dict[str, str]
    aliases: tuple[tuple[str, str], ...] = field(default=())

    def candidates(self, hf_name: str) -> list[str]:
        """`hf_name` and the names other writers give the same tensor."""
        out = [hf_name]
        for canonical, other in self.aliases:
            if hf_name.startswith(canonical):
                out.append(other + hf_name[len(canonical) :])
        return out


def hf_state_dict(module: nn.Module, name_map: NameMap) -> dict[str, Tensor]:
    """The tower's tensors (parameters and saved buffers) under the checkpoint's names; every one
    must be mapped."""
    tensors = module.state_dict()
    unmapped = sorted(set(tensors) - set(name_map.names))
    if unmapped:
        raise ValueError(f"vision tower tensors without a checkpoint name: {unmapped[:5]}")
    return {name_map.names[n]: t.detach() for n, t in tensors.items()}


def load_hf_state_dict(
    module: nn.Module, tensors: Mapping[str, Tensor], name_map: NameMap, where: str
) -> None:
    """Copy the tower's tensors out of `tensors` (checkpoint name -> tensor; names it does not map,
    such as the text model's, are left to their owner). A missing tensor or one of another shape
    is a `UserError` naming it and `where` (the checkpoint folder)."""
    params = module.state_dict(keep_vars=True)  # parameters and saved buffers
    with torch.no_grad():
        for native, hf_name in name_map.names.items():
            found = next((n for n in name_map.candidates(hf_name) if n in tensors), None)
            if found is None:
                raise UserError(
                    f"{where}: the vision tower's tensor {hf_name} is missing; the checkpoint is "
                    "incomplete or its vision_config does not match its weights"
                )
            value, param = tensors[found], params[native]
            if tuple(value.shape) != tuple(param.shape):
                raise UserError(
                    f"{where}: {found} has shape {tuple(value.shape)}, the vision_config gives "
                    f"{tuple(param.shape)}; the config and the weights are from different models"
                )
            param.copy_(value.to(param.dtype))


def config_get(config: Mapping | object, key: str, default: object = None) -> object:
    """`key` of a config given as a dict (config.json's vision_config) or a config object."""
    if isinstance(config, Mapping):
        return config.get(key, default)
    return getattr(config, key, default)
