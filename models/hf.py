"""HF checkpoints <-> native models: config.json mapping, weight names, safetensors I/O.

Native parameter names differ from HF names by renaming only (the decoder uses HF's rope
layout), so the mapping is a table. Loading goes tensor by tensor through `safe_open` into a
model allocated once; saving writes one shard at a time. Neither ever holds two full copies of
the weights.

Reads both config styles: transformers 4.x (`rope_theta` + `rope_scaling`, `torch_dtype`) and
5.x (`rope_parameters` holding `rope_theta`, `dtype`). Writes the 4.x keys, which both read,
plus the 5.x keys when the original config used them.
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import Tensor, nn

from compiletune import faults
from compiletune.distributed import full_tensor
from compiletune.errors import UserError

from .decoder import ROPE_TYPES, ModelArgs, RopeScaling, Transformer, TransformerBlock
from .lora import dense_tensors
from .names import strip_wrappers

# --- names -------------------------------------------------------------------------------

# native name <-> HF name for the tensors outside the blocks
_GLOBAL_NAMES = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
# native suffix <-> HF suffix inside block i ("layers.{i}." <-> "model.layers.{i}."). A model has
# only the tensors its ModelArgs give it (q/k norms: Qwen3; wqkv and w13: Phi-3's fused ones).
_BLOCK_NAMES = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wq.bias": "self_attn.q_proj.bias",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wk.bias": "self_attn.k_proj.bias",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wv.bias": "self_attn.v_proj.bias",
    "attention.wqkv.weight": "self_attn.qkv_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "attention.q_norm.weight": "self_attn.q_norm.weight",
    "attention.k_norm.weight": "self_attn.k_norm.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "feed_forward.w13.weight": "mlp.gate_up_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
# Gemma's four norms: HF's post_attention_layernorm is the one *after* attention there.
_GEMMA_BLOCK_NAMES = {
    **_BLOCK_NAMES,
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "post_ffn_norm.weight": "post_feedforward_layernorm.weight",
}
_NATIVE_BLOCK = re.compile(r"layers\.(\d+)\.(.+)")
_HF_BLOCK = re.compile(r"model\.layers\.(\d+)\.(.+)")


# MoE blocks: the router, and the experts the hub stores one tensor per expert and projection:
# (module path of the experts, names of gate, up and down); native experts.w13 holds gate and
# up of every expert, experts.w2 down (models/moe.py).
_ROUTER_NAMES = {"qwen3_moe": "mlp.gate.weight", "mixtral": "block_sparse_moe.gate.weight"}
_EXPERT_NAMES = {
    "qwen3_moe": ("mlp.experts", ("gate_proj", "up_proj", "down_proj")),
    "mixtral": ("block_sparse_moe.experts", ("w1", "w3", "w2")),
}
_NATIVE_EXPERTS = ("feed_forward.experts.w13", "feed_forward.experts.w2")
_GLOBAL_NAMES_INV = {v: k for k, v in _GLOBAL_NAMES.items()}


def _block_names(family: str) -> dict[str, str]:
    if family.startswith("gemma"):
        return _GEMMA_BLOCK_NAMES
    if family in _ROUTER_NAMES:
        return {**_BLOCK_NAMES, "feed_forward.router.weight": _ROUTER_NAMES[family]}
    return _BLOCK_NAMES


def _block_names_inv(family: str) -> dict[str, str]:
    return {v: k for k, v in _block_names(family).items()}


def to_hf_name(native: str, family: str = "llama") -> str:
    """`layers.3.attention.wq.weight` -> `model.layers.3.self_attn.q_proj.weight`."""
    native = strip_wrappers(native)
    if native in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[native]
    m = _NATIVE_BLOCK.fullmatch(native)
    names = _block_names(family)
    if m and m.group(2) in names:
        return f"model.layers.{m.group(1)}.{names[m.group(2)]}"
    raise UserError(
        f"parameter {native!r} has no HF name; only compiletune decoder models can be saved"
    )


def to_native_name(hf: str, family: str = "llama") -> str:
    """`model.layers.3.mlp.gate_proj.weight` -> `layers.3.feed_forward.w1.weight`."""
    if hf in _GLOBAL_NAMES_INV:
        return _GLOBAL_NAMES_INV[hf]
    m = _HF_BLOCK.fullmatch(hf)
    inverse = _block_names_inv(family)
    if m and m.group(2) in inverse:
        return f"layers.{m.group(1)}.{inverse[m.group(2)]}"
    if m and family in _EXPERT_NAMES:
        prefix, (gate, up, down) = _EXPERT_NAMES[family]
        e = re.fullmatch(re.escape(prefix) + r"\.\d+\.(\w+)\.weight", m.group(2))
        if e and e.group(1) in (gate, up, down):
            return f"layers.{m.group(1)}.{_NATIVE_EXPERTS[e.group(1) == down]}"
    raise UserError(
        f"checkpoint tensor {hf!r} is not part of a supported decoder "
        f"({', '.join(_ARCHITECTURES)}); use a checkpoint of a supported architecture"
    )


Index = tuple[int | slice, ...]


def hf_pieces(
    native: str, shape: tuple[int, ...], family: str = "llama"
) -> list[tuple[str, Index, tuple[int, ...]]]:
    """The HF tensors a native tensor is stored as: (HF name, index into the native tensor, the
    piece's shape). One piece, the whole tensor, except for stacked experts, which the hub keeps
    as one tensor per expert and projection: w13 [E, 2F, d] -> gate and up [F, d] of each expert
    (rows :F and F:), w2 [E, d, F] -> down [d, F] of each."""
    native = strip_wrappers(native)
    m = _NATIVE_BLOCK.fullmatch(native)
    if not (m and m.group(2) in _NATIVE_EXPERTS and family in _EXPERT_NAMES):
        return [(to_hf_name(native, family), (), tuple(shape))]
    prefix, (gate, up, down) = _EXPERT_NAMES[family]
    base = f"model.layers.{m.group(1)}.{prefix}"
    n_experts, rows, cols = shape
    if m.group(2) == _NATIVE_EXPERTS[1]:
        return [(f"{base}.{e}.{down}.weight", (e,), (rows, cols)) for e in range(n_experts)]
    half = rows // 2
    return [
        (f"{base}.{e}.{name}.weight", (e, part), (half, cols))
        for e in range(n_experts)
        for name, part in ((gate, slice(0, half)), (up, slice(half, rows)))
    ]


def state_dict_to_hf(
    sd: dict[str, Tensor], tie_embeddings: bool = False, family: str = "llama"
) -> dict[str, Tensor]:
    """Rename a native state dict to HF names (dropping `output.weight` when tied; stacked
    experts split into the hub's per-expert tensors)."""
    return {
        hf: v[index]
        for k, v in sd.items()
        for hf, index, _ in hf_pieces(k, tuple(v.shape), family)
        if not (tie_embeddings and hf == "lm_head.weight")
    }


# --- config ------------------------------------------------------------------------------

_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "MistralForCausalLM": "mistral",
    "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3_text",
    "Phi3ForCausalLM": "phi3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "MixtralForCausalLM": "mixtral",
}
_FAMILY_ARCH = {family: arch for arch, family in _ARCHITECTURES.items()}
# Multimodal checkpoints whose text model is one of the above (weights renamed at load).
_TEXT_OF = {"Gemma3ForConditionalGeneration": "Gemma3ForCausalLM"}
# Expert-count fields: set in a config of a family without MoE support, they are refused.
_MOE_FIELDS = ("num_experts", "num_local_experts", "n_routed_experts")
_MOE_FAMILIES = ("qwen3_moe", "mixtral")
# What transformers' Gemma 2 and Gemma 3 configs both assume when a key is absent.
_GEMMA_DEFAULTS: dict[str, Any] = {
    "hidden_size": 2304,
    "intermediate_size": 9216,
    "num_hidden_layers": 26,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True,
    "query_pre_attn_scalar": 256,
    "sliding_window": 4096,
    "hidden_activation": "gelu_pytorch_tanh",
}
# What transformers assumes when a key is absent, per family (so we build what it would load).
_HF_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {"rms_norm_eps": 1e-6, "max_position_embeddings": 2048},
    "qwen2": {"rms_norm_eps": 1e-6, "max_position_embeddings": 32768, "num_key_value_heads": 32},
    "qwen3": {
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 32768,
        "num_key_value_heads": 32,
        "head_dim": 128,
    },
    "mistral": {
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 4096 * 32,
        "num_key_value_heads": 8,
        "sliding_window": 4096,
    },
    "gemma2": {
        **_GEMMA_DEFAULTS,
        "vocab_size": 256000,
        "max_position_embeddings": 8192,
        "attn_logit_softcapping": 50.0,
        "final_logit_softcapping": 30.0,
    },
    "gemma3_text": {
        **_GEMMA_DEFAULTS,
        "vocab_size": 262208,
        "max_position_embeddings": 131072,
        "rope_theta": 1000000.0,
        "rope_local_base_freq": 10000.0,
        "sliding_window_pattern": 6,
    },
    "qwen3_moe": {
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 32768,
        "num_key_value_heads": 4,
        "num_experts": 128,
        "num_local_experts": 128,
        "num_experts_per_tok": 8,
        "moe_intermediate_size": 768,
        "norm_topk_prob": False,
        "decoder_sparse_step": 1,
        "router_aux_loss_coef": 0.001,
    },
    "mixtral": {
        "rms_norm_eps": 1e-5,
        "max_position_embeddings": 131072,
        "num_key_value_heads": 8,
        "rope_theta": 1000000.0,
        "num_local_experts": 8,
        "num_experts_per_tok": 2,
        "router_aux_loss_coef": 0.001,
    },
    "phi3": {
        "vocab_size": 32064,
        "rms_norm_eps": 1e-5,
        "max_position_embeddings": 4096,
        "tie_word_embeddings": False,
    },
}
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


