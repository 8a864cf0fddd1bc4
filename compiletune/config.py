"""The typed run configuration: defaults < `--config run.yaml` < command-line flags.

`TrainConfig` is the single source of truth for a run. The CLI builds it, the trainer reads it,
and the resolved copy is written to `OUTPUT_DIR/config.yaml` so a run can be repeated exactly.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import yaml

from compiletune.errors import UserError

DTYPES = ("fp32", "bf16", "bf16-mixed")
SCHEDULES = ("cosine", "linear", "constant")
COMPILE_BACKENDS = ("inductor", "aot_eager")
LOSSES = ("fused", "chunked", "plain")


@dataclass
class TrainConfig:
    # what to train
    model: str | None = None  # preset name; None -> "debug", or the architecture of --model-dir
    model_dir: str | None = None  # local HF folder to fine-tune
    n_layers: int | None = None  # override the preset's depth (random init; benches, debugging)
    data: str = "pydocs"  # pydocs | file.txt | file.jsonl
    tokenizer: str | None = None  # local HF tokenizer folder; default: the model dir, else bytes
    # None -> on when rows pack several examples: each attends only to itself (see trainer)
    doc_mask: bool | None = None
    # held-out evaluation
    eval_data: str | None = None  # a source like --data, evaluated on held-out loss/perplexity
    val_split: float = 0.0  # or: hold out this fraction of --data's examples (0 = none)
    eval_every: int = 0  # evaluate every N steps; 0 -> only at the end (with an eval source)
    # shape of a step
    seq_len: int = 256
    batch_size: int = 8
    grad_accum: int = 1
    max_steps: int = 100
    # optimisation
    lr: float | None = None  # None -> 1e-3 from random init, 2e-5 when fine-tuning --model-dir
    weight_decay: float = 0.0
    warmup_steps: int | None = None  # None -> 5% of max_steps
    schedule: str = "cosine"
    min_lr_ratio: float = 0.1
    max_grad_norm: float | None = None  # None -> 1.0 (0 with --optimizer-in-backward); 0 = off
    optimizer: str = "adamw"  # adamw | adamw8bit
    optimizer_in_backward: bool = False  # step each parameter in its grad hook, free its grad
    bf16_compensation: str = "none"  # none | kahan | stochastic (pure-bf16 parameter updates)
    dtype: str | None = None  # None -> bf16 on a GPU that supports it, else fp32; bf16-mixed:
    # fp32 master weights, bf16 compute, fp32 gradient reduction (FSDP's mixed precision)
    seed: int = 0
    # compiler
    compile: bool = False  # compile each block and the loss head through compiletune's backend
    compile_backend: str = "inductor"  # inductor | aot_eager (same passes, no code generation)
    dump_graphs: str | None = None  # folder for per-region, per-stage graphs and summary.json
    loss: str | None = None  # fused | chunked | plain; None -> fused with --compile or vocab >= 32k
    ac: str = "none"  # activation policy: none | full | selective | budget=F
    ac_every: int = 1  # apply --ac to every K-th block
    offload_activations: bool = False  # what each block saves goes to host memory (needs --compile)
    # distributed (FSDP2; launch with torchrun for several processes)
    fsdp: bool = False  # shard parameters, gradients and optimizer state across processes
    sharding: str = "full"  # full | grad-op | hybrid | none (FULL_SHARD, SHARD_GRAD_OP, ...)
    shard_size: int | None = None  # hybrid: processes per shard group; None -> per node
    cpu_offload: bool = False  # parameters, gradients and the optimizer step on the host
    # LoRA / QLoRA (models/lora.py, compiletune/lora.py)
    lora_rank: int = 0  # 0 -> full fine-tuning; R -> rank-R adapters, every other weight frozen
    lora_alpha: float | None = None  # None -> 2 * lora_rank; the update is scaled by alpha / rank
    lora_dropout: float = 0.0  # dropout on the adapters' input
    lora_targets: str = "all-linear"  # comma list of q,k,v,o,gate,up,down, or all-linear
    base_dtype: str | None = None  # storage of the frozen matrices; None -> --dtype
    quantize_base: str | None = None  # nf4: frozen projections in 4-bit NormalFloat (QLoRA)
    merge: bool = False  # at the end also write OUTPUT_DIR/merged, adapters folded in
    # output
    output_dir: str | None = None  # None -> runs/<model>-<time>
    save_every: int = 0  # 0 -> only at the end
    log: str | None = None  # extra metric loggers beside metrics.jsonl: tensorboard,wandb
    resume: bool = False
    overwrite: bool = False
    preflight: bool = True  # on a GPU, refuse a step the memory estimate says cannot fit

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


FIELD_NAMES = {f.name for f in fields(TrainConfig)}


def load_yaml(path: str) -> dict[str, Any]:
    """Read a YAML run file into a dict of TrainConfig fields (dashes or underscores accepted)."""
    p = Path(path)
    if not p.is_file():
        raise UserError(f"--config {path}: no such file; pass the path of a YAML run file")
    try:
        raw = yaml.safe_load(p.read_text()) or {}
    except yaml.YAMLError as e:
        raise UserError(f"--config {path}: not valid YAML ({e}); fix the file") from e
    if not isinstance(raw, dict):
        raise UserError(f"--config {path}: expected a mapping of option: value at the top level")
    out = {}
    for key, value in raw.items():
        name = str(key).replace("-", "_")
        if name not in FIELD_NAMES:
            known = ", ".join(sorted(FIELD_NAMES))
            raise UserError(f"--config {path}: unknown option '{key}'; known options: {known}")
        out[name] = value
    return out


def _check_types(cfg: TrainConfig, origin: str) -> None:
    """YAML values arrive untyped; make sure each has the field's type before anything runs."""
    expected = {
        "seq_len": int,
        "batch_size": int,
        "grad_accum": int,
        "max_steps": int,
        "save_every": int,
        "seed": int,
        "weight_decay": float,
        "min_lr_ratio": float,
        "optimizer_in_backward": bool,
        "resume": bool,
        "overwrite": bool,
        "compile": bool,
        "ac_every": int,
        "offload_activations": bool,
        "fsdp": bool,
        "cpu_offload": bool,
        "eval_every": int,
        "val_split": float,
        "preflight": bool,
        "lora_rank": int,
        "lora_dropout": float,
        "lora_targets": str,
        "merge": bool,
    }
    for name, typ in expected.items():
        value = getattr(cfg, name)
        if typ is float and isinstance(value, int) and not isinstance(value, bool):
            setattr(cfg, name, float(value))
            continue
        if not isinstance(value, typ) or (typ is int and isinstance(value, bool)):
            raise UserError(
                f"{origin}: {name} must be {typ.__name__}, got {value!r}; fix the value"
            )


