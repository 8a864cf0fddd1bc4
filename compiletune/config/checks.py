"""The checks of a run's values, one function per config section (a value that is valid alone
but not beside another is refused here, with the flags to change), and the type check of
values read from YAML."""

from __future__ import annotations

import math
import re
from dataclasses import fields
from pathlib import Path
from typing import Literal, get_args, get_origin

from compiletune import hub, recipes
from compiletune.choices import Bf16Compensation, OptimizerKind, choices
from compiletune.config.schema import (
    SECTIONS,
    DataConfig,
    LoRAConfig,
    ModelConfig,
    ObjectiveConfig,
    OptimConfig,
    ParallelConfig,
    RunConfig,
    TechniquesConfig,
    TrainConfig,
    flag_of,
    hints_of,
    key_of,
    unwrap,
)
from compiletune.data.sources import check_local_sources
from compiletune.errors import UserError
from compiletune.launch import launched_world_size
from compiletune.models.lora_targets import parse_targets
from compiletune.models.presets import from_name


def _at_least_one(key: str, value: int) -> None:
    if value < 1:
        raise UserError(f"--{key.replace('_', '-')} must be at least 1, got {value}")


def check_model(section: ModelConfig, cfg: TrainConfig) -> None:
    if section.preset is not None:
        from_name(section.preset)  # an unknown name is refused before anything loads
    if section.n_layers is not None and (section.model_dir is not None or section.n_layers < 1):
        raise UserError(
            "--n-layers (a positive depth) only applies to a random-init --model preset"
        )
    if section.dtype == "bf16-mixed" and not cfg.parallel.fsdp:
        raise UserError(
            "--dtype bf16-mixed is FSDP's mixed precision; add --fsdp, or pass --dtype bf16"
        )


def check_data(section: DataConfig, cfg: TrainConfig) -> None:
    for name in ("seq_len", "batch_size", "grad_accum"):
        _at_least_one(name, getattr(section, name))
    if section.data_workers is not None and section.data_workers < 0:
        raise UserError(f"--data-workers must be >= 0, got {section.data_workers}")
    if section.data_columns is not None:
        from compiletune.data.layouts import (
            parse_columns,  # lazy: the CLI imports config before torch
        )

        parse_columns(section.data_columns)  # a malformed mapping fails before the model loads
    if section.data_roles is not None:
        from compiletune.data.layouts import (
            parse_roles,  # lazy: the CLI imports config before torch
        )

        parse_roles(section.data_roles)
    if not recipes.is_placeholder(section.source):  # a recipe's <...> is refused by train
        from compiletune.data.sources import (
            parse_sources,  # lazy: the CLI imports config before torch
        )

        parse_sources(section.source)  # a malformed mixture fails before the model loads
    if section.eval_every < 0:
        raise UserError(
            f"--eval-every must be 0 (only at the end) or positive, got {section.eval_every}"
        )
    if not 0.0 <= section.val_split < 1.0:
        raise UserError(f"--val-split must be a fraction in [0, 1), got {section.val_split}")
    if section.val_split > 0 and section.eval_data is not None:
        raise UserError("--val-split and --eval-data both name the held-out data; pass one of them")
    if section.eval_every > 0 and section.eval_data is None and section.val_split == 0:
        raise UserError("--eval-every needs held-out data: add --eval-data SOURCE or --val-split F")
    if section.eval_split is not None and section.eval_data is None:
        raise UserError("--eval-split picks a split of --eval-data; add --eval-data SOURCE")


