"""LoRA runs on disk: PEFT-format adapter folders (checkpoints, export, import) and merged export.

The model side (adapters, frozen and NF4 weights, merging math) is `models/lora.py`; this module
is every file format a LoRA run reads or writes, so a sharded (FSDP2) export can plug in here.

An adapter folder is what `peft.PeftModel.from_pretrained(base, folder)` loads:

    adapter_config.json        PEFT LoraConfig: r, lora_alpha, lora_dropout, target_modules
                               (HF module names, e.g. q_proj), base_model_name_or_path
    adapter_model.safetensors  base_model.model.<HF module>.lora_A.weight  [r, in]
                               base_model.model.<HF module>.lora_B.weight  [out, r]
                               in the adapters' dtype

A vision-language model's decoder modules are `model.language_model.*` there, and its vision
tower's adapted projections (`--lora-targets vision.*`, models/vision/lora.py) are named as in
transformers' model (`model.vision_tower.*`, `model.visual.*`); target_modules is then a regex
that matches exactly the adapted modules.

A LoRA run's checkpoint `step_N/` is such a folder plus the tokenizer files and
`trainer_state.pt`; it holds no base weights (the run's --model-dir, or the seeded preset, is the
base). `--merge` writes `OUTPUT_DIR/merged/`, a plain HF model folder with every adapter folded
into its weight (for a QLoRA run: into the dequantized NF4 weight the adapters were trained
against).
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import Tensor, nn

from compiletune import faults
from compiletune.checkpoint.atomic import write_folder_atomically
from compiletune.errors import UserError
from compiletune.gather import full_tensor
from compiletune.models import save_hf
from compiletune.models.families import FAMILIES
from compiletune.models.generation_config import write_side_files
from compiletune.models.hf_config import brief, read_json
from compiletune.models.hf_names import to_hf_name, to_native_name
from compiletune.models.layouts import deinterleave, interleave
from compiletune.models.lora import (
    FUSED_PARTS,
    LINEAR_ATTENTION_TARGETS,
    SPEC_TARGETS,
    TARGETS,
    LoRASpec,
    lora_experts,
    lora_modules,
)
from compiletune.models.lora_targets import VISION_PREFIX
from compiletune.models.vision import lora as tower_lora
from compiletune.models.vision.model import VisionLanguageModel

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
MERGED_DIR = "merged"  # OUTPUT_DIR/merged: the --merge export
PEFT_PREFIX = "base_model.model."
# A vision-language model's decoder as transformers' ForConditionalGeneration names it in memory
# (what PEFT adapts): its adapters' keys carry this instead of `model.`, and target_modules
# names the decoder's projections only (the towers have q_proj / v_proj too).
VISION_TEXT = "model.language_model."


def _vision_key(key: str) -> str:
    """A decoder adapter's PEFT key as a vision-language checkpoint's model names it."""
    return PEFT_PREFIX + VISION_TEXT + key.removeprefix(PEFT_PREFIX + "model.")


_HF_TO_SHORT = {hf: short for short, (_, hf) in TARGETS.items()}
_PATH_TO_SHORT = {path: short for short, (path, _) in TARGETS.items()}
_ATTENTION_SHORTS = {"q", "k", "v", "o", "qkv"}
# MoE experts: transformers 5 keeps each MoE layer's experts as 3-D parameters of one module
# (`model.layers.N.mlp.experts`, Mixtral too), and PEFT adapts them as `target_parameters`.
# Two adapted parameters of one module nest: the first registered (gate_up_proj) is the inner
# wrapper, `experts.base_layer.lora_*`; the other, or a lone one, is `experts.lora_*`.
# Per expert e, lora_A [E * r, in] holds A_e in rows e*r:(e+1)*r and lora_B [out, r * E] holds
# B_e in columns e, e + E, e + 2E, ... (expert-minor).
_EXPERT_PARAMS = {"w13": "mlp.experts.gate_up_proj", "w2": "mlp.experts.down_proj"}
_EXPERT_SHORTS = {"w13": ("gate", "up"), "w2": ("down",)}
_PEFT_EXPERTS = re.compile(r"model\.layers\.(\d+)\.mlp\.experts(\.base_layer)?")


def _expert_keys(module: str, adapted: tuple[str, ...]) -> dict[str, str]:
    """Stacked weight -> PEFT module path of its adapter, for native experts `module`."""
    layer = module.split(".")[1]
    base = f"{PEFT_PREFIX}model.layers.{layer}.mlp.experts"
    if len(adapted) == 1:
        return {adapted[0]: base}
    return {"w13": f"{base}.base_layer", "w2": base}


def _interleaved(model: nn.Module) -> set[str]:
    """PEFT names of the expert adapters' B whose output rows the hub interleaves: a family with
    `gate_up_interleaved` keeps gate_up_proj's columns as gate, up, gate, up ...
    (models/layouts.py `interleave`), so the B of its gate+up adapter is stored in that order."""
    family = FAMILIES.get(model.args.family)
    if family is None or not family.gate_up_interleaved:
        return set()
    keys = {
        _expert_keys(name, m.adapted)["w13"] + ".lora_B.weight"
        for name, m in lora_experts(model)
        if "w13" in m.adapted
    }
    return {_vision_key(k) for k in keys} if isinstance(model, VisionLanguageModel) else keys


def _to_peft(kind: str, tensor: Tensor) -> Tensor:
    """Native A [E, r, in] -> PEFT's lora_A [E * r, in]; B [E, out, r] -> lora_B [out, r * E]."""
    if kind == "A":
        return tensor.flatten(0, 1)
    return tensor.permute(1, 2, 0).flatten(1, 2)


