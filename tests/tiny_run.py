"""The one way tests start a small in-process training run (what `compiletune train` does)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from compiletune import before_train
from compiletune.config import resolve
from compiletune.train.loop import train


def tiny_run(tmp_path: Path, data: str, name: str = "run", **overrides: Any) -> dict:
    """Train on `data` into tmp_path/name; defaults: seq 32, batch 2, 6 steps. Returns the
    summary. As the CLI's train command: on a GPU the pre-flight (and --offload-activations
    auto's plan) first."""
    values = {"data": data, "seq_len": 32, "batch_size": 2, "max_steps": 6}
    values |= {"output_dir": str(tmp_path / name), **overrides}
    return train(*before_train.prepare(resolve({}, values)))
