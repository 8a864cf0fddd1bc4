"""Native decoder models, presets and HF checkpoint mapping.

The names below load on first use (PEP 562): `compiletune.models.presets` and `.args` are plain
data, so the CLI checks a preset name before it imports torch (seconds), and the torch-heavy
modules (decoder, hf) load only when something asks for them.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .args import ModelArgs, RopeScaling
    from .decoder import Transformer, build_model
    from .hf import from_hf, save_hf, write_hf_folder
    from .hf_config import (
        args_from_hf_config,
        hf_config_from_args,
        load_hf_config,
        resolve_model_path,
    )
    from .hf_names import to_hf_name
    from .params import num_params, params_text
    from .presets import PRESETS, from_name

# name -> the submodule that defines it
_HOMES = {
    "ModelArgs": "args",
    "RopeScaling": "args",
    "Transformer": "decoder",
    "build_model": "decoder",
    "from_hf": "hf",
    "save_hf": "hf",
    "write_hf_folder": "hf",
    "args_from_hf_config": "hf_config",
    "hf_config_from_args": "hf_config",
    "load_hf_config": "hf_config",
    "resolve_model_path": "hf_config",
    "to_hf_name": "hf_names",
    "num_params": "params",
    "params_text": "params",
    "PRESETS": "presets",
    "from_name": "presets",
}

__all__ = [
    "PRESETS",
    "ModelArgs",
    "RopeScaling",
    "Transformer",
    "args_from_hf_config",
    "build_model",
    "from_hf",
    "from_name",
    "hf_config_from_args",
    "load_hf_config",
    "num_params",
    "params_text",
    "resolve_model_path",
    "save_hf",
    "to_hf_name",
    "write_hf_folder",
]


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{home}"), name)
    globals()[name] = value  # the next lookup is a plain attribute
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_HOMES})
