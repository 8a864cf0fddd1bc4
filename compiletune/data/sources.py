"""Reading `--data`: where the rows come from (containers) and what they hold (layouts).

Containers (`--data SOURCE`):

- `pydocs`: the embedded corpus of standard-library docstrings (`compiletune.data.corpus`).
- `FILE.txt`: plain text; documents are separated by two or more consecutive empty lines.
- `FILE.jsonl`: one JSON object per line (empty lines skipped); messages name `FILE:LINE`.
- `FILE.json`: a JSON array of objects, or an object holding one such array (JSON lines, as
  `datasets`' `to_json` writes under a `.json` name, are read like `.jsonl`).
- `FILE.parquet`, `FILE.arrow` (Arrow IPC file or stream, what `datasets` writes), `FILE.csv`
  (header row; every cell is read as text): read with pyarrow, batch by batch.
- A folder or a glob of shards of one kind, in sorted order. Shards named after a split
  (`train-00000-of-00004.parquet`, `test.jsonl`, `train/...`) are filtered by `--data-split`.
- A folder written by `datasets`' `save_to_disk`: a Dataset (`state.json` + `data-*.arrow`) or
  a DatasetDict (`dataset_dict.json` + one folder per split; `--data-split`, default train).
- `NAME` or `OWNER/NAME` of a dataset in the local Hugging Face hub cache, read offline from its
  snapshot folder like a folder of shards (nothing is downloaded).

Rows of table-like files name `FILE:row N` in messages (row 1 is the first).

Layouts (`--data-format`, `auto` detects them from the first row; every row must then have the
same layout):

- `text`: `{"text"}`, every token a target.
- `prompt-completion`: `{"prompt", "completion"}`, the completion (and the closing eos) only.
- `messages`: `{"messages": [{"role", "content"}, ...]}` (OpenAI), rendered with the chat template;
  the assistant replies (with the end-of-turn text the template puts after them) only.
- `sharegpt`: `{"conversations": [{"from", "value"}, ...]}`, mapped to messages (human/user ->
  user; gpt/assistant/chatgpt/model -> assistant; system; tool/function -> tool).
- `alpaca`: `{"instruction", "input" (optional), "output"}`: with a chat template, a user message
  "instruction\\n\\ninput" and the assistant reply "output"; without one, prompt-completion with
  the prompt "### Instruction:\\n...\\n\\n### Input:\\n...\\n\\n### Response:\\n".

`--data-columns FIELD=COL,...` reads a layout's field from another column (`prompt=question`,
`messages=dialog`, and inside messages `role=from,content=text`).

Chat templates that rewrite earlier turns (e.g. drop the reasoning of past assistant turns) do not
render a conversation as an extension of its prefixes; such a conversation becomes one example per
assistant turn: the conversation before the turn rendered with the generation prompt (context),
then the rest of the conversation through the turn (target).
"""

from __future__ import annotations

import glob as globlib
import hashlib
import json
import os
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from compiletune.data.corpus import pydoc_corpus
from compiletune.errors import UserError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

# A piece of an example: text and whether its tokens are targets.
Piece = tuple[str, bool]

LAYOUTS = ("text", "prompt-completion", "messages", "sharegpt", "alpaca")
FILE_KINDS = (".jsonl", ".json", ".parquet", ".arrow", ".csv", ".txt")
# The fields --data-columns can map, per layout (the inner fields of a message after a dot-less
# name: role/content for messages, from/value for sharegpt).
FIELDS = {
    "text": ("text",),
    "prompt-completion": ("prompt", "completion"),
    "messages": ("messages", "role", "content"),
    "sharegpt": ("conversations", "from", "value"),
    "alpaca": ("instruction", "input", "output"),
}
_ALL_FIELDS = tuple(dict.fromkeys(f for fields in FIELDS.values() for f in fields))
# Detection order: the first layout whose key column a row has.
_KEY = {
    "messages": ("messages",),
    "sharegpt": ("conversations",),
    "alpaca": ("instruction",),
    "prompt-completion": ("prompt", "completion"),
    "text": ("text",),
}
_SHAREGPT_ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "chatgpt": "assistant",
    "model": "assistant",
    "system": "system",
    "tool": "tool",
    "function": "tool",
}
_HOW = (
    'each row needs "text", "prompt"+"completion", "messages", "conversations" (ShareGPT) or '
    '"instruction"+"output" (alpaca); map other names with --data-columns FIELD=COL,... or '
    "pick the layout with --data-format"
)

