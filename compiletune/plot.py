"""`compiletune plot RUN_DIR ...`: runs' `metrics.jsonl` drawn as a grid of charts, one PNG and
one self-contained HTML page (the same panels, embedded as base64 PNGs).

Panels, each a chart of one key against the step: `loss` (with `eval_loss` as points), `lr`,
`tokens_per_s`, `peak_mem_gib`, `grad_norm`, then the objectives' keys in a fixed order (GRPO
rewards, DPO rewards, KD, MoE expert load), then any other numeric key, sorted, unless it never
changes. Nested numbers are named by their path (`rewards.NAME.mean`); bookkeeping counts are
left out. An `eval_KEY` is drawn as points on KEY's panel. Several runs share the panels, one
colour each, with a legend of their folder names.

It reads what a trainer can leave: a line torn by a kill is skipped (with a count, on stderr), a
number beyond +-LIMIT (or beyond a float) is a gap as a non-finite one is, and a log with
thousands of keys (one per expert and layer) gets the known panels and MAX_OTHER_PANELS others,
top-level keys first, the rest named as left out. The files are written whole or not at all.

The grid has COLUMNS columns of PANEL_PX pixels each, so the PNG is COLUMNS * PANEL_PX[0] wide
and ceil(panels / COLUMNS) * PANEL_PX[1] high. matplotlib (the `plot` extra) is imported only
here, with the Agg canvas; a training run writes plot.png and plot.html at its end when it is
installed (`after_run`).
"""

from __future__ import annotations

import base64
import errno
import html
import io
import math
import os
import shutil
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from compiletune import faults
from compiletune.errors import UserError
from compiletune.metrics import parse_metrics

PLOT_FILES = ("plot.png", "plot.html")  # what a run folder gets (run_dir/contents.py knows them)
COLUMNS = 3
PANEL_PX = (400, 300)  # width, height of one panel
DPI = 100
_MARGINS = (64, 14, 26, 34)  # left, right, top, bottom of the axes inside a panel, in pixels
INSTALL = 'pip install "compiletune[plot]"'
# Beyond this an axis's span overflows a float (matplotlib: "arange: cannot compute length").
LIMIT = 1e300
MAX_OTHER_PANELS = 12  # panels for keys not in KNOWN

# Drawn first, in this order, whenever present (even when constant).
KNOWN = (
    *("loss", "lr", "tokens_per_s", "peak_mem_gib", "grad_norm"),
    *("reward", "reward_std", "advantage_std", "kl", "completion_len", "completion_clipped"),
    *("ratio_clipped", "reward_margin", "reward_accuracy", "chosen_reward", "rejected_reward"),
    *("kd_divergence", "kd_ce", "expert_load_min", "expert_load_max", "router_aux_loss"),
    "router_z_loss",
)
TITLES = {
    "lr": "learning rate",
    "tokens_per_s": "tokens/s",
    "peak_mem_gib": "peak memory (GiB)",
    "grad_norm": "gradient norm",
}
# Counts and derived values that say nothing a panel should show.
BOOKKEEPING = {
    *("step", "tokens", "padding", "targets", "epoch", "step_time_s"),
    *("eval_ppl", "eval_targets", "eval_pairs", "expert_load.mean", "completion_len_max"),
    "eval_prompts",
}


@dataclass
class Run:
    """One run's numeric series: key -> (steps, values); a null (non-finite) value is NaN."""

    name: str
    series: dict[str, tuple[list[float], list[float]]] = field(default_factory=dict)
    beyond: int = 0  # finite numbers beyond +-LIMIT, drawn as gaps


