"""The token cache and what reads it: rows equal to in-memory packing, cache hits, invalidation,
killed builds, concurrent builders, worker processes; mixtures of sources."""

from __future__ import annotations

import json
import multiprocessing
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from compiletune.cli import main
from compiletune.data import rows as data_mod
from compiletune.data.rows import Batches, Mixture, PackedData, load_examples, pack
from compiletune.data.sources import parse_sources
from compiletune.data.token_cache import cached_store
from compiletune.data.token_store import META, MemoryStore
from compiletune.data.tokenizer import byte_tokenizer
from compiletune.errors import UserError
from compiletune.metrics import read_metrics

CHAT = {
    "messages": [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "what is {i}?"},
        {"role": "assistant", "content": "{i} is a number."},
    ]
}


def _chat_file(path: Path, n: int, offset: int = 0) -> Path:
    rows = []
    for i in range(offset, offset + n):
        row = json.loads(json.dumps(CHAT).replace("{i}", str(i)))
        rows.append(json.dumps(row))
    path.write_text("\n".join(rows) + "\n")
    return path


def _text_file(path: Path, n: int, word: str) -> Path:
    path.write_text("\n".join(json.dumps({"text": f"{word} {i} " * (1 + i % 5)}) for i in range(n)))
    return path


def _same_rows(a: PackedData, b: PackedData) -> None:
    assert a.rows == b.rows
    x, y = a.all_rows(), b.all_rows()
    for k in x:
        assert torch.equal(x[k], y[k]), k


@pytest.mark.parametrize("seq_len", [7, 32])
def test_cached_rows_equal_in_memory_packing(tmp_path, seq_len):
    tok = byte_tokenizer()
    src = _chat_file(tmp_path / "chat.jsonl", 40)
    store = cached_store(str(src), tok, cache_dir=str(tmp_path / "c"), say=lambda s: None)
    examples = load_examples(str(src), tok)
    _same_rows(PackedData(store, seq_len), pack(examples, seq_len))
    _same_rows(PackedData(store, seq_len, keep_tail=True), pack(examples, seq_len, keep_tail=True))
    # a subset of documents (what --val-split leaves) packs like the same examples in memory
    keep = np.array([i for i in range(store.n_docs) if i % 3])
    _same_rows(PackedData(store.subset(keep), seq_len), pack([examples[i] for i in keep], seq_len))
    docs = [store.document(int(i)) for i in keep]
    _same_rows(
        PackedData(MemoryStore.from_documents(docs), seq_len),
        pack([examples[i] for i in keep], seq_len),
    )


def test_second_run_reads_the_cache_and_a_changed_input_rebuilds(tmp_path, monkeypatch):
    tok, cache = byte_tokenizer(), str(tmp_path / "c")
    src = _chat_file(tmp_path / "chat.jsonl", 20)
    said = []
    first = cached_store(str(src), tok, cache_dir=cache, say=said.append)
    assert len(said) == 2 and said[0].startswith(f"tokenizing {src} into the token cache")
    assert said[1].startswith(f"tokenized {src}: 20 documents")

    def no_tokenizing(*a, **k):
        raise AssertionError("tokenized again")

    monkeypatch.setattr(data_mod, "encode", no_tokenizing)
    again = cached_store(str(src), tok, cache_dir=cache, say=said.append)
    assert again.folder == first.folder and len(said) == 2
    monkeypatch.undo()
    _chat_file(src, 20, offset=1)  # same size, other content
    changed = cached_store(str(src), tok, cache_dir=cache, say=said.append)
    assert changed.folder != first.folder and len(said) == 4
    # another tokenizer (another chat template) is another entry too
    tok.chat_template = tok.chat_template.replace("### ", "## ")
    assert cached_store(str(src), tok, cache_dir=cache, say=said.append).folder != changed.folder


def test_a_killed_build_is_never_used(tmp_path):
    src = _text_file(tmp_path / "t.jsonl", 3000, "word")
    cache = tmp_path / "c"
    code = (
        "import sys; from compiletune.data.token_cache import cached_store; "
        "from compiletune.data.tokenizer import byte_tokenizer; "
        "cached_store(sys.argv[1], byte_tokenizer(), cache_dir=sys.argv[2], workers=0)"
    )
    env = {**os.environ, "COMPILETUNE_KILL_AT": "cache:2"}
    done = subprocess.run([sys.executable, "-c", code, str(src), str(cache)], env=env, timeout=120)
    assert done.returncode == -9
    assert not [p for p in cache.iterdir() if (p / META).exists()]  # nothing complete
    store = cached_store(str(src), byte_tokenizer(), cache_dir=str(cache), say=lambda s: None)
    assert store.n_docs == 3000
    assert not [p for p in cache.iterdir() if p.name.startswith(".tmp-")]


