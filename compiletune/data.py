"""Training data: read a source, tokenise it with target masks, pack it into rows, batch it.

Sources (`--data SOURCE`):

- `pydocs`: the embedded corpus of standard-library docstrings (see `compiletune.corpus`).
- `FILE.txt`: plain text. Documents are separated by two or more consecutive empty lines, so a
  file of paragraphs (single empty lines) stays one document and a file with no such gap is
  one document. Every token is a target.
- `FILE.jsonl`: one JSON object per line, each in one of three shapes:
  `{"text": ...}` (every token is a target),
  `{"prompt": ..., "completion": ...}` (only the completion and the closing eos are targets),
  `{"messages": [{"role": ..., "content": ...}, ...]}` (rendered with the tokenizer's chat
  template; only the assistant replies, including the end-of-turn tokens the template puts
  after them, are targets). Empty lines are skipped.

Each example becomes token ids that start with bos (when the tokenizer has one) and end with eos,
plus a same-length `is_target` mask. `pack` concatenates all examples into one stream and cuts
it into rows of `seq_len + 1` tokens that overlap by one (inputs and shifted targets), and
`Batches` serves those rows in a seeded order that can be saved and resumed exactly.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from tqdm import tqdm

from compiletune.errors import UserError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

IGNORE_INDEX = -100  # targets value for "not a target", what cross_entropy ignores by default

# Tokenise this many strings per tokenizer call: big enough for the Rust batch path to pay
# off, small enough for the progress bar to move.
_TOKENIZE_CHUNK = 256

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


@dataclass
class PackedData:
    """All training rows. Every tensor is `[rows, seq_len]`.

    `positions` restart at 0 at each document start and at the start of each row: a document
    that began in an earlier row cannot attend to that part, so inside this row it starts
    fresh, and positions stay below `seq_len`. `doc_ids` number the documents within a row
    (0, 1, 2, ...) for document-masked attention.
    """

    inputs: torch.Tensor  # [rows, seq_len] int64
    targets: torch.Tensor  # [rows, seq_len] int64, IGNORE_INDEX where not a target
    positions: torch.Tensor  # [rows, seq_len] int64
    doc_ids: torch.Tensor  # [rows, seq_len] int32

    @property
    def rows(self) -> int:
        return self.inputs.shape[0]

    @property
    def seq_len(self) -> int:
        return self.inputs.shape[1]


# ----------------------------------------------------------------------------- reading sources


def _read_source(
    source: str,
    tokenizer,
    fmt: str = "auto",
    columns: str | None = None,
    split: str | None = None,
) -> list[_RawExample]:
    """The examples of `source` (see `compiletune.sources`): any container (files, folders,
    save_to_disk folders, the HF cache) and layout, `fmt` (--data-format), `columns`
    (--data-columns) and `split` (--data-split). `sources.read_examples` gives them lazily."""
    from compiletune.sources import read_examples

    return list(read_examples(source, tokenizer, fmt=fmt, columns=columns, split=split))


# ----------------------------------------------------------------------------- tokenising


def _tokenize_pieces(
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


def load_examples(source: str, tokenizer: PreTrainedTokenizerBase) -> list[Example]:
    """Read `source` (pydocs, a .txt or a .jsonl path) and tokenise it into examples.

    Each example starts with bos (if the tokenizer has one; not a target) and ends with eos
    (a target, except after a chat whose last message is not the assistant's).
    """
    raw = _read_source(source, tokenizer)
    if not raw:
        raise UserError(f"{source} has no examples; add data to it or pick another --data")
    texts = [text for example in raw for text, _ in example.pieces]
    wheres = [example.where or source for example in raw for _ in example.pieces]
    piece_ids = iter(_tokenize_pieces(texts, tokenizer, wheres))
    bos = tokenizer.bos_token_id
    eos = tokenizer.eos_token_id
    examples = []
    for example in raw:
        ids: list[int] = []
        is_target: list[bool] = []
        for _, target in example.pieces:
            tokens = next(piece_ids)
            ids.extend(tokens)
            is_target.extend([target] * len(tokens))
        # Chat templates usually emit bos themselves; add it only where missing.
        if bos is not None and (not ids or ids[0] != bos):
            ids.insert(0, bos)
            is_target.insert(0, False)
        if eos is not None and (not ids or ids[-1] != eos):
            ids.append(eos)
            is_target.append(example.eos_is_target)
        examples.append(Example(ids, is_target))
    return examples


# ----------------------------------------------------------------------------- held-out split


def split_examples(
    examples: list[Example], fraction: float, seed: int
) -> tuple[list[Example], list[Example]]:
    """(train, held_out): a seeded random `fraction` of whole examples is held out.

    Splitting examples before packing keeps every example on one side (a packed row may cut an
    example in two, a row-level split would leak it). Both sides keep the source order. The
    same seed and data give the same split, so a resumed run evaluates on the same examples.
    """
    n = len(examples)
    n_held = round(fraction * n)
    if n_held < 1 or n_held >= n:
        raise UserError(
            f"--val-split {fraction} of {n} examples leaves "
            + ("no held-out example" if n_held < 1 else "no training example")
            + "; pass a fraction that leaves at least one example on each side, or --eval-data"
        )
    g = torch.Generator()
    g.manual_seed(seed % (1 << 63))
    held = set(torch.randperm(n, generator=g)[:n_held].tolist())
    train = [e for i, e in enumerate(examples) if i not in held]
    return train, [e for i, e in enumerate(examples) if i in held]


def eval_batches(data: PackedData, batch_size: int) -> Iterator[dict[str, torch.Tensor]]:
    """Every row of `data` once, in order, in batches of up to `batch_size` rows."""
    for start in range(0, data.rows, batch_size):
        sl = slice(start, start + batch_size)
        yield {
            "inputs": data.inputs[sl],
            "targets": data.targets[sl],
            "positions": data.positions[sl],
            "doc_ids": data.doc_ids[sl],
        }


# ----------------------------------------------------------------------------- packing


def pack(
    examples: list[Example], seq_len: int, source: str = "the data", keep_tail: bool = False
) -> PackedData:
    """Concatenate `examples` into one token stream and cut it into training rows.

    Row r covers stream tokens [r*L, r*L + L] (L + 1 tokens, L = seq_len): inputs are the first
    L, targets the last L where they are targets of the same document and IGNORE_INDEX
    elsewhere, so consecutive rows share one token and no token is lost. The tail that does not
    fill a row is dropped (training), or with `keep_tail` (evaluation: every held-out target
    counts) padded to a last row with token 0 in a document of its own, never a target; causal
    attention keeps the padding out of every real token's logits. Any row without a single
    target is dropped. `source` names the data in error messages.
    """
    if seq_len < 1:
        raise UserError(f"seq-len must be at least 1, got {seq_len}; pass a positive --seq-len")
    lengths = [len(e.ids) for e in examples]
    n = sum(lengths)
    rows = (n - 1) // seq_len if n > 0 else 0
    pad = 0
    if keep_tail and n > 1 and (n - 1) % seq_len:
        rows += 1
        pad = rows * seq_len + 1 - n
    if rows == 0:
        raise UserError(
            f"{source} has {n} tokens; seq-len {seq_len} needs at least "
            f"{2 if keep_tail else seq_len + 1}; "
            "lower --seq-len or add data"
        )
    # array.fromlist then frombuffer: several times faster than torch.tensor on a long list.
    ids_buffer, target_buffer = array("q"), array("b")
    for e in examples:
        ids_buffer.fromlist(e.ids)
        target_buffer.fromlist(e.is_target)
    ids_buffer.fromlist([0] * pad)
    target_buffer.fromlist([0] * pad)
    stream = torch.frombuffer(ids_buffer, dtype=torch.int64).clone()  # [n + pad]
    stream_is_target = torch.frombuffer(target_buffer, dtype=torch.int8).bool()  # [n + pad]
    # Document index of every stream token (the padding is a document of its own): [n + pad]
    stream_doc = torch.repeat_interleave(
        torch.arange(len(examples) + 1), torch.tensor([*lengths, pad], dtype=torch.long)
    )
    end = rows * seq_len
    inputs = stream[:end].view(rows, seq_len)
    next_ids = stream[1 : end + 1].view(rows, seq_len)
    next_is_target = stream_is_target[1 : end + 1].view(rows, seq_len)
    # A token never predicts the first token of the next document: trained one by one, no
    # example has that target, and with document masking nothing of the next document is
    # visible. (With a bos token that first token is bos, which is no target anyway.)
    same_doc = (stream_doc[1 : end + 1] == stream_doc[:end]).view(rows, seq_len)
    targets = torch.where(next_is_target & same_doc, next_ids, IGNORE_INDEX)

    doc = stream_doc[:end].view(rows, seq_len)  # [rows, L], global document index
    doc_ids = (doc - doc[:, :1]).to(torch.int32)  # documents are contiguous, so 0, 1, 2 ...
    # positions: distance to the latest document start (or row start) at or before each column.
    col = torch.arange(seq_len).expand(rows, seq_len)
    starts = torch.ones(rows, seq_len, dtype=torch.bool)
    starts[:, 1:] = doc[:, 1:] != doc[:, :-1]
    last_start = torch.where(starts, col, 0).cummax(dim=1).values
    positions = col - last_start

    keep = (targets != IGNORE_INDEX).any(dim=1)
    if not keep.any():
        raise UserError(
            f"{source}: no row has a token to predict (every target is masked); check that "
            "completions and assistant replies are not empty"
        )
    return PackedData(
        inputs=inputs[keep].contiguous(),
        targets=targets[keep].contiguous(),
        positions=positions[keep].contiguous(),
        doc_ids=doc_ids[keep].contiguous(),
    )


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
        rows = self.data.rows
        picked = []
        need = self.batch_size
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
        idx = torch.cat(picked)
        return {
            "inputs": self.data.inputs[idx],
            "targets": self.data.targets[idx],
            "positions": self.data.positions[idx],
            "doc_ids": self.data.doc_ids[idx],
        }

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


def count_targets(batch: dict[str, torch.Tensor]) -> int:
    """Number of target tokens in a batch (what the loss averages over)."""
    return int((batch["targets"] != IGNORE_INDEX).sum())