def resolve(yaml_values: dict[str, Any], flag_values: dict[str, Any]) -> TrainConfig:
    """Merge defaults, the YAML file and explicit flags, then check every value."""
    cfg = TrainConfig(**{**yaml_values, **flag_values})
    _check_types(cfg, "config")
    positive = ("seq_len", "batch_size", "grad_accum", "max_steps")
    for name in positive:
        if getattr(cfg, name) < 1:
            flag = "--" + name.replace("_", "-")
            raise UserError(f"{flag} must be at least 1, got {getattr(cfg, name)}")
    if cfg.save_every < 0:
        raise UserError(
            f"--save-every must be 0 (only at the end) or positive, got {cfg.save_every}"
        )
    if cfg.lr is not None and not cfg.lr > 0:
        raise UserError(f"--lr must be positive, got {cfg.lr}")
    if cfg.warmup_steps is not None and cfg.warmup_steps < 0:
        raise UserError(f"--warmup-steps must be >= 0, got {cfg.warmup_steps}")
    if cfg.dtype is not None and cfg.dtype not in DTYPES:
        raise UserError(f"--dtype must be one of {', '.join(DTYPES)}, got {cfg.dtype!r}")
    if cfg.schedule not in SCHEDULES:
        raise UserError(f"--schedule must be one of {', '.join(SCHEDULES)}, got {cfg.schedule!r}")
    if not 0.0 <= cfg.min_lr_ratio <= 1.0:
        raise UserError(f"--min-lr-ratio must be within [0, 1], got {cfg.min_lr_ratio}")
    if cfg.max_grad_norm is None:
        # In-backward never holds all gradients at once, so there is no global norm to clip.
        cfg.max_grad_norm = 0.0 if cfg.optimizer_in_backward else 1.0
    if not isinstance(cfg.max_grad_norm, (int, float)) or cfg.max_grad_norm < 0:
        raise UserError(f"--max-grad-norm must be >= 0 (0 disables), got {cfg.max_grad_norm}")
    cfg.max_grad_norm = float(cfg.max_grad_norm)
    from compiletune.optim import check_optimizer_flags

    check_optimizer_flags(
        cfg.optimizer,
        cfg.optimizer_in_backward,
        cfg.grad_accum,
        cfg.max_grad_norm,
        cfg.bf16_compensation,
    )
    if cfg.bf16_compensation != "none" and cfg.dtype != "bf16":
        raise UserError(
            f"--bf16-compensation {cfg.bf16_compensation} corrects bf16 parameter updates; "
            "add --dtype bf16 or drop it"
        )
    if cfg.compile_backend not in COMPILE_BACKENDS:
        raise UserError(
            f"--compile-backend must be one of {', '.join(COMPILE_BACKENDS)}, got {cfg.compile_backend!r}"
        )
    if cfg.loss is not None and cfg.loss not in LOSSES:
        raise UserError(f"--loss must be one of {', '.join(LOSSES)}, got {cfg.loss!r}")
    if cfg.n_layers is not None and (cfg.model_dir is not None or cfg.n_layers < 1):
        raise UserError(
            "--n-layers (a positive depth) only applies to a random-init --model preset"
        )
    from compiletune.activation import parse_ac

    policy = parse_ac(cfg.ac, cfg.ac_every)
    if policy.kind == "budget" and not cfg.compile:
        raise UserError(f"--ac {cfg.ac} is a setting of the compiler's partitioner; add --compile")
    if cfg.offload_activations and not cfg.compile:
        raise UserError("--offload-activations is a pass of the compile pipeline; add --compile")
    if cfg.dump_graphs is not None and not cfg.compile:
        raise UserError("--dump-graphs shows what the compiler did; it needs --compile")
    from compiletune.distributed import SHARDINGS, launched_world_size

    if cfg.sharding not in SHARDINGS:
        raise UserError(f"--sharding must be one of {', '.join(SHARDINGS)}, got {cfg.sharding!r}")
    world = launched_world_size()
    if world > 1 and not cfg.fsdp:
        raise UserError(
            f"{world} processes were launched but --fsdp is off; add --fsdp (every process "
            "would otherwise train its own copy)"
        )
    if not cfg.fsdp:
        for name, default in (("sharding", "full"), ("shard_size", None), ("cpu_offload", False)):
            if getattr(cfg, name) != default:
                flag = "--" + name.replace("_", "-")
                raise UserError(f"{flag} is a setting of FSDP; add --fsdp or drop {flag}")
        if cfg.dtype == "bf16-mixed":
            raise UserError(
                "--dtype bf16-mixed is FSDP's mixed precision; add --fsdp, or pass --dtype bf16"
            )
    if cfg.shard_size is not None and (cfg.sharding != "hybrid" or cfg.shard_size < 1):
        raise UserError("--shard-size (a positive process count) only applies to --sharding hybrid")
    if cfg.doc_mask is not None and not isinstance(cfg.doc_mask, bool):
        raise UserError(f"config: doc_mask must be true or false, got {cfg.doc_mask!r}")
    if cfg.eval_every < 0:
        raise UserError(
            f"--eval-every must be 0 (only at the end) or positive, got {cfg.eval_every}"
        )
    if not 0.0 <= cfg.val_split < 1.0:
        raise UserError(f"--val-split must be a fraction in [0, 1), got {cfg.val_split}")
    if cfg.val_split > 0 and cfg.eval_data is not None:
        raise UserError("--val-split and --eval-data both name the held-out data; pass one of them")
    if cfg.eval_every > 0 and cfg.eval_data is None and cfg.val_split == 0:
        raise UserError("--eval-every needs held-out data: add --eval-data SOURCE or --val-split F")
    from compiletune.loggers import parse_loggers

    parse_loggers(cfg.log)
    _check_lora(cfg)
    if cfg.lora_rank and cfg.dtype == "bf16-mixed":
        # FSDP's mixed precision would cast the NF4 codes too; LoRA has its own storage dtypes.
        raise UserError(
            "--dtype bf16-mixed does not apply to LoRA runs (the frozen base has its own "
            "storage); pass --dtype bf16, or --dtype fp32 with --base-dtype bf16"
        )
    if cfg.resume and cfg.overwrite:
        raise UserError("--resume and --overwrite contradict each other; pass one of them")
    if cfg.resume and cfg.output_dir is None:
        raise UserError("--resume needs the --output-dir of the run to continue")
    # Defaults that depend on other choices are fixed here, once, so config.yaml shows them.
    if cfg.lr is None:
        # Adapters start at zero and are few: LoRA wants a ~10x larger lr than full fine-tuning.
        cfg.lr = (2e-4 if cfg.lora_rank else 2e-5) if cfg.model_dir else 1e-3
    if cfg.warmup_steps is None:
        cfg.warmup_steps = max(1, round(0.05 * cfg.max_steps)) if cfg.max_steps > 1 else 0
    if cfg.output_dir is None:
        name = cfg.model or (Path(cfg.model_dir).name if cfg.model_dir else "debug")
        cfg.output_dir = str(Path("runs") / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}")
    return cfg