def read_run(folder: Path, say: Callable[[str], None] | None = None) -> list[dict[str, Any]]:
    """The records of `folder`/metrics.jsonl. A line that is not a JSON object (torn by a crash
    while it was written) is skipped, and `say` told how many."""
    path = folder / "metrics.jsonl"
    if not folder.is_dir():
        raise UserError(f"{folder}: no such run folder; pass the --output-dir of a training run")
    if not path.is_file():
        raise UserError(
            f"{folder} has no metrics.jsonl; pass the --output-dir of a `compiletune train` run"
        )
    records, torn = parse_metrics(path.read_bytes())
    if not records:
        bad = f" ({len(torn)} lines are not JSON objects)" if torn else ""
        raise UserError(f"{path} holds no steps yet{bad} (a run writes a line after each step)")
    if torn and say is not None:
        first = ", ".join(map(str, torn[:3])) + (", ..." if len(torn) > 3 else "")
        say(
            f"{path}: skipped {len(torn)} line{'s that are' if len(torn) > 1 else ' that is'} "
            f"not a JSON object (line {first}: torn by a kill while it was written)"
        )
    return records


def _numbers(
    record: dict[str, Any], prefix: str = "", beyond: list[int] | None = None
) -> dict[str, float]:
    """The record's numbers (nested dicts flattened to dotted keys); null is NaN, lists and
    text are left out. A number beyond +-LIMIT is inf (a gap when drawn), counted in
    `beyond[0]`."""
    out: dict[str, float] = {}
    for key, value in record.items():
        name = prefix + str(key)
        if isinstance(value, dict):
            out.update(_numbers(value, name + ".", beyond))
        elif value is None:
            out[name] = math.nan
        elif isinstance(value, int | float) and not isinstance(value, bool):
            out[name] = x = _float(value)
            limited = isinstance(value, int) or math.isfinite(value)  # not an inf of the log
            if beyond is not None and math.isinf(x) and limited:
                beyond[0] += 1
    return out


def _float(value: float) -> float:
    """`value` as a float an axis can hold: inf when it is beyond +-LIMIT (an integer beyond
    any float included)."""
    try:
        x = float(value)
    except OverflowError:
        return math.inf
    return x if abs(x) <= LIMIT else (math.inf if math.isfinite(x) else x)  # inf, nan: as they are


def to_run(name: str, records: list[dict[str, Any]]) -> Run:
    """The records' numbers as series; a step beyond +-LIMIT becomes the record's position."""
    run = Run(name)
    beyond = [0]
    for i, record in enumerate(records, 1):
        values = _numbers(record, beyond=beyond)
        step = values.get("step", math.nan)
        x = step if math.isfinite(step) else float(i)
        for key, value in values.items():
            if key not in BOOKKEEPING:
                xs, ys = run.series.setdefault(key, ([], []))
                xs.append(x)
                ys.append(value)
    run.beyond = beyond[0]
    return run


def panels(runs: Sequence[Run], left_out: list[str] | None = None) -> list[str]:
    """The keys to draw, in order: KNOWN ones present, then up to MAX_OTHER_PANELS others,
    sorted (chosen top-level keys first: a nested key is a detail of one), leaving out an `eval_KEY` drawn on KEY's panel and a
    key whose value never changes. The other keys that change but are not drawn go into
    `left_out`. Each series is read once."""
    keys = {k for r in runs for k in r.series}
    drawn = [k for k in KNOWN if k in keys]

    def changes(key: str) -> bool:
        values = {v for r in runs for v in r.series.get(key, ((), ()))[1] if math.isfinite(v)}
        return len(values) > 1

    others = [
        key
        for key in sorted(keys - set(KNOWN), key=lambda k: (k.count("."), k))
        if not (key.startswith("eval_") and key[5:] in keys)  # points on its key's panel
        and changes(key)
    ]
    if left_out is not None:
        left_out.extend(others[MAX_OTHER_PANELS:])
    return drawn + sorted(others[:MAX_OTHER_PANELS])


def _matplotlib() -> Any:
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.ticker import MaxNLocator
    except ImportError as e:
        raise UserError(f"plotting needs matplotlib ({e}); install it: {INSTALL}") from e
    return Figure, FigureCanvasAgg, MaxNLocator


