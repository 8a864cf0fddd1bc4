"""Nothing lost, nothing cryptic: non-finite steps, a full disk, two runs in one folder, changed
flags on --resume, and kill -9 at the moments that matter."""

from __future__ import annotations

import errno
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file

from compiletune.checkpoint import steps as ckpt
from compiletune.cli import main
from compiletune.metrics import read_metrics
from compiletune.train import loop, strategy
from compiletune.train.run_dir import closing
from compiletune.train.run_dir.disk import space_warning
from compiletune.train.run_dir.lock import LOCK_FILE, OutputLock, _start_time

TEXT = "\n".join(f"Line {i}: a fox counts to {i * 7 % 13} and back again." for i in range(300))
TINY = ["--seq-len", "32", "--batch-size", "2"]


@pytest.fixture()
def corpus(tmp_path: Path) -> str:
    path = tmp_path / "corpus.txt"
    path.write_text(TEXT)
    return str(path)


def _train(out: Path, corpus: str, *flags: str) -> int:
    return main(["train", "--data", corpus, *TINY, "--output-dir", str(out), *flags])


def _one_error_line(capsys: pytest.CaptureFixture) -> str:
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and err[0].startswith("compiletune: error: "), err
    return err[0]


def _strict(path: Path) -> list[dict]:
    """Parse JSON lines refusing NaN/Infinity, as a strict consumer does."""

    def refuse(name: str) -> None:
        raise AssertionError(f"{path} holds {name}")

    return [json.loads(line, parse_constant=refuse) for line in path.read_text().splitlines()]


def _all_finite(folder: Path) -> bool:
    tensors = load_file(folder / "model.safetensors")
    return all(bool(torch.isfinite(t).all()) for t in tensors.values())


# ----------------------------------------------------------------------------- non-finite


def test_diverged_run_stops_and_never_saves_nonfinite_weights(tmp_path, corpus, capsys):
    out = tmp_path / "run"
    assert _train(out, corpus, "--lr", "1e10", "--save-every", "1", "--max-steps", "8") == 2
    line = _one_error_line(capsys)
    step = int(line.split("step ")[1].split(":")[0])
    saved = ckpt.list_checkpoints(out)
    assert [s for s, _ in saved] == list(range(1, step))  # every step before the bad one
    assert all(_all_finite(path) for _, path in saved)
    records = _strict(out / "metrics.jsonl")
    assert records[-1]["step"] == step and records[-1]["applied"] is False
    assert "nonfinite" in records[-1]
    assert not (out / LOCK_FILE).exists()
    # The checkpoints are finite but no good (lr 1e10 moved every weight by ~1e10): none is
    # named, and the advice, followed, trains the run to its end.
    assert "no good checkpoint was written before it" in line
    advice = line.split("start again with a lower learning rate (")[1].split(")")[0]
    assert advice == "--lr 0.001 --overwrite"
    assert _train(out, corpus, "--save-every", "1", "--max-steps", "8", *advice.split()) == 0
    assert all(math.isfinite(r["loss"]) for r in _strict(out / "metrics.jsonl"))


def test_last_good_checkpoint_is_one_to_continue_from(tmp_path, corpus, capsys, monkeypatch):
    """Finite checkpoints whose weights a far too high lr blew up are not "good": the divergence
    names the one before them, and its advice, followed, continues with finite steps."""
    out = tmp_path / "run"
    assert _train(out, corpus, "--max-steps", "2", "--save-every", "1") == 0
    # Step 4 of the resumed run fails: injected, since whether lr 1e4 turns its gradient into
    # NaN by itself there depends on the CPU's arithmetic (it did on one AVX2 machine).
    _nan_on_calls(monkeypatch, {2})
    resume = ["--resume", "--max-steps", "6", "--lr", "1e4", "--accept-changes"]
    capsys.readouterr()
    assert main(["train", "--output-dir", str(out), *resume, "--save-every", "1"]) == 2
    line = _one_error_line(capsys)
    assert [s for s, _ in ckpt.list_checkpoints(out)] == [1, 2, 3]  # 3: finite, blown up
    assert f"the last good checkpoint is {out / 'step_2'}" in line, line
    advice = line.split("continue from it with a lower learning rate: ")[1].split(" (or")[0]
    assert advice == "--resume --resume-from step_2 --lr 0.001 --accept-changes"
    monkeypatch.undo()
    assert main(["train", "--output-dir", str(out), *advice.split()]) == 0
    records = _strict(out / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6]
    assert all(math.isfinite(r["loss"]) for r in records)


