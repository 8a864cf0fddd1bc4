"""HF checkpoints <-> native models: weight names and safetensors I/O (config.json: hf_config.py).

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
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import Tensor, nn

from compiletune import faults
from compiletune.errors import UserError
from compiletune.gather import full_tensor

from .args import ModelArgs
from .decoder import Transformer, TransformerBlock
from .families import FAMILIES
from .generation_config import load_generation_config, write_side_files
from .hf_config import (
    args_from_hf_config,
    brief,
    dtype_from_config,
    hf_config_from_args,
    load_hf_config,
    resolve_model_path,
)
from .hf_names import (
    HF_BLOCK,
    UNUSED_IN_REUSE,
    Index,
    hf_pieces,
    layout,
    to_native_name,
)
from .lora import dense_tensors
from .names import strip_wrappers
from .quantized import (
    FP8_SCALE,
    MX_SUFFIXES,
    dequantize_fp8_blocks,
    dequantize_mxfp4,
    mxfp4_shape,
)
from .vision.model import TOWER, VisionLanguageModel, text_checkpoint_name, vision_config

# --- weights -----------------------------------------------------------------------------


def _shape(shape: Any) -> str:
    return "[" + ", ".join(str(int(n)) for n in shape) + "]"


def checkpoint_files(path: Path) -> list[Path]:
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
_NOT_TEXT += ("model.multi_modal_projector.", "model.visual.", "mtp.")
_NOT_TEXT += ("model.embed_vision.", "model.audio_tower.", "model.embed_audio.")


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
    vision: bool = False,
    train_vision: bool = False,
) -> Transformer:
    """Load an HF checkpoint folder of a supported architecture as a native `Transformer` (of
    a multimodal checkpoint: its text model, `Family.multimodal`; with `vision`, the text model
    and its vision tower, a `VisionLanguageModel` whose tower is frozen unless `train_vision`).

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
        dtype = dtype_from_config(cfg) or torch.float32
    files = checkpoint_files(path)

    with torch.device("meta"):
        model = VisionLanguageModel(args, cfg, str(path)) if vision else Transformer(args)
    model.to(dtype)
    family = args.family
    # HF name -> shape; a tied model has no lm_head
    expected = {
        hf: shape
        for n, p in model.named_parameters()
        if not n.startswith(TOWER + ".")  # a vision tower's: `load_tower`
        for hf, _, shape in hf_pieces(n, tuple(p.shape), family)
    }
    block = fp8_block(cfg)
    where, mx, fp8 = _locate(files, expected, args, block)
    missing = [n for n in expected if n not in where]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise UserError(
            f"{path}: checkpoint is missing tensor {missing[0]!r}{more}; copy the complete "
            "checkpoint (all shards) or fix config.json"
        )

    parts: list[tuple[str, nn.Module]] = [("tok_embeddings", model.tok_embeddings)]
    if model.per_layer_inputs is not None:
        parts.append(("per_layer_inputs", model.per_layer_inputs))
    parts += [(f"layers.{i}", block) for i, block in enumerate(model.layers)]
    parts += [("norm", model.norm)] + [("output", model.output)] * (not args.tie_embeddings)
    with contextlib.ExitStack() as stack, torch.no_grad():
        readers = {file: stack.enter_context(_open_safetensors(file)) for file in files}
        for prefix, module in parts:
            module.to_empty(device=device)
            model.tie_weights()
            for name, param in module.named_parameters(prefix=prefix):
                convert = layout(name, family)
                for hf, index, _ in hf_pieces(name, tuple(param.shape), family):
                    file, stored = where[hf]
                    to_native = None if convert is None else convert[0]
                    if hf in mx:
                        _read_mxfp4(param[index], readers, mx[hf], dtype, to_native)
                        continue
                    if hf in fp8:
                        _read_fp8(param[index], readers, (file, stored), fp8[hf], block)
                        continue
                    _read_into(param[index], readers[file], file, stored, dtype, to_native)
            if on_block is not None and prefix.startswith("layers."):
                on_block(module)
        if isinstance(model, VisionLanguageModel):
            model.load_tower(_Tensors(readers), str(path), device, dtype)
            model.train_vision(train_vision)
            model.read_processor_files(path)
    model.hf_config = cfg
    model.generation_config = load_generation_config(path)
    return model