def check_optim(section: OptimConfig, cfg: TrainConfig) -> None:

    if section.lr is not None and not section.lr > 0:
        raise UserError(f"--lr must be positive, got {section.lr}")
    if section.warmup_steps is not None and section.warmup_steps < 0:
        raise UserError(f"--warmup-steps must be >= 0, got {section.warmup_steps}")
    if not 0.0 <= section.min_lr_ratio <= 1.0:
        raise UserError(f"--min-lr-ratio must be within [0, 1], got {section.min_lr_ratio}")
    if section.max_grad_norm is not None and section.max_grad_norm < 0:
        raise UserError(f"--max-grad-norm must be >= 0 (0 disables), got {section.max_grad_norm}")
    for flag, value in (("aux", section.router_aux_coef), ("z", section.router_z_coef)):
        if value is not None and value < 0:
            raise UserError(f"--router-{flag}-coef must be >= 0 (0 = off), got {value}")
    if section.router_bias_update_rate < 0:
        raise UserError(
            f"--router-bias-update-rate must be >= 0 (0 = off), got {section.router_bias_update_rate}"
        )
    if section.router_bias_update_rate and cfg.lora.rank:
        raise UserError(
            "--router-bias-update-rate changes the base model's router biases, which a LoRA "
            "run's adapter folders do not carry; use it in full fine-tuning, or leave it 0"
        )
    check_optimizer_flags(
        section.optimizer,
        section.optimizer_in_backward,
        cfg.data.grad_accum,
        section.max_grad_norm or 0.0,
        section.bf16_compensation or "none",
    )
    # dtype None (decided by the device) is checked again once the build knows it
    if section.bf16_compensation not in (None, "none") and cfg.model.dtype not in (None, "bf16"):
        raise UserError(
            f"--bf16-compensation {section.bf16_compensation} corrects bf16 parameter updates; "
            "add --dtype bf16 or drop it"
        )


def check_optimizer_flags(
    optimizer: str,
    in_backward: bool,
    grad_accum: int,
    max_grad_norm: float,
    bf16_compensation: str,
) -> None:
    """Raise `UserError` for an unknown optimizer or compensation, or a contradictory combination."""
    if optimizer not in choices(OptimizerKind):
        raise UserError(
            f"--optimizer {optimizer} is not known; pass one of {', '.join(choices(OptimizerKind))}"
        )
    if bf16_compensation not in choices(Bf16Compensation):
        raise UserError(
            f"--bf16-compensation {bf16_compensation} is not known; "
            f"pass one of {', '.join(choices(Bf16Compensation))}"
        )
    if in_backward and grad_accum > 1:
        raise UserError(
            f"--optimizer-in-backward steps each parameter as soon as its gradient is ready, so it "
            f"cannot accumulate --grad-accum {grad_accum} micro-batches; pass --grad-accum 1 "
            "(with a larger --batch-size) or drop --optimizer-in-backward"
        )
    if in_backward and max_grad_norm > 0:
        raise UserError(
            f"--optimizer-in-backward never holds all gradients at once, so it cannot clip them "
            f"to a global norm (--max-grad-norm {max_grad_norm}); pass --max-grad-norm 0 or drop "
            "--optimizer-in-backward"
        )


def check_techniques(section: TechniquesConfig, cfg: TrainConfig) -> None:

    policy = section.activation_policy  # parsed here, once: a bad value is refused
    if policy.kind == "budget" and not section.compile:
        raise UserError(
            f"--ac {section.ac} is a setting of the compiler's partitioner; add --compile"
        )
    if section.fp8 and cfg.lora.quantize_base:
        raise UserError(
            f"--fp8 with --quantize-base {cfg.lora.quantize_base}: the quantized base is "
            "dequantized for each matmul, float8 would cast it again; drop one of them (--fp8 "
            "with plain LoRA casts the frozen base)"
        )
    if section.mlp_tile < 0:
        raise UserError(f"--mlp-tile must be a token count (0 = off), got {section.mlp_tile}")
    if section.offload_activations and not section.compile:
        raise UserError("--offload-activations is a pass of the compile pipeline; add --compile")
    if section.dump_graphs is not None and not section.compile:
        raise UserError("--dump-graphs shows what the compiler did; it needs --compile")