def test_advice_after_a_real_divergence_followed_trains_to_the_end(tmp_path, corpus, capsys):
    """Issue 67: the stop line's command, parsed and run as written, ends finite."""
    out = tmp_path / "run"
    assert _train(out, corpus, "--max-steps", "1", "--save-every", "1") == 0
    capsys.readouterr()
    resume = ["--resume", "--max-steps", "5", "--lr", "1e10", "--accept-changes"]
    assert main(["train", "--output-dir", str(out), *resume]) == 2
    line = _one_error_line(capsys)
    advice = line.split("continue from it with a lower learning rate: ")[1].split(" (or")[0]
    assert advice == "--resume --resume-from step_1 --lr 0.001 --accept-changes"
    assert main(["train", "--output-dir", str(out), *advice.split()]) == 0
    records = _strict(out / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5]
    assert all(math.isfinite(r["loss"]) and "nonfinite" not in r for r in records)


def test_a_resumed_run_failing_at_its_first_step_is_not_sent_back_to_it(
    tmp_path, corpus, capsys, monkeypatch
):
    """Issue 67: a resumed run whose first step is not finite whatever the lr (its batch is
    bad) was told to resume from the same checkpoint with a lower lr, which replays that step:
    it failed again at the same step, with the same advice. No update preceded it, so the lr is
    not the cause: the advice steps over the batch, and followed (the batch still bad), the run
    ends with every applied step finite."""
    out = tmp_path / "run"
    assert _train(out, corpus, "--max-steps", "2", "--save-every", "1") == 0
    _nan_on_calls(monkeypatch, {1})
    capsys.readouterr()
    assert main(["train", "--output-dir", str(out), "--resume", "--max-steps", "5"]) == 2
    line = _one_error_line(capsys)
    assert line.startswith("compiletune: error: step 3: the loss is nan"), line
    assert "the learning rate is not the cause" in line and "--lr" not in line
    advice = line.split("step over the batch: ")[1]
    assert advice == "--resume --resume-from step_2 --skip-nonfinite 1 --accept-changes"
    monkeypatch.undo()
    _nan_on_calls(monkeypatch, {1})  # the same batch is as bad the second time
    assert main(["train", "--output-dir", str(out), *advice.split()]) == 0
    records = _strict(out / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5]
    assert [r.get("applied", True) for r in records] == [True, True, False, True, True]
    assert all(math.isfinite(r["loss"]) for r in records if r.get("applied", True))
    assert _all_finite(out / "step_5")


def _nan_on_calls(monkeypatch: pytest.MonkeyPatch, calls: set[int]) -> None:
    """The trainer's step sees a NaN loss on these (1-based) calls."""
    real, seen = strategy.train_step, [0]

    def step(run, batch, lr=None, accept=None):
        seen[0] += 1
        if seen[0] in calls:
            poisoned = accept

            def accept(values):  # noqa: F811 - the poisoned check
                return poisoned({**values, "loss_sum": values["loss_sum"] * float("nan")})

        return real(run, batch, lr, accept)

    monkeypatch.setattr(strategy, "train_step", step)