# Two or more consecutive empty (or whitespace-only) lines separate documents in a .txt file.
_DOC_GAP = re.compile(r"\n[ \t\r\f\v]*\n(?:[ \t\r\f\v]*\n)+")
_BATCH_ROWS = 1024  # rows converted to Python objects at a time (parquet, arrow, csv)
_SHARD = re.compile(r"^(?P<split>[A-Za-z][\w.]*?)-\d{5}-of-\d{5}$")
_SPLIT_NAMES = {"train", "test", "validation", "valid", "dev", "eval", "val"}
# Files of datasets' own bookkeeping, never rows (hub repositories and save_to_disk folders).
_METADATA = {"dataset_info.json", "dataset_infos.json", "dataset_dict.json", "state.json"}
_REPO_ID = re.compile(r"^[\w.-]+(?:/[\w.-]+)?$")


@dataclass
class RawExample:
    """An example before tokenisation: text pieces in order, and what closes it."""

    pieces: list[Piece]
    eos_is_target: bool  # whether an eos appended at the end is a target
    where: str = ""  # FILE:LINE, FILE:row N (or the source), for messages


# ----------------------------------------------------------------------------- text helpers


def read_text_file(path: Path) -> str:
    """The UTF-8 text of `path` (a byte-order mark dropped); a UserError naming the line of the
    first byte that is not UTF-8."""
    try:
        data = path.read_bytes()
    except OSError as e:
        raise UserError(f"{path}: cannot be read ({e.strerror or e}); check the path") from e
    return _decode(data, str(path), line_offset=0)


def _decode(data: bytes, path: str, line_offset: int) -> str:
    try:
        # utf-8-sig: a byte-order mark (Windows editors) would otherwise break line 1's JSON.
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        line = line_offset + data.count(b"\n", 0, e.start) + 1
        raise UserError(
            f"{path}:{line}: not valid UTF-8 (byte {data[e.start]:#04x} at offset {e.start}); "
            "save the file as UTF-8"
        ) from e


def check_utf8(text: str, where: str, what: str) -> str:
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


def split_documents(text: str) -> list[str]:
    """The documents of a .txt file: separated by two or more empty lines."""
    docs = (doc.strip("\n") for doc in _DOC_GAP.split(text))
    return [doc for doc in docs if doc.strip()]


# ----------------------------------------------------------------------------- containers


def _pyarrow(path: Path):
    try:
        import pyarrow
    except ImportError as e:
        raise UserError(
            f"{path}: reading {path.suffix or 'this'} data needs pyarrow, which is not "
            "installed; pip install 'compiletune[data]'"
        ) from e
    return pyarrow


def _arrow_error(path: Path, e: Exception) -> UserError:
    why = " ".join(str(e).split())[:300] or type(e).__name__
    return UserError(f"{path}: cannot be read as {path.suffix[1:]} ({why}); check the file")


def _batches_rows(path: Path, batches: Iterable) -> Iterator[tuple[dict, str]]:
    row = 0
    try:
        for batch in batches:
            for record in batch.to_pylist():
                row += 1
                yield record, f"{path}:row {row}"
    except UserError:
        raise
    except Exception as e:  # pyarrow errors (ArrowInvalid, OSError) met while reading a batch
        if type(e).__module__.startswith("pyarrow") or isinstance(e, OSError):
            raise _arrow_error(path, e) from e
        raise


def _read_parquet(path: Path) -> Iterator[tuple[dict, str]]:
    _pyarrow(path)
    import pyarrow.parquet as pq

    try:
        file = pq.ParquetFile(path)
    except Exception as e:
        raise _arrow_error(path, e) from e
    yield from _batches_rows(path, file.iter_batches(batch_size=_BATCH_ROWS))


def _read_arrow(path: Path) -> Iterator[tuple[dict, str]]:
    pa = _pyarrow(path)
    import pyarrow.ipc as ipc

    try:
        source = pa.memory_map(str(path), "r")
    except Exception as e:
        raise _arrow_error(path, e) from e
    with source:
        try:
            reader = ipc.open_file(source)
            batches: Iterable = (reader.get_batch(i) for i in range(reader.num_record_batches))
        except pa.ArrowInvalid:  # not the file format: the stream format (what datasets writes)
            source.seek(0)
            try:
                batches = ipc.open_stream(source)
            except Exception as e:
                raise _arrow_error(path, e) from e
        yield from _batches_rows(path, batches)


def _read_csv(path: Path) -> Iterator[tuple[dict, str]]:
    """The rows of a CSV file, parsed strictly: a header of distinct names, every row with as
    many fields as it, UTF-8 text; a value may span lines inside quotes. A bad row is a
    UserError naming its line (pyarrow's own errors name none)."""
    pa = _pyarrow(path)
    import pyarrow.csv as pacsv

    parse = pacsv.ParseOptions(newlines_in_values=True)
    try:
        # The header first, so that every column is read as text: a column of numbers is still
        # text to train on, and a type guessed from the first block cannot fail on a later one.
        names = pacsv.open_csv(path, parse_options=parse).schema.names
        _check_header(path, names)
        reader = pacsv.open_csv(
            path,
            parse_options=parse,
            convert_options=pacsv.ConvertOptions(column_types={n: pa.string() for n in names}),
        )
        yield from _batches_rows(path, reader)
    except UserError:
        raise
    except Exception as e:
        if "Empty CSV file" in str(e):
            raise UserError(f"{path} is empty; add a header row and data, or remove it") from e
        if type(e).__module__.startswith("pyarrow"):
            raise _csv_error(path, e) from e
        raise


