"""No silent minutes: every phase that can take long says what it does before it starts, and
work of known size shows its progress (a bar on a terminal, lines in a log). Each test checks
the ORDER of what is printed against the phase's work (the work patched to leave a mark), never
a measured time."""

from __future__ import annotations

import json
from pathlib import Path

from compiletune.data import token_cache
from compiletune.data.token_cache import cached_store
from compiletune.data.tokenizer import byte_tokenizer
from compiletune.progress import Progress


def _text_file(path: Path, n: int) -> Path:
    path.write_text("\n".join(json.dumps({"text": f"word {i} " * (1 + i % 5)}) for i in range(n)))
    return path


def test_progress_in_a_log_is_a_line_per_tenth_or_per_doubling() -> None:
    lines: list[str] = []
    with Progress("work", 20, "items", lines.append) as bar:
        for _ in range(20):
            bar.update(1)
    assert len(lines) == 10 and lines[0] == "work: 2/20 items (10%)"
    assert lines[-1] == "work: 20/20 items (100%)"
    lines.clear()
    with Progress("stream", None, "documents", lines.append) as bar:
        for _ in range(100):
            bar.update(1)
    # 1, 2, 4, ..., 64: a long stream is never silent, a log never floods
    assert [int(line.split(": ")[1].split()[0]) for line in lines] == [1, 2, 4, 8, 16, 32, 64]


def test_tokenising_names_the_source_and_the_entry_before_it_reads(tmp_path, monkeypatch):
    events: list[str] = []
    real = token_cache.read_examples

    def reading(*args, **kwargs):
        events.append("<reading the source>")
        return real(*args, **kwargs)

    monkeypatch.setattr(token_cache, "read_examples", reading)
    source = _text_file(tmp_path / "corpus.jsonl", 1200)
    cache = tmp_path / "cache"
    store = cached_store(str(source), byte_tokenizer(), cache_dir=str(cache), say=events.append)
    first = events[0]
    assert first.startswith(f"tokenizing {source} into the token cache ({cache}/")
    assert store.folder.name in first  # the entry it writes
    assert events[1] == "<reading the source>"
    # progress over the documents as chunks are written (512 a chunk), then the summary
    progress = [e for e in events if e.startswith(f"tokenizing {source}: ")]
    assert progress == [
        f"tokenizing {source}: 512 documents so far",
        f"tokenizing {source}: 1,024 documents so far",
    ]
    assert events[-1].startswith(f"tokenized {source}: 1200 documents")
    events.clear()
    cached_store(str(source), byte_tokenizer(), cache_dir=str(cache), say=events.append)
    assert events == []  # a cache hit is quiet