def test_skip_nonfinite_skips_and_reports_each_step(tmp_path, corpus, capsys, monkeypatch):
    _nan_on_calls(monkeypatch, {3})
    out = tmp_path / "run"
    assert _train(out, corpus, "--max-steps", "5", "--skip-nonfinite", "1") == 0
    assert "step 3: the loss is nan" in capsys.readouterr().out
    records = _strict(out / "metrics.jsonl")
    assert [r.get("applied", True) for r in records] == [True, True, False, True, True]
    assert records[2]["loss"] is None and records[2]["nonfinite_values"] == {"loss": "nan"}
    # four optimizer updates in five steps: the skipped one never reached the optimizer
    state = torch.load(out / "step_5" / ckpt.STATE_FILE, weights_only=True)
    counts = {int(s["step"]) for s in state["optimizer"]["state"].values()}
    assert counts == {4}
    assert _all_finite(out / "step_5")


def test_nonfinite_beyond_the_allowance_stops(tmp_path, corpus, capsys, monkeypatch):
    _nan_on_calls(monkeypatch, {3, 4})
    out = tmp_path / "run"
    code = _train(out, corpus, "--max-steps", "6", "--save-every", "2", "--skip-nonfinite", "1")
    assert code == 2
    line = _one_error_line(capsys)
    assert line.startswith("compiletune: error: step 4: the loss is nan")
    assert f"the last good checkpoint is {out / 'step_2'}" in line


# ----------------------------------------------------------------------------- --resume


def test_resume_continues_from_the_saved_config_and_judges_changes(tmp_path, corpus, capsys):
    out = tmp_path / "run"
    assert _train(out, corpus, "--max-steps", "2", "--lr", "5e-3", "--n-layers", "2") == 0
    saved = (out / "config.yaml").read_text()
    capsys.readouterr()
    resume = ["train", "--output-dir", str(out), "--resume"]

    # a result-changing option: listed and refused, nothing written
    assert main([*resume, "--max-steps", "4", "--lr", "1e-3", "--seq-len", "16"]) == 2
    line = _one_error_line(capsys)
    assert "--lr 0.005 -> 0.001" in line and "--seq-len 32 -> 16" in line
    assert "--accept-changes" in line
    assert (out / "config.yaml").read_text() == saved
    # what the checkpoint holds never changes, not even with --accept-changes
    assert main([*resume, "--max-steps", "4", "--n-layers", "3", "--accept-changes"]) == 2
    assert "--n-layers 2 -> 3" in _one_error_line(capsys)
    # a length at or below the checkpoint's step has nothing to train
    assert main([*resume, "--max-steps", "2"]) == 2
    assert "already at step 2" in _one_error_line(capsys)

    # --resume alone continues the run as it was configured (data, shape, lr, depth)
    assert main([*resume, "--max-steps", "4"]) == 0
    said = capsys.readouterr().out
    assert "--max-steps 4 (was 2)" in said and "resuming from step_2" in said
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl")] == [1, 2, 3, 4]
    now = (out / "config.yaml").read_text()
    assert "n_layers: 2" in now and "lr: 0.005" in now and "seq_len: 32" in now

    # saving options and memory techniques pass; an accepted change is said and recorded
    assert main([*resume, "--max-steps", "5", "--save-every", "3", "--ac", "full"]) == 0
    capsys.readouterr()
    assert main([*resume, "--max-steps", "6", "--lr", "1e-3", "--accept-changes"]) == 0
    assert "--lr 0.005 -> 0.001" in capsys.readouterr().out
    assert "lr: 0.001" in (out / "config.yaml").read_text()


# ----------------------------------------------------------------------------- the lock


