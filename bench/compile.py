"""Bench for `--compile`: compile time against depth (cold and warm cache), and tokens/s
compiled vs eager.

Every measurement is a real `compiletune train` run in its own process, so the compile cache
state is controlled: a cold run gets a fresh TORCHINDUCTOR_CACHE_DIR, the warm run reuses it.

    python bench/compile.py                       # defaults below; ~10 minutes on 2 CPU cores
    python bench/compile.py --layers 2 16 --model llama3_150m --seq-len 1024 --steps 4

Writes bench/results/compile-<device>.json and prints a markdown table.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import device_name, result_header, run_train, work_dir, write_result  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="llama3_150m")
    p.add_argument("--layers", type=int, nargs="+", default=[2, 16], help="depths for compile time")
    p.add_argument("--compile-seq-len", type=int, default=256)
    p.add_argument("--seq-len", type=int, default=1024, help="for tokens/s")
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--steps", type=int, default=4, help="steps per tokens/s run (first is warm-up)")
    p.add_argument("--loss", default="fused")
    p.add_argument(
        "--out", default=None, help="result JSON (default bench/results/compile-<device>.json)"
    )
    a = p.parse_args()

    work = work_dir("ct-bench-compile-")
    result = {**result_header(), "bench": "compile", "model": a.model, "loss": a.loss}

    # 1. Compile time against depth: flat in depth is the goal (one compile serves every block).
    depth_rows = []
    for layers in a.layers:
        cache = tempfile.mkdtemp(prefix="inductor-cache-", dir=work)
        common = [
            "--model",
            a.model,
            "--n-layers",
            str(layers),
            "--seq-len",
            str(a.compile_seq_len),
        ]
        common += ["--batch-size", "1", "--max-steps", "2", "--compile", "--loss", a.loss]
        for state in ("cold", "warm"):
            s = run_train(common, cache, work)
            depth_rows.append(
                {
                    "layers": layers,
                    "cache": state,
                    "compile_seconds": s["compile"]["compile_seconds"],
                    "first_step_s": s["step_times"][0],
                    "steady_step_s": s["step_times"][-1],
                    "compiles": s["compile"]["compiles"],
                    "recompiles": s["compile"]["recompiles"],
                }
            )
            print(f"layers={layers} {state}: {depth_rows[-1]}", flush=True)
    result["compile_time"] = depth_rows

    # 2. Tokens/s, compiled vs eager, same model, data, loss and shapes.
    cache = tempfile.mkdtemp(prefix="inductor-cache-", dir=work)
    tp = {}
    for mode in ("eager", "compiled"):
        args = ["--model", a.model, "--seq-len", str(a.seq_len), "--batch-size", str(a.batch_size)]
        args += ["--max-steps", str(a.steps), "--loss", a.loss]
        if mode == "compiled":
            args.append("--compile")
        s = run_train(args, cache, work)
        steady = statistics.median(s["step_times"][1:])
        tp[mode] = {
            "tokens_per_s": s["tokens_per_step"] / steady,
            "steady_step_s": steady,
            "step_times": s["step_times"],
            "peak_mem_gib": s["peak_mem_gib"],
        }
        print(f"{mode}: {tp[mode]}", flush=True)
    tp["compiled_over_eager"] = tp["compiled"]["tokens_per_s"] / tp["eager"]["tokens_per_s"]
    result["throughput"] = {"seq_len": a.seq_len, "batch_size": a.batch_size, **tp}

    path = (
        Path(a.out)
        if a.out
        else Path(__file__).parent / "results" / f"compile-{device_name()}.json"
    )
    write_result(path, result)
    print(f"\n{a.model}, {device_name()}, torch {result['torch']}, commit {result['commit']}\n")
    print("| layers | cache | compile s | first step s | compiles | recompiles |")
    print("|---:|---|---:|---:|---:|---:|")
    for r in depth_rows:
        print(
            f"| {r['layers']} | {r['cache']} | {r['compile_seconds']:.1f} | {r['first_step_s']:.1f} "
            f"| {r['compiles']} | {r['recompiles']} |"
        )
    print(f"\n| mode | tokens/s (seq {a.seq_len}) |\n|---|---:|")
    for mode in ("eager", "compiled"):
        print(f"| {mode} | {tp[mode]['tokens_per_s']:.0f} |")
    print(f"\ncompiled / eager: {tp['compiled_over_eager']:.2f}x; wrote {path}")


if __name__ == "__main__":
    main()
