"""HF config.json <-> ModelArgs, through the family table (models/families.py).

Reads both config styles: transformers 4.x (`rope_theta` + `rope_scaling`, `torch_dtype`) and
5.x (`rope_parameters` holding `rope_theta`, `dtype`). Writes the 4.x keys, which both read,
plus the 5.x keys when the original config used them. Every field is type-checked first
(`check_hf_config`), so a malformed config is one line, not a traceback.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from compiletune import hub
from compiletune.errors import UserError

from .args import ROPE_TYPES, ModelArgs, RopeScaling
from .families import BY_ARCHITECTURE, FAMILIES, MOE_FAMILIES, Family

ARCHITECTURES = {arch: f.model_type for arch, f in BY_ARCHITECTURE.items()}
_FAMILY_ARCH = {name: f.architecture for name, f in FAMILIES.items()}
# Multimodal checkpoints whose text model is one of the above (weights renamed at load).
_TEXT_OF = {arch: f.architecture for f in FAMILIES.values() for arch in f.multimodal}
# Expert-count fields: set in a config of a family without MoE support, they are refused.
_MOE_FIELDS = ("num_experts", "num_local_experts", "n_routed_experts")
_GELU_TANH = ("gelu_pytorch_tanh", "gelu_tanh", "gelu_new")
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def brief(error: BaseException, limit: int = 200) -> str:
    """An exception's message as one short line (for a UserError that quotes it)."""
    text = " ".join(str(error).split()) or type(error).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."


def read_json(path: Path, fix: str) -> Any:
    """A JSON file a user gave us (a BOM allowed); unreadable or invalid is one line ending in
    `fix`."""
    try:
        return json.loads(path.read_bytes().decode("utf-8-sig"))
    except (OSError, ValueError, RecursionError) as e:
        raise UserError(f"{path} is not valid JSON ({brief(e)}); {fix}") from e


def resolve_model_path(
    name: str | os.PathLike, flag: str = "--model-dir", weights: bool = True
) -> Path:
    """The local folder `name` stands for: the path itself when it exists, else (for a hub spec
    such as `HuggingFaceTB/SmolLM2-135M` or `ORG/NAME@REVISION`) its snapshot in the HF cache,
    downloaded on first use (`compiletune.hub`; `weights=False`: a tokenizer's files alone).
    Anything else is refused in one line. Every loader of a model or tokenizer folder resolves
    its argument through this."""
    path = Path(name)
    if path.exists():
        return path
    folder = hub.model_folder(str(name), flag, weights)
    if folder is not None:
        return folder
    raise UserError(hub.no_model_folder(name, flag))


def load_hf_config(path: str | os.PathLike, flag: str = "--model-dir") -> dict:
    """Read and check `config.json` of a checkpoint folder (or the file itself), the folder
    that `flag` names (in the messages).

    The folder is resolved by `resolve_model_path`. The file must be a JSON object whose
    fields have the types transformers gives them and describe a supported decoder
    (`args_from_hf_config` accepts it); anything else is one UserError naming the file."""
    path = Path(path)
    if path.is_file() and path.name != "config.json":
        raise UserError(f"{flag} {path} is a file; pass the model folder that holds config.json")
    if not path.is_file():
        path = resolve_model_path(path, flag, weights=False)  # config.json is enough here
    file = path if path.is_file() else path / "config.json"
    if not file.is_file():
        hint = ""
        if (path / "adapter_config.json").is_file():
            hint = " (it is a LoRA adapter folder: its base model holds config.json)"
        raise UserError(
            f"{path} has no config.json{hint}; pass an HF model folder (save_pretrained output)"
        )
    cfg = read_json(file, "re-export the checkpoint's config")
    if not isinstance(cfg, dict):
        raise UserError(
            f"{file} holds a JSON {type(cfg).__name__}, not an object; re-export the "
            "checkpoint's config"
        )
    try:
        check_hf_config(cfg)
        args_from_hf_config(cfg)
    except UserError as e:
        msg = str(e)
        raise UserError(
            f"{file}{msg.removeprefix('config.json')}"
            if msg.startswith("config.json")
            else f"{file}: {msg}"
        ) from e
    return cfg


