"""The token cache: a source tokenised once, read by every later run without tokenising.

`cached_store(source, tokenizer, ...)` returns a `FileStore` (token_store.py) over
`CACHE_DIR/<key>/`, building it first if needed. The key is a hash of the data's content (every
byte of every file the source reads: `sources.fingerprint`), the tokenizer (its vocabulary,
merges, normalisation, special tokens and chat template) and the layout options (--data-format,
--data-columns, --data-split). A changed input is a new key, so an old entry is never read for
new data. `--seq-len` is not part of it: rows are cut from the stored documents when read, so one
entry serves every row length.

Building streams the source (layouts.read_examples), tokenises chunks of examples in worker
processes (`--data-workers`; a progress bar with the tokens/s rate), and appends each chunk's
tokens to the entry's files in order, so memory holds a few chunks whatever the corpus size. The
entry is written under a temporary name and renamed when complete (atomic.py): a killed build
leaves nothing that is ever read. A lock file makes concurrent builders wait for one another:
under torchrun every rank asks for the entry, one builds it, the others wait and open it.

An entry proves itself. Its meta.json records each file's size and SHA-256 and the largest
token id. Opening an entry always checks the sizes and the document offsets (cheap), and the
first open in a process also re-hashes every file. A damaged entry is rebuilt from its source
with one line saying why: a truncated file, offsets past the ids, unreadable metadata, or ids
changed in place. `compiletune cache list|verify|clear` shows, checks and removes entries.

Only what the cache wrote is ever deleted. The cache root holds a ROOT_MARK file and each entry an
ENTRY_MARK file, both written by compiletune; an entry of an older version (before the markers)
is recognised by its own manifest, a meta.json with the fields only this cache writes, under a
folder named by a key. Anything else in the folder (a user's files, a training run, a
--cache-dir pointed at the wrong place) is "not a cache entry": listed as such, never deleted.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import os
import re
import shutil
import time
from array import array
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ProcessPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from itertools import islice
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from compiletune import faults
from compiletune.checkpoint.atomic import make_folder, write_folder_atomically
from compiletune.data.image_tokens import encode_image_pieces, image_token_ids
from compiletune.data.images import ImageError
from compiletune.data.layouts import read_examples
from compiletune.data.sources import fingerprint, source_files
from compiletune.data.token_store import DOCS, FLAGS, IDS, IMAGES, META, FileStore
from compiletune.errors import UserError
from compiletune.progress import Progress

FORMAT = 2  # bump when the entry layout or the tokenisation rules change (2: checksums)
_CHUNK = 512  # raw examples per tokenisation task
_IN_PROCESS_BYTES = 16 << 20  # sources smaller than this tokenise in this process
ROOT_MARK = ".compiletune-token-cache"  # in the cache root, written when a run first uses it
ENTRY_MARK = ".compiletune-entry"  # in each entry, written with it
_KEY = re.compile(r"[0-9a-f]{40}")  # an entry's name: cache_key()
_MARK_TEXT = "written by compiletune (the token cache); `compiletune cache clear` removes it\n"


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


def processor_fingerprint(processor: Any) -> str:
    """What decides an image conversation's tokens beyond the tokenizer: the image processor's
    settings (sizes, patches), the processor's own (tokens per image) and its chat template."""
    h = hashlib.sha256()
    image_processor = getattr(processor, "image_processor", None)
    if image_processor is not None:
        h.update(image_processor.to_json_string().encode())
    for name in ("image_seq_length", "chat_template", "image_token", "boi_token"):
        h.update(repr(getattr(processor, name, None)).encode())
    h.update(type(processor).__name__.encode())
    return h.hexdigest()


def cache_key(
    source: str,
    tokenizer: Any,
    fmt: str,
    columns: str | None,
    split: str | None,
    roles: str | None = None,
    processor: Any = None,
    skip_bad_images: bool = False,
) -> str:
    parts = {
        "format": FORMAT,
        "data": fingerprint(source, split),
        "tokenizer": tokenizer_fingerprint(tokenizer),
        "layout": [fmt, columns, split],
    }
    if roles:  # (absent otherwise, so entries built before --data-roles keep their keys)
        parts["roles"] = roles
    if processor is not None:  # how many tokens an image takes, and its chat template
        parts["processor"] = processor_fingerprint(processor)
        parts["skip_bad_images"] = skip_bad_images
        # and where its images are: an entry keeps them as paths resolved from the data file's
        # folder, so the same rows in another folder (its own img/a.png) are another entry
        parts["folders"] = sorted({str(f.resolve().parent) for f in source_files(source, split)})
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


