"""`build_run`: the one place a run is built — model, techniques, optimizer, data.

    config -> device, dtype, architecture -> tokenizer + data (or none: BuildOptions)
      -> model (preset or HF folder; LoRA/NF4 as each block loads; on meta under FSDP)
      -> techniques, in order: activation policy -> compile -> FSDP   (`apply_techniques`)
      -> materialise (FSDP shards filled from rank 0) -> optimizer -> resume state

`compiletune train` builds with real data and weights. A caller outside the trainer (the memory
estimate) passes `BuildOptions` (device, dtype, nothing read, fake tensors, a shorter model, an
eager step) and watches through a `BuildObserver` (observer.py); the build names no estimator.

Here: the order of the build, the optimizer and the checkpoint's training state. Each step's
room: device.py (device and dtype), inputs.py (tokenizer, data, resume state), build_model.py
(architecture, weights, the frozen reference or teacher), techniques.py (what wraps the model).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from compiletune import distributed as dist_
from compiletune.checkpoint import steps as ckpt
from compiletune.compiler.regions import CompiledRegions
from compiletune.config import TrainConfig, fill_defaults
from compiletune.data import prefetch
from compiletune.data.rows import (
    Batches,
    Mixture,
    PackedData,
)
from compiletune.errors import UserError
from compiletune.loss.head import LossHead, head_kind
from compiletune.models import (
    ModelArgs,
    Transformer,
)
from compiletune.models.hf_config import brief
from compiletune.models.lora import (
    LoRASpec,
    nf4_unfit,
)
from compiletune.models.seq_parallel import SeqShards, check_splittable
from compiletune.optim import ADAMW_BETAS, Optimizer
from compiletune.train.build_model import (
    build_frozen,
    build_policy_model,
    lora_spec,
    materialise,
    resolve_model_args,
    teacher_args,
    tower_lora,
    wants_vision,
)
from compiletune.train.device import check_compensation, device_and_dtype, pick_dtype
from compiletune.train.hooks import StepHooks
from compiletune.train.inputs import Inputs, holds_images, model_facts, read_inputs
from compiletune.train.observer import NO_OBSERVER, BuildObserver, BuildOptions
from compiletune.train.techniques import apply_techniques, offloaded_blocks, split_sequences


@dataclass
class Run:
    """Everything a training step needs, built once."""

    cfg: TrainConfig
    env: dist_.DistEnv | None
    device: torch.device
    dtype: torch.dtype
    args: ModelArgs
    model: Transformer
    head: LossHead
    optimizer: Optimizer
    params: list[nn.Parameter]  # the trainable ones
    lora: LoRASpec | None
    regions: CompiledRegions | None = None
    tokenizer: Any = None
    data: list[PackedData] | None = None  # one per --data source
    eval_set: Any = None  # held-out rows (PackedData), pairs (PairRows) or prompts (PromptSet)
    batches: Batches | Mixture | prefetch.PixelPrefetch | None = None
    resume_from: Path | None = None
    start_step: int = 0
    # what the run did before this invocation (a checkpoint's "totals": tokens, padding,
    # seconds); None for a checkpoint written before they were kept
    done_before: dict[str, float] | None = field(default_factory=dict)
    observer: BuildObserver = NO_OBSERVER  # who watches the build and the step from outside
    base_dtype: torch.dtype | None = None
    offload_activations: bool = False
    notes: list[str] = field(default_factory=list)
    reference: Transformer | None = None  # DPO/IPO without LoRA: the frozen starting weights
    teacher: Transformer | None = None  # --objective kd
    seq: SeqShards | None = None  # --cp: this rank's piece of every row (seq_parallel.py)
    hooks: StepHooks = field(default_factory=StepHooks)  # techniques' per-step work

    @property
    def world(self) -> int:
        return self.env.world if self.env is not None else 1

    @property
    def rank(self) -> int:
        return self.env.rank if self.env is not None else 0

    @property
    def dp_world(self) -> int:
        """Processes with rows of their own: each --cp group shares its rows."""
        return self.world // (self.seq.size if self.seq is not None else 1)

    @property
    def dp_rank(self) -> int:
        return self.rank // (self.seq.size if self.seq is not None else 1)

    @property
    def is_main(self) -> bool:
        return self.env is None or self.env.is_main

    def observe(self, phase: str) -> None:
        self.observer.observe(phase, self.params)


def build_run(
    cfg: TrainConfig,
    env: dist_.DistEnv | None,
    opts: BuildOptions = BuildOptions(),  # noqa: B008 (frozen: one shared default is safe)
    observer: BuildObserver = NO_OBSERVER,
) -> Run:
    """Build the run `cfg` describes for this process (`env`: its place in an FSDP job).

    `opts`: what the caller chooses beyond `cfg` (the trainer's are the defaults; the memory
    estimate reads nothing, builds on fake tensors, runs eagerly: observer.BuildOptions).
    `observer`: who watches from outside; everything that allocates runs in its scope.
    """
    torch.manual_seed(cfg.run.seed)
    device, dtype = device_and_dtype(cfg, env, opts)
    args = resolve_model_args(cfg)
    offloads = offloaded_blocks(cfg, args.n_layers, device) > 0  # of the whole model's blocks
    args, spec = _architecture(cfg, env, args, opts.depth)
    world, read = env.world if env is not None else 1, opts.read_inputs
    inputs = read_inputs(cfg, env, args, spec) if read else Inputs(model_facts(cfg, args, world))
    inputs.facts.bf16_params = dtype == torch.bfloat16
    check_compensation(cfg, dtype)
    fill_defaults(cfg, inputs.facts)

    base_dtype = pick_dtype(cfg.lora.base_dtype, device) if cfg.lora.base_dtype else dtype
    lora_kw = {"dtype": dtype, "base_dtype": base_dtype, "quantize": cfg.lora.quantize_base}
    resume_from = inputs.resume_from
    # the tower, for image data (read, or found by the estimate)
    vision = wants_vision(cfg, opts.images or holds_images(inputs.data))
    spec = tower_lora(cfg, spec, vision)  # the tower's adapters, where the tower is loaded
    model, full_sd = build_policy_model(
        cfg, env, args, spec, lora_kw, device, resume_from, read, vision
    )
    frozen: tuple[Any, Any] = (None, None)  # the objective's reference and teacher
    if cfg.objective.objective != "sft":
        # one process's policy as it starts: the reference is a copy (not read again)
        start = model if resume_from is None and read and env is None else None
        frozen = build_frozen(cfg, env, args, spec, lora_kw, device, read, start)
    seq = split_sequences(cfg, env, opts.fake, model, frozen)
    # The head shares the model's output projection; with --compile both are compiled in place.
    compiled = cfg.techniques.compile and opts.compile
    head = LossHead(
        model.output, head_kind(cfg.techniques.loss, compiled), model.args.final_softcap
    )
    notes: list[str] = []
    regions, hooks = apply_techniques(
        model, head, cfg, env, compiled, device, notes, opts.emulate_fp8
    )

    params: list[nn.Parameter] = []
    drawn = "none" if opts.fake else "seed"  # the weights of a build that reads none
    with observer.scope():
        observer.observe("params", params)
        if not read:
            materialise(model, cfg, device, drawn)
        elif env is not None:
            sharded_resume = resume_from is not None and spec is None
            fill = "rank0" if spec or cfg.model.model_dir else "seed"  # seed: a random init
            materialise(model, cfg, device, "none" if sharded_resume else fill, full_sd)
        del full_sd
        for f in frozen:
            if f is not None and f.pending:
                fill = "rank0" if read else drawn
                materialise(f.model, cfg, device, fill, f.full_sd and f.full_sd())
                f.full_sd, f.pending = None, False
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        params.extend(p for _, p in named)
        observer.observe("optimizer", params)
        optimizer = build_optimizer(cfg, named, device, compile_step=opts.compile)

    run = Run(
        cfg=cfg,
        env=env,
        device=device,
        dtype=dtype,
        args=args,
        model=model,
        head=head,
        optimizer=optimizer,
        params=params,
        lora=spec,
        regions=regions,
        tokenizer=inputs.tokenizer,
        data=inputs.data,
        eval_set=inputs.eval_set,
        resume_from=resume_from,
        observer=observer,
        base_dtype=base_dtype,
        offload_activations=offloads,
        reference=frozen[0].model if frozen[0] is not None else None,
        teacher=frozen[1].model if frozen[1] is not None else None,
        seq=seq,
        notes=notes,
        hooks=hooks,
    )
    _attach_batches(run, inputs)
    if inputs.state is not None:
        _load_train_state(run, inputs.state)
    return run


def _architecture(
    cfg: TrainConfig, env: dist_.DistEnv | None, args: ModelArgs, depth: int | None
) -> tuple[ModelArgs, LoRASpec | None]:
    """`args` as built (the first `depth` blocks, where given) and what LoRA adapts in it,
    checked before anything is loaded: --cp's split, --quantize-base nf4."""
    teacher = teacher_args(cfg, args) if cfg.objective.objective == "kd" else None
    check_splittable(cfg.parallel.cp, env.world if env else 1, args, teacher)
    if depth is not None:  # the first `depth` blocks only
        types = args.layer_types[:depth] if args.layer_types else None
        args = dataclasses.replace(args, n_layers=depth, layer_types=types)
    spec = lora_spec(cfg, args)
    if spec is not None and cfg.lora.quantize_base == "nf4" and (why := nf4_unfit(args)):
        raise UserError(f"--quantize-base nf4: {why}; drop --quantize-base for this model")
    return args, spec