# Fields whose JSON type transformers fixes: checked before any is used.
_POSITIVE_INTS = (
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "vocab_size",
    "max_position_embeddings",
    "head_dim",
    "sliding_window",
    "sliding_window_pattern",
    "original_max_position_embeddings",
    "num_experts",
    "num_local_experts",
    "num_experts_per_tok",
    "moe_intermediate_size",
    "decoder_sparse_step",
    "global_head_dim",
    "num_global_key_value_heads",
    "vocab_size_per_layer_input",
    # the families' own fields (models/families/): transformers' strict configs refuse
    # a string here, so ours must too, before a later reader (the tokenizer's) trips on it
    "n_routed_experts",
    "n_group",
    "topk_group",
    "top_k_experts",
    "kv_lora_rank",
    "q_lora_rank",
    "qk_rope_head_dim",
    "qk_nope_head_dim",
    "v_head_dim",
    "linear_num_key_heads",
    "linear_num_value_heads",
    "linear_key_head_dim",
    "linear_value_head_dim",
    "linear_conv_kernel_dim",
    "full_attention_interval",
    "no_rope_layer_interval",
)
# Counts that may be 0.
_COUNTS = (
    "first_k_dense_replace",
    "n_shared_experts",
    "num_kv_shared_layers",
    "hidden_size_per_layer_input",
    "shared_expert_intermediate_size",
)
_NUMBERS = (
    "rms_norm_eps",
    "rope_theta",
    "partial_rotary_factor",
    "query_pre_attn_scalar",
    "attn_logit_softcapping",
    "final_logit_softcapping",
    "rope_local_base_freq",
    "router_aux_loss_coef",
    "router_jitter_noise",
    "swiglu_limit",
    "swiglu_alpha",
    "routed_scaling_factor",
)
_BOOLS = (
    "tie_word_embeddings",
    "attention_bias",
    "mlp_bias",
    "use_sliding_window",
    "norm_topk_prob",
    "attention_k_eq_v",
    "use_double_wide_mlp",
    "enable_moe_block",
)
_STRINGS = ("hidden_act", "hidden_activation", "model_type", "torch_dtype", "dtype")
_ROPE_NUMBERS = (
    "factor",
    "low_freq_factor",
    "high_freq_factor",
    "original_max_position_embeddings",
    "beta_fast",
    "beta_slow",
    "attention_factor",
    "rope_theta",
    "partial_rotary_factor",
)


def _json_type(value: Any) -> str:
    names = {bool: "a boolean", int: "an integer", float: "a number", str: "a string"}
    names |= {list: "a list", dict: "an object", type(None): "null"}
    return names.get(type(value), type(value).__name__)


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _check_rope(rope: Any, key: str) -> None:
    if rope is None:
        return
    if not isinstance(rope, dict):
        raise UserError(f"config.json {key!r} must be an object or null, got {_json_type(rope)}")
    if rope and all(isinstance(v, dict) for v in rope.values()):  # per layer type
        for kind, sub in rope.items():
            _check_rope(sub, f"{key}.{kind}")
        return
    for name in ("rope_type", "type"):
        if rope.get(name) is not None and not isinstance(rope[name], str):
            raise UserError(
                f"config.json {key}.{name} must be a string, got {_json_type(rope[name])}"
            )
    for name in _ROPE_NUMBERS:
        if rope.get(name) is not None and not _is_number(rope[name]):
            raise UserError(
                f"config.json {key}.{name} must be a number, got {_json_type(rope[name])}"
            )
    for name in ("short_factor", "long_factor"):
        value = rope.get(name)
        if value is not None and not (
            isinstance(value, list) and all(_is_number(v) for v in value)
        ):
            raise UserError(f"config.json {key}.{name} must be a list of numbers")


