"""How --ep's split sizes reach the host: one counts exchange per MoE layer (what
compiletune/ops/expert_exchange.py does) against padding every rank's share to a fixed
capacity (no host read; the capacity must be the worst case, every row, to drop none).

    python bench/moe_ep_exchange.py [--rows 8192] [--dim 512] [--experts 8] [--reps 20]

Two gloo ranks on CPU, one thread each; routing uniform at random. Prints, per direction of one
layer, the median seconds and the bytes each rank sends and holds.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from compiletune.ops.expert_exchange import ep_counts, ep_rows, ep_to_experts, register_group


def _measure(rank: int, port: int, a: argparse.Namespace, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.set_num_threads(1)
    group = register_group(dist.group.WORLD)
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(a.rows, a.dim, generator=g)
    expert = torch.randint(0, a.experts, (a.rows,), generator=g).sort().values
    counts = torch.bincount(expert, minlength=a.experts)
    host, padded = [], []
    for _ in range(a.reps):
        dist.barrier()
        t0 = time.perf_counter()
        counts_all = ep_counts(counts, group)
        y = ep_to_experts(x, counts_all, group, ep_rows(counts_all, group))
        host.append(time.perf_counter() - t0)
        dist.barrier()
        t0 = time.perf_counter()
        # capacity: every row of every rank may go to one rank, so each pair exchanges a.rows
        send = torch.cat([x, x])  # [2 * rows, d]: this rank's rows for each destination, padded
        buf = torch.empty_like(send)
        dist.all_to_all_single(buf, send)
        padded.append(time.perf_counter() - t0)
    elt = x.element_size() * a.dim
    result = {
        "rank": rank,
        "host_exchange_s": statistics.median(host),
        "padded_s": statistics.median(padded),
        "host_sent_bytes": int(counts_all[rank].sum() * elt),  # every row once
        "host_received_rows": int(y.shape[0]),
        "padded_sent_bytes": int(send.numel() * x.element_size()),
        "padded_buffer_rows": int(buf.shape[0]),
    }
    with open(f"{out}.{rank}", "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=8192)
    p.add_argument("--dim", type=int, default=512)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--reps", type=int, default=20)
    a = p.parse_args()
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = f"/tmp/moe_ep_exchange.{os.getpid()}"
    mp.spawn(_measure, args=(port, a, out), nprocs=2, join=True)
    for r in range(2):
        with open(f"{out}.{r}") as f:
            print(json.load(f))


if __name__ == "__main__":
    main()