def check_parallel(section: ParallelConfig, cfg: TrainConfig) -> None:

    world = launched_world_size()
    if world > 1 and not section.fsdp:
        raise UserError(
            f"{world} processes were launched but --fsdp is off; add --fsdp (every process "
            "would otherwise train its own copy)"
        )
    if not section.fsdp:
        for name, default in (
            ("sharding", "full"),
            ("shard_size", None),
            ("cpu_offload", False),
        ):
            if getattr(section, name) != default:
                flag = "--" + name.replace("_", "-")
                raise UserError(f"{flag} is a setting of FSDP; add --fsdp or drop {flag}")
    if section.shard_size is not None and (section.sharding != "hybrid" or section.shard_size < 1):
        raise UserError("--shard-size (a positive process count) only applies to --sharding hybrid")
    if section.cp < 1:
        raise UserError(f"--cp must be a positive process count, got {section.cp}")
    if section.cp > 1 and not section.fsdp:
        raise UserError(
            f"--cp {section.cp} splits each sequence over {section.cp} processes; add --fsdp "
            f"and launch with torchrun (--nproc-per-node a multiple of {section.cp})"
        )
    if section.cp > 1 and world > 1 and world % section.cp:
        raise UserError(f"--cp {section.cp} must divide the {world} processes launched")
    if cfg.data.seq_len % section.cp:
        raise UserError(
            f"--seq-len {cfg.data.seq_len} must be a multiple of --cp {section.cp} (each "
            "process holds an equal piece of every row)"
        )
    check_ep_flags(cfg, world)
    if section.cp > 1 and cfg.objective.objective == "grpo":
        raise UserError(
            "--objective grpo with --cp: generation does not split sequences; drop --cp "
            "(GRPO's rows are prompts plus --max-new-tokens)"
        )


def check_ep_flags(cfg: TrainConfig, world: int) -> None:
    """--ep's own settings (the model's experts are checked when it is built)."""
    section = cfg.parallel
    if section.ep < 1:
        raise UserError(f"--ep must be a positive process count, got {section.ep}")
    if section.ep == 1:
        return
    if not section.fsdp:
        raise UserError(
            f"--ep {section.ep} splits the experts over {section.ep} processes; add --fsdp and "
            f"launch with torchrun (--nproc-per-node a multiple of {section.ep})"
        )
    if world > 1 and world % section.ep:
        raise UserError(f"--ep {section.ep} must divide the {world} processes launched")
    for flag, on in (
        ("--cp", section.cp > 1),
        ("--cpu-offload", section.cpu_offload),
        ("--dtype bf16-mixed", cfg.model.dtype == "bf16-mixed"),  # experts outside FSDP's mp
    ):
        if on:
            raise UserError(f"--ep with {flag} is not supported yet; drop one of them")


def check_lora(section: LoRAConfig, cfg: TrainConfig) -> None:

    if section.rank < 0:
        raise UserError(f"--lora-rank must be positive (0 = full fine-tuning), got {section.rank}")
    if not section.rank:
        for f in fields(section):
            if f.name != "rank" and getattr(section, f.name) != f.default:
                flag = flag_of(f)
                raise UserError(
                    f"{flag} applies to LoRA runs; add --lora-rank R (e.g. 16) or drop {flag}"
                )
        return
    if section.alpha is not None and not section.alpha > 0:
        raise UserError(f"--lora-alpha must be positive, got {section.alpha}")
    if not 0.0 <= section.dropout < 1.0:
        raise UserError(f"--lora-dropout must be in [0, 1), got {section.dropout}")
    try:
        parse_targets(section.targets)
    except ValueError as e:
        raise UserError(f"--lora-targets {section.targets}: {e}") from e
    if cfg.model.dtype == "bf16-mixed":
        # FSDP's mixed precision would cast the NF4 codes too; LoRA has its own storage.
        raise UserError(
            "--dtype bf16-mixed does not apply to LoRA runs (the frozen base has its own "
            "storage); pass --dtype bf16, or --dtype fp32 with --base-dtype bf16"
        )


