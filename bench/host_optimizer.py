"""Bench for the host side of a CPU-offloaded run (`--fsdp --cpu-offload`, the 24 GB recipes):
seconds per billion parameters of the optimizer step on host tensors, and of the random init
that a preset without `--model-dir` draws on the host.

Variants of the step, each over the same `--size` values split into `--tensors` parameters:

    adamw fused fp32        torch's fused CPU AdamW on fp32 weights (8 bytes of state per value)
    adamw fused bf16        the same on bf16 weights (no stochastic rounding: torch rounds to
                            nearest, which the trainer does not pick for pure bf16)
    adamw8bit bf16 stoch.   compiletune's 8-bit step with stochastic bf16 rounding, the
                            recipe's optimizer: the C++ kernel, draws hashed inline
    adamw8bit bf16 torch    the same step compiled by Inductor (COMPILETUNE_CPU_KERNELS=0),
                            with the [n] draws made by `rounding_noise`
    randint draw            what the draws cost when they came from torch.randint with a
                            seeded CPU generator (before the hashed draws): the draw alone

and the init: `normal_` on bf16 with a seeded generator, as `Decoder.init_weights` draws.

    python bench/host_optimizer.py                  # 256M values in 8 tensors, 3 rounds
    python bench/host_optimizer.py --size 64e6      # quicker

Variants run in turn for `--rounds` rounds and each reports its fastest step (the least
disturbed by a shared machine's load); `threads` says how many cores it used. The seconds per
billion extrapolated to more cores assume the step scales with cores, which a memory-bound
step does only until the host's memory bandwidth is used up: that column is an upper bound on
the speed, stated as such. Writes bench/results/host-optimizer-cpu.json.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import result_header, write_result  # noqa: E402

from compiletune.optim import Optimizer  # noqa: E402


def _params(size: int, tensors: int, dtype: torch.dtype) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(0)
    each = size // tensors
    params = []
    for _ in range(tensors):
        p = torch.nn.Parameter(torch.randn(each, generator=g).to(dtype))
        p.grad = (torch.randn(each, generator=g) * 1e-3).to(dtype)
        params.append(p)
    return params


def _optimizer_step(kind: str, dtype: torch.dtype, compensation: str, kernels: str):
    def make(size: int, tensors: int) -> Callable[[], None]:
        os.environ["COMPILETUNE_CPU_KERNELS"] = kernels
        params = _params(size, tensors, dtype)
        opt = Optimizer(
            [(f"w{i}", p) for i, p in enumerate(params)],
            kind=kind,
            lr=1e-4,
            weight_decay=0.1,
            device=torch.device("cpu"),
            bf16_compensation=compensation,
        )

        def step() -> None:
            os.environ["COMPILETUNE_CPU_KERNELS"] = kernels
            opt.step()

        return step

    return make


def _randint(size: int, tensors: int) -> Callable[[], None]:
    g = torch.Generator()
    each = size // tensors

    def draw() -> None:
        for i in range(tensors):
            g.manual_seed(i)
            torch.randint(0, 1 << 16, (each,), dtype=torch.int32, generator=g)

    return draw


def _init(size: int, tensors: int) -> Callable[[], None]:
    weights = [torch.empty(size // tensors, dtype=torch.bfloat16) for _ in range(tensors)]
    g = torch.Generator()

    def draw() -> None:
        g.manual_seed(0)
        for w in weights:
            w.normal_(0.0, 0.02, generator=g)

    return draw


VARIANTS: dict[str, Callable[[int, int], Callable[[], None]]] = {
    "adamw fused fp32": _optimizer_step("adamw", torch.float32, "none", "1"),
    "adamw fused bf16": _optimizer_step("adamw", torch.bfloat16, "none", "1"),
    "adamw8bit bf16 stoch.": _optimizer_step("adamw8bit", torch.bfloat16, "stochastic", "1"),
    "adamw8bit bf16 torch": _optimizer_step("adamw8bit", torch.bfloat16, "stochastic", "0"),
    "randint draw": _randint,
    "init normal_ bf16": _init,
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", type=float, default=256e6, help="values stepped (default 256M)")
    ap.add_argument("--tensors", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--cores", type=int, default=16, help="cores to extrapolate to")
    args = ap.parse_args()
    size = int(args.size)
    runs = {name: make(size, args.tensors) for name, make in VARIANTS.items()}
    for run in runs.values():  # warm-up: builds the kernels, compiles the torch step
        run()
    best: dict[str, float] = {}
    for _ in range(args.rounds):
        for name, run in runs.items():
            start = time.perf_counter()
            run()
            best[name] = min(best.get(name, float("inf")), time.perf_counter() - start)
    threads = torch.get_num_threads()
    rows = []
    print(
        f"| variant | s per 1B values ({threads} threads) | s per 1B at {args.cores} cores (bound) |"
    )
    print("|---|---:|---:|")
    for name, seconds in best.items():
        per_b = seconds * 1e9 / size
        bound = per_b * threads / args.cores
        rows.append(
            {
                "variant": name,
                "s_per_billion": per_b,
                f"s_per_billion_{args.cores}_cores_bound": bound,
            }
        )
        print(f"| {name} | {per_b:.2f} | {bound:.2f} |")
    result = {**result_header(), "size": size, "tensors": args.tensors, "rows": rows}
    write_result(Path(__file__).parent / "results" / "host-optimizer-cpu.json", result)


if __name__ == "__main__":
    main()