def _from_peft(kind: str, tensor: Tensor, shape: tuple[int, ...]) -> Tensor:
    """The inverse of `_to_peft` for one of them, into the native `shape`."""
    e, rows, cols = shape
    if kind == "A":
        return tensor.reshape(e, rows, cols)
    return tensor.reshape(rows, cols, e).permute(2, 0, 1)


def peft_module_name(native_module: str) -> str:
    """`layers.3.attention.wq` -> `base_model.model.model.layers.3.self_attn.q_proj`."""
    return PEFT_PREFIX + to_hf_name(native_module + ".weight").removesuffix(".weight")


def native_module_name(peft_module: str) -> str:
    """The inverse of `peft_module_name`."""
    hf = peft_module.removeprefix(PEFT_PREFIX)
    return to_native_name(hf + ".weight").removesuffix(".weight")


def adapter_config(
    spec: LoRASpec,
    base_model: str | None,
    modules: list[str] | None = None,
    experts: tuple[str, ...] = (),
) -> dict[str, Any]:
    """The adapter_config.json of a run (PEFT's LoraConfig fields; defaults written out).
    `modules`: the native names of the adapted projections; their HF names are the
    target_modules (a fused model's qkv_proj, not q_proj), else the spec's targets'.
    `experts`: the adapted stacked expert weights ("w13", "w2"), PEFT's target_parameters."""
    if modules is not None:
        hf_names = {to_hf_name(m + ".weight").removesuffix(".weight") for m in modules}
        target_modules = sorted({n.rsplit(".", 1)[-1] for n in hf_names})
    else:
        target_modules = sorted(TARGETS[t][1] for t in spec.targets)
    extra = {}
    if experts:
        extra["target_parameters"] = sorted(_EXPERT_PARAMS[w] for w in experts)
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": spec.rank,
        "lora_alpha": spec.alpha,
        "lora_dropout": spec.dropout,
        "target_modules": target_modules,
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
        "init_lora_weights": True,
        "use_rslora": False,
        "use_dora": False,
        "modules_to_save": None,
        "layers_to_transform": None,
        "layers_pattern": None,
        "rank_pattern": {},
        "alpha_pattern": {},
        **extra,
    }


def _tower(model: nn.Module) -> dict[str, str]:
    """Native module name -> PEFT module name of a vision tower's projections ({} without)."""
    return dict(model.tower_modules()) if isinstance(model, VisionLanguageModel) else {}


def targets_text(spec: LoRASpec) -> str:
    """`spec`'s targets as --lora-targets spells them (`q,v,vision.fc1`)."""
    return ",".join((*spec.targets, *(VISION_PREFIX + t for t in spec.vision)))


