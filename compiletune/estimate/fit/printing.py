"""The estimate-memory outputs as printed: the estimate with its verdict and fix, the ladder
and length ladder as markdown tables, and --max-seq-len's answer.

Its own room because the wording users read changes apart from the searches that produce it;
nothing here estimates.
"""

from __future__ import annotations

from typing import Any

from compiletune.estimate.estimator import GPUS_PER_NODE, MemoryEstimate
from compiletune.estimate.fit.capacity import (
    RESERVE_BYTES,
    Capacity,
    device_fits,
    fits,
    host_fits,
    host_needed,
    with_reserve,
)
from compiletune.estimate.fit.ladder import SEQ_STEP, Rung
from compiletune.estimate.tracker import CATEGORIES
from compiletune.models.params import params_text


def verdict(est: MemoryEstimate, capacity: Capacity) -> str:
    """One line: whether the step fits each GPU and, when it offloads, the machine's host memory."""
    gib = 2**30
    line = (
        f"{'fits' if device_fits(est, capacity) else 'does NOT fit'} in {capacity.device_bytes / gib:.0f} GiB "
        f"per GPU (with {RESERVE_BYTES / gib:.0f} GiB kept for the CUDA context, workspaces and "
        "fragmentation)"
    )
    if est.host_bytes and capacity.host_bytes is not None:
        ranks = min(est.gpus, GPUS_PER_NODE)
        line += (
            f"; host memory: {host_needed(est) / gib:.1f} GiB for {ranks} rank(s) on one machine "
            f"{'fits' if host_fits(est, capacity) else 'does NOT fit'} in {capacity.host_bytes / gib:.0f} GiB "
            "(--host-memory)"
        )
    return line


def _seq(setup: dict[str, Any]) -> str:
    """The row length, and under --cp the piece of it each GPU holds."""
    cp = setup.get("cp", 1)
    if cp == 1:
        return str(setup["seq_len"])
    return f"{setup['seq_len']} ({setup['seq_len'] // cp} each, --cp {cp})"


def format_estimate(
    est: MemoryEstimate,
    capacity: Capacity | None = None,
    fix: str | None = None,
    total_seconds: float | None = None,
) -> str:
    """The estimate as printed; `total_seconds`: the command's whole time, start-up and the
    advice search included."""
    gib = 2**30
    s = est.setup
    lines = [
        f"{s['model']} ({params_text(s['params'])} parameters), {est.gpus} GPU(s)"
        + (f", FSDP2 {s['sharding']}" if s["fsdp"] else "")
        + (f", experts split over {s['ep']} (--ep)" if s.get("ep", 1) > 1 else "")
        + (" + CPU offload" if s["cpu_offload"] else "")
        + f"; {s['dtype']}, seq {_seq(s)} x batch {s['batch_size']} per GPU, loss "
        f"{s['loss']}, ac {s['ac']}, {s['optimizer']}"
        + (" in backward" if s["optimizer_in_backward"] else "")
        + (f"; objective {s['objective']}" if s.get("objective", "sft") != "sft" else ""),
        f"peak per GPU: {est.peak_bytes / gib:.2f} GiB (in {est.peak_phase})",
    ]
    for k in CATEGORIES:
        lines.append(f"  {k:<16} {est.parts[k] / gib:8.2f} GiB")
    if est.host_bytes:
        parts = ", ".join(f"{k} {v / gib:.2f}" for k, v in est.host_parts.items() if v)
        lines.append(f"host memory per GPU (offload): {est.host_bytes / gib:.2f} GiB ({parts})")
    if capacity is not None:
        lines.append(verdict(est, capacity))
        if fix is not None:
            lines.append(f"to fit: {fix}")
    lines += [f"note: {n}" for n in est.notes]
    took = f"estimated in {est.seconds:.1f}s on fake tensors"
    if total_seconds is not None:
        took += f"; {total_seconds:.1f}s in all, start-up and any advice search included"
    lines.append(f"({took})")
    return "\n".join(lines)


def format_ladder(rows: list[Rung], capacity: Capacity | None = None) -> str:
    gib = 2**30
    head = "| rung | flags added | peak GiB / GPU | host GiB / GPU |"
    sep = "|---|---|---:|---:|"
    if capacity is not None:
        head += f" fits {capacity.device_bytes / gib:.0f} GiB |"
        sep += "---|"
    lines = [head, sep]
    for r in rows:
        if r.est is None:
            lines.append(f"| {r.name} | {r.flags} | {r.why} | |" + (" |" if capacity else ""))
            continue
        row = (
            f"| {r.name} | {r.flags or '—'} | {r.est.peak_bytes / gib:.2f} | "
            f"{r.est.host_bytes / gib:.2f} |"
        )
        if capacity is not None:
            row += f" {'yes' if fits(r.est, capacity) else 'no'} |"
        lines.append(row)
    return "\n".join(lines)


def longest_line(
    longest: int, est: MemoryEstimate, positions: int, capacity: Capacity | None = None
) -> str:
    """--max-seq-len's answer, and where memory would go past the model's positions."""
    line = f"longest --seq-len that fits: {min(longest, positions)}"
    peak = with_reserve(est, capacity) if capacity else f"{est.peak_bytes / 2**30:.2f} GiB"
    if longest <= positions:
        return line + f" (peak {peak})"
    return (
        line + f", the model's positions; memory would take {longest} (peak "
        f"{peak}) with positions extended past the checkpoint's"
    )


def no_length_line(capacity: Capacity) -> str:
    """--max-seq-len's answer when no length fits: what the reserve leaves for a step."""
    gib = 2**30
    room = max(0, capacity.device_bytes - RESERVE_BYTES) / gib
    return (
        f"no --seq-len of {SEQ_STEP} tokens or more fits: {capacity.device_bytes / gib:g} GiB per "
        f"GPU less the {RESERVE_BYTES / gib:.0f} GiB reserve (the CUDA context, workspaces, "
        f"fragmentation) leaves {room:.2f} GiB for the step; see the ladder (--ladder)"
    )


def format_length_ladder(rows: list[Rung], positions: int) -> str:
    """The length ladder as a markdown table; lengths past the model's `positions` marked."""
    lines = [
        "| rung | flags added | longest --seq-len | peak GiB / GPU |",
        "|---|---|---:|---:|",
    ]
    for r in rows:
        if r.est is None:
            lines.append(f"| {r.name} | {r.flags or '—'} | {r.why} | |")
            continue
        mark = " (past the positions)" if (r.longest or 0) > positions else ""
        mark += f" ({r.why})" if r.why else ""
        lines.append(
            f"| {r.name} | {r.flags or '—'} | {r.longest}{mark} | {r.est.peak_bytes / 2**30:.2f} |"
        )
    lines.append(f"\nthe model's positions: {positions} (train refuses a longer --seq-len)")
    return "\n".join(lines)
