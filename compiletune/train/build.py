"""`build_run`: the one place a run is built — model, techniques, optimizer, data.

    config -> device, dtype, architecture -> tokenizer + data (or none: BuildOptions)
      -> model (preset or HF folder; LoRA/NF4 as each block loads; on meta under FSDP)
      -> techniques, in order: activation policy -> compile -> FSDP   (`apply_techniques`)
      -> materialise (FSDP shards filled from rank 0) -> optimizer -> resume state

`compiletune train` builds with real data and weights. A caller outside the trainer (the memory
estimate) passes `BuildOptions` (device, dtype, nothing read, fake tensors, a shorter model, an
eager step) and watches through a `BuildObserver` (observer.py); the build names no estimator.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from compiletune import distributed as dist_
from compiletune import fp8, hardware, weight_init
from compiletune.checkpoint import adapter_io
from compiletune.checkpoint import steps as ckpt
from compiletune.compiler.activation import apply_eager_checkpointing
from compiletune.compiler.regions import CompiledRegions, CompileOptions, compile_regions
from compiletune.config import RunFacts, TrainConfig, fill_defaults
from compiletune.data.rows import (
    Batches,
    Mixture,
    PackedData,
)
from compiletune.data.tokenizer import byte_tokenizer, load_tokenizer
from compiletune.errors import UserError
from compiletune.loss.head import LossHead, head_kind
from compiletune.models import (
    ModelArgs,
    Transformer,
    args_from_hf_config,
    build_model,
    from_hf,
    from_name,
    load_hf_config,
    resolve_model_path,
)
from compiletune.models.attention import attention_backend
from compiletune.models.generation_config import load_generation_config
from compiletune.models.hf_config import brief
from compiletune.models.lora import (
    LoRASpec,
    apply_lora,
    block_adapter,
    model_targets,
    nf4_unfit,
    parse_targets,
)
from compiletune.models.seq_parallel import SeqShards, check_splittable, split_sequence
from compiletune.optim import ADAMW_BETAS, Optimizer
from compiletune.train.hooks import Fp8Scales, InBackwardCheck, RouterBiasUpdate, StepHooks
from compiletune.train.inputs import build_data, build_pairs, build_prompts
from compiletune.train.observer import NO_OBSERVER, BuildObserver, BuildOptions

# Fields that make two architectures different models (head_dim is compared resolved).
_ARCH_FIELDS = (
    "family",
    "dim",
    "n_layers",
    "n_heads",
    "n_kv_heads",
    "vocab_size",
    "ffn_dim",
    "qkv_bias",
)


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
    batches: Batches | None = None
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


# ----------------------------------------------------------------------------- choices


def pick_device() -> torch.device:
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def pick_dtype(name: str | None, device: torch.device) -> torch.dtype:
    """The dtype parameters are stored in (bf16-mixed stores fp32 and computes in bf16)."""
    if name is None:
        bf16_ok = device.type == "cuda" and torch.cuda.is_bf16_supported()
        return torch.bfloat16 if bf16_ok else torch.float32
    return {"fp32": torch.float32, "bf16": torch.bfloat16, "bf16-mixed": torch.float32}[name]


def resolve_model_args(cfg: TrainConfig) -> ModelArgs:
    """The architecture: from --model-dir's config.json, checked against --model if both given."""
    m = cfg.model
    if m.model_dir is None:
        args = from_name(m.preset or "debug")
        if m.n_layers is not None:
            args.n_layers = m.n_layers
            if args.layer_types is not None:  # the preset's layer pattern, continued
                pattern = args.layer_types
                args.layer_types = tuple(pattern[i % len(pattern)] for i in range(m.n_layers))
        return args
    args = args_from_hf_config(load_hf_config(m.model_dir))
    if m.preset is not None:
        preset = from_name(m.preset)
        for name in (*_ARCH_FIELDS, "hd", "tie_embeddings"):
            want, have = getattr(preset, name), getattr(args, name)
            if want != have:
                raise UserError(
                    f"--model {m.preset} has {name}={want} but {m.model_dir}/config.json has "
                    f"{have}; drop --model or pass the matching preset"
                )
    return args


