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

import json
import re
from array import array
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from tqdm import tqdm

from compiletune.corpus import pydoc_corpus
from compiletune.errors import UserError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

IGNORE_INDEX = -100  # targets value for "not a target", what cross_entropy ignores by default

# Two or more consecutive empty (or whitespace-only) lines separate documents in a .txt file.
_DOC_GAP = re.compile(r"\n[ \t\r\f\v]*\n(?:[ \t\r\f\v]*\n)+")

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


def _read_text_file(path: Path) -> str:
    try:
        data = path.read_bytes()
    except OSError as e:
        raise UserError(f"{path}: cannot be read ({e.strerror or e}); check the path") from e
    try:
        # utf-8-sig: a byte-order mark (Windows editors) would otherwise break line 1's JSON.
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        raise UserError(
            f"{path}:{line}: not valid UTF-8 (byte {data[e.start]:#04x} at offset {e.start}); "
            "save the file as UTF-8"
        ) from e


def _check_utf8(text: str, where: str, what: str) -> str:
    """`text`, which must be encodable as UTF-8 (a JSON escape like \\ud800 gives a lone
    surrogate, which no tokenizer can take)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise UserError(
            f"{where}: {what} holds {text[e.start]!r} (a lone UTF-16 surrogate, from an escape "
            "like \\ud800 without its pair), which is not text; fix the line"
        ) from e
    return text


def _split_documents(text: str) -> list[str]:
    docs = (doc.strip("\n") for doc in _DOC_GAP.split(text))
    return [doc for doc in docs if doc.strip()]


def _render_chat(tokenizer, messages: list[dict], add_generation_prompt: bool, where: str) -> str:
    try:
        return tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt
        )
    except Exception as e:  # jinja errors and the templates' own raise_exception()
        raise UserError(
            f"{where}: the tokenizer's chat template failed on this conversation ({e}); "
            "fix the messages (roles, order) or use a tokenizer whose template accepts them"
        ) from e


def _chat_pieces(tokenizer, messages: list[dict], where: str) -> list[Piece]:
    """Split a rendered conversation into prompt pieces and assistant-reply pieces.

    The reply to message i spans from the end of `messages[:i]` rendered with the generation
    prompt to the end of `messages[:i+1]`: whatever the template puts there (content, end of
    turn, eos) is what the model must produce, and this holds for any template that renders
    conversations prefix by prefix.
    """
    full = _render_chat(tokenizer, messages, False, where)
    pieces: list[Piece] = []
    done = 0  # characters of `full` already assigned to pieces
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = _render_chat(tokenizer, messages[:i], True, where)
        through = _render_chat(tokenizer, messages[: i + 1], False, where)
        if not (full.startswith(through) and through.startswith(before) and len(before) >= done):
            raise UserError(
                f"{where}: the tokenizer's chat template renders a conversation differently "
                "from its prefixes, so the assistant replies cannot be located; use a "
                "tokenizer whose template extends the text turn by turn"
            )
        pieces.append((full[done : len(before)], False))
        pieces.append((full[len(before) : len(through)], True))
        done = len(through)
    pieces.append((full[done:], False))
    return [piece for piece in pieces if piece[0]]


def _check_str(obj: dict, key: str, where: str) -> str:
    value = obj[key]
    if not isinstance(value, str):
        raise UserError(
            f'{where}: "{key}" must be a string, got {type(value).__name__}; fix the line'
        )
    return _check_utf8(value, where, f'"{key}"')


def _check_messages(obj: dict, where: str) -> list[dict]:
    messages = obj["messages"]
    shape = '"messages" must be a list of {"role": str, "content": str} objects'
    if not isinstance(messages, list):
        raise UserError(f"{where}: {shape}, got {type(messages).__name__}; fix the line")
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise UserError(
                f"{where}: {shape}; messages[{i}] is a {type(m).__name__}; fix the line"
            )
        for key in ("role", "content"):
            if not isinstance(m.get(key), str):
                got = "missing" if key not in m else f"a {type(m[key]).__name__}"
                raise UserError(f'{where}: {shape}; messages[{i}]["{key}"] is {got}; fix the line')
            _check_utf8(m[key], where, f'messages[{i}]["{key}"]')
    if not messages:
        raise UserError(f'{where}: "messages" is empty; add the conversation or remove the line')
    # The reply's prompt is rendered from the messages before it, and templates (and
    # transformers 5) refuse an empty conversation.
    if messages[0]["role"] == "assistant":
        raise UserError(
            f"{where}: the conversation starts with an assistant message; put the user (or "
            "system) message it answers before it"
        )
    if not any(m["role"] == "assistant" for m in messages):
        raise UserError(
            f'{where}: the conversation has no "assistant" message, so there is nothing to '
            "learn from it; add the assistant reply or remove the line"
        )
    return messages


def _read_jsonl(path: Path, tokenizer) -> list[_RawExample]:
    examples = []
    text = _read_text_file(path)
    # split("\n"), not splitlines(): JSON strings may hold a raw U+2028, which is not a line end
    # here (read_text already turned \r\n into \n).
    for lineno, line in enumerate(text.split("\n"), start=1):
        if not line.strip():
            continue
        where = f"{path}:{lineno}"
        try:
            obj = json.loads(line)
        except (ValueError, RecursionError) as e:  # JSONDecodeError, too many digits, nesting
            why = "nested too deeply" if isinstance(e, RecursionError) else e
            raise UserError(f"{where}: invalid JSON ({why}); fix the line or remove it") from e
        if not isinstance(obj, dict):
            raise UserError(
                f"{where}: expected a JSON object, got {type(obj).__name__}; write one object "
                'per line with "text", "prompt" and "completion", or "messages"'
            )
        if "messages" in obj:
            if getattr(tokenizer, "chat_template", None) is None:
                raise UserError(
                    f'{where}: chat "messages" need a tokenizer with a chat template and this '
                    "one has none; pass --tokenizer with a chat template (an instruct model's) "
                    'or use "text" / "prompt"+"completion" lines'
                )
            messages = _check_messages(obj, where)
            pieces = _chat_pieces(tokenizer, messages, where)
            last_is_reply = messages[-1]["role"] == "assistant"
            examples.append(_RawExample(pieces, eos_is_target=last_is_reply, where=where))
        elif "prompt" in obj or "completion" in obj:
            if not ("prompt" in obj and "completion" in obj):
                missing = "completion" if "prompt" in obj else "prompt"
                raise UserError(f'{where}: "{missing}" is missing; give both prompt and completion')
            prompt = _check_str(obj, "prompt", where)
            completion = _check_str(obj, "completion", where)
            pieces = [(prompt, False), (completion, True)]
            examples.append(_RawExample(pieces, eos_is_target=True, where=where))
        elif "text" in obj:
            examples.append(_RawExample([(_check_str(obj, "text", where), True)], True, where))
        else:
            found = ", ".join(sorted(obj)) or "none"
            raise UserError(
                f"{where}: no known key (found: {found}); each line needs "
                '"text", or "prompt" and "completion", or "messages"'
            )
    return examples


def _read_source(source: str, tokenizer) -> list[_RawExample]:
    if source == "pydocs":
        docs = pydoc_corpus()
        if not docs:
            raise UserError(
                "the pydocs corpus is empty because Python runs with -OO, which strips "
                "docstrings; run without -OO or pass --data FILE"
            )
        return [_RawExample([(doc, True)], True) for doc in docs]
    path = Path(source)
    if not path.exists():
        raise UserError(
            f"data source {source} does not exist; pass --data pydocs, a .txt file or a .jsonl file"
        )
    if path.is_dir():
        raise UserError(f"{source} is a directory; pass --data with a .txt or .jsonl file")
    suffix = path.suffix.lower()
    if suffix == ".txt":
        docs = _split_documents(_read_text_file(path))
        return [_RawExample([(doc, True)], True, str(path)) for doc in docs]
    if suffix == ".jsonl":
        return _read_jsonl(path, tokenizer)
    raise UserError(
        f"{source}: unsupported data file type {suffix or '(no extension)'}; "
        "use a .txt or .jsonl file, or pydocs"
    )


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
