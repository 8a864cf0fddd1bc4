"""`compiletune export --gguf f16|q8_0 FOLDER [-o OUT.gguf]`: a GGUF file for llama.cpp, Ollama
and LM Studio from a checkpoint folder (docs/export.md).

FOLDER is an HF model folder: a run's `step_N/` or `merged/`. A LoRA run's `step_N/` (an adapter
folder) is merged first, as `--merge` would, into a temporary folder beside the output, which is
removed afterwards. A sharded (--fsdp) step is refused with the `convert` command that makes it
an HF folder.

The file is written tensor by tensor (one tensor in memory at a time) under a temporary name in
the output's folder and renamed when complete, so an error or a full disk leaves no partial file.

    config.json            -> general.* and {arch}.* keys      (gguf_arch.metadata)
    tokenizer files         -> tokenizer.* keys, chat template  (gguf_vocab.read_vocab)
    *.safetensors          -> tensors, llama.cpp's names: 1-D ones (norms, biases) F32, the rest
                              F16, or Q8_0 where a row is a whole number of 32-value blocks (the
                              rest F16, as llama.cpp's own converter does)
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import numpy as np
from safetensors import safe_open
from tqdm import tqdm

from compiletune import faults
from compiletune.errors import UserError

KINDS = ("f16", "q8_0")
_Q8_BLOCK = 32  # values per Q8_0 block (one fp16 scale + 32 int8)


def _require_gguf() -> Any:
    """The gguf package, or one line naming the extra that installs it."""
    try:
        # deferred: gguf is an optional extra, needed by this command only
        import gguf
    except ImportError:
        raise UserError(
            "compiletune export --gguf needs the gguf package: pip install 'compiletune[gguf]'"
        ) from None
    return gguf


def _safetensors(folder: Path) -> list[Path]:
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise UserError(f"{folder} holds config.json but no *.safetensors weights")
    return files


def _end_ids(folder: Path, cfg: dict[str, Any], tokenizer: Any) -> list[int]:
    """The ids that end a reply: generation_config.json's, config.json's, the chat template's."""
    # deferred: compiletune.models imports torch; the refusals before this need none of it
    from compiletune.models.generation_config import (
        end_of_turn_id,
        eos_ids,
        load_generation_config,
    )

    settings = load_generation_config(folder) or {}
    ids = eos_ids(settings.get("eos_token_id")) + eos_ids(cfg.get("eos_token_id"))
    eot = end_of_turn_id(tokenizer)
    ids += [eot] if eot is not None else []
    return list(dict.fromkeys(ids))


def _file_type(gguf: Any, shape: tuple[int, ...], kind: str) -> Any:
    """The ggml type a tensor is stored as."""
    T = gguf.GGMLQuantizationType
    if len(shape) < 2:
        return T.F32  # norms and biases: small, and llama.cpp reads them as F32
    if kind == "q8_0" and shape[-1] % _Q8_BLOCK == 0:
        return T.Q8_0
    return T.F16


def _encode(gguf: Any, value: np.ndarray, qtype: Any) -> np.ndarray:
    T = gguf.GGMLQuantizationType
    if qtype == T.F32:
        return np.ascontiguousarray(value, dtype=np.float32)
    if qtype == T.F16:
        return np.ascontiguousarray(value, dtype=np.float16)
    return gguf.quants.quantize(np.ascontiguousarray(value, dtype=np.float32), qtype)


def _plan(gguf: Any, folder: Path, names: Any, kind: str) -> list[tuple[str, str, Path, Any]]:
    """(gguf name, HF name, safetensors file, (shape, ggml type)) for every tensor the file
    holds, in the checkpoint's order."""
    plan = []
    for file in _safetensors(folder):
        with safe_open(file, framework="pt") as f:
            for hf_name in f.keys():  # noqa: SIM118 (safe_open is not iterable)
                target = names.gguf_name(hf_name)
                if target is None:
                    continue
                shape = tuple(f.get_slice(hf_name).get_shape())
                plan.append((target, hf_name, file, shape))
    return [(t, h, file, (shape, _file_type(gguf, shape, kind))) for t, h, file, shape in plan]