def check_run(section: RunConfig, cfg: TrainConfig) -> None:
    if section.max_steps is not None and section.epochs is not None:
        raise UserError("--max-steps and --epochs both set the run's length; pass one of them")
    if section.max_steps is not None:
        _at_least_one("max_steps", section.max_steps)
    if section.epochs is not None:
        _at_least_one("epochs", section.epochs)
    if section.save_every < 0:
        raise UserError(
            f"--save-every must be 0 (only at the end) or positive, got {section.save_every}"
        )

    from compiletune.loggers import parse_loggers  # lazy: the CLI imports config before torch

    parse_loggers(section.log)
    if section.resume and section.overwrite:
        raise UserError("--resume and --overwrite contradict each other; pass one of them")
    if section.resume and section.output_dir is None:
        raise UserError("--resume needs the --output-dir of the run to continue")
    if section.output_dir is not None and not section.output_dir.strip():
        raise UserError(
            "--output-dir is empty (it would train into the current folder); pass a folder "
            "path, or leave it out for runs/<model>-<time>"
        )
    if section.resume_from is not None and not section.resume:
        raise UserError("--resume-from picks the checkpoint of --resume; add --resume")
    if section.resume_from is not None and not re.fullmatch(r"(step_)?\d+", section.resume_from):
        raise UserError(
            f"--resume-from {section.resume_from!r}: pass a checkpoint of --output-dir as step_N "
            "or N"
        )
    if section.accept_changes and not section.resume:
        raise UserError("--accept-changes applies to --resume; drop it or add --resume")
    if section.skip_nonfinite < 0:
        raise UserError(f"--skip-nonfinite must be >= 0, got {section.skip_nonfinite}")
    if section.skip_nonfinite and cfg.optim.optimizer_in_backward:
        raise UserError(
            "--skip-nonfinite cannot undo a step of --optimizer-in-backward (each parameter "
            "is updated during backward, before the loss is known); drop one of them"
        )
    _check_eval_tasks(section, cfg)


def _check_eval_tasks(section: RunConfig, cfg: TrainConfig) -> None:
    """--eval-tasks runs lm-eval on the checkpoints the run saves (docs/eval.md)."""
    if section.eval_tasks is None:
        for name in ("eval_tasks_every", "eval_tasks_include", "eval_tasks_limit"):
            if getattr(section, name) not in (None, 0):
                flag = "--" + name.replace("_", "-")
                raise UserError(f"{flag} applies to --eval-tasks; add it or drop {flag}")
        return
    from compiletune import harness  # lazy: the CLI imports config before torch

    harness.parse_tasks(section.eval_tasks, "--eval-tasks")
    every, save_every = section.eval_tasks_every, section.save_every
    if every < 0:
        raise UserError(f"--eval-tasks-every must be 0 (the final checkpoint) or N, got {every}")
    if not section.save:
        raise UserError("--eval-tasks runs on the checkpoints the run saves; drop --no-save")
    if every and (not save_every or every % save_every):
        raise UserError(
            f"--eval-tasks-every {every} runs lm-eval on the checkpoints saved at those steps: "
            f"make it a multiple of --save-every{f' {save_every}' if save_every else ''} (or "
            f"pass --save-every {every})"
        )
    if section.eval_tasks_limit is not None and section.eval_tasks_limit < 1:
        raise UserError(f"--eval-tasks-limit must be at least 1, got {section.eval_tasks_limit}")
    include = section.eval_tasks_include
    if include is not None and not Path(include).is_dir():
        raise UserError(f"--eval-tasks-include {include} is not a folder of task YAML files")
    if cfg.parallel.fsdp:
        raise UserError(
            "--eval-tasks with --fsdp: lm-eval runs in one process on HF folders, which a "
            "sharded run writes only at its end; after the run, `compiletune eval "
            "OUTPUT_DIR/step_N --tasks ...`"
        )
    if cfg.lora.rank and cfg.model.model_dir is None:
        raise UserError(
            "--eval-tasks on a LoRA run of a random-init preset: lm-eval loads an adapter on "
            "its base model folder, and this base has none; add --merge and run `compiletune "
            "eval OUTPUT_DIR/merged --tasks ...` after the run"
        )
    if line := harness.missing("--eval-tasks"):
        raise UserError(line)