def _attach_batches(run: Run, inputs: Inputs) -> None:
    """The run's batch stream over the data it read (none without `read_inputs`). Every rank
    draws the same global batch of (world / --cp) x --batch-size rows, trains its slice."""
    if inputs.data is None:
        return
    cfg = run.cfg
    global_batch = cfg.data.batch_size * run.dp_world
    if len(inputs.data) == 1:
        run.batches = Batches(inputs.data[0], global_batch, cfg.run.seed)
    else:
        run.batches = Mixture(inputs.data, inputs.weights, global_batch, cfg.run.seed)
    if holds_images(inputs.data) and prefetch.DEPTH > 0:  # pixels prepared by a data worker
        run.batches = prefetch.PixelPrefetch(run.batches, inputs.data)


def build_optimizer(
    cfg: TrainConfig,
    named: list[tuple[str, nn.Parameter]],
    device: torch.device,
    compile_step: bool,
) -> Optimizer:
    """The run's optimizer over its trainable parameters. The memory estimate's step runs
    eagerly (`compile_step=False`) on fake tensors, and its real-tensor check does the same, so
    that the two compare like with like."""
    o = cfg.optim
    return Optimizer(
        named,
        kind=o.optimizer,
        lr=o.lr,
        betas=ADAMW_BETAS,
        weight_decay=o.weight_decay,
        in_backward=o.optimizer_in_backward,
        bf16_compensation=o.bf16_compensation,
        device=torch.device("cpu") if cfg.parallel.cpu_offload else device,
        compile_step=compile_step,
    )


def _load_train_state(run: Run, state: dict[str, Any]) -> None:
    """Optimizer, data position and RNG from a checkpoint's training state; a state that does
    not fit this run is one line naming the file."""
    try:
        _apply_train_state(run, state)
    except (KeyError, TypeError, ValueError, IndexError, RuntimeError) as e:
        raise UserError(
            f"{run.resume_from / ckpt.STATE_FILE} does not fit this run ({type(e).__name__}: "
            f"{brief(e)}); resume with the run's own options, or delete {run.resume_from}"
        ) from e


def _apply_train_state(run: Run, state: dict[str, Any]) -> None:
    if run.env is not None:
        opt_sd = dist_.load_sharded(
            run.resume_from / dist_.SHARDED_DIR,
            run.model if run.lora is None else None,  # LoRA: adapters came with rank 0's state
            run.optimizer.state_dict(),
        )
    else:
        opt_sd = state["optimizer"]
    run.optimizer.load_state_dict(opt_sd)
    run.batches.load_state_dict(state["data"])
    ckpt.set_rng_state(state["rng"])
    run.start_step = state["step"]
    run.done_before = state.get("totals")