def _refuse_in_a_starting_worker() -> None:
    """A spawned worker starts by importing its parent's main script again: a script whose
    top-level code builds a cache would, in each of the pool's workers, wait for the lock its
    parent holds while building, for good. Said instead (multiprocessing's own check comes too
    late: the worker blocks before it starts a process)."""
    import multiprocessing  # (only here: the check of a starting worker)

    if getattr(multiprocessing.current_process(), "_inheriting", False):
        raise RuntimeError(
            "the token cache was asked for while a worker process was starting: the script that "
            "builds it runs again in each worker; put its top-level code under "
            "`if __name__ == '__main__':`"
        )


def cached_store(
    source: str,
    tokenizer: Any,
    *,
    fmt: str = "auto",
    columns: str | None = None,
    split: str | None = None,
    roles: str | None = None,
    cache_dir: str | None = None,
    workers: int | None = None,
    say: Callable[[str], None] = print,
    processor: Any = None,
    skip_bad_images: bool = False,
) -> FileStore:
    """The tokenised documents of `source`, from the cache (built first if missing). Image
    conversations go through `processor` (the checkpoint's; None: a model without a vision
    tower, which refuses them); with `skip_bad_images` a row with a bad image is left out and
    counted instead of stopping the run."""
    _refuse_in_a_starting_worker()
    root = cache_root(cache_dir)
    make_folder(root, "--cache-dir")
    _mark(root / ROOT_MARK)
    key = cache_key(source, tokenizer, fmt, columns, split, roles, processor, skip_bad_images)
    entry = root / key
    if entry.exists() and damage(entry) is None:
        return _opened(FileStore(entry), source, say)
    with _locked(root / f".{key}.lock"):
        problem = damage(entry) if entry.exists() else None  # another process may have built it
        if problem is not None:
            say(f"token cache entry {entry} is damaged ({problem}); rebuilding it from {source}")
            _remove(entry)
        if not entry.exists():
            n = _workers(source, split, workers)
            # said before the work: a large source tokenises for minutes
            say(
                f"tokenizing {source} into the token cache ({entry}; later runs read it from "
                "there without tokenizing)"
            )
            try:
                write_folder_atomically(
                    entry,
                    _marked(
                        lambda tmp: _build(
                            tmp,
                            source,
                            _Tokens(tokenizer, processor, skip_bad_images),
                            (fmt, columns, split, roles),
                            n,
                            say,
                        )
                    ),
                )
            except OSError as e:
                if e.errno != errno.ENOSPC:
                    raise
                free = shutil.disk_usage(root).free
                raise UserError(
                    f"the disk of the token cache {root} is full ({free / 2**20:.0f} MiB free) "
                    f"while tokenising {source}; free space there (`compiletune cache clear` "
                    "removes old entries) or pass --cache-dir on a disk with room, then run the "
                    "same command again"
                ) from e
    return _opened(FileStore(entry), source, say)


def _opened(store: FileStore, source: str, say: Callable[[str], None]) -> FileStore:
    """`store`, with a line saying how many rows --skip-bad-images left out of it."""
    skipped = int(store.meta.get("skipped_images", 0))
    if skipped:
        say(
            f"{source}: {skipped} row{'s' if skipped > 1 else ''} with a missing, unreadable "
            "or oversized image skipped (--skip-bad-images)"
        )
    return store


# Entries whose files were hashed in this process (by path): later opens check sizes only.
_HASHED: set[str] = set()
_HASH_BLOCK = 8 << 20


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(_HASH_BLOCK):
            h.update(block)
    return h.hexdigest()


