"""Where a run's tensors live and the dtype its parameters are stored in.

The trainer's choice (the GPU if there is one, --dtype there) unless the caller chose
(`BuildOptions.device`, `.dtype`: the memory estimate's fake CPU tensors in the dtype of the GPU
it is for), and the checks that depend on the dtype.
"""

from __future__ import annotations

import torch

from compiletune import distributed as dist_
from compiletune import hardware
from compiletune.config import TrainConfig
from compiletune.errors import UserError
from compiletune.train.observer import BuildOptions


def pick_device() -> torch.device:
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def pick_dtype(name: str | None, device: torch.device) -> torch.dtype:
    """The dtype parameters are stored in (bf16-mixed stores fp32 and computes in bf16)."""
    if name is None:
        bf16_ok = device.type == "cuda" and torch.cuda.is_bf16_supported()
        return torch.bfloat16 if bf16_ok else torch.float32
    return {"fp32": torch.float32, "bf16": torch.bfloat16, "bf16-mixed": torch.float32}[name]


def model_device(env: dist_.DistEnv | None) -> torch.device:
    return env.device if env is not None else pick_device()


def device_and_dtype(
    cfg: TrainConfig, env: dist_.DistEnv | None, opts: BuildOptions
) -> tuple[torch.device, torch.dtype]:
    """Where the tensors live and the parameters' dtype: the caller's choice, else the
    process's device (the GPU if there is one) and --dtype there."""
    if env is not None:
        device = env.device
    else:
        device = opts.device if opts.device is not None else pick_device()
    dtype = opts.dtype if opts.dtype is not None else pick_dtype(cfg.model.dtype, device)
    if dtype == torch.bfloat16 and device.type == "cuda" and not torch.cuda.is_bf16_supported():
        raise UserError("--dtype bf16: this GPU has no bf16 support; pass --dtype fp32")
    if dtype == torch.bfloat16 and device.type == "cpu" and opts.dtype is None:
        hardware.warn_slow_bf16()
    return device, dtype


def check_compensation(cfg: TrainConfig, dtype: torch.dtype) -> None:
    comp = cfg.optim.bf16_compensation
    if comp not in (None, "none") and dtype != torch.bfloat16:
        raise UserError(
            f"--bf16-compensation {comp} corrects bf16 parameter updates, but the parameters "
            f"are {str(dtype).removeprefix('torch.')} here; add --dtype bf16 or drop it"
        )
