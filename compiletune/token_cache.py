"""The token cache: a source tokenised once, read by every later run without tokenising.

`cached_store(source, tokenizer, ...)` returns a `FileStore` (token_store.py) over
`CACHE_DIR/<key>/`, building it first if needed. The key is a hash of the data's content (every
byte of every file the source reads: `sources.fingerprint`), the tokenizer (its vocabulary,
merges, normalisation, special tokens and chat template) and the layout options (--data-format,
--data-columns, --data-split). A changed input is a new key, so an old entry is never read for
new data. `--seq-len` is not part of it: rows are cut from the stored documents when read, so one
entry serves every row length.

Building streams the source (sources.read_examples), tokenises chunks of examples in worker
processes (`--data-workers`; a progress bar with the tokens/s rate), and appends each chunk's
tokens to the entry's files in order, so memory holds a few chunks whatever the corpus size. The
entry is written under a temporary name and renamed when complete (atomic.py): a killed build
leaves nothing that is ever read. A lock file makes concurrent builders wait for one another:
under torchrun every rank asks for the entry, one builds it, the others wait and open it.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import sys
import time
from array import array
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ProcessPoolExecutor
from contextlib import contextmanager
from itertools import islice
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from compiletune import faults
from compiletune.atomic import make_folder, write_folder_atomically
from compiletune.token_store import DOCS, FLAGS, IDS, META, FileStore

FORMAT = 1  # bump when the entry layout or the tokenisation rules change
_CHUNK = 512  # raw examples per tokenisation task
_IN_PROCESS_BYTES = 16 << 20  # sources smaller than this tokenise in this process


def cache_root(cache_dir: str | None) -> Path:
    """--cache-dir, else $COMPILETUNE_CACHE_DIR, else $XDG_CACHE_HOME/compiletune/data (or
    ~/.cache/compiletune/data)."""
    if cache_dir:
        return Path(cache_dir).expanduser()
    if env := os.environ.get("COMPILETUNE_CACHE_DIR"):
        return Path(env).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "compiletune" / "data"


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """What decides how text becomes tokens: the fast tokenizer's whole definition (vocabulary,
    merges, normaliser, pre-tokenizer, added tokens), the special-token ids and the chat
    template."""
    h = hashlib.sha256()
    backend = getattr(tokenizer, "backend_tokenizer", None)
    h.update(backend.to_str().encode() if backend is not None else repr(tokenizer).encode())
    for value in (
        tokenizer.bos_token_id,
        tokenizer.eos_token_id,
        getattr(tokenizer, "chat_template", None),
        type(tokenizer).__name__,
    ):
        h.update(repr(value).encode())
    return h.hexdigest()


def cache_key(source: str, tokenizer: Any, fmt: str, columns: str | None, split: str | None) -> str:
    from compiletune.sources import fingerprint

    parts = {
        "format": FORMAT,
        "data": fingerprint(source, split),
        "tokenizer": tokenizer_fingerprint(tokenizer),
        "layout": [fmt, columns, split],
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:40]


@contextmanager
def _locked(path: Path) -> Iterator[None]:
    """An exclusive lock on `path` (created if needed) for the duration."""
    fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)


def cached_store(
    source: str,
    tokenizer: Any,
    *,
    fmt: str = "auto",
    columns: str | None = None,
    split: str | None = None,
    cache_dir: str | None = None,
    workers: int | None = None,
    say: Callable[[str], None] = print,
) -> FileStore:
    """The tokenised documents of `source`, from the cache (built first if missing)."""
    root = cache_root(cache_dir)
    make_folder(root, "--cache-dir")
    key = cache_key(source, tokenizer, fmt, columns, split)
    entry = root / key
    if (entry / META).is_file():
        return FileStore(entry)
    with _locked(root / f".{key}.lock"):
        if not (entry / META).is_file():  # another process may have built it meanwhile
            n = _workers(source, split, workers)
            write_folder_atomically(
                entry, lambda tmp: _build(tmp, source, tokenizer, fmt, columns, split, n, say)
            )
    return FileStore(entry)


def _workers(source: str, split: str | None, asked: int | None) -> int:
    if asked is not None:
        return asked
    from compiletune.sources import source_files

    size = sum(f.stat().st_size for f in source_files(source, split))
    if size < _IN_PROCESS_BYTES:
        return 0  # a process pool costs more than it saves on small data
    return min(os.cpu_count() or 1, 8)


# A worker process's tokenizer, set once by `_init_worker`.
_TOKENIZER: Any = None


def _init_worker(tokenizer: Any) -> None:
    global _TOKENIZER
    _TOKENIZER = tokenizer


def _encode_chunk(raw: list, tokenizer: Any = None) -> tuple[bytes, bytes, list[int]]:
    """A chunk's token ids (int32 bytes), target flags (uint8 bytes) and lengths."""
    ids, flags, lengths = encode_arrays(raw, tokenizer if tokenizer is not None else _TOKENIZER)
    return ids.tobytes(), flags.tobytes(), lengths