def check_hf_config(cfg: dict) -> None:
    """Refuse a config.json dict whose known fields have the wrong JSON type or disagree
    (heads that do not divide the width, layer_types of another length than the layers)."""
    if "architectures" in cfg and cfg["architectures"] is not None:
        archs = cfg["architectures"]
        if not (isinstance(archs, list) and all(isinstance(a, str) for a in archs)):
            raise UserError(
                "config.json 'architectures' must be a list of strings, e.g. [\"LlamaForCausalLM\"]"
            )
    if "text_config" in cfg and not isinstance(cfg["text_config"], dict | None):
        raise UserError("config.json 'text_config' must be an object")
    sub = cfg.get("text_config")
    for c in (cfg, sub) if isinstance(sub, dict) else (cfg,):
        _check_field_types(c)
    text = text_config(cfg)
    layers, heads = text.get("num_hidden_layers"), text.get("num_attention_heads")
    kv, dim = text.get("num_key_value_heads"), text.get("hidden_size")
    if heads and kv and heads % kv:
        raise UserError(
            f"config.json num_attention_heads {heads} is not a multiple of num_key_value_heads "
            f"{kv}; use the config.json that came with the weights"
        )
    if heads and dim and not text.get("head_dim") and dim % heads:
        raise UserError(
            f"config.json hidden_size {dim} is not a multiple of num_attention_heads {heads} "
            "and there is no head_dim; use the config.json that came with the weights"
        )
    listed = text.get("layer_types")
    if listed is not None and layers and len(listed) != layers:
        raise UserError(
            f"config.json num_hidden_layers is {layers} but layer_types lists {len(listed)} "
            "layers; make them agree (one entry per layer)"
        )


def _check_field_types(cfg: dict) -> None:
    def bad(key: str, want: str) -> UserError:
        return UserError(
            f"config.json {key!r} must be {want}, got {_json_type(cfg[key])} "
            f"{json.dumps(cfg[key])[:40]}; fix the field or re-export the config"
        )

    for key in _POSITIVE_INTS:
        value = cfg.get(key)
        if value is not None and not (
            isinstance(value, int) and not isinstance(value, bool) and value >= 1
        ):
            raise bad(key, "a positive integer")
    for key in _COUNTS:
        value = cfg.get(key)
        if value is not None and not (
            isinstance(value, int) and not isinstance(value, bool) and value >= 0
        ):
            raise bad(key, "a non-negative integer")
    for key in _NUMBERS:
        if cfg.get(key) is not None and not _is_number(cfg[key]):
            raise bad(key, "a number")
    for key in _BOOLS:
        if cfg.get(key) is not None and not isinstance(cfg[key], bool):
            raise bad(key, "true or false")
    for key in _STRINGS:
        if cfg.get(key) is not None and not isinstance(cfg[key], str):
            raise bad(key, "a string")
    for key in ("rms_norm_eps", "rope_theta"):
        if cfg.get(key) is not None and cfg[key] <= 0:
            raise bad(key, "a positive number")
    listed = cfg.get("layer_types")
    if listed is not None and not (
        isinstance(listed, list) and all(isinstance(t, str) for t in listed)
    ):
        raise bad("layer_types", "a list of strings")
    for key in ("rope_scaling", "rope_parameters"):
        _check_rope(cfg.get(key), key)


def text_config(cfg: dict) -> dict:
    """The decoder's config: `cfg` itself, or the `text_config` of a multimodal checkpoint whose
    text weights map onto a supported decoder (`Family.multimodal`)."""
    archs = cfg.get("architectures") or []
    if not archs or archs[0] not in _TEXT_OF:
        return cfg
    text = cfg.get("text_config")
    if not isinstance(text, dict):
        raise UserError(
            f"config.json architecture {archs[0]!r} has no 'text_config' object; re-export the "
            "checkpoint's config"
        )
    out = {k: v for k, v in text.items() if k != "architectures"}
    for key in ("torch_dtype", "dtype"):
        if key in cfg:
            out.setdefault(key, cfg[key])
    out["architectures"] = [_TEXT_OF[archs[0]]]
    out["tie_word_embeddings"] = text.get(
        "tie_word_embeddings", cfg.get("tie_word_embeddings", True)
    )
    return out


