"""Models and datasets from the Hub, served by a stand-in Hub on the loopback address
(tests/hub_server.py; HF_ENDPOINT points at it, HF_HOME at a fresh cache per test)."""

from __future__ import annotations

import errno
import json

import pytest
from hub_server import HubServer, Repo, folder_files
from tiny_hf import save_tiny_llama

from compiletune.cli import main
from compiletune.config import read_saved_config
from compiletune.data import sources
from compiletune.errors import UserError
from compiletune.models import load_hf_config, resolve_model_path

CARD = """---
configs:
- config_name: default
  default: true
  data_files:
  - split: train
    path: data/train-*
  - split: test
    path: data/test-*
- config_name: other
  data_files: other/*.jsonl
- config_name: folder
  data_dir: sub
---
# a dataset card
"""


def _jsonl(rows: list[dict]) -> bytes:
    return "".join(json.dumps(r) + "\n" for r in rows).encode()


TRAIN = [{"text": f"the quick brown fox {i} jumps over the lazy dog"} for i in range(12)]


@pytest.fixture(scope="module")
def model_files(tmp_path_factory) -> dict[str, bytes]:
    files = folder_files(save_tiny_llama(tmp_path_factory.mktemp("hubmodel")))
    # what a Hub repo often holds beside: never fetched
    files["pytorch_model.bin"] = b"pickle" * 50
    files["original/consolidated.00.pth"] = b"meta" * 50
    files["model.Q4_K_M.gguf"] = b"gguf" * 50
    files["consolidated.safetensors"] = files["model.safetensors"]  # Mistral's second copy
    return files