# A hub model id: "org/name" (what `from_pretrained` takes), never a path that exists here.
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*")


def resolve_model_path(name: str | os.PathLike, flag: str = "--model-dir") -> Path:
    """The local folder `name` stands for: the path itself when it exists, else (for a hub id
    such as `HuggingFaceTB/SmolLM2-135M`) its snapshot in the local HF cache. Nothing is ever
    downloaded; a name that is neither is refused in one line that says how to get the folder.
    Every loader of a model or tokenizer folder resolves its argument through this."""
    path = Path(name)
    if path.exists():
        return path
    text = str(name)
    if _HUB_ID.fullmatch(text) and ".." not in text:
        try:
            from huggingface_hub import snapshot_download

            return Path(snapshot_download(text, local_files_only=True))
        except Exception as e:  # not cached (LocalEntryNotFoundError), invalid id, no hub lib
            raise UserError(
                f"{flag} {text}: no such folder, and the hub model {text} is not in the local "
                f"HF cache ({type(e).__name__}); compiletune downloads nothing: run "
                f"`hf download {text} --local-dir DIR` (or `huggingface-cli download {text} "
                f"--local-dir DIR`) and pass {flag} DIR"
            ) from e
    raise UserError(
        f"model folder {text} does not exist; pass {flag} with a local HF model folder "
        "(config.json, model.safetensors, tokenizer files)"
    )