def _build(args: tuple[str, str]) -> str:
    lines = []
    cached_store(args[0], byte_tokenizer(), cache_dir=args[1], workers=0, say=lines.append)
    return "".join(lines)


def test_concurrent_builders_build_once(tmp_path):
    """What torchrun's ranks do: all ask at once, one builds, the others wait and read it."""
    src = _text_file(tmp_path / "t.jsonl", 4000, "token")
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(3) as pool:
        said = pool.map(_build, [(str(src), str(tmp_path / "c"))] * 3)
    assert sum(f"tokenized {src}:" in s for s in said) == 1


def test_worker_processes_give_the_same_entry(tmp_path):
    tok = byte_tokenizer()
    src = _chat_file(tmp_path / "chat.jsonl", 1500)
    one = cached_store(str(src), tok, cache_dir=str(tmp_path / "a"), workers=0, say=lambda s: None)
    two = cached_store(str(src), tok, cache_dir=str(tmp_path / "b"), workers=2, say=lambda s: None)
    for name in ("ids.i32", "flags.u8", "docs.i64"):
        assert (one.folder / name).read_bytes() == (two.folder / name).read_bytes(), name


# ----------------------------------------------------------------------------- mixtures


def test_mixture_proportions_determinism_and_exact_resume(tmp_path):
    tok = byte_tokenizer()
    a = pack(load_examples(str(_text_file(tmp_path / "a.jsonl", 300, "x" * 8)), tok), 8)
    b = pack(load_examples(str(_text_file(tmp_path / "b.jsonl", 300, "y" * 8)), tok), 8)
    mix = Mixture([a, b], [0.7, 0.3], batch_size=10, seed=3)
    batches = [mix.next() for _ in range(300)]
    from_a = sum(int((bt["inputs"] == ord("x")).any(dim=1).sum()) for bt in batches)
    assert abs(from_a / 3000 - 0.7) < 0.04
    state = None
    again = Mixture([a, b], [0.7, 0.3], batch_size=10, seed=3)
    for i in range(300):
        if i == 123:
            state = json.loads(json.dumps(again.state_dict()))  # JSON-able, as saved
        nxt = again.next()
        assert all(torch.equal(nxt[k], batches[i][k]) for k in nxt)
    resumed = Mixture([a, b], [0.7, 0.3], batch_size=10, seed=3)
    resumed.load_state_dict(state)
    for i in range(123, 160):
        nxt = resumed.next()
        assert all(torch.equal(nxt[k], batches[i][k]) for k in nxt)
    other = Mixture([a, b], [0.7, 0.3], batch_size=10, seed=4).next()
    assert not torch.equal(other["inputs"], batches[0]["inputs"])
    with pytest.raises(UserError, match="2-source mixture"):
        resumed.load_state_dict(Batches(a, 4, 0).state_dict())  # a single source's state


@pytest.mark.parametrize(
    "spec, needle",
    [
        ("a.jsonl:0.5,b.jsonl:x", "the weight 'x' of b.jsonl is not a number"),
        ("a.jsonl:0.5,b.jsonl", "'b.jsonl' has no weight"),
        ("a.jsonl:-1,b.jsonl:1", "must be positive"),
        ("a.jsonl:inf", "must be positive"),
    ],
)
def test_bad_mixtures(spec, needle):
    with pytest.raises(UserError, match=needle):
        parse_sources(spec)


def test_mixture_trains_and_resumes_exactly(tmp_path, capsys):
    a = _text_file(tmp_path / "a.jsonl", 200, "alpha")
    b = _chat_file(tmp_path / "b.jsonl", 100)
    flags = ["--data", f"{a}:0.6,{b}:0.4", "--seq-len", "96", "--batch-size", "2"]
    flags += ["--val-split", "0.1"]
    full, part = tmp_path / "full", tmp_path / "part"
    assert (
        main(["train", *flags, "--max-steps", "6", "--save-every", "3", "--output-dir", str(full)])
        == 0
    )
    shutil.copytree(full, part)
    shutil.rmtree(part / "step_6")  # as if the run had died after step 3's checkpoint
    assert main(["train", "--output-dir", str(part), "--resume"]) == 0
    want = [r["loss"] for r in read_metrics(full / "metrics.jsonl")]
    got = [r["loss"] for r in read_metrics(part / "metrics.jsonl")]
    assert got == want
    assert read_metrics(full / "metrics.jsonl")[-1]["eval_loss"] > 0
    assert main(["train", "--data", f"{a}:0.6,{b}:oops", "--output-dir", str(tmp_path / "x")]) == 2
    assert "the weight 'oops'" in capsys.readouterr().err