def test_second_run_refused_while_first_lives_stale_lock_taken_over(tmp_path, corpus, capsys):
    out = tmp_path / "run"
    out.mkdir()
    lock = out / LOCK_FILE
    # a live owner: this very process
    live = {
        "pid": os.getpid(),
        "host": os.uname().nodename,
        "start": _start_time(os.getpid()),
    }
    lock.write_text(json.dumps(live))
    assert _train(out, corpus, "--max-steps", "1") == 2
    assert f"in use by the run of process {os.getpid()}" in _one_error_line(capsys)
    assert sorted(p.name for p in out.iterdir()) == [LOCK_FILE]  # nothing written
    # a dead owner (a process that has exited) on this host: taken over, with a message
    gone = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        text=True,
        capture_output=True,
        check=True,
    )
    lock.write_text(json.dumps({**live, "pid": int(gone.stdout), "start": "1"}))
    assert _train(out, corpus, "--max-steps", "1") == 0
    assert "taking over the lock" in capsys.readouterr().out
    assert not lock.exists()


def test_a_run_that_fails_to_build_leaves_no_folder(tmp_path, capsys):
    out = tmp_path / "deep" / "run"
    assert main(["train", "--output-dir", str(out), "--model-dir", str(tmp_path / "none")]) == 2
    _one_error_line(capsys)
    assert not (tmp_path / "deep").exists()


# ----------------------------------------------------------------------------- a full disk


def _small_disk(path: Path, mib: int) -> bool:
    """A tmpfs of `mib` MiB at `path` (root only); False where it cannot be mounted."""
    path.mkdir()
    if os.geteuid() != 0 or shutil.which("mount") is None:
        return False
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={mib}m", "tmpfs", str(path)], capture_output=True
    )
    return done.returncode == 0


def test_disk_full_during_a_checkpoint(tmp_path, corpus, capsys, monkeypatch):
    """A real full filesystem where one can be mounted, else a writer that fails as one does;
    either way: one line naming the folder and the space, the previous checkpoint intact,
    nothing half-written, and a resume in place once space is freed."""
    disk = tmp_path / "disk"
    real = _small_disk(disk, 48)
    try:
        out, filler = disk / "run", disk / "filler"
        flags = ["--n-layers", "1", "--max-steps", "2", "--save-every", "1"]
        if real:
            # step_1 (~12 MiB) fits; then the filler leaves too little for step_2
            def fill(self, record, at_end):
                if self.step == 2 and not filler.exists():
                    free = shutil.disk_usage(disk).free
                    filler.write_bytes(b"\0" * (free - 4 * 2**20))

            monkeypatch.setattr(loop.Trainer, "maybe_evaluate", fill)
        else:
            real_save = torch.save

            def failing_save(obj, f, *a, **k):
                if str(f).endswith(ckpt.STATE_FILE) and "step_2" in str(f):
                    raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos")
                return real_save(obj, f, *a, **k)

            monkeypatch.setattr(torch, "save", failing_save)
            monkeypatch.setattr(shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(1, 1, 0))
        assert _train(out, corpus, *flags) == 2
        line = _one_error_line(capsys)
        assert f"the disk of {out} is full: step_2 could not be written" in line
        assert "a checkpoint needs about" in line and f"{out / 'step_1'}" in line
        assert [s for s, _ in ckpt.list_checkpoints(out)] == [1]
        assert not [p.name for p in out.iterdir() if p.name.startswith((".tmp", ".old"))]
        transformers.AutoModelForCausalLM.from_pretrained(out / "step_1")
        monkeypatch.undo()
        filler.unlink(missing_ok=True)
        assert main(["train", "--output-dir", str(out), "--resume"]) == 0
        assert [s for s, _ in ckpt.list_checkpoints(out)] == [1, 2]
    finally:
        # lazily where a file in it is still open: no tmpfs left behind
        if real and subprocess.run(["umount", str(disk)], capture_output=True).returncode:
            subprocess.run(["umount", "-l", str(disk)], check=False)


