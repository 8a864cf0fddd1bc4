"""`--ep` against FSDP2 alone: the trainer's own build and step of one MoE model on N gloo ranks
(CPU, one thread each), step time, bytes each rank sends in the experts' all-to-alls and in
FSDP's collectives, and each rank's peak of allocated memory.

    python bench/moe.py --ep 2 [--model debug_moe] [--layers 4] [--seq-len 512] [--batch-size 4]
    python bench/moe_ep.py --ep 2 ...      (the same)

Per configuration (FSDP alone; FSDP + --ep N) every rank builds the run (`build_run`, random
weights, no data read) and runs --warmup + --iters steps of random tokens (`backward_pass`,
`optimizer_step`: clipping, AdamW); time: the median step of the slowest rank. Bytes sent: what
this rank puts on the wire per step, counted by wrapping the torch.distributed calls: an
all-to-all's rows for other ranks, an all-gather's input times the other ranks (FSDP2's
`all_gather_single`), a reduce-scatter's input less its own part (`reduce_scatter_single`), an
all-reduce's input (the experts' gradients and norms; DTensor's own reductions go through
functional collectives and are not counted). Peak: the CPU allocator's
largest allocated total during one step of a fresh build (torch.profiler's allocator events,
as the memory estimator's real-step tests read it), and the memory estimator's figure for the
same run (rank 0, `--ep-skew 1` and the default 2) beside it.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent))

_SENT: Counter[str] = Counter()


def _count_collectives() -> None:
    """Wrap the torch.distributed calls the step makes (FSDP2's all_gather_single and
    reduce_scatter_single, the experts' all_to_all_single, all_reduce), adding the bytes this
    rank sends."""
    orig = {
        k: getattr(dist, k)
        for k in ("all_to_all_single", "all_gather_single", "reduce_scatter_single", "all_reduce")
    }

    def size(t: torch.Tensor) -> int:
        return t.numel() * t.element_size()

    def all_to_all_single(output, input, output_split_sizes=None, input_split_sizes=None, **kw):
        group = kw.get("group")
        n, me = dist.get_world_size(group), dist.get_rank(group)
        rows = input_split_sizes or [input.shape[0] // n] * n
        row = size(input) // max(input.shape[0], 1)
        _SENT["all_to_all"] += row * (sum(rows) - rows[me])
        return orig["all_to_all_single"](output, input, output_split_sizes, input_split_sizes, **kw)

    def all_gather_single(output, input, *a, **kw):
        _SENT["fsdp"] += size(input) * (size(output) // max(size(input), 1) - 1)
        return orig["all_gather_single"](output, input, *a, **kw)

    def reduce_scatter_single(output, input, *a, **kw):
        _SENT["fsdp"] += size(input) - size(output)
        return orig["reduce_scatter_single"](output, input, *a, **kw)

    def all_reduce(t, *a, **kw):
        _SENT["all_reduce"] += size(t)
        return orig["all_reduce"](t, *a, **kw)

    dist.all_to_all_single = all_to_all_single
    dist.all_gather_single = all_gather_single
    dist.reduce_scatter_single = reduce_scatter_single
    dist.all_reduce = all_reduce


def _run(rank: int, world: int, port: int, flags: dict, a: argparse.Namespace, out: str) -> None:
    from compiletune import distributed as dist_
    from compiletune.config import resolve
    from compiletune.estimate.estimator import measure_cpu_step
    from compiletune.train import BuildOptions, StepBatch, build_run
    from compiletune.train.step import backward_pass, optimizer_step

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), COMPILETUNE_LCE_EAGER="1")
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    cfg = resolve({}, flags)
    peak = measure_cpu_step(cfg, world)  # a fresh build and one step, as the estimator's tests
    _count_collectives()
    env = dist_.DistEnv(rank, world, rank, world, torch.device("cpu"), False)
    run = build_run(cfg, env, BuildOptions(device=torch.device("cpu"), read_inputs=False))
    run.optimizer.set_lr(1e-4)
    rows, seq = cfg.data.batch_size * world, cfg.data.seq_len
    g = torch.Generator().manual_seed(0)  # the same global batches on every rank
    times, sent = [], []
    for i in range(a.warmup + a.iters):
        tokens = torch.randint(0, run.args.vocab_size, (rows, seq + 1), generator=g)
        micro = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:].clone()}
        batch = StepBatch([micro], rows * seq)
        _SENT.clear()
        dist.barrier()
        t0 = time.perf_counter()
        optimizer_step(run, backward_pass(run, batch))
        dist.barrier()
        if i >= a.warmup:
            times.append(time.perf_counter() - t0)
            sent.append(dict(_SENT))
    result = {"rank": rank, "step_s": statistics.median(times), "sent": sent[-1], "peak": peak}
    Path(f"{out}.{rank}").write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def measure(flags: dict, world: int, a: argparse.Namespace) -> list[dict[str, Any]]:
    out = os.path.join(tempfile.mkdtemp(), "rank")
    mp.spawn(_run, args=(world, _free_port(), flags, a, out), nprocs=world, join=True)
    return [json.loads(Path(f"{out}.{r}").read_text()) for r in range(world)]


def estimated(flags: dict, world: int) -> float:
    from compiletune.config import resolve
    from compiletune.estimate.estimator import estimate_memory

    return estimate_memory(resolve({}, flags), world, round_bytes=1).peak_bytes


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--ep", type=int, default=2, help="ranks (and --ep)")
    ap.add_argument("--model", default="debug_moe")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    a = ap.parse_args(argv)
    base = {"model": a.model, "n_layers": a.layers, "seq_len": a.seq_len}
    base |= {"batch_size": a.batch_size, "dtype": "fp32", "loss": "plain", "fsdp": True}
    mib = 2**20
    print(
        f"{a.model}, {a.layers} layers, seq {a.seq_len} x batch {a.batch_size} per rank, fp32, "
        f"{a.ep} gloo ranks x 1 thread"
    )
    print(
        "| run | step (median, slowest rank) | all-to-all sent / rank | FSDP sent / rank | "
        "all-reduce sent / rank | peak per rank (measured) | estimate, rank 0 (uniform / skew 2) |"
    )
    print("|---|---|---|---|---|---|---|")
    for name, ep in (("FSDP2", 1), (f"FSDP2 + --ep {a.ep}", a.ep)):
        flags = {**base, "ep": ep}
        ranks = measure(flags, a.ep, a)
        step = max(r["step_s"] for r in ranks)
        sent = {k: [r["sent"].get(k, 0) / mib for r in ranks] for k in ("all_to_all", "fsdp")}
        reduce = [r["sent"].get("all_reduce", 0) / mib for r in ranks]
        peaks = " / ".join(f"{r['peak'] / mib:.1f}" for r in ranks)
        est = [estimated({**flags, "ep_skew": s}, a.ep) / mib for s in (1.0, 2.0)]
        est_text = f"{est[0]:.1f} / {est[1]:.1f}" if ep > 1 else f"{est[0]:.1f}"
        print(
            f"| {name} | {step * 1e3:.0f} ms | "
            + " | ".join(" / ".join(f"{v:.2f}" for v in vals) + " MiB" for vals in sent.values())
            + f" | {' / '.join(f'{v:.3f}' for v in reduce)} MiB | {peaks} MiB | {est_text} MiB |"
        )


if __name__ == "__main__":
    main()
