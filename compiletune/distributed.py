"""FSDP2 across processes: process group, device mesh, sharding, loading, sharded checkpoints.

One command from one process to many nodes: `torchrun --nproc-per-node N -m compiletune train
--fsdp ...`. torch.distributed is the engine (NCCL on GPUs, gloo on CPU).

Units (torchtitan's order: compile first, then `fully_shard` per unit, then the root):
    each transformer block                 gathered for its forward, freed after (full/hybrid)
    the token embedding                    its own unit (untied models)
    the per-layer inputs (Gemma 4)         their own unit (an embedding as large as the rest)
    final norm + output projection         one unit; the loss head reads the output weight
                                           directly, so this unit stays gathered from the
                                           norm's forward to the end of backward
    the root (the model)                   whatever is left (tied models: embedding + head)

Data parallelism: each rank reads its own slice of the global batch (`--batch-size` rows per
rank), the loss is divided by the global count of target tokens, and FSDP's reduction (a mean
over ranks) is undone by scaling the loss by the world size, so N ranks compute the gradient of
one big batch, exactly as a single process with N x --batch-size rows would.

Checkpoints (`step_N/sharded/`, torch.distributed.checkpoint): every rank writes its shards of
the model and of AdamW's moments, both laid out as the whole tensors (`compiletune convert`
reads them without a process group), and the rest of its optimizer state (the step counts,
8-bit AdamW's blocks) under its own key. A resume reshards on load: another number of
processes or another --ep reads its own shards of the same whole tensors (8-bit AdamW, whose
blocks are cut from each process's shard, resumes on as many processes as wrote it).
A LoRA run saves the optimizer state alone there: its adapters go to the PEFT adapter folder
beside it and its frozen base is rebuilt from the run's source.
"""

from __future__ import annotations

import functools
import gc
import os
import re
import socket
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from compiletune import faults, torch_internals
from compiletune.choices import Sharding, choices
from compiletune.errors import UserError
from compiletune.expert_parallel import (
    apply_expert_parallel,
    global_view,
    load_experts,
    local_view,
)
from compiletune.launch import launched_world_size as launched_world_size  # re-exported
from compiletune.torch_internals import fsdp_completes_partial_groups

if TYPE_CHECKING:
    pass

SHARDINGS = choices(Sharding)
SHARDED_DIR = "sharded"


@dataclass
class DistEnv:
    """This process's place in the job."""

    rank: int
    world: int
    local_rank: int
    local_world: int
    device: torch.device
    owns_group: bool  # we initialised the process group (and tear it down)

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def init_distributed(device_type: str) -> DistEnv:
    """Join (or, for a single process with --fsdp, create) the default process group."""
    owns = False
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if device_type == "cuda":
        torch.cuda.set_device(local_rank)  # also when the caller made the group
    if not dist.is_initialized():
        if "RANK" not in os.environ:  # one process without torchrun: a group of one
            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
            os.environ.setdefault("MASTER_PORT", str(_free_port()))
            os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
        # On GPUs, gloo serves the collectives on CPU tensors that --cpu-offload creates
        # (gradient clipping's norm over host-side gradient shards); NCCL does the rest.
        backend = "cuda:nccl,cpu:gloo" if device_type == "cuda" else "gloo"
        dist.init_process_group(backend)
        owns = True
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    device = (
        torch.device("cuda", torch.cuda.current_device())
        if device_type == "cuda"
        else torch.device("cpu")
    )
    return DistEnv(rank, world, local_rank, local_world, device, owns)


def close_group() -> None:
    """Destroy the default process group in a fixed order: what the run built (FSDP state and
    DTensors hold the group) is collected first, while the group lives. Destroying gloo and
    freeing its last reference later, at interpreter exit, aborted a rank ('terminate called
    without an active exception') in two of three CI runs of this project on one day, in
    different 2-process tests. No barrier: after a failure on one rank it would hang the rest."""
    gc.collect()
    dist.destroy_process_group()