def _files(plan: list[tuple[str, str, Path, Any]]) -> list[Path]:
    return list(dict.fromkeys(file for _, _, file, _ in plan))


def _declare(gguf: Any, writer: Any, name: str, shape: tuple[int, ...], qtype: Any) -> None:
    """Add a tensor's entry (name, shape, type, size) to the writer's table before any data."""
    T = gguf.GGMLQuantizationType
    if qtype == T.Q8_0:
        byte_shape = gguf.quant_shape_to_byte_shape(shape, qtype)
        writer.add_tensor_info(
            name, byte_shape, np.dtype(np.uint8), int(np.prod(byte_shape)), qtype
        )
    else:
        dtype = np.dtype(np.float16 if qtype == T.F16 else np.float32)
        writer.add_tensor_info(name, shape, dtype, int(np.prod(shape)) * dtype.itemsize)


def _write(
    gguf: Any,
    folder: Path,
    cfg: dict[str, Any],
    tokenizer: Any,
    tmp: Path,
    kind: str,
    warn: Callable[[str], None],
) -> int:
    """Write the whole file to `tmp`; returns the number of tensors."""
    # deferred: gguf_arch imports the optional gguf package at its top
    from compiletune import gguf_arch, gguf_vocab

    fam = gguf_arch.family_of(cfg, folder)
    names = gguf_arch.TensorNames(cfg, fam)
    plan = _plan(gguf, folder, names, kind)
    embed = [shape for t, _, _, (shape, _) in plan if t == "token_embd.weight"]
    vocab = gguf_vocab.read_vocab(
        folder,
        tokenizer,
        embed[0][0] if embed else cfg["vocab_size"],
        _end_ids(folder, cfg, tokenizer),
    )
    for line in vocab.warnings:
        warn(line)

    writer = gguf.GGUFWriter(None, gguf.MODEL_ARCH_NAMES[fam.arch])
    # "RUN-step_N": a step folder's own name says little (and a general.name of exactly
    # "mistral" makes transformers' reader look for an architecture gguf does not have)
    where = folder.resolve()
    writer.add_name(f"{where.parent.name}-{where.name}")
    ftype = gguf.LlamaFileType.MOSTLY_Q8_0 if kind == "q8_0" else gguf.LlamaFileType.MOSTLY_F16
    writer.add_file_type(ftype)
    if kind == "q8_0":
        writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    for method, value in gguf_arch.metadata(cfg, fam, folder).items():
        getattr(writer, method)(value)
    gguf_vocab.write_vocab(writer, vocab)

    extra: dict[str, np.ndarray] = {}
    params, _ = gguf_arch.rope_parameters(cfg)
    if fam.interleave_qk and (params.get("rope_type") or params.get("type")) == "llama3":
        extra["rope_freqs.weight"] = np.asarray(gguf_arch.llama3_rope_factors(cfg), np.float32)
    for name, value in extra.items():
        _declare(gguf, writer, name, value.shape, gguf.GGMLQuantizationType.F32)
    for target, _, _, (shape, qtype) in plan:
        _declare(gguf, writer, target, shape, qtype)

    writer.open_output_file(tmp)
    try:
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        for value in extra.values():
            writer.write_tensor_data(value)
        with ExitStack() as files:
            opened = {f: files.enter_context(safe_open(f, framework="pt")) for f in _files(plan)}
            for target, hf_name, file, (_, qtype) in tqdm(plan, desc="export", unit="tensor"):
                value = opened[file].get_tensor(hf_name).float().numpy()  # one tensor at a time
                writer.write_tensor_data(_encode(gguf, names.convert(target, value), qtype))
                faults.point("gguf_tensor")
        writer.flush()
        for out in writer.fout or []:
            os.fsync(out.fileno())
    finally:
        writer.close()
    return len(plan) + len(extra)


