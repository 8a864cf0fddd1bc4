"""`compiletune plot`: metrics.jsonl drawn as a grid of panels into a PNG and an HTML page, by
the command and at the end of a training run; bad input is one line."""

from __future__ import annotations

import json
import math
import re
import sys
from pathlib import Path

import pytest

pytest.importorskip("matplotlib")

from matplotlib.image import imread  # noqa: E402

from compiletune import plot  # noqa: E402
from compiletune.cli import main  # noqa: E402
from compiletune.errors import UserError  # noqa: E402

BASIC = ["loss", "lr", "tokens_per_s", "peak_mem_gib", "grad_norm"]


def _sft(steps: int = 8, eval_every: int = 4, scale: float = 1.0) -> list[dict]:
    out = []
    for s in range(1, steps + 1):
        r = {
            "step": s,
            "loss": scale * (5.0 - 0.4 * s + 0.1 * math.sin(s)),
            "lr": 1e-3 * min(1.0, s / 3),
            "grad_norm": 10.0 / s,
            "tokens": 64,
            "padding": 0,
            "targets": 64,
            "tokens_per_s": 900.0 + 50 * (s % 3),
            "step_time_s": 0.07,
            "peak_mem_gib": 0.5 + 0.001 * s,
            "epoch": 0,
        }
        if s % eval_every == 0:
            r.update(eval_loss=scale * (4.8 - 0.3 * s), eval_ppl=100.0, eval_targets=640)
        out.append(r)
    return out


def _write(folder: Path, records: list[dict], tail: str = "") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    text = "".join(json.dumps(r) + "\n" for r in records)
    (folder / "metrics.jsonl").write_text(text + tail)
    return folder


def _check(png: Path, n: int) -> list[str]:
    """The PNG is the grid of `n` panels, each drawn and the cells past them blank; the page
    has the same panels. Returns the page's panel keys, in order."""
    w, h = plot.PANEL_PX
    rows = math.ceil(n / plot.COLUMNS)
    image = imread(png)
    assert image.shape[:2] == (rows * h, plot.COLUMNS * w)
    for i in range(rows * plot.COLUMNS):
        r, c = divmod(i, plot.COLUMNS)
        cell = image[r * h : (r + 1) * h, c * w : (c + 1) * w, :3]
        assert (cell.std() > 0.02) if i < n else (cell.std() == 0), (i, float(cell.std()))
    page = png.with_suffix(".html").read_text()
    assert page.count("<figure") == n and page.count("data:image/png;base64,") == n
    assert "<script" not in page and 'src="http' not in page  # self-contained
    return re.findall(r'<figure id="([^"]+)"', page)


def test_an_sft_run_with_eval_points(tmp_path, capsys):
    run = _write(tmp_path / "sft", _sft())
    assert main(["plot", str(run)]) == 0
    assert capsys.readouterr().out.strip() == f"wrote {run / 'plot.png'} and {run / 'plot.html'}"
    assert _check(run / "plot.png", 5) == BASIC  # eval_loss is points on the loss panel
    assert imread(run / "plot.png").shape[:2] == (600, 1200)  # 5 panels: 2 rows of 3


def test_objective_keys_get_panels_known_ones_first(tmp_path):
    records = _sft(6, eval_every=6)
    for s, r in enumerate(records, 1):
        r.update(
            chosen_reward=0.1 * s,
            rejected_reward=-0.05 * s,
            reward_accuracy=0.5 + 0.05 * s,
            reward_margin=0.15 * s,
            expert_load_min=0.5 + 0.01 * s,
            expert_load_max=1.5 - 0.01 * s,
            expert_load={"mean": 8.0, "min": [1.0, 2.0], "max": [9.0, 9.5]},  # lists: left out
            rewards={"format": {"mean": 0.1 * s, "std": 0.2}},  # constant std: left out
            zeta=float(s % 2),  # an unknown key that changes: drawn after the known ones
            constant=3.0,  # never changes: left out
            note="text",
            applied=True,
        )
    records[-1].update(eval_reward_accuracy=0.9, eval_pairs=8)
    run = _write(tmp_path / "dpo", records)
    png, page = plot.plot_runs([run])
    assert (png, page) == (run / "plot.png", run / "plot.html")
    known = ["reward_margin", "reward_accuracy", "chosen_reward", "rejected_reward"]
    known += ["expert_load_min", "expert_load_max"]
    assert _check(png, 13) == [*BASIC, *known, "rewards.format.mean", "zeta"]
    assert imread(png).shape[:2] == (1500, 1200)


