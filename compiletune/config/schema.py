"""The run configuration's schema: its sections (model, data, optim, techniques, parallel, lora,
run, objective), each a dataclass whose fields carry their help, flag and YAML key, estimate and
resume behaviour (`opt`), and `TrainConfig`, the whole run. The checks of the values are in
checks.py, their resolution and derived defaults in resolve.py, YAML files in files.py and the
command-line flags in flags.py."""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from dataclasses import dataclass, field, fields
from typing import Any, get_args, get_origin

from compiletune.choices import (
    BaseDtype,
    Bf16Compensation,
    CompileBackend,
    DataFormat,
    Dtype,
    Fp8Recipe,
    GrpoLoss,
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
from compiletune.compiler.ac_policy import ActivationPolicy, parse_ac
from compiletune.compiler.offload_target import OffloadTarget

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
    numerics contract), "length" for the run's length (judged by `run_dir/resume.judge_resume`)."""
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
        None,
        "HF model folder to fine-tune, or a Hub id ORG/NAME[@REVISION] (downloaded once)",
        metavar="DIR",
        on_resume="fixed",
    )
    n_layers: int | None = opt(
        None,
        "override the preset's depth (random init; benches, debugging)",
        shows="preset's",
        on_resume="fixed",
    )
    tokenizer: str | None = opt(
        None,
        "HF tokenizer folder or Hub id",
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
    train_vision: bool = opt(
        False,
        "vision-language checkpoints: train the vision tower too (frozen by default; with "
        "--lora-rank: LoRA on all of its projections; the build reads this)",
        on_resume="fixed",
    )


@dataclass
class DataConfig:
    """What the model reads: training data, held-out data, and the shape of a step."""

    TITLE = "data and step shape"
    source: str = opt(
        "pydocs",
        "pydocs (embedded default) | a file (.jsonl .json .parquet .arrow .csv .txt) | a folder "
        "or glob of shards | a save_to_disk folder | a Hub dataset ORG/NAME[/CONFIG][@REV] | a "
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
        "the split of a DatasetDict or Hub dataset",
        shows="train",
        estimate=False,
        metavar="NAME",
    )
    eval_split: str | None = opt(
        None,
        "the split of --eval-data (e.g. test)",
        shows="--data-split",
        estimate=False,
        metavar="NAME",
        on_resume="free",
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
    skip_bad_images: bool = opt(
        False,
        "leave out (and count) the rows whose image is missing, unreadable or oversized, "
        "instead of stopping on the first",
        estimate=False,
    )
    seq_len: int = opt(256, "tokens per row")
    batch_size: int = opt(8, "rows per micro-batch (per process)")
    grad_accum: int = opt(1, "micro-batches per optimizer step")


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
    router_bias_update_rate: float = opt(
        0.0,
        "DeepSeek-V3-style routers: nudge each expert's correction bias by this after every "
        "step towards balanced loads (auxiliary-loss-free balancing; 0 = off)",
        estimate=False,
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
    fp8: Fp8Recipe | None = opt(
        None,
        "float8 matmuls in the blocks' linears (torchao, compiletune[fp8]; GPUs of compute "
        "capability 8.9+): rowwise or tensorwise scales",
        on_resume="free",
    )
    mlp_tile: int = opt(
        0,
        "run each block's MLP (with its norm) over N tokens at a time, each tile recomputed in "
        "backward: a block's transient memory stops growing with the row (0 = off)",
        metavar="N",
        on_resume="free",
    )
    offload_activations: OffloadTarget = opt(
        OffloadTarget(),
        "what the first N blocks save for backward goes to host memory (needs --compile); "
        "all (the flag alone): every block; auto: the fewest blocks that make the step fit the "
        "GPU (estimate-memory: --device-memory)",
        shows="off",
        metavar="N|all|auto",
        on_resume="free",
    )

    @functools.cached_property
    def activation_policy(self) -> ActivationPolicy:
        """--ac and --ac-every as one typed value, parsed once, at the first read (the config's
        checks, `check_techniques`, which refuse a bad value in one line). Every reader takes
        this; none parses the text. A config made anew (`cfg.replace`) parses its own."""
        return parse_ac(self.ac, self.ac_every)


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
    cp: int = opt(
        1,
        "context parallelism: split each sequence over N processes (attention exchanged over "
        "heads; N divides the processes and the heads)",
        on_resume="fixed",
    )
    ep: int = opt(
        1,
        "expert parallelism: split each MoE layer's experts over N processes, tokens sent to "
        "their experts' processes (N divides the processes and the experts)",
        on_resume="free",  # the sharded checkpoint holds experts and moments whole
    )
    ep_skew: float = opt(
        2.0,
        "estimate-memory under --ep: the busiest process receives F times its even share of "
        "the routed tokens (1 = uniform routing, --ep = all of them; train ignores it)",
        metavar="F",
        on_resume="free",
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
        "q,k,v,o,gate,up,down (any of them) or all-linear; vision.NAME: the vision tower's "
        "projection NAME as the checkpoint names it (vision.all-linear: all)",
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
    eval_tasks: str | None = opt(
        None,
        "lm-evaluation-harness tasks run on saved checkpoints, into OUTPUT_DIR/eval/ "
        "(compiletune[eval]; docs/eval.md)",
        estimate=False,
        metavar="T1,T2",
        on_resume="free",
    )
    eval_tasks_every: int = opt(
        0,
        "run --eval-tasks on the checkpoints of every N steps, a multiple of --save-every "
        "(0 = the final checkpoint only)",
        estimate=False,
        on_resume="free",
    )
    eval_tasks_include: str | None = opt(
        None,
        "a folder of lm-eval task YAML files of your own, for --eval-tasks",
        estimate=False,
        metavar="DIR",
        on_resume="free",
    )
    eval_tasks_limit: int | None = opt(
        None, "--eval-tasks: at most N examples per task", estimate=False, on_resume="free"
    )
    save: bool = opt(
        True,
        "write no checkpoint at all, not even at the end (benchmarks; the run is not resumable)",
        estimate=False,
        negate=True,
        on_resume="free",
    )
    log: str | None = opt(
        None,
        "also log to: tensorboard, wandb, mlflow (comma-separated)",
        estimate=False,
        on_resume="free",
    )
    resume: bool = opt(
        False,
        "continue from the latest checkpoint in --output-dir",
        estimate=False,
        on_resume="free",
    )
    resume_from: str | None = opt(
        None,
        "with --resume: continue from this checkpoint of --output-dir (step_N or N) instead "
        "of the newest complete one",
        estimate=False,
        metavar="STEP",
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


@dataclass
class ObjectiveConfig:
    """What the run optimises: next-token cross-entropy, a preference objective on pairs, or
    distillation from a teacher (docs/objectives.md)."""

    TITLE = "objective"
    objective: Objective = opt(
        "sft",
        "sft: next-token loss; dpo/ipo/simpo: preference pairs; kd: distil --teacher-dir; "
        "grpo: reinforcement from --reward on sampled completions",
        estimate=True,
        on_resume="fixed",
    )
    beta: float | None = opt(
        None,
        "dpo/ipo/simpo: the preference strength beta; grpo: the KL penalty to the reference "
        "(0: none, and no reference is built)",
        shows="0.1; 0 for grpo",
        estimate=True,
    )
    label_smoothing: float = opt(0.0, "dpo: conservative DPO's label smoothing eps", estimate=False)
    simpo_gamma: float = opt(0.5, "simpo: the target reward margin gamma", estimate=False)
    precompute_ref: bool = opt(
        False,
        "dpo/ipo: score every pair under the reference once, before training (then freed)",
        estimate=True,
    )
    teacher_dir: str | None = opt(
        None,
        "kd: the teacher's HF folder or Hub id (same vocabulary)",
        estimate=True,
        metavar="DIR",
        on_resume="fixed",
    )
    kd_ratio: float = opt(0.5, "kd: weight of the divergence (the rest: CE)", estimate=False)
    kd_temperature: float = opt(1.0, "kd: softmax temperature of both models", estimate=False)
    kd_loss: KdLoss = opt("forward_kl", "kd: forward KL or Jensen-Shannon", estimate=False)
    reward: str | None = opt(
        None,
        "grpo: reward functions, comma-separated: module:function, exact:COLUMN, "
        "contains:COLUMN, regex:PATTERN, length:N (docs/grpo.md)",
        estimate=False,
        metavar="SPEC",
    )
    reward_weights: str | None = opt(
        None, "grpo: one weight per --reward, comma-separated (default 1 each)", estimate=False
    )
    reward_timeout: float = opt(
        60.0,
        "grpo: seconds one call of a reward function may take; past it the run stops as on "
        "Ctrl-C, naming the reward (raise it for a slow reward)",
        estimate=False,
        on_resume="free",
    )
    num_generations: int = opt(4, "grpo: completions sampled per prompt (the group)", estimate=True)
    max_new_tokens: int = opt(128, "grpo: the longest completion, in tokens", estimate=True)
    temperature: float = opt(1.0, "grpo: sampling temperature", estimate=False)
    top_p: float = opt(1.0, "grpo: nucleus sampling's top-p (1: off)", estimate=False)
    grpo_iterations: int = opt(
        1, "grpo: optimizer updates per batch of completions (old log-probs kept)", estimate=False
    )
    grpo_loss: GrpoLoss = opt(
        "grpo",
        "grpo: per-completion mean (grpo), a constant normaliser (dr_grpo) or a token mean (dapo)",
        estimate=False,
    )
    epsilon_low: float = opt(0.2, "grpo: the ratio's clip below 1", estimate=False)
    epsilon_high: float = opt(0.2, "grpo: the ratio's clip above 1 (DAPO: 0.28)", estimate=False)
    scale_rewards: bool = opt(
        True,
        "grpo: do not divide the advantages by the group's std (Dr. GRPO)",
        estimate=False,
        negate=True,
    )
    rollout_cuda_graphs: bool = opt(
        False,
        "grpo: replay the rollout's decode step as one CUDA graph per batch of prompts (CUDA)",
        estimate=False,
        on_resume="free",
    )


SECTIONS: dict[str, type] = {
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
        per_section: dict[str, dict[str, Any]] = {name: {} for name in SECTIONS}
        for key, value in values.items():
            section, attr = BY_KEY[key]
            per_section[section][attr] = PARSED[key].parse(value) if key in PARSED else value
        return cls(**{name: SECTIONS[name](**v) for name, v in per_section.items()})

    def to_dict(self) -> dict[str, Any]:
        """Flat `{key: value}`, the form of YAML files and `config.yaml`."""
        return {
            key_of(f): _plain(getattr(getattr(self, section), f.name))
            for section, cls in SECTIONS.items()
            for f in fields(cls)
        }

    def get(self, key: str) -> Any:
        """The value of a flat key (`cfg.get("seq_len")`)."""
        section, attr = BY_KEY[key]
        return getattr(getattr(self, section), attr)

    def replace(self, **changes: Any) -> TrainConfig:
        """A copy with some flat keys changed (`cfg.replace(ac="full")`)."""
        return TrainConfig.from_flat({**self.to_dict(), **changes})

    @property
    def name(self) -> str:
        """What the run trains, as banners and summaries name it."""
        return self.model.preset or self.model.model_dir or "debug"


def key_of(f: dataclasses.Field) -> str:
    return f.metadata.get("key") or f.name


def flag_of(f: dataclasses.Field) -> str:
    return "--" + key_of(f).replace("_", "-")


BY_KEY = {key_of(f): (section, f.name) for section, cls in SECTIONS.items() for f in fields(cls)}
FIELD_NAMES = set(BY_KEY)


def flag_text(key: str, value: Any) -> str:
    """The command-line form of `key = value` ("--ac full", "--fsdp"; "" for an unset or false
    switch), with the flag name the config derives for that key."""
    section, attr = BY_KEY[key]
    flag = flag_of(next(f for f in fields(SECTIONS[section]) if f.name == attr))
    value = _plain(value)
    if value is True:
        return flag
    if value is False or value is None:
        return ""
    return f"{flag} {value}"


def unwrap(hint: Any) -> tuple[Any, bool]:
    """(the type without `None`, whether None is allowed)."""
    if get_origin(hint) in (typing.Union, types.UnionType):
        args = [a for a in get_args(hint) if a is not type(None)]
        return args[0], len(args) < len(get_args(hint))
    return hint, False


def hints_of(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


# Fields whose values are parsed into a type of their own (`OffloadTarget`): `from_flat` parses
# the YAML or flag form (so every config holds the typed value), `to_dict` gives that form back.
PARSED = {
    key_of(f): typ
    for cls in SECTIONS.values()
    for f in fields(cls)
    if hasattr(typ := unwrap(hints_of(cls)[f.name])[0], "parse")
}


def _plain(value: Any) -> Any:
    return value.to_config() if hasattr(value, "to_config") else value