def shutdown(env: DistEnv) -> None:
    if env.owns_group and dist.is_initialized():
        close_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def mesh_shape(sharding: str, world: int, shard_size: int | None, local_world: int) -> tuple:
    """(replicate, shard) sizes of the 2-D mesh, or (world,) for 1-D full / grad-op sharding."""
    if sharding in ("full", "grad-op"):
        return (world,)
    if sharding == "none":
        return (world, 1)  # every rank holds everything: replication only
    size = shard_size or local_world  # hybrid: shard within a node, replicate across nodes
    if size < 1 or world % size:
        raise UserError(
            f"--sharding hybrid: a shard group of {size} processes does not divide the "
            f"{world} processes; pass --shard-size with a divisor of {world}"
        )
    return (world // size, size)


def cp_group(size: int) -> Any:
    """This rank's context-parallel group: `size` consecutive ranks (0..size-1, size..).
    Every rank creates every group, as torch.distributed requires."""
    mine, _ = dist.new_subgroups(group_size=size)
    return mine


def build_mesh(env: DistEnv, sharding: str, shard_size: int | None = None) -> Any:
    from torch.distributed.device_mesh import init_device_mesh

    shape = mesh_shape(sharding, env.world, shard_size, env.local_world)
    names = ("shard",) if len(shape) == 1 else ("replicate", "shard")
    return init_device_mesh(env.device.type, shape, mesh_dim_names=names)


def apply_fsdp(
    model: nn.Module,
    mesh: Any,
    *,
    sharding: str = "full",
    param_dtype: torch.dtype | None = None,
    cpu_offload: bool = False,
    grad_hooks: bool = False,
    ep: int = 1,
) -> None:
    """`fully_shard` the blocks (a vision model's tower blocks too), the embedding, the head
    (norm + output) and then the root.

    param_dtype: the compute dtype of gathered parameters (bf16 mixed precision keeps fp32
    master weights and reduces gradients in fp32); None computes in the storage dtype.
    grad_hooks: parameters carry post-accumulate-grad hooks (--optimizer-in-backward).
    ep: --ep, each MoE layer's experts split over this many ranks first
    (`expert_parallel.apply_expert_parallel`; a model that has them split already keeps them),
    and left out of FSDP.
    """
    from torch.distributed.fsdp import (
        CPUOffloadPolicy,
        MixedPrecisionPolicy,
        OffloadPolicy,
        fully_shard,
        register_fsdp_forward_method,
    )

    if sharding not in SHARDINGS:
        raise ValueError(f"unknown sharding {sharding!r}")
    torch_internals.fsdp_allow_integer_params()  # NF4 codes on torch 2.11
    mp = MixedPrecisionPolicy(
        param_dtype=param_dtype, reduce_dtype=torch.float32 if param_dtype else None
    )
    # Pinned host memory makes FSDP's gradient copy to the host asynchronous; a per-parameter
    # gradient hook (--optimizer-in-backward) would then read a gradient still in transit on
    # torch versions that do not wait for it, so with hooks the copy stays synchronous.
    pin = torch.cuda.is_available() and not grad_hooks
    offload = CPUOffloadPolicy(pin_memory=pin) if cpu_offload else None
    common = {"mesh": mesh, "mp_policy": mp, "offload_policy": offload or OffloadPolicy()}
    if ep > 1 and getattr(model, "expert_parallel", None) is None:
        apply_expert_parallel(model, ep, torch.device(mesh.device_type))
    split = getattr(model, "expert_parallel", None)
    if split is not None:  # each rank's own experts: never gathered, never sharded further
        common["ignored_params"] = set(split.held)
    # grad-op (SHARD_GRAD_OP) keeps gathered parameters from forward to backward: less
    # communication, more memory. With one shard per rank ("none") there is nothing to free.
    reshard = sharding in ("full", "hybrid")
    for block in model.layers:
        fully_shard(block, reshard_after_forward=reshard, **common)
    vision = getattr(model, "vision_blocks", None)  # a vision-language model's tower
    if vision is not None:  # a unit per tower block; its embeddings and projector in the root
        for block in vision():
            fully_shard(block, reshard_after_forward=reshard, **common)
    if model.per_layer_inputs is not None:  # Gemma 4's embedding per layer: large, used once
        fully_shard(model.per_layer_inputs, reshard_after_forward=reshard, **common)
    if not model.args.tie_embeddings:
        fully_shard(model.tok_embeddings, reshard_after_forward=reshard, **common)
        if fsdp_completes_partial_groups():
            # Gathered at the final norm's forward rather than at the start of the model's, and
            # kept for backward, which starts right there. The output module's own forward never
            # runs (the head reads its weight), so the group is never "complete": torch versions
            # that cannot finish such a group leave norm and output in the root instead.
            fully_shard([model.norm, model.output], reshard_after_forward=False, **common)
    fully_shard(model, **common)
    # The trainer calls `hidden_states` (the loss head follows outside the model), so the root's
    # hooks (lazy init, gathering the root's own parameters) must run for that method too.
    register_fsdp_forward_method(model, "hidden_states")
    register_fsdp_forward_method(model, "hidden_states_cached")  # GRPO's rollout


def load_full_state(model: nn.Module, full_sd: dict[str, torch.Tensor] | None) -> None:
    """Fill a sharded model (materialised with `to_empty`) from rank 0's full state dict:
    tensors are broadcast one at a time and each rank keeps its shard. Other ranks pass None."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    full_sd = full_sd if dist.get_rank() == 0 else None
    split = getattr(model, "expert_parallel", None) is not None
    load_experts(model, full_sd)  # --ep: each rank's experts (taken out of full_sd)
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, strict=not split)
    set_model_state_dict(model, full_sd or {}, options=options)


def all_reduce_sum(values: list[float], device: torch.device) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return t.tolist()


def any_rank(flag: bool, device: torch.device) -> bool:
    """True on every rank if `flag` is True on any (a collective: every rank calls it)."""
    return all_reduce_sum([float(flag)], device)[0] > 0


def gather_floats(value: float, device: torch.device) -> list[float]:
    """Every rank's `value`, in rank order, on every rank."""
    t = torch.zeros(dist.get_world_size(), dtype=torch.float64, device=device)
    t[dist.get_rank()] = value
    dist.all_reduce(t)
    return t.tolist()


def _failure(error: BaseException) -> tuple[int | None, BaseException]:
    """(the rank it happened on where known, the exception): torch.distributed.checkpoint
    hands every rank a CheckpointException holding the failing ranks' own exceptions."""
    failures = getattr(error, "failures", None)
    if isinstance(failures, dict) and failures:
        rank = min(failures)
        inner = failures[rank]
        return rank, inner[0] if isinstance(inner, tuple) else inner
    return None, error


def attempt(work: Callable[[], Any]) -> BaseException | None:
    """Run `work`; its exception (None if it went well), for `agree`. torch.distributed.
    checkpoint's CheckpointException is a BaseException, so it is named beside Exception."""
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        work()
    except (Exception, CheckpointException) as e:
        return e
    return None


def agree(error: BaseException | None, describe: Callable[[BaseException], str]) -> None:
    """A barrier that carries failures. Every rank calls it after work that may fail on some
    ranks only (`error`: this rank's exception, None where its part went well). When any rank
    failed, every rank raises the same UserError, the first failing rank's `describe(error)`
    naming that rank, at once: no rank is left waiting at a barrier (until the process
    group's timeout) for one that has given up. Alone (no process group) it re-raises."""
    if not (dist.is_available() and dist.is_initialized()):
        if error is not None:
            raise error
        return
    line = None
    if error is not None:
        at, cause = _failure(error)
        line = (dist.get_rank() if at is None else at, describe(cause))
    lines: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(lines, line)
    failed = sorted(x for x in lines if x is not None)
    if not failed:
        return
    rank, text = failed[0]
    others = sorted({r for r, _ in failed} - {rank})
    also = f" (and on rank{'s' if len(others) > 1 else ''} {', '.join(map(str, others))})"
    raise UserError(f"rank {rank}: {text}" + (also if others else "")) from error


def save_sharded(folder: Path, model: nn.Module | None, optimizer_sd: dict[str, Any]) -> None:
    """Every rank writes its shards of the model and of the optimizer's moments (saved whole
    once, `_split_optimizer`) and its own rest of the optimizer state into `folder`.
    model None: the optimizer state alone (a LoRA run keeps its adapters in the adapter folder
    and rebuilds its frozen base from the run's source)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    own, whole = _split_optimizer(optimizer_sd)
    state: dict[str, Any] = {"optimizer": {f"rank{dist.get_rank()}": own}, WHOLE: whole}
    if model is not None:
        state["model"] = global_view(model, get_model_state_dict(model))
    dcp.save(state, storage_writer=_shard_writer_class()(str(folder)))


# The sharded checkpoint's section of optimizer state saved whole (parameter -> state name ->
# tensor, each once): the moments, laid out as their parameters (optim.py `_whole`).
WHOLE = "optimizer_whole"


def _split_optimizer(optimizer_sd: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(this rank's own part, the whole part) of an `Optimizer.state_dict()`: its DTensors go
    to the whole part, which every rank saves under the same keys (so it is written once and
    read back under another --ep, each rank taking its own part); the rest (the step counts,
    8-bit AdamW's blocks, the numbers) stays this rank's."""
    own = dict(optimizer_sd)
    own["state"], whole = {}, {}
    for name, entries in optimizer_sd.get("state", {}).items():
        own["state"][name] = {k: t for k, t in entries.items() if not hasattr(t, "to_local")}
        mine = {k: t for k, t in entries.items() if hasattr(t, "to_local")}
        if mine:
            whole[name] = mine
    return own, whole


@functools.cache
def _shard_writer_class() -> type:
    from torch.distributed.checkpoint import FileSystemWriter

    class ShardWriter(FileSystemWriter):
        """DCP's own file writer (its defaults: what `checkpoint_id=folder` gives), with the
        fault point "shards" where each rank writes (a full disk there is one rank's)."""

        def write_data(self, *args: Any, **kwargs: Any) -> Any:
            faults.point("shards")
            return super().write_data(*args, **kwargs)

    return ShardWriter


def load_sharded(
    folder: Path, model: nn.Module | None, optimizer_sd: dict[str, Any]
) -> dict[str, Any]:
    """Read `folder` into the sharded model (in place; None: no model, see `save_sharded`) and
    into `optimizer_sd` (a template of this rank's optimizer state, filled in place and
    returned)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    own, whole = _split_optimizer(optimizer_sd)
    saved = FileSystemReader(str(folder)).read_metadata().state_dict_metadata
    old = whole and not any(k.startswith(WHOLE + ".") for k in saved)
    key = _own_key(folder, saved, own, bool(old))
    if old:  # written before the moments were saved whole: each rank's, in its own layout
        own = {
            **own,
            "state": {
                n: {k: _local_of(t) for k, t in e.items()} for n, e in optimizer_sd["state"].items()
            },
        }
        whole = {}
    state: dict[str, Any] = {"optimizer": {key: own}, WHOLE: whole}
    if model is not None:
        state["model"] = global_view(model, get_model_state_dict(model))
    if old:
        _check_own_layout(folder, saved, key, own["state"])
    dcp.load(state, checkpoint_id=str(folder))
    if model is not None:
        set_model_state_dict(model, local_view(model, state["model"]))
    out = state["optimizer"][key]
    for name, entries in whole.items():
        out["state"][name].update(entries)
    return out


_RANK_KEY = re.compile(r"^optimizer\.rank(\d+)\.")


def _own_key(folder: Path, saved: dict[str, Any], own: dict[str, Any], old: bool) -> str:
    """Whose own part of the optimizer state this rank reads: its own, or, when the checkpoint
    was written by another number of processes, rank 0's. That part then holds the step
    counts alone (every rank's are the same); the moments come from the whole part, each rank
    reading its new shard of them. 8-bit AdamW's blocks and a checkpoint of the old layout
    (each rank's moments its own) are cut from each process's shard: refused in one line."""
    written = {int(m.group(1)) for k in saved if (m := _RANK_KEY.match(k))}
    world = dist.get_world_size()
    if len(written) == world:
        return f"rank{dist.get_rank()}"
    cut = sorted({k for e in own["state"].values() for k in e if k != "step"})
    if old or cut:
        what = f"8-bit AdamW's blocks ({', '.join(cut)})" if cut else "its AdamW moments"
        raise UserError(
            f"{folder.parent} was written by {len(written)} processes and keeps {what} in "
            f"each process's own shard, which {world} process{'es' * (world > 1)} cut "
            f"differently; resume it with {len(written)} processes"
        )
    return "rank0"


def _local_of(t: Any) -> Any:
    return t.to_local() if hasattr(t, "to_local") else t


def _check_own_layout(
    folder: Path, saved: dict[str, Any], key: str, state: dict[str, dict[str, Any]]
) -> None:
    """A checkpoint whose ranks saved their moments in their own layout fits only a run that
    splits the parameters as it did: one line naming the fix otherwise."""
    for name, entries in state.items():
        for k, t in entries.items():
            md = saved.get(f"optimizer.{key}.state.{name}.{k}")
            size = getattr(md, "size", None)
            if size is not None and tuple(size) != tuple(t.shape):
                raise UserError(
                    f"{folder.parent} keeps each process's optimizer state in that process's "
                    f"layout (written before a resume could change --ep; {name}.{k} is "
                    f"{tuple(size)}, this run's {tuple(t.shape)}); resume it with the --ep it "
                    "was written with"
                )


def sharded_model_tensors(folder: Path) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Native parameter name -> (shape, dtype) of the model saved in a sharded checkpoint."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    meta = FileSystemReader(str(folder)).read_metadata()
    out = {}
    for key, md in meta.state_dict_metadata.items():
        if key.startswith("model.") and isinstance(md, TensorStorageMetadata):
            out[key.removeprefix("model.")] = (tuple(md.size), md.properties.dtype)
    return out


def sharded_damage(folder: Path) -> str | None:
    """Why the sharded checkpoint in `folder` cannot be read (None: every shard file its
    metadata names is there and long enough): the missing or cut-short shard, named."""
    from torch.distributed.checkpoint import FileSystemReader

    try:
        meta = FileSystemReader(str(folder)).read_metadata()
    except Exception as e:  # missing or truncated .metadata: an unpickling error of any kind
        return f"{folder}/.metadata cannot be read ({type(e).__name__}: {e!s:.120})"
    need: dict[str, int] = {}
    for info in (meta.storage_data or {}).values():
        end = info.offset + info.length
        need[info.relative_path] = max(need.get(info.relative_path, 0), end)
    for name, end in sorted(need.items()):
        shard = folder / name
        if not shard.is_file():
            return f"shard {shard} is missing"
        if shard.stat().st_size < end:
            return f"shard {shard} is cut short ({shard.stat().st_size} of at least {end} bytes)"
    return None


def read_sharded_tensor(
    folder: Path, name: str, shape: tuple[int, ...], dtype: torch.dtype
) -> torch.Tensor:
    """One whole model tensor from a sharded checkpoint, without a process group."""
    import torch.distributed.checkpoint as dcp

    t = torch.empty(shape, dtype=dtype)
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": yes
        warnings.simplefilter("ignore", UserWarning)
        dcp.load({"model": {name: t}}, checkpoint_id=str(folder), no_dist=True)
    return t
