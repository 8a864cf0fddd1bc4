"""A run's configuration resolved: defaults < YAML file < flags (and, with --resume, the run's
saved config under the flags typed), every value checked, and `fill_defaults`, the one function
that decides every default depending on other choices."""

from __future__ import annotations

import time
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from compiletune.config.checks import CHECKS, check_types
from compiletune.config.files import SAVED_CONFIG, read_saved_config, unknown_option
from compiletune.config.schema import (
    DEFAULT_MAX_STEPS,
    FIELD_NAMES,
    LORA_ALPHA_PER_RANK,
    LR_FINE_TUNE,
    LR_LORA,
    LR_RANDOM_INIT,
    MAX_GRAD_NORM,
    SECTIONS,
    WARMUP_FRACTION,
    TrainConfig,
    flag_of,
    key_of,
)
from compiletune.errors import UserError


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
    check_types(TrainConfig.from_flat(dict(yaml_values)))
    if _LENGTH & set(flag_values):  # a flag's run length replaces the file's, whichever it is
        yaml_values = {k: v for k, v in yaml_values.items() if k not in _LENGTH}
    given = {**yaml_values, **flag_values}
    cfg = TrainConfig.from_flat({**_resumed_base(given), **given})
    check_types(cfg)
    for section, check in CHECKS.items():
        check(getattr(cfg, section), cfg)
    fill_defaults(cfg)
    return cfg


_LENGTH = {"max_steps", "epochs"}  # the run's length: one of them
# Options that belong to one invocation, never taken from a run's saved config.
_PER_INVOCATION = ("resume", "resume_from", "overwrite", "accept_changes")


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
    for section, cls in SECTIONS.items():
        for f in fields(cls):
            key, kind = key_of(f), f.metadata["on_resume"]
            if kind not in changed or key not in saved:
                continue
            old, new = saved[key], getattr(getattr(cfg, section), f.name)
            if old != new:
                changed[kind].append(f"{flag_of(f)} {old} -> {new}")
    return changed


def default_lr(cfg: TrainConfig) -> float:
    """The learning rate a run gets when --lr is not given."""
    if not cfg.model.model_dir:
        return LR_RANDOM_INIT
    # Adapters start at zero and are few: LoRA wants a ~10x larger lr than full fine-tuning.
    return LR_LORA if cfg.lora.rank else LR_FINE_TUNE


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
        o.lr = default_lr(cfg)
    if cfg.objective.beta is None:
        cfg.objective.beta = 0.0 if cfg.objective.objective == "grpo" else 0.1
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
        groups = max(1, facts.world // cfg.parallel.cp)  # ranks with rows of their own
        rows_per_step = cfg.data.batch_size * cfg.data.grad_accum * groups
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