def lora_spec(cfg: TrainConfig, args: ModelArgs) -> LoRASpec | None:
    """What the --lora-* flags ask for on this model (None: full fine-tuning): the targets it
    has (`all-linear` on a model without linear-attention layers leaves theirs out). Values
    were checked in config."""
    lo = cfg.lora
    if not lo.rank:
        return None
    targets = model_targets(args, parse_targets(lo.targets))
    return LoRASpec(rank=lo.rank, alpha=float(lo.alpha), dropout=lo.dropout, targets=targets)


def resolve_tokenizer(cfg: TrainConfig) -> Any:
    if cfg.model.tokenizer is not None:
        return load_tokenizer(cfg.model.tokenizer, "--tokenizer")
    if cfg.model.model_dir is not None:
        return load_tokenizer(cfg.model.model_dir)
    # Random-init presets train on raw bytes: no tokenizer files needed, any vocab >= 259 fits.
    return byte_tokenizer()


def _check_shapes(cfg: TrainConfig, args: ModelArgs, tokenizer: Any) -> None:
    if len(tokenizer) > args.vocab_size:
        raise UserError(
            f"the tokenizer has {len(tokenizer)} tokens but the model's vocabulary is "
            f"{args.vocab_size}; pass a --tokenizer that matches the model"
        )
    seq_len = cfg.data.seq_len
    if seq_len > args.max_seq_len:
        raise UserError(
            f"--seq-len {seq_len} is beyond the model's {args.max_seq_len} positions; "
            f"pass --seq-len {args.max_seq_len} or less"
        )
    if cfg.optim.router_bias_update_rate and args.router_score != "sigmoid":
        raise UserError(
            "--router-bias-update-rate nudges the correction bias of DeepSeek-V3-style "
            "(sigmoid) routers; this model has none, so leave it 0"
        )


def _check_compensation(cfg: TrainConfig, dtype: torch.dtype) -> None:
    comp = cfg.optim.bf16_compensation
    if comp not in (None, "none") and dtype != torch.bfloat16:
        raise UserError(
            f"--bf16-compensation {comp} corrects bf16 parameter updates, but the parameters "
            f"are {str(dtype).removeprefix('torch.')} here; add --dtype bf16 or drop it"
        )


# ----------------------------------------------------------------------------- data


def _model_name(cfg: TrainConfig) -> str:
    """What adapter_config.json names as the base: the folder, or the (seeded) preset."""
    m = cfg.model
    return str(resolve_model_path(m.model_dir).resolve()) if m.model_dir else m.preset or "debug"


def build_model_weights(
    cfg: TrainConfig,
    args: ModelArgs,
    spec: LoRASpec | None,
    lora_kw: dict[str, Any],
    device: torch.device | str,
    resume_from: Path | None,
) -> Transformer:
    """The model with its weights: the checkpoint's, --model-dir's, or drawn from the seed.
    With LoRA each block becomes LoRA (NF4) as soon as it is loaded, so the full-size base never
    exists, and a LoRA checkpoint's adapters are loaded on top."""
    m, seed = cfg.model, cfg.run.seed
    dtype = lora_kw["dtype"]
    if spec is None:
        if resume_from is not None:
            return from_hf(resume_from, dtype=dtype, device=device)
        if m.model_dir is not None:
            return from_hf(m.model_dir, dtype=dtype, device=device)
        return weight_init.init_hashed(build_model(args, device, dtype, init=False), seed)
    adapt = block_adapter(spec, **lora_kw, seed=seed)
    if m.model_dir is not None:
        model = from_hf(m.model_dir, dtype=dtype, device=device, on_block=adapt)
    else:
        model = build_model(args, device, dtype, init=True, seed=seed, on_block=adapt)
    apply_lora(model, spec, **lora_kw, blocks_adapted=True)
    model.lora_base = _model_name(cfg)
    if resume_from is not None:
        adapter_io.load_adapter(model, resume_from)
    return model


