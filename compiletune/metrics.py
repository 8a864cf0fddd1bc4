"""Per-step metrics: `OUTPUT_DIR/metrics.jsonl`, one JSON object per optimizer step."""

from __future__ import annotations

import json
import math
import resource
import sys
from pathlib import Path
from typing import Any

import torch


def peak_memory_gib(device: torch.device) -> float:
    """Peak memory of this process so far, in GiB.

    On a GPU: the caching allocator's peak of allocated bytes (`max_memory_allocated`).
    On CPU: the process's peak resident set size, which also counts the Python runtime,
    libraries and the dataset, so it reads higher than the tensors alone.
    """
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    # ru_maxrss is in KiB on Linux and in bytes on macOS.
    return rss / (2**30 if sys.platform == "darwin" else 2**20)


def perplexity(loss: float) -> float:
    """exp(mean loss per target token); inf where that overflows a float."""
    return math.exp(loss) if loss < 700 else math.inf


class MetricsLog:
    """Appends one line per step and flushes it, so a crash loses at most the current step."""

    def __init__(self, path: Path, resume_step: int | None = None) -> None:
        self.path = path
        if resume_step is not None and path.exists():
            # Steps after the checkpoint are replayed by the resumed run; drop the stale copies.
            kept = [
                line
                for line in path.read_text().splitlines()
                if line.strip() and json.loads(line).get("step", 0) <= resume_step
            ]
            path.write_text("".join(line + "\n" for line in kept))
        # a new run starts the file afresh (a first attempt that died before its first
        # checkpoint may have left steps in it)
        self._f = path.open("w" if resume_step is None else "a", buffering=1)

    def write(self, record: dict[str, Any]) -> None:
        self._f.write(strict_json(record) + "\n")

    def close(self) -> None:
        self._f.close()


def _finite(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    return value


def strict_json(record: dict[str, Any], **kw: Any) -> str:
    """Strict JSON (RFC 8259 has no NaN or Infinity): a non-finite number becomes null, and
    `nonfinite_values` names the keys it was found under."""
    bad = [k for k, v in record.items() if isinstance(v, float) and not math.isfinite(v)]
    clean = _finite(record)
    if bad:
        clean["nonfinite_values"] = {k: str(record[k]) for k in bad}
    return json.dumps(clean, allow_nan=False, **kw)


def read_metrics(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