def encode_arrays(raw: list, tok: Any) -> tuple[np.ndarray, np.ndarray, list[int]]:
    """Raw examples to token ids (int32), target flags (uint8) and lengths, with array
    operations (no Python step per token): bos first unless there, eos last unless there (a
    target unless a chat ends on a non-assistant turn). `data.encode` gives the same as lists."""
    from compiletune.data import _tokenize_pieces

    texts = [text for example in raw for text, _ in example.pieces]
    wheres = [example.where for example in raw for _ in example.pieces]
    pieces = _tokenize_pieces(texts, tok, wheres)
    bos, eos = tok.bos_token_id, tok.eos_token_id
    ids_out, flags_out, lengths = [], [], []
    k = 0
    for example in raw:
        n = len(example.pieces)
        parts = pieces[k : k + n]
        k += n
        ids = np.fromiter((t for p in parts for t in p), np.int64)
        flags = np.repeat(
            np.array([t for _, t in example.pieces], np.uint8), [len(p) for p in parts]
        )
        if bos is not None and (len(ids) == 0 or ids[0] != bos):
            ids, flags = np.concatenate([[bos], ids]), np.concatenate([[0], flags])
        if eos is not None and (len(ids) == 0 or ids[-1] != eos):
            ids = np.concatenate([ids, [eos]])
            flags = np.concatenate([flags, [int(example.eos_is_target)]])
        ids_out.append(ids.astype(np.int32))
        flags_out.append(flags.astype(np.uint8))
        lengths.append(len(ids))
    if not ids_out:
        return np.empty(0, np.int32), np.empty(0, np.uint8), []
    return np.concatenate(ids_out), np.concatenate(flags_out), lengths


def _build(
    tmp: Path,
    source: str,
    tokenizer: Any,
    fmt: str,
    columns: str | None,
    split: str | None,
    workers: int,
    say: Callable[[str], None],
) -> None:
    from compiletune.sources import read_examples

    tmp.mkdir(parents=True)
    t0 = time.perf_counter()
    raw = read_examples(source, tokenizer, fmt=fmt, columns=columns, split=split)
    chunks = iter(lambda: list(islice(raw, _CHUNK)), [])
    bounds = array("q", [0])
    interactive = sys.stderr.isatty()
    bar = tqdm(desc=f"tokenizing {source}", unit="tok", unit_scale=True, disable=not interactive)
    with open(tmp / IDS, "wb") as ids_f, open(tmp / FLAGS, "wb") as flags_f:

        def write(result: tuple[bytes, bytes, list[int]]) -> None:
            ids, flags, lengths = result
            ids_f.write(ids)
            flags_f.write(flags)
            for n in lengths:
                bounds.append(bounds[-1] + n)
            bar.update(sum(lengths))
            faults.point("cache")  # a chunk is written, the entry is not complete

        if workers == 0:
            for chunk in chunks:
                write(_encode_chunk(chunk, tokenizer))
        else:
            os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # one thread per worker
            import multiprocessing

            ctx = multiprocessing.get_context("fork")
            with ProcessPoolExecutor(
                workers, mp_context=ctx, initializer=_init_worker, initargs=(tokenizer,)
            ) as pool:
                pending: deque[Future] = deque()
                for chunk in chunks:  # a bounded window of chunks in flight, written in order
                    pending.append(pool.submit(_encode_chunk, chunk))
                    if len(pending) >= 2 * workers:
                        write(pending.popleft().result())
                while pending:
                    write(pending.popleft().result())
    bar.close()
    np.asarray(bounds, dtype=np.int64).tofile(tmp / DOCS)
    seconds = time.perf_counter() - t0
    tokens, docs = bounds[-1], len(bounds) - 1
    meta = {
        "format": FORMAT,
        "source": source,
        "documents": docs,
        "tokens": tokens,
        "seconds": round(seconds, 3),
        "workers": workers,
    }
    (tmp / META).write_text(json.dumps(meta, indent=2) + "\n")
    rate = tokens / seconds if seconds > 0 else 0.0
    say(
        f"tokenized {source}: {docs} documents, {tokens} tokens in {seconds:.1f}s "
        f"({rate:,.0f} tokens/s, {max(workers, 1)} process{'es' if workers > 1 else ''}); "
        f"cached in {tmp.parent / tmp.name.removeprefix('.tmp-')}"
    )