def test_disk_full_before_the_first_checkpoint(tmp_path, corpus, capsys, monkeypatch):
    """No checkpoint was written: the advice is to run the same command again, which works."""
    real_save = torch.save

    def failing_save(obj, f, *a, **k):
        if str(f).endswith(ckpt.STATE_FILE):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_save(obj, f, *a, **k)

    monkeypatch.setattr(torch, "save", failing_save)
    out = tmp_path / "run"
    assert _train(out, corpus, "--max-steps", "2") == 2
    line = _one_error_line(capsys)
    assert "no checkpoint was written; free some space and run the same command again" in line
    monkeypatch.undo()
    assert _train(out, corpus, "--max-steps", "2") == 0
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl")] == [1, 2]  # afresh


def test_disk_full_while_building_the_token_cache(tmp_path, capsys):
    """One line naming the cache folder and what to do; doing it works."""
    disk = tmp_path / "disk"
    real = _small_disk(disk, 1)
    if not real:
        pytest.skip("needs root to mount a 1 MiB tmpfs")
    try:
        big = tmp_path / "big.txt"
        big.write_text("\n\n\n".join(f"document {i}: " + "words " * 400 for i in range(200)))
        argv = ["--data", str(big), *TINY, "--max-steps", "1", "--output-dir"]
        assert main(["train", *argv, str(tmp_path / "a"), "--cache-dir", str(disk)]) == 2
        line = _one_error_line(capsys)
        assert f"the disk of the token cache {disk} is full" in line
        assert "pass --cache-dir on a disk with room" in line
        assert not [p for p in disk.iterdir() if not p.name.startswith(".")]  # no half entry
        elsewhere = ["--cache-dir", str(tmp_path / "cache")]
        assert main(["train", *argv, str(tmp_path / "a"), *elsewhere]) == 0
    finally:
        subprocess.run(["umount", str(disk)], check=False)


# ----------------------------------------------------------------------------- kill -9


def _killed(out: Path, corpus: str, at: str, *flags: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "compiletune", "train", "--data", corpus, *TINY]
    cmd += ["--output-dir", str(out), *flags]
    env = {**os.environ, "COMPILETUNE_KILL_AT": at}
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)


def _looks_complete_only_if_complete(out: Path) -> None:
    for child in out.iterdir():
        if child.name.startswith("step_"):  # a visible checkpoint is a whole one
            assert (child / ckpt.STATE_FILE).is_file(), child
            assert list(child.glob("*.safetensors")), child


@pytest.mark.slow
@pytest.mark.parametrize(
    "at, flags, left",
    [
        ("step:3", ["--max-steps", "4", "--save-every", "2"], [2]),  # in a step
        ("save:2", ["--max-steps", "4", "--save-every", "1"], [1]),  # mid-checkpoint
        ("save:3", ["--max-steps", "3", "--save-every", "1"], [1, 2]),  # the last (HF) save
    ],
)
def test_kill_9_then_resume(tmp_path, corpus, at, flags, left):
    out = tmp_path / "run"
    assert _killed(out, corpus, at, *flags).returncode == -9
    _looks_complete_only_if_complete(out)
    assert [s for s, _ in ckpt.list_checkpoints(out)] == left
    assert main(["train", "--output-dir", str(out), "--resume", "--max-steps", "4"]) == 0
    assert ckpt.list_checkpoints(out)[-1][0] == 4
    assert not [p for p in out.iterdir() if p.name.startswith((".tmp", ".old"))]
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl")] == [1, 2, 3, 4]
    transformers.AutoModelForCausalLM.from_pretrained(out / "step_4")


@pytest.mark.slow
def test_kill_9_during_merge_leaves_no_merged_folder(tmp_path, corpus, capsys):
    out = tmp_path / "run"
    lora = ["--lora-rank", "4", "--merge", "--max-steps", "2"]
    assert _killed(out, corpus, "merge", *lora).returncode == -9
    assert not (out / "merged").exists()
    # --resume finishes the merge without training another step
    before = read_metrics(out / "metrics.jsonl")
    assert main(["train", "--output-dir", str(out), "--resume"]) == 0
    said = capsys.readouterr().out
    assert "writing the merged model it did not finish" in said
    assert "done: no step to train (the run is at step 2 of 2), merged model" in said
    assert read_metrics(out / "metrics.jsonl") == before
    transformers.AutoModelForCausalLM.from_pretrained(out / "merged")
    # and once merged, a resume at the end has nothing left to do
    assert main(["train", "--output-dir", str(out), "--resume"]) == 2
    assert "already at step 2" in capsys.readouterr().err


