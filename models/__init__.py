"""Native decoder models, presets and HF checkpoint mapping."""

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
from .params import num_params
from .presets import PRESETS, from_name

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
    "resolve_model_path",
    "save_hf",
    "to_hf_name",
    "write_hf_folder",
]
