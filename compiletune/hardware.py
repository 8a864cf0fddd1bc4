"""What this machine's CPU does well: measured once per process, for the choices that depend
on it.

Some x86 CPUs have no bf16 matmul instructions (AVX2 only: no AVX512-BF16, no AMX). There
PyTorch's bf16 matmul falls back to a scalar path: on this project's CPU machines it ran at
0.3 GFLOP/s against 154 GFLOP/s in fp32, so a `--dtype bf16` run crawls. `warn_slow_bf16`
says so once, with the numbers and the fix; `cpu_default_dtype` keeps benches from choosing
bf16 on such a CPU. And how much memory the machine has (`machine_host_bytes`).
"""

from __future__ import annotations

import functools
import os
import sys
import time

import torch

SLOW_FACTOR = 4.0  # bf16 slower than fp32 by more than this: no native bf16 matmul
_warned = False


def machine_host_bytes() -> int:
    """This machine's physical memory (the default of --host-memory)."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _gflops(dtype: torch.dtype, n: int) -> float:
    a = torch.randn(n, n).to(dtype)
    b = torch.randn(n, n).to(dtype)
    a @ b  # warm-up
    best = float("inf")
    for _ in range(3):
        t = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t)
    return 2 * n**3 / best / 1e9


@functools.cache
def cpu_matmul_gflops() -> tuple[float, float]:
    """(bf16, fp32) matmul GFLOP/s of this CPU, on 256 x 256 products (under half a second even where bf16
    is slow)."""
    return _gflops(torch.bfloat16, 256), _gflops(torch.float32, 256)


def cpu_bf16_is_slow() -> bool:
    bf16, fp32 = cpu_matmul_gflops()
    return bf16 * SLOW_FACTOR < fp32


def warn_slow_bf16() -> bool:
    """Once per process, on a CPU whose bf16 matmul is slow: say so on stderr, with the
    measured rates and the fix. Returns whether it is slow."""
    global _warned
    if not cpu_bf16_is_slow():
        return False
    if not _warned:
        _warned = True
        bf16, fp32 = cpu_matmul_gflops()
        print(
            f"warning: bf16 matmul on this CPU runs at {bf16:.1f} GFLOP/s against {fp32:.1f} "
            "GFLOP/s in fp32 (no AVX512-BF16 or AMX): a bf16 run here will be very slow; "
            "pass --dtype fp32",
            file=sys.stderr,
            flush=True,
        )
    return True


def cpu_default_dtype() -> str:
    """The dtype a CPU bench runs in by default: bf16 where the CPU multiplies it natively."""
    return "fp32" if cpu_bf16_is_slow() else "bf16"


HOST_READS_ENV = "COMPILETUNE_NO_HOST_READS"


def host_reads_free(device: torch.device) -> bool:
    """Whether reading a tensor's values on the host mid-step (`.item()`, `.tolist()`,
    `bool(t)`, a size taken from data) costs nothing on `device`. On a CPU it does not; on an
    accelerator it stalls the host until the device's queue drains, so there a step reads the
    device once (the loss check) and data-dependent sizes stay on the device.
    COMPILETUNE_NO_HOST_READS=1 makes a CPU take the accelerator's paths (the test that counts
    a step's host syncs)."""
    import os

    return device.type == "cpu" and os.environ.get(HOST_READS_ENV) != "1"
