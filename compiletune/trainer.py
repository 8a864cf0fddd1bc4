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
from tqdm import tqdm

from compiletune import checkpoint as ckpt
from compiletune import lora as lora_io
from compiletune.activation import apply_eager_checkpointing, parse_ac
from compiletune.compile import CompileOptions, compile_regions
from compiletune.config import TrainConfig, save_yaml
from compiletune.data import Batches, load_examples, pack
from compiletune.errors import UserError
from compiletune.loss import IGNORE_INDEX, LossHead, head_kind
from compiletune.metrics import MetricsLog, peak_memory_gib
from compiletune.models import (
    ModelArgs,
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
    if name is None:
        bf16_ok = device.type == "cuda" and torch.cuda.is_bf16_supported()
        return torch.bfloat16 if bf16_ok else torch.float32
    return {"fp32": torch.float32, "bf16": torch.bfloat16}[name]


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


@dataclass
class _Stop:
    """Set by SIGINT/SIGTERM: the loop finishes its step, checkpoints, and returns."""

    requested: bool = False


def train(cfg: TrainConfig) -> dict[str, Any]:
    """Run a training job described by `cfg`; returns the run summary."""
    torch.manual_seed(cfg.seed)
    device = pick_device()
    dtype = pick_dtype(cfg.dtype, device)
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
    spec = lora_spec(cfg)
    if spec is not None and cfg.quantize_base == "nf4" and (why := nf4_unfit(args)):
        raise UserError(f"--quantize-base nf4: {why}; drop --quantize-base for this model")
    examples = load_examples(cfg.data, tokenizer)
    data = pack(examples, cfg.seq_len)
    resume_from = ckpt.latest_checkpoint(out) if cfg.resume else None
    state = ckpt.load_train_state(resume_from) if resume_from else None
    if resume_from is not None:
        check_resume_kind(resume_from, spec)

    base_dtype = pick_dtype(cfg.base_dtype, device) if cfg.base_dtype else dtype
    lora_kw = {"dtype": dtype, "base_dtype": base_dtype, "quantize": cfg.quantize_base}
    # Each block becomes LoRA (NF4) as soon as it is loaded: the full-size base never exists.
    adapt = block_adapter(spec, **lora_kw, seed=cfg.seed) if spec is not None else None
    if resume_from is not None and spec is None:
        model = from_hf(resume_from, dtype=dtype, device=device)
    elif cfg.model_dir is not None:
        model = from_hf(cfg.model_dir, dtype=dtype, device=device, on_block=adapt)
    else:
        model = build_model(args, device, dtype, init=True, seed=cfg.seed, on_block=adapt)
    if spec is not None:
        apply_lora(model, spec, **lora_kw, blocks_adapted=True)
        # What adapter_config.json names as the base: the folder, or the (seeded) preset.
        model.lora_base = (
            str(Path(cfg.model_dir).resolve()) if cfg.model_dir else cfg.model or "debug"
        )
        if resume_from is not None:
            lora_io.load_adapter(model, resume_from)

    # --- the run's folder --------------------------------------------------------------
    if cfg.overwrite and out.exists():
        for _, path in ckpt.list_checkpoints(out):
            shutil.rmtree(path)
        if (out / lora_io.MERGED_DIR).is_dir():
            shutil.rmtree(out / lora_io.MERGED_DIR)
        for stale in ("metrics.jsonl", "summary.json"):
            (out / stale).unlink(missing_ok=True)
    out.mkdir(parents=True, exist_ok=True)
    save_yaml(cfg, out / "config.yaml")

    # The head shares the model's output projection; with --compile both are compiled in place.
    head = LossHead(model.output, head_kind(cfg.loss, cfg.compile))
    regions = None
    policy = parse_ac(cfg.ac, cfg.ac_every)
    if cfg.compile:
        opts = CompileOptions(
            backend=cfg.compile_backend,
            loss=cfg.loss,
            dump=cfg.dump_graphs is not None,
            ac=policy,
            offload=cfg.offload_activations,
        )
        regions = compile_regions(model, head, opts)
    elif policy.kind != "none":
        apply_eager_checkpointing(model, policy)

    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = Optimizer(
        [(n, p) for n, p in model.named_parameters() if p.requires_grad],
        kind=cfg.optimizer,
        lr=cfg.lr,
        betas=(0.9, 0.95),
        weight_decay=cfg.weight_decay,
        in_backward=cfg.optimizer_in_backward,
        bf16_compensation=cfg.bf16_compensation,
        device=device,
    )
    batches = Batches(data, cfg.batch_size, cfg.seed)
    start_step = 0
    if state is not None:
        optimizer.load_state_dict(state["optimizer"])
        batches.load_state_dict(state["data"])
        ckpt.set_rng_state(state["rng"])
        start_step = state["step"]

    n_params = num_params(args)
    print(
        f"model {cfg.model or cfg.model_dir or 'debug'}: {n_params / 1e6:.1f}M parameters, "
        f"{str(dtype).removeprefix('torch.')} on {device.type}; data {cfg.data}: "
        f"{data.inputs.shape[0]} rows of {cfg.seq_len} tokens; output {out}"
        + (f"; resuming from {resume_from.name}" if resume_from else ""),
        flush=True,
    )
    n_trainable = sum(p.numel() for p in params)
    if spec is not None:
        stored = cfg.quantize_base or str(base_dtype).removeprefix("torch.")
        print(
            f"LoRA rank {spec.rank} (alpha {spec.alpha:g}) on {','.join(spec.targets)}: "
            f"{n_trainable / 1e6:.2f}M trainable parameters ({n_trainable / n_params:.2%}), "
            f"frozen projections stored as {stored}",
            flush=True,
        )

    def train_state(step: int) -> dict[str, Any]:
        return {
            "step": step,
            "optimizer": optimizer.state_dict(),
            "data": batches.state_dict(),
            "rng": ckpt.rng_state(),
            "config": cfg.to_dict(),
        }

    metrics = MetricsLog(out / "metrics.jsonl", resume_step=start_step if state else None)
    stop = _Stop()
    previous = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}

    def request_stop(signum: int, frame: Any) -> None:
        if stop.requested:  # a second Ctrl-C means now
            raise KeyboardInterrupt
        stop.requested = True

    for s in previous:
        signal.signal(s, request_stop)

    interactive = sys.stderr.isatty()
    log_every = max(1, cfg.max_steps // 10)
    bar = tqdm(
        total=cfg.max_steps, initial=start_step, disable=not interactive, unit="step", ncols=100
    )
    first_loss = last_loss = float("nan")
    tokens_done, t_start = 0, time.perf_counter()
    last_saved: Path | None = resume_from
    merged: Path | None = None
    step = start_step
    try:
        model.train()
        while step < cfg.max_steps and not stop.requested:
            t0 = time.perf_counter()
            micro = [batches.next() for _ in range(cfg.grad_accum)]
            # The lr is a function of the step alone (so a resume needs no schedule state); it is
            # set before backward because --optimizer-in-backward steps during backward.
            lr = cfg.lr * lr_factor(step, cfg)
            optimizer.set_lr(lr)
            # The loss is normalised by the target tokens of the whole accumulated batch, so
            # accumulation gives the same gradient as one big batch.
            n_targets = sum(int((mb["targets"] != IGNORE_INDEX).sum()) for mb in micro)
            total = torch.zeros((), device=device, dtype=torch.float32)
            for mb in micro:
                mb = {k: v.to(device, non_blocking=True) for k, v in mb.items()}
                hidden = model.hidden_states(mb["inputs"])  # [b, s, d]
                loss = head(hidden, mb["targets"])  # fp32 [], summed over targets
                (loss / n_targets).backward()
                total += loss.detach()
            grad_norm = (
                torch.nn.utils.clip_grad_norm_(params, cfg.max_grad_norm)
                if cfg.max_grad_norm > 0
                else None
            )
            optimizer.step()  # a no-op with --optimizer-in-backward: already stepped
            optimizer.zero_grad()
            step += 1

            loss_value = total.item() / n_targets
            if not math.isfinite(loss_value):
                raise UserError(
                    f"the loss became {loss_value} at step {step}; lower --lr or use --dtype fp32"
                    + (f" (last good checkpoint: {last_saved})" if last_saved else "")
                )
            dt = time.perf_counter() - t0
            n_tokens = cfg.grad_accum * cfg.batch_size * cfg.seq_len
            tokens_done += n_tokens
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
            metrics.write(record)
            if step == start_step + 1:
                first_loss = loss_value
            last_loss = loss_value
            bar.update(1)
            bar.set_postfix(
                loss=f"{loss_value:.3f}",
                tok_s=f"{record['tokens_per_s']:.0f}",
                mem=f"{record['peak_mem_gib']:.2f}G",
            )
            if not interactive and (step % log_every == 0 or step == cfg.max_steps):
                print(
                    f"step {step}/{cfg.max_steps} loss {loss_value:.4f} lr {lr:.2e} "
                    f"{record['tokens_per_s']:.0f} tok/s mem {record['peak_mem_gib']:.2f} GiB",
                    flush=True,
                )
            if regions is not None and cfg.dump_graphs and step == start_step + 1:
                regions.write_dump(Path(cfg.dump_graphs))  # every region has compiled by now
            if cfg.save_every and step % cfg.save_every == 0 and step < cfg.max_steps:
                last_saved = ckpt.save_checkpoint(out, step, model, tokenizer, train_state(step))
        if step > start_step or resume_from is None:
            last_saved = ckpt.save_checkpoint(out, step, model, tokenizer, train_state(step))
        if cfg.merge and step >= cfg.max_steps:
            merged = lora_io.save_merged(model, out / lora_io.MERGED_DIR, tokenizer=tokenizer)
    finally:
        bar.close()
        metrics.close()
        for s, handler in previous.items():
            signal.signal(s, handler)

    elapsed = time.perf_counter() - t_start
    compile_stats = regions.stats() if regions is not None else None
    if regions is not None and cfg.dump_graphs:
        regions.write_dump(Path(cfg.dump_graphs))
    summary = {
        "steps": step,
        "interrupted": step < cfg.max_steps,
        "first_loss": first_loss,
        "final_loss": last_loss,
        "tokens": tokens_done,
        "seconds": elapsed,
        "tokens_per_s": tokens_done / elapsed if elapsed > 0 else 0.0,
        "peak_mem_gib": peak_memory_gib(device),
        "checkpoint": str(last_saved) if last_saved else None,
        "merged": str(merged) if merged else None,
        "trainable_params": n_trainable,
        "optimizer": cfg.optimizer + (" in-backward" if cfg.optimizer_in_backward else ""),
        "optimizer_state_bytes": optimizer.state_bytes(),
        "output_dir": str(out),
        "loss_kind": cfg.loss,
        "compile": compile_stats,
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(
        ("stopped early: " if summary["interrupted"] else "done: ")
        + f"{step} steps, loss {first_loss:.4f} -> {last_loss:.4f}, "
        f"{tokens_done} tokens in {elapsed:.1f}s ({summary['tokens_per_s']:.0f} tok/s), "
        f"peak mem {summary['peak_mem_gib']:.2f} GiB, "
        + (
            f"{compile_stats['compiles']} compiles ({compile_stats['recompiles']} recompiles, "
            f"{compile_stats['compile_seconds']:.1f}s), "
            if compile_stats
            else ""
        )
        + f"checkpoint {last_saved}"
        + (f", merged model {merged}" if merged else ""),
        flush=True,
    )
    return summary
