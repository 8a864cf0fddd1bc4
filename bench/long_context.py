"""Bench for long rows: tokens/s and peak memory across lengths, with and without each
technique, and `--cp 2` on two processes against one, side by side in one run.

    python bench/long_context.py                                   # CPU: debug model, 1k..8k
    python bench/long_context.py --model llama3_2_1b --seq-len 8192 16384 32768 65536 131072

Each (length, technique) is one `compiletune train` process (`--cp` ones under torchrun with
--fsdp, and a one-process --fsdp row beside them, so the comparison is sharded against sharded;
on a CPU the ranks talk over gloo). tokens/s is the median of the steps after the first, over
all ranks; peak is rank 0's (RSS on a CPU, max allocated on a GPU). A run that runs out of
memory is recorded as such and the bench goes on. Writes bench/results/long_context-<device>.json.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # noqa: E402
    bench_out,
    device_name,
    result_header,
    run_train,
    steady_state,
    work_dir,
    write_result,
)

# name -> (flags, processes); "cp2" rows compare with "fsdp" (one process, sharded the same way)
TECHNIQUES: dict[str, tuple[list[str], int]] = {
    "none": ([], 0),
    "ac-full": (["--ac", "full"], 0),
    "fsdp": (["--fsdp"], 1),
    "cp2": (["--fsdp", "--cp", "2"], 2),
    "cp2+ac-full": (["--fsdp", "--cp", "2", "--ac", "full"], 2),
}
GPU_ONLY = {"offload": (["--compile", "--ac", "full", "--offload-activations"], 0)}


def corpus(path: Path, tokens: int) -> Path:
    """A text corpus of at least `tokens` bytes (the byte tokenizer: one token per byte)."""
    lines, n, i = [], 0, 0
    while n < tokens:
        line = f"Record {i}: a long context row keeps going, value {i * 37 % 101}.\n"
        lines.append(line)
        n, i = n + len(line), i + 1
    path.write_text("".join(lines))
    return path


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="debug")
    p.add_argument("--n-layers", type=int, default=None)
    p.add_argument("--seq-len", type=int, nargs="+", default=[1024, 2048, 4096, 8192])
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--techniques", nargs="+", default=None, choices=[*TECHNIQUES, *GPU_ONLY])
    p.add_argument("--doc-mask", action="store_true", help="keep document masking on")
    p.add_argument("--out", default=None)
    a = p.parse_args()

    device = device_name()
    table = {**TECHNIQUES, **(GPU_ONLY if device != "cpu" else {})}
    names = a.techniques or list(table)
    work = work_dir("ct-bench-long-")
    data = corpus(work / "corpus.txt", 4 * max(a.seq_len) * (a.steps + 1))
    result: dict[str, Any] = {**result_header(), "bench": "long_context", "model": a.model}
    result["n_layers"] = a.n_layers
    rows = []
    for seq in a.seq_len:
        for name in names:
            flags, processes = table[name]
            args = ["--model", a.model, "--seq-len", str(seq), "--batch-size", "1"]
            args += ["--max-steps", str(a.steps), "--data", str(data), "--no-save"]
            args += ["--dtype", "fp32" if device == "cpu" else "bf16", *flags]
            if a.n_layers:
                args += ["--n-layers", str(a.n_layers)]
            s = run_train(
                args,
                tempfile.mkdtemp(dir=work),
                work,
                allow_failure=True,
                remove_output=True,
                processes=processes,
                doc_mask=a.doc_mask,
            )
            row: dict[str, Any] = {"technique": name, "seq_len": seq, "processes": processes or 1}
            if "error" in s:
                row["error"] = s["error"]
            else:
                speed = steady_state(s["step_times"], s["tokens_per_step"])
                row |= {k: speed[k] for k in ("tokens_per_s", "steady_step_s", "step_spread")}
                row["peak_mem_gib"] = s["step_peak_mem_gib"]
            rows.append(row)
            print(row, flush=True)
    for r in rows:  # side by side: each row against its length's baseline in this run
        base_name = "fsdp" if r["technique"].startswith("cp2") else "none"
        base = next(
            (b for b in rows if b["seq_len"] == r["seq_len"] and b["technique"] == base_name),
            None,
        )
        if base and "tokens_per_s" in r and "tokens_per_s" in base and r is not base:
            r["vs"] = base_name
            r["speed_ratio"] = r["tokens_per_s"] / base["tokens_per_s"]
            r["peak_ratio"] = r["peak_mem_gib"] / base["peak_mem_gib"]
    result["rows"] = rows
    path = bench_out("long_context", a.out)
    write_result(path, result)
    print(f"\n{a.model}, {device}, torch {result['torch']}, commit {result['commit']}\n")
    print("| seq | technique | ranks | tokens/s | peak GiB (rank 0) | vs | speed | peak |")
    print("|---:|---|---:|---:|---:|---|---:|---:|")
    for r in rows:
        if "error" in r:
            print(
                f"| {r['seq_len']} | {r['technique']} | {r['processes']} | {r['error']} | | | | |"
            )
            continue
        ratios = (
            f"{r['vs']} | {r['speed_ratio']:.2f}x | {r['peak_ratio']:.2f}x" if "vs" in r else "| |"
        )
        print(
            f"| {r['seq_len']} | {r['technique']} | {r['processes']} | {r['tokens_per_s']:.0f} "
            f"| {r['peak_mem_gib']:.2f} | {ratios} |"
        )
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