def damage(entry: Path, rehash: bool | None = None) -> str | None:
    """What is wrong with cache entry `entry`, or None when it is whole. Always: meta.json
    readable, of this FORMAT, each file of its recorded size, the document offsets rising from
    0 to the token count. With `rehash` (default: the first time in this process) also every
    file's SHA-256 against the recorded one."""
    try:
        meta = json.loads((entry / META).read_text())
        files, tokens, docs = meta["files"], int(meta["tokens"]), int(meta["documents"])
    except FileNotFoundError:
        return f"{META} is missing"
    except (OSError, ValueError, KeyError, TypeError) as e:
        return f"{META} is unreadable ({type(e).__name__})"
    if meta.get("format") != FORMAT:
        return f"{META} is of format {meta.get('format')}, not {FORMAT}"
    expected = {IDS: 4 * tokens, FLAGS: tokens, DOCS: 8 * (docs + 1)}
    if IMAGES in files:  # image conversations: their images' references, a line per document
        expected[IMAGES] = files[IMAGES].get("bytes")
    for name, size in expected.items():
        path = entry / name
        if not path.is_file():
            return f"{name} is missing"
        actual = path.stat().st_size
        if actual != size or files.get(name, {}).get("bytes") != size:
            return f"{name} holds {actual} bytes where {size} are recorded"
    bounds = np.fromfile(entry / DOCS, dtype=np.int64)
    if bounds[0] != 0 or bounds[-1] != tokens or (np.diff(bounds) < 0).any():
        return f"{DOCS} holds document offsets outside the {tokens} stored tokens"
    if rehash is None:
        rehash = str(entry) not in _HASHED
    if rehash:
        for name in expected:
            if _sha256(entry / name) != files[name].get("sha256"):
                return f"{name} changed since it was written (its SHA-256 differs)"
        _HASHED.add(str(entry))
    return None


def check_vocabulary(store: FileStore, vocab: int) -> None:
    """Refuse an entry holding a token id outside [0, vocab): the tokenizer does not match the
    model (the embedding would fail with an index error mid-step)."""
    top = int(store.meta.get("max_id", -1))
    if top >= vocab:
        raise UserError(
            f"token cache entry {store.folder} holds token id {top}, outside the model's "
            f"vocabulary of {vocab}; the tokenizer does not match the model (pass the model's "
            "own with --tokenizer)"
        )


def _mark(path: Path) -> None:
    """Write the marker file `path` unless it is there."""
    if path.exists():
        return
    try:
        path.write_text(_MARK_TEXT)
    except OSError:  # a cache on a read-only disk (entries built elsewhere) is still read
        return


def _marked(write: Callable[[Path], None]) -> Callable[[Path], None]:
    """`write(tmp)` for a new entry, followed by its ENTRY_MARK (before the entry is published)."""

    def write_marked(tmp: Path) -> None:
        write(tmp)
        (tmp / ENTRY_MARK).write_text(_MARK_TEXT)

    return write_marked


def is_entry(folder: Path) -> bool:
    """Whether `folder` is a token cache entry compiletune wrote: a folder named by a key that
    holds ENTRY_MARK, or (written by a version before the marker) a meta.json manifest with the
    fields `_build` writes."""
    if not _KEY.fullmatch(folder.name) or not folder.is_dir():
        return False
    if (folder / ENTRY_MARK).is_file():
        return True
    try:
        meta = json.loads((folder / META).read_text())
    except (OSError, ValueError, RecursionError):
        return False
    manifest = {"format", "source", "documents", "tokens", "files"}
    return isinstance(meta, dict) and manifest <= meta.keys()


def _remove(entry: Path) -> bool:
    """Take an entry out of the cache: renamed first (one step), then deleted. False when it is
    already gone (another process removed it): removing is idempotent."""
    trash = entry.with_name(f".trash-{entry.name}-{os.getpid()}")
    try:
        entry.rename(trash)
    except FileNotFoundError:
        return False
    shutil.rmtree(trash, ignore_errors=True)
    _HASHED.discard(str(entry))
    return True


def _visible(cache_dir: str | None) -> list[Path]:
    """The folders of the cache root, by name, leaving out its own dot-files (locks, markers,
    half-written and half-removed entries)."""
    root = cache_root(cache_dir)
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))


def entries(cache_dir: str | None = None) -> list[Path]:
    """Every entry folder of the cache (what compiletune wrote), by name."""
    return [p for p in _visible(cache_dir) if is_entry(p)]


def foreign(cache_dir: str | None = None) -> list[Path]:
    """The folders in the cache root that are not entries: never shown as damaged, never
    deleted."""
    return [p for p in _visible(cache_dir) if not is_entry(p)]


def _holds_anything(root: Path) -> bool:
    return root.is_dir() and any(not p.name.startswith(".") for p in root.iterdir())


