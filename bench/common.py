"""What every bench result carries: device, torch version, git commit; and how it is written."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
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


def run_train(args: list[str], cache_dir: str, workdir: Path) -> dict[str, Any]:
    """One `compiletune train` process with its own Inductor cache folder; returns the run's
    summary.json plus `step_times` and `tokens_per_step` from its metrics.jsonl."""
    out = workdir / f"run{len(list(workdir.iterdir()))}"
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache_dir}
    cmd = [sys.executable, "-m", "compiletune", "train", *args, "--output-dir", str(out)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"bench run failed: {' '.join(cmd)}\n{proc.stderr[-3000:]}")
    summary = json.loads((out / "summary.json").read_text())
    steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    summary["step_times"] = [r["step_time_s"] for r in steps]
    summary["tokens_per_step"] = steps[0]["tokens"]
    return summary
