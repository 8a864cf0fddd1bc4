"""Per-step metrics: `OUTPUT_DIR/metrics.jsonl`, one JSON object per optimizer step."""

from __future__ import annotations

import json
import math
import os
import resource
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # torch is imported where it is used: `plot` reads metrics without it
    import torch


def peak_memory_gib(device: torch.device) -> float:
    """Peak memory of this process so far, in GiB.

    On a GPU: the caching allocator's peak of allocated bytes (`max_memory_allocated`).
    On CPU: the process's peak resident set size, which also counts the Python runtime,
    libraries and the dataset, so it reads higher than the tensors alone.
    """
    if device.type == "cuda":
        import torch  # here: `compiletune plot` reads metrics through this module without torch

        return torch.cuda.max_memory_allocated(device) / 2**30
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    # ru_maxrss is in KiB on Linux and in bytes on macOS.
    return rss / (2**30 if sys.platform == "darwin" else 2**20)


def perplexity(loss: float) -> float:
    """exp(mean loss per target token); inf where that overflows a float."""
    return math.exp(loss) if loss < 700 else math.inf


class MetricsLog:
    """Appends one line per step and flushes it, so a crash loses at most the current step
    (a torn last line, which every reader skips and a resume cuts away)."""

    def __init__(self, path: Path, resume_step: int | None = None) -> None:
        self.path = path
        if resume_step is not None and path.exists():
            # Steps after the checkpoint are replayed by the resumed run; drop the stale copies,
            # and the line a kill tore, so what is appended starts on a line of its own.
            kept = [
                line
                for _, line, record in _lines(path.read_bytes())
                if record is not None and _step(record) <= resume_step
            ]
            tmp = path.with_name(f".{path.name}.tmp")
            try:
                tmp.write_text("".join(line + "\n" for line in kept))
                os.replace(tmp, path)  # whole or not at all: a crash here keeps the old file
            except BaseException:
                tmp.unlink(missing_ok=True)  # a full disk leaves no temporary file
                raise
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


def _step(record: dict[str, Any]) -> float:
    step = record.get("step", 0)
    return step if isinstance(step, int | float) and not isinstance(step, bool) else 0


def parse_metrics(data: bytes) -> tuple[list[dict[str, Any]], list[int]]:
    """The records of a metrics.jsonl as the trainer can leave it: one JSON object per line,
    where a kill mid-write tears the last line (and a run resumed by an older version appended
    after the torn piece). Returns the records and the numbers of the lines that are not a JSON
    object, which are skipped."""
    records, torn = [], []
    for n, _, record in _lines(data):
        if record is None:
            torn.append(n)
        else:
            records.append(record)
    return records, torn


def _lines(data: bytes) -> Iterator[tuple[int, str, dict[str, Any] | None]]:
    """(line number, text, the JSON object or None) of each line that is not blank."""
    for n, line in enumerate(data.decode("utf-8", "replace").splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except (ValueError, RecursionError):
            record = None
        yield n, line, record if isinstance(record, dict) else None


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """The records of `path`, torn lines skipped."""
    return parse_metrics(path.read_bytes())[0]
