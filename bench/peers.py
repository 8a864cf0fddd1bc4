"""compiletune against transformers: the same model, data, precision and batch, side by side in
one run; each configuration trains in its own process.

    python bench/peers.py                          # CPU: llama3_150m, seq 1024, batch 1, bf16*
    python bench/peers.py --dtype fp32             # the same in fp32
    python bench/peers.py                          # GPU: llama3_2_1b, seq 2048, bf16, batch 4
    python bench/peers.py --n-layers 4 --peers eager checkpointing

transformers configurations (AutoModelForCausalLM from `hf_config_from_args` of the preset,
random init, loss from `labels`, fused torch AdamW betas 0.9/0.95, clipping at 1.0 as the
trainer does):

    eager           the model as transformers builds it (SDPA attention)
    checkpointing   + activation checkpointing of every decoder layer (transformers' own switch)
    compile         + torch.compile of the whole model (no checkpointing)
    eager-hugepages eager with PyTorch's THP_MEM_ALLOC_ENABLE=1, the allocator setting the
                    compiletune CLI turns on (compiletune.cli.huge_page_tensors): what of
                    compiletune's lead is that setting alone (the other rows run without it)

compiletune rows: `eager` (the ladder's baseline rung) and its full stack (the ladder's highest
rung the trainer supports, see bench/ladder.py). Both sides train on the same batches (the
embedded pydocs corpus, byte tokens, packed by compiletune.data.rows with seed 0) and are measured
the same way: tokens/s is the median of the steps after the first; peak memory is
torch.cuda.max_memory_allocated on a GPU and the process's peak resident set on CPU, read after
the last step (compiletune.metrics.peak_memory_gib in both). With --repeats N (default 2 on CPU)
the configurations run N times in turn and each row keeps its fastest run, with the median peak
(common.best_of_repeats): a shared CPU's speed drifts by up to 2x over minutes.

Ratios are taken against the best of transformers' own configurations (eager and gradient
checkpointing, the peers the targets name) for each measure: memory against the one with the
lowest peak, speed against the fastest. transformers + torch.compile is a row of its own, and
every row also gets its ratios against it. *CPU runs default to bf16, the precision fine-tuning
runs in (a CPU with AMX or AVX512-BF16 runs its matmuls 4-6x faster than fp32), except on a CPU
without native bf16 matmuls (compiletune.hardware), where they default to fp32; --dtype fp32
measures the fp32 configuration. Writes bench/results/peers-<device>.json and prints a
markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # noqa: E402
    bench_out,
    best_of_repeats,
    failure_reason,
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
from ladder import RUNGS, full_stack  # noqa: E402

from compiletune.hardware import cpu_default_dtype  # noqa: E402
from compiletune.models import from_name, num_params  # noqa: E402

PEERS = ("eager", "checkpointing", "compile", "eager-hugepages")
# What the targets are measured against: transformers as it trains out of the box and with its
# own memory switch. The compile and huge-page rows are shown beside them, with their own ratios.
TARGET_PEERS = ("eager", "checkpointing")
TARGETS = {"memory_vs_best_transformers": 0.6, "speed_vs_fastest_transformers": 1.5}


def hf_train(peer: str, a: argparse.Namespace) -> dict[str, Any]:
    """Train the preset with transformers for a.steps steps in this process (the child)."""
    import transformers

    from compiletune.data.rows import Batches, load_examples, pack
    from compiletune.data.tokenizer import byte_tokenizer
    from compiletune.metrics import peak_memory_gib
    from compiletune.models import hf_config_from_args

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[a.dtype]
    args = from_name(a.model)
    if a.n_layers:
        args.n_layers = a.n_layers
    cfg = hf_config_from_args(args, dtype)
    config = transformers.AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    torch.manual_seed(0)
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(config)
    torch.set_default_dtype(default_dtype)
    model.train()
    if peer == "checkpointing":
        if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.x
            model.activation_checkpointing_enable()
        else:
            model.gradient_checkpointing_enable()
    forward = torch.compile(model) if peer == "compile" else model
    params = [p for p in model.parameters() if p.requires_grad]
    # fused: transformers' Trainer default (adamw_torch_fused), and compiletune's adamw step.
    opt = torch.optim.AdamW(params, lr=1e-3, betas=(0.9, 0.95), weight_decay=0.0, fused=True)
    batches = Batches(pack(load_examples("pydocs", byte_tokenizer()), a.seq_len), a.batch_size, 0)

    step_times, losses, first_peak = [], [], None
    for _ in range(a.steps):
        t0 = time.perf_counter()
        b = batches.next()
        inputs, targets = b["inputs"].to(device), b["targets"].to(device)
        # targets are already shifted: shift_labels keeps transformers from shifting again.
        out = forward(input_ids=inputs, labels=targets, shift_labels=targets, use_cache=False)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(out.loss.item())  # syncs the GPU, as the trainer's loss read does
        step_times.append(time.perf_counter() - t0)
        first_peak = first_peak or peak_memory_gib(device)
    return {
        "step_times": step_times,
        "tokens_per_step": a.batch_size * a.seq_len,
        "peak_mem_gib": peak_memory_gib(device),
        "first_step_peak_mem_gib": first_peak,
        "final_loss": losses[-1],
        "transformers": transformers.__version__,
    }


def run_hf(peer: str, a: argparse.Namespace, work: Path) -> dict[str, Any]:
    """`hf_train` in a fresh process, so its peak memory is its own."""
    out = work / f"hf-{peer}.json"
    cmd = [sys.executable, __file__, "--child", peer, "--child-out", str(out), *shape_args(a)]
    cmd += ["--steps", str(a.steps)]
    env = {k: v for k, v in os.environ.items() if k != "THP_MEM_ALLOC_ENABLE"}
    env["TORCHINDUCTOR_CACHE_DIR"] = str(work / f"inductor-{peer}")
    if peer == "eager-hugepages":
        env["THP_MEM_ALLOC_ENABLE"] = "1"  # read by torch at its first allocation
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        return {"error": failure_reason(proc.stderr)}
    child = json.loads(out.read_text())
    row = steady_state(child["step_times"], child["tokens_per_step"])
    row.update(peak_mem_gib=child["peak_mem_gib"], final_loss=child["final_loss"])
    row["first_step_peak_mem_gib"] = child["first_step_peak_mem_gib"]
    row["transformers_version"] = child["transformers"]
    return row


def run_compiletune(flags: list[str], a: argparse.Namespace, work: Path) -> dict[str, Any]:
    # run_train turns document masking off: the transformers side trains plain causal
    # attention over the packed rows, so both train the same thing.
    args = [*shape_args(a), "--max-steps", str(a.steps), *flags]
    cache = tempfile.mkdtemp(prefix="inductor-", dir=work)
    s = run_train(args, cache, work, allow_failure=True, remove_output=True)
    if "error" in s:
        return s
    row = steady_state(s["step_times"], s["tokens_per_step"])
    row.update(peak_mem_gib=s["step_peak_mem_gib"], final_loss=s["final_loss"])
    row["first_step_peak_mem_gib"] = s["first_step_peak_mem_gib"]
    return row


def shape_args(a: argparse.Namespace) -> list[str]:
    """What both sides share, as flags both this script and `compiletune train` accept."""
    shape = ["--model", a.model, "--seq-len", str(a.seq_len)]
    shape += ["--batch-size", str(a.batch_size), "--dtype", a.dtype]
    return shape + (["--n-layers", str(a.n_layers)] if a.n_layers else [])


def add_ratios(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Each row against the best of transformers' own configurations (eager and gradient
    checkpointing: the peers the targets name) per measure, and against transformers +
    torch.compile where that row ran; returns the headline ratios."""
    hf = [r for r in rows if r["framework"] == "transformers" and "tokens_per_s" in r]
    compiled = next((r for r in hf if r["config"] == "compile"), None)
    own = [r for r in hf if r["config"] in TARGET_PEERS]
    leanest = min(own, key=lambda r: r["peak_mem_gib"]) if own else None
    fastest = max(own, key=lambda r: r["tokens_per_s"]) if own else None
    for r in rows:
        if "tokens_per_s" not in r:
            continue
        if compiled is not None:
            r["mem_vs_transformers_compile"] = r["peak_mem_gib"] / compiled["peak_mem_gib"]
            r["speed_vs_transformers_compile"] = r["tokens_per_s"] / compiled["tokens_per_s"]
        if leanest is not None and fastest is not None:
            r["mem_vs_best_transformers"] = r["peak_mem_gib"] / leanest["peak_mem_gib"]
            r["speed_vs_fastest_transformers"] = r["tokens_per_s"] / fastest["tokens_per_s"]
    if leanest is None or fastest is None:  # neither eager nor checkpointing ran
        return {}
    full = rows[-1]
    if full["framework"] != "compiletune" or "tokens_per_s" not in full:
        return {}
    mem, speed = full["mem_vs_best_transformers"], full["speed_vs_fastest_transformers"]
    headline = {
        "compiletune": full["config"],
        "leanest_transformers": leanest["config"],
        "fastest_transformers": fastest["config"],
        "memory_vs_best_transformers": mem,
        "speed_vs_fastest_transformers": speed,
        "targets": {
            k: (f"<= {v}" if k.startswith("memory") else f">= {v}") for k, v in TARGETS.items()
        },
        "targets_met": {
            "memory": mem <= TARGETS["memory_vs_best_transformers"],
            "speed": speed >= TARGETS["speed_vs_fastest_transformers"],
        },
    }
    if compiled is not None:
        headline["memory_vs_transformers_compile"] = full["mem_vs_transformers_compile"]
        headline["speed_vs_transformers_compile"] = full["speed_vs_transformers_compile"]
    return headline


