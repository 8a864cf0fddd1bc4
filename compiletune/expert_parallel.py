"""Expert parallelism (`--ep N`): each MoE layer's experts split across N ranks, tokens sent to
their experts' ranks and back (compiletune/ops/expert_exchange.py), applied from outside the
model like the other techniques.

The mesh (torchtitan's layout, expert ranks borrowed from the data-parallel ones):

    world W = dp_shard_mod_ep x ep        [W / N, N]; an `ep` group is N consecutive ranks
    non-expert weights                    FSDP2 over all W ranks, as without --ep
    expert weights                        rank r of its ep group holds experts
                                          [r E/N, (r+1) E/N) whole (plain tensors, not DTensors),
                                          replicated over the W / N groups

Each rank trains its own rows, as under FSDP. An expert's gradient on its rank already sums
the rows every rank of its group sent it (the backward of the exchange brings theirs back);
`finish_grad` adds the other groups' (an all-reduce over `dp_shard_mod_ep`, nothing when W = N)
and divides by W, which is what FSDP's mean does to the other weights after the trainer's loss
scaling by W. Gradient norms add the two kinds: the non-expert norm over FSDP's shards, the
expert norm summed over one ep group (each expert counted once).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from compiletune.errors import UserError
from compiletune.gather import gather_experts
from compiletune.models.moe import MoE
from compiletune.ops.expert_exchange import ExpertShards, process_group, register_group


@dataclass
class ExpertParallel:
    """What `apply_expert_parallel` did to a model (kept as `model.expert_parallel`)."""

    shards: ExpertShards
    mesh: Any  # [dp_shard_mod_ep, ep]
    replicas: Any  # the dp_shard_mod_ep process group: the other holders of these experts
    world: int
    held: list[nn.Parameter] = field(default_factory=list)  # this rank's expert weights
    params: list[nn.Parameter] = field(default_factory=list)  # the trainable ones of them
    names: dict[str, slice] = field(default_factory=dict)  # state-dict name -> experts held

    def finish_grad(self, grad: Tensor) -> Tensor:
        """An expert gradient as it arrives (a tensor hook, so once per backward, before it
        is accumulated): summed over every rank that holds the same experts, divided by the
        world size (see the module docstring)."""
        if dist.get_world_size(self.replicas) > 1:
            grad = grad.clone()
            dist.all_reduce(grad, group=self.replicas)
        return grad / self.world

    def grad_norm(self, params: list[nn.Parameter]) -> Tensor:
        """The L2 norm of the gradients of `params` (the run's trainable ones) as one process
        would see them: FSDP's shards and each expert once."""
        mine = {id(p) for p in self.params}
        dense = [p.grad for p in params if p.grad is not None and id(p) not in mine]
        local = [p.grad for p in params if p.grad is not None and id(p) in mine]
        total = torch.zeros((), dtype=torch.float32)
        if dense:
            norm = torch.nn.utils.get_total_norm(dense)
            norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
            total = norm.float().square()
        experts = torch.zeros((), dtype=torch.float32, device=total.device)
        if local:
            experts = torch.nn.utils.get_total_norm(local).float().square().to(total.device)
        dist.all_reduce(experts, group=process_group(self.shards.group))
        return (total.to(experts.device) + experts).sqrt()

    def clip_grad_norm(self, params: list[nn.Parameter], max_norm: float) -> Tensor:
        """`torch.nn.utils.clip_grad_norm_` for a model whose experts are split (torch's own
        cannot mix FSDP's DTensor gradients with the experts' plain ones in one norm)."""
        norm = self.grad_norm(params)
        mine = {id(p) for p in self.params}
        for group in (
            [p for p in params if id(p) not in mine],
            [p for p in params if id(p) in mine],
        ):
            if group:
                torch.nn.utils.clip_grads_with_norm_(group, max_norm, norm)
        return norm


def check_ep(ep: int, world: int, n_experts: int) -> None:
    """--ep N must divide the world and the experts; one line naming the fix otherwise."""
    if ep == 1:
        return
    if not n_experts:
        raise UserError(
            f"--ep {ep} splits the experts of a MoE model, and this model has none; drop --ep"
        )
    if world % ep:
        raise UserError(
            f"--ep {ep} does not divide the {world} processes; pass a divisor of {world}"
        )
    if n_experts % ep:
        raise UserError(
            f"--ep {ep} does not divide the model's {n_experts} experts; pass a divisor of "
            f"{n_experts} that also divides the {world} processes"
        )


def apply_expert_parallel(model: nn.Module, ep: int, device: torch.device | str) -> ExpertParallel:
    """Split every MoE layer's experts over groups of `ep` consecutive ranks, before FSDP,
    which leaves them out. A real model keeps each rank's slice; a meta one gets its slice
    allocated on `device` now (uninitialised, filled by the run's load or init), so that
    `to_empty` keeps these parameters, their gradient hooks and their `first_row` (where the
    slice starts among the experts, for the hashed random init)."""
    from torch.distributed.device_mesh import init_device_mesh

    world = dist.get_world_size()
    n_experts = model.args.n_experts
    check_ep(ep, world, n_experts)
    device = torch.device(device)
    mesh = init_device_mesh(
        device.type, (world // ep, ep), mesh_dim_names=("dp_shard_mod_ep", "ep")
    )
    shards = ExpertShards(
        register_group(mesh.get_group("ep")), ep, mesh.get_local_rank("ep"), n_experts
    )
    state = ExpertParallel(shards, mesh, mesh.get_group("dp_shard_mod_ep"), world)
    for path, moe in model.named_modules():
        if not isinstance(moe, MoE):
            continue
        moe.exchange = shards
        experts = moe.experts
        for name, p in list(experts.named_parameters(recurse=False)):
            if p.shape[0] != n_experts:
                raise ValueError(f"{path}.experts.{name} {tuple(p.shape)}: not one row per expert")
            rows = p.detach()[shards.local]
            rows = torch.empty_like(rows, device=device) if rows.is_meta else rows.clone()
            local = nn.Parameter(rows, requires_grad=p.requires_grad)
            local.first_row = shards.local.start
            local.expert_group = shards.group  # `gather_experts` reads it
            local.whole_rows = n_experts  # the export's shape (models/lora.dense_tensors)
            local.expert_mesh = mesh  # the optimizer state's whole layout (optim._whole)
            setattr(experts, name, local)
            state.names[f"{path}.experts.{name}"] = shards.local
            state.held.append(local)
            if local.requires_grad:
                state.params.append(local)
                # before accumulation: each micro-batch's part is finished once, and an
                # optimizer stepping in backward (its hook runs after) sees the final gradient
                local.register_hook(state.finish_grad)
        experts.n_experts = n_experts // ep
    model.expert_parallel = state
    return state


def load_experts(model: nn.Module, full_sd: dict[str, Tensor] | None) -> None:
    """Fill this rank's experts from rank 0's full state dict (None on other ranks), taking the
    expert weights out of it: each is broadcast whole and every rank keeps its experts."""
    state: ExpertParallel | None = getattr(model, "expert_parallel", None)
    if state is None:
        return
    params = dict(model.named_parameters())
    for name, rows in state.names.items():  # the same order on every rank
        p = params[name]
        shape = (state.shards.n_experts, *p.shape[1:])
        whole = full_sd.pop(name) if full_sd is not None else None
        t = whole.to(p.device, p.dtype) if whole is not None else p.new_empty(shape)
        dist.broadcast(t, src=0)
        with torch.no_grad():
            p.copy_(t[rows])


def global_view(model: nn.Module, sd: dict[str, Any]) -> dict[str, Any]:
    """A model state dict (`get_model_state_dict`) whose --ep experts are DTensors of the whole
    [E, ...] (split over `ep`, replicated over `dp_shard_mod_ep`) sharing this rank's storage:
    what a sharded checkpoint saves, so that it holds every expert once and a load fills each
    rank's in place. Unchanged without --ep."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    state: ExpertParallel | None = getattr(model, "expert_parallel", None)
    if state is None:
        return sd
    for name in state.names:
        if name in sd:
            local = sd[name]
            sd[name] = DTensor.from_local(
                local, state.mesh, [Replicate(), Shard(0)], run_check=False
            )
    return sd


def local_view(model: nn.Module, sd: dict[str, Any]) -> dict[str, Any]:
    """`global_view` undone: each expert DTensor back to this rank's tensor (the same storage)."""
    state: ExpertParallel | None = getattr(model, "expert_parallel", None)
    for name in state.names if state is not None else ():
        if hasattr(sd.get(name), "to_local"):
            sd[name] = sd[name].to_local()
    return sd


@contextlib.contextmanager
def whole_experts(model: nn.Module, trainable_only: bool = False) -> Iterator[None]:
    """Inside, every MoE layer holds all its experts (gathered from the ranks of its `ep`
    group, a collective; frozen copies), as one process would: for the HF export and the
    adapter folder. Every rank enters it. It gathers every layer's experts at once;
    `trainable_only`: only the trainable ones (the adapters, for the adapter folder: a LoRA
    run's frozen expert weights, most of a MoE model, stay split)."""
    state: ExpertParallel | None = getattr(model, "expert_parallel", None)
    if state is None:
        yield
        return
    saved = []
    for name in state.names:
        path, attr = name.rsplit(".", 1)
        experts = model.get_submodule(path)
        local = getattr(experts, attr)
        if trainable_only and not local.requires_grad:
            continue
        saved.append((experts, attr, local, experts.n_experts))
        whole = nn.Parameter(gather_experts(local), requires_grad=False)
        experts._parameters[attr] = whole
        experts.n_experts = state.shards.n_experts
    try:
        yield
    finally:
        for experts, attr, local, n in saved:
            experts._parameters[attr] = local
            experts.n_experts = n
