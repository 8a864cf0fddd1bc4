"""Held-out evaluation (--eval-data, --val-split, --eval-every) and the metric loggers (--log)."""

from __future__ import annotations

import glob
import json
import math
import re
import sys
from pathlib import Path

import pytest
import torch
from tiny_run import tiny_run

from compiletune.cli import main
from compiletune.compiler.regions import CompileOptions, compile_regions
from compiletune.data.rows import Example, pack, split_examples
from compiletune.loss.head import IGNORE_INDEX, LossHead
from compiletune.metrics import read_metrics
from compiletune.models import build_model, from_name
from compiletune.train import evaluate

DOCS = [
    f"Note {i}: the {['red', 'blue', 'green'][i % 3]} fox counts {i * 7 % 13} hens." * (i % 4 + 1)
    for i in range(200)
]


@pytest.fixture()
def corpus(tmp_path: Path) -> str:
    path = tmp_path / "corpus.txt"
    path.write_text("\n\n\n".join(DOCS))
    return str(path)


def run(tmp_path: Path, corpus: str, name: str = "run", **overrides) -> dict:
    return tiny_run(tmp_path, corpus, name, **{"seq_len": 64, "max_steps": 4, **overrides})


def test_split_examples_is_seeded_and_disjoint():
    examples = [Example([i, i + 1], [False, True]) for i in range(100)]
    train_a, held_a = split_examples(examples, 0.1, seed=3)
    train_b, held_b = split_examples(examples, 0.1, seed=3)
    assert [e.ids for e in held_a] == [e.ids for e in held_b] and len(held_a) == 10
    ids = lambda part: {e.ids[0] for e in part}  # noqa: E731
    assert not ids(train_a) & ids(held_a) and ids(train_a) | ids(held_a) == set(range(100))
    assert ids(split_examples(examples, 0.1, seed=4)[1]) != ids(held_a)


def test_eval_every_and_at_the_end(tmp_path, corpus, capsys):
    summary = run(tmp_path, corpus, val_split=0.1, eval_every=3, max_steps=4)
    rows = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert [("eval_loss" in r) for r in rows] == [False, False, True, True]  # step 3, then end
    for r in rows[2:]:
        assert r["eval_ppl"] == pytest.approx(math.exp(r["eval_loss"]))
        assert r["eval_targets"] > 0
    assert summary["eval_loss"] == rows[-1]["eval_loss"]
    out = capsys.readouterr().out
    assert re.search(r"step 3/4 .* eval_loss \d+\.\d+ ppl \d+\.\d+", out), out
    assert "eval loss" in out.splitlines()[-1]


def test_eval_data_only_at_the_end_by_default(tmp_path, corpus):
    held = tmp_path / "held.jsonl"
    held.write_text("\n".join(f'{{"text": "held-out note {i} about foxes"}}' for i in range(40)))
    run(tmp_path, corpus, eval_data=str(held), max_steps=3)
    rows = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert ["eval_loss" in r for r in rows] == [False, False, True]


def test_evaluate_is_the_mean_target_loss_and_compiles_nothing(corpus):
    from compiletune.data.rows import load_examples
    from compiletune.data.tokenizer import byte_tokenizer

    examples = load_examples(corpus, byte_tokenizer())[:30]
    data = pack(examples, 64, keep_tail=True)  # as the trainer packs held-out data
    # Every target of the held-out examples counts (a document's first token is never one).
    assert int((data.targets != IGNORE_INDEX).sum()) == sum(sum(e.is_target[1:]) for e in examples)
    args = from_name("debug")
    args.n_layers, args.dim, args.ffn_dim, args.n_heads, args.n_kv_heads = 2, 64, 128, 4, 2
    model = build_model(args, seed=0)
    head = LossHead(model.output, "plain")
    with torch.no_grad():  # reference: every row alone, mean over all targets
        total = sum(
            head(
                model.hidden_states(
                    data.inputs[r : r + 1], data.positions[r : r + 1], data.doc_ids[r : r + 1]
                ),
                data.targets[r : r + 1],
            )
            for r in range(data.rows)
        )
    n = int((data.targets != IGNORE_INDEX).sum())
    regions = compile_regions(model, head, CompileOptions(backend="aot_eager", loss="plain"))
    got = evaluate(model, data, "plain", 4, torch.device("cpu"), doc_mask=True)  # 4 rows/batch
    assert got["eval_targets"] == n
    assert got["eval_loss"] == pytest.approx(total.item() / n, rel=1e-5)
    assert regions.stats()["compiles"] == 0  # evaluation ran eagerly
    assert model.training