def check_objective(section: ObjectiveConfig, cfg: TrainConfig) -> None:
    if cfg.data.packing == "stream" and section.objective not in _STREAMED:
        # pairs and prompts are read whole (train/inputs.py): a stream would be ignored
        raise UserError(
            f"--packing stream cuts a token stream into rows (sft, kd); --objective "
            f"{section.objective} reads each {_UNIT.get(section.objective, 'example')} whole; "
            "drop --packing stream"
        )
    kd = section.objective == "kd"
    if kd != (section.teacher_dir is not None):
        raise UserError(
            "--objective kd needs --teacher-dir DIR"
            if kd
            else "--teacher-dir applies to --objective kd; add it or drop --teacher-dir"
        )
    grpo = section.objective == "grpo"
    if section.beta is not None and not (section.beta > 0 or (grpo and section.beta == 0)):
        raise UserError(f"--beta must be positive (grpo: >= 0), got {section.beta}")
    _check_grpo(section, cfg)
    if not 0.0 <= section.label_smoothing < 0.5:
        raise UserError(f"--label-smoothing must be in [0, 0.5), got {section.label_smoothing}")
    if not 0.0 <= section.kd_ratio <= 1.0:
        raise UserError(f"--kd-ratio must be in [0, 1], got {section.kd_ratio}")
    if not section.kd_temperature > 0:
        raise UserError(f"--kd-temperature must be positive, got {section.kd_temperature}")
    if section.precompute_ref and section.objective not in ("dpo", "ipo"):
        raise UserError("--precompute-ref applies to --objective dpo or ipo (a reference)")
    if section.objective in ("dpo", "ipo", "simpo") and "," in (cfg.data.source or ""):
        raise UserError(f"--objective {section.objective} reads one --data source of pairs")


# The objectives whose data is packed by --packing (the others read pairs or prompts whole).
_STREAMED = ("sft", "kd")
_UNIT = {"dpo": "preference pair", "ipo": "preference pair", "simpo": "preference pair"}
_UNIT |= {"grpo": "prompt"}


_GRPO_ONLY = (
    "reward",
    "reward_weights",
    "reward_timeout",
    "num_generations",
    "max_new_tokens",
    "temperature",
    "top_p",
    "grpo_iterations",
    "grpo_loss",
    "epsilon_low",
    "epsilon_high",
    "scale_rewards",
    "rollout_cuda_graphs",
)


def _check_grpo(section: ObjectiveConfig, cfg: TrainConfig) -> None:
    if section.objective != "grpo":
        for f in fields(section):
            if f.name in _GRPO_ONLY and getattr(section, f.name) != f.default:
                flag = flag_of(f)
                raise UserError(f"{flag} applies to --objective grpo; add it or drop {flag}")
        return
    if section.num_generations < 2:
        raise UserError(
            f"--num-generations must be at least 2 (advantages compare a prompt's completions "
            f"with each other), got {section.num_generations}"
        )
    if not 0 < section.max_new_tokens < cfg.data.seq_len:
        raise UserError(
            f"--max-new-tokens must be in 1..--seq-len - 1 ({cfg.data.seq_len - 1}): the prompt "
            f"and its completion share --seq-len; got {section.max_new_tokens}"
        )
    if not section.temperature > 0:
        raise UserError(
            f"--temperature must be positive for grpo (greedy completions of a prompt are all "
            f"the same), got {section.temperature}"
        )
    if not 0.0 < section.top_p <= 1.0:
        raise UserError(f"--top-p must be in (0, 1], got {section.top_p}")
    if section.grpo_iterations < 1:
        raise UserError(f"--grpo-iterations must be at least 1, got {section.grpo_iterations}")
    if not (math.isfinite(section.reward_timeout) and section.reward_timeout > 0):
        raise UserError(
            f"--reward-timeout must be a positive number of seconds, got {section.reward_timeout}"
        )
    for name in ("epsilon_low", "epsilon_high"):
        value = getattr(section, name)
        if not 0.0 < value < 1.0:
            raise UserError(f"--{name.replace('_', '-')} must be in (0, 1), got {value}")
    if section.precompute_ref:
        raise UserError("--precompute-ref applies to dpo/ipo; grpo scores its own completions")


