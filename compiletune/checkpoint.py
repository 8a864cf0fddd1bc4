"""Checkpoints: an HF-format folder per step plus the training state beside the weights.

Layout of `OUTPUT_DIR/step_N/`:
    config.json, model*.safetensors (+ index), tokenizer files   -> loads in transformers as is
    trainer_state.pt                                              -> optimizer, schedule, data, RNG

A checkpoint is written under a temporary name and renamed when complete. A rename within one
folder is atomic, so a crash mid-save leaves only a `.tmp-step_N` folder that `--resume` ignores.
"""

from __future__ import annotations

import os
import random
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from compiletune.errors import UserError

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
        torch.cuda.set_rng_state_all(state["cuda"])


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
    from compiletune.models import save_hf
    from compiletune.models.lora import is_lora

    def write(tmp: Path) -> None:
        if is_lora(model):
            from compiletune.lora import save_adapter

            save_adapter(model, tmp, tokenizer=tokenizer)
        else:
            save_hf(model, tmp, tokenizer=tokenizer)
        torch.save(train_state, tmp / STATE_FILE)

    return write_folder_atomically(output_dir / f"step_{step}", write)


def write_folder_atomically(final: Path, write: Callable[[Path], None]) -> Path:
    """`write(tmp)` fills a temporary sibling `.tmp-<name>`, which then replaces `final`."""
    tmp = final.parent / f".tmp-{final.name}"
    if tmp.exists():
        shutil.rmtree(tmp)
    write(tmp)
    _fsync_tree(tmp)
    if final.exists():  # re-saving a step (e.g. after a resume): swap, never delete first
        old = final.parent / f".old-{final.name}"
        if old.exists():
            shutil.rmtree(old)
        os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old)
    else:
        os.replace(tmp, final)
    return final


def load_train_state(ckpt: Path) -> dict[str, Any]:
    path = ckpt / STATE_FILE
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # a state we cannot read must not be silently skipped
        raise UserError(f"{path}: cannot read the training state ({e}); delete {ckpt}") from e


def _fsync_tree(folder: Path) -> None:
    """Flush file contents to disk before the rename makes the checkpoint visible."""
    for child in folder.iterdir():
        if child.is_file():
            fd = os.open(child, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