def _check_header(path: Path, names: list[str]) -> None:
    blank = [i + 1 for i, n in enumerate(names) if not n.strip()]
    if blank:
        raise UserError(f"{path}:1: header column {blank[0]} has no name; name every column")
    seen: set[str] = set()
    for n in names:
        if n in seen:
            raise UserError(
                f"{path}:1: the header names column {n!r} twice, so one of them would be "
                "ignored; give each column its own name"
            )
        seen.add(n)


def _csv_error(path: Path, e: Exception) -> UserError:
    """pyarrow's error about `path` as one line naming the file's line where it can be found:
    the first line that is not UTF-8, or the first record whose field count is not the
    header's (found with Python's csv module, which counts physical lines)."""
    import csv

    why = " ".join(str(e).split())[:200]
    if "UTF8" in why or "UTF-8" in why:
        offset = 0
        with path.open("rb") as fh:
            for lineno, raw in enumerate(fh, start=1):
                try:
                    raw.decode("utf-8")
                except UnicodeDecodeError as bad:
                    return UserError(
                        f"{path}:{lineno}: not valid UTF-8 (byte 0x{raw[bad.start]:02x} at "
                        f"offset {offset + bad.start}); save the file as UTF-8"
                    )
                offset += len(raw)
    with path.open(newline="", encoding="utf-8-sig", errors="replace") as fh:
        reader = csv.reader(fh)
        try:
            width = len(next(reader))
            for record in reader:
                if record and len(record) != width:
                    return UserError(
                        f"{path}:{reader.line_num}: {len(record)} field{'s' if len(record) != 1 else ''} where the header has "
                        f"{width}; quote a value that holds a comma or a quote "
                        '("a, b"; "say ""hi""")'
                    )
        except csv.Error as bad:
            return UserError(f"{path}:{reader.line_num}: {bad}; fix the quoting of this row")
    return _arrow_error(path, e)


def _read_jsonl(path: Path) -> Iterator[tuple[dict, str]]:
    try:
        file = path.open("rb")
    except OSError as e:
        raise UserError(f"{path}: cannot be read ({e.strerror or e}); check the path") from e
    offset = 0  # of the line in the file, for a UTF-8 error
    with file:
        # Binary lines end at b"\n" only: JSON strings may hold a raw U+2028, which is not a
        # line end here; a \r before the \n is JSON whitespace.
        for lineno, raw in enumerate(file, start=1):
            where = f"{path}:{lineno}"
            try:
                # utf-8-sig on line 1: a byte-order mark (Windows editors) would break its JSON.
                line = raw.decode("utf-8-sig" if lineno == 1 else "utf-8")
            except UnicodeDecodeError as e:
                raise UserError(
                    f"{where}: not valid UTF-8 (byte {raw[e.start]:#04x} at offset "
                    f"{offset + e.start}); save the file as UTF-8"
                ) from e
            offset += len(raw)
            if line.strip():
                yield _parse_json_line(line, where), where


def _parse_json_line(line: str, where: str) -> dict:
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
    return obj


def _read_json(path: Path) -> Iterator[tuple[dict, str]]:
    text = read_text_file(path)
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        if e.msg == "Extra data" and text.lstrip().startswith("{"):  # JSON lines in a .json
            yield from _read_jsonl(path)
            return
        raise UserError(
            f"{path}:{e.lineno}: invalid JSON ({e.msg}, column {e.colno}); fix the file"
        ) from e
    except (ValueError, RecursionError) as e:
        why = "nested too deeply" if isinstance(e, RecursionError) else e
        raise UserError(f"{path}: invalid JSON ({why}); fix the file") from e
    if isinstance(data, dict):
        lists = [k for k, v in data.items() if isinstance(v, list)]
        if len(lists) != 1:
            found = ", ".join(lists) or "none"
            raise UserError(
                f"{path}: a JSON object must hold exactly one list of rows (lists found: "
                f"{found}); write the rows as a top-level array or one object per line (.jsonl)"
            )
        data = data[lists[0]]
    if not isinstance(data, list):
        raise UserError(
            f"{path}: expected a JSON array of objects, got {type(data).__name__}; write the "
            "rows as an array or one object per line (.jsonl)"
        )
    for row, obj in enumerate(data, start=1):
        where = f"{path}:row {row}"
        if not isinstance(obj, dict):
            raise UserError(
                f"{where}: expected a JSON object, got {type(obj).__name__}; make every row an "
                "object"
            )
        yield obj, where


_READERS = {
    ".jsonl": _read_jsonl,
    ".json": _read_json,
    ".parquet": _read_parquet,
    ".arrow": _read_arrow,
    ".csv": _read_csv,
}


