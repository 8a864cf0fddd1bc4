"""`compiletune train`: the training loop, read top to bottom.

config -> tokenizer -> model arguments -> data -> model (HF weights, checkpoint, or random init)
-> optimizer + schedule -> loop: batch -> forward + loss -> backward -> clip -> step -> metrics line
-> periodic checkpoint. Everything a user can get wrong is checked before the output folder is
touched, so a bad flag never leaves a half-written run behind.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from tqdm import tqdm

from compiletune import checkpoint as ckpt
from compiletune import distributed as dist_
from compiletune import lora as lora_io
from compiletune import torch_internals
from compiletune.activation import apply_eager_checkpointing, parse_ac
from compiletune.compile import CompileOptions, compile_regions
from compiletune.config import TrainConfig, save_yaml
from compiletune.data import (
    Batches,
    PackedData,
    eval_batches,
    load_examples,
    pack,
    split_examples,
)
from compiletune.errors import UserError
from compiletune.loggers import WANDB_RUN_ID, check_available, open_loggers, parse_loggers
from compiletune.loss import IGNORE_INDEX, LossHead, head_kind
from compiletune.metrics import MetricsLog, peak_memory_gib, perplexity
from compiletune.models import (
    ModelArgs,
    Transformer,
    args_from_hf_config,
    build_model,
    from_hf,
    from_name,
    load_hf_config,
    num_params,
)
from compiletune.models.lora import (
    LoRASpec,
    apply_lora,
    block_adapter,
    nf4_unfit,
    parse_targets,
)
from compiletune.optim import Optimizer
from compiletune.tokenizer import byte_tokenizer, load_tokenizer

# Fields that make two architectures different models (head_dim is compared resolved).
_ARCH_FIELDS = ("dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "ffn_dim", "qkv_bias")


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
    if cfg.model_dir is None:
        args = from_name(cfg.model or "debug")
        if cfg.n_layers is not None:
            args.n_layers = cfg.n_layers
        return args
    args = args_from_hf_config(load_hf_config(cfg.model_dir))
    if cfg.model is not None:
        preset = from_name(cfg.model)
        for name in (*_ARCH_FIELDS, "hd", "tie_embeddings"):
            want, have = getattr(preset, name), getattr(args, name)
            if want != have:
                raise UserError(
                    f"--model {cfg.model} has {name}={want} but {cfg.model_dir}/config.json has "
                    f"{have}; drop --model or pass the matching preset"
                )
    return args


def lora_spec(cfg: TrainConfig) -> LoRASpec | None:
    """What the --lora-* flags ask for (None: full fine-tuning). Values were checked in config."""
    if not cfg.lora_rank:
        return None
    return LoRASpec(
        rank=cfg.lora_rank,
        alpha=float(cfg.lora_alpha),
        dropout=cfg.lora_dropout,
        targets=parse_targets(cfg.lora_targets),
    )


def check_resume_kind(checkpoint: Path, spec: LoRASpec | None) -> None:
    """A LoRA run resumes from an adapter checkpoint with the same adapters; a full run from
    weights."""
    if lora_io.is_adapter_folder(checkpoint) and spec is None:
        raise UserError(
            f"--resume: {checkpoint} is a LoRA checkpoint; pass the run's --lora-rank (and its "
            "other --lora-* flags) to continue it"
        )
    if spec is None:
        return
    if not lora_io.is_adapter_folder(checkpoint):
        raise UserError(
            f"--resume: {checkpoint} holds full weights, not a LoRA adapter; drop --lora-rank "
            "to continue that run, or start the LoRA run in another --output-dir"
        )
    saved = lora_io.read_adapter_spec(checkpoint)
    if (saved.rank, saved.alpha, saved.targets) != (spec.rank, spec.alpha, spec.targets):
        raise UserError(
            f"--resume: {checkpoint} has rank {saved.rank}, alpha {saved.alpha:g} adapters on "
            f"{','.join(saved.targets)}; pass --lora-rank {saved.rank} --lora-alpha "
            f"{saved.alpha:g} --lora-targets {','.join(saved.targets)}"
        )


def resolve_tokenizer(cfg: TrainConfig) -> Any:
    if cfg.tokenizer is not None:
        return load_tokenizer(cfg.tokenizer)
    if cfg.model_dir is not None:
        return load_tokenizer(cfg.model_dir)
    # Random-init presets train on raw bytes: no tokenizer files needed, any vocab >= 259 fits.
    return byte_tokenizer()


def check_output_dir(cfg: TrainConfig) -> Path:
    out = Path(cfg.output_dir)
    if out.exists() and not out.is_dir():
        raise UserError(f"--output-dir {out} is a file; pass a folder path")
    # The nearest existing ancestor must be a writable folder; nothing is created yet.
    probe = out
    while not probe.exists():
        probe = probe.parent
    if not probe.is_dir() or not os.access(probe, os.W_OK | os.X_OK):
        raise UserError(f"--output-dir {out}: {probe} is not a writable folder; pass another path")
    existing = ckpt.list_checkpoints(out)
    if cfg.resume and not existing:
        raise UserError(
            f"--resume: {out} holds no complete checkpoint (step_N/ with {ckpt.STATE_FILE}); "
            "drop --resume to start a new run"
        )
    if existing and not cfg.resume and not cfg.overwrite:
        raise UserError(
            f"--output-dir {out} already holds checkpoints (up to {existing[-1][1].name}); "
            "pass --resume to continue, --overwrite to start over, or another --output-dir"
        )
    return out


def lr_factor(step: int, cfg: TrainConfig) -> float:
    """Multiplier of the peak lr for optimizer step `step` (0-based): warmup, then decay."""
    warmup = cfg.warmup_steps or 0
    if step < warmup:
        return (step + 1) / warmup
    if cfg.schedule == "constant":
        return 1.0
    progress = min(1.0, (step - warmup) / max(1, cfg.max_steps - warmup))
    floor = cfg.min_lr_ratio
    if cfg.schedule == "linear":
        return floor + (1 - floor) * (1 - progress)
    return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))


def _silent(*args: Any, **kwargs: Any) -> None:
    """`print` for ranks other than 0."""


def forward_hidden(model: torch.nn.Module, batch: dict[str, torch.Tensor], doc_mask: bool):
    """Hidden states [b, s, d] of a batch; with `doc_mask` every packed example attends only to
    itself, with its positions restarting at 0 (as if it were alone in the row)."""
    if doc_mask:
        return model.hidden_states(batch["inputs"], batch["positions"], batch["doc_ids"])
    return model.hidden_states(batch["inputs"])


def evaluate(
    model: torch.nn.Module,
    data: PackedData,
    loss_kind: str,
    batch_size: int,
    device: torch.device,
    doc_mask: bool,
    env: dist_.DistEnv | None = None,
) -> dict[str, float]:
    """Mean loss per target token (and its perplexity) over every row of `data`.

    Runs eagerly even under --compile (`force_eager`): the compiled regions were traced with
    gradients on, so calling them under no_grad would compile them a second time, and a short
    last batch a third. Eager gives the same loss (the numerics contract), and without autograd
    nothing is kept for a backward.

    Under FSDP the rows are split over the ranks as training batches are (each global batch of
    world x batch_size rows, each rank its slice), and the sums are added up at the end. Every
    rank runs the same number of forwards (FSDP's gathers are collectives): a rank whose slice
    of the last global batch is empty runs one row with no targets.
    """
    rank, world = (env.rank, env.world) if env is not None else (0, 1)
    head = LossHead(model.output, loss_kind)  # shares the weight; the eager form of the head
    total = torch.zeros((), device=device, dtype=torch.float32)
    n_targets = 0
    model.eval()
    try:
        with torch.no_grad(), torch.compiler.set_stance("force_eager"):
            for batch in eval_batches(data, batch_size * world):
                mine = {k: v[rank * batch_size : (rank + 1) * batch_size] for k, v in batch.items()}
                if mine["inputs"].shape[0] == 0:
                    mine = {k: v[:1] for k, v in batch.items()}
                    mine["targets"] = torch.full_like(mine["targets"], IGNORE_INDEX)
                mine = {k: v.to(device, non_blocking=True) for k, v in mine.items()}
                total += head(forward_hidden(model, mine, doc_mask), mine["targets"])
                n_targets += int((mine["targets"] != IGNORE_INDEX).sum())
    finally:
        model.train()
    loss_sum = total.item()
    if env is not None:
        loss_sum, n_targets = dist_.all_reduce_sum([loss_sum, n_targets], device)
        n_targets = int(n_targets)
    loss = loss_sum / n_targets
    return {"eval_loss": loss, "eval_ppl": perplexity(loss), "eval_targets": n_targets}


@dataclass
class _Stop:
    """Set by SIGINT/SIGTERM: the loop finishes its step, checkpoints, and returns.

    `requested` is this process's signal, set at any moment; `agreed` is what the loop acts on.
    In one process they are the same; under FSDP `agreed` changes only through the per-step
    all-reduce, so every rank leaves the loop after the same step whenever each saw the signal.
    """

    requested: bool = False
    agreed: bool = False
    distributed: bool = False

    def should_stop(self) -> bool:
        return self.agreed if self.distributed else self.requested


def train(cfg: TrainConfig) -> dict[str, Any]:
    """Run a training job described by `cfg`; returns the run summary (the same on every rank).

    With --fsdp every process of the job runs this function; rank 0 alone writes the metrics,
    the config and the summary, and prints.
    """
    if cfg.preflight and pick_device().type == "cuda":
        preflight_check(cfg)
    env = dist_.init_distributed(pick_device().type) if cfg.fsdp else None
    try:
        return _train(cfg, env)
    finally:
        if env is not None:
            dist_.shutdown(env)


def preflight_check(cfg: TrainConfig) -> None:
    """Before anything is allocated: refuse a step that cannot fit this GPU, naming flags that
    would make it fit (estimate.py, fake tensors; seconds for an 8B model). Runs before the
    process group exists, since the estimate simulates its own. An estimator failure (a torch
    version without one of its private APIs, say) warns and lets the run go on."""
    import warnings

    from compiletune import estimate

    local = int(os.environ.get("LOCAL_RANK", "0"))
    capacity = torch.cuda.mem_get_info(local)[1]
    world = dist_.launched_world_size() if cfg.fsdp else 1
    try:
        estimate.preflight(cfg, world, capacity)
    except UserError:
        raise
    except Exception as e:  # the estimate is advice; never block a run on its own bug
        warnings.warn(
            f"compiletune: the memory pre-flight check failed ({type(e).__name__}: {e}); "
            "continuing without it",
            stacklevel=2,
        )


def _build_model(
    cfg: TrainConfig,
    args: ModelArgs,
    dtype: torch.dtype,
    device: torch.device,
    resume_from: Path | None,
    env: dist_.DistEnv | None,
) -> tuple[Transformer, dict[str, Tensor] | None]:
    """The model with its weights (single process), or, under FSDP, the model on the meta
    device plus rank 0's full state dict to broadcast once the model is sharded (None on other
    ranks, and when a sharded checkpoint supplies the weights)."""
    if env is None:
        if resume_from is not None:
            return from_hf(resume_from, dtype=dtype, device=device), None
        if cfg.model_dir is not None:
            return from_hf(cfg.model_dir, dtype=dtype, device=device), None
        return build_model(args, device=device, dtype=dtype, init=True, seed=cfg.seed), None
    full_sd = None
    if env.is_main and resume_from is None:
        # Rank 0 alone reads the checkpoint (or draws the initial weights, on the host, the
        # same values a single CPU process draws): host RAM holds one model, not one per rank.
        if cfg.model_dir is not None:
            source = from_hf(cfg.model_dir, dtype=dtype, device="cpu")
        else:
            source = build_model(args, device="cpu", dtype=dtype, init=True, seed=cfg.seed)
        full_sd = source.state_dict()
    with torch.device("meta"):
        model = Transformer(args)
    model.to(dtype)
    config_dir = resume_from or cfg.model_dir
    if config_dir is not None:
        model.hf_config = load_hf_config(config_dir)
    return model, full_sd


def _build_lora_model_fsdp(
    cfg: TrainConfig,
    args: ModelArgs,
    spec: LoRASpec,
    lora_kw: dict[str, Any],
    resume_from: Path | None,
    env: dist_.DistEnv,
) -> tuple[Transformer, dict[str, Tensor] | None]:
    """Under FSDP: the LoRA model on the meta device (every rank), plus rank 0's full state dict
    of the real one, built on the host exactly as a single CPU process builds it (blocks
    converted, NF4 quantized, as they load; adapters drawn from the seed) and, on resume, with
    the checkpoint's adapters loaded. Frozen and trainable parameters of a block are one module
    tree, so each block's `fully_shard` unit holds both."""
    base = str(Path(cfg.model_dir).resolve()) if cfg.model_dir else cfg.model or "debug"
    full_sd = None
    if env.is_main:
        adapt = block_adapter(spec, **lora_kw, seed=cfg.seed)
        if cfg.model_dir is not None:
            source = from_hf(cfg.model_dir, dtype=lora_kw["dtype"], device="cpu", on_block=adapt)
        else:
            source = build_model(
                args, "cpu", lora_kw["dtype"], init=True, seed=cfg.seed, on_block=adapt
            )
        apply_lora(source, spec, **lora_kw, blocks_adapted=True)
        if resume_from is not None:
            lora_io.load_adapter(source, resume_from)
        full_sd = source.state_dict()
    with torch.device("meta"):
        model = Transformer(args)
    model.to(lora_kw["dtype"])
    apply_lora(model, spec, **lora_kw, seed=cfg.seed)  # the same structure, on meta
    model.lora_base = base
    if cfg.model_dir is not None:
        model.hf_config = load_hf_config(cfg.model_dir)
    return model, full_sd


