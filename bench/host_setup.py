"""Bench for the host set-up of a CPU-offloaded FSDP run (`--fsdp --cpu-offload`, the 24 GB
recipes) with random initial weights: seconds per billion parameters of each phase, the old
path (rank 0 draws the whole model with a seeded generator, then every rank takes its shard of
it) beside the new one (every rank draws its own shard, `compiletune.weight_init`), at 1 and 2
threads.

    phase                    what runs
    draw whole (old)         `build_model(init=True)`: the full model in its dtype, normal_ from
                             one seeded generator (serial)
    hand out shards (old)    meta model, `fully_shard`, `to_empty` on the host, then
                             `load_full_state` (set_model_state_dict from rank 0's full dict)
    shard + place            meta model, `fully_shard`, `to_empty` on the host: what both
                             paths do (allocation only; pages are touched by the fill)
    draw shards (new)        `init_hashed` into the shards just placed (the C++ kernel)
    8-bit AdamW state        `Optimizer(adamw8bit, in backward)` over the shards

One process, one rank of a gloo group (the recipe's one GPU), `--model` cut to `--layers`
blocks (llama3_1_8b with 1 block: 1.27B parameters, its embedding and head whole). Each phase
reports its fastest of `--rounds`, in wall seconds and in CPU seconds of the process (the work
done, whatever share of the cores other processes leave it: on a shared machine the wall time
of 2 threads says more about the neighbours than about the code). The column at `--cores`
cores divides the CPU seconds by the cores for phases whose code splits the work over threads
(`PARALLEL`) and keeps them for the others: an extrapolation, linear in parameters and cores,
and an upper bound on the speed of the parallel ones (a fill runs out of memory bandwidth
before 16 cores), stated as such. Writes bench/results/host-setup-cpu.json.

    python bench/host_setup.py                      # llama3_1_8b, 1 block, bf16
    python bench/host_setup.py --layers 0 --rounds 1
"""

from __future__ import annotations

import argparse
import gc
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import result_header, write_result  # noqa: E402

from compiletune import weight_init  # noqa: E402
from compiletune.distributed import DistEnv, apply_fsdp, build_mesh, load_full_state  # noqa: E402
from compiletune.models import Transformer, build_model, from_name  # noqa: E402
from compiletune.optim import Optimizer  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def _sharded(args, dtype: torch.dtype, env: DistEnv) -> Transformer:
    with torch.device("meta"):
        model = Transformer(args)
    model.to(dtype)
    apply_fsdp(model, build_mesh(env, "full", None), cpu_offload=True, grad_hooks=True)
    model.to_empty(device="cpu")
    model.tie_weights()
    return model


# Whether a phase's work is split over threads, by its code: OpenMP over independent chunks
# (the hashed draws) or ATen's parallel fills and copies; a seeded generator is one stream.
PARALLEL = {
    "draw whole (old)": False,
    "shard + place": False,
    "hand out shards (old)": True,
    "draw shards (new)": True,
    "8-bit AdamW state": True,
}


class _Clock:
    """(wall seconds, CPU seconds of this process) since the last `lap`, under a phase's name.
    CPU seconds are the work done whatever share of the cores other processes leave us."""

    def __init__(self) -> None:
        self.times: dict[str, tuple[float, float]] = {}
        self.start()

    def start(self) -> None:
        self.last = (time.perf_counter(), time.process_time())

    def lap(self, name: str) -> None:
        now = (time.perf_counter(), time.process_time())
        self.times[name] = (now[0] - self.last[0], now[1] - self.last[1])
        self.last = now


def one_round(args, dtype: torch.dtype, env: DistEnv) -> dict[str, tuple[float, float]]:
    """Seconds of each phase, old path then new, with the memory of each freed between."""
    clock = _Clock()
    whole = build_model(args, dtype=dtype, init=True, seed=0)
    clock.lap("draw whole (old)")
    full_sd = whole.state_dict()
    clock.start()
    model = _sharded(args, dtype, env)
    clock.lap("shard + place")
    load_full_state(model, full_sd)
    clock.lap("hand out shards (old)")
    del whole, full_sd, model
    gc.collect()
    model = _sharded(args, dtype, env)
    clock.start()
    weight_init.init_hashed(model, seed=0)
    clock.lap("draw shards (new)")
    named = list(model.named_parameters())
    clock.start()
    opt = Optimizer(named, kind="adamw8bit", lr=1e-5, in_backward=True, device=torch.device("cpu"))
    clock.lap("8-bit AdamW state")
    opt.remove_hooks()
    del model, named, opt
    gc.collect()
    return clock.times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="llama3_1_8b")
    ap.add_argument("--layers", type=int, default=1, help="blocks kept (default 1)")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--cores", type=int, default=16, help="cores to extrapolate to")
    ap.add_argument("--threads", default="1,2", help="thread counts to run, comma-separated")
    a = ap.parse_args()
    args = from_name(a.model)
    args.n_layers = a.layers
    if args.layer_types:
        args.layer_types = args.layer_types[: a.layers]
    dtype = DTYPES[a.dtype]
    with torch.device("meta"):
        n_params = sum(p.numel() for p in Transformer(args).parameters())
    store = Path(tempfile.mkdtemp()) / "store"
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    env = DistEnv(0, 1, 0, 1, torch.device("cpu"), owns_group=False)
    weight_init.hashed_normal_(torch.empty(8, dtype=dtype), 0.02, 0)  # builds the kernel
    per_b: dict[int, dict[str, tuple[float, float]]] = {}  # threads -> phase -> (wall, cpu)
    threads = [int(t) for t in a.threads.split(",")]
    for n in threads:
        torch.set_num_threads(n)
        best: dict[str, tuple[float, float]] = {}
        for _ in range(a.rounds):
            for name, sec in one_round(args, dtype, env).items():
                best[name] = min(best.get(name, (float("inf"), 0.0)), sec)
        per_b[n] = {k: (w * 1e9 / n_params, c * 1e9 / n_params) for k, (w, c) in best.items()}
    dist.destroy_process_group()

    lo = min(threads)
    head = " | ".join(f"wall / CPU s per B, {n} thr" for n in threads)
    print(f"{a.model}, {a.layers} blocks: {n_params / 1e9:.2f}B parameters, {a.dtype}")
    print(f"| phase | {head} | s/B at {a.cores} cores (extrapolated) | s at 8.03B |")
    print("|---|" + "---:|" * (len(threads) + 2))
    rows = []
    for name in per_b[lo]:
        cpu = per_b[lo][name][1]  # the work, from the fewest threads' run
        at_cores = cpu / a.cores if PARALLEL[name] else cpu
        cells = " | ".join(f"{per_b[n][name][0]:.2f} / {per_b[n][name][1]:.2f}" for n in threads)
        kind = "" if PARALLEL[name] else " (serial)"
        print(f"| {name} | {cells} | {at_cores:.2f}{kind} | {at_cores * 8.03:.1f} |")
        rows.append(
            {
                "phase": name,
                "wall_s_per_billion": {str(n): per_b[n][name][0] for n in threads},
                "cpu_s_per_billion": {str(n): per_b[n][name][1] for n in threads},
                "parallel": PARALLEL[name],
                f"s_per_billion_{a.cores}_cores_extrapolated": at_cores,
            }
        )
    result = {
        **result_header(),
        "model": a.model,
        "layers": a.layers,
        "dtype": a.dtype,
        "params": n_params,
        "rows": rows,
    }
    write_result(Path(__file__).parent / "results" / "host-setup-cpu.json", result)


if __name__ == "__main__":
    main()