def _merged_lora(folder: Path, into: Path) -> Path:
    """A LoRA step folder merged (base + adapters folded) into the HF folder `into`/merged."""
    # deferred: loading a LoRA checkpoint pulls the model code, needed only for adapter folders
    from compiletune.checkpoint import adapter_io
    from compiletune.data.tokenizer import load_tokenizer
    from compiletune.generate import _tokenizer_folder, adapter_base, load_lora_checkpoint
    from compiletune.train.device import pick_device

    base, saved = adapter_base(folder)
    tokenizer = load_tokenizer(_tokenizer_folder(folder, base))
    model = load_lora_checkpoint(folder, None, pick_device(), (base, saved)).eval()
    return adapter_io.save_merged(model, into / "merged", tokenizer=tokenizer)


def default_output(folder: Path, kind: str) -> Path:
    """FOLDER's sibling FOLDER-KIND.gguf (RUN/step_100 -> RUN/step_100-q8_0.gguf)."""
    folder = folder.resolve()
    return folder.parent / f"{folder.name}-{kind}.gguf"


def export_gguf(
    step_dir: str | os.PathLike,
    kind: str,
    output: str | os.PathLike | None = None,
    log: Callable[[str], None] = print,
) -> Path:
    """Write the GGUF file of checkpoint folder `step_dir` as `kind` (f16 | q8_0); returns its path."""
    if kind not in KINDS:
        raise UserError(f"--gguf {kind}: choose one of {', '.join(KINDS)}")
    gguf = _require_gguf()
    folder = Path(step_dir)
    if not folder.is_dir():
        raise UserError(f"{folder}: no such folder; pass a run's step_N or merged/ folder")
    out = Path(output) if output is not None else default_output(folder, kind)
    if out.suffix != ".gguf":
        raise UserError(f"-o {out}: name the file *.gguf")
    if not out.parent.is_dir():
        raise UserError(f"-o {out}: the folder {out.parent} does not exist; create it first")
    t0 = time.perf_counter()
    if not (folder / "config.json").is_file() and (folder / "adapter_config.json").is_file():
        log(f"{folder} is a LoRA adapter: merging it into its base first (as --merge does)")
        with tempfile.TemporaryDirectory(dir=out.parent, prefix=".merge-") as scratch:
            merged = _merged_lora(folder, Path(scratch))
            return export_gguf(merged, kind, out, log)
    if not (folder / "config.json").is_file():
        raise UserError(
            f"{folder} holds no config.json: pass an HF folder (a run's step_N or merged/); a "
            f"sharded --fsdp step becomes one with `compiletune convert {folder} HF_DIR`"
        )
    try:
        cfg = json.loads((folder / "config.json").read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UserError(f"{folder / 'config.json'}: not valid JSON ({e}); fix it") from None
    # deferred: gguf_arch imports the optional gguf package at its top
    from compiletune import gguf_arch

    fam = gguf_arch.family_of(cfg, folder)  # before any heavy import
    # deferred: transformers (seconds of imports) after the checks above; its config class fills
    # the fields a config.json may leave at their defaults (Phi-3's rms_norm_eps is not Llama's)
    from transformers import AutoConfig

    # deferred: it imports compiletune.models (torch), which the refusals above need none of
    from compiletune.data.tokenizer import load_tokenizer

    cfg = AutoConfig.from_pretrained(folder).to_dict()
    gguf_arch.metadata(cfg, fam, folder)  # refuse what llama.cpp would run differently
    tokenizer = load_tokenizer(folder)
    log(f"exporting {folder} ({cfg.get('model_type')}) as {kind} to {out}")
    tmp = out.parent / f".tmp-{out.name}"
    try:
        count = _write(gguf, folder, cfg, tokenizer, tmp, kind, lambda m: log(f"warning: {m}"))
        os.replace(tmp, out)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise UserError(
            f"-o {out}: writing failed ({e.strerror or e}); nothing was written, free space "
            "or pass another -o"
        ) from e
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    size = out.stat().st_size / 2**30
    log(f"wrote {out} ({size:.2f} GiB, {count} tensors) in {time.perf_counter() - t0:.1f}s")
    return out