# ----------------------------------------------------------------------------- integrity


def _entry(tmp_path: Path) -> tuple[str, str, Path, list]:
    """A built entry of a small chat file: (source, cache dir, entry folder, its rows)."""
    src, cache = str(_chat_file(tmp_path / "chat.jsonl", 30)), str(tmp_path / "c")
    store = cached_store(src, byte_tokenizer(), cache_dir=cache, say=lambda s: None)
    return src, cache, store.folder, PackedData(store, 16).all_rows()


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:-8])


def _offsets_past_the_ids(path: Path) -> None:
    bounds = np.fromfile(path, dtype=np.int64)
    bounds[-2] = bounds[-1] + 100
    bounds.tofile(path)


def _ids_changed_in_place(path: Path) -> None:
    ids = np.fromfile(path, dtype=np.int32)
    ids[5] = (ids[5] + 1) % 200  # still inside the vocabulary
    ids.tofile(path)


DAMAGE = [
    ("ids.i32", _truncate, "ids.i32 holds"),
    ("docs.i64", _offsets_past_the_ids, "docs.i64 holds document offsets outside"),
    ("meta.json", lambda p: p.write_text("{not json"), "meta.json is unreadable"),
    ("flags.u8", _truncate, "flags.u8 holds"),
    ("ids.i32", _ids_changed_in_place, "ids.i32 changed since it was written"),
]


@pytest.mark.parametrize("name, spoil, reason", DAMAGE, ids=[d[2] for d in DAMAGE])
def test_a_damaged_entry_is_rebuilt_with_one_line(tmp_path, name, spoil, reason):
    from compiletune.data import token_cache

    src, cache, entry, rows = _entry(tmp_path)
    spoil(entry / name)
    token_cache._HASHED.clear()  # a new process: the first open re-hashes
    said = []
    store = cached_store(src, byte_tokenizer(), cache_dir=cache, say=said.append)
    assert said[0].startswith(f"token cache entry {entry} is damaged ({reason}")
    assert said[0].endswith(f"rebuilding it from {src}") and said[-1].startswith("tokenized ")
    again = PackedData(store, 16).all_rows()
    assert all(torch.equal(again[k], rows[k]) for k in rows)  # the same data as before
    assert token_cache.damage(store.folder, rehash=True) is None


def test_sizes_are_checked_at_every_open_and_hashes_once_per_process(tmp_path):
    from compiletune.data import token_cache

    src, cache, entry, _ = _entry(tmp_path)
    _ids_changed_in_place(entry / "ids.i32")  # same size: only a hash sees it
    assert token_cache.damage(entry) is None  # hashed as it was written, in this process
    assert "changed since" in token_cache.damage(entry, rehash=True)
    _truncate(entry / "flags.u8")
    assert "flags.u8 holds" in token_cache.damage(entry)  # sizes: always


def test_token_ids_outside_the_models_vocabulary_are_refused(tmp_path):
    from compiletune.data.token_cache import check_vocabulary

    src, cache, entry, _ = _entry(tmp_path)
    store = cached_store(src, byte_tokenizer(), cache_dir=cache, say=lambda s: None)
    top = store.meta["max_id"]
    assert top == int(np.fromfile(entry / "ids.i32", dtype=np.int32).max())
    check_vocabulary(store, top + 1)
    with pytest.raises(UserError, match=f"{entry} holds token id {top}, outside .* of {top}"):
        check_vocabulary(store, top)


def test_cache_command_lists_verifies_and_clears(tmp_path, capsys):
    src, cache, entry, _ = _entry(tmp_path)
    other = cached_store(
        str(_text_file(tmp_path / "t.jsonl", 20, "w")),
        byte_tokenizer(),
        cache_dir=cache,
        say=lambda s: None,
    ).folder
    assert main(["cache", "list", "--cache-dir", cache]) == 0
    out = capsys.readouterr().out
    assert entry.name in out and other.name in out and "30 documents" in out
    assert main(["cache", "verify", "--cache-dir", cache]) == 0
    assert capsys.readouterr().out.count("  ok") == 2
    _ids_changed_in_place(entry / "ids.i32")
    assert main(["cache", "verify", "--cache-dir", cache]) == 1
    out = capsys.readouterr().out
    assert "DAMAGED: ids.i32 changed" in out and "1 damaged" in out
    assert main(["cache", "clear", entry.name, "--cache-dir", cache]) == 0
    assert not entry.exists() and other.exists()
    assert main(["cache", "clear", "nosuchkey", "--cache-dir", cache]) == 2
    assert "no token cache entry nosuchkey" in capsys.readouterr().err
    assert main(["cache", "clear", "--cache-dir", cache]) == 0
    assert not other.exists()
    assert main(["cache", "list", "--cache-dir", cache]) == 0
    assert "no entries" in capsys.readouterr().out