def build_meta_model(
    cfg: TrainConfig, args: ModelArgs, spec: LoRASpec | None, lora_kw: dict[str, Any]
) -> Transformer:
    """The model's structure on the meta device (LoRA adapters and NF4 codes included), as every
    FSDP rank and a build that reads nothing build it; `materialise` gives it storage."""
    with torch.device("meta"):
        model = Transformer(args)
    model.to(lora_kw["dtype"])
    if spec is not None:
        apply_lora(model, spec, **lora_kw, seed=cfg.run.seed)
        model.lora_base = _model_name(cfg)
    config_dir = cfg.model.model_dir
    if config_dir is not None:
        model.hf_config = load_hf_config(config_dir)
        model.generation_config = load_generation_config(config_dir)
    return model


# ----------------------------------------------------------------------------- techniques


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


def model_device(env: dist_.DistEnv | None) -> torch.device:
    return env.device if env is not None else pick_device()


def offloaded_blocks(cfg: TrainConfig, n_layers: int, device: torch.device) -> int:
    """How many blocks (the first) --offload-activations offloads; none on a CPU, whose device
    memory is host memory (a copy would duplicate it), though a count past `n_layers` is
    refused there too."""
    target = cfg.techniques.offload_activations
    n = 0 if target.auto and device.type == "cpu" else target.count(n_layers)
    return n if device.type != "cpu" else 0


def materialise(
    model: Transformer,
    cfg: TrainConfig,
    device: torch.device,
    fill: str,
    full_sd: dict[str, Tensor] | None = None,
) -> None:
    """Give a meta model storage on its device (the host with --cpu-offload), then fill it:
    `fill` is "rank0" (rank 0's full state dict, each rank keeping its shard), "seed" (drawn
    from the seed, each rank its own shard: `weight_init`), or "none" (fake tensors; or a
    sharded checkpoint, which fills the shards when the training state is loaded)."""
    model.to_empty(device="cpu" if cfg.parallel.cpu_offload else device)
    model.tie_weights()
    if fill == "seed":
        weight_init.init_hashed(model, cfg.run.seed)
    elif fill == "rank0":
        dist_.load_full_state(model, full_sd)


# ----------------------------------------------------------------------------- the run


@dataclass
class _Inputs:
    """What a run reads before its model is built (nothing, without `read_inputs`)."""

    facts: RunFacts
    tokenizer: Any = None
    data: list[PackedData] | None = None  # one per --data source
    eval_set: Any = None  # as Run.eval_set
    resume_from: Path | None = None
    state: dict[str, Any] | None = None
    weights: list[float] | None = None  # the sources' mixture weights


def _read_inputs(
    cfg: TrainConfig, env: dist_.DistEnv | None, args: ModelArgs, spec: LoRASpec | None
) -> _Inputs:
    """Tokenizer, packed data, and with --resume the latest checkpoint and its state."""
    world = env.world if env is not None else 1
    tokenizer = resolve_tokenizer(cfg)
    _check_shapes(cfg, args, tokenizer)
    say = print if env is None or env.is_main else (lambda line: None)
    if cfg.objective.objective == "grpo":
        datas, weights, eval_set = build_prompts(cfg, tokenizer, say)
    elif cfg.objective.objective in ("dpo", "ipo", "simpo"):
        datas, weights, eval_set = build_pairs(cfg, tokenizer, say)
    else:
        datas, weights, eval_set = build_data(cfg, tokenizer, say, args.vocab_size)
    packs = any(getattr(d, "packs_documents", lambda: False)() for d in datas)
    rows = sum(d.rows for d in datas)
    facts = RunFacts(
        args.vocab_size,
        packs_documents=packs,
        rows=rows,
        world=world,
        router_aux_coef=args.router_aux_coef,
    )
    inputs = _Inputs(facts, tokenizer, datas, eval_set, weights=weights)
    if cfg.run.resume:
        inputs.resume_from = ckpt.pick_resume(Path(cfg.run.output_dir), cfg.run.resume_from, say)
        inputs.state = ckpt.load_train_state(inputs.resume_from)
        ranks = world if env is not None else None
        ckpt.check_resumable(inputs.resume_from, inputs.state, ranks, cfg.parallel.sharding)
        adapter_io.check_resume_kind(inputs.resume_from, spec)
    return inputs