def _check_lora(cfg: TrainConfig) -> None:
    """LoRA flags: values in range, and none of them without --lora-rank."""
    from compiletune.models.lora import QUANTIZE, parse_targets

    if cfg.lora_rank < 0:
        raise UserError(f"--lora-rank must be positive (0 = full fine-tuning), got {cfg.lora_rank}")
    if not cfg.lora_rank:
        given = [
            flag
            for flag, value, default in (
                ("--lora-alpha", cfg.lora_alpha, None),
                ("--lora-dropout", cfg.lora_dropout, 0.0),
                ("--lora-targets", cfg.lora_targets, "all-linear"),
                ("--base-dtype", cfg.base_dtype, None),
                ("--quantize-base", cfg.quantize_base, None),
                ("--merge", cfg.merge, False),
            )
            if value != default
        ]
        if given:
            raise UserError(
                f"{given[0]} applies to LoRA runs; add --lora-rank R (e.g. 16) or drop {given[0]}"
            )
        return
    if cfg.lora_alpha is None:
        cfg.lora_alpha = 2.0 * cfg.lora_rank
    if isinstance(cfg.lora_alpha, bool) or not isinstance(cfg.lora_alpha, (int, float)):
        raise UserError(f"--lora-alpha must be a number, got {cfg.lora_alpha!r}")
    cfg.lora_alpha = float(cfg.lora_alpha)
    if not cfg.lora_alpha > 0:
        raise UserError(f"--lora-alpha must be positive, got {cfg.lora_alpha}")
    if not 0.0 <= cfg.lora_dropout < 1.0:
        raise UserError(f"--lora-dropout must be in [0, 1), got {cfg.lora_dropout}")
    try:
        parse_targets(cfg.lora_targets)
    except ValueError as e:
        raise UserError(f"--lora-targets {cfg.lora_targets}: {e}") from e
    if cfg.base_dtype is not None and cfg.base_dtype not in DTYPES:
        raise UserError(f"--base-dtype must be one of {', '.join(DTYPES)}, got {cfg.base_dtype!r}")
    if cfg.quantize_base is not None and cfg.quantize_base not in QUANTIZE:
        raise UserError(
            f"--quantize-base must be one of {', '.join(QUANTIZE)}, got {cfg.quantize_base!r}"
        )


def save_yaml(cfg: TrainConfig, path: Path) -> None:
    path.write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