def adapter_state_dict(model: nn.Module) -> dict[str, Tensor]:
    """PEFT name -> adapter tensor (detached; the model's own storage)."""
    out, tower = {}, _tower(model)
    for name, m in lora_modules(model):
        if name in tower:
            continue  # below
        peft = peft_module_name(name)
        out[f"{peft}.lora_A.weight"] = m.lora_a.detach()
        out[f"{peft}.lora_B.weight"] = m.lora_b.detach()
    for name, m in lora_experts(model):
        for weight, peft in _expert_keys(name, m.adapted).items():
            a, b = getattr(m, f"lora_a_{weight}"), getattr(m, f"lora_b_{weight}")
            out[f"{peft}.lora_A.weight"], out[f"{peft}.lora_B.weight"] = a.detach(), b.detach()
    if isinstance(model, VisionLanguageModel):
        out = {_vision_key(k): v for k, v in out.items()}
    for name, m in lora_modules(model):
        if name in tower:
            out[f"{PEFT_PREFIX}{tower[name]}.lora_A.weight"] = m.lora_a.detach()
            out[f"{PEFT_PREFIX}{tower[name]}.lora_B.weight"] = m.lora_b.detach()
    return out


def save_adapter(
    model: nn.Module,
    path: str | os.PathLike,
    *,
    base_model: str | None = None,
    tokenizer: Any = None,
    writer: bool = True,
) -> None:
    """Write the adapter folder of a LoRA model (see the module docstring).

    A sharded (FSDP2) model: every rank calls this (each adapter is gathered whole, a
    collective) and only the rank with `writer=True` writes, the same files as one process."""

    spec: LoRASpec = model.lora_spec
    if base_model is None:
        base_model = getattr(model, "lora_base", None)
    tensors = {k: full_tensor(v).to("cpu") for k, v in adapter_state_dict(model).items()}
    for k in _interleaved(model):
        tensors[k] = interleave(tensors[k], 1)
    # an expert adapter (3-D) in PEFT's 2-D layout
    tensors = {
        k: (_to_peft(k.removesuffix(".weight")[-1], v) if v.dim() == 3 else v).contiguous()
        for k, v in tensors.items()
    }
    if not writer:
        return
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    experts = tuple(dict.fromkeys(w for _, m in lora_experts(model) for w in m.adapted))
    tower = _tower(model)
    adapted = [name for name, _ in lora_modules(model)]
    decoder = [name for name in adapted if name not in tower]
    config = adapter_config(spec, base_model, decoder, experts)
    if isinstance(model, VisionLanguageModel):  # the decoder's projections, and the tower's
        names = "|".join(config["target_modules"])
        parts = [rf"model\.language_model\..*\.({names})"] if names else []
        if any(name in tower for name in adapted):
            parts.append(tower_lora.peft_pattern(tower[n] for n in adapted if n in tower))
        config["target_modules"] = "|".join(f"(?:{p})" for p in parts)
    (path / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2) + "\n")
    write_side_files(path, tokenizer, getattr(model, "generation_config", None))
    if isinstance(model, VisionLanguageModel):  # AutoProcessor loads the step's folder too
        model.write_processor_files(path)


def is_adapter_folder(path: Path) -> bool:
    return (path / ADAPTER_CONFIG).is_file()


