"""Tokenised data as a stream of documents, and the training rows cut from it on demand.

A `Store` holds documents back to back: token ids (int32), a target flag per token (uint8: is
this token something to predict), and where each document starts. `MemoryStore` keeps them in
arrays (small data, held-out sets, tests); `FileStore` reads them from a folder of the token
cache (token_cache.py) a row at a time with `pread`, so the process's memory does not grow with
the corpus (nothing is memory-mapped, so no page of the corpus counts in its resident set).
`Store.subset(docs)` is a view of some documents in order (what `--val-split` leaves), with no
copy.

Two ways to lay documents into training rows of `seq_len` inputs, each building a batch of
rows when asked (`take`), so the training step never needs more than its own rows in memory:

    ExampleRows   `--packing whole` (the default): every document (an example) whole in one
                  row, rows filled by best-fit-decreasing bin packing and padded with ignored
                  targets; an example longer than a row is truncated (`--truncation`).
    PackedData    `--packing stream` (pre-training corpora): the documents as one token stream
                  cut into rows of `seq_len + 1` tokens that overlap by one; a document that
                  straddles a row boundary is trained in two pieces.
"""

from __future__ import annotations

import contextlib
import json
import os
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch

IGNORE_INDEX = -100  # targets value for "not a target", what cross_entropy ignores by default
IDS, FLAGS, DOCS, META = "ids.i32", "flags.u8", "docs.i64", "meta.json"
IMAGES = "images.jsonl"  # image conversations: each document's image references, a JSON line
# A batch's key for its pixels still to prepare (`ExampleRows.defer_pixels`): a callable that
# returns what `image_batch.ImagePrep` would have added (`images`, `image_rows`, or nothing).
PIXEL_JOB = "pixel_job"


class Store:
    """Documents back to back. Subclasses give `_read(start, count)` over physical offsets and
    the physical start of every document (`_phys`, int64 [n_docs]) and its length."""

    _phys: np.ndarray  # physical start of each document (of this view), int64 [n_docs]
    _lens: np.ndarray  # length of each document, int64 [n_docs]
    # image conversations: each document's image references (`ImageRef.to_json`); None for
    # text-only data
    images: list[list[dict]] | None = None

    def _init_view(self, phys: np.ndarray, lens: np.ndarray) -> None:
        self._phys, self._lens = phys.astype(np.int64), lens.astype(np.int64)
        # virtual start of each document in this view's stream, and the stream's end
        self.starts = np.zeros(len(lens) + 1, dtype=np.int64)
        np.cumsum(self._lens, out=self.starts[1:])
        # every document where the stream has it: a range is one read
        self._contiguous = bool(np.array_equal(self._phys, self.starts[:-1]))

    @property
    def n_docs(self) -> int:
        return len(self._lens)

    @property
    def n_tokens(self) -> int:
        return int(self.starts[-1])

    def _read(self, start: int, count: int) -> tuple[np.ndarray, np.ndarray]:
        raise NotImplementedError

    def read(self, start: int, count: int) -> tuple[np.ndarray, np.ndarray]:
        """(ids int32, flags uint8) of virtual tokens [start, start + count), within the
        stream."""
        if count <= 0:
            return np.empty(0, np.int32), np.empty(0, np.uint8)
        if self._contiguous:
            return self._read(start, count)
        first = int(np.searchsorted(self.starts, start, side="right")) - 1
        ids, flags, need, at = [], [], count, start
        doc = first
        while need > 0:
            offset = at - int(self.starts[doc])
            take = min(need, int(self._lens[doc]) - offset)
            i, f = self._read(int(self._phys[doc]) + offset, take)
            ids.append(i)
            flags.append(f)
            need -= take
            at += take
            doc += 1
        if len(ids) == 1:
            return ids[0], flags[0]
        return np.concatenate(ids), np.concatenate(flags)

    def subset(self, docs: np.ndarray) -> Store:
        """The documents `docs` (indices in this view, ascending) as a store of their own."""
        images = None if self.images is None else [self.images[int(d)] for d in docs]
        return _Subset(self, self._phys[docs], self._lens[docs], images)

    def document(self, doc: int) -> tuple[np.ndarray, np.ndarray]:
        return self.read(int(self.starts[doc]), int(self._lens[doc]))