def clear(cache_dir: str | None = None, keys: list[str] | None = None) -> list[Path]:
    """Remove these entries (by key, or every entry); returns what was removed. A key naming
    anything but an entry, or a root that is not a cache at all, is refused by its path."""
    root = cache_root(cache_dir)
    found = {p.name: p for p in entries(cache_dir)}
    keys = list(dict.fromkeys(keys or []))  # a key given twice is removed once
    for key in keys:
        if key in found:
            continue
        if (root / key).exists():
            raise UserError(
                f"{root / key} is not a token cache entry (no {ENTRY_MARK} marker or cache "
                "manifest): compiletune deletes only what it wrote, so it is left alone; check "
                "--cache-dir and the key (`compiletune cache list` shows the entries)"
            )
        raise UserError(
            f"no token cache entry {key} in {root}; `compiletune cache list` shows the entries"
        )
    if not keys and not found and not (root / ROOT_MARK).exists() and _holds_anything(root):
        raise UserError(
            f"--cache-dir {root} is not a compiletune token cache (no {ROOT_MARK} marker and no "
            "cache entry); nothing removed: pass the cache's folder (`compiletune cache list` "
            "without --cache-dir shows the default one)"
        )
    chosen = [found[k] for k in keys] if keys else list(found.values())
    return [entry for entry in chosen if _remove(entry)]


def _workers(source: str, split: str | None, asked: int | None) -> int:
    if asked is not None:
        return asked
    size = sum(f.stat().st_size for f in source_files(source, split))
    if size < _IN_PROCESS_BYTES:
        return 0  # a process pool costs more than it saves on small data
    return min(os.cpu_count() or 1, 8)


@dataclass
class _Tokens:
    """How a cache entry's text becomes tokens: the tokenizer, the checkpoint's processor for
    image conversations (None: a model without a vision tower), and --skip-bad-images."""

    tokenizer: Any
    processor: Any = None
    skip_bad_images: bool = False


# A worker process's tokenisation, set once by `_init_worker`.
_TOKENS: _Tokens | None = None


def _init_worker(tokens: _Tokens) -> None:
    global _TOKENS
    _TOKENS = tokens


_TOKENIZE_CHUNK = 256  # texts per tokenizer call


def tokenize_pieces(
    texts: list[str], tokenizer, wheres: list[str] | None = None
) -> list[list[int]]:
    """Token ids of each text, no special tokens added; a progress bar when there are many.
    A text the tokenizer fails on is a UserError naming its `wheres` entry (FILE:LINE)."""
    out: list[list[int]] = []
    with tqdm(total=len(texts), desc="tokenizing", unit="doc", disable=len(texts) < 2000) as bar:
        for start in range(0, len(texts), _TOKENIZE_CHUNK):
            chunk = texts[start : start + _TOKENIZE_CHUNK]
            try:
                # verbose=False: documents longer than model_max_length are fine here, rows
                # are cut by pack(), so the "sequence too long" warning would only mislead.
                out.extend(tokenizer(chunk, add_special_tokens=False, verbose=False)["input_ids"])
            except Exception:  # find the text it fails on, one by one
                for i, text in enumerate(chunk, start=start):
                    try:
                        out.append(tokenizer(text, add_special_tokens=False)["input_ids"])
                    except Exception as e:
                        where = wheres[i] if wheres else "the data"
                        why = " ".join(str(e).split())[:200] or type(e).__name__
                        raise UserError(
                            f"{where}: the tokenizer cannot encode this text ({why}); fix or "
                            "remove it"
                        ) from e
            bar.update(len(chunk))
    return out


@dataclass
class _Encoded:
    """A chunk of documents tokenised: ids (int32 bytes), target flags (uint8 bytes), lengths,
    each document's image references (a JSON line each) and the rows left out for a bad image."""

    ids: bytes
    flags: bytes
    lengths: list[int]
    images: list[str]
    skipped: list[str]


def _encode_chunk(raw: list, tokens: _Tokens | None = None) -> _Encoded:
    """A chunk's documents tokenised (in a worker: its `_TOKENS`)."""
    tokens = tokens if tokens is not None else _TOKENS
    assert tokens is not None, "a worker is initialised with the tokenisation"
    skipped: list[str] = []
    ids, flags, lengths, kept = encode_documents(raw, tokens, skipped)
    images = [json.dumps([ref.to_json() for ref in e.images]) + "\n" for e in kept]
    return _Encoded(ids.tobytes(), flags.tobytes(), lengths, images, skipped)