def read_adapter_spec(path: str | os.PathLike) -> LoRASpec:
    """The LoRASpec an adapter folder (ours or PEFT's) describes. Targets come from the tensors
    present, which must cover the same projections in every block; PEFT features the native
    LoRA model does not have (DoRA, rsLoRA, per-module ranks, biases, extra trained modules) are
    refused by name."""
    path = Path(path)
    config_file, weights = path / ADAPTER_CONFIG, path / ADAPTER_WEIGHTS
    if not config_file.is_file() or not weights.is_file():
        raise UserError(
            f"{path} is not a LoRA adapter folder ({ADAPTER_CONFIG} and {ADAPTER_WEIGHTS} are "
            "needed); pass a folder written by a LoRA run or by PEFT's save_pretrained"
        )
    cfg = read_json(config_file, "re-export the adapter")
    if not isinstance(cfg, dict) or cfg.get("peft_type") != "LORA" or "r" not in cfg:
        raise UserError(
            f"{config_file} is not a LoRA adapter config (peft_type LORA with r and lora_alpha); "
            "pass a folder written by a LoRA run or by PEFT's save_pretrained"
        )
    numbers = {"r": cfg["r"], "lora_alpha": cfg.get("lora_alpha", 8)}
    numbers["lora_dropout"] = cfg.get("lora_dropout") or 0.0
    for key, value in numbers.items():
        whole = isinstance(value, int) and value >= 1
        ok = whole if key == "r" else isinstance(value, int | float) and value >= 0
        if isinstance(value, bool) or not ok:
            raise UserError(
                f"{config_file}: {key} must be a "
                + ("positive integer" if key == "r" else "non-negative number")
                + f", got {json.dumps(value)[:40]}; re-export the adapter"
            )
    unsupported = {
        "use_dora": bool(cfg.get("use_dora")),
        "use_rslora": bool(cfg.get("use_rslora")),
        "rank_pattern": bool(cfg.get("rank_pattern")),
        "alpha_pattern": bool(cfg.get("alpha_pattern")),
        "bias": cfg.get("bias", "none") != "none",
        "modules_to_save": bool(cfg.get("modules_to_save")),
        "lora_bias": bool(cfg.get("lora_bias")),
    }
    for key, used in unsupported.items():
        if used:
            raise UserError(
                f"{config_file} sets {key}={cfg.get(key)!r}, which compiletune's LoRA does not "
                "support; export the adapter without it"
            )
    with _open(weights) as f:
        names = list(f.keys())
    per_block: dict[str, set[str]] = {}
    experts = _expert_params(cfg)
    tower = {tower_lora.target_name(m) for n in names if (m := _tower_module(n))}
    for name in names:
        if _tower_module(name):
            continue
        module, _, weight = _split_key(name, weights, experts)
        _, block, inside = module.split(".", 2)  # "layers", "3", "attention.wq"
        shorts = _EXPERT_SHORTS[weight] if weight else (_PATH_TO_SHORT[inside],)
        per_block.setdefault(block, set()).update(shorts)
    if not per_block:  # the vision tower's adapters alone
        return LoRASpec(**_numbers(cfg), targets=(), vision=tuple(sorted(tower)))
    if experts:  # a MoE model's dense layers carry no MLP adapters (models/lora.py)
        mlp = {s for w in experts for s in _EXPERT_SHORTS[w]}
        per_block = {b: v | mlp for b, v in per_block.items()}
    # Blocks of one kind carry the same projections; attention and linear-attention layers
    # (Qwen3.5) each have their own, beside the same MLP ones.
    linear = set(LINEAR_ATTENTION_TARGETS)
    mlps = {frozenset(v - linear - _ATTENTION_SHORTS) for v in per_block.values()}
    # Gemma 4's layers may lack k and v projections (keys as values, or an earlier layer's):
    # those count as carrying them
    kv = {"k", "v"} & set().union(*per_block.values())
    attention = {frozenset(v & _ATTENTION_SHORTS | kv) for v in per_block.values()}
    attention -= {frozenset(kv)}
    mixers = {frozenset(v & linear) for v in per_block.values()} - {frozenset()}
    if len(mlps) != 1 or len(attention) > 1 or len(mixers) > 1:
        raise UserError(
            f"{weights}: the blocks carry adapters on different projections; compiletune "
            "applies the same targets to every block"
        )
    # in --lora-targets' terms: a fused projection (Phi-3's qkv_proj) stands for its parts
    union = set().union(*per_block.values())
    present = {p for t in union for p in FUSED_PARTS.get(t, (t,))}
    targets = tuple(t for t in SPEC_TARGETS if t in present)
    return LoRASpec(**_numbers(cfg), targets=targets, vision=tuple(sorted(tower)))


def _numbers(cfg: dict) -> dict[str, Any]:
    """rank, alpha and dropout of an adapter config (checked)."""
    return {
        "rank": int(cfg["r"]),
        "alpha": float(cfg.get("lora_alpha", 8)),  # PEFT's default when absent
        "dropout": float(cfg.get("lora_dropout") or 0.0),
    }


def _tower_module(name: str) -> str | None:
    """The module (as transformers' model names it) of a vision tower's adapter tensor `name`;
    None for any other tensor."""
    module = re.sub(r"\.lora_[AB]\.weight$", "", name.removeprefix(PEFT_PREFIX))
    if name.startswith(PEFT_PREFIX) and module != name and tower_lora.is_tower_module(module):
        return module
    return None


