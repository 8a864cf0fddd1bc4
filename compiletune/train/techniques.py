"""The techniques that wrap a built model, in their order (`apply_techniques`): float8 linears,
the activation policy, compile, FSDP2; each one's per-step work registered as a step hook
(hooks.py); and --cp's split of every row (`split_sequences`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from compiletune import distributed as dist_
from compiletune import fp8
from compiletune.compiler.activation import apply_eager_checkpointing
from compiletune.compiler.regions import CompiledRegions, CompileOptions, compile_regions
from compiletune.config import TrainConfig
from compiletune.loss.head import LossHead
from compiletune.models import (
    Transformer,
)
from compiletune.models.attention import attention_backend
from compiletune.models.seq_parallel import SeqShards, split_sequence
from compiletune.train.device import model_device
from compiletune.train.hooks import Fp8Scales, InBackwardCheck, RouterBiasUpdate, StepHooks


def apply_techniques(
    model: Transformer,
    head: LossHead,
    cfg: TrainConfig,
    env: dist_.DistEnv | None,
    compile: bool,
    device: torch.device | None = None,
    notes: list[str] | None = None,
    emulate_fp8: bool = False,
) -> tuple[CompiledRegions | None, StepHooks]:
    """Every technique that wraps the model, in one place and in this order (`device`: where
    the model runs; the memory estimate's is the CPU of its fake tensors, also for a GPU run;
    `notes`: start-up lines about what was done; `emulate_fp8`: float8 emulated whatever the
    device, as the estimate asks), and each one's per-step work as a step hook
    (hooks.py), which the step calls in this order after the optimizer step:

    0. float8 linears     (--fp8: torchao's, in the blocks; the estimate's emulated)
    1. activation policy  (eager: torch.utils.checkpoint per block; compiled: a graph pass)
    2. compile            (each block and the head through compiletune's backend)
    3. FSDP2              (after compile, so FSDP's hooks stay outside the compiled blocks)

    Step hooks: --fp8 tensorwise under FSDP (the next all-gather's scales), the MoE routers'
    --router-bias-update-rate, --optimizer-in-backward's check of the weights.
    """
    t = cfg.techniques
    hooks = StepHooks()
    policy = t.activation_policy
    device = device or model_device(env)
    if t.fp8:
        emulate = True if emulate_fp8 else fp8.check_device(device)
        n, kept = fp8.convert_blocks(model, t.fp8, emulate, env is not None)
        if notes is not None:
            where = " (emulated)" if emulate else ""
            notes.append(f"--fp8 {t.fp8}{where}: {n} block linears in float8")
            notes += [f"  kept in {cfg.model.dtype or 'bf16'}: {line}" for line in kept]
        if t.fp8 == "tensorwise" and env is not None:
            hooks.add(Fp8Scales(model, t.fp8))
    if cfg.optim.router_bias_update_rate and model.args.n_experts:
        hooks.add(RouterBiasUpdate(model, cfg.optim.router_bias_update_rate, _world(env)))
    for i, block in enumerate(model.layers):
        eager_selective = not compile and policy.kind == "selective" and policy.applies_to(i)
        block.attention.backend = attention_backend(device, eager_selective=eager_selective)
        block.mlp_tile = t.mlp_tile
    regions = None
    if compile:
        opts = CompileOptions(
            backend=t.compile_backend,
            loss=t.loss,
            dump=t.dump_graphs is not None,
            ac=policy,
            offload_blocks=offloaded_blocks(cfg, model.args.n_layers, device),
        )
        regions = compile_regions(model, head, opts)
    elif policy.kind != "none":
        apply_eager_checkpointing(model, policy)
    if env is not None:
        shard_model(model, cfg, env)
    if cfg.optim.optimizer_in_backward:  # the optimizer's hooks step during backward
        hooks.add(InBackwardCheck(model))
    return regions, hooks


def _world(env: dist_.DistEnv | None) -> int:
    return env.world if env is not None else 1


def shard_model(
    model: Transformer, cfg: TrainConfig, env: dist_.DistEnv, frozen: bool = False
) -> None:
    """FSDP2 over the run's mesh, with its sharding, mixed precision and offload (the policy,
    and the objective's `frozen` reference or teacher: no backward ever frees what grad-op
    keeps gathered after forward, so a frozen model reshards after each block as full does)."""
    p = cfg.parallel
    sharding = "full" if frozen and p.sharding == "grad-op" else p.sharding
    dist_.apply_fsdp(
        model,
        dist_.build_mesh(env, p.sharding, p.shard_size),
        sharding=sharding,
        param_dtype=torch.bfloat16 if cfg.model.dtype == "bf16-mixed" else None,
        cpu_offload=p.cpu_offload,
        grad_hooks=cfg.optim.optimizer_in_backward and not frozen,
        ep=p.ep,
    )


def offloaded_blocks(cfg: TrainConfig, n_layers: int, device: torch.device) -> int:
    """How many blocks (the first) --offload-activations offloads; none on a CPU, whose device
    memory is host memory (a copy would duplicate it), though a count past `n_layers` is
    refused there too."""
    target = cfg.techniques.offload_activations
    n = 0 if target.auto and device.type == "cpu" else target.count(n_layers)
    return n if device.type != "cpu" else 0


def split_sequences(
    cfg: TrainConfig,
    env: dist_.DistEnv | None,
    simulated: bool,
    model: nn.Module,
    frozen: tuple[Any, Any],
) -> SeqShards | None:
    """--cp N: this rank's place among N consecutive ranks sharing each row (None without), the
    model and its frozen ones split to it. `simulated`: the estimate's rank 0, no group."""
    n = cfg.parallel.cp  # what cannot split was refused by check_splittable
    if n == 1 or simulated or env is None:
        seq = None if n == 1 else SeqShards(n, 0)
    else:
        seq = SeqShards(n, env.rank % n, dist_.cp_group(n))
    for m in (model, *(f.model for f in frozen if f is not None)):
        split_sequence(m, seq)
    return seq
