"""Checkpoints: an HF-format folder per step plus the training state beside the weights.

Layout of `OUTPUT_DIR/step_N/`:
    config.json, model*.safetensors (+ index), tokenizer files   -> loads in transformers as is
    trainer_state.pt                                              -> optimizer, schedule, data, RNG

Under FSDP (`--fsdp`) a checkpoint is sharded instead:
    sharded/                  torch.distributed.checkpoint: each rank's model shards and its
                              optimizer state, written in parallel
    config.json, tokenizer    the architecture (`compiletune convert` needs it)
    model*.safetensors        only at the end of the run: exported tensor by tensor
    trainer_state.pt          step, data position, RNG, config, number of ranks
A resume under FSDP may use another number of processes (or --ep): each reads its shards of
the whole tensors saved (`check_resumable` says where it cannot).

A LoRA run under FSDP writes the same adapter folder as one process (adapter_config.json,
adapter_model.safetensors: rank 0 writes the adapters gathered whole) plus `sharded/` with each
rank's optimizer state only; the frozen base is rebuilt from the run's source on resume.

A checkpoint is written under a temporary name and renamed when complete. A rename within one
folder is atomic, so a crash mid-save leaves only a `.tmp-step_N` folder that `--resume` ignores.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from compiletune import faults
from compiletune.checkpoint.adapter_io import ADAPTER_CONFIG, ADAPTER_WEIGHTS, save_adapter
from compiletune.checkpoint.atomic import fsync_tree, publish, write_folder_atomically
from compiletune.distributed import (
    SHARDED_DIR,
    agree,
    attempt,
    read_sharded_tensor,
    save_sharded,
    sharded_damage,
    sharded_model_tensors,
)
from compiletune.errors import UserError
from compiletune.expert_parallel import whole_experts
from compiletune.models import (
    Transformer,
    args_from_hf_config,
    hf_config_from_args,
    load_hf_config,
    save_hf,
    to_hf_name,
    write_hf_folder,
)
from compiletune.models.generation_config import write_side_files
from compiletune.models.hf import checkpoint_files
from compiletune.models.hf_config import brief
from compiletune.models.lora import is_lora

STATE_FILE = "trainer_state.pt"
_STEP_DIR = re.compile(r"^step_(\d+)$")


def rng_state() -> dict[str, Any]:
    state = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        # one state per GPU the saving process saw: a run resumed where fewer are visible (a
        # smaller node, CUDA_VISIBLE_DEVICES, one process) restores those it has
        saved = state["cuda"]
        for i in range(min(len(saved), torch.cuda.device_count())):
            torch.cuda.set_rng_state(saved[i], i)


def list_checkpoints(output_dir: Path) -> list[tuple[int, Path]]:
    """Complete checkpoints in `output_dir`, oldest first."""
    if not output_dir.is_dir():
        return []
    found = []
    for child in output_dir.iterdir():
        m = _STEP_DIR.match(child.name)
        if m and child.is_dir() and (child / STATE_FILE).is_file():
            found.append((int(m.group(1)), child))
    return sorted(found)


def checkpoint_damage(ckpt: Path) -> str | None:
    """Why `ckpt` (a step_N folder) cannot be resumed from, as a sentence; None when it looks
    whole: a readable training state and all of its weights (the HF files, the adapter, or every
    shard of a sharded checkpoint)."""
    if not (ckpt / STATE_FILE).is_file():
        return f"{ckpt} has no {STATE_FILE}"
    try:
        load_train_state(ckpt)
        if is_sharded(ckpt):
            return sharded_damage(ckpt / SHARDED_DIR)
        if (ckpt / ADAPTER_CONFIG).is_file():
            if not (ckpt / ADAPTER_WEIGHTS).is_file():
                return f"{ckpt} has no {ADAPTER_WEIGHTS}"
            return None
        if not (ckpt / "config.json").is_file():
            return f"{ckpt} has no config.json"
        checkpoint_files(ckpt)
    except UserError as e:
        return str(e)
    return None


def pick_resume(output_dir: Path, chosen: str | None, say: Callable[[str], None]) -> Path:
    """The checkpoint `--resume` continues from: `chosen` (--resume-from step_N or N), or the
    newest whole one, saying which newer ones were passed over and why."""
    found = sorted(
        (int(m.group(1)), child)
        for child in output_dir.iterdir()
        if (m := _STEP_DIR.match(child.name)) and child.is_dir()
    )
    if chosen is not None:
        step = int(chosen.removeprefix("step_"))
        match = [path for n, path in found if n == step]
        if not match:
            have = ", ".join(path.name for _, path in found) or "none"
            raise UserError(
                f"--resume-from {chosen}: {output_dir} has no step_{step} (checkpoints: {have})"
            )
        if damage := checkpoint_damage(match[0]):
            raise UserError(f"--resume-from {chosen}: {damage}; choose another step_N")
        return match[0]
    passed: list[str] = []
    for _, path in reversed(found):
        damage = checkpoint_damage(path)
        if damage is None:
            if passed:
                say(
                    f"--resume: continuing from {path.name}, the newest whole checkpoint; "
                    + "; ".join(passed)
                    + " (--resume-from step_N picks another)"
                )
            return path
        passed.append(f"{path.name} cannot be used ({damage})")
    raise UserError(
        f"--resume: {output_dir} holds no checkpoint to continue from"
        + (f": {'; '.join(passed)}" if passed else "")
        + "; drop --resume to start a new run"
    )


def latest_checkpoint(output_dir: Path) -> Path | None:
    found = list_checkpoints(output_dir)
    return found[-1][1] if found else None


def save_checkpoint(
    output_dir: Path,
    step: int,
    model: torch.nn.Module,
    tokenizer: Any,
    train_state: dict[str, Any],
) -> Path:
    """Write `output_dir/step_{step}` atomically and return its path. A LoRA model's checkpoint
    holds its adapter folder (compiletune/lora.py) instead of the weights."""

    def write(tmp: Path) -> None:
        if is_lora(model):
            save_adapter(model, tmp, tokenizer=tokenizer)
        else:
            save_hf(model, tmp, tokenizer=tokenizer)
        faults.point("save")  # the weights are written, the training state not yet
        torch.save(train_state, tmp / STATE_FILE)

    return write_folder_atomically(output_dir / f"step_{step}", write)


def is_sharded(ckpt: Path) -> bool:

    return (ckpt / SHARDED_DIR).is_dir()


def check_resumable(
    ckpt: Path, state: dict[str, Any], world: int | None, sharding: str | None = None
) -> None:
    """A single-process checkpoint resumes in a single process, a sharded one under FSDP on any
    number of processes (the weights and AdamW's moments are saved as whole tensors and
    resharded on load), but for 8-bit AdamW's state, which resumes on as many processes as
    wrote it. world None: no FSDP."""
    if is_sharded(ckpt):
        saved = state.get("world_size")
        if world is None and (ckpt / "adapter_config.json").is_file():
            raise UserError(
                f"{ckpt} is a LoRA checkpoint of an FSDP run of {saved} processes; resume it "
                "with --fsdp (on any number of processes, one included; its adapter folder "
                "loads in peft as is)"
            )
        if world is None:
            raise UserError(
                f"{ckpt} is a sharded (FSDP) checkpoint of {saved} processes; resume it with "
                "--fsdp (on any number of processes, one included), or turn it into an HF "
                "folder with `compiletune convert` and start a new run from it with --model-dir"
            )
        config = state.get("config", {})
        if sharding is not None and config.get("sharding", sharding) != sharding:
            raise UserError(
                f"{ckpt} was written with --sharding {config.get('sharding')}; resume with the "
                "same --sharding (each rank's optimizer state has that layout)"
            )
        if saved != world and config.get("optimizer") == "adamw8bit":
            raise UserError(
                f"{ckpt} holds 8-bit AdamW state of {saved} processes, quantized in blocks of "
                f"each process's own shard, which {world} process{'es' * (world > 1)} cut "
                f"differently; resume with {saved} processes"
            )
    elif world is not None:
        raise UserError(
            f"{ckpt} is a single-process checkpoint; resume it without --fsdp, or start a new "
            f"FSDP run from its weights with --model-dir {ckpt}"
        )


def save_sharded_checkpoint(
    output_dir: Path,
    step: int,
    model: torch.nn.Module,
    tokenizer: Any,
    train_state: dict[str, Any],
    optimizer_state: dict[str, Any],
    *,
    is_main: bool,
    export_hf: bool,
    describe: Callable[[BaseException], str],
) -> Path:
    """Every rank calls this. Writes `output_dir/step_{step}` atomically (rank 0 renames it once
    all ranks are done); `export_hf` also writes the HF weights, gathered tensor by tensor.

    It goes in four parts (make the folder; every rank's shards; the export or config; the
    training state and the rename), and the ranks agree after each (`distributed.agree`): a
    failure on any rank (a full disk, described by `describe`) is raised on every rank as the
    same one line at that point, and the half-written folder is removed."""

    final = output_dir / f"step_{step}"
    tmp = output_dir / f".tmp-step_{step}"
    lora = is_lora(model)

    def make_folder() -> None:
        if is_main:
            if tmp.exists():
                shutil.rmtree(tmp)
            tmp.mkdir(parents=True)

    def shards() -> None:
        # A LoRA run's sharded/ holds the optimizer state alone; its base is the run's source.
        save_sharded(tmp / SHARDED_DIR, None if lora else model, optimizer_state)

    def weights() -> None:
        if lora or export_hf:
            # --ep: a LoRA run's expert adapters gathered whole first; the HF export gathers
            # each expert tensor as it writes it (models/lora.dense_tensors)
            with whole_experts(model, trainable_only=True) if lora else contextlib.nullcontext():
                if lora:  # the adapter folder a single process writes
                    save_adapter(model, tmp, tokenizer=tokenizer, writer=is_main)
                else:
                    save_hf(model, tmp, tokenizer=tokenizer, writer=is_main)
        elif is_main:
            dtype = next(model.parameters()).dtype
            cfg = hf_config_from_args(model.args, dtype, base=getattr(model, "hf_config", None))
            (tmp / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
            write_side_files(tmp, tokenizer, getattr(model, "generation_config", None))

    def state() -> None:
        if is_main:
            faults.point("state")
            torch.save(train_state, tmp / STATE_FILE)
            fsync_tree(tmp)
            publish(tmp, final)

    try:
        for part in (make_folder, shards, weights, state):
            agree(attempt(part), describe)
    except UserError:
        if is_main:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


def load_train_state(ckpt: Path) -> dict[str, Any]:

    path = ckpt / STATE_FILE
    try:
        # Memory-mapped: the optimizer takes the loaded tensors as its state (optim.py), so a
        # resume never holds a second copy of it.
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as e:  # a state we cannot read must not be silently skipped
        raise UserError(
            f"{path}: cannot read the training state ({brief(e)}); delete {ckpt} to resume from "
            "the checkpoint before it"
        ) from e
    needed = {"step", "data", "rng"}
    if (
        not isinstance(state, dict)
        or not needed <= set(state)
        or not isinstance(state["step"], int)
    ):
        found = sorted(state)[:8] if isinstance(state, dict) else type(state).__name__
        raise UserError(
            f"{path}: not a compiletune training state (needs {sorted(needed)}, found {found}); "
            f"delete {ckpt} to resume from the checkpoint before it"
        )
    if "optimizer" not in state and "world_size" not in state:
        raise UserError(f"{path}: the training state holds no optimizer state; delete {ckpt}")
    return state


def convert_to_hf(src: str | os.PathLike, dst: str | os.PathLike, dtype: str | None = None) -> Path:
    """Turn a sharded (FSDP) checkpoint folder into an HF folder, one tensor at a time (no
    process group, no GPU; host memory: one safetensors shard)."""

    src, dst = Path(src), Path(dst)
    if not is_sharded(src):
        hint = " (it is already an HF folder)" if (src / "config.json").is_file() else ""
        raise UserError(
            f"{src} holds no sharded checkpoint ({SHARDED_DIR}/){hint}; pass a step_N folder "
            "of an --fsdp run"
        )
    if (src / "adapter_config.json").is_file():
        raise UserError(
            f"{src} is a LoRA checkpoint: its adapter folder loads in peft as is, and "
            "`--merge` writes the merged model; there is nothing to convert"
        )
    if dst.exists() and any(dst.iterdir()):
        raise UserError(f"{dst} exists and is not empty; pass a new folder")
    if damage := sharded_damage(src / SHARDED_DIR):
        raise UserError(f"{src} is damaged: {damage}; convert another step_N of the run")
    hf_cfg = load_hf_config(src)
    args = args_from_hf_config(hf_cfg)
    saved = sharded_model_tensors(src / SHARDED_DIR)
    with torch.device("meta"):
        model = Transformer(args)
    entries = []
    for name, p in model.named_parameters():  # model order; a tied head appears once
        if name not in saved:
            raise UserError(
                f"{src}: the sharded checkpoint has no tensor {name!r}; it is incomplete"
            )
        shape, saved_dtype = saved[name]
        if tuple(p.shape) != shape:
            raise UserError(f"{src}: {name} is {shape} but config.json implies {tuple(p.shape)}")
        entries.append(
            (
                to_hf_name(name, args.family),
                shape,
                lambda n=name, s=shape, d=saved_dtype: read_sharded_tensor(
                    src / SHARDED_DIR, n, s, d
                ),
            )
        )
    if args.tie_embeddings:
        entries = [e for e in entries if e[0] != "lm_head.weight"]
    out_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, None: None}[dtype]
    out_dtype = out_dtype or next(iter(saved.values()))[1]

    def write(folder: Path) -> None:
        write_hf_folder(
            folder, hf_config_from_args(args, out_dtype, base=hf_cfg), entries, out_dtype
        )
        faults.point("convert")
        for extra in src.iterdir():  # tokenizer files and anything else beside the weights
            if not extra.is_file() or extra.name in ("config.json", STATE_FILE):
                continue
            if extra.name.startswith("model") and extra.name.endswith((".safetensors", ".json")):
                continue  # the run's own export (last checkpoint): ours replaces it
            shutil.copy2(extra, folder / extra.name)

    # Whole or not at all: a killed convert leaves only `.tmp-<name>`, never a folder that
    # looks like a model and is not.
    return write_folder_atomically(dst, write)