class _Subset(Store):
    def __init__(
        self, base: Store, phys: np.ndarray, lens: np.ndarray, images: list | None = None
    ) -> None:
        self.base, self.images = base, images
        self._init_view(phys, lens)

    def _read(self, start: int, count: int) -> tuple[np.ndarray, np.ndarray]:
        return self.base._read(start, count)


class MemoryStore(Store):
    """Documents held in arrays."""

    def __init__(
        self, ids: np.ndarray, flags: np.ndarray, lens: np.ndarray, images: list | None = None
    ) -> None:
        self.ids, self.flags = ids.astype(np.int32, copy=False), flags.astype(np.uint8, copy=False)
        self.images = images
        lens = np.asarray(lens, dtype=np.int64)
        phys = np.zeros(len(lens), dtype=np.int64)
        np.cumsum(lens[:-1], out=phys[1:])
        self._init_view(phys, lens)

    @classmethod
    def from_examples(cls, examples: list) -> MemoryStore:
        """From `data.Example`s (ids and is_target lists)."""
        lens = np.array([len(e.ids) for e in examples], dtype=np.int64)
        ids = np.fromiter((t for e in examples for t in e.ids), np.int64, int(lens.sum()))
        flags = np.fromiter((t for e in examples for t in e.is_target), np.uint8, int(lens.sum()))
        return cls(ids, flags, lens)

    @classmethod
    def from_documents(
        cls, docs: list[tuple[np.ndarray, np.ndarray]], images: list | None = None
    ) -> MemoryStore:
        """From (ids, flags) pairs, one per document (`Store.document`), and for image
        conversations each one's image references."""
        if not docs:
            empty = np.empty(0, np.int32), np.empty(0, np.uint8), np.empty(0, np.int64)
            return cls(*empty, images)
        lens = np.array([len(i) for i, _ in docs], dtype=np.int64)
        ids, flags = np.concatenate([i for i, _ in docs]), np.concatenate([f for _, f in docs])
        return cls(ids, flags, lens, images)

    @classmethod
    def from_stores(cls, parts: list[tuple[Store, np.ndarray]]) -> MemoryStore:
        """The documents `docs` of each (store, docs), in order, with their images."""
        docs = [store.document(int(d)) for store, idx in parts for d in idx]
        if all(store.images is None for store, _ in parts):
            return cls.from_documents(docs)
        images = [store.images[int(d)] if store.images else [] for store, idx in parts for d in idx]
        return cls.from_documents(docs, images)

    def _read(self, start: int, count: int) -> tuple[np.ndarray, np.ndarray]:
        return self.ids[start : start + count], self.flags[start : start + count]