def _train(cfg: TrainConfig, env: dist_.DistEnv | None) -> dict[str, Any]:
    torch.manual_seed(cfg.seed)
    graphs_before = torch_internals.dynamo_graphs_compiled()
    device = env.device if env is not None else pick_device()
    dtype = pick_dtype(cfg.dtype, device)
    world = env.world if env is not None else 1
    main = env is None or env.is_main
    if dtype == torch.bfloat16 and device.type == "cuda" and not torch.cuda.is_bf16_supported():
        raise UserError("--dtype bf16: this GPU has no bf16 support; pass --dtype fp32")

    # --- everything that can be wrong is checked before anything is written -------------
    out = check_output_dir(cfg)
    tokenizer = resolve_tokenizer(cfg)
    args = resolve_model_args(cfg)
    if len(tokenizer) > args.vocab_size:
        raise UserError(
            f"the tokenizer has {len(tokenizer)} tokens but the model's vocabulary is "
            f"{args.vocab_size}; pass a --tokenizer that matches the model"
        )
    if cfg.seq_len > args.max_seq_len:
        raise UserError(
            f"--seq-len {cfg.seq_len} is beyond the model's {args.max_seq_len} positions; "
            f"pass --seq-len {args.max_seq_len} or less"
        )
    if args.sliding_window is not None and cfg.seq_len > args.sliding_window:
        raise UserError(
            f"--seq-len {cfg.seq_len} exceeds the model's sliding window of {args.sliding_window}, "
            f"which compiletune does not implement; pass --seq-len {args.sliding_window} or less"
        )
    if cfg.loss is None:
        # The fused head pays off once logits are large; a tiny vocabulary gains nothing from it.
        cfg.loss = "fused" if cfg.compile or args.vocab_size >= 32000 else "plain"
    log_names = parse_loggers(cfg.log)
    check_available(log_names)
    spec = lora_spec(cfg)
    if spec is not None and cfg.quantize_base == "nf4" and (why := nf4_unfit(args)):
        raise UserError(f"--quantize-base nf4: {why}; drop --quantize-base for this model")
    examples = load_examples(cfg.data, tokenizer)
    held_out, held_out_name = None, None
    if cfg.val_split > 0:
        # Whole examples are held out before packing, so none is on both sides.
        examples, held_out = split_examples(examples, cfg.val_split, cfg.seed)
        held_out_name = f"the --val-split {cfg.val_split} held-out examples"
    elif cfg.eval_data is not None:
        held_out = load_examples(cfg.eval_data, tokenizer)
        held_out_name = f"--eval-data {cfg.eval_data}"
    data = pack(examples, cfg.seq_len, source=cfg.data)
    eval_set = (
        pack(held_out, cfg.seq_len, source=held_out_name, keep_tail=True) if held_out else None
    )
    if cfg.doc_mask is None:
        # Document masking is the default wherever a row holds more than one example: without
        # it an example attends to the unrelated text packed before it, which it never sees at
        # inference, and its positions run on from that text. With the mask, loss and
        # gradients of a packed row equal those of its examples run one by one (tested). Where
        # no row holds two examples the mask changes nothing, and plain causal attention is
        # the simpler kernel.
        cfg.doc_mask = bool((data.doc_ids > 0).any())
    resume_from = ckpt.latest_checkpoint(out) if cfg.resume else None
    state = ckpt.load_train_state(resume_from) if resume_from else None
    if state is not None:
        ckpt.check_resumable(resume_from, state, world if env is not None else None, cfg.sharding)
    if resume_from is not None:
        check_resume_kind(resume_from, spec)

    base_dtype = pick_dtype(cfg.base_dtype, device) if cfg.base_dtype else dtype
    lora_kw = {"dtype": dtype, "base_dtype": base_dtype, "quantize": cfg.quantize_base}
    if spec is None:
        model, full_sd = _build_model(cfg, args, dtype, device, resume_from, env)
    elif env is not None:
        model, full_sd = _build_lora_model_fsdp(cfg, args, spec, lora_kw, resume_from, env)
    else:
        full_sd = None
        # Each block becomes LoRA (NF4) as soon as it is loaded: the full-size base never exists.
        adapt = block_adapter(spec, **lora_kw, seed=cfg.seed)
        if cfg.model_dir is not None:
            model = from_hf(cfg.model_dir, dtype=dtype, device=device, on_block=adapt)
        else:
            model = build_model(args, device, dtype, init=True, seed=cfg.seed, on_block=adapt)
        apply_lora(model, spec, **lora_kw, blocks_adapted=True)
        # What adapter_config.json names as the base: the folder, or the (seeded) preset.
        model.lora_base = (
            str(Path(cfg.model_dir).resolve()) if cfg.model_dir else cfg.model or "debug"
        )
        if resume_from is not None:
            lora_io.load_adapter(model, resume_from)

    # --- the run's folder --------------------------------------------------------------
    if main:
        if cfg.overwrite and out.exists():
            for _, path in ckpt.list_checkpoints(out):
                shutil.rmtree(path)
            if (out / lora_io.MERGED_DIR).is_dir():
                shutil.rmtree(out / lora_io.MERGED_DIR)
            # The W&B run id too: a later --resume must not continue the discarded run.
            for stale in ("metrics.jsonl", "summary.json", WANDB_RUN_ID):
                (out / stale).unlink(missing_ok=True)
        out.mkdir(parents=True, exist_ok=True)
        save_yaml(cfg, out / "config.yaml")

    # The head shares the model's output projection; with --compile both are compiled in place.
    head = LossHead(model.output, head_kind(cfg.loss, cfg.compile))
    regions = None
    policy = parse_ac(cfg.ac, cfg.ac_every)
    if cfg.compile:
        # On a CPU the device memory is host memory: offloading would copy every saved
        # activation into a second buffer of the same memory and back, for nothing.
        offload = cfg.offload_activations and device.type != "cpu"
        if cfg.offload_activations and not offload and main:
            print(
                "--offload-activations: training on the CPU, where activations already live in "
                "host memory; nothing to offload, the flag is ignored",
                flush=True,
            )
        opts = CompileOptions(
            backend=cfg.compile_backend,
            loss=cfg.loss,
            dump=cfg.dump_graphs is not None,
            ac=policy,
            offload=offload,
        )
        regions = compile_regions(model, head, opts)
    elif policy.kind != "none":
        apply_eager_checkpointing(model, policy)
    if env is not None:
        # After compile (FSDP's hooks stay outside the compiled blocks), then materialise the
        # shards and fill them from rank 0.
        dist_.shard_model(model, env, cfg)
        model.to_empty(device="cpu" if cfg.cpu_offload else device)
        model.tie_weights()
        if resume_from is None or spec is not None:  # a LoRA checkpoint holds no base
            dist_.load_full_state(model, full_sd)
        del full_sd

    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = Optimizer(
        [(n, p) for n, p in model.named_parameters() if p.requires_grad],
        kind=cfg.optimizer,
        lr=cfg.lr,
        betas=(0.9, 0.95),
        weight_decay=cfg.weight_decay,
        in_backward=cfg.optimizer_in_backward,
        bf16_compensation=cfg.bf16_compensation,
        device=torch.device("cpu") if cfg.cpu_offload else device,
    )
    # Every rank draws the same global batch of world x --batch-size rows and trains its slice.
    batches = Batches(data, cfg.batch_size * world, cfg.seed)
    rank = env.rank if env else 0
    rank_rows = slice(rank * cfg.batch_size, (rank + 1) * cfg.batch_size)
    start_step = 0
    if state is not None:
        if env is not None:
            opt_sd = dist_.load_sharded(
                resume_from / dist_.SHARDED_DIR,
                model if spec is None else None,  # LoRA: adapters came with rank 0's state
                optimizer.state_dict(),
            )
        else:
            opt_sd = state["optimizer"]
        optimizer.load_state_dict(opt_sd)
        batches.load_state_dict(state["data"])
        ckpt.set_rng_state(state["rng"])
        start_step = state["step"]

    n_params = num_params(args)
    say = print if main else _silent
    dtype_name = cfg.dtype if cfg.dtype == "bf16-mixed" else str(dtype).removeprefix("torch.")
    say(
        f"model {cfg.model or cfg.model_dir or 'debug'}: {n_params / 1e6:.1f}M parameters, "
        f"{dtype_name} on {device.type}"
        + (
            f" x {world} processes (FSDP2 {cfg.sharding}"
            + (", CPU offload" if cfg.cpu_offload else "")
            + ")"
            if env is not None
            else ""
        )
        + f"; data {cfg.data}: {data.inputs.shape[0]} rows of {cfg.seq_len} tokens"
        + (", document-masked" if cfg.doc_mask else "")
        + (f"; eval {eval_set.rows} rows" if eval_set is not None else "")
        + f"; output {out}"
        + (f"; resuming from {resume_from.name}" if resume_from else ""),
        flush=True,
    )
    n_trainable = sum(p.numel() for p in params)
    if spec is not None:
        stored = cfg.quantize_base or str(base_dtype).removeprefix("torch.")
        say(
            f"LoRA rank {spec.rank} (alpha {spec.alpha:g}) on {','.join(spec.targets)}: "
            f"{n_trainable / 1e6:.2f}M trainable parameters ({n_trainable / n_params:.2%}), "
            f"frozen projections stored as {stored}",
            flush=True,
        )

    def train_state(step: int) -> dict[str, Any]:
        state = {
            "step": step,
            "data": batches.state_dict(),
            "rng": ckpt.rng_state(),
            "config": cfg.to_dict(),
        }
        if env is None:
            state["optimizer"] = optimizer.state_dict()
        else:  # the optimizer state is in the sharded checkpoint, one entry per rank
            state["world_size"] = world
        return state

    def save(step: int, final: bool) -> Path:
        if env is None:
            return ckpt.save_checkpoint(out, step, model, tokenizer, train_state(step))
        return ckpt.save_sharded_checkpoint(
            out,
            step,
            model,
            tokenizer,
            train_state(step),
            optimizer.state_dict(),
            is_main=main,
            export_hf=final,
        )

    metrics = (
        MetricsLog(out / "metrics.jsonl", resume_step=start_step if state else None)
        if main
        else None
    )
    loggers = (
        open_loggers(log_names, out, cfg.to_dict(), start_step if state else None) if main else []
    )
    stop = _Stop(distributed=env is not None)
    previous = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}

    def request_stop(signum: int, frame: Any) -> None:
        if stop.requested:  # a second Ctrl-C means now
            raise KeyboardInterrupt
        stop.requested = True

    for s in previous:
        signal.signal(s, request_stop)

    interactive = sys.stderr.isatty() and main
    log_every = max(1, cfg.max_steps // 10)
    bar = tqdm(
        total=cfg.max_steps, initial=start_step, disable=not interactive, unit="step", ncols=100
    )
    first_loss = last_loss = float("nan")
    last_eval: dict[str, float] | None = None
    eval_seconds = 0.0
    tokens_done, t_start = 0, time.perf_counter()
    last_saved: Path | None = resume_from
    merged: Path | None = None
    step = start_step
    try:
        model.train()
        while step < cfg.max_steps and not stop.should_stop():
            t0 = time.perf_counter()
            micro = [batches.next() for _ in range(cfg.grad_accum)]  # global batches
            # The lr is a function of the step alone (so a resume needs no schedule state); it is
            # set before backward because --optimizer-in-backward steps during backward.
            lr = cfg.lr * lr_factor(step, cfg)
            optimizer.set_lr(lr)
            # The loss is normalised by the target tokens of the whole accumulated batch, so
            # accumulation gives the same gradient as one big batch.
            # Under FSDP every rank sees the whole global batch, so the count needs no
            # communication; FSDP averages gradients over ranks, which the factor `world` undoes.
            n_targets = sum(int((mb["targets"] != IGNORE_INDEX).sum()) for mb in micro)
            total = torch.zeros((), device=device, dtype=torch.float32)
            for mb in micro:
                mb = {k: v[rank_rows].to(device, non_blocking=True) for k, v in mb.items()}
                hidden = forward_hidden(model, mb, cfg.doc_mask)  # [b, s, d]
                loss = head(hidden, mb["targets"])  # fp32 [], summed over targets
                (loss * (world / n_targets)).backward()
                total += loss.detach()
            grad_norm = (
                torch.nn.utils.clip_grad_norm_(params, cfg.max_grad_norm)
                if cfg.max_grad_norm > 0
                else None
            )
            optimizer.step()  # a no-op with --optimizer-in-backward: already stepped
            optimizer.zero_grad()
            step += 1

            loss_sum = total.item()
            if env is not None:
                # One collective per step: the global loss, and a stop request seen by any
                # rank (so every rank leaves the loop after the same step).
                loss_sum, stop_votes = dist_.all_reduce_sum([loss_sum, stop.requested], device)
                stop.agreed = stop_votes > 0
            loss_value = loss_sum / n_targets
            if not math.isfinite(loss_value):
                raise UserError(
                    f"the loss became {loss_value} at step {step}; lower --lr or use --dtype fp32"
                    + (f" (last good checkpoint: {last_saved})" if last_saved else "")
                )
            dt = time.perf_counter() - t0
            n_tokens = cfg.grad_accum * cfg.batch_size * world * cfg.seq_len
            tokens_done += n_tokens
            if grad_norm is not None and hasattr(grad_norm, "full_tensor"):
                grad_norm = grad_norm.full_tensor()  # the norm over every rank's shards
            record = {
                "step": step,
                "loss": loss_value,
                "lr": lr,
                "grad_norm": None if grad_norm is None else float(grad_norm),
                "tokens": n_tokens,
                "targets": n_targets,
                "tokens_per_s": n_tokens / dt,
                "step_time_s": dt,
                "peak_mem_gib": peak_memory_gib(device),
                "epoch": batches.epoch,
            }
            at_end = step == cfg.max_steps or stop.should_stop()
            if eval_set is not None and (at_end or (cfg.eval_every and step % cfg.eval_every == 0)):
                t_eval = time.perf_counter()
                last_eval = evaluate(
                    model, eval_set, cfg.loss, cfg.batch_size, device, cfg.doc_mask, env
                )
                eval_seconds += time.perf_counter() - t_eval
                record.update(last_eval)  # eval_loss, eval_ppl, eval_targets on this step's line
            if metrics is not None:
                metrics.write(record)
            for logger in loggers:
                logger.log(record)
            if step == start_step + 1:
                first_loss = loss_value
            last_loss = loss_value
            bar.update(1)
            postfix = {
                "loss": f"{loss_value:.3f}",
                "tok_s": f"{record['tokens_per_s']:.0f}",
                "mem": f"{record['peak_mem_gib']:.2f}G",
            }
            if last_eval is not None:
                postfix["eval"] = f"{last_eval['eval_loss']:.3f}"
            bar.set_postfix(postfix)
            evaluated = "eval_loss" in record
            if (
                main
                and not interactive
                and (step % log_every == 0 or step == cfg.max_steps or evaluated)
            ):
                print(
                    f"step {step}/{cfg.max_steps} loss {loss_value:.4f} lr {lr:.2e} "
                    f"{record['tokens_per_s']:.0f} tok/s mem {record['peak_mem_gib']:.2f} GiB"
                    + (
                        f" eval_loss {record['eval_loss']:.4f} ppl {record['eval_ppl']:.2f}"
                        if evaluated
                        else ""
                    ),
                    flush=True,
                )
            if regions is not None and cfg.dump_graphs and step == start_step + 1 and main:
                regions.write_dump(Path(cfg.dump_graphs))  # every region has compiled by now
            if cfg.save_every and step % cfg.save_every == 0 and step < cfg.max_steps:
                last_saved = save(step, final=False)
        # The training peak of every rank, before the final save (whose staging copies count
        # toward the process's peak on CPU) adds its own.
        train_peak = peak_memory_gib(device)
        train_peaks = [train_peak] if env is None else dist_.gather_floats(train_peak, device)
        if step > start_step or resume_from is None:
            last_saved = save(step, final=True)
        if cfg.merge and step >= cfg.max_steps:
            merged = lora_io.save_merged(
                model, out / lora_io.MERGED_DIR, tokenizer=tokenizer, writer=main
            )
            if env is not None:
                torch.distributed.barrier()  # the folder is complete before any rank returns
    finally:
        bar.close()
        if metrics is not None:
            metrics.close()
        for logger in loggers:
            logger.close()
        for s, handler in previous.items():
            signal.signal(s, handler)

    elapsed = time.perf_counter() - t_start - eval_seconds  # training time alone
    peak_mem = peak_memory_gib(device)
    rank_peaks = [peak_mem] if env is None else dist_.gather_floats(peak_mem, device)
    peak_mem = max(rank_peaks)  # the busiest rank's peak
    compile_stats = regions.stats() if regions is not None else None
    # Graphs compiled outside the model's regions: torch.compile'd helpers (the fused head's
    # row functions and gradient scaling on a CPU, our optimizer step), in eager runs too.
    graphs = torch_internals.dynamo_graphs_compiled() - graphs_before
    helper_graphs = max(0, graphs - (compile_stats["compiles"] if compile_stats else 0))
    if regions is not None and cfg.dump_graphs and main:
        regions.write_dump(Path(cfg.dump_graphs))
    summary = {
        "steps": step,
        "interrupted": step < cfg.max_steps,
        "first_loss": first_loss,
        "final_loss": last_loss,
        "tokens": tokens_done,
        "seconds": elapsed,
        "tokens_per_s": tokens_done / elapsed if elapsed > 0 else 0.0,
        "peak_mem_gib": peak_mem,
        "peak_mem_gib_per_rank": rank_peaks,
        "train_peak_mem_gib_per_rank": train_peaks,
        "checkpoint": str(last_saved) if last_saved else None,
        "merged": str(merged) if merged else None,
        "trainable_params": n_trainable,
        "optimizer": cfg.optimizer + (" in-backward" if cfg.optimizer_in_backward else ""),
        "optimizer_state_bytes": optimizer.state_bytes(),
        "output_dir": str(out),
        "loss_kind": cfg.loss,
        "doc_mask": cfg.doc_mask,
        "eval_loss": last_eval["eval_loss"] if last_eval else None,
        "eval_ppl": last_eval["eval_ppl"] if last_eval else None,
        "eval_seconds": eval_seconds,
        "compile": compile_stats,
        "helper_graphs": helper_graphs,
        "processes": world,
    }
    if main:
        (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    say(
        ("stopped early: " if summary["interrupted"] else "done: ")
        + f"{step} steps, loss {first_loss:.4f} -> {last_loss:.4f}, "
        + (
            f"eval loss {last_eval['eval_loss']:.4f} (ppl {last_eval['eval_ppl']:.2f}), "
            if last_eval
            else ""
        )
        + f"{tokens_done} tokens in {elapsed:.1f}s ({summary['tokens_per_s']:.0f} tok/s), "
        f"peak mem {summary['peak_mem_gib']:.2f} GiB, "
        + (
            f"{compile_stats['compiles']} compiles ({compile_stats['recompiles']} recompiles, "
            f"{compile_stats['compile_seconds']:.1f}s), "
            if compile_stats
            else ""
        )
        + (f"{helper_graphs} helper graphs compiled, " if helper_graphs else "")
        + f"checkpoint {last_saved}"
        + (f", merged model {merged}" if merged else ""),
        flush=True,
    )
    return summary