def _user_files(folder: Path) -> list[str]:
    """A user's own things in `folder`: notes, photos, a training run, a folder whose name looks
    like a key. Returns what is there, to compare after."""
    (folder / "photos").mkdir(parents=True)
    (folder / "photos" / "cat.jpg").write_bytes(b"\xff\xd8 a cat")
    (folder / "todo.txt").write_text("buy milk")
    run = folder / "run"
    (run / "step_1").mkdir(parents=True)
    (run / "config.yaml").write_text("lr: 0.001\n")
    (run / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0}\n')
    (folder / ("ab" * 20)).mkdir()
    (folder / ("ab" * 20) / "meta.json").write_text('{"mine": true}')
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))


def test_clear_deletes_only_what_the_cache_wrote(tmp_path, capsys):
    """`cache clear` pointed at a user's folder, or at a cache with a user's folders in it,
    deletes nothing but cache entries; a foreign folder named as a key is refused by name."""
    mine = tmp_path / "mine"
    before = _user_files(mine)
    assert main(["cache", "clear", "--cache-dir", str(mine)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"{mine} is not a compiletune token cache" in err[0], err
    assert sorted(str(p.relative_to(mine)) for p in mine.rglob("*")) == before
    # a real cache that a user's folders ended up in
    src, cache, entry, _ = _entry(tmp_path)
    kept = [k for k in _user_files(Path(cache)) if not k.startswith((".", entry.name))]
    for name in ("photos", "run", "ab" * 20):
        assert main(["cache", "clear", name, "--cache-dir", cache]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and f"{Path(cache) / name} is not a token cache entry" in err[0]
    assert main(["cache", "clear", "--cache-dir", cache]) == 0
    out = capsys.readouterr().out
    assert "removed 1 entry" in out and "left 3 folders that are not token cache entries" in out
    assert not entry.exists()
    left = sorted(str(p.relative_to(cache)) for p in Path(cache).rglob("*"))
    assert [k for k in left if not k.startswith(".")] == kept


def test_an_entry_of_an_older_version_is_recognised_by_its_manifest(tmp_path, capsys):
    from compiletune.data import token_cache

    src, cache, entry, _ = _entry(tmp_path)
    (entry / token_cache.ENTRY_MARK).unlink()  # written before the marker existed
    (Path(cache) / token_cache.ROOT_MARK).unlink()
    assert token_cache.entries(cache) == [entry]
    assert main(["cache", "clear", entry.name, "--cache-dir", cache]) == 0
    assert not entry.exists()


def test_clearing_a_key_twice_in_one_command_removes_it_once(tmp_path, capsys):
    src, cache, entry, _ = _entry(tmp_path)
    assert main(["cache", "clear", entry.name, entry.name, "--cache-dir", cache]) == 0
    assert "removed 1 entry" in capsys.readouterr().out and not entry.exists()


def test_list_and_verify_show_foreign_folders_as_not_entries(tmp_path, capsys):
    src, cache, entry, _ = _entry(tmp_path)
    _user_files(Path(cache))
    for action in ("list", "verify"):
        assert main(["cache", action, "--cache-dir", cache]) == 0
        out = capsys.readouterr().out
        assert "DAMAGED" not in out and "damaged" not in out and "cache clear" not in out
        for name in ("photos", "run", "ab" * 20):
            assert f"{name}  not a cache entry" in out
        assert entry.name in out
    assert main(["cache", "verify", "photos", "--cache-dir", cache]) == 0
    assert "photos  not a cache entry" in capsys.readouterr().out


UNGUARDED = """
import sys, threading, time
from compiletune.data.token_cache import cached_store
from compiletune.data.tokenizer import byte_tokenizer
threading.Thread(target=time.sleep, args=(300,), daemon=True).start()
cached_store(sys.argv[1], byte_tokenizer(), cache_dir=sys.argv[2], workers=2, say=print)
"""


def test_a_script_without_a_main_guard_is_told_not_left_waiting(tmp_path):
    """Beside another thread the cache's workers are spawned, and each runs the script that
    started them again: one whose top-level code builds the cache is told to guard it, instead
    of every worker waiting for good on the lock its parent holds."""
    script = tmp_path / "unguarded.py"
    script.write_text(UNGUARDED)
    src = _chat_file(tmp_path / "chat.jsonl", 600)
    done = subprocess.run(
        [sys.executable, str(script), str(src), str(tmp_path / "cache")],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=tmp_path,
    )
    assert done.returncode != 0
    assert "if __name__ == '__main__':" in done.stderr, done.stderr[-2000:]