def test_resume_passes_over_a_damaged_checkpoint_or_takes_the_one_chosen(tmp_path, corpus, capsys):
    """The newest checkpoint lost its weights: --resume continues from the one before, saying
    so, with the uninterrupted run's result; --resume-from picks a checkpoint by name."""
    flags = ["--max-steps", "4", "--save-every", "1"]
    assert _train(tmp_path / "whole", corpus, *flags) == 0
    out = tmp_path / "run"
    shutil.copytree(tmp_path / "whole", out)
    (out / "step_4" / "model.safetensors").unlink()
    (out / "step_3" / ckpt.STATE_FILE).write_bytes(b"cut short")
    capsys.readouterr()
    assert main(["train", "--output-dir", str(out), "--resume"]) == 0
    said = capsys.readouterr().out
    assert "--resume: continuing from step_2, the newest whole checkpoint; step_4 cannot" in said
    assert "; step_3 cannot be used (" in said
    losses = [
        [r["loss"] for r in read_metrics(d / "metrics.jsonl")] for d in (tmp_path / "whole", out)
    ]
    assert losses[0] == losses[1]
    assert main(["train", "--output-dir", str(out), "--resume", "--resume-from", "step_1"]) == 0
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl")] == [1, 2, 3, 4]
    assert [r["loss"] for r in read_metrics(out / "metrics.jsonl")] == losses[0]
    assert main(["train", "--output-dir", str(out), "--resume", "--resume-from", "9"]) == 2
    assert "has no step_9 (checkpoints: step_1, step_2, step_3, step_4)" in capsys.readouterr().err
    assert main(["train", "--output-dir", str(out), "--resume-from", "2"]) == 2
    assert "add --resume" in capsys.readouterr().err


def test_kill_9_between_the_renames_of_a_resave_is_recovered(tmp_path):
    """Re-saving a step (a stop right after a periodic save) swaps the old folder aside; a kill
    between the two renames leaves `.old-step_N` as the one complete copy, which the next run
    puts back before it looks for checkpoints."""
    out = tmp_path / "run"
    out.mkdir()
    code = (
        "import sys; from pathlib import Path; from compiletune.checkpoint.atomic import "
        "write_folder_atomically as w\n"
        "for v in ('first', 'second'):\n"
        "    w(Path(sys.argv[1]) / 'step_2', lambda t, v=v: (t.mkdir(), (t / 'v').write_text(v)))"
    )
    env = {**os.environ, "COMPILETUNE_KILL_AT": "publish"}
    done = subprocess.run([sys.executable, "-c", code, str(out)], env=env, timeout=60)
    assert done.returncode == -9
    assert not (out / "step_2").exists() and (out / ".old-step_2").is_dir()
    with OutputLock(out, say=lambda s: None):
        pass
    assert (out / "step_2" / "v").read_text() == "first"
    assert sorted(p.name for p in out.iterdir()) == ["step_2"]


def test_a_training_state_of_the_wrong_shape_is_one_line(tmp_path, corpus, capsys):
    out = tmp_path / "run"
    assert _train(out, corpus, "--max-steps", "1") == 0
    torch.save({"stp": 1, "optimizer": {}}, out / "step_1" / ckpt.STATE_FILE)
    capsys.readouterr()
    assert main(["train", "--output-dir", str(out), "--resume", "--max-steps", "2"]) == 2
    line = _one_error_line(capsys)
    assert "not a compiletune training state" in line and "found ['optimizer', 'stp']" in line


