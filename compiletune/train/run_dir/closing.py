"""How a run ends on the page: summary.json, and the closing line printed from it.

Its own room because the closing line is the run's report to its user (what this invocation
did and, after a resume, what the whole run has done): its wording is read and changed apart
from the folder's checks.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from compiletune.metrics import strict_json


def write_summary(out: Path, summary: dict[str, Any]) -> None:
    (out / "summary.json").write_text(strict_json(summary, indent=2) + "\n")


def closing_line(s: dict[str, Any]) -> str:
    """The summary as the one line a run ends with: what this invocation did, and after a
    resume what the whole run has done, each labelled; tokens are the data's, padding apart."""
    c = s["compile"]
    total = s.get("run_totals")
    resumed = s["first_step"] > 1
    steps = f"{s['steps']} steps"
    if resumed:
        span = f"steps {s['first_step']}-{s['step']}" if s["steps"] else "no step"
        steps = f"{span} ({s['steps']} this time, {s['step']} in all)"
    if not s["steps"] and s["interrupted"]:  # stopped before its first step ended (a reward)
        saved = f", checkpoint {s['checkpoint']}" if s["checkpoint"] else ""
        return (
            f"stopped early: no step completed (the run is at step {s['step']} of "
            f"{s['max_steps']}){saved}"
        )
    if not s["steps"]:  # a resume that only finished the merge
        parts = [f"no step to train (the run is at step {s['step']} of {s['max_steps']})"]
        if s["merged"]:
            parts.append(f"merged model {s['merged']}")
        return "done: " + ", ".join(parts)
    parts = [f"{steps}, loss {s['first_loss']:.4f} -> {s['final_loss']:.4f}"]
    if s["eval_loss"] is not None:
        ppl = f" (ppl {s['eval_ppl']:.2f})" if s.get("eval_ppl") is not None else ""
        parts.append(f"eval loss {s['eval_loss']:.4f}{ppl}")
    if s.get("eval_reward") is not None:
        parts.append(f"held-out reward {s['eval_reward']:.3f}")
    tokens = f"{s['tokens']} tokens"
    if s["padding_tokens"]:
        tokens += f" (+{s['padding_tokens']} padding)"
    this_time = " this time" if resumed else ""
    parts.append(
        f"{tokens}{this_time} in {s['seconds']:.1f}s ({s['tokens_per_s']:.0f} tok/s)"
        + (f", {total['tokens']} in all in {total['seconds']:.1f}s" if resumed and total else "")
    )
    parts.append(f"peak mem {s['peak_mem_gib']:.2f} GiB")
    if c:
        parts.append(
            f"{c['compiles']} compiles ({c['recompiles']} recompiles, {c['compile_seconds']:.1f}s)"
        )
    if s["helper_graphs"]:
        parts.append(f"{s['helper_graphs']} helper graphs compiled")
    last = f"checkpoint {s['checkpoint']}"
    if s["merged"]:
        last += f", merged model {s['merged']}"
    parts.append(last)
    return ("stopped early: " if s["interrupted"] else "done: ") + ", ".join(parts)
