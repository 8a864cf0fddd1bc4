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

from compiletune.errors import UserError

from .decoder import ModelArgs, RopeScaling, Transformer, TransformerBlock
from .lora import dense_tensors
from .names import strip_wrappers

# --- names -------------------------------------------------------------------------------

# native name <-> HF name for the tensors outside the blocks
_GLOBAL_NAMES = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
# native suffix <-> HF suffix inside block i ("layers.{i}." <-> "model.layers.{i}.")
_BLOCK_NAMES = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wq.bias": "self_attn.q_proj.bias",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wk.bias": "self_attn.k_proj.bias",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wv.bias": "self_attn.v_proj.bias",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
_GLOBAL_NAMES_INV = {v: k for k, v in _GLOBAL_NAMES.items()}
_BLOCK_NAMES_INV = {v: k for k, v in _BLOCK_NAMES.items()}
_NATIVE_BLOCK = re.compile(r"layers\.(\d+)\.(.+)")
_HF_BLOCK = re.compile(r"model\.layers\.(\d+)\.(.+)")


def to_hf_name(native: str) -> str:
    """`layers.3.attention.wq.weight` -> `model.layers.3.self_attn.q_proj.weight`."""
    native = strip_wrappers(native)
    if native in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[native]
    m = _NATIVE_BLOCK.fullmatch(native)
    if m and m.group(2) in _BLOCK_NAMES:
        return f"model.layers.{m.group(1)}.{_BLOCK_NAMES[m.group(2)]}"
    raise UserError(
        f"parameter {native!r} has no HF name; only compiletune decoder models can be saved"
    )


def to_native_name(hf: str) -> str:
    """`model.layers.3.mlp.gate_proj.weight` -> `layers.3.feed_forward.w1.weight`."""
    if hf in _GLOBAL_NAMES_INV:
        return _GLOBAL_NAMES_INV[hf]
    m = _HF_BLOCK.fullmatch(hf)
    if m and m.group(2) in _BLOCK_NAMES_INV:
        return f"layers.{m.group(1)}.{_BLOCK_NAMES_INV[m.group(2)]}"
    raise UserError(
        f"checkpoint tensor {hf!r} is not part of a Llama/Qwen2/Mistral decoder; "
        "use a checkpoint of a supported architecture"
    )


def state_dict_to_hf(sd: dict[str, Tensor], tie_embeddings: bool = False) -> dict[str, Tensor]:
    """Rename a native state dict to HF names (dropping `output.weight` when tied)."""
    return {
        to_hf_name(k): v
        for k, v in sd.items()
        if not (tie_embeddings and to_hf_name(k) == "lm_head.weight")
    }


# --- config ------------------------------------------------------------------------------

_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "MistralForCausalLM": "mistral",
}
_FAMILY_ARCH = {family: arch for arch, family in _ARCHITECTURES.items()}
# What transformers assumes when a key is absent, per family (so we build what it would load).
_HF_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {"rms_norm_eps": 1e-6, "max_position_embeddings": 2048},
    "qwen2": {"rms_norm_eps": 1e-6, "max_position_embeddings": 32768, "num_key_value_heads": 32},
    "mistral": {
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 4096 * 32,
        "num_key_value_heads": 8,
        "sliding_window": 4096,
    },
}
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def load_hf_config(path: str | os.PathLike) -> dict:
    """Read `config.json` from a checkpoint folder (or the file itself)."""
    path = Path(path)
    file = path if path.is_file() else path / "config.json"
    if not path.exists():
        raise UserError(f"model folder {path} does not exist; pass a folder with config.json")
    if not file.is_file():
        raise UserError(
            f"{path} has no config.json; pass an HF model folder (save_pretrained output)"
        )
    try:
        cfg = json.loads(file.read_text())
    except (OSError, ValueError) as e:
        raise UserError(f"{file} is not valid JSON ({e}); re-export the checkpoint's config") from e
    if not isinstance(cfg, dict):
        raise UserError(f"{file} does not hold a JSON object; re-export the checkpoint's config")
    return cfg