@pytest.fixture
def server(tmp_path, monkeypatch, model_files):
    s = HubServer()
    s.add("model", "org/tiny", Repo(dict(model_files)))
    s.add("model", "org/gated", Repo(dict(model_files), gated=True))
    s.add("model", "org/secret", Repo(dict(model_files), private=True))
    s.add("model", "org/binonly", Repo({"config.json": model_files["config.json"], "x.bin": b"0"}))
    sharded = {k: v for k, v in model_files.items() if k != "model.safetensors"}
    sharded["model-00001-of-00001.safetensors"] = model_files["model.safetensors"]
    index = {"weight_map": {"w": "model-00001-of-00001.safetensors"}}
    sharded["model.safetensors.index.json"] = json.dumps(index).encode()
    s.add("model", "org/sharded", Repo(sharded))
    files = {
        "README.md": CARD.encode(),
        "data/train-00000-of-00001.jsonl": _jsonl(TRAIN),
        "data/test-00000-of-00001.jsonl": _jsonl(TRAIN[:3]),
        "other/a.jsonl": _jsonl(TRAIN[:5]),
        "data/extra/train-x.jsonl": b"not a row",  # data/train-* does not reach into folders
        "sub/train.jsonl": _jsonl(TRAIN[:4]),
        "sub/test.jsonl": _jsonl(TRAIN[:1]),
    }
    s.add("dataset", "org/set", Repo(files))
    s.add("dataset", "org/plain", Repo({"train.jsonl": _jsonl(TRAIN), "test.jsonl": b"{}"}))
    monkeypatch.setenv("HF_ENDPOINT", s.url)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_HUB_CACHE", "HF_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    # conftest makes every test offline; huggingface_hub read that when it was imported
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", False)
    monkeypatch.setenv("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    yield s
    s.close()


def test_a_model_downloads_only_what_is_read_then_comes_from_the_cache(server, model_files):
    folder = resolve_model_path("org/tiny")
    commit = server.repos[("model", "org/tiny")].commit
    assert folder.name == commit and folder.parent.parent.name == "models--org--tiny"
    got = {p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()}
    want = {n for n in model_files if n.endswith((".json", ".jinja"))} | {"model.safetensors"}
    assert got == want  # no .bin, no original/, no .gguf, no consolidated.safetensors
    assert not any(p.endswith((".bin", ".pth", ".gguf")) for p in server.file_gets())
    for name in want:
        assert (folder / name).read_bytes() == model_files[name]
    # pinned to the commit: the cache alone, not one request
    before = len(server.requests)
    assert resolve_model_path(f"org/tiny@{commit}") == folder
    assert server.requests[before:] == []
    # the default branch again: the Hub is asked for its commit, no file is fetched again
    gets = len(server.file_gets())
    assert resolve_model_path("org/tiny") == folder
    assert len(server.file_gets()) == gets
    # a config alone (estimate-memory's need) skips the weights
    server.repos[("model", "org/other")] = Repo(dict(model_files))
    assert load_hf_config("org/other")["hidden_size"] == 32
    assert not any("org/other" in p and p.endswith(".safetensors") for p in server.file_gets())


def test_a_sharded_model_fetches_the_shards_its_index_names(server):
    folder = resolve_model_path("org/sharded")
    assert sorted(p.name for p in folder.glob("*.safetensors")) == [
        "model-00001-of-00001.safetensors"
    ]
    assert not any("consolidated" in p for p in server.file_gets())


def test_offline_uses_the_cache_or_says_so(server, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(
        UserError,
        match=r"--model-dir org/tiny: no such local path, and not in the HF cache .*HF_HUB_OFF",
    ):
        resolve_model_path("org/tiny")
    monkeypatch.delenv("HF_HUB_OFFLINE")
    folder = resolve_model_path("org/tiny")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    before = len(server.requests)
    assert resolve_model_path("org/tiny") == folder
    assert server.requests[before:] == []


def test_a_dropped_download_resumes_where_it_stopped(server, model_files, monkeypatch):
    # huggingface_hub resumes from the last whole chunk it wrote (10 MB); small ones here
    monkeypatch.setattr("huggingface_hub.constants.DOWNLOAD_CHUNK_SIZE", 4096)
    data = model_files["model.safetensors"]
    half = len(data) // 2 // 4096 * 4096
    server.drop_once["model.safetensors"] = half
    folder = resolve_model_path("org/tiny")
    assert (folder / "model.safetensors").read_bytes() == data
    ranges = [r for m, p, r in server.requests if m == "GET" and p.endswith(".safetensors")]
    assert ranges == [None, f"bytes={half}-"]


@pytest.mark.parametrize(
    "spec, message",
    [
        ("org/nothere", r"no such local path, and no model repository org/nothere on http"),
        ("org/secret", r"or it is private\); check the name, and for a private one log in"),
        ("org/gated", r"the model is gated; accept its terms on http://127.0.0.1:\d+/org/gated"),
        ("org/tiny@v9", r"org/tiny has no revision 'v9'; pass a branch, tag or commit"),
        ("org/binonly", r"has no model.safetensors of safetensors weights"),
        ("runs/exp--2", r"no such local path, and not a Hub id ORG/NAME"),
    ],
)
def test_hub_errors_are_one_line(server, spec, message):
    with pytest.raises(UserError, match=message) as info:
        resolve_model_path(spec)
    assert "\n" not in str(info.value) and str(info.value).startswith(f"--model-dir {spec}")


def test_no_network_and_a_full_disk(server, monkeypatch):
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # nothing listens there
    # huggingface_hub retries a refused connection with waits of 1, 2, 4, 8 s: not here
    monkeypatch.setattr("huggingface_hub.utils._http.time.sleep", lambda s: None)
    with pytest.raises(UserError, match=r"no such local path, and http://127.0.0.1:9 cannot be"):
        resolve_model_path("org/tiny")
    with pytest.raises(UserError, match=r"--data org/set: no such local path, and http://127"):
        sources.source_files("org/set")  # the listing's request: the same line

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr("huggingface_hub.snapshot_download", full)
    monkeypatch.setenv("HF_ENDPOINT", server.url)  # the files listed, the disk fills in the fetch
    with pytest.raises(UserError, match=r"the disk filled .*HF_HOME to a larger disk"):
        resolve_model_path("org/tiny")


def test_a_dataset_reads_the_split_of_its_card_config(server):
    files = sources.source_files("org/set")
    assert [f.name for f in files] == ["train-00000-of-00001.jsonl"]
    assert "README.md" in server.file_gets()[0]
    assert not any("test-" in p or "other/" in p for p in server.file_gets())
    rows = [r for r, _ in sources.iter_records("org/set", "test")]
    assert rows == TRAIN[:3]
    assert [r for r, _ in sources.iter_records("org/set/other")] == TRAIN[:5]
    assert [r for r, _ in sources.iter_records("org/set/folder")] == TRAIN[:4]
    assert [r for r, _ in sources.iter_records("org/set/folder", "test")] == TRAIN[:1]
    with pytest.raises(UserError, match=r"no config 'nope' \(configs: default, other, folder\)"):
        sources.source_files("org/set/nope")
    with pytest.raises(UserError, match=r"has no split 'dev' \(splits: train, test\)"):
        sources.source_files("org/set", "dev")
    # without a card: the shards' names pick the split
    assert [f.name for f in sources.source_files("org/plain")] == ["train.jsonl"]
    with pytest.raises(UserError, match=r"--data org/none: no such local path, and no dataset"):
        sources.source_files("org/none")


def test_train_pins_the_commits_and_resumes_offline(server, tmp_path, monkeypatch):
    out = tmp_path / "run"
    argv = ["train", "--model-dir", "org/tiny", "--data", "org/set", "--seq-len", "32"]
    argv += ["--batch-size", "2", "--save-every", "2", "--output-dir", str(out)]
    held = ["--eval-data", "org/set", "--eval-split", "test"]
    assert main([*argv, *held, "--max-steps", "2"]) == 0
    flat = read_saved_config(out)
    model_commit = server.repos[("model", "org/tiny")].commit
    data_commit = server.repos[("dataset", "org/set")].commit
    assert flat["model_dir"] == f"org/tiny@{model_commit}"
    assert flat["data"] == f"org/set@{data_commit}"
    assert flat["eval_data"] == f"org/set@{data_commit}" and flat["eval_split"] == "test"
    last = json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])
    assert last["eval_targets"] <= 3 * 32  # the 3 rows of the test split, not train's 12
    # the repo moves on; a resume naming it again keeps the run's commit, offline
    server.repos[("model", "org/tiny")].branches["main"] = "f" * 40
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    before = len(server.requests)
    assert main([*argv, "--max-steps", "3", "--resume"]) == 0
    assert server.requests[before:] == []
    steps = [json.loads(s)["step"] for s in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3]
    # a run from before pinning (config.yaml holds org/tiny): --resume as it was, offline
    saved = (out / "config.yaml").read_text()
    (out / "config.yaml").write_text(saved.replace(f"org/tiny@{model_commit}", "org/tiny"))
    assert main(["train", "--output-dir", str(out), "--resume", "--max-steps", "4"]) == 0
    assert server.requests[before:] == []


def test_processes_of_one_machine_download_once(server, tmp_path):
    """What torchrun's processes do at start-up: resolve the same spec at the same time. The
    lock in the cache lets one download; the other waits and fetches nothing."""
    import os
    import subprocess
    import sys

    code = (
        "from compiletune.models import resolve_model_path; print(resolve_model_path('org/tiny'))"
    )
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code],
            env={**os.environ, "LOCAL_RANK": str(rank)},
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        for rank in range(2)
    ]
    folders = {p.communicate(timeout=300)[0].strip().splitlines()[-1] for p in procs}
    assert all(p.returncode == 0 for p in procs)
    assert len(folders) == 1
    gets = server.file_gets()
    assert sorted(gets) == sorted(set(gets)) and any(g.endswith(".safetensors") for g in gets)
