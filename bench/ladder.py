"""The technique ladder: one model, compiletune's techniques added one at a time, each rung a
`compiletune train` run in its own process; steady-state tokens/s and peak memory per rung.

    python bench/ladder.py                          # CPU: llama3_150m, seq 1024, bf16 if native*
    python bench/ladder.py                          # GPU: llama3_2_1b and llama3_1_8b, seq 2048, bf16
    python bench/ladder.py --n-layers 4 --steps 4   # fewer layers to fit CPU time
    python bench/ladder.py --rungs eager "+ compile"

*bf16 where this CPU multiplies it natively, else fp32 (compiletune.hardware); --dtype picks.

Rungs are cumulative (RUNGS below), followed by LoRA and QLoRA rows (LORA_ROWS) on the same
stack; a rung whose flags `compiletune train --help` does not list
is recorded as skipped with the reason, and a rung that runs out of memory is recorded as such.
tokens/s is the median of the steps after the first (which compiles); peak memory is what the
trainer reports after the last step: torch.cuda.max_memory_allocated on a GPU, the process's
peak resident set on CPU (Python, libraries and the dataset included). On a GPU each row also
gets its model FLOPs utilisation (common.model_flops_per_token against the bf16 peak).

Writes bench/results/ladder-<device>.json and, with matplotlib, ladder-<device>.png; prints a
markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # noqa: E402
    bench_out,
    best_of_repeats,
    device_name,
    mfu,
    model_flops_per_token,
    ratio_cell,
    result_header,
    run_train,
    steady_state,
    train_flags,
    work_dir,
    write_result,
)

from compiletune import recipes  # noqa: E402
from compiletune.hardware import cpu_default_dtype  # noqa: E402
from compiletune.models import from_name, num_params  # noqa: E402

_SAC = ["--compile", "--ac", "selective"]
_OIB = [*_SAC, "--optimizer-in-backward", "--max-grad-norm", "0"]  # in-backward cannot clip
_8BIT = [*_OIB, "--optimizer", "adamw8bit"]

# (name, the full `compiletune train` flags of the rung); each adds one technique to the last.
RUNGS: list[tuple[str, list[str]]] = [
    ("eager", ["--loss", "plain"]),
    ("+ compile", ["--compile", "--loss", "plain"]),
    ("+ fused loss", ["--compile"]),  # --loss fused is the default
    ("+ selective AC", _SAC),
    ("+ optimizer in backward", _OIB),
    ("+ 8-bit AdamW", _8BIT),
    ("+ offload activations", [*_8BIT, "--offload-activations"]),
]
# Rows beside the ladder: full AC instead of selective (it recomputes the whole forward), and
# LoRA / QLoRA on the fused head with selective AC, the base frozen (only rank-16 adapters
# train, so 8-bit moments would save nothing). They change a rung rather than add to the last,
# so they are not rungs: `full_stack` (what bench/peers.py compares with transformers) ignores
# them.
_LORA = [*_SAC, "--lora-rank", "16"]
LORA_ROWS: list[tuple[str, list[str]]] = [
    ("full AC", ["--compile", "--ac", "full"]),
    ("LoRA r16", _LORA),
    ("QLoRA r16 (nf4)", [*_LORA, "--quantize-base", "nf4", "--base-dtype", "bf16"]),
    # float8 matmuls (torchao; GPUs of compute capability 8.9+) on the fused, selective-AC
    # stack, against "+ selective AC"
    ("+ fp8 rowwise", [*_SAC, "--fp8", "rowwise"]),
    ("+ fp8 tensorwise", [*_SAC, "--fp8", "tensorwise"]),
    ("LoRA r16 + fp8 rowwise", [*_LORA, "--fp8", "rowwise"]),  # against "LoRA r16"
]
# `--models llama3_1_8b --rows 8b`: an 8B model on one GPU (seq 2048 x batch 2), each row with
# the trainer's pre-flight estimate beside its measured peak.
_8B_FULL = [*_8BIT]
EIGHT_B_ROWS: list[tuple[str, list[str]]] = [
    ("8B full: fused + selective AC + 8-bit AdamW in backward", _8B_FULL),
    ("8B LoRA r16", _LORA),
    ("8B QLoRA r16 (nf4)", [*_LORA, "--quantize-base", "nf4", "--base-dtype", "bf16"]),
    ("8B full + fp8 rowwise", [*_8B_FULL, "--fp8", "rowwise"]),
    ("8B LoRA r16 + fp8 rowwise", [*_LORA, "--fp8", "rowwise"]),
    ("8B recipe llama3_1_8b_full_24gb", ["--recipe", "llama3_1_8b_full_24gb"]),
]
# A recipe's own keys that a bench run replaces: its data, weights and run length.
_RECIPE_IO = {"model_dir", "data", "output_dir", "epochs", "save_every", "max_steps"}


def recipe_flags(name: str) -> list[str]:
    """A shipped recipe's settings as `compiletune train` flags, less its placeholders (the
    model is random-initialised, the data the embedded corpus) and its run length."""
    flags = []
    for key, value in recipes.get(name).values.items():
        if key in _RECIPE_IO:
            continue
        flag = "--" + key.replace("_", "-")
        if value is True:
            flags.append(flag)
        elif value is not False and value is not None:
            flags += [flag, str(value)]
    return flags


def missing_flags(flags: list[str], known: set[str]) -> list[str]:
    return [f for f in flags if f.startswith("--") and f not in known]


def full_stack(known: set[str]) -> tuple[str, list[str]]:
    """The highest rung this trainer can run: what `bench/peers.py` compares against."""
    return [(name, flags) for name, flags in RUNGS if not missing_flags(flags, known)][-1]


def run_rung(
    model: str, flags: list[str], a: argparse.Namespace, cache: str, work: Path
) -> dict[str, Any]:
    if flags[:1] == ["--recipe"]:  # a shipped recipe, as written (its own shapes and model)
        args = [*recipe_flags(flags[1]), "--max-steps", str(a.steps)]
    else:
        args = ["--model", model, "--seq-len", str(a.seq_len)]
        args += ["--batch-size", str(a.batch_size), "--max-steps", str(a.steps)]
        args += ["--dtype", a.dtype, *flags]
        if a.compile_backend and "--compile" in flags:
            args += ["--compile-backend", a.compile_backend]
        if a.n_layers:
            args += ["--n-layers", str(a.n_layers)]
    # No checkpoint (an 8B one with its optimizer state is ~100 GB); the pre-flight estimate
    # only where the row reports it.
    args += ["--no-save"] + ([] if a.estimate else ["--no-preflight"])
    s = run_train(
        args, cache, work, True, remove_output=True, doc_mask=True, memory_cap_gib=a.memory_cap_gib
    )
    if "error" in s:
        return s
    row = steady_state(s["step_times"], s["tokens_per_step"])
    row["setup_s"] = s["setup_s"]  # the process less its steps: imports, build, first batch
    row["peak_mem_gib"] = s["step_peak_mem_gib"]
    row["first_step_peak_mem_gib"] = s["first_step_peak_mem_gib"]
    row["final_loss"] = s["final_loss"]
    row["compile_seconds"] = s["compile"]["compile_seconds"] if s["compile"] else 0.0
    if s.get("estimate_peak_gib") is not None:
        row["estimate_peak_gib"] = s["estimate_peak_gib"]
        row["estimate_error"] = s["estimate_peak_gib"] / row["peak_mem_gib"] - 1
    return row


def _model_entry(model: str, args: Any, flops: float, rows: list[dict[str, Any]]) -> dict:
    add_ratios(rows)
    return {
        "model": model,
        "n_layers": args.n_layers,
        "params_m": num_params(args) / 1e6,
        "flops_per_token": flops,
        "rungs": rows,
    }


def add_ratios(rows: list[dict[str, Any]]) -> None:
    """What each rung buys: its speed and memory against the baseline and the last rung run."""
    for r in rows:
        for key in ("speed_vs_prev", "mem_vs_prev", "speed_vs_eager", "mem_vs_eager") + (
            "speed_vs_compile",
            "mem_vs_compile",
        ):
            r.pop(key, None)
    ran = [r for r in rows if "tokens_per_s" in r]
    for prev, r in zip(ran, ran[1:], strict=False):
        r["speed_vs_prev"] = r["tokens_per_s"] / prev["tokens_per_s"]
        r["mem_vs_prev"] = r["peak_mem_gib"] / prev["peak_mem_gib"]
    first = rows[0] if rows else {}
    base = first if first.get("rung") == "eager" and "tokens_per_s" in first else None
    compiled = next((r for r in ran if r["rung"] == "+ compile"), None)
    for r in ran:
        if base:
            r["speed_vs_eager"] = r["tokens_per_s"] / base["tokens_per_s"]
            r["mem_vs_eager"] = r["peak_mem_gib"] / base["peak_mem_gib"]
        if compiled:  # the yardstick: what each technique costs the compiled baseline
            r["speed_vs_compile"] = r["tokens_per_s"] / compiled["tokens_per_s"]
            r["mem_vs_compile"] = r["peak_mem_gib"] / compiled["peak_mem_gib"]


def markdown(result: dict[str, Any]) -> str:
    gpu = result["device"] != "cpu"
    head = ["rung", "tokens/s", "vs prev", "vs eager", "peak GiB", "vs prev", "vs eager"]
    head += ["vs compile", "best tokens/s", "step spread", "load"] + ["MFU", "estimate GiB"] * gpu
    lines = []
    for m in result["models"]:
        lines.append(
            f"\n{m['model']} ({m['params_m']:.0f}M parameters, {m['n_layers']} layers), "
            f"seq {result['seq_len']} x batch {result['batch_size']}, {result['dtype']}, "
            f"{result['device']}, torch {result['torch']}, commit {result['commit']}\n"
        )
        lines += ["| " + " | ".join(head) + " |", "|---" + "|---:" * (len(head) - 1) + "|"]
        for r in m["rungs"]:
            if "tokens_per_s" not in r:
                why = r.get("skipped") or r.get("error")
                lines.append(f"| {r['rung']} | {why} |" + " |" * (len(head) - 2))
                continue
            cells = [
                r["rung"],
                f"{r['tokens_per_s']:.0f}",
                ratio_cell(r, "speed_vs_prev"),
                ratio_cell(r, "speed_vs_eager"),
                f"{r['peak_mem_gib']:.2f}",
                ratio_cell(r, "mem_vs_prev"),
                ratio_cell(r, "mem_vs_eager"),
                ratio_cell(r, "speed_vs_compile"),
                f"{r['best_tokens_per_s']:.0f}",
                f"{r['step_spread']:.0%}",
                f"{r['load_1m']:.1f}",
            ]
            if gpu:
                cells.append(f"{r['mfu']:.1%}" if r.get("mfu") is not None else "")
                est = r.get("estimate_peak_gib")
                cells.append(f"{est:.2f} ({r['estimate_error']:+.1%})" if est else "")
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(result: dict[str, Any], path: Path) -> None:
    from plot import bar_panels

    panels = []
    for m in result["models"]:
        ran = [r for r in m["rungs"] if "tokens_per_s" in r]
        labels = [r["rung"] for r in ran]
        panels.append((f"{m['model']}: tokens/s", labels, [r["tokens_per_s"] for r in ran]))
        panels.append((f"{m['model']}: peak GiB", labels, [r["peak_mem_gib"] for r in ran]))
    title = (
        f"compiletune technique ladder, {result['device']}, seq {result['seq_len']} x batch "
        f"{result['batch_size']}, {result['dtype']}, commit {result['commit']}"
    )
    bar_panels(path, title, panels)


def main() -> None:
    gpu = torch.cuda.is_available()
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--models", nargs="+", default=["llama3_2_1b", "llama3_1_8b"] if gpu else ["llama3_150m"]
    )
    p.add_argument("--n-layers", type=int, default=None, help="fewer layers to fit CPU time")
    p.add_argument("--seq-len", type=int, default=2048 if gpu else 1024)
    p.add_argument("--batch-size", type=int, default=4 if gpu else 1)
    p.add_argument(
        "--dtype",
        choices=["bf16", "fp32"],
        default="bf16" if gpu else cpu_default_dtype(),
        help="default: bf16 (on a CPU, where it multiplies bf16 natively; else fp32)",
    )
    p.add_argument("--steps", type=int, default=8 if gpu else 6, help="first one compiles")
    p.add_argument(
        "--compile-backend",
        default=None,
        help="passed to every --compile rung (default: the trainer's, inductor); aot_eager runs "
        "the same graphs and passes without Inductor's code generation (gpu_check --dry-run)",
    )
    p.add_argument("--rungs", nargs="+", default=None, help="default: every row of --rows")
    p.add_argument(
        "--rows",
        choices=["ladder", "8b"],
        default="ladder",
        help="ladder: the rungs and the LoRA / full-AC rows; 8b: the one-GPU 8B rows",
    )
    p.add_argument(
        "--estimate",
        action="store_true",
        help="keep the trainer's pre-flight memory estimate and report it beside each peak",
    )
    p.add_argument(
        "--memory-cap-gib",
        type=float,
        default=None,
        help="cap each run's GPU memory (torch.cuda.set_per_process_memory_fraction): a smaller "
        "card's budget, e.g. 24 for the 24 GB recipes",
    )
    p.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="runs per rung, taken in turn; each row keeps its fastest (the median peak)",
    )
    p.add_argument(
        "--merge",
        action="store_true",
        help="keep the other rungs of the result at --out (same shape) and replace these",
    )
    p.add_argument("--out", default=None, help="default bench/results/ladder-<device>.json")
    p.add_argument("--no-plot", action="store_true")
    a = p.parse_args()
    if a.repeats < 1:
        p.error(f"--repeats must be at least 1, got {a.repeats}")
    rows_known = RUNGS + LORA_ROWS if a.rows == "ladder" else EIGHT_B_ROWS
    a.rungs = a.rungs or [name for name, _ in rows_known]
    unknown = set(a.rungs) - {name for name, _ in rows_known}
    if unknown:
        p.error(f"unknown rungs {sorted(unknown)}; choose from {[n for n, _ in rows_known]}")

    path = bench_out("ladder", a.out)
    shape = {
        "seq_len": a.seq_len,
        "batch_size": a.batch_size,
        "dtype": a.dtype,
        "steps": a.steps,
        "n_layers_override": a.n_layers,
        "compile_backend": a.compile_backend,
    }
    previous: dict[str, list[dict[str, Any]]] = {}
    if a.merge and path.exists():
        old = json.loads(path.read_text())
        old_shape = {k: old.get(k) for k in shape}
        if old_shape != shape or old.get("device") != device_name():
            p.error(
                f"--merge: {path} was measured with {old_shape} on {old.get('device')}; "
                "pass the same settings, or drop --merge to start a new result"
            )
        previous = {m["model"]: m["rungs"] for m in old["models"]}

    known = train_flags()
    work = work_dir("ct-bench-ladder-")
    models = [*previous.keys() - set(a.models), *a.models]
    # The arguments that reproduce the whole result (bench/regress.py reruns with them).
    argv = ["--models", *models, "--seq-len", str(a.seq_len), "--batch-size", str(a.batch_size)]
    argv += ["--dtype", a.dtype, "--steps", str(a.steps), "--repeats", str(a.repeats)]
    argv += ["--n-layers", str(a.n_layers)] if a.n_layers else []
    result = {
        **result_header(),
        "bench": "ladder",
        "argv": argv,
        **shape,
        "peak_memory": (
            "torch.cuda.max_memory_allocated after the last step"
            if gpu
            else "process peak RSS after the last step (Python, libraries and data included)"
        ),
        "tokens_per_s": "median over the steps after the first (the fastest of --repeats runs)",
        "repeats": a.repeats,
        "models": [],
    }
    for model in models:
        args = from_name(model)
        if a.n_layers:
            args.n_layers = a.n_layers
        flops = model_flops_per_token(args, a.seq_len)
        cache = tempfile.mkdtemp(prefix="inductor-cache-", dir=work)
        by_name = {r["rung"]: r for r in previous.get(model, [])}
        todo = [(n, f) for n, f in rows_known if model in a.models and n in a.rungs]
        # Repeats take the rungs in turn, so a slow spell of the machine hits them alike.
        runs_of: dict[str, list[dict[str, Any]]] = {name: [] for name, _ in todo}
        for repeat in range(a.repeats):
            for name, flags in todo:
                row: dict[str, Any] = {"rung": name, "flags": flags, "commit": result["commit"]}
                # A recipe row stands for its recipe's own flags (`run_rung` expands them).
                expanded = recipe_flags(flags[1]) if flags[:1] == ["--recipe"] else flags
                missing = missing_flags(expanded, known)
                if missing and repeat > 0:
                    continue
                if missing:
                    row["skipped"] = f"compiletune train has no {' '.join(missing)} yet"
                elif repeat == 0 or any("tokens_per_s" in r for r in runs_of[name]):
                    row.update(run_rung(model, flags, a, cache, work))
                else:
                    continue  # failed (e.g. out of memory) the first time: not again
                # Other work on the machine shows up as noise; the load says how much there was.
                row["load_1m"] = os.getloadavg()[0]
                runs_of[name].append(row)
                shown = {k: v for k, v in row.items() if k not in ("flags", "step_times")}
                shown["step_s"] = [round(t, 2) for t in row.get("step_times", [])]
                print(f"repeat {repeat + 1}/{a.repeats}", shown, flush=True)
                if "mfu" not in row and "tokens_per_s" in row:
                    row["mfu"] = mfu(row["tokens_per_s"], flops)
                # Each row on disk as it completes: a run cut short keeps what it measured.
                partial = {
                    **result,
                    "models": [
                        *result["models"],
                        _model_entry(
                            model,
                            args,
                            flops,
                            [*by_name.values(), *(r[-1] for r in runs_of.values() if r)],
                        ),
                    ],
                }
                write_result(path, partial)
        for name, _ in todo:
            row = best_of_repeats(runs_of[name])
            if "tokens_per_s" in row:
                row["mfu"] = mfu(row["tokens_per_s"], flops)
            by_name[name] = row
        rows = [by_name[name] for name, _ in rows_known if name in by_name]
        result["models"].append(_model_entry(model, args, flops, rows))

    write_result(path, result)
    print(markdown(result))
    print(f"\nwrote {path}")
    if not a.no_plot:
        plot(result, path.with_suffix(".png"))
    errors = [r for m in result["models"] for r in m["rungs"] if "error" in r]
    if any(r["error"] != "out of memory" for r in errors):
        sys.exit(1)


if __name__ == "__main__":
    main()