def _family(cfg: dict) -> str:
    archs = cfg.get("architectures") or []
    if archs:
        arch = archs[0]
        if arch not in _ARCHITECTURES:
            raise UserError(
                f"config.json architecture {arch!r} is not supported; use one of "
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


def _rope_params(cfg: dict) -> dict:
    """The rope dict in either config style ({} when absent). 5.x gives `rope_scaling` priority."""
    rope = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
    if not isinstance(rope, dict):
        raise UserError(f"config.json 'rope_scaling' must be an object or null, got {rope!r}")
    if "full_attention" in rope and isinstance(rope["full_attention"], dict):
        rope = rope["full_attention"]  # nested per layer type
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


def args_from_hf_config(cfg: dict) -> ModelArgs:
    """ModelArgs for an HF config.json dict (Llama, Qwen2 or Mistral)."""
    family = _family(cfg)
    defaults = _HF_DEFAULTS[family]

    def get(key: str, default: Any = None, required: bool = False) -> Any:
        value = cfg.get(key)
        if value is None:
            if required:
                raise UserError(
                    f"config.json is missing the field {key!r}; add it or re-export the config"
                )
            return defaults.get(key, default)
        return value

    dim = get("hidden_size", required=True)
    n_heads = get("num_attention_heads", required=True)
    if get("hidden_act", "silu") != "silu":
        raise UserError(
            f"config.json hidden_act {cfg['hidden_act']!r} is not supported; only 'silu' (SwiGLU) is"
        )
    if get("mlp_bias", False):
        raise UserError(
            "config.json sets mlp_bias: true, which is not supported; only bias-free MLPs are"
        )
    if family == "llama" and get("attention_bias", False):
        # Llama's attention_bias also puts a bias on o_proj, which the decoder does not have.
        raise UserError(
            "config.json sets attention_bias: true for Llama, which is not supported; set it false"
        )
    if family == "qwen2" and get("use_sliding_window", False):
        raise UserError(
            "config.json sets use_sliding_window: true, which is not supported; set it false "
            "(Qwen2.5 checkpoints ship with it false)"
        )

    rope = _rope_params(cfg)
    rope_type = rope.get("rope_type", rope.get("type", "default")) or "default"
    rope_theta = rope.get("rope_theta", get("rope_theta", 10000.0))
    if rope.get("partial_rotary_factor", get("partial_rotary_factor", 1.0)) != 1.0:
        raise UserError(
            "config.json sets partial_rotary_factor != 1, which is not supported; remove it"
        )
    max_seq_len = get("max_position_embeddings")
    rope_scaling = None
    if rope_type == "llama3":
        missing = [k for k in ("factor", "low_freq_factor", "high_freq_factor") if k not in rope]
        if missing:
            raise UserError(
                f"config.json rope_scaling (llama3) is missing the field {missing[0]!r}; add it"
            )
        rope_scaling = RopeScaling(
            factor=float(rope["factor"]),
            low_freq_factor=float(rope["low_freq_factor"]),
            high_freq_factor=float(rope["high_freq_factor"]),
            original_max_position_embeddings=int(
                rope.get("original_max_position_embeddings", max_seq_len)
            ),
        )
    elif rope_type != "default":
        raise UserError(
            f"config.json rope type {rope_type!r} is not supported; only the default rope and "
            "'llama3' scaling are (remove rope_scaling or use a supported checkpoint)"
        )

    head_dim = get("head_dim")
    return ModelArgs(
        dim=dim,
        n_layers=get("num_hidden_layers", required=True),
        n_heads=n_heads,
        n_kv_heads=get("num_key_value_heads", n_heads),
        vocab_size=get("vocab_size", required=True),
        ffn_dim=get("intermediate_size", required=True),
        head_dim=head_dim if head_dim != dim // n_heads else None,
        norm_eps=float(get("rms_norm_eps")),
        rope_theta=float(rope_theta),
        rope_scaling=rope_scaling,
        max_seq_len=int(max_seq_len),
        qkv_bias=family == "qwen2",
        tie_embeddings=bool(get("tie_word_embeddings", False)),
        # An explicit null means no window; only a missing key takes Mistral's 4096 default.
        sliding_window=cfg.get("sliding_window", 4096) if family == "mistral" else None,
        family=family,
    )


def hf_config_from_args(args: ModelArgs, dtype: torch.dtype, base: dict | None = None) -> dict:
    """A config.json dict that transformers (4.45+ and 5.x) loads as the same model.

    With `base` (the checkpoint's original config), its other fields (token ids, etc.) are kept.
    """
    if args.family not in _FAMILY_ARCH:
        raise UserError(
            f"model family {args.family!r} cannot be saved; use llama, qwen2 or mistral"
        )
    if args.qkv_bias != (args.family == "qwen2"):
        raise UserError(
            f"family {args.family!r} with qkv_bias={args.qkv_bias} has no HF architecture; "
            "q/k/v bias is only saveable as family 'qwen2'"
        )
    dtype_name = str(dtype).removeprefix("torch.")
    cfg = dict(base or {})
    for key in ("rope_scaling", "rope_theta", "torch_dtype"):
        cfg.pop(key, None)
    rope_scaling = None
    if args.rope_scaling is not None:
        rope_scaling = {
            "rope_type": "llama3",
            "factor": args.rope_scaling.factor,
            "low_freq_factor": args.rope_scaling.low_freq_factor,
            "high_freq_factor": args.rope_scaling.high_freq_factor,
            "original_max_position_embeddings": args.rope_scaling.original_max_position_embeddings,
        }
    cfg.update(
        architectures=[_FAMILY_ARCH[args.family]],
        model_type=args.family,
        hidden_size=args.dim,
        intermediate_size=args.ffn_dim,
        num_hidden_layers=args.n_layers,
        num_attention_heads=args.n_heads,
        num_key_value_heads=args.n_kv_heads,
        head_dim=args.hd,
        hidden_act="silu",
        rms_norm_eps=args.norm_eps,
        rope_theta=args.rope_theta,
        rope_scaling=rope_scaling,
        max_position_embeddings=args.max_seq_len,
        vocab_size=args.vocab_size,
        tie_word_embeddings=args.tie_embeddings,
        torch_dtype=dtype_name,
    )
    if "rope_parameters" in cfg:  # 5.x-style original: keep its style in sync
        cfg["rope_parameters"] = {
            "rope_type": "default",
            "rope_theta": args.rope_theta,
            **(rope_scaling or {}),
        }
    if "dtype" in cfg:
        cfg["dtype"] = dtype_name
    if "layer_types" in cfg:
        cfg["layer_types"] = ["full_attention"] * args.n_layers
    if args.family == "llama":
        cfg.update(attention_bias=False, mlp_bias=False)
    elif args.family == "qwen2":
        cfg["use_sliding_window"] = False
        cfg.setdefault("sliding_window", None)
        cfg.setdefault("max_window_layers", args.n_layers)
    else:
        cfg["sliding_window"] = args.sliding_window
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
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise UserError(
                f"{index} is not a valid safetensors index ({e}); re-export the checkpoint"
            ) from e
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
    shards = sorted(path.glob("*.safetensors"))
    if shards:
        return shards
    raise UserError(
        f"{path} has no model.safetensors or model.safetensors.index.json; "
        "save the model with safetensors (save_pretrained(..., safe_serialization=True))"
    )


def from_hf(
    path: str | os.PathLike,
    dtype: torch.dtype | None = None,
    device: torch.device | str = "cpu",
    on_block: Callable[[TransformerBlock], None] | None = None,
) -> Transformer:
    """Load an HF Llama/Qwen2/Mistral checkpoint folder as a native `Transformer`.

    dtype defaults to the config's torch_dtype/dtype, else fp32. Every tensor name and shape is
    checked before anything is allocated; then the model is allocated a part at a time
    (embedding, each block, final norm and head) and each part read tensor by tensor straight
    into it. `on_block(block)` is called on each block once loaded, before the next one is
    allocated (see `build_model`).
    """
    path = Path(path)
    if not path.is_dir():
        raise UserError(
            f"model folder {path} does not exist; pass the folder that holds config.json"
        )
    cfg = load_hf_config(path)
    args = args_from_hf_config(cfg)
    if dtype is None:
        dtype = _dtype_from_config(cfg) or torch.float32
    files = _checkpoint_files(path)

    with torch.device("meta"):
        model = Transformer(args)
    model.to(dtype)
    expected = {to_hf_name(n): p.shape for n, p in model.named_parameters()}  # tied: no lm_head
    where: dict[str, Path] = {}
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                if name.endswith("rotary_emb.inv_freq"):  # old exports saved the rope buffer
                    continue
                if args.tie_embeddings and name == "lm_head.weight":
                    continue  # a tied checkpoint may carry the shared tensor twice
                if name not in expected:
                    to_native_name(name)  # raises for names foreign to the architecture
                    raise UserError(
                        f"{file.name}: unexpected tensor {name!r} (config.json describes a model "
                        "without it); use the config.json that came with these weights"
                    )
                shape = f.get_slice(name).get_shape()
                if list(shape) != list(expected[name]):
                    raise UserError(
                        f"{name}: checkpoint has {_shape(shape)}, model expects "
                        f"{_shape(expected[name])}; config.json does not match the weights in "
                        f"{file.name}"
                    )
                where[name] = file
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
        readers = {
            file: stack.enter_context(safe_open(str(file), framework="pt", device="cpu"))
            for file in files
        }
        for prefix, module in parts:
            module.to_empty(device=device)
            model.tie_weights()
            for name, param in module.named_parameters(prefix=prefix):
                hf = to_hf_name(name)
                param.copy_(readers[where[hf]].get_tensor(hf))
            if on_block is not None and prefix.startswith("layers."):
                on_block(module)
    model.hf_config = cfg
    return model


def _hf_tensors(
    model: nn.Module, merge: bool
) -> list[tuple[str, tuple[int, ...], Callable[[], Tensor]]]:
    """(HF name, shape, make) in model order; a tied head is left out (it is the embedding).
    A LoRA model gives its base weights (dequantized if NF4), with adapters folded in if `merge`."""
    args: ModelArgs = model.args
    out = []
    for name, shape, make in dense_tensors(model, merge):
        hf = to_hf_name(name)
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
    from compiletune.distributed import full_tensor

    if dtype is None:
        dtype = model.tok_embeddings.weight.dtype
    entries = [
        (name, shape, lambda make=make: full_tensor(make()))
        for name, shape, make in _hf_tensors(model, merge_lora)
    ]
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
    for file_name, shard in zip(file_names, shards, strict=True):
        tensors = {}
        for name, fetch in shard:
            whole = fetch()
            if writer:
                tensors[name] = whole.to(device="cpu", dtype=dtype).contiguous()
            del whole
        if not writer:
            continue
        final = path / file_name
        tmp = path / (file_name + ".tmp")
        save_file(tensors, str(tmp), metadata={"format": "pt"})
        written.append((tmp, final))
        for name, t in tensors.items():
            weight_map[name] = file_name
            total += t.numel() * t.element_size()
        del tensors
    if not writer:
        return
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