@dataclass
class _Files:
    """What a source resolves to: data files of one kind, in reading order."""

    files: list[Path]
    kind: str  # one of FILE_KINDS


def _kind_of(path: Path) -> str | None:
    suffix = path.suffix.lower()
    return suffix if suffix in FILE_KINDS and path.name not in _METADATA else None


def _split_of(path: Path, root: Path) -> str | None:
    """The split a shard belongs to by its name (`train-00000-of-00002.parquet`, `test.jsonl`,
    `validation/...`), or None."""
    match = _SHARD.match(path.stem)
    if match:
        return match["split"]
    if path.stem.lower() in _SPLIT_NAMES:
        return path.stem
    for part in path.relative_to(root).parts[:-1]:
        if part.lower() in _SPLIT_NAMES:
            return part
    return None


def _one_kind(files: list[Path], source: str) -> _Files:
    kinds = sorted({_kind_of(f) for f in files})
    if len(kinds) != 1:
        raise UserError(
            f"{source} holds data files of several kinds ({', '.join(kinds)}); keep shards of "
            "one kind together, or pass one file or a glob like DIR/*.parquet"
        )
    return _Files(files, kinds[0])  # type: ignore[arg-type]


def _pick_split(files: list[Path], root: Path, source: str, split: str | None) -> list[Path]:
    splits = {f: _split_of(f, root) for f in files}
    named = sorted({s for s in splits.values() if s is not None})
    if not named:
        if split is not None:
            raise UserError(
                f"--data-split {split}: {source} has no splits (its files are not named after "
                "one); drop --data-split"
            )
        return files
    want = split or "train"
    picked = [f for f in files if splits[f] == want]
    if not picked:
        raise UserError(
            f"{source} has no split {want!r} (splits: {', '.join(named)}); pass --data-split "
            "with one of them"
        )
    return picked


def _save_to_disk_files(folder: Path, split: str | None, source: str) -> list[Path] | None:
    """The arrow files of a `save_to_disk` folder (the chosen split of a DatasetDict), or None
    when `folder` is not one."""
    if (folder / "dataset_dict.json").is_file():
        try:
            splits = json.loads(read_text_file(folder / "dataset_dict.json"))["splits"]
        except (ValueError, KeyError, TypeError) as e:
            raise UserError(
                f'{folder / "dataset_dict.json"}: not a DatasetDict index (no "splits" list); '
                "save the dataset again with save_to_disk"
            ) from e
        want = split or "train"
        if want not in splits:
            raise UserError(
                f"{source} has no split {want!r} (splits: {', '.join(splits)}); pass "
                "--data-split with one of them"
            )
        files = _save_to_disk_files(folder / want, None, f"{source} split {want}")
        if files is None:
            raise UserError(
                f"{folder / want}: the split's folder has no state.json; save the dataset again "
                "with save_to_disk"
            )
        return files
    if not (folder / "state.json").is_file():
        return None
    if split is not None and source == str(folder):
        raise UserError(
            f"--data-split {split}: {source} is one Dataset, not a DatasetDict; drop --data-split"
        )
    try:
        state = json.loads(read_text_file(folder / "state.json"))
        names = [entry["filename"] for entry in state["_data_files"]]
    except (ValueError, KeyError, TypeError):
        names = None
    if names is None:  # an older or different state.json: the data-*.arrow files
        names = sorted(p.name for p in folder.glob("data-*.arrow"))
    files = [folder / name for name in names]
    for f in files:
        if not f.is_file():
            raise UserError(f"{f}: listed in state.json but missing; save the dataset again")
    return files


def _folder_files(folder: Path, source: str, split: str | None) -> _Files:
    saved = _save_to_disk_files(folder, split, source)
    if saved is not None:
        if not saved:
            raise UserError(f"{source} has no data files (no data-*.arrow); save it again")
        return _Files(saved, ".arrow")
    files = sorted(
        p
        for p in folder.rglob("*")
        if p.is_file()
        and _kind_of(p)
        and not any(part.startswith(".") for part in p.relative_to(folder).parts)
    )
    if not files:
        raise UserError(
            f"{source} is a folder without data files ({', '.join(FILE_KINDS)}); pass a folder "
            "of shards, a save_to_disk folder or a file"
        )
    return _one_kind(_pick_split(files, folder, source, split), source)


def _hf_cache_folder(name: str) -> Path:
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import LocalEntryNotFoundError
    except ImportError as e:  # transformers depends on it; only a broken install lacks it
        raise UserError(
            f"{name}: reading a dataset from the Hugging Face cache needs huggingface_hub; "
            "pip install huggingface_hub"
        ) from e
    try:
        return Path(snapshot_download(name, repo_type="dataset", local_files_only=True))
    except LocalEntryNotFoundError as e:
        raise UserError(
            f"{name} is not a path, and not a dataset in the local Hugging Face cache; download "
            f"it first (hf download {name} --repo-type dataset) or pass a file or folder"
        ) from e
    except Exception as e:  # an invalid repo id and the like
        why = " ".join(str(e).split())[:200]
        raise UserError(
            f"data source {name} does not exist ({why}); pass --data pydocs, a file, a folder, "
            "a glob or a dataset name in the local Hugging Face cache"
        ) from e


