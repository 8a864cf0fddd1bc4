"""The models a run trains and runs beside: the architecture (`resolve_model_args`), LoRA's
targets, the policy with its weights (read, or drawn from the seed) or on the meta device for
FSDP and for a build that reads nothing, `materialise` to give a meta model storage, and the
frozen reference or teacher (`build_frozen`).
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from compiletune import distributed as dist_
from compiletune import weight_init
from compiletune.checkpoint import adapter_io
from compiletune.config import TrainConfig
from compiletune.errors import UserError
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
from compiletune.models.generation_config import load_generation_config
from compiletune.models.lora import (
    LoRASpec,
    apply_lora,
    block_adapter,
    model_targets,
    parse_targets,
)
from compiletune.models.lora_targets import ALL_LINEAR, parse_tower_targets
from compiletune.models.vision.lora import resolve as resolve_tower
from compiletune.models.vision.model import (
    VisionLanguageModel,
    is_vision_checkpoint,
    tower_targets,
)
from compiletune.train.techniques import shard_model

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
    has (`all-linear` on a model without linear-attention layers leaves theirs out), and the
    vision tower's (`vision.NAME` entries; all of its projections with --train-vision when
    none is named, on a vision-language --model-dir). Values were checked in config."""
    lo = cfg.lora
    if not lo.rank:
        return None
    targets = model_targets(args, parse_targets(lo.targets))
    tower = parse_tower_targets(lo.targets)
    folder = cfg.model.model_dir
    config = load_hf_config(folder) if folder is not None else {}
    if tower and not is_vision_checkpoint(config):
        raise UserError(
            f"--lora-targets {lo.targets}: vision.* targets adapt a vision tower, and "
            f"{folder or 'the preset'} has none that compiletune loads; drop them"
        )
    if not tower and cfg.model.train_vision and is_vision_checkpoint(config):
        tower = (ALL_LINEAR,)  # --train-vision in a LoRA run: adapters on all of the tower
    if tower:  # checked against the checkpoint's tower, sorted
        tower = resolve_tower(tower, tower_targets(args, config, str(folder)), str(folder))
    return LoRASpec(
        rank=lo.rank, alpha=float(lo.alpha), dropout=lo.dropout, targets=targets, vision=tower
    )


def tower_lora(cfg: TrainConfig, spec: LoRASpec | None, vision: bool) -> LoRASpec | None:
    """`spec` for a run that loads the vision tower (`vision`) or not: a text-only run drops the
    tower's targets that --train-vision implied (the flag has nothing to do there) and refuses
    the ones --lora-targets names."""
    if spec is None or vision or not spec.vision:
        return spec
    if parse_tower_targets(cfg.lora.targets):
        raise UserError(
            f"--lora-targets {cfg.lora.targets}: vision.* targets adapt the vision tower, which "
            "a run loads for image data only (this data has no images); drop them"
        )
    return dataclasses.replace(spec, vision=())


def _model_name(cfg: TrainConfig) -> str:
    """What adapter_config.json names as the base: the folder, or the (seeded) preset."""
    m = cfg.model
    return str(resolve_model_path(m.model_dir).resolve()) if m.model_dir else m.preset or "debug"


def wants_vision(cfg: TrainConfig, images: bool) -> bool:
    """Does the run load --model-dir's vision tower: its data holds images (`images`) and the
    checkpoint is a vision-language one compiletune loads. A text-only run on a vision
    checkpoint loads its text model alone, as before. --train-vision with LoRA puts adapters
    on the tower's projections (`lora_spec`)."""
    folder = cfg.model.model_dir
    return images and folder is not None and is_vision_checkpoint(load_hf_config(folder))


def build_model_weights(
    cfg: TrainConfig,
    args: ModelArgs,
    spec: LoRASpec | None,
    lora_kw: dict[str, Any],
    device: torch.device | str,
    resume_from: Path | None,
    vision: bool = False,
) -> Transformer:
    """The model with its weights: the checkpoint's, --model-dir's, or drawn from the seed.
    With LoRA each block becomes LoRA (NF4) as soon as it is loaded, so the full-size base never
    exists, and a LoRA checkpoint's adapters are loaded on top. `vision` (`wants_vision`): with
    the checkpoint's vision tower, trainable with --train-vision."""
    m, seed = cfg.model, cfg.run.seed
    dtype = lora_kw["dtype"]
    tower = {"vision": vision, "train_vision": m.train_vision}
    if spec is None:
        if resume_from is not None:
            return from_hf(resume_from, dtype=dtype, device=device, **tower)
        if m.model_dir is not None:
            return from_hf(m.model_dir, dtype=dtype, device=device, **tower)
        return weight_init.init_hashed(build_model(args, device, dtype, init=False), seed)
    adapt = block_adapter(spec, **lora_kw, seed=seed)
    if m.model_dir is not None:
        model = from_hf(m.model_dir, dtype=dtype, device=device, on_block=adapt, **tower)
    else:
        model = build_model(args, device, dtype, init=True, seed=seed, on_block=adapt)
    apply_lora(model, spec, **lora_kw, seed=seed, blocks_adapted=True)
    model.lora_base = _model_name(cfg)
    if resume_from is not None:
        adapter_io.load_adapter(model, resume_from)
    return model


def build_meta_model(
    cfg: TrainConfig,
    args: ModelArgs,
    spec: LoRASpec | None,
    lora_kw: dict[str, Any],
    vision: bool = False,
) -> Transformer:
    """The model's structure on the meta device (LoRA adapters and NF4 codes included), as every
    FSDP rank and a build that reads nothing build it; `materialise` gives it storage."""
    with torch.device("meta"):
        if vision:
            folder = cfg.model.model_dir
            model = VisionLanguageModel(args, load_hf_config(folder), str(folder))
            model.train_vision(cfg.model.train_vision)
        else:
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


def build_policy_model(
    cfg: TrainConfig,
    env: dist_.DistEnv | None,
    args: ModelArgs,
    spec: LoRASpec | None,
    lora_kw: dict[str, Any],
    device: torch.device,
    resume_from: Path | None,
    read: bool,
    vision: bool = False,
) -> tuple[Transformer, dict[str, Tensor] | None]:
    """The model with its weights (one process), or, under FSDP and without `read` (weights
    drawn from the seed later), the model on the meta device plus (FSDP rank 0, reading) the
    full state dict to fill the shards from. `vision`: with the tower (`wants_vision`)."""
    if read and env is None:
        return build_model_weights(cfg, args, spec, lora_kw, device, resume_from, vision), None
    full_sd = None
    if read and env.is_main and (spec or (resume_from is None and cfg.model.model_dir)):
        # Rank 0 alone reads the checkpoint (or a LoRA run's random base; a full model's random
        # init is drawn shard by shard, see materialise): host RAM holds one model, not one per
        # rank. A LoRA checkpoint holds no base, so its adapters come this way too.
        full_sd = build_model_weights(
            cfg, args, spec, lora_kw, "cpu", resume_from, vision
        ).state_dict()
    model = build_meta_model(cfg, args, spec, lora_kw, vision)
    if resume_from is not None and spec is None:
        model.hf_config = load_hf_config(resume_from)
        model.generation_config = load_generation_config(resume_from)
    return model, full_sd


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