def load_hf_config(path: str | os.PathLike) -> dict:
    """Read and check `config.json` of a checkpoint folder (or the file itself).

    The folder is resolved by `resolve_model_path`. The file must be a JSON object whose
    fields have the types transformers gives them and describe a supported decoder
    (`args_from_hf_config` accepts it); anything else is one UserError naming the file."""
    path = Path(path)
    if not path.is_file():
        path = resolve_model_path(path)
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
)
_BOOLS = (
    "tie_word_embeddings",
    "attention_bias",
    "mlp_bias",
    "use_sliding_window",
    "use_bidirectional_attention",
    "norm_topk_prob",
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
    if rope and all(isinstance(v, dict) for v in rope.values()):  # per layer type (Gemma 3)
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
    text weights map onto a supported decoder (Gemma 3 with vision)."""
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
        if arch not in _ARCHITECTURES:
            moe = " (a mixture-of-experts model)" if "Moe" in arch or "Mixtral" in arch else ""
            raise UserError(
                f"config.json architectures: {arch!r}{moe} is not supported; use one of "
                f"{', '.join(_ARCHITECTURES)}"
            )
        return _ARCHITECTURES[arch]
    model_type = cfg.get("model_type")
    if model_type in _FAMILY_ARCH:
        return model_type
    raise UserError(
        "config.json has no 'architectures' field (and no known 'model_type'); "
        'add e.g. "architectures": ["LlamaForCausalLM"]'
    )


def _rope_params(cfg: dict, kind: str = "full_attention") -> dict:
    """The rope dict in either config style ({} when absent). 5.x gives `rope_scaling` priority.
    A dict nested per layer type (Gemma 3, 5.x) gives the entry of `kind`."""
    rope = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
    if not isinstance(rope, dict):
        raise UserError(f"config.json 'rope_scaling' must be an object or null, got {rope!r}")
    if "full_attention" in rope and isinstance(rope["full_attention"], dict):
        rope = rope.get(kind) or {}  # nested per layer type
    return rope


def _dtype_from_config(cfg: dict) -> torch.dtype | None:
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
        if rope.get(key):
            raise UserError(f"config.json rope_scaling.{key} is not supported; remove it")
    # transformers gives the top-level key priority (Phi-3 keeps it there, default 4096)
    top = cfg.get("original_max_position_embeddings")
    if top is None and _family(cfg) == "phi3":
        top = 4096
    original = int(top or rope.get("original_max_position_embeddings") or max_seq_len)
    if rope_type == "linear":  # unused by linear scaling: the canonical default
        original = RopeScaling.original_max_position_embeddings
    needed = {
        "llama3": ("factor", "low_freq_factor", "high_freq_factor"),
        "linear": ("factor",),
        "yarn": (),
        "longrope": ("short_factor", "long_factor"),
    }[rope_type]
    missing = [k for k in needed if rope.get(k) is None]
    if missing:
        raise UserError(
            f"config.json rope_scaling ({rope_type}) is missing the field {missing[0]!r}; add it"
        )
    factor = rope.get("factor") or max_seq_len / original
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
    )


def _layer_types(cfg: dict, family: str, n_layers: int) -> tuple[str, ...] | None:
    """Per-layer "full"/"sliding" for the families that mix them (Gemma), else None."""
    listed = cfg.get("layer_types")
    if listed:
        if len(listed) != n_layers or any(
            t not in ("full_attention", "sliding_attention") for t in listed
        ):
            raise UserError(
                "config.json layer_types must list 'full_attention' or 'sliding_attention' for "
                f"each of the {n_layers} layers"
            )
        kinds = tuple("sliding" if t == "sliding_attention" else "full" for t in listed)
    elif family == "gemma2":
        kinds = tuple("sliding" if i % 2 == 0 else "full" for i in range(n_layers))
    elif family == "gemma3_text":
        pattern = int(cfg.get("sliding_window_pattern") or cfg.get("_sliding_window_pattern") or 6)
        kinds = tuple("full" if (i + 1) % pattern == 0 else "sliding" for i in range(n_layers))
    else:
        return None
    return kinds


def args_from_hf_config(cfg: dict) -> ModelArgs:
    """ModelArgs for an HF config.json dict of a supported architecture (`_ARCHITECTURES`)."""
    cfg = text_config(cfg)
    family = _family(cfg)
    defaults = _HF_DEFAULTS[family]

    def get(key: str, default: Any = None, required: bool = False) -> Any:
        value = cfg.get(key)
        if value is None:
            if required and key not in defaults:
                raise UserError(
                    f"config.json is missing the field {key!r}; add it or re-export the config"
                )
            return defaults.get(key, default)
        return value

    for key in _MOE_FIELDS:
        if cfg.get(key) and family not in _MOE_FAMILIES:
            raise UserError(
                f"config.json sets {key}: {cfg[key]} (mixture of experts) for {family}, which "
                f"has no MoE form; MoE is supported for {', '.join(_MOE_FAMILIES)}"
            )
    dim = get("hidden_size", required=True)
    n_heads = get("num_attention_heads", required=True)
    n_layers = get("num_hidden_layers", required=True)
    gemma = family.startswith("gemma")
    act_key = "hidden_activation" if gemma else "hidden_act"
    act = get(act_key) or cfg.get("hidden_act") or ("gelu_pytorch_tanh" if gemma else "silu")
    if act not in ("silu", *_GELU_TANH):
        raise UserError(
            f"config.json {act_key} {act!r} is not supported; use 'silu' (SwiGLU) or "
            "'gelu_pytorch_tanh' (GeGLU)"
        )
    if get("mlp_bias", False):
        raise UserError(
            "config.json sets mlp_bias: true, which is not supported; only bias-free MLPs are"
        )
    if family != "qwen2" and get("attention_bias", False):
        # Llama's attention_bias also puts a bias on o_proj, which the decoder does not have.
        raise UserError(
            f"config.json sets attention_bias: true for {family}, which is not supported; "
            "set it false"
        )
    if family in ("qwen2", "qwen3", "qwen3_moe") and get("use_sliding_window", False):
        raise UserError(
            "config.json sets use_sliding_window: true, which is not supported; set it false "
            "(Qwen checkpoints ship with it false)"
        )
    if gemma and cfg.get("use_bidirectional_attention"):
        raise UserError(
            "config.json sets use_bidirectional_attention: true (an encoder), which is not "
            "supported; use a causal checkpoint"
        )

    rope = _rope_params(cfg)
    rope_theta = rope.get("rope_theta", get("rope_theta", 10000.0))
    partial = rope.get("partial_rotary_factor", get("partial_rotary_factor", 1.0))
    max_seq_len = int(get("max_position_embeddings"))
    head_dim = get("head_dim") or dim // n_heads
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

    window = cfg.get("sliding_window", defaults.get("sliding_window"))
    if family in ("llama", "qwen2", "qwen3", "qwen3_moe"):
        window = None  # Qwen's window is off (use_sliding_window false); Llama has none
    layer_types = _layer_types(cfg, family, n_layers) if window else None
    if layer_types is not None and "sliding" not in layer_types:
        window, layer_types = None, None
    local_theta = None
    if family == "gemma3_text":
        local = _rope_params(cfg, "sliding_attention")
        local_theta = float(local.get("rope_theta") or get("rope_local_base_freq"))
    qpas = get("query_pre_attn_scalar") if gemma else None

    def softcap(key: str) -> float | None:
        value = cfg.get(key, defaults.get(key)) if family == "gemma2" else cfg.get(key)
        return float(value) if value else None

    moe = _moe_args(cfg, family, n_layers, get) if family in _MOE_FAMILIES else {}
    return ModelArgs(
        dim=dim,
        n_layers=n_layers,
        n_heads=n_heads,
        n_kv_heads=get("num_key_value_heads", n_heads),
        vocab_size=get("vocab_size", required=True),
        ffn_dim=get("intermediate_size", required=True),
        head_dim=head_dim if head_dim != dim // n_heads else None,
        norm_eps=float(get("rms_norm_eps")),
        rope_theta=float(rope_theta),
        rope_scaling=rope_scaling,
        max_seq_len=max_seq_len,
        qkv_bias=family == "qwen2",
        tie_embeddings=bool(get("tie_word_embeddings", False)),
        sliding_window=int(window) if window else None,
        layer_types=layer_types,
        family=family,
        qk_norm=family in ("qwen3", "gemma3_text", "qwen3_moe"),
        norm_plus_one=gemma,
        embed_scale=gemma,
        activation="silu" if act == "silu" else "gelu_tanh",
        sandwich_norms=gemma,
        query_pre_attn_scalar=float(qpas) if qpas is not None else None,
        attn_softcap=softcap("attn_logit_softcapping"),
        final_softcap=softcap("final_logit_softcapping"),
        local_rope_theta=local_theta,
        rotary_dim=rotary_dim if rotary_dim != head_dim else None,
        fused_projections=family == "phi3",
        **moe,
    )


def _moe_args(cfg: dict, family: str, n_layers: int, get: Callable[..., Any]) -> dict[str, Any]:
    """The ModelArgs MoE fields of a Qwen3-MoE or Mixtral config."""
    if family == "mixtral":
        if get("router_jitter_noise", 0.0):
            raise UserError(
                f"config.json sets router_jitter_noise: {cfg['router_jitter_noise']}, which is "
                "not supported; set it 0 (Mixtral checkpoints ship with 0)"
            )
        n_experts, ffn, norm_topk, dense = (
            get("num_local_experts"),
            get("intermediate_size"),
            True,
            (),
        )
    else:
        # the hub's configs say num_experts; transformers 5 saves num_local_experts
        n_experts = cfg.get("num_experts") or get("num_local_experts") or get("num_experts")
        ffn = get("moe_intermediate_size")
        norm_topk = bool(get("norm_topk_prob"))
        step = int(get("decoder_sparse_step") or 1)
        only = cfg.get("mlp_only_layers") or []
        if not isinstance(only, list) or not all(
            isinstance(i, int) and 0 <= i < n_layers for i in only
        ):
            raise UserError(
                f"config.json mlp_only_layers must list layer indices in 0..{n_layers - 1}"
            )
        dense = tuple(i for i in range(n_layers) if i in only or (i + 1) % step)
    top_k = get("num_experts_per_tok")
    if not 0 < top_k <= n_experts:
        raise UserError(
            f"config.json num_experts_per_tok {top_k} must be between 1 and the expert count "
            f"{n_experts}"
        )
    return dict(
        n_experts=n_experts,
        top_k=top_k,
        moe_ffn_dim=ffn,
        norm_topk=norm_topk,
        dense_layers=dense,
        router_aux_coef=float(get("router_aux_loss_coef")),
    )


def _rope_dict(rs: RopeScaling | None) -> dict | None:
    """The HF rope_scaling dict of `rs` (None without scaling)."""
    if rs is None:
        return None
    out: dict[str, Any] = {"rope_type": rs.rope_type}
    if rs.rope_type == "longrope":
        out.update(short_factor=list(rs.short_factor), long_factor=list(rs.long_factor))
    else:
        out["factor"] = rs.factor
    if rs.rope_type in ("llama3", "yarn", "longrope"):
        out["original_max_position_embeddings"] = rs.original_max_position_embeddings
    if rs.rope_type == "llama3":
        out.update(low_freq_factor=rs.low_freq_factor, high_freq_factor=rs.high_freq_factor)
    if rs.rope_type == "yarn":
        out.update(beta_fast=rs.beta_fast, beta_slow=rs.beta_slow, truncate=rs.truncate)
    if rs.attention_factor is not None:
        out["attention_factor"] = rs.attention_factor
    return out


def _int_if_whole(x: float | None) -> float | int | None:
    """HF types query_pre_attn_scalar as int (strictly, in 5.x) but configs may hold floats."""
    return int(x) if x is not None and float(x).is_integer() else x


def hf_config_from_args(args: ModelArgs, dtype: torch.dtype, base: dict | None = None) -> dict:
    """A config.json dict that transformers (4.45+ and 5.x) loads as the same model.

    With `base` (the checkpoint's original config), its other fields (token ids, etc.) are kept.
    A multimodal base (Gemma 3 with vision) is written as its text model.
    """
    family = args.family
    if family not in _FAMILY_ARCH:
        raise UserError(
            f"model family {family!r} cannot be saved; use one of {', '.join(_FAMILY_ARCH)}"
        )
    if args.qkv_bias != (family == "qwen2"):
        raise UserError(
            f"family {family!r} with qkv_bias={args.qkv_bias} has no HF architecture; "
            "q/k/v bias is only saveable as family 'qwen2'"
        )
    dtype_name = str(dtype).removeprefix("torch.")
    cfg = dict(text_config(base) if base else {})
    for key in ("rope_scaling", "rope_theta", "torch_dtype", "sliding_window_pattern"):
        cfg.pop(key, None)
    rope_scaling = _rope_dict(args.rope_scaling)
    cfg.update(
        architectures=[_FAMILY_ARCH[family]],
        model_type=family,
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
    full_rope = {"rope_type": "default", "rope_theta": args.rope_theta, **(rope_scaling or {})}
    if args.rotary_dim is not None:
        cfg["partial_rotary_factor"] = args.rotary_dim / args.hd
        full_rope["partial_rotary_factor"] = cfg["partial_rotary_factor"]
    if args.layer_types is not None or family.startswith("gemma") or "layer_types" in cfg:
        cfg["layer_types"] = [f"{args.layer_kind(i)}_attention" for i in range(args.n_layers)]
    if "rope_parameters" in cfg or family == "gemma3_text":  # 5.x style: keep it in sync
        cfg["rope_parameters"] = full_rope
    if family == "gemma3_text":
        local = {"rope_type": "default", "rope_theta": args.local_rope_theta}
        cfg["rope_parameters"] = {"full_attention": full_rope, "sliding_attention": local}
        cfg["rope_local_base_freq"] = args.local_rope_theta
    if "dtype" in cfg:
        cfg["dtype"] = dtype_name
    if family.startswith("gemma"):
        cfg.update(
            hidden_activation=cfg["hidden_act"],
            query_pre_attn_scalar=_int_if_whole(args.query_pre_attn_scalar),
            attn_logit_softcapping=args.attn_softcap,
            final_logit_softcapping=args.final_softcap,
        )
    if family in ("llama", "qwen3", "gemma2", "gemma3_text", "qwen3_moe"):
        cfg.update(attention_bias=False)
    if family == "llama":
        cfg.update(mlp_bias=False)
    if family == "qwen3_moe":
        cfg.update(
            num_experts=args.n_experts,
            num_local_experts=args.n_experts,  # transformers 5's name; both read either
            num_experts_per_tok=args.top_k,
            moe_intermediate_size=args.moe_ffn_dim,
            norm_topk_prob=args.norm_topk,
            decoder_sparse_step=1,
            mlp_only_layers=list(args.dense_layers),
            router_aux_loss_coef=args.router_aux_coef,
        )
    if family == "mixtral":
        if not args.norm_topk or args.dense_layers or args.moe_ffn_dim != args.ffn_dim:
            raise UserError(
                "a Mixtral model renormalises its top-k weights, has no dense layers and one "
                "MLP width; these args have no Mixtral checkpoint"
            )
        cfg.update(
            num_local_experts=args.n_experts,
            num_experts_per_tok=args.top_k,
            router_aux_loss_coef=args.router_aux_coef,
            router_jitter_noise=0.0,
        )
    if args.n_experts and family not in _MOE_FAMILIES:
        raise UserError(f"family {family!r} has no MoE checkpoint; use qwen3_moe or mixtral")
    if family in ("qwen2", "qwen3", "qwen3_moe"):
        cfg["use_sliding_window"] = False
        cfg.setdefault("max_window_layers", args.n_layers)
    if family == "phi3":
        original = args.max_seq_len
        rs = args.rope_scaling
        if rs is not None:
            original = rs.original_max_position_embeddings
        cfg["original_max_position_embeddings"] = original
        if rs is not None and rs.rope_type == "longrope" and rs.attention_factor is None:
            # the only form transformers 4.x's Phi-3 validation accepts
            cfg["rope_scaling"] = {
                "type": "longrope",
                "short_factor": list(rs.short_factor),
                "long_factor": list(rs.long_factor),
            }
    return cfg


# --- weights -----------------------------------------------------------------------------


def _shape(shape: Any) -> str:
    return "[" + ", ".join(str(int(n)) for n in shape) + "]"


def _checkpoint_files(path: Path) -> list[Path]:
    """The safetensors files of a checkpoint folder."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, ValueError, KeyError, TypeError, RecursionError) as e:
            raise UserError(
                f"{index} is not a valid safetensors index ({brief(e)}); re-export the checkpoint"
            ) from e
        if not isinstance(weight_map, dict) or not all(
            isinstance(f, str) and f and Path(f).name == f for f in weight_map.values()
        ):
            raise UserError(
                f"{index}: 'weight_map' must map tensor names to file names in the folder; "
                "re-export the checkpoint"
            )
        files = [path / f for f in dict.fromkeys(weight_map.values())]
        for file in files:
            if not file.is_file():
                raise UserError(
                    f"{index} lists {file.name}, which is missing; copy the whole checkpoint folder"
                )
        return files
    single = path / "model.safetensors"
    if single.is_file():
        return [single]
    shards = sorted(path.glob("model*.safetensors"))
    if shards:
        return shards
    if (path / "adapter_config.json").is_file():
        raise UserError(
            f"{path} is a LoRA adapter folder and holds no model weights; pass its base model "
            "folder (adapter_config.json's base_model_name_or_path)"
        )
    if re.fullmatch(r"step_\d+", path.name) or (path / "trainer_state.pt").is_file():
        raise UserError(
            f"checkpoint {path} is incomplete: it has no model*.safetensors and no adapter "
            "(the save was interrupted or files were removed); use another step_N folder"
        )
    if any(path.glob("*.bin")) or any(path.glob("*.pt")) or any(path.glob("*.pth")):
        raise UserError(
            f"{path} holds weights in pickle files (.bin/.pt), not safetensors; convert them "
            "with save_pretrained(..., safe_serialization=True) and pass the new folder"
        )
    raise UserError(
        f"{path} has no model.safetensors or model.safetensors.index.json; "
        "save the model with safetensors (save_pretrained(..., safe_serialization=True))"
    )


# safetensors dtypes a floating-point weight may be stored in
_FLOAT_DTYPES = ("F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2")


def _open_safetensors(file: Path) -> Any:
    """`safe_open(file)`; an unreadable file (truncated, not safetensors) is a UserError."""
    try:
        return safe_open(str(file), framework="pt", device="cpu")
    except Exception as e:  # SafetensorError, OSError: the header or the size is wrong
        raise UserError(
            f"{file} is not a readable safetensors file ({brief(e)}); it is truncated or "
            "corrupt: copy or download it again"
        ) from e


# Where a multimodal checkpoint keeps its text model (transformers 4.5x, then 5.x naming).
_TEXT_PREFIXES = (("language_model.model.", "model."), ("model.language_model.", "model."))
_TEXT_HEADS = ("language_model.lm_head.weight",)
_NOT_TEXT = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.")
_NOT_TEXT += ("model.multi_modal_projector.",)


def _text_tensor_name(stored: str) -> str | None:
    """The decoder name of a stored tensor (a multimodal checkpoint's text weights renamed), or
    None for a tensor of another part of the model (vision tower, projector)."""
    if stored.startswith(_NOT_TEXT):
        return None
    if stored in _TEXT_HEADS:
        return "lm_head.weight"
    for old, new in _TEXT_PREFIXES:
        if stored.startswith(old):
            return new + stored.removeprefix(old)
    return stored


def from_hf(
    path: str | os.PathLike,
    dtype: torch.dtype | None = None,
    device: torch.device | str = "cpu",
    on_block: Callable[[TransformerBlock], None] | None = None,
) -> Transformer:
    """Load an HF checkpoint folder of a supported architecture as a native `Transformer` (of
    a Gemma 3 checkpoint with vision: its text model).

    dtype defaults to the config's torch_dtype/dtype, else fp32. Every tensor name and shape is
    checked before anything is allocated; then the model is allocated a part at a time
    (embedding, each block, final norm and head) and each part read tensor by tensor straight
    into it. `on_block(block)` is called on each block once loaded, before the next one is
    allocated (see `build_model`).
    """
    path = resolve_model_path(path)
    if not path.is_dir():
        raise UserError(f"{path} is a file; pass the model folder that holds config.json")
    cfg = load_hf_config(path)
    args = args_from_hf_config(cfg)
    if dtype is None:
        dtype = _dtype_from_config(cfg) or torch.float32
    files = _checkpoint_files(path)

    with torch.device("meta"):
        model = Transformer(args)
    model.to(dtype)
    family = args.family
    # HF name -> shape; a tied model has no lm_head
    expected = {
        hf: shape
        for n, p in model.named_parameters()
        for hf, _, shape in hf_pieces(n, tuple(p.shape), family)
    }
    where: dict[str, tuple[Path, str]] = {}  # HF name -> (file, name in that file)
    for file in files:
        with _open_safetensors(file) as f:
            for stored in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                name = _text_tensor_name(stored)
                if name is None or name.endswith("rotary_emb.inv_freq"):
                    continue  # vision tower, or the rope buffer old exports saved
                if args.tie_embeddings and name == "lm_head.weight":
                    continue  # a tied checkpoint may carry the shared tensor twice
                if name not in expected:
                    to_native_name(name, family)  # raises for names foreign to the family
                    raise UserError(
                        f"{file}: unexpected tensor {stored!r} (config.json describes a "
                        "model without it); use the config.json that came with these weights"
                    )
                piece = f.get_slice(stored)
                shape = piece.get_shape()
                if piece.get_dtype() not in _FLOAT_DTYPES:
                    raise UserError(
                        f"{file}: tensor {stored!r} is stored as {piece.get_dtype()}, but model "
                        "weights are floating point (F32, F16, BF16); re-export the weights"
                    )
                if list(shape) != list(expected[name]):
                    raise UserError(
                        f"{stored}: checkpoint has {_shape(shape)}, model expects "
                        f"{_shape(expected[name])}; config.json does not match the weights in "
                        f"{file}"
                    )
                where[name] = (file, stored)
    missing = [n for n in expected if n not in where]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise UserError(
            f"{path}: checkpoint is missing tensor {missing[0]!r}{more}; copy the complete "
            "checkpoint (all shards) or fix config.json"
        )

    parts: list[tuple[str, nn.Module]] = [("tok_embeddings", model.tok_embeddings)]
    parts += [(f"layers.{i}", block) for i, block in enumerate(model.layers)]
    parts += [("norm", model.norm)] + [("output", model.output)] * (not args.tie_embeddings)
    with contextlib.ExitStack() as stack, torch.no_grad():
        readers = {file: stack.enter_context(_open_safetensors(file)) for file in files}
        for prefix, module in parts:
            module.to_empty(device=device)
            model.tie_weights()
            for name, param in module.named_parameters(prefix=prefix):
                for hf, index, _ in hf_pieces(name, tuple(param.shape), family):
                    file, stored = where[hf]
                    _read_into(param[index], readers[file], file, stored, dtype)
            if on_block is not None and prefix.startswith("layers."):
                on_block(module)
    model.hf_config = cfg
    return model


def _read_into(target: Tensor, reader: Any, file: Path, stored: str, dtype: torch.dtype) -> None:
    """Copy tensor `stored` of an open safetensors file into `target`, checking it is finite."""
    try:
        tensor = reader.get_tensor(stored)
    except Exception as e:  # SafetensorError: data cut short or unreadable
        raise UserError(
            f"{file}: cannot read tensor {stored!r} ({brief(e)}); the file is "
            "truncated or corrupt: copy or download it again"
        ) from e
    target.copy_(tensor)
    # in the load dtype: a value too large for it is as unusable as a NaN
    if not bool(torch.isfinite(target).all()):
        why = "holds NaN or Inf values"
        if bool(torch.isfinite(tensor).all()):
            why = f"has values beyond the range of {str(dtype).removeprefix('torch.')}"
        raise UserError(
            f"{file}: tensor {stored!r} {why}; the weights are corrupt or diverged: "
            "use a healthy checkpoint"
        )


def _gathered(gather: Callable[[Tensor], Tensor], make: Callable[[], Tensor]) -> Tensor:
    return gather(make())


class _Shared:
    """One fetch shared by the pieces of a tensor: fetched at the first piece's call, released
    after the last one (an exporter holds one whole stacked tensor at a time)."""

    def __init__(self, fetch: Callable[[], Tensor], uses: int) -> None:
        self.fetch, self.left = fetch, uses
        self.whole: Tensor | None = None

    def piece(self, index: Index) -> Tensor:
        if self.whole is None:
            self.whole = self.fetch()
        out = self.whole[index]
        self.left -= 1
        if not self.left:
            self.whole = None
        return out


def _hf_tensors(
    model: nn.Module, merge: bool, gather: Callable[[Tensor], Tensor] = lambda t: t
) -> list[tuple[str, tuple[int, ...], Callable[[], Tensor]]]:
    """(HF name, shape, make) in model order; a tied head is left out (it is the embedding).
    A LoRA model gives its base weights (dequantized if NF4), with adapters folded in if `merge`."""
    args: ModelArgs = model.args
    out = []
    for name, shape, dense in dense_tensors(model, merge):
        make = functools.partial(_gathered, gather, dense)
        pieces = hf_pieces(name, shape, args.family)
        if len(pieces) > 1:
            shared = _Shared(make, len(pieces))
            out += [(hf, piece, functools.partial(shared.piece, i)) for hf, i, piece in pieces]
            continue
        hf = pieces[0][0]
        if args.tie_embeddings and hf == "lm_head.weight":
            continue
        out.append((hf, shape, make))
    return out


def save_hf(
    model: Transformer,
    path: str | os.PathLike,
    *,
    dtype: torch.dtype | None = None,
    tokenizer: Any = None,
    max_shard_bytes: int = 5 * 2**30,
    writer: bool = True,
    merge_lora: bool = False,
) -> None:
    """Write an HF checkpoint folder: config.json, safetensors (sharded with an index when
    larger than `max_shard_bytes`) and, if given, the tokenizer files.

    A LoRA model (models/lora.py) is written as the plain model it stands for: its base weights
    (NF4 ones dequantized) with, when `merge_lora`, each adapter folded into its weight
    (W + alpha / r * B A, in fp32 before the cast to `dtype`). `dtype` defaults to the
    embedding's dtype (the base dtype of a LoRA model).

    A sharded (FSDP2) model is exported tensor by tensor: every rank calls this (each whole
    tensor is gathered, a collective), and only the rank with `writer=True` keeps the CPU copy
    and writes files, so no device ever holds more than one whole tensor of the model.
    """

    if dtype is None:
        dtype = model.tok_embeddings.weight.dtype
    entries = _hf_tensors(model, merge_lora, gather=full_tensor)
    cfg = hf_config_from_args(model.args, dtype, base=getattr(model, "hf_config", None))
    write_hf_folder(
        path,
        cfg,
        entries,
        dtype,
        tokenizer=tokenizer,
        max_shard_bytes=max_shard_bytes,
        writer=writer,
    )


def write_hf_folder(
    path: str | os.PathLike,
    config: dict[str, Any],
    entries: list[tuple[str, tuple[int, ...], Callable[[], Tensor]]],
    dtype: torch.dtype,
    *,
    tokenizer: Any = None,
    max_shard_bytes: int = 5 * 2**30,
    writer: bool = True,
) -> None:
    """Write `config` and the tensors of `entries` (HF name, shape, fetch) as an HF folder.

    Tensors are fetched one at a time and grouped into safetensors shards by size; peak extra
    host memory is one shard. Files are written under temporary names and renamed at the end,
    and stale shards from an earlier save are removed, so a folder never mixes two saves.
    `writer=False` only fetches (for ranks whose fetch is a collective they must join).
    """
    path = Path(path)
    if writer:
        path.mkdir(parents=True, exist_ok=True)
    itemsize = torch.empty((), dtype=dtype).element_size()
    shards: list[list[tuple[str, Callable[[], Tensor]]]] = [[]]
    shard_bytes = 0
    for name, shape, fetch in entries:
        nbytes = math.prod(shape) * itemsize
        if shards[-1] and shard_bytes + nbytes > max_shard_bytes:
            shards.append([])
            shard_bytes = 0
        shards[-1].append((name, fetch))
        shard_bytes += nbytes
    n = len(shards)
    file_names = (
        ["model.safetensors"]
        if n == 1
        else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    )

    written: list[tuple[Path, Path]] = []
    weight_map: dict[str, str] = {}
    total = 0
    failed: Exception | None = None  # the writer's error: it still joins every fetch
    for file_name, shard in zip(file_names, shards, strict=True):
        tensors = {}
        for name, fetch in shard:
            whole = fetch()
            if writer and failed is None:
                tensors[name] = whole.to(device="cpu", dtype=dtype).contiguous()
            del whole
        if not writer or failed is not None:
            continue
        final = path / file_name
        tmp = path / (file_name + ".tmp")
        try:
            faults.point("export")
            save_file(tensors, str(tmp), metadata={"format": "pt"})
        except Exception as e:  # a full disk: the other ranks' gathers still need this one
            failed = e
            tmp.unlink(missing_ok=True)
            continue
        written.append((tmp, final))
        for name, t in tensors.items():
            weight_map[name] = file_name
            total += t.numel() * t.element_size()
        del tensors
    if not writer:
        return
    if failed is not None:
        for tmp, _ in written:
            tmp.unlink(missing_ok=True)
        raise failed
    if n > 1:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        tmp = path / "model.safetensors.index.json.tmp"
        tmp.write_text(json.dumps(index, indent=2) + "\n")
        written.append((tmp, path / "model.safetensors.index.json"))
    tmp = path / "config.json.tmp"
    tmp.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    written.append((tmp, path / "config.json"))

    keep = {final.name for _, final in written}
    for old in [*path.glob("model*.safetensors"), path / "model.safetensors.index.json"]:
        if old.is_file() and old.name not in keep:
            old.unlink()
    for tmp, final in written:
        os.replace(tmp, final)
    if tokenizer is not None:
        tokenizer.save_pretrained(str(path))
