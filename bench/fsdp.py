"""What each FSDP choice costs: one process vs N ranks per sharding mode and CPU offload.

    python bench/fsdp.py [--model llama3_150m] [--processes 2] [--seq-len 256] [--steps 4]

Every configuration trains the same global batch (N x --batch-size rows) for a few steps in its
own launch; the table shows the peak memory of each rank, tokens/s of the steady steps and the
final loss (equal across rows: sharding changes where tensors live, not the result). On CPU the
peak is the process's resident set (Python and torch included), and rank 0 also holds the one
full copy of the weights it reads and broadcasts at start; the other ranks show the sharding.
Peaks are taken after the last step, before the final checkpoint (whose staging copies would
otherwise dominate on CPU; they are recorded too).
Writes bench/results/fsdp-<device>.json.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import bench_out, result_header, run_train, steady_state, write_result  # noqa: E402

CONFIGS = {
    "one process": ([], 0),
    "full": (["--fsdp", "--sharding", "full"], None),
    "grad-op": (["--fsdp", "--sharding", "grad-op"], None),
    "none (replicate)": (["--fsdp", "--sharding", "none"], None),
    "full + cpu-offload": (["--fsdp", "--sharding", "full", "--cpu-offload"], None),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama3_150m")
    ap.add_argument("--processes", type=int, default=2)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--batch-size", type=int, default=1, help="rows per rank")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--only", nargs="*", help="configuration names to run")
    ap.add_argument("--out", default=None)
    ns = ap.parse_args()

    common = ["--model", ns.model, "--seq-len", str(ns.seq_len), "--max-steps", str(ns.steps)]
    common += ["--dtype", "fp32", "--loss", "fused"]
    rows = []
    with tempfile.TemporaryDirectory(prefix="ct-bench-fsdp-") as tmp:
        work = Path(tmp)
        for name, (flags, procs) in CONFIGS.items():
            if ns.only and name not in ns.only:
                continue
            procs = ns.processes if procs is None else procs
            rows_per_process = ns.batch_size * (ns.processes if procs == 0 else 1)
            args = [*common, "--batch-size", str(rows_per_process), *flags]
            print(f"{name}: {procs or 1} process(es)", flush=True)
            s = run_train(args, str(work / "cache"), work, allow_failure=True, processes=procs)
            if "error" in s:
                rows.append({"config": name, "error": s["error"]})
                continue
            speed = steady_state(s["step_times"], s["tokens_per_step"])
            rows.append(
                {
                    "config": name,
                    "processes": procs or 1,
                    "peak_mem_gib_per_rank": [
                        round(x, 3) for x in s["train_peak_mem_gib_per_rank"]
                    ],
                    "peak_with_final_save_gib_per_rank": [
                        round(x, 3) for x in s["peak_mem_gib_per_rank"]
                    ],
                    "tokens_per_s": round(speed["tokens_per_s"], 1),
                    "final_loss": s["final_loss"],
                }
            )
    result = {**result_header(), "bench": "fsdp", "args": vars(ns), "rows": rows}
    path = bench_out("fsdp", ns.out)
    write_result(path, result)
    print("\n| configuration | ranks | peak memory per rank (GiB) | tokens/s | final loss |")
    print("|---|---|---|---|---|")
    for r in rows:
        if "error" in r:
            print(f"| {r['config']} | | {r['error']} | | |")
            continue
        peaks = " / ".join(f"{x:.2f}" for x in r["peak_mem_gib_per_rank"])
        print(
            f"| {r['config']} | {r['processes']} | {peaks} | {r['tokens_per_s']:.0f} "
            f"| {r['final_loss']:.4f} |"
        )
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
