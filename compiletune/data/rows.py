"""Training data: tokenise examples with target masks, pack them into rows, batch them.

Reading a source (files, folders, datasets, layouts) is `sources.py`'s; the trainer's path goes
through the token cache (`token_cache.py`, `token_store.py`), and this module gives what both
paths share:

- `encode`: raw examples (text pieces with target flags) to token ids that start with bos (when
  the tokenizer has one) and end with eos, plus a same-length `is_target` mask;
- `load_examples` + `pack`: the in-memory path (small data, held-out sets, tests), rows as
  `token_store.PackedData` describes them;
- `split_indices`: the seeded held-out documents of --val-split;
- `Batches` (one source) and `Mixture` (`--data SRC:W,...`): rows served in a seeded order
  whose position is saved with each checkpoint and restored exactly.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from compiletune.data.image_batch import ImagePrep, join_batches
from compiletune.data.layouts import read_examples
from compiletune.data.token_cache import encode_arrays
from compiletune.data.token_store import IGNORE_INDEX, ExampleRows, MemoryStore, PackedData, Store
from compiletune.errors import UserError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


# Tokenise this many strings per tokenizer call: big enough for the Rust batch path to pay
# off, small enough for the progress bar to move.

# A piece of an example: text and whether its tokens are targets.
Piece = tuple[str, bool]


@dataclass
class Example:
    """One tokenised document. `ids` and `is_target` have the same length."""

    ids: list[int]
    is_target: list[bool]


@dataclass
class _RawExample:
    """An example before tokenisation: text pieces in order, and what closes it."""

    pieces: list[Piece]
    eos_is_target: bool  # whether an eos appended at the end is a target
    where: str = ""  # FILE:LINE (or the source), for messages


# ----------------------------------------------------------------------------- reading sources


def _read_source(
    source: str,
    tokenizer,
    fmt: str = "auto",
    columns: str | None = None,
    split: str | None = None,
    roles: str | None = None,
) -> list[_RawExample]:
    """The examples of `source` (see `compiletune.data.sources`): any container (files, folders,
    save_to_disk folders, the HF cache) and layout, `fmt` (--data-format), `columns`
    (--data-columns) and `split` (--data-split). `layouts.read_examples` gives them lazily."""
    return list(
        read_examples(source, tokenizer, fmt=fmt, columns=columns, split=split, roles=roles)
    )


# ----------------------------------------------------------------------------- tokenising


def load_examples(
    source: str,
    tokenizer: PreTrainedTokenizerBase,
    fmt: str = "auto",
    columns: str | None = None,
    split: str | None = None,
    roles: str | None = None,
) -> list[Example]:
    """Read `source` (see `compiletune.data.sources`) and tokenise it into examples, in memory (the
    trainer goes through the token cache instead, token_cache.py)."""
    raw = _read_source(source, tokenizer, fmt=fmt, columns=columns, split=split, roles=roles)
    if not raw:
        raise UserError(f"{source} has no examples; add data to it or pick another --data")
    return encode(raw, tokenizer, source)


def encode(
    raw: list, tokenizer: PreTrainedTokenizerBase, source: str = "the data"
) -> list[Example]:
    """Tokenise raw examples (text pieces with target flags): each example starts with bos (if
    the tokenizer has one; not a target) and ends with eos (a target, except after a chat whose
    last message is not the assistant's). The token cache's encoding, as lists."""
    for example in raw:
        example.where = example.where or source
    ids, flags, lengths = encode_arrays(raw, tokenizer)
    bounds = np.cumsum([0, *lengths])
    return [
        Example(ids[a:b].tolist(), (flags[a:b] > 0).tolist())
        for a, b in zip(bounds[:-1], bounds[1:], strict=True)
    ]


# ----------------------------------------------------------------------------- held-out split


def split_indices(n: int, fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(train, held_out) indices of `n` examples, each ascending: a seeded random `fraction`
    is held out. The same seed and data give the same split, so a resumed run evaluates on
    the same examples."""
    n_held = round(fraction * n)
    if n_held < 1 or n_held >= n:
        raise UserError(
            f"--val-split {fraction} of {n} examples leaves "
            + ("no held-out example" if n_held < 1 else "no training example")
            + "; pass a fraction that leaves at least one example on each side, or --eval-data"
        )
    g = torch.Generator()
    g.manual_seed(seed % (1 << 63))
    held = np.zeros(n, dtype=bool)
    held[torch.randperm(n, generator=g)[:n_held].numpy()] = True
    return np.flatnonzero(~held), np.flatnonzero(held)


def split_examples(
    examples: list[Example], fraction: float, seed: int
) -> tuple[list[Example], list[Example]]:
    """(train, held_out): a seeded random `fraction` of whole examples is held out.

    Splitting examples before packing keeps every example on one side (a packed row may cut an
    example in two, a row-level split would leak it). Both sides keep the source order.
    """
    train, held = split_indices(len(examples), fraction, seed)
    return [examples[i] for i in train], [examples[i] for i in held]


def eval_batches(data: PackedData, batch_size: int) -> Iterator[dict[str, torch.Tensor]]:
    """Every row of `data` once, in order, in batches of up to `batch_size` rows."""
    for start in range(0, data.rows, batch_size):
        yield data.take(np.arange(start, min(data.rows, start + batch_size)))


# ----------------------------------------------------------------------------- packing


def pack(
    examples: list[Example], seq_len: int, source: str = "the data", keep_tail: bool = False
) -> PackedData:
    """`examples` in one token stream, cut into training rows (see `PackedData`). `source`
    names the data in error messages."""
    return check_rows(PackedData(MemoryStore.from_examples(examples), seq_len, keep_tail), source)


def pack_store(
    store: Store,
    seq_len: int,
    packing: str = "whole",
    truncation: str = "right",
    images: ImagePrep | None = None,
    **kw: Any,
) -> PackedData | ExampleRows:
    """A store's training rows: each example whole in a row (`packing="whole"`, `truncation`
    for one longer than a row; an image conversation with its images, pixels prepared by
    `images` when a batch is taken), or the stream cut into rows ("stream"; `kw`:
    `keep_tail`)."""
    if packing == "whole":
        return ExampleRows(store, seq_len, truncation, images)
    if packing == "stream":
        if store.images is not None:
            raise UserError(
                "--packing stream cuts examples across rows, and an image conversation must "
                "stay whole with its images; use --packing whole (the default)"
            )
        return PackedData(store, seq_len, **kw)
    raise ValueError(f"packing must be whole or stream, got {packing!r}")


def check_rows(data: PackedData | ExampleRows, source: str) -> PackedData | ExampleRows:
    """`data`, refused in one line when it has no row to train on."""
    if data.seq_len < 1:
        raise UserError(
            f"seq-len must be at least 1, got {data.seq_len}; pass a positive --seq-len"
        )
    n, L = data.store.n_tokens, data.seq_len
    if data.total_rows == 0 and n < (2 if data.keep_tail else L + 1):
        raise UserError(
            f"{source} has {n} tokens; seq-len {L} needs at least "
            f"{2 if data.keep_tail else L + 1}; lower --seq-len or add data"
        )
    if data.rows == 0 and getattr(data, "truncated", 0):
        right = data.truncation == "right"
        raise UserError(
            f"{source}: every example's targets were truncated away at --seq-len {L} (each "
            f"keeps its {'start' if right else 'end'}); raise --seq-len"
            + (", or pass --truncation left to keep the ends (the replies)" if right else "")
        )
    if data.rows == 0:
        raise UserError(
            f"{source}: no row has a token to predict (every target is masked); check that "
            "completions and assistant replies are not empty"
        )
    return data


# ----------------------------------------------------------------------------- batching


class Batches:
    """Infinite, deterministic iterator of fixed-size batches over PackedData rows.

    Each epoch visits every row once in an order drawn from a generator seeded by
    (seed, epoch). A batch that runs past the end of an epoch is completed from the next
    epoch's order, so every batch has exactly `batch_size` rows (rows repeat when there are
    fewer rows than that). `state_dict()` is the position of the next row; restoring it
    continues with exactly the batches an uninterrupted iterator would have produced.
    """

    def __init__(self, data: PackedData, batch_size: int, seed: int):
        if batch_size < 1:
            raise UserError(f"batch size must be at least 1, got {batch_size}; fix --batch-size")
        self.data = data
        self.batch_size = batch_size
        self.seed = seed
        self._epoch = 0
        self._index = 0  # position in this epoch's order of the next row to serve
        self._order_epoch = -1
        self._order = torch.empty(0, dtype=torch.long)
        self.served_inputs = 0  # real (not padding) input tokens of the batches served so far

    @property
    def epoch(self) -> int:
        """The epoch the next batch starts in (0-based)."""
        return self._epoch

    def _epoch_order(self) -> torch.Tensor:
        if self._order_epoch != self._epoch:
            g = torch.Generator()
            # One stream per (seed, epoch); the modulus keeps any int seed a valid torch seed.
            g.manual_seed((self.seed * 1_000_003 + self._epoch) % (1 << 63))
            self._order = torch.randperm(self.data.rows, generator=g)
            self._order_epoch = self._epoch
        return self._order

    def next(self) -> dict[str, torch.Tensor]:
        """The next batch: `inputs`, `targets`, `positions` (int64) and `doc_ids` (int32), each
        `[batch_size, seq_len]`."""
        rows = self.next_rows(self.batch_size).numpy()
        self.served_inputs += self.data.real_inputs(rows)
        return self.data.take(rows)

    def next_rows(self, n: int) -> torch.Tensor:
        """The row numbers of the next `n` rows (what `next` serves, `n` at a time)."""
        rows = self.data.rows
        picked = []
        need = n
        while need > 0:
            if self._index >= rows:
                self._epoch += 1
                self._index = 0
            take = self._epoch_order()[self._index : self._index + need]
            picked.append(take)
            self._index += take.numel()
            need -= take.numel()
        if self._index >= rows:  # so that `epoch` and the saved state name the upcoming epoch
            self._epoch += 1
            self._index = 0
        return torch.cat(picked)

    __next__ = next

    def __iter__(self) -> Batches:
        return self

    def state_dict(self) -> dict:
        """`{"epoch": int, "index": int}`: where the next batch starts (JSON-able)."""
        return {"epoch": self._epoch, "index": self._index}

    def load_state_dict(self, state: dict) -> None:
        epoch, index = state.get("epoch"), state.get("index")
        valid = isinstance(epoch, int) and isinstance(index, int) and epoch >= 0
        if not valid or not 0 <= index <= self.data.rows:
            raise UserError(
                f"the saved data position {state} does not fit this data ({self.data.rows} "
                "rows); resume with the same --data, --seq-len and tokenizer, or start fresh"
            )
        self._epoch = epoch
        self._index = index


class Mixture:
    """Batches drawn from several sources by weight (`--data a.parquet:0.7,b.jsonl:0.3`).

    Each row of a batch comes from a source drawn with the given probabilities; the draws come
    from a generator seeded by (seed, block of 4096 draws), so draw k is a function of the seed
    and k alone. Each source serves its rows as `Batches` does (its own seeded order, epoch by
    epoch). The state is the number of draws so far and every source's position: a resume
    continues with exactly the batches an uninterrupted run would have drawn.
    """

    BLOCK = 4096

    def __init__(
        self, datas: list[PackedData], weights: list[float], batch_size: int, seed: int
    ) -> None:
        self.parts = [Batches(d, 1, seed * 7919 + i) for i, d in enumerate(datas)]
        self.weights = torch.tensor(weights, dtype=torch.float64) / sum(weights)
        self.batch_size, self.seed = batch_size, seed
        self.draws = 0
        self._block, self._choices = -1, torch.empty(0, dtype=torch.long)
        self.served_inputs = 0  # as Batches.served_inputs

    @property
    def epoch(self) -> int:
        """Passes completed over every source (the slowest source's epoch)."""
        return min(p.epoch for p in self.parts)

    def _source(self, k: int) -> int:
        block = k // self.BLOCK
        if block != self._block:
            g = torch.Generator()
            g.manual_seed((self.seed * 1_000_033 + block) % (1 << 63))
            self._choices = torch.multinomial(self.weights, self.BLOCK, True, generator=g)
            self._block = block
        return int(self._choices[k % self.BLOCK])

    def next(self) -> dict[str, torch.Tensor]:
        picks = [self._source(self.draws + j) for j in range(self.batch_size)]
        self.draws += self.batch_size
        parts = []
        for src in picks:
            rows = self.parts[src].next_rows(1).numpy()
            self.served_inputs += self.parts[src].data.real_inputs(rows)
            parts.append(self.parts[src].data.take(rows))
        return join_batches(parts)

    __next__ = next

    def __iter__(self) -> Mixture:
        return self

    def state_dict(self) -> dict:
        return {"draws": self.draws, "sources": [p.state_dict() for p in self.parts]}

    def load_state_dict(self, state: dict) -> None:
        saved = state.get("sources")
        if not isinstance(saved, list) or len(saved) != len(self.parts):
            raise UserError(
                f"the saved data position {state} is not one of this {len(self.parts)}-source "
                "mixture; resume with the same --data"
            )
        draws = state.get("draws")
        if not isinstance(draws, int) or draws < 0:
            raise UserError(f"the saved data position {state} is not valid; resume with --data")
        for part, st in zip(self.parts, saved, strict=True):
            part.load_state_dict(st)
        self.draws = draws


def check_targets(batch: dict[str, torch.Tensor], vocab: int) -> None:
    """Refuse a host batch whose targets fall outside [0, vocab) (ignored ones aside), before
    it is copied to the device: on an accelerator the loss head does not read its targets on
    the host, and an index outside the vocabulary would end in a device-side assert."""
    targets = batch["targets"]
    bad = (targets != IGNORE_INDEX) & ((targets < 0) | (targets >= vocab))
    if bad.any():
        raise UserError(
            f"cross-entropy targets must lie in [0, {vocab}) or equal "
            f"ignore_index={IGNORE_INDEX}; found {int(targets[bad][0])}. Check that the "
            "tokenizer matches the model's vocabulary"
        )


def count_targets(batch: dict[str, torch.Tensor]) -> int:
    """Number of target tokens in a batch (what the loss averages over)."""
    return int((batch["targets"] != IGNORE_INDEX).sum())