# ----------------------------------------------------------------------------- Ctrl-C


def _start(out: Path, corpus: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "compiletune", "train", "--data", corpus, *TINY]
    cmd += ["--max-steps", "100000", "--save-every", "1", "--output-dir", str(out)]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.mark.slow
def test_sigterm_after_the_run_finished_is_answered(tmp_path, corpus, capsys, monkeypatch):
    """A SIGTERM while the finished run writes its summary: the summary and closing line are
    still written, then one line says that nothing was lost; the exit status is success."""
    real = closing.write_summary

    def write_then_signal(out, summary):
        real(out, summary)
        os.kill(os.getpid(), signal.SIGTERM)

    monkeypatch.setattr(closing, "write_summary", write_then_signal)
    out = tmp_path / "run"
    assert _train(out, corpus, "--max-steps", "1") == 0
    said = capsys.readouterr().out.strip().splitlines()
    assert said[-2].startswith("done: 1 steps")
    assert said[-1] == (
        f"compiletune: SIGTERM arrived after the run had finished; nothing was lost "
        f"({out / 'summary.json'} is written)"
    )
    assert (out / "summary.json").is_file()


# The program's signal handling (compiletune.interrupt, as `python -m compiletune` sets it up),
# one run, then a SIGTERM the moment `main` has returned: after the closing line, while the
# process ends (the interpreter's teardown after torch takes seconds).
_SIGNAL_AFTER_DONE = """
import os, signal, sys, time
from compiletune.interrupt import exit_on_interrupt
exit_on_interrupt()
from compiletune.cli import main
code = main(sys.argv[1:])
os.kill(os.getpid(), signal.SIGTERM)
time.sleep(30)
print("the signal was lost")
"""


@pytest.mark.slow
def test_sigterm_after_the_closing_line_exits_0_with_one_line(tmp_path, corpus):
    """A signal once the run's work is saved ends the process with the run's own status (0)
    and one line saying nothing was lost, never a silent 143."""
    out = tmp_path / "run"
    argv = ["train", "--data", corpus, *TINY, "--output-dir", str(out), "--max-steps", "1"]
    cmd = [sys.executable, "-c", _SIGNAL_AFTER_DONE, *argv]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip().splitlines()[-1].startswith("done: 1 steps")
    assert proc.stderr.strip().splitlines()[-1] == (
        "compiletune: SIGTERM after the run had finished; nothing was lost"
    )
    assert "Traceback" not in proc.stderr and "signal was lost" not in proc.stdout
    assert (out / "summary.json").is_file()


