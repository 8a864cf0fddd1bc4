"""Rerun a bench and compare it with the committed baseline for this device; exit 1 when
tokens/s (or a step time) got worse, or peak memory grew, by more than the noise.

    python bench/regress.py ladder                    # rerun with the baseline's own arguments
    python bench/regress.py activation -- --n-layers 4 --seq-len 1024   # arguments for the rerun
    python bench/regress.py compile --tolerance 0.15  # fixed 15% on speed instead of measured
    python bench/regress.py peers --current /tmp/peers.json             # compare, no rerun

The baseline is bench/results/<bench>-<device>.json (or --baseline). The rerun is
`python bench/<bench>.py ARGS --out TMP`, where ARGS are the arguments after `--`, else the
`argv` the baseline recorded (ladder and peers record it), else none (the bench's defaults).

What is compared: every `tokens_per_s` (higher is better), `time_ms` (lower), and peak memory
(`peak_mem_gib`, `peak_mib`, `saved_bytes_per_block_on_device`; lower), matched by their place
in the JSON (list items by their rung / policy / seq_len / ... fields). A metric the baseline
has and the rerun lacks (the rung failed or ran out of memory) is a regression.

Tolerance on speed, `--tolerance auto` (default): the larger of the two runs' own step spread,
(slowest - fastest) / median of the steady steps, recorded as `step_spread` or derived from
`step_times`, and never below 5%; 10% where a result records no steps. `--tolerance F` fixes it.
Memory: `--mem-tolerance`, 5% by default.

Exit status: 0 no regression, 1 regressions (printed as a table), 2 nothing to compare with.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import bench_out, device_name  # noqa: E402

BENCHES = ("compile", "activation", "ladder", "loss", "peers")
# metric key -> (kind, True when higher is better)
METRICS = {
    "tokens_per_s": ("speed", True),
    "time_ms": ("speed", False),
    "peak_mem_gib": ("memory", False),
    "peak_mib": ("memory", False),
    "saved_bytes_per_block_on_device": ("memory", False),
}
# Fields that name a list item, so rows match across runs whatever their order.
ID_FIELDS = (
    "model",
    "framework",
    "config",
    "rung",
    "policy",
    "seq_len",
    "layers",
    "cache",
    "tokens",
)
MIN_SPEED_TOLERANCE = 0.05
DEFAULT_SPEED_TOLERANCE = 0.10
DEFAULT_MEM_TOLERANCE = 0.05


@dataclass
class Check:
    """One metric of the baseline against the rerun. `change` is the relative move in the
    worse direction (0.12 = 12% slower or bigger; negative = better); None when it is missing."""

    path: str
    kind: str
    baseline: float
    current: float | None
    change: float | None
    tolerance: float
    regressed: bool


def _spread(node: dict[str, Any]) -> float | None:
    if isinstance(node.get("step_spread"), int | float):
        return float(node["step_spread"])
    times = node.get("step_times")
    if isinstance(times, list) and len(times) >= 3:
        steady = times[1:]
        return (max(steady) - min(steady)) / statistics.median(steady)
    return None


def _label(item: Any, index: int) -> str:
    if isinstance(item, dict):
        named = [f"{k}={item[k]}" for k in ID_FIELDS if k in item]
        if named:
            return ",".join(named)
    return str(index)


def flatten(node: Any, path: str = "") -> dict[str, tuple[str, float | None, float | None]]:
    """Every metric in a result: {path: (metric key, value, the step spread beside it)}."""
    found: dict[str, tuple[str, float | None, float | None]] = {}
    if isinstance(node, dict):
        spread = _spread(node)
        for key, value in node.items():
            where = f"{path}.{key}" if path else key
            if key in METRICS and (value is None or isinstance(value, int | float)):
                found[where] = (key, value, spread)
            elif isinstance(value, dict | list):
                found.update(flatten(value, where))
    elif isinstance(node, list):
        for i, item in enumerate(node):
            if isinstance(item, dict | list):
                found.update(flatten(item, f"{path}[{_label(item, i)}]"))
    return found


def compare(
    baseline: dict[str, Any],
    current: dict[str, Any],
    tolerance: float | None = None,
    mem_tolerance: float = DEFAULT_MEM_TOLERANCE,
) -> list[Check]:
    """Check every baseline metric against the rerun. `tolerance` None means measured (see the
    module docstring); a metric the rerun lacks is a regression; a new one is not checked."""
    now = flatten(current)
    checks = []
    for path, (key, base, base_spread) in flatten(baseline).items():
        if base is None or base == 0:
            continue  # nothing measured (e.g. out of memory in the baseline too)
        kind, higher_is_better = METRICS[key]
        _, cur, cur_spread = now.get(path, (key, None, None))
        if kind == "memory":
            tol = mem_tolerance
        elif tolerance is not None:
            tol = tolerance
        else:
            spreads = [s for s in (base_spread, cur_spread) if s is not None]
            tol = max([MIN_SPEED_TOLERANCE, *spreads]) if spreads else DEFAULT_SPEED_TOLERANCE
        if cur is None:
            checks.append(Check(path, kind, base, None, None, tol, True))
            continue
        change = (base - cur) / base if higher_is_better else (cur - base) / base
        checks.append(Check(path, kind, base, cur, change, tol, change > tol))
    return checks


def table(checks: list[Check]) -> str:
    lines = [
        "| metric | kind | baseline | now | worse by | tolerance |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for c in checks:
        now = "missing" if c.current is None else f"{c.current:.4g}"
        worse = "" if c.change is None else f"{c.change:+.1%}"
        lines.append(
            f"| {c.path} | {c.kind} | {c.baseline:.4g} | {now} | {worse} | {c.tolerance:.0%} |"
        )
    return "\n".join(lines)


def _without_out(argv: list[str]) -> list[str]:
    kept, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg == "--out":
            skip = True
        elif not arg.startswith("--out="):
            kept.append(arg)
    return kept


def rerun(bench: str, args: list[str]) -> dict[str, Any]:
    out = Path(tempfile.mkdtemp(prefix=f"ct-regress-{bench}-")) / f"{bench}.json"
    cmd = [sys.executable, str(Path(__file__).parent / f"{bench}.py"), *args, "--out", str(out)]
    print("rerunning:", " ".join(cmd), flush=True)
    proc = subprocess.run(cmd)
    if not out.exists():
        raise SystemExit(f"regress: {bench}.py wrote no result (exit {proc.returncode})")
    return json.loads(out.read_text())


def main() -> None:
    argv = sys.argv[1:]
    extra = argv[argv.index("--") + 1 :] if "--" in argv else None
    argv = argv[: argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("bench", choices=BENCHES)
    p.add_argument("--tolerance", default="auto", help="auto (measured noise) or a fraction")
    p.add_argument("--mem-tolerance", type=float, default=DEFAULT_MEM_TOLERANCE)
    p.add_argument("--baseline", default=None, help="default bench/results/<bench>-<device>.json")
    p.add_argument("--current", default=None, help="a result to compare instead of rerunning")
    p.add_argument("--all", action="store_true", help="print every comparison, not only losses")
    a = p.parse_args(argv)
    try:
        tolerance = None if a.tolerance == "auto" else float(a.tolerance)
    except ValueError:
        p.error(f"--tolerance {a.tolerance}: pass auto or a fraction such as 0.1")

    base_path = bench_out(a.bench, a.baseline)
    if not base_path.exists():
        print(
            f"regress: no baseline {base_path}; run `python bench/{a.bench}.py` on this "
            f"device ({device_name()}) and commit its result first",
            file=sys.stderr,
        )
        sys.exit(2)
    baseline = json.loads(base_path.read_text())
    if a.current:
        current = json.loads(Path(a.current).read_text())
    else:
        current = rerun(
            a.bench, extra if extra is not None else _without_out(baseline.get("argv", []))
        )
    if baseline.get("device") != current.get("device"):
        print(
            f"regress: the baseline is from {baseline.get('device')}, the rerun from "
            f"{current.get('device')}; compare results of the same device",
            file=sys.stderr,
        )
        sys.exit(2)

    checks = compare(baseline, current, tolerance, a.mem_tolerance)
    bad = [c for c in checks if c.regressed]
    print(
        f"\n{a.bench} on {current['device']}: baseline commit {baseline.get('commit')} "
        f"({baseline.get('date')}), now commit {current.get('commit')}; "
        f"{len(checks)} metrics compared, {len(bad)} regressed"
    )
    if a.all:
        print(table(checks))
    elif bad:
        print(table(bad))
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