def markdown(result: dict[str, Any]) -> str:
    gpu = result["device"] != "cpu"
    head = ["framework", "configuration", "tokens/s", "vs fastest transformers", "peak GiB"]
    head += ["vs leanest transformers", "best tokens/s", "step spread", "load"] + ["MFU"] * gpu
    lines = [
        f"{result['model']} ({result['params_m']:.0f}M parameters, {result['n_layers']} layers), "
        f"seq {result['seq_len']} x batch {result['batch_size']}, {result['dtype']}, "
        f"{result['device']}, torch {result['torch']}, transformers {result['transformers']}, "
        f"commit {result['commit']}\n",
        "| " + " | ".join(head) + " |",
        "|---|---" + "|---:" * (len(head) - 2) + "|",
    ]
    for r in result["rows"]:
        if "tokens_per_s" not in r:
            cells = f"| {r['framework']} | {r['config']} | {r['error']} |"
            lines.append(cells + " |" * (len(head) - 3))
            continue
        cells = [
            r["framework"],
            r["config"],
            f"{r['tokens_per_s']:.0f}",
            ratio_cell(r, "speed_vs_fastest_transformers"),
            f"{r['peak_mem_gib']:.2f}",
            ratio_cell(r, "mem_vs_best_transformers"),
            f"{r['best_tokens_per_s']:.0f}",
            f"{r['step_spread']:.0%}",
            f"{r['load_1m']:.1f}",
        ]
        if gpu:
            cells.append(f"{r['mfu']:.1%}" if r.get("mfu") is not None else "")
        lines.append("| " + " | ".join(cells) + " |")
    h = result["headline"]
    if h:
        lines.append(
            f"\ncompiletune {h['compiletune']}: {h['memory_vs_best_transformers']:.2f}x the peak "
            f"memory of transformers {h['leanest_transformers']} (target <= "
            f"{TARGETS['memory_vs_best_transformers']}), {h['speed_vs_fastest_transformers']:.2f}x "
            f"the tokens/s of transformers {h['fastest_transformers']} (target >= "
            f"{TARGETS['speed_vs_fastest_transformers']})"
        )
        if "speed_vs_transformers_compile" in h:
            lines.append(
                f"against transformers + torch.compile: {h['memory_vs_transformers_compile']:.2f}x "
                f"its peak memory, {h['speed_vs_transformers_compile']:.2f}x its tokens/s"
            )
    return "\n".join(lines)