def check_model_folder(name: str, flag: str) -> None:
    """A model folder given as `flag` is a local path or a Hub id (fetched later): nothing
    else is, so a typo is refused before anything loads."""
    if not Path(name).exists() and hub.parse(name) is None:
        raise UserError(hub.no_model_folder(name, flag))


def check_inputs(cfg: TrainConfig, *, estimate: bool = False) -> None:
    """What a run reads is there, checked before anything loads: the model, tokenizer and
    teacher folders exist (or are Hub ids, checked as they download); for training also no
    recipe placeholder is left and the data's local files exist and are data. `estimate`: the
    memory estimate's inputs, the model and teacher folders alone (a recipe's placeholder
    model folder is the preset's)."""
    if not estimate:
        recipes.check_no_placeholders(cfg)
    for flag, value in (
        ("--model-dir", cfg.model.model_dir),
        ("--tokenizer", None if estimate else cfg.model.tokenizer),
        ("--teacher-dir", cfg.objective.teacher_dir),
    ):
        if value is not None and not recipes.is_placeholder(value):
            check_model_folder(value, flag)
    if estimate:
        return
    check_local_sources(cfg.data.source, cfg.data.data_split)
    if cfg.data.eval_data is not None:
        check_local_sources(cfg.data.eval_data, cfg.data.eval_split)


# The checks of each section, in the order `resolve` runs them.
CHECKS = {
    "model": check_model,
    "data": check_data,
    "optim": check_optim,
    "techniques": check_techniques,
    "parallel": check_parallel,
    "lora": check_lora,
    "run": check_run,
    "objective": check_objective,
}


# A number in exponent form (1e-3, 5E4, 2.5e+2): what YAML 1.1 leaves a string.
_EXPONENT = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+")


def check_types(cfg: TrainConfig) -> None:
    """YAML values arrive untyped; make sure each has its field's type before anything runs."""
    for section, cls in SECTIONS.items():
        sec = getattr(cfg, section)
        hints = hints_of(cls)
        for f in fields(cls):
            typ, nullable = unwrap(hints[f.name])
            value = getattr(sec, f.name)
            if value is None and nullable:
                continue
            key = key_of(f)
            if get_origin(typ) is Literal:
                allowed = get_args(typ)
                if value not in allowed:
                    raise UserError(
                        f"{flag_of(f)} must be one of {', '.join(allowed)}, got {value!r}"
                    )
                continue
            if typ is float and isinstance(value, int) and not isinstance(value, bool):
                setattr(sec, f.name, float(value))
                continue
            if typ is float and isinstance(value, str) and _EXPONENT.fullmatch(value.strip()):
                # YAML 1.1 (PyYAML) reads `lr: 1e-3` as a string (its floats need a dot and a
                # signed exponent); users write numbers so, and mean the number.
                value = float(value)
                setattr(sec, f.name, value)
            if typ is float and isinstance(value, float) and not math.isfinite(value):
                raise UserError(f"{flag_of(f)} must be a finite number, got {value}")
            if not isinstance(value, typ) or (typ is not bool and isinstance(value, bool)):
                what = "true or false" if typ is bool else typ.__name__
                raise UserError(
                    f"{flag_of(f)} ({key}: in a --config file) must be {what}, got {value!r}; "
                    "fix the value"
                )
