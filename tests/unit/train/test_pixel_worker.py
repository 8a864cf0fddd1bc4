"""An image run's data worker (data/prefetch.py) from the CLI, on a tiny Gemma 3 vision
checkpoint: the run's losses and saved data positions equal those of the run that prepares the
pixels when a batch is taken (`prefetch.DEPTH = 0`), held-out losses included; a run cut at step 2 and resumed equals the
straight run; a bad image fails the run with its line; --skip-bad-images counts as before; no
worker thread outlives `train`, and a text-only run starts none."""

from __future__ import annotations

import json
import shutil
import threading
from pathlib import Path

import pytest
from image_cases import png, save_tiny_gemma3_checkpoint

from compiletune.checkpoint import steps as ckpt
from compiletune.cli import main
from compiletune.data import image_batch, prefetch
from compiletune.data.images import ImageError
from compiletune.metrics import read_metrics


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("gemma3")
    save_tiny_gemma3_checkpoint(folder)
    return folder


def conversations(folder: Path, n: int, images: bool = True) -> Path:
    """`n` conversations, one or two images each (every third none), or text only."""
    lines = []
    for i in range(n):
        names = [f"img/{i}_{k}.png" for k in range(1 + i % 2)] if images and i % 3 else []
        for k, name in enumerate(names):
            png(folder / name, 12 + 5 * k + i % 4, 20 - i % 5, seed=10 * i + k)
        user = [{"type": "image", "image": name} for name in names]
        user.append({"type": "text", "text": f"What is {i}?"})
        reply = [{"type": "text", "text": f"number {i} " * (1 + i % 3)}]
        messages = [{"role": "user", "content": user}, {"role": "assistant", "content": reply}]
        lines.append(json.dumps({"messages": messages}))
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "train.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def argv(checkpoint: Path, data: Path, out: Path, *more: str) -> list[str]:
    flags = ["train", "--model-dir", str(checkpoint), "--data", str(data), "--lora-rank", "4"]
    flags += ["--lr", "1e-2", "--max-steps", "4", "--save-every", "2", "--batch-size", "2"]
    flags += ["--grad-accum", "2", "--seq-len", "128", "--dtype", "fp32", "--output-dir"]
    return [*flags, str(out), *more]


def workers() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == prefetch.THREAD_NAME]


def losses(out: Path) -> list[tuple[int, float, int, float | None]]:
    records = read_metrics(out / "metrics.jsonl")
    return [(r["step"], r["loss"], r["tokens"], r.get("eval_loss")) for r in records]


def position(out: Path, step: int) -> dict:
    return ckpt.load_train_state(out / f"step_{step}")["data"]


def test_the_worker_changes_no_batch_and_resume_is_exact(tmp_path, checkpoint, capsys, monkeypatch):
    data = conversations(tmp_path / "data", 10)
    jobs: list[str] = []
    submit = prefetch.PixelWorker.submit

    def spy(self, job):
        jobs.append(threading.current_thread().name)
        return submit(self, job)

    monkeypatch.setattr(prefetch.PixelWorker, "submit", spy)
    out, held = tmp_path / "worker", ["--val-split", "0.3", "--eval-every", "2"]
    assert main(argv(checkpoint, data, out, *held)) == 0, capsys.readouterr().err
    assert jobs and not workers()  # the worker ran the pixels, and stopped with the run
    straight = losses(out)
    assert [r[3] is not None for r in straight] == [False, True, False, True]

    monkeypatch.setattr(prefetch, "DEPTH", 0)  # the pixels prepared when a batch is taken
    jobs.clear()
    plain = tmp_path / "plain"
    assert main(argv(checkpoint, data, plain, *held)) == 0, capsys.readouterr().err
    assert not jobs and len(straight) == 4
    assert losses(plain) == straight  # bit for bit: the same batches in the same order
    for step in (2, 4):  # the batches taken, not those drawn ahead
        assert position(out, step) == position(plain, step)
    monkeypatch.setattr(prefetch, "DEPTH", 2)

    shutil.rmtree(out / "step_4")
    assert main([*argv(checkpoint, data, out, *held), "--resume", "--resume-from", "2"]) == 0
    assert "resuming from step_2" in capsys.readouterr().out
    assert losses(out) == straight and position(out, 4) == position(plain, 4)
    assert not workers()


def test_a_bad_image_fails_the_run_with_its_line_and_stops_the_worker(
    tmp_path, checkpoint, capsys, monkeypatch
):
    """An image that cannot be read when its batch's pixels are prepared (after tokenising):
    the run fails with the same line with and without the worker, and leaves no thread."""
    data = conversations(tmp_path / "data", 10)
    load = image_batch.load_image

    def failing(ref, max_pixels):
        if ref.path is not None and ref.path.name == "4_0.png":
            raise ImageError(f"{ref.where}: image {ref.name} cannot be read (gone)")
        return load(ref, max_pixels)

    monkeypatch.setattr(image_batch, "load_image", failing)
    lines = []
    for depth in (2, 0):
        monkeypatch.setattr(prefetch, "DEPTH", depth)
        assert main(argv(checkpoint, data, tmp_path / f"run{depth}")) != 0
        said = capsys.readouterr()
        err = said.err
        assert "step 1/4" in said.out  # failed in training, at a later batch
        lines.append([line for line in err.splitlines() if "4_0.png cannot be read" in line])
        assert lines[-1], err
        assert not workers()
    assert lines[0] == lines[1]


def test_a_text_only_run_starts_no_worker(tmp_path, checkpoint, capsys, monkeypatch):
    data = conversations(tmp_path / "data", 6, images=False)
    started = []
    monkeypatch.setattr(prefetch.PixelPrefetch, "__init__", lambda *a: started.append(a))
    more = ["--max-steps", "2", "--save-every", "2"]
    assert main(argv(checkpoint, data, tmp_path / "run", *more)) == 0, capsys.readouterr().err
    assert not started and not workers()


def test_skip_bad_images_counts_the_rows_as_before(tmp_path, checkpoint, capsys, monkeypatch):
    """--skip-bad-images with a file missing from the start: the row is left out and counted at
    tokenising, the same line with and without the worker, and the run trains on the rest."""
    data = conversations(tmp_path / "data", 10)
    (tmp_path / "data" / "img" / "4_0.png").unlink()
    said = []
    for depth in (2, 0):
        monkeypatch.setattr(prefetch, "DEPTH", depth)
        more = ["--skip-bad-images", "--max-steps", "2", "--cache-dir", str(tmp_path / f"c{depth}")]
        assert main(argv(checkpoint, data, tmp_path / f"run{depth}", *more)) == 0
        out = capsys.readouterr().out
        said.append([line for line in out.splitlines() if "skipped (--skip-bad-images)" in line])
        assert len(said[-1]) == 1 and ": 1 row with a missing" in said[-1][0], out
    assert said[0] == said[1] and not workers()
