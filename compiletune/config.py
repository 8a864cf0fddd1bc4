"""The typed run configuration: defaults < `--config run.yaml` < command-line flags.

`TrainConfig` is the single source of truth for a run: sections (model, data, optim, techniques,
parallel, lora, run), each a dataclass whose fields carry their own help text, and whose choice
sets are the `Literal`s of `choices.py`. From these declarations come, with nothing written twice:

- the command-line flags (`add_flags`: name, type, choices, help with the real default),
- the YAML keys (the flag without its dashes; `seq-len` and `seq_len` both accepted),
- the type checks of YAML values, and `config.yaml`, the flat resolved copy a run writes.

`resolve` merges and checks the values; `fill_defaults` is the one function that decides every
default that depends on other choices (some of them on facts known only once the model's
config and the data are read, which the build passes in as `RunFacts`).
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import math
import time
import types
import typing
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

import yaml

from compiletune import recipes
from compiletune.choices import (
    BaseDtype,
    Bf16Compensation,
    CompileBackend,
    DataFormat,
    Dtype,
    KdLoss,
    Loss,
    Objective,
    OptimizerKind,
    Packing,
    Quantize,
    Schedule,
    Sharding,
    Truncation,
)
from compiletune.errors import UserError

# Defaults that depend on other choices: `fill_defaults` applies these, and --help shows them
# from the same values.
LR_RANDOM_INIT, LR_FINE_TUNE, LR_LORA = 1e-3, 2e-5, 2e-4
WARMUP_FRACTION = 0.05  # of the run's steps
DEFAULT_MAX_STEPS = 100
MAX_GRAD_NORM = 1.0  # 0 (off) with --optimizer-in-backward
LORA_ALPHA_PER_RANK = 2.0


def _sci(x: float) -> str:
    return f"{x:.0e}".replace("e-0", "e-")


def opt(
    default: Any,
    help: str,
    *,
    key: str | None = None,
    shows: str | None = None,
    estimate: bool = True,
    negate: bool = False,
    metavar: str | None = None,
    on_resume: str = "same",
) -> Any:
    """A config field. `key`: its YAML key and flag name when they differ from the attribute;
    `shows`: the default as `--help` states it (for defaults decided by `fill_defaults`);
    `estimate`: the flag changes a memory estimate (so `estimate-memory` takes it);
    `negate`: a True-by-default switch offered as `--no-<key>`;
    `on_resume`: "same" if changing it on `--resume` changes the result (refused unless
    --accept-changes), "fixed" if the checkpoint itself holds it (the model, the adapters, the
    optimizer's state: never changed on resume), "free" if it changes only logging, saving or
    how the same numbers are computed (the compile and memory techniques, equal by the
    numerics contract), "length" for the run's length (judged by `run_dir.judge_resume`)."""
    meta = {"help": help, "key": key, "shows": shows, "estimate": estimate, "negate": negate}
    return field(default=default, metadata={**meta, "metavar": metavar, "on_resume": on_resume})


@dataclass
class ModelConfig:
    """What model is trained, and how it is stored."""

    TITLE = "model"
    preset: str | None = opt(
        None,
        "preset name (see `compiletune models`)",
        key="model",
        shows="debug, or the architecture of --model-dir",
        on_resume="fixed",
    )
    model_dir: str | None = opt(
        None, "local HF model folder to fine-tune", metavar="DIR", on_resume="fixed"
    )
    n_layers: int | None = opt(
        None,
        "override the preset's depth (random init; benches, debugging)",
        shows="preset's",
        on_resume="fixed",
    )
    tokenizer: str | None = opt(
        None,
        "local HF tokenizer folder",
        shows="--model-dir, else a byte tokenizer",
        estimate=False,
        metavar="DIR",
        on_resume="fixed",
    )
    dtype: Dtype | None = opt(
        None,
        "parameter dtype; bf16-mixed: fp32 master weights, bf16 compute (with --fsdp)",
        shows="bf16 on a GPU that supports it, else fp32",
    )

    def check(self, cfg: TrainConfig) -> None:
        if self.n_layers is not None and (self.model_dir is not None or self.n_layers < 1):
            raise UserError(
                "--n-layers (a positive depth) only applies to a random-init --model preset"
            )
        if self.dtype == "bf16-mixed" and not cfg.parallel.fsdp:
            raise UserError(
                "--dtype bf16-mixed is FSDP's mixed precision; add --fsdp, or pass --dtype bf16"
            )


@dataclass
class DataConfig:
    """What the model reads: training data, held-out data, and the shape of a step."""

    TITLE = "data and step shape"
    source: str = opt(
        "pydocs",
        "pydocs (embedded default) | a file (.jsonl .json .parquet .arrow .csv .txt) | a folder "
        "or glob of shards | a save_to_disk folder | a dataset in the local HF cache | a "
        "mixture SRC:W,SRC:W",
        key="data",
        estimate=False,
        metavar="SOURCE",
    )
    data_format: DataFormat = opt(
        "auto",
        "the rows' layout (auto: detected from the columns)",
        estimate=False,
    )
    data_columns: str | None = opt(
        None,
        "map the layout's fields to other column names, e.g. prompt=question,completion=answer",
        estimate=False,
        metavar="FIELD=COL,...",
    )
    data_roles: str | None = opt(
        None,
        "map chat roles the tokenizer's template does not know, e.g. human=user,bot=assistant",
        estimate=False,
        metavar="FROM=TO,...",
    )
    data_split: str | None = opt(
        None,
        "the split of a DatasetDict or HF-cache dataset",
        shows="train",
        estimate=False,
        metavar="NAME",
    )
    cache_dir: str | None = opt(
        None,
        "where tokenised data is cached",
        shows="$XDG_CACHE_HOME/compiletune/data (~/.cache/...)",
        estimate=False,
        on_resume="free",
        metavar="DIR",
    )
    data_workers: int | None = opt(
        None,
        "processes that tokenise (0: in this process)",
        shows="the CPU count, at most 8",
        estimate=False,
        on_resume="free",
    )
    doc_mask: bool | None = opt(
        None,
        "packed examples attend only to themselves",
        shows="on when rows pack several examples",
        estimate=False,
    )
    eval_data: str | None = opt(
        None,
        "held-out SOURCE (like --data)",
        estimate=False,
        metavar="SOURCE",
        on_resume="free",
    )
    val_split: float = opt(0.0, "hold out this fraction of --data (0 = none)", estimate=False)
    eval_every: int = opt(
        0, "evaluate every N steps (0 = at the end)", estimate=False, on_resume="free"
    )
    packing: Packing | None = opt(
        None,
        "how examples fill rows: whole (each example whole in one row, best-fit packed, padded) "
        "or stream (one token stream cut into rows: pre-training corpora)",
        shows="whole; stream for the embedded pydocs corpus",
    )
    truncation: Truncation = opt(
        "right",
        "an example longer than --seq-len keeps its start (right: the prompt) or its end (left)",
    )
    seq_len: int = opt(256, "tokens per row")
    batch_size: int = opt(8, "rows per micro-batch (per process)")
    grad_accum: int = opt(1, "micro-batches per optimizer step")

    def check(self, cfg: TrainConfig) -> None:
        for name in ("seq_len", "batch_size", "grad_accum"):
            _at_least_one(name, getattr(self, name))
        if self.data_workers is not None and self.data_workers < 0:
            raise UserError(f"--data-workers must be >= 0, got {self.data_workers}")
        if self.data_columns is not None:
            from compiletune.data.sources import (
                parse_columns,  # lazy: the CLI imports config before torch
            )

            parse_columns(self.data_columns)  # a malformed mapping fails before the model loads
        if self.data_roles is not None:
            from compiletune.data.sources import (
                parse_roles,  # lazy: the CLI imports config before torch
            )

            parse_roles(self.data_roles)
        if not recipes.is_placeholder(self.source):  # a recipe's <...> is refused by train
            from compiletune.data.rows import (
                parse_sources,  # lazy: the CLI imports config before torch
            )

            parse_sources(self.source)  # a malformed mixture fails before the model loads
        if self.eval_every < 0:
            raise UserError(
                f"--eval-every must be 0 (only at the end) or positive, got {self.eval_every}"
            )
        if not 0.0 <= self.val_split < 1.0:
            raise UserError(f"--val-split must be a fraction in [0, 1), got {self.val_split}")
        if self.val_split > 0 and self.eval_data is not None:
            raise UserError(
                "--val-split and --eval-data both name the held-out data; pass one of them"
            )
        if self.eval_every > 0 and self.eval_data is None and self.val_split == 0:
            raise UserError(
                "--eval-every needs held-out data: add --eval-data SOURCE or --val-split F"
            )


@dataclass
class OptimConfig:
    """The optimizer, its state, and the learning-rate schedule."""

    TITLE = "optimisation"
    optimizer: OptimizerKind = opt("adamw", "AdamW, or AdamW with 8-bit moments", on_resume="fixed")
    optimizer_in_backward: bool = opt(
        False, "step each parameter during backward and free its gradient at once"
    )
    bf16_compensation: Bf16Compensation | None = opt(
        None,
        "keep small bf16 updates from vanishing (with bf16 parameters)",
        shows="stochastic with bf16 parameters (the GPU default), else none",
    )
    lr: float | None = opt(
        None,
        "peak learning rate",
        shows=f"{_sci(LR_RANDOM_INIT)} from random init; {_sci(LR_FINE_TUNE)} fine-tuning "
        f"--model-dir, {_sci(LR_LORA)} with LoRA",
        estimate=False,
    )
    weight_decay: float = opt(0.0, "AdamW weight decay", estimate=False)
    warmup_steps: int | None = opt(
        None, "linear warmup steps", shows=f"{WARMUP_FRACTION:.0%} of the steps", estimate=False
    )
    schedule: Schedule = opt("cosine", "decay after warmup", estimate=False)
    min_lr_ratio: float = opt(0.1, "final lr / peak lr", estimate=False)
    max_grad_norm: float | None = opt(
        None,
        "clip gradients to this global norm (0 = off)",
        shows=f"{MAX_GRAD_NORM}; 0 with --optimizer-in-backward",
    )
    router_aux_coef: float | None = opt(
        None,
        "weight of the MoE load-balancing loss (0 = off)",
        shows="the model's router_aux_loss_coef; 0 for dense models",
        estimate=False,
    )
    router_z_coef: float = opt(0.0, "weight of the MoE router z-loss", estimate=False)

    def check(self, cfg: TrainConfig) -> None:

        if self.lr is not None and not self.lr > 0:
            raise UserError(f"--lr must be positive, got {self.lr}")
        if self.warmup_steps is not None and self.warmup_steps < 0:
            raise UserError(f"--warmup-steps must be >= 0, got {self.warmup_steps}")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise UserError(f"--min-lr-ratio must be within [0, 1], got {self.min_lr_ratio}")
        if self.max_grad_norm is not None and self.max_grad_norm < 0:
            raise UserError(f"--max-grad-norm must be >= 0 (0 disables), got {self.max_grad_norm}")
        for flag, value in (("aux", self.router_aux_coef), ("z", self.router_z_coef)):
            if value is not None and value < 0:
                raise UserError(f"--router-{flag}-coef must be >= 0 (0 = off), got {value}")
        from compiletune.optim import (
            check_optimizer_flags,  # lazy: the CLI imports config before torch
        )

        check_optimizer_flags(
            self.optimizer,
            self.optimizer_in_backward,
            cfg.data.grad_accum,
            self.max_grad_norm or 0.0,
            self.bf16_compensation or "none",
        )
        # dtype None (decided by the device) is checked again once the build knows it
        if self.bf16_compensation not in (None, "none") and cfg.model.dtype not in (None, "bf16"):
            raise UserError(
                f"--bf16-compensation {self.bf16_compensation} corrects bf16 parameter updates; "
                "add --dtype bf16 or drop it"
            )


@dataclass
class TechniquesConfig:
    """The compiler and the memory techniques it applies."""

    TITLE = "compiler and activation memory"
    compile: bool = opt(
        False,
        "compile each block and the loss head through compiletune's backend",
        on_resume="free",
    )
    compile_backend: CompileBackend = opt(
        "inductor",
        "aot_eager: the same passes, no code generation (debugging)",
        on_resume="free",
    )
    dump_graphs: str | None = opt(
        None,
        "write each region's graphs per stage and a summary.json here",
        estimate=False,
        metavar="DIR",
        on_resume="free",
    )
    loss: Loss | None = opt(
        None,
        "the loss head: fused (no full logits), chunked, or plain",
        shows="fused with --compile or a vocabulary of 32k+, else plain",
        on_resume="free",
    )
    ac: str = opt("none", "activation policy: none | full | selective | budget=F", on_resume="free")
    ac_every: int = opt(1, "apply --ac to every K-th block", on_resume="free")
    offload_activations: bool = opt(
        False,
        "what each block saves for backward goes to host memory (needs --compile)",
        on_resume="free",
    )

    def check(self, cfg: TrainConfig) -> None:

        from compiletune.compiler.activation import (
            parse_ac,  # lazy: the CLI imports config before torch
        )

        policy = parse_ac(self.ac, self.ac_every)
        if policy.kind == "budget" and not self.compile:
            raise UserError(
                f"--ac {self.ac} is a setting of the compiler's partitioner; add --compile"
            )
        if self.offload_activations and not self.compile:
            raise UserError(
                "--offload-activations is a pass of the compile pipeline; add --compile"
            )
        if self.dump_graphs is not None and not self.compile:
            raise UserError("--dump-graphs shows what the compiler did; it needs --compile")


@dataclass
class ParallelConfig:
    """FSDP2 across processes (launch with torchrun for several)."""

    TITLE = "distributed (launch with torchrun for several processes)"
    fsdp: bool = opt(
        False, "shard parameters, gradients and optimizer state with FSDP2", on_resume="free"
    )
    sharding: Sharding = opt(
        "full",
        "what FSDP shards: FULL_SHARD, SHARD_GRAD_OP, HYBRID_SHARD or NO_SHARD",
        on_resume="free",
    )
    shard_size: int | None = opt(
        None, "hybrid: processes per shard group", shows="per node", on_resume="free"
    )
    cpu_offload: bool = opt(
        False, "parameters, gradients and the optimizer step on the host", on_resume="free"
    )

    def check(self, cfg: TrainConfig) -> None:

        from compiletune.distributed import (
            launched_world_size,  # lazy: the CLI imports config before torch
        )

        world = launched_world_size()
        if world > 1 and not self.fsdp:
            raise UserError(
                f"{world} processes were launched but --fsdp is off; add --fsdp (every process "
                "would otherwise train its own copy)"
            )
        if not self.fsdp:
            for name, default in (
                ("sharding", "full"),
                ("shard_size", None),
                ("cpu_offload", False),
            ):
                if getattr(self, name) != default:
                    flag = "--" + name.replace("_", "-")
                    raise UserError(f"{flag} is a setting of FSDP; add --fsdp or drop {flag}")
        if self.shard_size is not None and (self.sharding != "hybrid" or self.shard_size < 1):
            raise UserError(
                "--shard-size (a positive process count) only applies to --sharding hybrid"
            )


@dataclass
class LoRAConfig:
    """LoRA / QLoRA adapters (`models/lora.py`; adapter files in `checkpoint/adapter_io.py`)."""

    TITLE = "LoRA / QLoRA"
    rank: int = opt(
        0,
        "train rank-R adapters, freeze every other weight (0 = off)",
        key="lora_rank",
        on_resume="fixed",
    )
    alpha: float | None = opt(
        None,
        "adapter scale: the update is scaled by alpha / R",
        key="lora_alpha",
        shows=f"{LORA_ALPHA_PER_RANK:g}R",
        on_resume="fixed",
    )
    dropout: float = opt(0.0, "dropout on the adapters' input", key="lora_dropout", estimate=False)
    targets: str = opt(
        "all-linear",
        "q,k,v,o,gate,up,down (any of them) or all-linear",
        key="lora_targets",
        on_resume="fixed",
    )
    base_dtype: BaseDtype | None = opt(None, "the frozen weights' storage dtype", shows="--dtype")
    quantize_base: Quantize | None = opt(
        None, "store the frozen projections in NF4 (QLoRA)", on_resume="fixed"
    )
    merge: bool = opt(
        False,
        "also write OUTPUT_DIR/merged at the end, adapters folded in",
        estimate=False,
        on_resume="free",
    )

    def check(self, cfg: TrainConfig) -> None:

        if self.rank < 0:
            raise UserError(f"--lora-rank must be positive (0 = full fine-tuning), got {self.rank}")
        if not self.rank:
            for f in fields(self):
                if f.name != "rank" and getattr(self, f.name) != f.default:
                    flag = _flag(f)
                    raise UserError(
                        f"{flag} applies to LoRA runs; add --lora-rank R (e.g. 16) or drop {flag}"
                    )
            return
        if self.alpha is not None and not self.alpha > 0:
            raise UserError(f"--lora-alpha must be positive, got {self.alpha}")
        if not 0.0 <= self.dropout < 1.0:
            raise UserError(f"--lora-dropout must be in [0, 1), got {self.dropout}")
        try:
            from compiletune.models.lora import (
                parse_targets,  # lazy: the CLI imports config before torch
            )

            parse_targets(self.targets)
        except ValueError as e:
            raise UserError(f"--lora-targets {self.targets}: {e}") from e
        if cfg.model.dtype == "bf16-mixed":
            # FSDP's mixed precision would cast the NF4 codes too; LoRA has its own storage.
            raise UserError(
                "--dtype bf16-mixed does not apply to LoRA runs (the frozen base has its own "
                "storage); pass --dtype bf16, or --dtype fp32 with --base-dtype bf16"
            )


@dataclass
class RunConfig:
    """How long the run is, and what it writes."""

    TITLE = "run length and output"
    max_steps: int | None = opt(
        None, "optimizer steps", shows=str(DEFAULT_MAX_STEPS), estimate=False, on_resume="length"
    )
    epochs: int | None = opt(
        None,
        "train this many passes over --data instead of --max-steps",
        estimate=False,
        on_resume="length",
    )
    seed: int = opt(0, "initialisation and data order", estimate=False)
    output_dir: str | None = opt(
        None,
        "run folder",
        shows="runs/<model>-<time>",
        estimate=False,
        metavar="DIR",
        on_resume="free",
    )
    save_every: int = opt(
        0, "checkpoint every N steps (0 = at the end only)", estimate=False, on_resume="free"
    )
    save: bool = opt(
        True,
        "write no checkpoint at all, not even at the end (benchmarks; the run is not resumable)",
        estimate=False,
        negate=True,
        on_resume="free",
    )
    log: str | None = opt(
        None, "also log to: tensorboard, wandb (comma-separated)", estimate=False, on_resume="free"
    )
    resume: bool = opt(
        False,
        "continue from the latest checkpoint in --output-dir",
        estimate=False,
        on_resume="free",
    )
    overwrite: bool = opt(
        False, "replace an existing run in --output-dir", estimate=False, on_resume="free"
    )
    preflight: bool = opt(
        True,
        "skip the memory estimate that refuses a step that cannot fit the GPU",
        estimate=False,
        negate=True,
        on_resume="free",
    )
    accept_changes: bool = opt(
        False,
        "--resume: accept flags that change the result (the refusal lists them)",
        estimate=False,
        on_resume="free",
    )
    skip_nonfinite: int = opt(
        0,
        "skip up to N steps whose loss or gradient norm is not finite (0: stop at the first)",
        estimate=False,
        on_resume="free",
    )

    def check(self, cfg: TrainConfig) -> None:
        if self.max_steps is not None and self.epochs is not None:
            raise UserError("--max-steps and --epochs both set the run's length; pass one of them")
        if self.max_steps is not None:
            _at_least_one("max_steps", self.max_steps)
        if self.epochs is not None:
            _at_least_one("epochs", self.epochs)
        if self.save_every < 0:
            raise UserError(
                f"--save-every must be 0 (only at the end) or positive, got {self.save_every}"
            )

        from compiletune.loggers import parse_loggers  # lazy: the CLI imports config before torch

        parse_loggers(self.log)
        if self.resume and self.overwrite:
            raise UserError("--resume and --overwrite contradict each other; pass one of them")
        if self.resume and self.output_dir is None:
            raise UserError("--resume needs the --output-dir of the run to continue")
        if self.accept_changes and not self.resume:
            raise UserError("--accept-changes applies to --resume; drop it or add --resume")
        if self.skip_nonfinite < 0:
            raise UserError(f"--skip-nonfinite must be >= 0, got {self.skip_nonfinite}")
        if self.skip_nonfinite and cfg.optim.optimizer_in_backward:
            raise UserError(
                "--skip-nonfinite cannot undo a step of --optimizer-in-backward (each parameter "
                "is updated during backward, before the loss is known); drop one of them"
            )


@dataclass
class ObjectiveConfig:
    """What the run optimises: next-token cross-entropy, a preference objective on pairs, or
    distillation from a teacher (docs/objectives.md)."""

    TITLE = "objective"
    objective: Objective = opt(
        "sft",
        "sft: next-token loss; dpo/ipo/simpo: preference pairs; kd: distil --teacher-dir",
        estimate=True,
        on_resume="fixed",
    )
    beta: float = opt(0.1, "dpo/ipo/simpo: the preference strength beta", estimate=False)
    label_smoothing: float = opt(0.0, "dpo: conservative DPO's label smoothing eps", estimate=False)
    simpo_gamma: float = opt(0.5, "simpo: the target reward margin gamma", estimate=False)
    precompute_ref: bool = opt(
        False,
        "dpo/ipo: score every pair under the reference once, before training (then freed)",
        estimate=True,
    )
    teacher_dir: str | None = opt(
        None,
        "kd: the teacher's HF folder (same vocabulary)",
        estimate=True,
        metavar="DIR",
        on_resume="fixed",
    )
    kd_ratio: float = opt(0.5, "kd: weight of the divergence (the rest: CE)", estimate=False)
    kd_temperature: float = opt(1.0, "kd: softmax temperature of both models", estimate=False)
    kd_loss: KdLoss = opt("forward_kl", "kd: forward KL or Jensen-Shannon", estimate=False)

    def check(self, cfg: TrainConfig) -> None:
        kd = self.objective == "kd"
        if kd != (self.teacher_dir is not None):
            raise UserError(
                "--objective kd needs --teacher-dir DIR"
                if kd
                else "--teacher-dir applies to --objective kd; add it or drop --teacher-dir"
            )
        if not self.beta > 0:
            raise UserError(f"--beta must be positive, got {self.beta}")
        if not 0.0 <= self.label_smoothing < 0.5:
            raise UserError(f"--label-smoothing must be in [0, 0.5), got {self.label_smoothing}")
        if not 0.0 <= self.kd_ratio <= 1.0:
            raise UserError(f"--kd-ratio must be in [0, 1], got {self.kd_ratio}")
        if not self.kd_temperature > 0:
            raise UserError(f"--kd-temperature must be positive, got {self.kd_temperature}")
        if self.precompute_ref and self.objective not in ("dpo", "ipo"):
            raise UserError("--precompute-ref applies to --objective dpo or ipo (a reference)")
        if self.objective in ("dpo", "ipo", "simpo") and "," in (cfg.data.source or ""):
            raise UserError(f"--objective {self.objective} reads one --data source of pairs")


_SECTIONS: dict[str, type] = {
    "model": ModelConfig,
    "data": DataConfig,
    "optim": OptimConfig,
    "techniques": TechniquesConfig,
    "parallel": ParallelConfig,
    "lora": LoRAConfig,
    "run": RunConfig,
    "objective": ObjectiveConfig,
}


@dataclass
class TrainConfig:
    """A whole run: `cfg.data.seq_len`, `cfg.lora.rank`, ... (see the sections above)."""

    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    techniques: TechniquesConfig = field(default_factory=TechniquesConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    run: RunConfig = field(default_factory=RunConfig)
    objective: ObjectiveConfig = field(default_factory=ObjectiveConfig)

    @classmethod
    def from_flat(cls, values: dict[str, Any]) -> TrainConfig:
        """From `{key: value}` (YAML keys / flag names with underscores); unknown keys raise
        KeyError (`load_yaml` names them for the user first)."""
        per_section: dict[str, dict[str, Any]] = {name: {} for name in _SECTIONS}
        for key, value in values.items():
            section, attr = _BY_KEY[key]
            per_section[section][attr] = value
        return cls(**{name: _SECTIONS[name](**v) for name, v in per_section.items()})

    def to_dict(self) -> dict[str, Any]:
        """Flat `{key: value}`, the form of YAML files and `config.yaml`."""
        return {
            _key(f): getattr(getattr(self, section), f.name)
            for section, cls in _SECTIONS.items()
            for f in fields(cls)
        }

    def get(self, key: str) -> Any:
        """The value of a flat key (`cfg.get("seq_len")`)."""
        section, attr = _BY_KEY[key]
        return getattr(getattr(self, section), attr)

    def replace(self, **changes: Any) -> TrainConfig:
        """A copy with some flat keys changed (`cfg.replace(ac="full")`)."""
        return TrainConfig.from_flat({**self.to_dict(), **changes})

    @property
    def name(self) -> str:
        """What the run trains, as banners and summaries name it."""
        return self.model.preset or self.model.model_dir or "debug"


def _key(f: dataclasses.Field) -> str:
    return f.metadata.get("key") or f.name


def _flag(f: dataclasses.Field) -> str:
    return "--" + _key(f).replace("_", "-")


_BY_KEY = {_key(f): (section, f.name) for section, cls in _SECTIONS.items() for f in fields(cls)}
FIELD_NAMES = set(_BY_KEY)


def flag_text(key: str, value: Any) -> str:
    """The command-line form of `key = value` ("--ac full", "--fsdp"; "" for an unset or false
    switch), with the flag name the config derives for that key."""
    section, attr = _BY_KEY[key]
    flag = _flag(next(f for f in fields(_SECTIONS[section]) if f.name == attr))
    if value is True:
        return flag
    if value is False or value is None:
        return ""
    return f"{flag} {value}"


def _at_least_one(key: str, value: int) -> None:
    if value < 1:
        raise UserError(f"--{key.replace('_', '-')} must be at least 1, got {value}")


# ----------------------------------------------------------------------------- types


def _unwrap(hint: Any) -> tuple[Any, bool]:
    """(the type without `None`, whether None is allowed)."""
    if get_origin(hint) in (typing.Union, types.UnionType):
        args = [a for a in get_args(hint) if a is not type(None)]
        return args[0], len(args) < len(get_args(hint))
    return hint, False


def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _check_types(cfg: TrainConfig) -> None:
    """YAML values arrive untyped; make sure each has its field's type before anything runs."""
    for section, cls in _SECTIONS.items():
        sec = getattr(cfg, section)
        hints = _hints(cls)
        for f in fields(cls):
            typ, nullable = _unwrap(hints[f.name])
            value = getattr(sec, f.name)
            if value is None and nullable:
                continue
            key = _key(f)
            if get_origin(typ) is Literal:
                allowed = get_args(typ)
                if value not in allowed:
                    raise UserError(
                        f"{_flag(f)} must be one of {', '.join(allowed)}, got {value!r}"
                    )
                continue
            if typ is float and isinstance(value, int) and not isinstance(value, bool):
                setattr(sec, f.name, float(value))
                continue
            if typ is float and isinstance(value, float) and not math.isfinite(value):
                raise UserError(f"{_flag(f)} must be a finite number, got {value}")
            if not isinstance(value, typ) or (typ is not bool and isinstance(value, bool)):
                what = "true or false" if typ is bool else typ.__name__
                raise UserError(
                    f"{_flag(f)} ({key}: in a --config file) must be {what}, got {value!r}; "
                    "fix the value"
                )


# ----------------------------------------------------------------------------- resolution


@dataclass
class RunFacts:
    """What some defaults depend on beyond the config: read once the model and data are."""

    vocab_size: int | None = None
    packs_documents: bool | None = None  # does any training row hold two examples?
    rows: int | None = None  # training rows (for --epochs)
    world: int = 1
    bf16_params: bool | None = None  # are the parameters stored in pure bf16?
    router_aux_coef: float | None = None  # the model's (0.0 for a dense model)


def resolve(yaml_values: dict[str, Any], flag_values: dict[str, Any]) -> TrainConfig:
    """Merge defaults, the YAML file and explicit flags, check every value, and fill the
    defaults that need nothing but the config."""
    unknown = sorted(set(yaml_values) - FIELD_NAMES)
    if unknown:
        raise UserError(f"config: {unknown_option(unknown[0])}")
    # A file's value of the wrong type is refused even where a flag replaces it.
    _check_types(TrainConfig.from_flat(dict(yaml_values)))
    if _LENGTH & set(flag_values):  # a flag's run length replaces the file's, whichever it is
        yaml_values = {k: v for k, v in yaml_values.items() if k not in _LENGTH}
    given = {**yaml_values, **flag_values}
    cfg = TrainConfig.from_flat({**_resumed_base(given), **given})
    _check_types(cfg)
    for section in _SECTIONS:
        getattr(cfg, section).check(cfg)
    fill_defaults(cfg)
    return cfg


SAVED_CONFIG = "config.yaml"
_LENGTH = {"max_steps", "epochs"}  # the run's length: one of them
# Options that belong to one invocation, never taken from a run's saved config.
_PER_INVOCATION = ("resume", "overwrite", "accept_changes")


def read_saved_config(output_dir: str | Path) -> dict[str, Any] | None:
    """A run's `config.yaml` (None if the folder has none): its known options, flat."""
    path = Path(output_dir) / SAVED_CONFIG
    if not path.is_file():
        return None
    try:
        raw = yaml.safe_load(path.read_text())
    except (yaml.YAMLError, UnicodeDecodeError, OSError) as e:
        raise UserError(
            f"{path}: cannot read the run's saved config ({type(e).__name__}); restore it, or "
            "delete it and pass every flag of the run again with --resume"
        ) from e
    if not isinstance(raw, dict):
        raise UserError(f"{path}: expected option: value lines; restore or delete the file")
    for key in raw:
        if key not in FIELD_NAMES:
            raise UserError(f"{path}: {unknown_option(key)} Remove or correct that line")
    return dict(raw)


def _resumed_base(given: dict[str, Any]) -> dict[str, Any]:
    """With --resume, the run's saved config is what the given options change (so `--resume`
    alone continues the run as it was). The run's length is one choice: `--max-steps` or
    `--epochs`, whichever is given, replaces both saved ones."""
    if not given.get("resume") or given.get("output_dir") is None:
        return {}
    base = read_saved_config(given["output_dir"])
    if base is None:
        if Path(given["output_dir"]).is_dir() and not given.get("accept_changes"):
            raise UserError(
                f"--resume: {Path(given['output_dir']) / SAVED_CONFIG} is missing, so the run's "
                "options are unknown (a resume would fall back to defaults); restore the file "
                "(every run writes it as it starts), or pass every option of the run again with "
                "--accept-changes"
            )
        base = {}
    for key in _PER_INVOCATION:
        base.pop(key, None)
    if "max_steps" in given or "epochs" in given:
        base.pop("max_steps", None)
        base.pop("epochs", None)
    elif base.get("epochs") is not None:
        base.pop("max_steps", None)  # derived from --epochs and the data, again in the build
    return base


def resume_changes(saved: dict[str, Any], cfg: TrainConfig) -> dict[str, list[str]]:
    """The options of `cfg` that differ from a run's saved config, by their `on_resume` kind
    ("same", "fixed"; the others are not judged here), each as `--flag old -> new`."""
    changed: dict[str, list[str]] = {"same": [], "fixed": []}
    for section, cls in _SECTIONS.items():
        for f in fields(cls):
            key, kind = _key(f), f.metadata["on_resume"]
            if kind not in changed or key not in saved:
                continue
            old, new = saved[key], getattr(getattr(cfg, section), f.name)
            if old != new:
                changed[kind].append(f"{_flag(f)} {old} -> {new}")
    return changed


def fill_defaults(cfg: TrainConfig, facts: RunFacts | None = None) -> TrainConfig:
    """Every default that depends on other choices, decided here once (so `config.yaml` shows
    it). Each is filled as soon as what it depends on is known: the build calls this again with
    the facts of the model and data. Values already set are never changed."""
    facts = facts or RunFacts()
    o, lora, run = cfg.optim, cfg.lora, cfg.run
    if cfg.data.packing is None:
        # The embedded corpus is long documents (a pre-training corpus): cut, not truncated.
        cfg.data.packing = "stream" if cfg.data.source == "pydocs" else "whole"
    if o.lr is None:
        # Adapters start at zero and are few: LoRA wants a ~10x larger lr than full fine-tuning.
        o.lr = (LR_LORA if lora.rank else LR_FINE_TUNE) if cfg.model.model_dir else LR_RANDOM_INIT
    if o.router_aux_coef is None and facts.router_aux_coef is not None:
        o.router_aux_coef = facts.router_aux_coef
    if o.max_grad_norm is None:
        # In-backward never holds all gradients at once, so there is no global norm to clip.
        o.max_grad_norm = 0.0 if o.optimizer_in_backward else MAX_GRAD_NORM
    bf16 = facts.bf16_params
    if bf16 is None and cfg.model.dtype is not None:  # else the device decides, in the build
        bf16 = cfg.model.dtype == "bf16"
    if o.bf16_compensation is None and bf16 is not None:
        # Plain bf16 rounds away updates under half an ulp of their weight: at a fine-tuning lr
        # it makes ~20% of fp32's progress (tests/unit/test_optim.py). Stochastic rounding
        # keeps the expected update and costs no memory, so pure bf16 learns like fp32.
        o.bf16_compensation = "stochastic" if bf16 else "none"
    if lora.rank and lora.alpha is None:
        lora.alpha = LORA_ALPHA_PER_RANK * lora.rank
    if run.output_dir is None:
        name = cfg.model.preset or (
            Path(cfg.model.model_dir).name if cfg.model.model_dir else "debug"
        )
        run.output_dir = str(Path("runs") / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}")
    if run.max_steps is None and run.epochs is None:
        run.max_steps = DEFAULT_MAX_STEPS
    if run.max_steps is None and facts.rows is not None:
        rows_per_step = cfg.data.batch_size * cfg.data.grad_accum * facts.world
        run.max_steps = max(1, run.epochs * -(-facts.rows // rows_per_step))
    if o.warmup_steps is None and run.max_steps is not None:
        o.warmup_steps = max(1, round(WARMUP_FRACTION * run.max_steps)) if run.max_steps > 1 else 0
    if cfg.techniques.loss is None and facts.vocab_size is not None:
        # The fused head pays off once logits are large; a tiny vocabulary gains nothing from it.
        big = cfg.techniques.compile or facts.vocab_size >= 32000
        cfg.techniques.loss = "fused" if big else "plain"
    if cfg.data.doc_mask is None and facts.packs_documents is not None:
        # Document masking is the default wherever a row holds more than one example: without
        # it an example attends to the unrelated text packed before it, which it never sees at
        # inference, and its positions run on from that text. With the mask, loss and
        # gradients of a packed row equal those of its examples run one by one (tested). Where
        # no row holds two examples the mask changes nothing, and plain causal attention is
        # the simpler kernel.
        cfg.data.doc_mask = facts.packs_documents
    return cfg


# ----------------------------------------------------------------------------- files


def load_yaml(path: str) -> dict[str, Any]:
    """Read a YAML run file, or a shipped recipe by name (`compiletune configs`), into a dict of
    config keys (dashes or underscores accepted)."""
    p = Path(path)
    if not p.is_file():
        shipped = recipes.find(path)
        if shipped is None:
            raise UserError(
                f"--config {path}: no such file or shipped recipe; pass the path of a YAML run "
                "file or a name from `compiletune configs`"
            )
        p = shipped
    try:
        raw = yaml.safe_load(p.read_text()) or {}
    except yaml.YAMLError as e:
        raise UserError(f"--config {path}: not valid YAML ({e}); fix the file") from e
    if not isinstance(raw, dict):
        raise UserError(f"--config {path}: expected a mapping of option: value at the top level")
    out: dict[str, Any] = {}
    spelled: dict[str, Any] = {}
    for key, value in raw.items():
        name = str(key).replace("-", "_")
        if name not in FIELD_NAMES:
            raise UserError(f"--config {path}: {unknown_option(key)}")
        if name in out:
            raise UserError(
                f"--config {path}: '{spelled[name]}' and '{key}' are the same option; keep one"
            )
        out[name], spelled[name] = value, key
    return out


def unknown_option(key: Any) -> str:
    """'unknown option K; did you mean N?' with the nearest option name, or the known ones."""
    name = str(key).replace("-", "_")
    near = difflib.get_close_matches(name, sorted(FIELD_NAMES), n=1, cutoff=0.6)
    if near:
        return f"unknown option '{key}'; did you mean '{near[0]}'?"
    return f"unknown option '{key}'; known options: {', '.join(sorted(FIELD_NAMES))}"


def save_yaml(cfg: TrainConfig, path: Path) -> None:
    path.write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))


# ----------------------------------------------------------------------------- flags


_METAVARS = {int: "N", float: "F", str: "VALUE"}


def add_flags(parser: argparse.ArgumentParser, *, estimate_only: bool = False) -> None:
    """One flag per config field, grouped by section. Every flag defaults to SUPPRESS, so only
    flags the user typed reach the config and YAML values survive. `estimate_only`: just the
    flags that change a memory estimate."""
    S = argparse.SUPPRESS
    for cls in _SECTIONS.values():
        group = parser.add_argument_group(cls.TITLE)
        hints = _hints(cls)
        for f in fields(cls):
            meta = f.metadata
            if estimate_only and not meta["estimate"]:
                continue
            typ, _ = _unwrap(hints[f.name])
            help_text = meta["help"]
            shown = meta["shows"] if meta["shows"] is not None else f.default
            kw: dict[str, Any] = {"default": S, "dest": _key(f)}
            if typ is bool and meta["negate"]:
                group.add_argument(
                    "--no-" + _key(f).replace("_", "-"), action="store_false", help=help_text, **kw
                )
                continue
            if typ is bool:
                if f.default is None:
                    kw["action"] = argparse.BooleanOptionalAction
                    help_text += f" (default: {shown})"
                else:
                    kw["action"] = "store_true"
            elif get_origin(typ) is Literal:
                kw["choices"] = get_args(typ)
                if shown is not None:
                    help_text += f" (default: {shown})"
            else:
                kw["type"] = typ
                kw["metavar"] = meta["metavar"] or _METAVARS.get(typ, "VALUE")
                if shown is not None:
                    help_text += f" (default: {shown})"
            group.add_argument(_flag(f), help=help_text.replace("%", "%%"), **kw)