class FileStore(Store):
    """A token cache folder: `ids.i32`, `flags.u8`, `docs.i64` (document starts, then the
    end), `meta.json`. Rows are read with `pread`: nothing of the corpus stays in memory but
    the document offsets (8 bytes per document)."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.meta = json.loads((folder / META).read_text())
        bounds = np.fromfile(folder / DOCS, dtype=np.int64)
        if (folder / IMAGES).is_file():  # a JSON line per document
            with open(folder / IMAGES) as f:
                self.images = [json.loads(line) for line in f]
        self._ids_fd = os.open(folder / IDS, os.O_RDONLY)
        self._flags_fd = os.open(folder / FLAGS, os.O_RDONLY)
        self._init_view(bounds[:-1], np.diff(bounds))

    def _read(self, start: int, count: int) -> tuple[np.ndarray, np.ndarray]:
        ids = np.frombuffer(os.pread(self._ids_fd, 4 * count, 4 * start), dtype=np.int32)
        flags = np.frombuffer(os.pread(self._flags_fd, count, start), dtype=np.uint8)
        return ids, flags

    def __del__(self) -> None:
        for fd in (getattr(self, "_ids_fd", None), getattr(self, "_flags_fd", None)):
            if fd is not None:
                with contextlib.suppress(OSError):
                    os.close(fd)

    def __getstate__(self) -> dict:  # picklable (spawned workers reopen the files)
        return {"folder": self.folder}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["folder"])


class _Rows:
    """Whole-tensor views of a row layout's batches (small data and tests; training reads
    batches with `take`)."""

    rows: int

    def take(self, idx: torch.Tensor | np.ndarray) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def real_inputs(self, idx: torch.Tensor | np.ndarray) -> int:
        """The inputs of rows `idx` that are tokens of the data, not padding."""
        raise NotImplementedError

    def all_rows(self) -> dict[str, torch.Tensor]:
        return self.take(np.arange(self.rows))

    @property
    def inputs(self) -> torch.Tensor:
        return self.all_rows()["inputs"]

    @property
    def targets(self) -> torch.Tensor:
        return self.all_rows()["targets"]

    @property
    def positions(self) -> torch.Tensor:
        return self.all_rows()["positions"]

    @property
    def doc_ids(self) -> torch.Tensor:
        return self.all_rows()["doc_ids"]


class PackedData(_Rows):
    """The training rows of a store. Row r covers stream tokens [r*L, r*L + L] (L + 1 tokens,
    L = seq_len): inputs are the first L, targets the last L where they are targets of the
    same document and IGNORE_INDEX elsewhere, so consecutive rows share one token and no token
    is lost. The tail that does not fill a row is dropped, or with `keep_tail` (evaluation:
    every held-out target counts) padded with token 0 in a document of its own, never a
    target. Rows without a single target are left out.

    `positions` restart at 0 at each document start and at the start of each row: a document
    that began in an earlier row cannot attend to that part, so inside this row it starts
    fresh, and positions stay below `seq_len`. `doc_ids` number the documents within a row
    (0, 1, 2, ...) for document-masked attention.
    """

    def __init__(self, store: Store, seq_len: int, keep_tail: bool = False) -> None:
        self.store, self.seq_len, self.keep_tail = store, seq_len, keep_tail
        n, L = store.n_tokens, seq_len
        rows = (n - 1) // L if n > 0 else 0
        if keep_tail and n > 1 and (n - 1) % L:
            rows += 1
        self.total_rows = rows
        self._row = self._rows_with_targets(rows)  # kept row -> stream row, int64

    @property
    def rows(self) -> int:
        return len(self._row)

    def _rows_with_targets(self, rows: int) -> np.ndarray:
        """Stream rows that have at least one target (scanned a block of rows at a time)."""
        L, keep = self.seq_len, []
        block = max(1, (1 << 20) // L)
        for r0 in range(0, rows, block):
            r1 = min(rows, r0 + block)
            t = self._targets_of(r0 * L, (r1 - r0) * L).reshape(r1 - r0, L)
            keep.append(r0 + np.flatnonzero(t.any(axis=1)))
        return np.concatenate(keep) if keep else np.empty(0, np.int64)

    def _window(self, start: int, count: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(ids, flags, document index) of stream tokens [start, start + count), padded past
        the end (keep_tail) with token 0 in a document of its own."""
        s = self.store
        real = max(0, min(count, s.n_tokens - start))
        ids, flags = s.read(start, real)
        doc = np.searchsorted(s.starts, np.arange(start, start + real), side="right") - 1
        if real < count:
            pad = count - real
            ids = np.concatenate([ids, np.zeros(pad, np.int32)])
            flags = np.concatenate([flags, np.zeros(pad, np.uint8)])
            doc = np.concatenate([doc, np.full(pad, s.n_docs, dtype=doc.dtype)])
        return ids, flags, doc

    def _targets_of(self, start: int, count: int) -> np.ndarray:
        """Whether stream tokens [start + 1, start + count] are targets for the token before
        them (a target of the same document), as a bool array [count]. Memory: the flags of
        the range, nothing per token beyond them."""
        s = self.store
        real = max(0, min(count + 1, s.n_tokens - start))
        _, flags = s.read(start, real)
        t = np.zeros(count, dtype=bool)  # the padding (keep_tail) is never a target
        t[: max(0, real - 1)] = flags[1:real] > 0
        # a document's first token is never the target of the token before it
        lo, hi = np.searchsorted(s.starts, [start + 1, start + count + 1])
        t[s.starts[lo:hi] - start - 1] = False
        return t

    def real_inputs(self, idx: torch.Tensor | np.ndarray) -> int:
        # only the last row of a keep_tail store runs past the stream's end
        starts = self._row[np.asarray(idx, dtype=np.int64).reshape(-1)] * self.seq_len
        return int(np.clip(self.store.n_tokens - starts, 0, self.seq_len).sum())

    def take(self, idx: torch.Tensor | np.ndarray) -> dict[str, torch.Tensor]:
        """Rows `idx` (kept-row numbers) as a batch: `inputs`, `targets`, `positions` (int64)
        and `doc_ids` (int32), each `[len(idx), seq_len]`."""
        L = self.seq_len
        idx = np.asarray(idx, dtype=np.int64).reshape(-1)
        out = {k: np.empty((len(idx), L), dtype=np.int64) for k in ("i", "t", "p")}
        doc_ids = np.empty((len(idx), L), dtype=np.int32)
        col = np.arange(L)
        for j, r in enumerate(self._row[idx]):
            ids, flags, doc = self._window(int(r) * L, L + 1)
            out["i"][j] = ids[:L]
            target = (flags[1:] > 0) & (doc[1:] == doc[:-1])
            out["t"][j] = np.where(target, ids[1:], IGNORE_INDEX)
            # position: distance to the latest document start in the row (or the row start)
            starts = np.ones(L, dtype=bool)
            starts[1:] = doc[1:L] != doc[: L - 1]
            out["p"][j] = col - np.maximum.accumulate(np.where(starts, col, 0))
            doc_ids[j] = doc[:L] - doc[0]
        return {
            "inputs": torch.from_numpy(out["i"]),
            "targets": torch.from_numpy(out["t"]),
            "positions": torch.from_numpy(out["p"]),
            "doc_ids": torch.from_numpy(doc_ids),
        }

    def packs_documents(self) -> bool:
        """Does any kept row hold the start of a second document (so document masking
        changes something)?"""
        L = self.seq_len
        starts = self.store.starts[1:-1]  # document starts after the first
        inside = starts[(starts % L) != 0] // L  # rows where a document starts mid-row
        return bool(np.isin(inside, self._row).any())