def _resolve(source: str, split: str | None) -> _Files:
    """The files `source` reads (not pydocs)."""
    path = Path(source)
    if path.is_dir():
        return _folder_files(path, source, split)
    if path.exists():
        kind = _kind_of(path)
        if kind is None:
            raise UserError(
                f"{source}: unsupported data file type {path.suffix or '(no extension)'}; use "
                f"{', '.join(FILE_KINDS)}, a folder of them, or pydocs"
            )
        if split is not None:
            raise UserError(f"--data-split {split}: {source} is one file; drop --data-split")
        return _Files([path], kind)
    if any(c in source for c in "*?["):
        matches = sorted(Path(p) for p in globlib.glob(source, recursive=True))
        files = [p for p in matches if p.is_file() and _kind_of(p)]
        if not files:
            raise UserError(
                f"{source} matches no data file ({', '.join(FILE_KINDS)}); check the pattern"
            )
        if split is not None:
            root = Path(os.path.commonpath([f.parent for f in files]))
            files = _pick_split(files, root, source, split)
        return _one_kind(files, source)
    if _REPO_ID.match(source) and _kind_of(path) is None:
        return _folder_files(_hf_cache_folder(source), source, split)
    raise UserError(
        f"data source {source} does not exist; pass --data pydocs, a file, a folder, a glob "
        "or a dataset name in the local Hugging Face cache"
    )


def source_files(source: str, split: str | None = None) -> list[Path]:
    """The data files `source` reads, in reading order (empty for pydocs)."""
    if source == "pydocs":
        return []
    return _resolve(source, split).files


def fingerprint(source: str, split: str | None = None) -> str:
    """A hex digest of the data's content: the bytes of every file `source` reads, in order
    (for pydocs, its docstrings). Any change to the data changes it; renaming files does not."""
    h = hashlib.sha256()
    if source == "pydocs":
        h.update(b"pydocs\0")
        for doc in pydoc_corpus():
            data = doc.encode("utf-8", "surrogatepass")
            h.update(len(data).to_bytes(8, "little"))
            h.update(data)
        return h.hexdigest()
    for path in source_files(source, split):
        try:
            with path.open("rb") as f:
                h.update(path.suffix.lower().encode() + b"\0")
                h.update(path.stat().st_size.to_bytes(8, "little"))
                while chunk := f.read(1 << 20):
                    h.update(chunk)
        except OSError as e:
            raise UserError(f"{path}: cannot be read ({e.strerror or e}); check the path") from e
    return h.hexdigest()


def iter_records(source: str, split: str | None = None) -> Iterator[tuple[dict, str]]:
    """`(row, where)` for every row of a table-like source (not pydocs, not .txt)."""
    found = _resolve(source, split)
    if found.kind == ".txt":
        raise UserError(f"{source}: .txt files hold documents, not rows")
    for path in found.files:
        yield from _READERS[found.kind](path)


# ----------------------------------------------------------------------------- layouts


def parse_columns(spec: str | None) -> dict[str, str]:
    """`--data-columns FIELD=COL,...` as {field: column}."""
    if not spec:
        return {}
    mapping: dict[str, str] = {}
    for item in spec.split(","):
        field, eq, column = (s.strip() for s in item.partition("="))
        if not eq or not field or not column:
            raise UserError(
                f"--data-columns: {item.strip()!r} is not FIELD=COLUMN; write e.g. "
                "prompt=question,completion=answer"
            )
        if field not in _ALL_FIELDS:
            raise UserError(
                f"--data-columns: unknown field {field!r}; fields: {', '.join(_ALL_FIELDS)}"
            )
        if field in mapping:
            raise UserError(f"--data-columns: {field} is mapped twice; map it once")
        mapping[field] = column
    return mapping


# Roles every chat template renders; any other role must be named in the template's source
# (Qwen's "tool", Llama 3.1's "ipython", gpt-oss's "developer") or mapped with --data-roles.
_TEMPLATE_ROLES = ("system", "user", "assistant")
ROLE_TARGETS = ("system", "user", "assistant", "tool")