def test_a_signal_after_a_run_stopped_early_keeps_its_status():
    """A run stopped early returns 130; a signal after its summary keeps that status."""
    code = (
        "import os, signal, time\n"
        "from compiletune import interrupt\n"
        "interrupt.exit_on_interrupt()\n"
        "interrupt.run_finished(interrupted=True)\n"
        "os.kill(os.getpid(), signal.SIGINT)\n"
        "time.sleep(30)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 130
    assert proc.stderr.strip() == "compiletune: SIGINT after the run had finished; nothing was lost"


def test_ctrl_c_during_start_up_exits_130_without_a_traceback(tmp_path, corpus):
    out = tmp_path / "run"
    proc = _start(out, corpus)
    time.sleep(1.5)  # importing torch, building the run
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    assert err.strip().splitlines()[-1] == "compiletune: interrupted" and "Traceback" not in err
    assert not out.exists() or not ckpt.list_checkpoints(out)


@pytest.mark.slow
def test_a_second_ctrl_c_stops_at_once_leaving_only_whole_checkpoints(tmp_path, corpus):
    out = tmp_path / "run"
    proc = _start(out, corpus)
    deadline = time.time() + 120
    while time.time() < deadline and len(ckpt.list_checkpoints(out)) < 3:
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    assert "Traceback" not in err
    _looks_complete_only_if_complete(out)
    assert not [p for p in out.iterdir() if p.name.startswith((".tmp", ".old", ".compiletune"))]
    last = ckpt.list_checkpoints(out)[-1][0]
    assert main(["train", "--output-dir", str(out), "--resume", "--max-steps", str(last + 1)]) == 0


def test_free_space_below_one_checkpoint_is_warned_before_the_first_save(tmp_path):
    assert space_warning(tmp_path, 1) is None
    warning = space_warning(tmp_path, 1 << 60)
    assert warning.startswith(f"warning: {tmp_path} has ") and "needs about" in warning


# ----------------------------------------------------------------------------- issue 67


def test_resume_after_a_kill_tore_the_last_metrics_line(tmp_path, corpus, capsys):
    """A kill while a metrics line was written leaves it torn; --resume cuts it away and the
    file stays valid JSON lines."""
    out = tmp_path / "run"
    assert _train(out, corpus, "--max-steps", "2", "--save-every", "1") == 0
    with (out / "metrics.jsonl").open("a") as f:
        f.write('{"step": 3, "loss": 4.1, "lr": 0.0003, "tokens_per_s": 9')  # no newline
    assert main(["train", "--output-dir", str(out), "--resume", "--max-steps", "3"]) == 0
    assert [r["step"] for r in _strict(out / "metrics.jsonl")] == [1, 2, 3]


@pytest.mark.parametrize("how", ["fault", "safetensors"])
def test_disk_full_while_merging_is_one_line_and_resume_merges(
    tmp_path, corpus, capsys, monkeypatch, how
):
    """A full disk in --merge: one line naming merged/ and what to do, no half folder, the
    adapters kept; the advised --resume writes merged/."""
    from collections import Counter

    from safetensors import SafetensorError

    from compiletune import faults
    from compiletune.models import hf

    if how == "fault":
        monkeypatch.setattr(faults, "_failed", Counter())
        monkeypatch.setenv(faults.FAIL_ENV, "merge")
    else:

        def full(*a, **k):
            raise SafetensorError(
                'Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: "No '
                'space left on device" })'
            )

        monkeypatch.setattr(hf, "save_file", full)
    out = tmp_path / "run"
    assert _train(out, corpus, "--lora-rank", "4", "--merge", "--max-steps", "2") == 2
    line = _one_error_line(capsys)
    assert f"the disk of {out} is full: {out / 'merged'} could not be written" in line
    assert f"{out / 'step_2'}" in line and "--resume" in line
    assert not [p.name for p in out.iterdir() if p.name.startswith((".tmp", ".old", "merged"))]
    assert (out / "step_2" / "adapter_model.safetensors").is_file()
    monkeypatch.undo()
    assert main(["train", "--output-dir", str(out), "--resume"]) == 0
    transformers.AutoModelForCausalLM.from_pretrained(out / "merged")


def test_overwrite_deletes_only_what_a_run_wrote(tmp_path, corpus, capsys):
    """--overwrite in a folder of a user's things named like a run's (eval/, merged/, a step_N/
    that is no checkpoint) replaces a run's files and leaves theirs."""
    mine = tmp_path / "mine"
    users = ("eval", "merged", "step_7", ".tmp-thesis", ".old-photos")
    for name in users:
        (mine / name).mkdir(parents=True)
        (mine / name / "notes.txt").write_text(f"my {name} notes")
    (mine / "todo.txt").write_text("buy milk")
    assert _train(mine, corpus, "--max-steps", "1", "--overwrite") == 0
    assert _train(mine, corpus, "--max-steps", "1", "--overwrite") == 0  # over its own run
    for name in users:
        assert (mine / name / "notes.txt").read_text() == f"my {name} notes"
    assert (mine / "todo.txt").read_text() == "buy milk"
    assert [s for s, _ in ckpt.list_checkpoints(mine)] == [1]
    assert [r["step"] for r in _strict(mine / "metrics.jsonl")] == [1]