def _family(cfg: dict) -> str:
    archs = cfg.get("architectures") or []
    if archs:
        arch = archs[0]
        if arch not in ARCHITECTURES:
            moe = " (a mixture-of-experts model)" if "Moe" in arch or "Mixtral" in arch else ""
            raise UserError(
                f"config.json architectures: {arch!r}{moe} is not supported; use one of "
                f"{', '.join(ARCHITECTURES)}"
            )
        return ARCHITECTURES[arch]
    model_type = cfg.get("model_type")
    if model_type in _FAMILY_ARCH:
        return model_type
    raise UserError(
        "config.json has no 'architectures' field (and no known 'model_type'); "
        'add e.g. "architectures": ["LlamaForCausalLM"]'
    )


def _rope_params(cfg: dict, kind: str = "full_attention") -> dict:
    """The rope dict in either config style ({} when absent). 5.x gives `rope_scaling` priority.
    A dict nested per layer type (5.x) gives the entry of `kind`."""
    rope = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
    if not isinstance(rope, dict):
        raise UserError(f"config.json 'rope_scaling' must be an object or null, got {rope!r}")
    if "full_attention" in rope and isinstance(rope["full_attention"], dict):
        rope = rope.get(kind) or {}  # nested per layer type
    return rope


def dtype_from_config(cfg: dict) -> torch.dtype | None:
    name = cfg.get("torch_dtype") or cfg.get("dtype")
    if name is None:
        return None
    name = str(name).removeprefix("torch.")
    if name not in _DTYPES:
        raise UserError(
            f"config.json dtype {name!r} is not supported; use float32, float16 or bfloat16"
        )
    return _DTYPES[name]