class _Tensors(Mapping):
    """The tensors of open safetensors files by name, each read when asked for."""

    def __init__(self, readers: dict[Path, Any]) -> None:
        self.where = {name: f for f in readers.values() for name in f.keys()}  # noqa: SIM118

    def __getitem__(self, name: str) -> Tensor:
        return self.where[name].get_tensor(name)

    def __iter__(self) -> Any:
        return iter(self.where)

    def __len__(self) -> int:
        return len(self.where)


_Where = dict[str, tuple[Path, str]]  # HF name -> (file, name in that file)


def _locate(
    files: list[Path], expected: dict[str, Any], args: ModelArgs, block: tuple[int, int] | None
) -> tuple[_Where, dict[str, _Where], _Where]:
    """Where each expected HF tensor lies: (file, name in that file) per HF name, checking every
    stored tensor's name, dtype and shape against `expected` (HF name -> shape) without reading
    data. Also the MXFP4 experts' blocks and scales, and the block-scaled fp8 weights' scales
    (`block`: the checkpoint's fp8 block size, or None)."""
    family = args.family
    where: _Where = {}
    mx: dict[str, _Where] = {}  # MXFP4: HF name -> its blocks and scales
    fp8: _Where = {}  # block-scaled fp8: HF name -> its scales
    for file in files:
        with _open_safetensors(file) as f:
            for stored in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                name = _text_tensor_name(stored)
                if name is None or name.endswith("rotary_emb.inv_freq"):
                    continue  # vision tower, or the rope buffer old exports saved
                if args.tie_embeddings and name == "lm_head.weight":
                    continue  # a tied checkpoint may carry the shared tensor twice
                if name not in expected and _unused(name, args):
                    continue
                if block and name.endswith(FP8_SCALE) and name[: -len(FP8_SCALE)] in expected:
                    fp8[name[: -len(FP8_SCALE)]] = (file, stored)
                    continue
                base, suffix = name[:-7], name[-7:]
                if suffix in MX_SUFFIXES and base in expected:  # MXFP4 experts
                    mx.setdefault(base, {})[suffix] = (file, stored)
                    if suffix == "_blocks":
                        shape = mxfp4_shape(tuple(f.get_slice(stored).get_shape()))
                        _check_shape(stored, shape, expected[base], file)
                    continue
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
                _check_shape(stored, shape, expected[name], file)
                where[name] = (file, stored)
    for base, parts in mx.items():
        if len(parts) == 2:
            where[base] = parts["_blocks"]
    return where, mx, fp8


def _check_shape(stored: str, shape: Any, want: Any, file: Path) -> None:
    if list(shape) != list(want):
        raise UserError(
            f"{stored}: checkpoint has {_shape(shape)}, model expects {_shape(want)}; "
            f"config.json does not match the weights in {file}"
        )


def _read_mxfp4(
    target: Tensor,
    readers: dict[Path, Any],
    parts: dict[str, tuple[Path, str]],
    dtype: torch.dtype,
    to_native: Callable[[Tensor], Tensor] | None,
) -> None:
    """Dequantize an MXFP4 tensor ([E, ...] blocks and scales) into `target`, one expert at a
    time (host memory: one expert's weights)."""
    (bfile, bname), (sfile, sname) = parts["_blocks"], parts["_scales"]
    blocks = readers[bfile].get_slice(bname)
    scales = readers[sfile].get_slice(sname)
    for e in range(target.shape[0]):
        dense = dequantize_mxfp4(blocks[e : e + 1], scales[e : e + 1], dtype).transpose(-1, -2)
        target[e : e + 1].copy_(dense if to_native is None else to_native(dense))
    if not bool(torch.isfinite(target).all()):
        raise UserError(f"{bfile}: MXFP4 tensor {bname!r} holds NaN or Inf values")


def _unused(name: str, args: ModelArgs) -> bool:
    """Is checkpoint tensor `name` one the model leaves unused: key/value weights in a layer that
    attends over an earlier layer's keys and values, or the multi-token-prediction layers some
    families store after the last one (`Family.extra_layers_unused`; transformers skips them
    too)?"""
    m = HF_BLOCK.fullmatch(name)
    fam = FAMILIES.get(args.family)
    if m and int(m.group(1)) >= args.n_layers and fam is not None and fam.extra_layers_unused:
        return True
    return bool(m and args.kv_mode(int(m.group(1))) == "reuse" and m.group(2) in UNUSED_IN_REUSE)


