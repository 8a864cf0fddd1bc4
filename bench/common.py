"""What every bench result carries: device, torch version, git commit; and how it is written."""

from __future__ import annotations

import json
import platform
import subprocess
import time
from pathlib import Path
from typing import Any

import torch


def device_name() -> str:
    """'cpu' or a GPU's short name, e.g. 'h100' / 'h200' (used in result file names)."""
    if not torch.cuda.is_available():
        return "cpu"
    name = torch.cuda.get_device_name().lower()
    for short in ("h200", "h100", "a100", "l40s", "a10g", "4090"):
        if short in name:
            return short
    return name.replace(" ", "-")


def git_commit() -> str:
    try:
        return subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            cwd=Path(__file__).parent,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def result_header() -> dict[str, Any]:
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else platform.processor()
    return {
        "device": device_name(),
        "device_detail": device or platform.machine(),
        "cpu_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "commit": git_commit(),
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
    }


def write_result(path: Path, result: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")