def parse_roles(spec: str | None) -> dict[str, str]:
    """`--data-roles FROM=TO,...` as {from: to}; TO one of ROLE_TARGETS."""
    if not spec:
        return {}
    mapping: dict[str, str] = {}
    for item in spec.split(","):
        src, eq, dst = (s.strip() for s in item.partition("="))
        if not eq or not src or not dst:
            raise UserError(
                f"--data-roles: {item.strip()!r} is not FROM=TO; write e.g. human=user,bot=assistant"
            )
        if dst not in ROLE_TARGETS:
            raise UserError(
                f"--data-roles: {src}={dst}: the role must become one of {', '.join(ROLE_TARGETS)}"
            )
        if src in mapping:
            raise UserError(f"--data-roles: {src} is mapped twice; map it once")
        mapping[src] = dst
    return mapping


def check_roles(
    messages: list[dict], tokenizer: Any, roles: dict[str, str], where: str, list_col: str
) -> list[dict]:
    """`messages` with their roles mapped by `roles` (--data-roles), each role one the chat
    template renders: system, user and assistant always; another only where the template's
    source names it. A template that ignores a role it does not know (Qwen's drops the
    message) would otherwise train without that text and without a word."""
    template = getattr(tokenizer, "chat_template", None) or ""
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m.get("role"), str):
            raise UserError(f'{where}: {list_col}[{i}] has no "role" string; fix the row')
        role = roles.get(m["role"], m["role"])
        named = f"'{role}'" in template or f'"{role}"' in template
        if role not in _TEMPLATE_ROLES and not named:
            raise UserError(
                f"{where}: {list_col}[{i}] has role {role!r}, which the tokenizer's chat "
                "template does not name, so it may drop or misplace that text; map it with "
                f"--data-roles {role}=user (or system, assistant, tool)"
            )
        out.append(m if role == m["role"] else {**m, "role": role})
    return out


def _detect(row: dict, col: dict[str, str]) -> str | None:
    """The layout of `row`: the first whose key column it has with a value (parquet, arrow
    and csv give every row every column, null where a row has none), else merely has."""
    for present in (lambda k: row.get(k) is not None, lambda k: k in row):
        for layout, keys in _KEY.items():
            if any(present(col.get(k, k)) for k in keys):
                return layout
    return None


def _found(row: dict) -> str:
    return ", ".join(sorted(map(str, row))) or "none"


def _get_str(row: dict, field: str, col: dict[str, str], where: str, optional=False) -> str:
    name = col.get(field, field)
    value = row.get(name)
    if value is None and optional:
        return ""
    if not isinstance(value, str):
        got = "missing" if name not in row else f"a {type(value).__name__}"
        raise UserError(f'{where}: "{name}" must be a string, got {got}; fix the row')
    return check_utf8(value, where, f'"{name}"')


def _messages(
    row: dict, layout: str, col: dict[str, str], where: str, roles: dict[str, str]
) -> list[dict]:
    """The row's conversation as [{"role", "content", ...}], checked; roles mapped by `roles`
    (--data-roles) first."""
    if layout == "messages":
        list_key, role_key, content_key = "messages", "role", "content"
    else:
        list_key, role_key, content_key = "conversations", "from", "value"
    list_col = col.get(list_key, list_key)
    role_col, content_col = col.get(role_key, role_key), col.get(content_key, content_key)
    messages = row[list_col]
    shape = f'"{list_col}" must be a list of {{"{role_col}": str, "{content_col}": str}} objects'
    if not isinstance(messages, list):
        raise UserError(f"{where}: {shape}, got {type(messages).__name__}; fix the row")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise UserError(
                f"{where}: {shape}; {list_col}[{i}] is a {type(m).__name__}; fix the row"
            )
        for key in (role_col, content_col):
            if not isinstance(m.get(key), str):
                got = "missing" if m.get(key) is None else f"a {type(m[key]).__name__}"
                hint = ""
                if m.get(key) is None:
                    hint = f" (keys: {_found(m)}; map them with --data-columns"
                    hint += f" {role_key}=...,{content_key}=...)"
                raise UserError(
                    f'{where}: {shape}; {list_col}[{i}]["{key}"] is {got}{hint}; fix the row'
                )
            check_utf8(m[key], where, f'{list_col}[{i}]["{key}"]')
        role = roles.get(m[role_col], m[role_col])
        if layout == "sharegpt":
            if role.lower() not in _SHAREGPT_ROLES:
                raise UserError(
                    f'{where}: {list_col}[{i}]["{role_col}"] is {role!r}; ShareGPT roles are '
                    f"{', '.join(_SHAREGPT_ROLES)}; map others with --data-roles {role}=user "
                    "(or system, assistant, tool)"
                )
            role = _SHAREGPT_ROLES[role.lower()]
        # Other keys (name, tool_calls, ...) go to the template; a null is a column this row
        # does not use (parquet and arrow give every row every struct field).
        extra = {
            k: v
            for k, v in m.items()
            if k not in (role_col, content_col, "role", "content") and v is not None
        }
        out.append({"role": role, "content": m[content_col], **extra})
    if not out:
        raise UserError(f'{where}: "{list_col}" is empty; add the conversation or remove the row')
    # The reply's prompt is rendered from the messages before it, and templates (and
    # transformers 5) refuse an empty conversation.
    if out[0]["role"] == "assistant":
        raise UserError(
            f"{where}: the conversation starts with an assistant message; put the user (or "
            "system) message it answers before it"
        )
    # A conversation with no assistant reply (or only empty ones) has nothing to learn: it is
    # kept as an example without a target, which packing counts and leaves out.
    return out


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