def test_several_runs_share_the_panels(tmp_path):
    a = _write(tmp_path / "a" / "run", _sft(8))
    b_records = _sft(5, eval_every=5, scale=1.2)
    for r in b_records:
        r["kd_ce"] = r["loss"] / 2  # only one run has it: its panel shows that run alone
    b = _write(tmp_path / "b" / "run", b_records)
    with pytest.raises(UserError, match="2 runs go on one chart; name it with -o"):
        plot.plot_runs([a, b])
    png, page = plot.plot_runs([a, b], tmp_path / "cmp" / "both.png")
    assert _check(png, 6) == [*BASIC, "kd_ce"]
    text = page.read_text()
    assert "a/run" in text and "b/run" in text  # the same folder names, told apart
    loss_cell = (imread(png)[: plot.PANEL_PX[1], : plot.PANEL_PX[0], :3] * 255).round()
    for colour in ((31, 119, 180), (255, 127, 14)):  # C0 and C1: a line per run
        assert (abs(loss_cell - colour).sum(axis=-1) < 6).sum() > 50
    assert plot.plot_runs([a, b], tmp_path / "cmp")[0] == tmp_path / "cmp" / "plot.png"


def test_a_torn_last_line_is_dropped(tmp_path):
    run = _write(tmp_path / "run", _sft(4), tail='{"step": 5, "loss": 1.')
    png, _ = plot.plot_runs([run])
    assert _check(png, 5) == BASIC
    assert plot.read_run(run)[-1]["step"] == 4