class _Bins:
    """Best fit over bins of integer capacity: `place(size)` puts an item into the open bin
    whose free room is the smallest that holds it (a new bin when none does) and returns the
    bin's number. Free rooms are counted in a segment tree over 0..capacity, so a placement
    costs O(log capacity)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.size = 1 << max(1, (capacity + 1).bit_length())
        self.count = [0] * (2 * self.size)  # bins per free room, summed up the tree
        self.by_room: dict[int, list[int]] = {}  # free room -> bins with it (a stack)
        self.room: list[int] = []  # free room of each bin

    def _add(self, room: int, delta: int) -> None:
        i = room + self.size
        while i:
            self.count[i] += delta
            i //= 2

    def _smallest_at_least(self, need: int) -> int | None:
        """The smallest free room >= need that some bin has, or None."""
        if need > self.capacity:
            return None
        # walk the leaves' range [need, size) through the tree, left to right
        lo, hi = need + self.size, 2 * self.size
        left: list[int] = []
        right: list[int] = []
        while lo < hi:
            if lo & 1:
                left.append(lo)
                lo += 1
            if hi & 1:
                hi -= 1
                right.append(hi)
            lo //= 2
            hi //= 2
        for node in left + right[::-1]:
            if self.count[node]:
                while node < self.size:  # down to the leftmost non-empty leaf
                    node = 2 * node if self.count[2 * node] else 2 * node + 1
                return node - self.size
        return None

    def place(self, size: int) -> int:
        room = self._smallest_at_least(size)
        if room is None:
            b = len(self.room)
            self.room.append(self.capacity)
            self.by_room.setdefault(self.capacity, []).append(b)
            self._add(self.capacity, 1)
            room = self.capacity
        b = self.by_room[room].pop()
        self._add(room, -1)
        left = room - size
        self.room[b] = left
        self.by_room.setdefault(left, []).append(b)
        self._add(left, 1)
        return b


class ExampleRows(_Rows):
    """The training rows of a store with every document whole in one row.

    A document of n tokens trains on n - 1 inputs (its tokens but the last) with the next token
    as each one's target, as it would alone. Documents longer than a row (n - 1 > seq_len) are
    truncated to seq_len + 1 tokens: `truncation` "right" keeps their start (the prompt), "left"
    their end. Documents are placed into rows by best-fit-decreasing (longest first, ties by
    position; each into the row whose free room is the smallest that holds it), which is
    deterministic; within a row they keep their order in the data. The rest of a row is
    padding: token 0, never a target, a document of its own. Documents without a target (after
    truncation) are left out.

    Serves batches as `PackedData` does (`rows`, `take`, `all_rows`, `packs_documents`), with
    `fill_ratio` (real inputs / row inputs), `truncated` (documents cut) and `lost_tokens`.
    """

    keep_tail = True  # nothing is ever dropped for not filling a row

    def __init__(
        self, store: Store, seq_len: int, truncation: str = "right", images: Any = None
    ) -> None:
        if truncation not in ("right", "left"):
            raise ValueError(f"truncation must be right or left, got {truncation!r}")
        if store.images is not None and images is None:
            raise ValueError("a store with images needs `images` (data.image_batch.ImagePrep)")
        self.store, self.seq_len, self.truncation = store, seq_len, truncation
        self.prep = images  # prepares the pixels of a batch's images
        # set by data/prefetch.py: `take` leaves the pixels as a job (PIXEL_JOB) for its worker
        self.defer_pixels = False
        lens = store._lens
        # the part of each document a row holds: [first, first + used) of its tokens
        used = np.minimum(lens, seq_len + 1)
        first = np.where(lens > used, lens - used, 0) if truncation == "left" else 0
        first = np.broadcast_to(np.asarray(first, dtype=np.int64), lens.shape).copy()
        self.truncated = int((lens > used).sum())
        self.lost_tokens = int((lens - used).sum())
        trains = self._has_targets(first, used)
        # an image conversation is never cut: its image tokens must all come with the image
        whole = np.array([bool(refs) for refs in store.images or []], dtype=bool)
        too_long = whole & (lens > used) if store.images is not None else np.zeros_like(trains)
        self.images_too_long = int((too_long & trains).sum())
        trains &= ~too_long
        docs = np.flatnonzero(trains)
        inputs = used[docs] - 1
        order = docs[np.lexsort((docs, -inputs))]  # longest first, ties by position
        bins = _Bins(seq_len)
        row_of = np.empty(len(lens), dtype=np.int64)
        for d in order.tolist():
            row_of[d] = bins.place(int(used[d]) - 1)
        # rows as runs of documents in data order
        by_row = docs[np.argsort(row_of[docs], kind="stable")]
        counts = np.bincount(row_of[docs], minlength=len(bins.room)) if len(docs) else []
        self._docs, self._first, self._used = by_row, first[by_row], used[by_row]
        self._row_start = np.zeros(len(bins.room) + 1, dtype=np.int64)
        np.cumsum(counts, out=self._row_start[1:])
        self.total_rows = len(bins.room)
        filled = int(inputs.sum())
        self.fill_ratio = filled / (self.total_rows * seq_len) if self.total_rows else 0.0
        # real inputs of each row (the rest is padding)
        self._filled = np.bincount(row_of[docs], weights=inputs, minlength=self.total_rows).astype(
            np.int64
        )
        self.dropped = int(len(lens) - len(docs)) - self.images_too_long

    def _has_targets(self, first: np.ndarray, used: np.ndarray) -> np.ndarray:
        """bool [n_docs]: the kept part of each document predicts at least one target."""
        out = np.zeros(len(used), dtype=bool)
        for d in range(len(used)):  # flags only, a document at a time
            _, flags = self.store.read(int(self.store.starts[d] + first[d]), int(used[d]))
            out[d] = bool((flags[1:] > 0).any())
        return out

    @property
    def rows(self) -> int:
        return self.total_rows

    def real_inputs(self, idx: torch.Tensor | np.ndarray) -> int:
        return int(self._filled[np.asarray(idx, dtype=np.int64).reshape(-1)].sum())

    def take(self, idx: torch.Tensor | np.ndarray) -> dict[str, torch.Tensor]:
        """Rows `idx` as a batch: `inputs`, `targets`, `positions` (int64) and `doc_ids`
        (int32), each `[len(idx), seq_len]`."""
        L = self.seq_len
        idx = np.asarray(idx, dtype=np.int64).reshape(-1)
        n = len(idx)
        inputs = np.zeros((n, L), dtype=np.int64)
        targets = np.full((n, L), IGNORE_INDEX, dtype=np.int64)
        positions = np.zeros((n, L), dtype=np.int64)
        doc_ids = np.zeros((n, L), dtype=np.int32)
        for j, r in enumerate(idx.tolist()):
            at = 0
            k = 0
            for k, i in enumerate(range(self._row_start[r], self._row_start[r + 1])):
                d, first, used = int(self._docs[i]), int(self._first[i]), int(self._used[i])
                ids, flags = self.store.read(int(self.store.starts[d]) + first, used)
                m = used - 1
                span = slice(at, at + m)
                inputs[j, span] = ids[:-1]
                targets[j, span] = np.where(flags[1:] > 0, ids[1:], IGNORE_INDEX)
                positions[j, span] = np.arange(m)
                doc_ids[j, span] = k
                at += m
            doc_ids[j, at:] = k + 1  # padding: a document of its own
            positions[j, at:] = np.arange(L - at)
        batch = {
            "inputs": torch.from_numpy(inputs),
            "targets": torch.from_numpy(targets),
            "positions": torch.from_numpy(positions),
            "doc_ids": torch.from_numpy(doc_ids),
        }
        if self.prep is not None:  # the rows' images, in the order of their tokens
            refs = [self.row_images(int(r)) for r in idx]
            if self.defer_pixels:  # prepared by the data worker (data/prefetch.py)
                batch[PIXEL_JOB] = partial(self.prep, refs)
            else:
                batch |= self.prep(refs)
        return batch

    def row_images(self, r: int) -> list[dict]:
        """The image references of row `r`'s examples, in order (none for text data)."""
        images = self.store.images
        if images is None:
            return []
        docs = self._docs[self._row_start[r] : self._row_start[r + 1]]
        return [ref for d in docs for ref in images[int(d)]]

    def packs_documents(self) -> bool:
        """Does any row hold two documents (so document masking changes something)?"""
        return bool((np.diff(self._row_start) > 1).any())

    def summary(self) -> str:
        """One line: rows, fill and what truncation cost."""
        line = (
            f"packed whole examples into {self.rows} rows of {self.seq_len} tokens "
            f"(fill {self.fill_ratio:.1%})"
        )
        if self.truncated:
            line += (
                f"; {self.truncated} example{'s' if self.truncated > 1 else ''} longer than "
                f"--seq-len truncated ({self.truncation}), {self.lost_tokens} tokens lost"
            )
            share = self.lost_tokens / max(1, self.store.n_tokens)
            if share > 0.25:
                line += (
                    f" ({share:.0%} of the data: raise --seq-len, or for long documents such as "
                    "a pre-training corpus pass --packing stream)"
                )
        if self.images_too_long:
            n = self.images_too_long
            line += (
                f"; {n} image conversation{'s' if n > 1 else ''} longer than --seq-len left out "
                "(an image's tokens are never cut: raise --seq-len to train on them)"
            )
        if self.dropped:
            line += (
                f"; {self.dropped} with nothing to learn left out (no assistant reply, an empty "
                "reply or completion, or targets cut away by truncation)"
            )
        return line
