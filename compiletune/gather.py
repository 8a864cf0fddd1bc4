"""A parameter split over ranks, whole again: FSDP2's shards (DTensors) and --ep's experts
(expert_parallel.py). A collective: every rank of the group calls it.

Its own module below both the models (export, LoRA merges read whole weights) and the
techniques that split them (distributed.py, expert_parallel.py, which import the models).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from compiletune.ops.expert_exchange import process_group


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a (possibly sharded) parameter; a collective: every rank calls it."""
    if getattr(t, "expert_group", None) is not None:  # --ep: this rank's experts
        return gather_experts(t)
    if not hasattr(t, "full_tensor"):
        return t
    if t.device.type == "cpu" and torch.cuda.is_available():  # --cpu-offload shards: gather
        t = t.to(torch.device("cuda", torch.cuda.current_device()))  # on the GPU, via NCCL
    return t.full_tensor()


def gather_experts(t: Tensor) -> Tensor:
    """A parameter split by `apply_expert_parallel` whole again ([E/N, ...] -> [E, ...]), on
    every rank of its group (a collective)."""
    group = process_group(t.expert_group)
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, t.detach().contiguous(), group=group)
    return torch.cat(parts)
