"""Bar charts for bench results (matplotlib is optional: without it the chart is skipped)."""

from __future__ import annotations

import math
import sys
from pathlib import Path


def bar_panels(path: Path, title: str, panels: list[tuple[str, list[str], list[float]]]) -> None:
    """One horizontal bar chart per (panel title, bar labels, values), two panels per row."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"no matplotlib (pip install matplotlib): {path} not written", file=sys.stderr)
        return
    cols = min(2, len(panels))
    rows = math.ceil(len(panels) / cols)
    height = max(len(labels) for _, labels, _ in panels) * 0.45 + 1.2
    fig, axes = plt.subplots(rows, cols, figsize=(6 * cols, height * rows), squeeze=False)
    for ax, (name, labels, values) in zip(axes.flat, panels, strict=False):
        bars = ax.barh(range(len(values)), values, color="tab:blue")
        ax.set_yticks(range(len(labels)), labels)
        ax.invert_yaxis()  # first rung on top
        ax.bar_label(bars, fmt="%.3g", padding=2)
        ax.set_title(name)
        ax.margins(x=0.15)
    for ax in list(axes.flat)[len(panels) :]:
        ax.axis("off")
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"wrote {path}")