def encode_arrays(raw: list, tok: Any) -> tuple[np.ndarray, np.ndarray, list[int]]:
    """Raw text examples to token ids (int32), target flags (uint8) and lengths, with array
    operations (no Python step per token): bos first unless there, eos last unless there (a
    target unless a chat ends on a non-assistant turn). `data.encode` gives the same as lists."""
    ids, flags, lengths, _ = encode_documents(raw, _Tokens(tok))
    return ids, flags, lengths


def _piece_ids(raw: list, tokens: _Tokens, skipped: list[str] | None) -> list:
    """Each example's pieces as token ids, or None for an example left out for a bad image
    (when `skipped` collects their places: --skip-bad-images)."""
    plain = [e for e in raw if not e.images]
    texts = [text for example in plain for text, _ in example.pieces]
    wheres = [example.where for example in plain for _ in example.pieces]
    flat = iter(tokenize_pieces(texts, tokens.tokenizer, wheres))
    out = []
    for example in raw:
        if not example.images:
            out.append([next(flat) for _ in example.pieces])
            continue
        try:
            out.append(
                encode_image_pieces(example.pieces, example.images, tokens.processor, example.where)
            )
        except ImageError:
            if skipped is None:
                raise
            skipped.append(example.where)
            out.append(None)
    return out


def encode_documents(
    raw: list, tokens: _Tokens, skipped: list[str] | None = None
) -> tuple[np.ndarray, np.ndarray, list[int], list]:
    """`encode_arrays` for text and image examples: also the examples kept (an image example
    whose image is bad is left out when `skipped` collects them, else an `ImageError`). Image
    tokens are never targets."""
    tok = tokens.tokenizer
    skip = skipped if tokens.skip_bad_images else None
    pieces = _piece_ids(raw, tokens, skip)
    never = image_token_ids(tokens.processor) if tokens.processor is not None else []
    bos, eos = tok.bos_token_id, tok.eos_token_id
    ids_out, flags_out, lengths, kept = [], [], [], []
    for example, parts in zip(raw, pieces, strict=True):
        if parts is None:
            continue
        ids = np.fromiter((t for p in parts for t in p), np.int64)
        flags = np.repeat(
            np.array([t for _, t in example.pieces], np.uint8), [len(p) for p in parts]
        )
        if never:
            flags[np.isin(ids, never)] = 0
        if bos is not None and (len(ids) == 0 or ids[0] != bos):
            ids, flags = np.concatenate([[bos], ids]), np.concatenate([[0], flags])
        if eos is not None and (len(ids) == 0 or ids[-1] != eos):
            ids = np.concatenate([ids, [eos]])
            flags = np.concatenate([flags, [int(example.eos_is_target)]])
        ids_out.append(ids.astype(np.int32))
        flags_out.append(flags.astype(np.uint8))
        lengths.append(len(ids))
        kept.append(example)
    if not ids_out:
        return np.empty(0, np.int32), np.empty(0, np.uint8), [], []
    return np.concatenate(ids_out), np.concatenate(flags_out), lengths, kept