def _short_eval(tmp_path: Path) -> str:
    p = tmp_path / "short.txt"
    p.write_text("tiny")
    return str(p)


def test_eval_data_shorter_than_a_row_is_evaluated_whole(tmp_path, corpus):
    """Held-out data is packed with its tail padded into a last row, so a file shorter than
    --seq-len still counts every one of its targets."""
    from compiletune.data.rows import load_examples
    from compiletune.data.tokenizer import byte_tokenizer

    short = _short_eval(tmp_path)
    want = sum(sum(e.is_target[1:]) for e in load_examples(short, byte_tokenizer()))
    out = tmp_path / "out"
    argv = ["train", "--data", corpus, "--seq-len", "64", "--max-steps", "1"]
    assert main([*argv, "--eval-data", short, "--output-dir", str(out)]) == 0
    summary = json.loads((out / "summary.json").read_text())
    last = json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])
    assert want > 0 and last["eval_targets"] == want
    assert math.isfinite(summary["eval_loss"])


@pytest.mark.parametrize(
    "make_argv, needle",
    [
        (lambda t: ["--eval-every", "5"], "--eval-every needs held-out data"),
        (lambda t: ["--val-split", "0.1", "--eval-data", "x.txt"], "pass one of them"),
        (lambda t: ["--val-split", "1.5"], r"--val-split must be a fraction in \[0, 1\)"),
        (lambda t: ["--log", "neptune"], "unknown logger 'neptune'"),
    ],
)
def test_bad_eval_flags(tmp_path, corpus, capsys, make_argv, needle):
    out = tmp_path / "out"
    argv = ["train", "--data", corpus, "--seq-len", "64", "--max-steps", "1"]
    assert main([*argv, *make_argv(tmp_path), "--output-dir", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and re.search(needle, err[0]), err
    assert not out.exists()


def test_missing_logger_package_names_the_extra(tmp_path, corpus, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` raises ImportError
    out = tmp_path / "out"
    argv = ["train", "--data", corpus, "--max-steps", "1", "--log", "wandb"]
    assert main([*argv, "--output-dir", str(out)]) == 2
    assert 'pip install "compiletune[wandb]"' in capsys.readouterr().err
    assert not out.exists()


def test_tensorboard_events_match_metrics(tmp_path, corpus):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run(tmp_path, corpus, val_split=0.1, max_steps=3, log="tensorboard")
    rows = read_metrics(tmp_path / "run" / "metrics.jsonl")
    events = EventAccumulator(str(tmp_path / "run" / "tensorboard"))
    events.Reload()
    loss = events.Scalars("train/loss")
    assert [e.step for e in loss] == [1, 2, 3]
    assert [e.value for e in loss] == pytest.approx([r["loss"] for r in rows], rel=1e-6)
    (eval_loss,) = events.Scalars("eval/loss")
    assert eval_loss.step == 3 and eval_loss.value == pytest.approx(rows[-1]["eval_loss"])
    assert "train/lr" in events.Tags()["scalars"]
    (params,) = events.Tensors("params/text_summary")  # the run's parameters, at step 0
    table = params.tensor_proto.string_val[0].decode()
    assert params.step == 0 and "| trainer_commit | " in table and "| max_steps | 3 |" in table


def test_wandb_offline_run(tmp_path, corpus, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    run(tmp_path, corpus, val_split=0.1, max_steps=2, log="wandb")
    (run_file,) = glob.glob(str(tmp_path / "run" / "wandb" / "offline-run-*" / "run-*.wandb"))
    # The offline run's record log (protobuf) holds the logged keys; wandb ships no reader.
    content = Path(run_file).read_bytes()
    assert b"train/loss" in content and b"eval/loss" in content and b"eval/ppl" in content
    assert b"trainer_commit" in content and b"compiletune_version" in content  # in the config


def test_wandb_resumed_run_continues_the_same_run(tmp_path, corpus, monkeypatch):
    """A resumed training run logs into the W&B run it started (the id kept in the run
    folder), not a new one."""
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    run(tmp_path, corpus, max_steps=2, log="wandb")
    run_id = (tmp_path / "run" / "wandb" / "run_id").read_text()
    run(tmp_path, corpus, max_steps=4, log="wandb", resume=True)
    dirs = sorted(glob.glob(str(tmp_path / "run" / "wandb" / "offline-run-*")))
    # offline-run-<time>-<id>, with "-1" appended when both runs started in the same second
    assert len(dirs) == 2, dirs
    assert all(re.search(rf"-{run_id}(-\d+)?$", d) for d in dirs), dirs
    assert (tmp_path / "run" / "wandb" / "run_id").read_text() == run_id


def test_wandb_init_resumes_only_a_resumed_run(tmp_path, corpus, monkeypatch):
    """What the trainer asks wandb.init for: a new run (no id, no resume) for a fresh run, the
    kept id with resume="allow" for --resume, and a new run again when the folder was
    --overwrite-n since (even by a run without W&B)."""
    wandb = pytest.importorskip("wandb")
    calls = []

    class FakeRun:
        def __init__(self, id):
            self.id = id

        def log(self, *args, **kwargs):
            pass

        def finish(self):
            pass

    def fake_init(**kwargs):
        calls.append(kwargs)
        return FakeRun(kwargs["id"] or f"run{len(calls)}")

    monkeypatch.setattr(wandb, "init", fake_init)
    monkeypatch.setattr(wandb, "teardown", lambda: None)
    run(tmp_path, corpus, max_steps=2, log="wandb")
    run(tmp_path, corpus, max_steps=3, log="wandb", resume=True)
    run(tmp_path, corpus, max_steps=2, overwrite=True)  # no W&B this time
    run(tmp_path, corpus, max_steps=3, log="wandb", resume=True)
    run(tmp_path, corpus, max_steps=4, log="wandb", resume=True)
    asked = [(c["id"], c["resume"]) for c in calls]
    assert asked == [(None, None), ("run1", "allow"), (None, None), ("run3", "allow")]


def test_mlflow_run_matches_metrics_and_resumes(tmp_path, corpus, monkeypatch):
    """--log mlflow without MLFLOW_TRACKING_URI: a run in OUTPUT_DIR/mlflow/mlflow.db with
    metrics.jsonl's losses per step and the run's parameters; --resume continues that run (one
    value per step when it resumes from the last step logged)."""
    pytest.importorskip("mlflow")
    pytest.importorskip("sqlalchemy")
    from mlflow.tracking import MlflowClient

    from compiletune.loggers import trainer_commit

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("MLFLOW_EXPERIMENT_NAME", raising=False)
    out = tmp_path / "run"
    run(tmp_path, corpus, max_steps=2, log="mlflow")
    run_id = (out / "mlflow" / "run_id").read_text()
    run(tmp_path, corpus, max_steps=4, log="mlflow", resume=True)
    assert (out / "mlflow" / "run_id").read_text() == run_id
    client = MlflowClient(f"sqlite:///{out / 'mlflow' / 'mlflow.db'}")
    (experiment,) = [e for e in client.search_experiments() if e.name == "compiletune"]
    (only,) = client.search_runs([experiment.experiment_id])
    assert only.info.run_id == run_id and only.info.run_name == "run"
    assert only.info.status == "FINISHED"
    rows = read_metrics(out / "metrics.jsonl")
    loss = sorted(client.get_metric_history(run_id, "train/loss"), key=lambda m: m.step)
    assert [m.step for m in loss] == [1, 2, 3, 4]
    assert [m.value for m in loss] == pytest.approx([r["loss"] for r in rows], rel=1e-6)
    params, tags = only.data.params, only.data.tags
    assert params["trainer_commit"] == trainer_commit() and "model_dir" in params
    # parameters are the first invocation's; what the resume changed is a tag
    assert params["max_steps"] == "2" and params["resume"] == "false"
    assert tags["resumed_at_step_2.max_steps"] == "4"
    # --overwrite forgets the run id: a new MLflow run, the old one stays in the store
    run(tmp_path, corpus, max_steps=1, log="mlflow", overwrite=True)
    assert (out / "mlflow" / "run_id").read_text() != run_id
    assert len(client.search_runs([experiment.experiment_id])) == 2