def _rope_scaling(rope: dict, cfg: dict, max_seq_len: int) -> RopeScaling | None:
    """RopeScaling for an HF rope dict; an unsupported type or option is refused by name."""
    rope_type = rope.get("rope_type", rope.get("type", "default")) or "default"
    if rope_type == "default":
        return None
    if rope_type not in ROPE_TYPES:
        raise UserError(
            f"config.json rope_scaling.rope_type {rope_type!r} is not supported; use one of "
            f"default, {', '.join(ROPE_TYPES)}"
        )
    for key in ("mscale", "mscale_all_dim", "long_mscale", "short_mscale"):
        if rope.get(key) and not (rope_type == "yarn" and key in ("mscale", "mscale_all_dim")):
            raise UserError(f"config.json rope_scaling.{key} is not supported; remove it")
    # transformers gives the top-level key priority (a family may keep it there, with a class
    # default of its own: `Family.defaults`)
    top = cfg.get("original_max_position_embeddings")
    if top is None:
        top = FAMILIES[_family(cfg)].defaults.get("original_max_position_embeddings")
    original = int(top or rope.get("original_max_position_embeddings") or max_seq_len)
    if rope_type in ("linear", "proportional"):  # unused by these: the canonical default
        original = RopeScaling.original_max_position_embeddings
    needed = {
        "llama3": ("factor", "low_freq_factor", "high_freq_factor"),
        "linear": ("factor",),
        "yarn": (),
        "longrope": ("short_factor", "long_factor"),
        "proportional": (),
    }[rope_type]
    missing = [k for k in needed if rope.get(k) is None]
    if missing:
        raise UserError(
            f"config.json rope_scaling ({rope_type}) is missing the field {missing[0]!r}; add it"
        )
    factor = rope.get("factor") or max_seq_len / original
    if rope_type == "proportional":
        factor = rope.get("factor", 1.0)
    attention_factor = rope.get("attention_factor")
    return RopeScaling(
        factor=float(factor),
        low_freq_factor=float(rope.get("low_freq_factor", 1.0)),
        high_freq_factor=float(rope.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=original,
        rope_type=rope_type,
        beta_fast=float(rope.get("beta_fast") or 32.0),
        beta_slow=float(rope.get("beta_slow") or 1.0),
        truncate=bool(rope.get("truncate", True)),
        attention_factor=None if attention_factor is None else float(attention_factor),
        short_factor=tuple(map(float, rope["short_factor"])) if "short_factor" in rope else None,
        long_factor=tuple(map(float, rope["long_factor"])) if "long_factor" in rope else None,
        partial=float(rope.get("partial_rotary_factor", 1.0))
        if rope_type == "proportional"
        else 1.0,
        mscale=float(rope.get("mscale") or 0.0),
        mscale_all_dim=float(rope.get("mscale_all_dim") or 0.0),
    )


def _layer_types(cfg: dict, family: Family, n_layers: int) -> tuple[str, ...] | None:
    """Per-layer "full"/"sliding"/"linear" for the families that mix them, else None."""
    listed = cfg.get("layer_types")
    if listed:
        kinds = ("full_attention", "sliding_attention")
        kinds += ("linear_attention",) if family.linear_layers else ()
        if len(listed) != n_layers or any(t not in kinds for t in listed):
            raise UserError(
                f"config.json layer_types must list one of {', '.join(map(repr, kinds))} for "
                f"each of the {n_layers} layers"
            )
        return tuple(t.removesuffix("_attention") for t in listed)
    return family.layer_kinds(cfg, n_layers) if family.layer_kinds else None


def _check_unsupported(cfg: dict, fam: Family, get: Callable[..., Any]) -> None:
    """Config fields that would change the model in a way the decoder does not have."""
    for key in _MOE_FIELDS:
        if cfg.get(key) and not fam.moe:
            raise UserError(
                f"config.json sets {key}: {cfg[key]} (mixture of experts) for "
                f"{fam.model_type}, which has no MoE form; MoE is supported for "
                f"{', '.join(MOE_FAMILIES)}"
            )
    if get("mlp_bias", False):
        raise UserError(
            "config.json sets mlp_bias: true, which is not supported; only bias-free MLPs are"
        )
    if not (fam.qkv_bias or fam.bias_flag) and get("attention_bias", False):
        # attention_bias also puts a bias on o_proj there, which the decoder does not have.
        raise UserError(
            f"config.json sets attention_bias: true for {fam.model_type}, which is not "
            "supported; set it false"
        )
    if fam.qwen_window_flag and get("use_sliding_window", False):
        raise UserError(
            "config.json sets use_sliding_window: true, which is not supported; set it false "
            "(Qwen checkpoints ship with it false)"
        )
    quant = cfg.get("quantization_config")
    method = quant.get("quant_method") if isinstance(quant, dict) else quant
    if method is not None and method not in fam.quantizations and method != "fp8":
        raise UserError(
            f"config.json quantization_config: {json.dumps(method)} weights are not read; "
            "gpt-oss's MXFP4 experts and block-scaled fp8 weights are (dequantized as they "
            "load). Dequantize the checkpoint to bf16 first, or use --quantize-base nf4 on a "
            "bf16 one"
        )
    both = cfg.get("use_bidirectional_attention")
    if fam.gemma and both not in (None, False, "vision"):  # "vision": image tokens only
        raise UserError(
            f"config.json sets use_bidirectional_attention: {json.dumps(both)} (an encoder), "
            "which is not supported; use a causal checkpoint"
        )


def _activation(cfg: dict, fam: Family, get: Callable[..., Any]) -> str:
    act_key = "hidden_activation" if fam.gemma else "hidden_act"
    act = get(act_key) or cfg.get("hidden_act") or ("gelu_pytorch_tanh" if fam.gemma else "silu")
    if act not in ("silu", *_GELU_TANH):
        raise UserError(
            f"config.json {act_key} {act!r} is not supported; use 'silu' (SwiGLU) or "
            "'gelu_pytorch_tanh' (GeGLU)"
        )
    return "silu" if act == "silu" else "gelu_tanh"


def _rotary(cfg: dict, get: Callable[..., Any], head_dim: int) -> dict[str, Any]:
    """The rope fields of ModelArgs: base, scaling, positions, rotary dimension (checked)."""
    rope = _rope_params(cfg)
    partial = rope.get("partial_rotary_factor", get("partial_rotary_factor", 1.0))
    max_seq_len = int(get("max_position_embeddings"))
    rotary_dim = int(head_dim * partial)
    if not 0 < rotary_dim <= head_dim or rotary_dim % 2:
        raise UserError(
            f"config.json partial_rotary_factor {partial} gives a rotary dimension of "
            f"{rotary_dim}, which must be even and within head_dim {head_dim}"
        )
    rope_scaling = _rope_scaling(rope, cfg, max_seq_len)
    if rope_scaling is not None and rope_scaling.rope_type == "longrope":
        for key in ("short_factor", "long_factor"):
            if len(getattr(rope_scaling, key)) != rotary_dim // 2:
                raise UserError(
                    f"config.json rope_scaling.{key} has {len(getattr(rope_scaling, key))} "
                    f"values; the rotary dimension {rotary_dim} needs {rotary_dim // 2}"
                )
    return dict(
        rope_theta=float(rope.get("rope_theta", get("rope_theta", 10000.0))),
        rope_scaling=rope_scaling,
        max_seq_len=max_seq_len,
        rotary_dim=rotary_dim if rotary_dim != head_dim else None,
    )


def args_from_hf_config(cfg: dict) -> ModelArgs:
    """ModelArgs for an HF config.json dict of a supported architecture (models/families.py)."""
    cfg = text_config(cfg)
    fam = FAMILIES[_family(cfg)]
    defaults = fam.defaults

    def get(key: str, default: Any = None, required: bool = False) -> Any:
        value = cfg.get(key)
        if value is None:
            if required and key not in defaults:
                raise UserError(
                    f"config.json is missing the field {key!r}; add it or re-export the config"
                )
            return defaults.get(key, default)
        return value

    _check_unsupported(cfg, fam, get)
    dim = get("hidden_size", required=True)
    n_heads = get("num_attention_heads", required=True)
    n_layers = get("num_hidden_layers", required=True)
    head_dim = get("head_dim") or dim // n_heads
    window = cfg.get("sliding_window", defaults.get("sliding_window")) if fam.windows else None
    if fam.window_flag and not get("use_sliding_window", False):
        window = None
    layer_types = _layer_types(cfg, fam, n_layers) if window or fam.linear_layers else None
    if layer_types is not None and not {"sliding", "linear"} & set(layer_types):
        window, layer_types = None, None
    local_theta = None
    if fam.local_rope:
        local_theta = _local_theta(cfg, get)
    qpas = get("query_pre_attn_scalar") if fam.gemma else None

    def softcap(key: str) -> float | None:
        value = cfg.get(key, defaults.get(key))
        return float(value) if value else None

    fields: dict[str, Any] = dict(
        dim=dim,
        n_layers=n_layers,
        n_heads=n_heads,
        n_kv_heads=get("num_key_value_heads", n_heads),
        vocab_size=get("vocab_size", required=True),
        ffn_dim=get("intermediate_size", required=not fam.moe),
        head_dim=head_dim if head_dim != dim // n_heads else None,
        norm_eps=float(get("rms_norm_eps")),
        qkv_bias=fam.qkv_bias or (fam.bias_flag and bool(get("attention_bias", False))),
        tie_embeddings=bool(get("tie_word_embeddings", False)),
        pad_id=_pad_id(cfg, defaults, get("vocab_size", required=True)),
        sliding_window=int(window) if window else None,
        layer_types=layer_types,
        family=fam.model_type,
        qk_norm=fam.qk_norm,
        norm_plus_one=fam.gemma or fam.linear_layers,
        embed_scale=fam.gemma,
        activation=_activation(cfg, fam, get),
        attn_output_gate=fam.linear_layers,
        sandwich_norms=fam.gemma or fam.olmo,
        pre_norms=not fam.olmo,
        norm_weight_fp32=fam.olmo,
        qk_norm_whole=fam.olmo,
        query_pre_attn_scalar=float(qpas) if qpas is not None else None,
        attn_softcap=softcap("attn_logit_softcapping"),
        final_softcap=softcap("final_logit_softcapping"),
        local_rope_theta=local_theta,
        fused_projections=fam.fused_projections,
        **_rotary(cfg, get, head_dim),
    )
    # the family's own fields (a hook may also settle a shared one, such as ffn_dim)
    fields.update(fam.read_moe(cfg, n_layers, get) if fam.read_moe else {})
    fields.update(fam.read_extra(cfg, n_layers, get) if fam.read_extra else {})
    return ModelArgs(**fields)


def _pad_id(cfg: dict, defaults: dict[str, Any], vocab_size: int) -> int | None:
    """The pad token transformers makes its embedding's padding_idx: config.json's
    pad_token_id, the class default when the key is absent (`Family.defaults`), none when it is null
    or outside the vocabulary (transformers would refuse such a model; the ids are the
    tokenizer's business then)."""
    pad = cfg["pad_token_id"] if "pad_token_id" in cfg else defaults.get("pad_token_id")
    if isinstance(pad, int) and not isinstance(pad, bool) and 0 <= pad < vocab_size:
        return pad
    return None


def _local_theta(cfg: dict, get: Callable[..., Any]) -> float:
    """The rope base of sliding layers (`Family.local_rope`): the config's sliding_attention
    entry, else rope_local_base_freq, else the model's base. Those layers take no scaling:
    a sliding entry that asks for one is refused."""
    nested = [
        r
        for r in (cfg.get("rope_parameters"), cfg.get("rope_scaling"))
        if isinstance(r, dict) and isinstance(r.get("full_attention"), dict)
    ]  # per layer type (5.x)
    local = (nested[0].get("sliding_attention") or {}) if nested else {}
    if (local.get("rope_type") or "default") != "default":
        raise UserError(
            f"config.json rope_parameters.sliding_attention.rope_type {local['rope_type']!r} "
            "is not supported; sliding layers take the default rope"
        )
    theta = (
        local.get("rope_theta")
        or get("rope_local_base_freq")
        or _rope_params(cfg).get("rope_theta")
    )
    return float(theta or get("rope_theta"))


def _rope_dict(rs: RopeScaling | None) -> dict | None:
    """The HF rope_scaling dict of `rs` (None without scaling)."""
    if rs is None:
        return None
    out: dict[str, Any] = {"rope_type": rs.rope_type}
    if rs.rope_type == "longrope":
        out.update(short_factor=list(rs.short_factor), long_factor=list(rs.long_factor))
    elif rs.rope_type != "proportional" or rs.factor != 1.0:
        out["factor"] = rs.factor
    if rs.rope_type == "proportional":
        out["partial_rotary_factor"] = rs.partial
    if rs.rope_type in ("llama3", "yarn", "longrope"):
        out["original_max_position_embeddings"] = rs.original_max_position_embeddings
    if rs.rope_type == "llama3":
        out.update(low_freq_factor=rs.low_freq_factor, high_freq_factor=rs.high_freq_factor)
    if rs.rope_type == "yarn":
        out.update(beta_fast=rs.beta_fast, beta_slow=rs.beta_slow, truncate=rs.truncate)
        if rs.mscale or rs.mscale_all_dim:
            out.update(mscale=rs.mscale, mscale_all_dim=rs.mscale_all_dim)
    if rs.attention_factor is not None:
        out["attention_factor"] = rs.attention_factor
    return out


def _int_if_whole(x: float | None) -> float | int | None:
    """HF types query_pre_attn_scalar as int (strictly, in 5.x) but configs may hold floats."""
    return int(x) if x is not None and float(x).is_integer() else x


def _rope_config(args: ModelArgs, fam: Family, cfg: dict, rope_scaling: dict | None) -> None:
    """The rope keys of `cfg`, in both config styles where the base has the 5.x one."""
    full_rope = {"rope_type": "default", "rope_theta": args.rope_theta, **(rope_scaling or {})}
    if args.rotary_dim is not None:
        cfg["partial_rotary_factor"] = args.rotary_dim / args.hd
        full_rope["partial_rotary_factor"] = cfg["partial_rotary_factor"]
    if "rope_parameters" in cfg or fam.local_rope:  # 5.x style: keep it in sync
        cfg["rope_parameters"] = full_rope
    if fam.local_rope:
        local = {"rope_type": "default", "rope_theta": args.local_rope_theta}
        cfg["rope_parameters"] = {"full_attention": full_rope, "sliding_attention": local}
        if fam.gemma:
            cfg["rope_local_base_freq"] = args.local_rope_theta


def _dense_with_qkv_bias() -> str:
    """The dense families whose q/k/v projections always have biases, quoted."""
    return ", ".join(repr(n) for n, f in FAMILIES.items() if f.qkv_bias and not f.moe)


def hf_config_from_args(args: ModelArgs, dtype: torch.dtype, base: dict | None = None) -> dict:
    """A config.json dict that transformers (4.45+ and 5.x) loads as the same model.

    With `base` (the checkpoint's original config), its other fields (token ids, etc.) are kept.
    A multimodal base (`Family.multimodal`) is written as its text model.
    """
    fam = FAMILIES.get(args.family)
    if fam is None:
        raise UserError(
            f"model family {args.family!r} cannot be saved; use one of {', '.join(FAMILIES)}"
        )
    if args.qkv_bias != fam.qkv_bias and not fam.bias_flag:
        raise UserError(
            f"family {fam.model_type!r} with qkv_bias={args.qkv_bias} has no HF architecture; "
            f"q/k/v bias is only saveable as family {_dense_with_qkv_bias()}"
        )
    if args.n_experts and not fam.moe:
        raise UserError(
            f"family {fam.model_type!r} has no MoE checkpoint; use one of {', '.join(MOE_FAMILIES)}"
        )
    dtype_name = str(dtype).removeprefix("torch.")
    cfg = dict(text_config(base) if base else {})
    for key in ("rope_scaling", "rope_theta", "torch_dtype", "sliding_window_pattern"):
        cfg.pop(key, None)
    cfg.pop("quantization_config", None)  # written dense (a quantized source was dequantized)
    rope_scaling = _rope_dict(args.rope_scaling)
    cfg.update(
        architectures=[fam.architecture],
        model_type=fam.model_type,
        hidden_size=args.dim,
        intermediate_size=args.ffn_dim,
        num_hidden_layers=args.n_layers,
        num_attention_heads=args.n_heads,
        num_key_value_heads=args.n_kv_heads,
        head_dim=args.hd,
        hidden_act="silu" if args.activation == "silu" else "gelu_pytorch_tanh",
        rms_norm_eps=args.norm_eps,
        rope_theta=args.rope_theta,
        rope_scaling=rope_scaling,
        max_position_embeddings=args.max_seq_len,
        vocab_size=args.vocab_size,
        tie_word_embeddings=args.tie_embeddings,
        torch_dtype=dtype_name,
        sliding_window=args.sliding_window,
    )
    _rope_config(args, fam, cfg, rope_scaling)
    for key in ("pad_token_id", "bos_token_id", "eos_token_id"):
        # not transformers' per-class defaults (a class's pad id may be outside a small vocab):
        # the tokenizer's ids go into generation_config.json (generation_config.py); the pad id
        # the model was read with stays, since transformers makes it the embedding's padding_idx
        cfg.setdefault(key, args.pad_id if key == "pad_token_id" else None)
    if args.layer_types is not None or fam.layer_kinds or "layer_types" in cfg:
        cfg["layer_types"] = [f"{args.layer_kind(i)}_attention" for i in range(args.n_layers)]
    if "dtype" in cfg:
        cfg["dtype"] = dtype_name
    if fam.gemma:
        cfg.update(
            hidden_activation=cfg["hidden_act"],
            query_pre_attn_scalar=_int_if_whole(args.query_pre_attn_scalar),
            attn_logit_softcapping=args.attn_softcap,
            final_logit_softcapping=args.final_softcap,
        )
    if fam.writes_attention_bias:
        cfg.update(attention_bias=False)
    if fam.writes_mlp_bias:
        cfg.update(mlp_bias=False)
    if fam.write_moe is not None:
        fam.write_moe(args, cfg)
    if fam.qwen_window_flag:
        cfg["use_sliding_window"] = False
        cfg.setdefault("max_window_layers", args.n_layers)
    if fam.write_extra is not None:
        fam.write_extra(args, cfg)
    return cfg
