"""The metric loggers' parts that need no training run: the parameters every tracker records,
the trainer's commit, and the one-line errors (the runs themselves: integration/test_eval.py)."""

from __future__ import annotations

import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from compiletune import __version__
from compiletune.errors import UserError
from compiletune.loggers import check_available, parse_loggers, run_params, trainer_commit


def _git(repo: Path, *args: str) -> None:
    subprocess.run(
        ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t", *args],
        check=True,
        capture_output=True,
    )


def test_parse_loggers_knows_mlflow():
    assert parse_loggers("mlflow, tensorboard,mlflow") == ["mlflow", "tensorboard"]


def test_run_params_are_the_config_as_text_plus_the_trainer():
    params = run_params(
        {
            "lr": 1e-3,
            "model_dir": "org/name@abc",
            "log": None,
            "merge": True,
            "data": ["a.jsonl", "b.jsonl"],
            "reward_weights": {"len": 0.5},
        }
    )
    assert params["lr"] == "0.001" and params["model_dir"] == "org/name@abc"
    assert params["log"] == "null" and params["merge"] == "true"
    assert params["data"] == '["a.jsonl", "b.jsonl"]' and params["reward_weights.len"] == "0.5"
    assert params["compiletune_version"] == __version__
    assert params["trainer_commit"] == trainer_commit()
    assert all(isinstance(v, str) for v in params.values())


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
def test_trainer_commit_of_a_checkout_and_of_a_plain_folder(tmp_path):
    repo = tmp_path / "repo"
    package = repo / "compiletune"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    _git(repo, "init", "-q")
    _git(repo, "add", ".")
    _git(repo, "-c", "commit.gpgsign=false", "commit", "-q", "-m", "x")
    assert re.fullmatch(r"[0-9a-f]{40}", trainer_commit(package))
    (repo / "scratch.txt").write_text("untracked")  # an untracked file is not an edit
    assert re.fullmatch(r"[0-9a-f]{40}", trainer_commit(package))
    (package / "__init__.py").write_text("x = 1\n")
    assert re.fullmatch(r"[0-9a-f]{40}-dirty", trainer_commit(package))
    # a package the repository around it does not track (a venv inside a project): the version
    venv = repo / "venv" / "compiletune"
    venv.mkdir(parents=True)
    (venv / "__init__.py").write_text("")
    assert trainer_commit(venv) == __version__
    plain = tmp_path / "plain" / "compiletune"
    plain.mkdir(parents=True)
    assert trainer_commit(plain) == __version__


def test_trainer_commit_without_git(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # no git executable to be found
    assert trainer_commit() == __version__


@pytest.mark.parametrize("module", ["mlflow", "sqlalchemy"])
def test_missing_mlflow_package_is_one_line(module, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)  # the SQLite store needs sqlalchemy
    if module != "mlflow":
        pytest.importorskip("mlflow")
    monkeypatch.setitem(sys.modules, module, None)  # `import module` raises ImportError
    with pytest.raises(UserError) as e:
        check_available(["mlflow"])
    assert f"--log mlflow needs the {module} package" in str(e.value)
    assert 'pip install "compiletune[mlflow]"' in str(e.value) and "\n" not in str(e.value)


def test_mlflow_server_needs_no_sqlalchemy(monkeypatch):
    pytest.importorskip("mlflow")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:5000")
    monkeypatch.setitem(sys.modules, "sqlalchemy", None)
    check_available(["mlflow"])


def test_unreachable_mlflow_server_is_one_line(tmp_path, monkeypatch):
    pytest.importorskip("mlflow")
    from compiletune.loggers import MlflowLogger

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://user:secret@127.0.0.1:{port}")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "5")
    with pytest.raises(UserError) as e:
        MlflowLogger(tmp_path / "run", {"lr": "0.1"})
    text = str(e.value)
    assert text.startswith("--log mlflow: the MLflow tracking store http://***@127.0.0.1:")
    assert "MLFLOW_TRACKING_URI" in text and "secret" not in text and "\n" not in text
    assert not (tmp_path / "run").exists()