@pytest.mark.parametrize(
    "setup, message",
    [
        (lambda p: None, "no such run folder"),
        (lambda p: p.mkdir(), "has no metrics.jsonl; pass the --output-dir"),
        (lambda p: _write(p, []), "holds no steps yet"),
        (lambda p: _write(p, [[1, 2]], tail="{not json\n"), "holds no steps yet (2 lines are not"),
    ],
)
def test_bad_run_folders_are_one_line(tmp_path, capsys, setup, message):
    run = tmp_path / "run"
    setup(run)
    assert main(["plot", str(run)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err
    assert not (run / "plot.png").exists()


def test_bad_output_and_missing_matplotlib(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("COMPILETUNE_PLOT", "1")  # conftest turns the end-of-run plot off
    run = _write(tmp_path / "run", _sft(3))
    assert main(["plot", str(run), "-o", str(tmp_path / "x.svg")]) == 2
    assert "pass a path ending in .png" in capsys.readouterr().err
    monkeypatch.setitem(sys.modules, "matplotlib.backends.backend_agg", None)  # not installed
    assert main(["plot", str(run)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and 'pip install "compiletune[plot]"' in err[0], err
    said = []
    plot.after_run(run, said.append)  # matplotlib there but broken: a warning, never a raise
    assert len(said) == 1 and said[0].startswith("warning:") and "not written" in said[0]
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    plot.after_run(run, said.append)  # not installed at all: nothing, silently
    assert len(said) == 1 and not (run / "plot.png").exists()


def test_a_training_run_draws_its_plot(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("COMPILETUNE_PLOT", "1")  # conftest turns the end-of-run plot off
    from tiny_run import tiny_run  # here: the trainer's imports are seconds

    from compiletune.train.run_dir import contents  # here: the trainer's imports are seconds

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n\n\n".join(f"Note {i}: the fox counts {i % 7} hens." for i in range(200)))
    out = tmp_path / "run"
    out.mkdir()
    (out / "plot.html").write_text("an old run's")  # a run's file: the folder is a run's
    assert contents.foreign_files(out) == []
    tiny_run(tmp_path, str(corpus), max_steps=3, val_split=0.1, eval_every=2)
    assert "warning" not in capsys.readouterr().out
    records = plot.read_run(out)
    assert [r["step"] for r in records] == [1, 2, 3] and "eval_loss" in records[1]
    assert _check(out / "plot.png", 5) == BASIC


def test_a_torn_line_followed_by_resumed_steps_is_skipped_with_a_count(tmp_path, capsys):
    """A kill tore step 3's line; a run resumed by an older version appended after it."""
    tail = '{"step": 3, "loss": 1.{"step": 3, "loss": 3.6}\n' + json.dumps(_sft(4)[3]) + "\n"
    run = _write(tmp_path / "run", _sft(2), tail=tail)
    assert main(["plot", str(run)]) == 0
    captured = capsys.readouterr()
    assert captured.out.startswith("wrote ")
    assert f"{run / 'metrics.jsonl'}: skipped 1 line that is not a JSON object (line 3" in (
        captured.err
    )
    assert _check(run / "plot.png", 5) == BASIC


@pytest.mark.parametrize(
    "change",
    [
        lambda r: r.update(loss=1e308 if r["step"] % 2 else -1e308),  # finite extremes
        lambda r: r.update(grad_norm=10**400, step=r["step"] + 10**400),  # beyond a float
        lambda r: r.update(step=1e308 if r["step"] == 2 else r["step"], lr=-1.7e308),
    ],
    ids=["1e308", "400 digits", "extreme step"],
)
def test_extreme_numbers_are_drawn_as_gaps(tmp_path, capsys, change):
    records = _sft(6)
    for r in records[2:4]:
        change(r)
    run = _write(tmp_path / "run", records)
    assert main(["plot", str(run)]) == 0
    assert "beyond" in capsys.readouterr().err  # said, once
    assert _check(run / "plot.png", 5) == BASIC


def test_a_log_with_1500_keys_draws_the_standard_panels_and_some_others(tmp_path, capsys):
    """A wide MoE log: a key per expert and layer. The plot keeps to the standard panels and a
    few others, says what it left out, and reads the file once (no per-key pass over it)."""
    records = _sft(20)
    for r in records:
        r["expert_load"] = {f"l{i // 64}e{i % 64}": (i + r["step"]) % 7 for i in range(1500)}
        r["router_aux_loss"] = 0.01 * r["step"]
    run = _write(tmp_path / "run", records)
    assert main(["plot", str(run)]) == 0
    err = capsys.readouterr().err
    drawn = re.findall(r'<figure id="([^"]+)"', (run / "plot.html").read_text())
    assert drawn[:6] == [*BASIC, "router_aux_loss"]
    assert len(drawn) == 6 + plot.MAX_OTHER_PANELS
    left = 1500 - plot.MAX_OTHER_PANELS
    assert f"{left:,} other keys not drawn" in err and "expert_load." in err


def test_a_full_disk_under_plot_o_is_one_line_and_leaves_no_temporary_file(
    tmp_path, capsys, monkeypatch
):
    from collections import Counter

    from compiletune import faults

    run = _write(tmp_path / "run", _sft(3))
    out = tmp_path / "out"
    out.mkdir()
    monkeypatch.setattr(faults, "_failed", Counter())
    monkeypatch.setenv(faults.FAIL_ENV, "plot")
    assert main(["plot", str(run), "-o", str(out / "p.png")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"{out / 'p.png'} could not be written: the disk is full" in err[0]
    assert list(out.iterdir()) == []  # no temporary file, no half PNG


def test_plot_o_onto_a_real_full_disk(tmp_path, capsys):
    """The same on a full tmpfs, where one can be mounted (root)."""
    import os
    import shutil
    import subprocess

    disk = tmp_path / "disk"
    disk.mkdir()
    mount = ["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(disk)]
    if os.geteuid() != 0 or shutil.which("mount") is None or subprocess.run(mount).returncode:
        pytest.skip("needs root to mount a 1 MiB tmpfs")
    try:
        filler = disk / "filler"
        with open(filler, "wb", buffering=0) as f, pytest.raises(OSError):
            while True:
                f.write(b"\0" * 4096)
        run = _write(tmp_path / "run", _sft(3))
        assert main(["plot", str(run), "-o", str(disk / "p.png")]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "could not be written: the disk is full" in err[0], err
        assert sorted(p.name for p in disk.iterdir()) == ["filler"]
    finally:
        subprocess.run(["umount", str(disk)], check=False)