def _open(file: Path) -> Any:
    """`safe_open(file)`; an unreadable file (truncated, not safetensors) is a UserError."""
    try:
        return safe_open(str(file), framework="pt")
    except Exception as e:  # SafetensorError, OSError
        raise UserError(
            f"{file} is not a readable safetensors file ({brief(e)}); it is truncated or "
            "corrupt: copy it again"
        ) from e


def _expert_params(cfg: dict) -> tuple[str, ...]:
    """The stacked expert weights ("w13", "w2", in that order) an adapter config's
    target_parameters adapt (PEFT matches them by suffix: "down_proj" is enough)."""
    listed = cfg.get("target_parameters") or []
    if not isinstance(listed, list):
        return ()
    return tuple(
        w
        for w, full in _EXPERT_PARAMS.items()
        if any(isinstance(t, str) and full.endswith(t) for t in listed)
    )


def _split_key(name: str, file: Path, experts: tuple[str, ...] = ()) -> tuple[str, str, str | None]:
    """`base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight` ->
    (`layers.0.attention.wq`, `A`, None); an expert adapter (`experts`: the config's adapted
    expert weights) -> (`layers.0.feed_forward.experts`, `A`, "w13" | "w2")."""
    if name.startswith(PEFT_PREFIX + VISION_TEXT):  # a vision-language model's decoder
        name = PEFT_PREFIX + "model." + name.removeprefix(PEFT_PREFIX + VISION_TEXT)
    for kind in ("A", "B"):
        suffix = f".lora_{kind}.weight"
        if name.startswith(PEFT_PREFIX) and name.endswith(suffix):
            module = name.removesuffix(suffix)
            m = _PEFT_EXPERTS.fullmatch(module.removeprefix(PEFT_PREFIX))
            if m and experts and (not m.group(2) or len(experts) == 2):
                weight = "w13" if m.group(2) else experts[-1]
                return f"layers.{m.group(1)}.feed_forward.experts", kind, weight
            hf_short = module.rsplit(".", 1)[-1]
            if hf_short in _HF_TO_SHORT:
                try:
                    return native_module_name(module), kind, None
                except UserError:
                    break
    raise UserError(
        f"{file}: tensor {name!r} is not a LoRA A/B weight of a decoder projection; export "
        "adapters on q/k/v/o/gate/up/down only"
    )