def main() -> None:
    gpu = torch.cuda.is_available()
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model", default="llama3_2_1b" if gpu else "llama3_150m")
    p.add_argument("--n-layers", type=int, default=None, help="fewer layers to fit CPU time")
    p.add_argument("--seq-len", type=int, default=2048 if gpu else 1024)
    p.add_argument("--batch-size", type=int, default=4 if gpu else 1)
    p.add_argument(
        "--dtype",
        choices=["bf16", "fp32"],
        default="bf16" if gpu else cpu_default_dtype(),
        help="default: bf16 (on a CPU, where it multiplies bf16 natively; else fp32)",
    )
    p.add_argument("--steps", type=int, default=8 if gpu else 6, help="first one warms up")
    # The huge-page switch only moves CPU tensors: no row of its own on a GPU.
    default_peers = [x for x in PEERS if not (gpu and x == "eager-hugepages")]
    p.add_argument("--peers", nargs="+", choices=PEERS, default=default_peers)
    p.add_argument(
        "--repeats",
        type=int,
        default=1 if gpu else 2,
        help="runs per configuration, taken in turn; each row keeps its fastest (default: 2 on "
        "CPU, whose speed drifts with other work on the host, 1 on a GPU)",
    )
    p.add_argument(
        "--no-compiletune-eager", action="store_true", help="skip compiletune's eager row"
    )
    p.add_argument("--out", default=None, help="default bench/results/peers-<device>.json")
    p.add_argument("--child", choices=PEERS, help=argparse.SUPPRESS)
    p.add_argument("--child-out", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.repeats < 1:
        p.error(f"--repeats must be at least 1, got {a.repeats}")
    if a.child:
        Path(a.child_out).write_text(json.dumps(hf_train(a.child, a)))
        return

    args = from_name(a.model)
    if a.n_layers:
        args.n_layers = a.n_layers
    flops = model_flops_per_token(args, a.seq_len)
    work = work_dir("ct-bench-peers-")
    full_name, full_flags = full_stack(train_flags())
    runs: list[tuple[str, str, Any]] = [
        ("transformers", peer, lambda peer=peer: run_hf(peer, a, work)) for peer in a.peers
    ]
    if not a.no_compiletune_eager:
        runs.append(("compiletune", "eager", lambda: run_compiletune(RUNGS[0][1], a, work)))
    runs.append(
        ("compiletune", f"full stack ({full_name})", lambda: run_compiletune(full_flags, a, work))
    )
    # Repeats take the configurations in turn, so a slow spell of the machine hits them alike.
    runs_of: list[list[dict[str, Any]]] = [[] for _ in runs]
    for repeat in range(a.repeats):
        for (framework, config, run), done in zip(runs, runs_of, strict=True):
            if done and not any("tokens_per_s" in r for r in done):
                continue  # failed (e.g. out of memory) the first time: not again
            row = {"framework": framework, "config": config, **run()}
            row["load_1m"] = os.getloadavg()[0]  # other work on the machine shows up as noise
            done.append(row)
            shown = {k: v for k, v in row.items() if k != "step_times"}
            print(f"repeat {repeat + 1}/{a.repeats}", shown, flush=True)
    rows = []
    for done in runs_of:
        row = best_of_repeats(done)
        if "tokens_per_s" in row:
            row["mfu"] = mfu(row["tokens_per_s"], flops)
        rows.append(row)
    versions = {r.get("transformers_version") for r in rows} - {None}
    result = {
        **result_header(),
        "bench": "peers",
        # The arguments that reproduce this result (bench/regress.py reruns with them).
        "argv": [*shape_args(a), "--steps", str(a.steps), "--repeats", str(a.repeats)]
        + ["--peers", *a.peers]
        + (["--no-compiletune-eager"] if a.no_compiletune_eager else []),
        "model": a.model,
        "n_layers": args.n_layers,
        "params_m": num_params(args) / 1e6,
        "seq_len": a.seq_len,
        "batch_size": a.batch_size,
        "dtype": a.dtype,
        "steps": a.steps,
        "repeats": a.repeats,
        "transformers": versions.pop() if versions else None,
        "compiletune_full_stack_flags": full_flags,
        "peak_memory": (
            "torch.cuda.max_memory_allocated after the last step"
            if gpu
            else "process peak RSS after the last step (Python, libraries and data included)"
        ),
        "rows": rows,
    }
    result["headline"] = add_ratios(rows)
    path = bench_out("peers", a.out)
    write_result(path, result)
    print(markdown(result))
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