def fp8_block(cfg: dict) -> tuple[int, int] | None:
    """The block of a block-scaled fp8 checkpoint (quantization_config quant_method "fp8",
    weight_block_size [rows, cols]), else None."""
    quant = cfg.get("quantization_config")
    if not (isinstance(quant, dict) and quant.get("quant_method") == "fp8"):
        return None
    block = quant.get("weight_block_size")
    if not (
        isinstance(block, list)
        and len(block) == 2
        and all(isinstance(n, int) and n > 0 for n in block)
    ):
        raise UserError(
            "config.json quantization_config (fp8) needs weight_block_size [rows, cols]; "
            "per-tensor fp8 checkpoints are not read: dequantize them to bf16 first"
        )
    return block[0], block[1]


def _read_fp8(
    target: Tensor,
    readers: dict[Path, Any],
    weight: tuple[Path, str],
    scales: tuple[Path, str],
    block: tuple[int, int] | None,
) -> None:
    """Dequantize one block-scaled fp8 weight into `target` (host memory: that weight)."""
    assert block is not None
    (wfile, wname), (sfile, sname) = weight, scales
    try:
        dense = dequantize_fp8_blocks(
            readers[wfile].get_tensor(wname), readers[sfile].get_tensor(sname), block, target.dtype
        )
    except ValueError as e:
        raise UserError(
            f"{wfile}: fp8 tensor {wname!r}: {e}; the checkpoint is inconsistent"
        ) from e
    target.copy_(dense)
    if not bool(torch.isfinite(target).all()):
        raise UserError(f"{wfile}: fp8 tensor {wname!r} holds NaN or Inf values")


def _read_into(
    target: Tensor,
    reader: Any,
    file: Path,
    stored: str,
    dtype: torch.dtype,
    to_native: Callable[[Tensor], Tensor] | None = None,
) -> None:
    """Copy tensor `stored` of an open safetensors file into `target` (through `to_native` when
    the checkpoint lays it out otherwise), checking it is finite."""
    try:
        tensor = reader.get_tensor(stored)
    except Exception as e:  # SafetensorError: data cut short or unreadable
        raise UserError(
            f"{file}: cannot read tensor {stored!r} ({brief(e)}); the file is "
            "truncated or corrupt: copy or download it again"
        ) from e
    target.copy_(tensor if to_native is None else to_native(tensor))
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


def _converted(to_hf: Callable[[Tensor], Tensor], make: Callable[[], Tensor]) -> Tensor:
    return to_hf(make()).contiguous()


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
        if strip_wrappers(name).startswith(TOWER + "."):
            continue  # a vision tower's tensors: `_vision_entries`
        make = functools.partial(_gathered, gather, dense)
        pieces = hf_pieces(name, shape, args.family)
        if len(pieces) > 1:
            shared = _Shared(make, len(pieces))
            out += [(hf, piece, functools.partial(shared.piece, i)) for hf, i, piece in pieces]
            continue
        hf, _, stored_shape = pieces[0]
        if args.tie_embeddings and hf == "lm_head.weight":
            continue
        convert = layout(name, args.family)
        if convert is not None:
            make = functools.partial(_converted, convert[1], make)
        out.append((hf, stored_shape, make))
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
    larger than `max_shard_bytes`) and, if given, the tokenizer files; generation_config.json
    as models/generation_config.py says (the source's, with the template's end of turn).

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
    if isinstance(model, VisionLanguageModel):  # the ForConditionalGeneration checkpoint
        renamed = [(text_checkpoint_name(model.vision, n), s, f) for n, s, f in entries]
        entries = renamed + model.tower_entries(gather=full_tensor, merge=merge_lora)
        cfg = vision_config(model, cfg, dtype)
    write_hf_folder(
        path,
        cfg,
        entries,
        dtype,
        tokenizer=tokenizer,
        generation_config=getattr(model, "generation_config", None),
        max_shard_bytes=max_shard_bytes,
        writer=writer,
    )
    if writer and isinstance(model, VisionLanguageModel):
        model.write_processor_files(Path(path))


def write_hf_folder(
    path: str | os.PathLike,
    config: dict[str, Any],
    entries: list[tuple[str, tuple[int, ...], Callable[[], Tensor]]],
    dtype: torch.dtype,
    *,
    tokenizer: Any = None,
    generation_config: dict[str, Any] | None = None,
    max_shard_bytes: int = 5 * 2**30,
    writer: bool = True,
) -> None:
    """Write `config` and the tensors of `entries` (HF name, shape, fetch) as an HF folder,
    with the tokenizer's files and generation_config.json (`write_side_files`).

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
    write_side_files(path, tokenizer, generation_config)