@torch.no_grad()
def load_adapter(model: nn.Module, path: str | os.PathLike) -> None:
    """Copy an adapter folder's weights into a LoRA model built with the same spec."""
    path = Path(path)
    saved = read_adapter_spec(path)
    spec: LoRASpec = model.lora_spec
    if _kind(saved) != _kind(spec):
        raise UserError(
            f"{path} holds a rank {saved.rank}, alpha {saved.alpha:g} adapter on "
            f"{targets_text(saved)}, but this run asks for rank {spec.rank}, alpha "
            f"{spec.alpha:g} on {targets_text(spec)}; pass the adapter's --lora-rank, "
            "--lora-alpha and --lora-targets"
        )
    params: dict[tuple[str, str], Tensor] = {}
    for module, m in lora_modules(model):
        params[module, "A"], params[module, "B"] = m.lora_a, m.lora_b
    # a vision tower's adapters by their PEFT module name; a model without the tower (a
    # text-only run or generate) leaves them out: they act on images only
    tower = {peft: native for native, peft in _tower(model).items()}
    for module, m in lora_experts(model):
        for w in m.adapted:
            params[f"{module}:{w}", "A"] = getattr(m, f"lora_a_{w}")
            params[f"{module}:{w}", "B"] = getattr(m, f"lora_b_{w}")
    experts = _expert_params(read_json(path / ADAPTER_CONFIG, "re-export the adapter"))
    loaded = set()
    interleaved = _interleaved(model)
    weights = path / ADAPTER_WEIGHTS
    with _open(weights) as f:
        for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
            if (peft := _tower_module(name)) is not None:
                if not isinstance(model, VisionLanguageModel):
                    continue
                kind = "A" if name.endswith(".lora_A.weight") else "B"
                module, weight = tower.get(peft, peft), None
            else:
                module, kind, weight = _split_key(name, weights, experts)
            module = f"{module}:{weight}" if weight else module
            if (module, kind) not in params:
                raise UserError(
                    f"{path}: adapter {name!r} has no place in this model (it has "
                    f"{model.args.n_layers} layers); use the adapter's base model"
                )
            param = params[module, kind]
            # an expert adapter is stored in PEFT's 2-D layout
            want = _to_peft(kind, param) if weight else param
            dtype = f.get_slice(name).get_dtype()
            if dtype not in ("F64", "F32", "F16", "BF16"):
                raise UserError(
                    f"{weights}: tensor {name!r} is stored as {dtype}; adapter weights are "
                    "floating point: re-export the adapter"
                )
            try:
                tensor = f.get_tensor(name)
            except Exception as e:  # SafetensorError: data cut short
                raise UserError(
                    f"{weights}: cannot read tensor {name!r} ({brief(e)}); the file is truncated "
                    "or corrupt: copy it again"
                ) from e
            if not bool(torch.isfinite(tensor).all()):
                raise UserError(
                    f"{weights}: tensor {name!r} holds NaN or Inf values; use a healthy "
                    "checkpoint (an earlier step_N)"
                )
            if tensor.shape != want.shape:
                raise UserError(
                    f"{path}: {name} has shape {list(tensor.shape)}, the model expects "
                    f"{list(want.shape)}; use the adapter's base model"
                )
            if weight:
                tensor = _from_peft(kind, tensor, tuple(param.shape))
                tensor = deinterleave(tensor, 1) if name in interleaved else tensor
            param.copy_(tensor)
            loaded.add((module, kind))
    missing = [f"{m}.lora_{k}" for m, k in params if (m, k) not in loaded]
    if missing:
        raise UserError(f"{path} lacks adapter weights for {missing[0]}; re-export the adapter")


def save_merged(
    model: nn.Module,
    path: str | os.PathLike,
    *,
    tokenizer: Any = None,
    dtype: torch.dtype | None = None,
    writer: bool = True,
) -> Path:
    """Write `path` as a plain HF model folder with every adapter folded in, atomically (a
    temporary sibling renamed when complete). dtype defaults to the run's --base-dtype.

    A sharded (FSDP2) model: every rank calls this and joins the gathers, one tensor at a time
    (each merged weight is built from its gathered base and adapters); only the rank with
    `writer=True` writes."""

    path = Path(path)

    def write(folder: Path) -> None:
        save_hf(
            model,
            folder,
            dtype=dtype or getattr(model, "lora_base_dtype", None),
            tokenizer=tokenizer,
            merge_lora=True,
            writer=writer,
        )
        faults.point("merge")

    if not writer:
        write(path.parent / f".tmp-{path.name}")  # gathers only; nothing is written
        return path
    return write_folder_atomically(path, write)


def trainable_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def check_resume_kind(checkpoint: Path, spec: LoRASpec | None) -> None:
    """A LoRA run resumes from an adapter checkpoint with the same adapters; a full run from
    weights."""
    if is_adapter_folder(checkpoint) and spec is None:
        raise UserError(
            f"--resume: {checkpoint} is a LoRA checkpoint; pass the run's --lora-rank (and its "
            "other --lora-* flags) to continue it"
        )
    if spec is None:
        return
    if not is_adapter_folder(checkpoint):
        raise UserError(
            f"--resume: {checkpoint} holds full weights, not a LoRA adapter; drop --lora-rank "
            "to continue that run, or start the LoRA run in another --output-dir"
        )
    saved = read_adapter_spec(checkpoint)
    if _kind(saved) != _kind(spec):
        raise UserError(
            f"--resume: {checkpoint} has rank {saved.rank}, alpha {saved.alpha:g} adapters on "
            f"{targets_text(saved)}; pass --lora-rank {saved.rank} --lora-alpha "
            f"{saved.alpha:g} --lora-targets {targets_text(saved)}"
        )


def _kind(spec: LoRASpec) -> tuple:
    """What a checkpoint's adapters and a run's must share."""
    return spec.rank, spec.alpha, spec.targets, spec.vision