def chat_examples(
    tokenizer: PreTrainedTokenizerBase, messages: list[dict], where: str
) -> list[RawExample]:
    """A conversation as examples whose targets are the assistant replies.

    The reply to message i spans from the end of `messages[:i]` rendered with the generation
    prompt to the end of `messages[:i+1]`: whatever the template puts there (content, end of
    turn, eos) is what the model must produce. When the full rendering extends every such
    prefix, this is one example. A template that rewrites earlier turns (a reasoning block
    dropped from past assistant replies) does not; then each assistant turn is an example of
    its own: that context (never a target), then the reply as the template renders it last.
    """
    full = _render_chat(tokenizer, messages, False, where)
    if not any(m["role"] == "assistant" and m["content"].strip() for m in messages):
        # Nothing to learn (no reply, or only empty ones): an example without a target, which
        # packing counts and leaves out.
        return [RawExample([(full, False)], False, where)]
    turns = []  # (before, through) per assistant reply
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = _render_chat(tokenizer, messages[:i], True, where)
        through = _render_chat(tokenizer, messages[: i + 1], False, where)
        if not through.startswith(before):
            raise UserError(
                f"{where}: the tokenizer's chat template renders the conversation through "
                f"message {i} differently from its prompt for that reply, so the reply cannot "
                "be located; use a tokenizer whose template extends the prompt with the reply"
            )
        turns.append((before, through))
    pieces: list[Piece] = []
    done = 0  # characters of `full` already assigned to pieces
    for before, through in turns:
        if not (full.startswith(through) and len(before) >= done):
            break  # the template rewrites earlier turns: one example per reply
        pieces.append((full[done : len(before)], False))
        pieces.append((full[len(before) : len(through)], True))
        done = len(through)
    else:
        pieces.append((full[done:], False))
        last_is_reply = messages[-1]["role"] == "assistant"
        return [RawExample([p for p in pieces if p[0]], last_is_reply, where)]
    return [
        RawExample(
            [p for p in [(before, False), (through[len(before) :], True)] if p[0]], True, where
        )
        for before, through in turns
    ]


def _alpaca_messages(row: dict, col: dict[str, str], where: str) -> list[dict]:
    instruction = _get_str(row, "instruction", col, where)
    extra = _get_str(row, "input", col, where, optional=True)
    output = _get_str(row, "output", col, where)
    user = f"{instruction}\n\n{extra}" if extra else instruction
    return [{"role": "user", "content": user}, {"role": "assistant", "content": output}]


def _needs_template(tokenizer, where: str, layout: str) -> None:
    if getattr(tokenizer, "chat_template", None) is None:
        raise UserError(
            f'{where}: chat "{layout}" rows need a tokenizer with a chat template and this '
            "one has none; pass --tokenizer with a chat template (an instruct model's) "
            'or use "text" / "prompt"+"completion" rows'
        )


def _learned(prompt: str, reply: str, where: str) -> RawExample:
    """A prompt and the reply to learn; a blank reply teaches nothing (not even to stop at
    once), so it is an example without a target, which packing counts and leaves out."""
    if not reply.strip():
        return RawExample([p for p in [(prompt, False)] if p[0]], False, where)
    return RawExample([p for p in [(prompt, False), (reply, True)] if p[0]], True, where)


def row_examples(
    row: dict,
    layout: str,
    tokenizer: PreTrainedTokenizerBase,
    col: dict[str, str],
    where: str,
    roles: dict[str, str] | None = None,
) -> list[RawExample]:
    """The examples of one row in `layout` (checked; a UserError naming `where`); chat roles
    mapped by `roles` (--data-roles)."""
    if layout == "text":
        return [_learned("", _get_str(row, "text", col, where), where)]
    if layout == "prompt-completion":
        p, c = col.get("prompt", "prompt"), col.get("completion", "completion")
        if p not in row or c not in row:
            missing = c if p in row else p
            raise UserError(f'{where}: "{missing}" is missing; give both prompt and completion')
        prompt = _get_str(row, "prompt", col, where)
        return [_learned(prompt, _get_str(row, "completion", col, where), where)]
    if layout == "alpaca":
        messages = _alpaca_messages(row, col, where)
        if getattr(tokenizer, "chat_template", None) is not None:
            return chat_examples(tokenizer, messages, where)
        instruction, _, extra = messages[0]["content"].partition("\n\n")
        prompt = f"### Instruction:\n{instruction}\n\n"
        if extra:
            prompt += f"### Input:\n{extra}\n\n"
        prompt += "### Response:\n"
        return [_learned(prompt, messages[1]["content"], where)]
    # messages, sharegpt
    _needs_template(tokenizer, where, layout)
    messages = _messages(row, layout, col, where, roles or {})
    list_col = col.get(_KEY[layout][0], _KEY[layout][0])
    return chat_examples(tokenizer, check_roles(messages, tokenizer, {}, where, list_col), where)