class _EntryWriter:
    """Appends tokenised chunks to a new entry's files, in order, hashing as it writes."""

    def __init__(self, tmp: Path, bar: Progress) -> None:
        self.tmp, self.bar = tmp, bar
        # closed by close(); a build that fails leaves them to the discarded temporary entry
        self.files = {name: open(tmp / name, "wb") for name in (IDS, FLAGS, IMAGES)}  # noqa: SIM115
        self.hashes = {name: hashlib.sha256() for name in self.files}
        self.sizes = dict.fromkeys(self.files, 0)
        self.bounds = array("q", [0])
        self.top = -1  # the largest token id
        self.images = 0  # image references written
        self.skipped: list[str] = []  # rows left out for a bad image

    def _put(self, name: str, data: bytes) -> None:
        self.files[name].write(data)
        self.hashes[name].update(data)
        self.sizes[name] += len(data)

    def write(self, chunk: _Encoded) -> None:
        self._put(IDS, chunk.ids)
        self._put(FLAGS, chunk.flags)
        for line in chunk.images:
            self._put(IMAGES, line.encode())
            self.images += line != "[]\n"
        if chunk.ids:
            self.top = max(self.top, int(np.frombuffer(chunk.ids, dtype=np.int32).max()))
        for n in chunk.lengths:
            self.bounds.append(self.bounds[-1] + n)
        self.skipped += chunk.skipped
        self.bar.update(len(chunk.lengths))
        faults.point("cache")  # a chunk is written, the entry is not complete

    def close(self) -> dict[str, dict]:
        """Closes the files and writes the document offsets: each file's size and SHA-256. An
        entry without images keeps no image file (the text-only layout)."""
        for f in self.files.values():
            f.close()
        if not self.images:
            (self.tmp / IMAGES).unlink()
            del self.hashes[IMAGES], self.sizes[IMAGES]
        offsets = np.asarray(self.bounds, dtype=np.int64)
        offsets.tofile(self.tmp / DOCS)
        self.hashes[DOCS] = hashlib.sha256(offsets.tobytes())
        self.sizes[DOCS] = offsets.nbytes
        return {
            k: {"bytes": self.sizes[k], "sha256": h.hexdigest()} for k, h in self.hashes.items()
        }


def _build(
    tmp: Path,
    source: str,
    tokens: _Tokens,
    layout: tuple[str, str | None, str | None, str | None],
    workers: int,
    say: Callable[[str], None],
) -> None:
    """Tokenise `source` into the new entry `tmp` (`layout`: --data-format, --data-columns,
    --data-split, --data-roles)."""
    tmp.mkdir(parents=True)
    t0 = time.perf_counter()
    fmt, columns, split, roles = layout
    skipped: list[str] = []  # rows whose image is missing (found while reading)
    raw = read_examples(
        source,
        tokens.tokenizer,
        fmt=fmt,
        columns=columns,
        split=split,
        roles=roles,
        processor=tokens.processor,
        skipped=skipped if tokens.skip_bad_images else None,
    )
    chunks = iter(lambda: list(islice(raw, _CHUNK)), [])
    # a streamed source's size in documents is unknown until it is read: a bar on a terminal,
    # else a line each time the count doubles from two chunks on (a small source: its summary)
    bar = Progress(f"tokenizing {source}", None, "documents", say, first_line=2 * _CHUNK)
    out = _EntryWriter(tmp, bar)
    if workers == 0:
        for chunk in chunks:
            out.write(_encode_chunk(chunk, tokens))
    else:
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # one thread per worker
        import multiprocessing

        from compiletune.forks import pool_context  # (torch, wanted only for a pool)

        ctx = multiprocessing.get_context(pool_context())  # spawn beside other threads
        with ProcessPoolExecutor(
            workers, mp_context=ctx, initializer=_init_worker, initargs=(tokens,)
        ) as pool:
            pending: deque[Future] = deque()
            for chunk in chunks:  # a bounded window of chunks in flight, written in order
                pending.append(pool.submit(_encode_chunk, chunk))
                if len(pending) >= 2 * workers:
                    out.write(pending.popleft().result())
            while pending:
                out.write(pending.popleft().result())
    bar.close()
    files = out.close()
    seconds = time.perf_counter() - t0
    n_tokens, docs = out.bounds[-1], len(out.bounds) - 1
    skipped += out.skipped
    meta = {
        "format": FORMAT,
        "source": source,
        "documents": docs,
        "tokens": n_tokens,
        "max_id": out.top,
        "files": files,
        "created": time.strftime("%Y-%m-%d %H:%M:%S"),
        "seconds": round(seconds, 3),
        "workers": workers,
    }
    if out.images or skipped:
        meta |= {"images": out.images, "skipped_images": len(skipped)}
        meta["skipped_rows"] = skipped[:20]  # the first few, for a user looking into it
    (tmp / META).write_text(json.dumps(meta, indent=2) + "\n")
    _HASHED.add(str(tmp.parent / tmp.name.removeprefix(".tmp-")))  # hashed as it was written
    rate = n_tokens / seconds if seconds > 0 else 0.0
    say(
        f"tokenized {source}: {docs} documents, {n_tokens} tokens in {seconds:.1f}s "
        f"({rate:,.0f} tokens/s, {max(workers, 1)} process{'es' if workers > 1 else ''}); "
        f"cached in {tmp.parent / tmp.name.removeprefix('.tmp-')}"
    )
