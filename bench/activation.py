"""Bench for `--ac` and `--offload-activations`: bytes each block saves for backward, and
tokens/s, per policy, side by side on one model.

    python bench/activation.py                     # llama3_150m body, seq 1024 and 2048
    python bench/activation.py --n-layers 4 --seq-len 1024 2048 --steps 3

Each policy is one `compiletune train --compile --dump-graphs` run in its own process; saved
bytes come from the partitioned forward graph (summary.json), tokens/s is the median of the
steps after the first (which compiles). Writes bench/results/activation-<device>.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import device_name, result_header, run_train, work_dir, write_result  # noqa: E402

POLICIES = [
    ("none", []),
    ("selective", ["--ac", "selective"]),
    ("budget=0.5", ["--ac", "budget=0.5"]),
    ("full", ["--ac", "full"]),
    ("none+offload", ["--offload-activations"]),
    ("selective+offload", ["--ac", "selective", "--offload-activations"]),
]


def default_policies(device: str) -> list[str]:
    """Every policy, less the +offload ones on a CPU: the trainer ignores
    --offload-activations there (activations already live in host memory)."""
    return [name for name, _ in POLICIES if device != "cpu" or "offload" not in name]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="llama3_150m")
    p.add_argument("--n-layers", type=int, default=None, help="fewer layers to fit CPU time")
    p.add_argument("--seq-len", type=int, nargs="+", default=[1024, 2048])
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument(
        "--policies",
        nargs="+",
        default=None,
        choices=[name for name, _ in POLICIES],
        help="default: all; on a CPU the +offload ones are left out (the trainer ignores "
        "--offload-activations there, so they would repeat the rows without it)",
    )
    p.add_argument("--out", default=None)
    a = p.parse_args()

    if a.policies is None:
        a.policies = default_policies(device_name())
        if len(a.policies) < len(POLICIES):
            print("on a CPU: leaving out the +offload policies (nothing to offload)", flush=True)
    work = work_dir("ct-bench-ac-")
    result = {**result_header(), "bench": "activation", "model": a.model, "n_layers": a.n_layers}
    rows = []
    for seq in a.seq_len:
        for name, flags in POLICIES:
            if name not in a.policies:
                continue
            dump = work / f"dump-{name}-{seq}"
            args = ["--model", a.model, "--seq-len", str(seq), "--batch-size", str(a.batch_size)]
            args += ["--max-steps", str(a.steps), "--compile", "--dump-graphs", str(dump), *flags]
            if a.n_layers:
                args += ["--n-layers", str(a.n_layers)]
            s = run_train(args, tempfile.mkdtemp(dir=work), work)
            block = json.loads((dump / "summary.json").read_text())["block"]
            steady = statistics.median(s["step_times"][1:])
            rows.append(
                {
                    "policy": name,
                    "seq_len": seq,
                    "saved_bytes_per_block": block["saved_activation_bytes"],
                    "saved_bytes_per_block_on_device": block["saved_activation_bytes_on_device"],
                    "tokens_per_s": s["tokens_per_step"] / steady,
                    "steady_step_s": steady,
                    "peak_mem_gib": s["peak_mem_gib"],
                }
            )
            print(json.dumps(rows[-1]), flush=True)
    for seq in a.seq_len:
        base = next((r for r in rows if r["seq_len"] == seq and r["policy"] == "none"), None)
        for r in rows:
            if base and r["seq_len"] == seq:
                r["saved_vs_none"] = (
                    r["saved_bytes_per_block_on_device"] / base["saved_bytes_per_block"]
                )
                r["speed_vs_none"] = r["tokens_per_s"] / base["tokens_per_s"]
    result["rows"] = rows
    path = (
        Path(a.out)
        if a.out
        else Path(__file__).parent / "results" / f"activation-{device_name()}.json"
    )
    write_result(path, result)
    print(
        f"\n{a.model} (layers: {a.n_layers or 'preset'}), {device_name()}, torch {result['torch']}, commit {result['commit']}\n"
    )
    print("| seq | policy | saved MiB/block (on device) | vs none | tokens/s | vs none |")
    print("|---:|---|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['seq_len']} | {r['policy']} | {r['saved_bytes_per_block_on_device'] / 2**20:.1f} "
            f"| {r.get('saved_vs_none', float('nan')):.2f} | {r['tokens_per_s']:.0f} "
            f"| {r.get('speed_vs_none', float('nan')):.2f} |"
        )
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