class _Layouts:
    """The layout of a source's rows: forced, or detected from the first row and then the
    same on every row."""

    def __init__(self, fmt: str, col: dict[str, str]):
        if fmt != "auto" and fmt not in LAYOUTS:
            raise UserError(
                f"--data-format {fmt!r} is not a layout; use auto, {', '.join(LAYOUTS)}"
            )
        unused = [f for f in col if fmt != "auto" and f not in FIELDS[fmt]]
        if unused:
            raise UserError(
                f"--data-columns maps {', '.join(unused)}, which --data-format {fmt} does not "
                f"read (its fields: {', '.join(FIELDS[fmt])}); drop them"
            )
        self.forced = fmt != "auto"
        self.layout: str | None = None if fmt == "auto" else fmt
        self.first_where = ""
        self.col = col

    def of(self, row: dict, where: str) -> str:
        detected = _detect(row, self.col)
        if self.layout is None:
            if detected is None:
                raise UserError(f"{where}: no known key (found: {_found(row)}); {_HOW}")
            self.layout, self.first_where = detected, where
            return detected
        keys = [self.col.get(k, k) for k in _KEY[self.layout]]
        if self.forced:
            if not any(k in row for k in keys):
                need = " or ".join(f'"{k}"' for k in keys)
                field = _KEY[self.layout][0]
                raise UserError(
                    f"{where}: no {need} column for --data-format {self.layout} (found: "
                    f"{_found(row)}); map one with --data-columns {field}=COLUMN"
                )
            return self.layout
        if detected == self.layout:
            return detected
        if detected is None:
            raise UserError(
                f"{where}: no known key (found: {_found(row)}); the rows before are "
                f"{self.layout} rows (from {self.first_where}); {_HOW}"
            )
        raise UserError(
            f"{where}: a {detected} row, but the rows before are {self.layout} rows (from "
            f"{self.first_where}); one source holds one layout: make the rows alike or split "
            "the data into separate sources"
        )


def read_examples(
    source: str,
    tokenizer: PreTrainedTokenizerBase,
    fmt: str = "auto",
    columns: str | None = None,
    split: str | None = None,
    roles: str | None = None,
) -> Iterator[RawExample]:
    """The examples of `source`, lazily, in order (chat roles mapped by `roles`,
    --data-roles). A source with none is a UserError."""
    col = parse_columns(columns)
    role_map = parse_roles(roles)
    layouts = _Layouts(fmt, col)
    count = 0
    if source == "pydocs":
        docs = pydoc_corpus()
        if not docs:
            raise UserError(
                "the pydocs corpus is empty because Python runs with -OO, which strips "
                "docstrings; run without -OO or pass --data FILE"
            )
        for doc in docs:
            yield RawExample([(doc, True)], True, "pydocs")
        return
    found = _resolve(source, split)
    if found.kind == ".txt":
        if layouts.forced and layouts.layout != "text":
            raise UserError(
                f"{source}: .txt files hold text documents; drop --data-format "
                f"{layouts.layout} or pass rows (.jsonl, .parquet, ...)"
            )
        for path in found.files:
            for doc in split_documents(read_text_file(path)):
                count += 1
                yield RawExample([(doc, True)], True, str(path))
    else:
        for path in found.files:
            for row, where in _READERS[found.kind](path):
                count += 1
                layout = layouts.of(row, where)
                yield from row_examples(row, layout, tokenizer, col, where, role_map)
    if count == 0:
        what = f"split {split!r} of {source}" if split else source
        raise UserError(f"{what} has no examples; add data to it or pick another --data")


def parse_sources(spec: str) -> list[tuple[str, float]]:
    """`--data`: one source, or a mixture `SRC:W,SRC:W,...` (weights, normalised)."""
    if "," not in spec and (":" not in spec or Path(spec).exists()):
        return [(spec, 1.0)]
    out = []
    for part in spec.split(","):
        source, sep, weight = part.strip().rpartition(":")
        if not sep or not source:
            raise UserError(
                f"--data {spec}: '{part}' has no weight; give every source of a mixture one, "
                "e.g. a.parquet:0.7,b.jsonl:0.3"
            )
        try:
            w = float(weight)
        except ValueError:
            raise UserError(
                f"--data {spec}: the weight '{weight}' of {source} is not a number"
            ) from None
        if not (w > 0 and w < float("inf")):
            raise UserError(f"--data {spec}: the weight of {source} must be positive, got {w}")
        out.append((source, w))
    return out