def render(runs: Sequence[Run], keys: Sequence[str]) -> Any:
    """The grid as an RGBA array of shape [rows * PANEL_PX[1], COLUMNS * PANEL_PX[0], 4]."""
    import numpy as np

    Figure, Canvas, MaxNLocator = _matplotlib()
    w, h = PANEL_PX
    rows = max(1, math.ceil(len(keys) / COLUMNS))
    fw, fh = COLUMNS * w, rows * h
    fig = Figure(figsize=(fw / DPI, fh / DPI), dpi=DPI)
    canvas = Canvas(fig)
    left, right, top, bottom = _MARGINS
    for i, key in enumerate(keys):
        x0, y0 = (i % COLUMNS) * w, (i // COLUMNS) * h  # the cell's top-left pixel
        rect = ((x0 + left) / fw, (fh - y0 - h + bottom) / fh, (w - left - right) / fw)
        ax = fig.add_axes((*rect, (h - top - bottom) / fh))
        for c, run in enumerate(runs):
            colour = f"C{c % 10}"
            if key in run.series:
                xs, ys = run.series[key]
                style = "-" if len(xs) > 1 else "o"
                ax.plot(xs, ys, style, color=colour, lw=1.2, ms=4, label=run.name)
            if f"eval_{key}" in run.series:
                xs, ys = run.series[f"eval_{key}"]
                ax.plot(xs, ys, "o", color=colour, ms=4, mfc="white", mew=1.2)
        title = TITLES.get(key, key)
        if any(f"eval_{key}" in run.series for run in runs):
            title += f" (points: eval_{key})"
        ax.set_title(title, fontsize=9)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_xlabel("step", fontsize=8, labelpad=1)
        ax.tick_params(labelsize=7)
        ax.ticklabel_format(axis="y", style="sci", scilimits=(-3, 5), useOffset=False)
        ax.grid(alpha=0.3)
        if i == 0 and len(runs) > 1:
            ax.legend(fontsize=7, loc="best")
    canvas.draw()
    return np.asarray(canvas.buffer_rgba()).copy()


def _png(pixels: Any) -> bytes:
    from matplotlib.image import imsave  # optional dependency (the plot extra)

    buf = io.BytesIO()
    imsave(buf, pixels, format="png")
    return buf.getvalue()


def _page(runs: Sequence[Run], keys: Sequence[str], pixels: Any) -> str:
    w, h = PANEL_PX
    figures = []
    for i, key in enumerate(keys):
        x0, y0 = (i % COLUMNS) * w, (i // COLUMNS) * h
        data = base64.b64encode(_png(pixels[y0 : y0 + h, x0 : x0 + w])).decode()
        figures.append(
            f'<figure id="{html.escape(key)}"><img alt="{html.escape(key)}" width="{w}" '
            f'height="{h}" src="data:image/png;base64,{data}"></figure>'
        )
    colours = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd"]
    colours += ["#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf"]
    legend = " ".join(
        f'<span style="color:{colours[c % 10]}">&#9632;</span> {html.escape(r.name)}'
        for c, r in enumerate(runs)
    )
    title = "compiletune: " + html.escape(", ".join(r.name for r in runs))
    style = (
        f"body{{font-family:sans-serif}} figure{{margin:0}} .grid{{display:grid;"
        f"grid-template-columns:repeat({COLUMNS},{w}px)}}"
    )
    return (
        f'<!doctype html>\n<html><head><meta charset="utf-8"><title>{title}</title>'
        f"<style>{style}</style></head>\n<body><h1>{title}</h1><p>{legend}</p>\n"
        f'<div class="grid">\n' + "\n".join(figures) + "\n</div></body></html>\n"
    )


def _write(path: Path, data: bytes) -> None:
    """Whole or not at all: a temporary file beside `path`, renamed over it; on any error the
    temporary file is removed, and a full disk is one line."""
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        with open(tmp, "wb") as f:
            faults.point("plot")  # the file exists and is empty: where a full disk strikes
            f.write(data)
        os.replace(tmp, path)
    except BaseException as e:
        tmp.unlink(missing_ok=True)
        if isinstance(e, OSError) and e.errno == errno.ENOSPC:
            free = shutil.disk_usage(path.parent).free
            raise UserError(
                f"{path} could not be written: the disk is full ({free / 2**20:.1f} MiB free, "
                f"{len(data) / 2**20:.1f} MiB needed); free some space or pass -o a path on "
                "another disk"
            ) from e
        raise


def output_path(folders: Sequence[Path], output: str | Path | None) -> Path:
    """Where the PNG goes: -o (a .png path, or a folder to hold plot.png), else RUN_DIR/plot.png
    for one run; several runs need -o."""
    if output is None:
        if len(folders) > 1:
            raise UserError(f"plot: {len(folders)} runs go on one chart; name it with -o PATH.png")
        return folders[0] / PLOT_FILES[0]
    path = Path(output)
    if path.is_dir():
        return path / PLOT_FILES[0]
    if path.suffix.lower() != ".png":
        raise UserError(f"-o {output}: pass a path ending in .png (the .html goes beside it)")
    return path


def _names(paths: Sequence[Path]) -> list[str]:
    """The legend's names: the folders' names, with as many parents as tell them apart."""
    parts = [p.resolve().parts for p in paths]
    for depth in range(1, max(map(len, parts)) + 1):
        names = ["/".join(p[-depth:]) for p in parts]
        if len(set(names)) == len(names):
            return names
    return [str(p) for p in paths]  # the same folder twice


def _to_stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def plot_runs(
    folders: Sequence[str | Path],
    output: str | Path | None = None,
    say: Callable[[str], None] = _to_stderr,
) -> list[Path]:
    """Draw the runs in `folders` into a PNG and an HTML page; returns [png, html]. What was
    skipped or left out is told to `say`."""
    paths = [Path(f) for f in folders]
    png = output_path(paths, output)
    records = [read_run(p, say) for p in paths]
    runs = [to_run(n, r) for n, r in zip(_names(paths), records, strict=True)]
    if beyond := sum(run.beyond for run in runs):
        say(f"plot: {beyond} numbers beyond +-{LIMIT:g} drawn as gaps (as non-finite ones are)")
    left_out: list[str] = []
    keys = panels(runs, left_out)
    if left_out:
        names = ", ".join(left_out[:3]) + (", ..." if len(left_out) > 3 else "")
        say(
            f"plot: {len(left_out):,} other keys not drawn ({names}): the known panels and "
            f"{MAX_OTHER_PANELS} others are; the numbers are in metrics.jsonl"
        )
    pixels = render(runs, keys)
    page = _page(runs, keys, pixels)
    png.parent.mkdir(parents=True, exist_ok=True)
    _write(png, _png(pixels))
    _write(png.with_suffix(".html"), page.encode())
    return [png, png.with_suffix(".html")]


def after_run(out: Path, say: Callable[[str], None]) -> None:
    """The end of a training run (rank 0): plot.png and plot.html in the run folder when
    matplotlib is installed and COMPILETUNE_PLOT is not 0. Never fails the run: anything that
    goes wrong is one warning."""
    if os.environ.get("COMPILETUNE_PLOT", "1").strip() == "0":
        return
    try:
        import matplotlib  # noqa: F401 - optional dependency (the plot extra)
    except ImportError:
        return
    try:
        if (out / "metrics.jsonl").stat().st_size == 0:
            return  # no step ran
        plot_runs([out], say=say)
    except Exception as e:  # a plot is a convenience; the run has finished
        message = " ".join(str(e).split())[:200]
        say(f"warning: {out / PLOT_FILES[0]} not written ({type(e).__name__}: {message})")