def _build_model(
    cfg: TrainConfig,
    env: dist_.DistEnv | None,
    args: ModelArgs,
    spec: LoRASpec | None,
    lora_kw: dict[str, Any],
    device: torch.device,
    resume_from: Path | None,
    read: bool,
) -> tuple[Transformer, dict[str, Tensor] | None]:
    """The model with its weights (one process), or, under FSDP and without `read` (weights
    drawn from the seed later), the model on the meta device plus (FSDP rank 0, reading) the
    full state dict to fill the shards from."""
    if read and env is None:
        return build_model_weights(cfg, args, spec, lora_kw, device, resume_from), None
    full_sd = None
    if read and env.is_main and (spec or (resume_from is None and cfg.model.model_dir)):
        # Rank 0 alone reads the checkpoint (or a LoRA run's random base; a full model's random
        # init is drawn shard by shard, see materialise): host RAM holds one model, not one per
        # rank. A LoRA checkpoint holds no base, so its adapters come this way too.
        full_sd = build_model_weights(cfg, args, spec, lora_kw, "cpu", resume_from).state_dict()
    model = build_meta_model(cfg, args, spec, lora_kw)
    if resume_from is not None and spec is None:
        model.hf_config = load_hf_config(resume_from)
        model.generation_config = load_generation_config(resume_from)
    return model, full_sd


def _device_and_dtype(
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


def model_facts(cfg: TrainConfig, args: ModelArgs, world: int) -> RunFacts:
    """The facts a build that reads no data fills `cfg`'s defaults from (then its params'
    dtype): the model's shapes, the world, and the objective's rows as the data would be."""
    return RunFacts(
        args.vocab_size,
        # pair rows hold two sequences each (the estimator's random pairs): masked as in a run
        packs_documents=cfg.objective.objective in ("dpo", "ipo", "simpo"),
        world=world,
        router_aux_coef=args.router_aux_coef,
    )


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
    device, dtype = _device_and_dtype(cfg, env, opts)
    args = resolve_model_args(cfg)
    teacher = teacher_args(cfg, args) if cfg.objective.objective == "kd" else None
    check_splittable(cfg.parallel.cp, env.world if env else 1, args, teacher)  # before any load
    offloads = offloaded_blocks(cfg, args.n_layers, device) > 0  # of the whole model's blocks
    if opts.depth is not None:  # the first `depth` blocks only
        types = args.layer_types[: opts.depth] if args.layer_types else None
        args = dataclasses.replace(args, n_layers=opts.depth, layer_types=types)
    spec = lora_spec(cfg, args)
    if spec is not None and cfg.lora.quantize_base == "nf4" and (why := nf4_unfit(args)):
        raise UserError(f"--quantize-base nf4: {why}; drop --quantize-base for this model")
    world, read = env.world if env is not None else 1, opts.read_inputs
    inputs = _read_inputs(cfg, env, args, spec) if read else _Inputs(model_facts(cfg, args, world))
    inputs.facts.bf16_params = dtype == torch.bfloat16
    _check_compensation(cfg, dtype)
    fill_defaults(cfg, inputs.facts)

    base_dtype = pick_dtype(cfg.lora.base_dtype, device) if cfg.lora.base_dtype else dtype
    lora_kw = {"dtype": dtype, "base_dtype": base_dtype, "quantize": cfg.lora.quantize_base}
    resume_from = inputs.resume_from
    model, full_sd = _build_model(cfg, env, args, spec, lora_kw, device, resume_from, read)
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


def _attach_batches(run: Run, inputs: _Inputs) -> None:
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


# ----------------------------------------------------------------------------- frozen models


def teacher_args(cfg: TrainConfig, student: ModelArgs) -> ModelArgs:
    """The teacher's ModelArgs, from --teacher-dir's config.json (any depth and width; the
    student's vocabulary, else exit 2 naming both sizes)."""
    args = args_from_hf_config(load_hf_config(cfg.objective.teacher_dir, "--teacher-dir"))
    if args.vocab_size != student.vocab_size:
        raise UserError(
            f"--teacher-dir {cfg.objective.teacher_dir} has a vocabulary of "
            f"{args.vocab_size} tokens and the student {student.vocab_size}; distillation "
            "compares their distributions token by token: use a teacher with the student's "
            "tokenizer"
        )
    return args


@dataclass
class Frozen:
    """A model that runs without gradients beside the policy: the DPO/IPO reference or the KD
    teacher. One process: loaded with its weights. FSDP, or a build that reads nothing: on the
    meta device (sharded like the policy under FSDP) until `materialise` gives it storage, with
    rank 0 reading the full state dict to fill the shards from."""

    model: Any
    # FSDP rank 0: reads the full state dict when the shards are filled, after the policy's
    # own is freed (rank 0's host holds one model at a time)
    full_sd: Callable[[], dict[str, Tensor]] | None = None
    pending: bool = False  # still on the meta device


def build_frozen(
    cfg: TrainConfig,
    env: dist_.DistEnv | None,
    args: ModelArgs,
    spec: LoRASpec | None,
    lora_kw: dict[str, Any],
    device: torch.device,
    read: bool,
    start: Any = None,
) -> tuple[Frozen | None, Frozen | None]:
    """(reference, teacher) of the run, each None where the objective has none: the reference
    is a frozen copy of the starting weights for DPO/IPO without LoRA (with LoRA the policy
    with its adapters off serves; a build that reads no data, `read=False`, builds none with
    --precompute-ref, which drops it before the first step), the teacher is --teacher-dir's
    model. `start`: one process's policy as it starts (None when resuming), copied for the
    reference rather than read again. Without `read` both stay on the meta device, to be drawn
    from the seed."""
    o = cfg.objective
    dtype = lora_kw["dtype"]
    reference = teacher = None
    wants = o.objective in ("dpo", "ipo") or (o.objective == "grpo" and bool(o.beta))
    if wants and spec is None and (read or not o.precompute_ref):
        # the starting weights, also when resuming (the checkpoint is the policy, not them)
        def load_reference(where: Any) -> Any:
            if isinstance(start, torch.nn.Module):
                return copy.deepcopy(start)
            return build_model_weights(cfg, args, None, lora_kw, where, None)

        reference = _frozen(load_reference, args, dtype, cfg, env, device, read)
    if o.objective == "kd":

        def load_teacher(where: Any) -> Any:
            return from_hf(o.teacher_dir, dtype=dtype, device=where)

        teacher = _frozen(load_teacher, teacher_args(cfg, args), dtype, cfg, env, device, read)
    return reference, teacher


def _frozen(
    load: Any,
    args: ModelArgs,
    dtype: torch.dtype,
    cfg: TrainConfig,
    env: dist_.DistEnv | None,
    device: torch.device,
    read: bool,
) -> Frozen:
    if read and env is None:
        return Frozen(load(device).requires_grad_(False).eval())

    def full_sd() -> dict[str, Tensor]:
        return load("cpu").state_dict()

    with torch.device("meta"):
        model = Transformer(args)
    model.to(dtype).requires_grad_(False).eval()
    if env is not None:
        shard_model(model, cfg, env, frozen=True)
    return Frozen(model, full_sd if read and env.is_main else None, pending=True)


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
