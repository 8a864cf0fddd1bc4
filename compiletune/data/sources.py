"""Reading `--data`: where the rows come from (containers).

Containers (`--data SOURCE`):

- `pydocs`: the embedded corpus of standard-library docstrings (`compiletune.data.corpus`).
- `FILE.txt`: plain text; documents are separated by two or more consecutive empty lines.
- `FILE.jsonl`: one JSON object per line (empty lines skipped); messages name `FILE:LINE`.
- `FILE.json`: a JSON array of objects, or an object holding one such array (JSON lines, as
  `datasets`' `to_json` writes under a `.json` name, are read like `.jsonl`).
- `FILE.parquet`, `FILE.arrow` (Arrow IPC file or stream, what `datasets` writes): read with
  pyarrow, batch by batch. `FILE.csv` (header row; every cell is read as text): read with
  Python's csv module in strict mode, row by row; messages name `FILE:LINE`.
- A folder or a glob of shards of one kind, in sorted order. Shards named after a split
  (`train-00000-of-00004.parquet`, `test.jsonl`, `train/...`) are filtered by `--data-split`.
- A folder written by `datasets`' `save_to_disk`: a Dataset (`state.json` + `data-*.arrow`) or
  a DatasetDict (`dataset_dict.json` + one folder per split; `--data-split`, default train).
- `ORG/NAME[/CONFIG][@REVISION]`: a dataset repository on the Hugging Face Hub. The card's
  `configs:` (README.md), else the folders and shard names, pick the files of one split
  (`--data-split`, default train); only those are downloaded into the HF cache (`hub.py`).

Rows of parquet, arrow and JSON-array files name `FILE:row N` in messages (row 1 is the first).

What the rows hold (the layouts) is read in `compiletune.data.layouts`.
"""

from __future__ import annotations

import csv
import functools
import glob as globlib
import hashlib
import json
import os
import re
import threading
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from compiletune import hub
from compiletune.data.corpus import pydoc_corpus
from compiletune.errors import UserError

FILE_KINDS = (".jsonl", ".json", ".parquet", ".arrow", ".csv", ".txt")

# Two or more consecutive empty (or whitespace-only) lines separate documents in a .txt file.
_DOC_GAP = re.compile(r"\n[ \t\r\f\v]*\n(?:[ \t\r\f\v]*\n)+")
_BATCH_ROWS = 1024  # rows converted to Python objects at a time (parquet, arrow)
_SHARD = re.compile(r"^(?P<split>[A-Za-z][\w.]*?)-\d{5}-of-\d{5}$")
_SPLIT_NAMES = {"train", "test", "validation", "valid", "dev", "eval", "val"}
# Files of datasets' own bookkeeping, never rows (hub repositories and save_to_disk folders).
_METADATA = {"dataset_info.json", "dataset_infos.json", "dataset_dict.json", "state.json"}


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


@functools.lru_cache(maxsize=8)
def _table(path: Path, thread: int) -> Any:
    """A parquet file (read by row group) or an arrow file's table (memory-mapped, so the
    table costs no memory of its own): what `read_cell` reads rows back from. One per `thread`
    (an image run's data worker reads rows beside the main thread's held-out batches), as a
    ParquetFile's reader is not documented safe to share between threads."""
    pa = _pyarrow(path)
    try:
        if path.suffix == ".parquet":
            import pyarrow.parquet as pq

            return pq.ParquetFile(path)
        import pyarrow.ipc as ipc

        source = pa.memory_map(str(path), "r")
        try:
            return ipc.open_file(source).read_all()
        except pa.ArrowInvalid:  # the stream format (what datasets writes)
            source.seek(0)
            return ipc.open_stream(source).read_all()
    except Exception as e:
        raise _arrow_error(path, e) from e


def read_cell(path: Path, row: int, column: str) -> Any:
    """The value of `column` in row `row` (from 1, as messages name rows) of a parquet or arrow
    file: how an image held in a row is read again when a batch needs its pixels."""
    table = _table(path, threading.get_ident())
    if path.suffix != ".parquet":
        return table.column(column)[row - 1].as_py()
    at = row - 1
    for group in range(table.num_row_groups):
        n = table.metadata.row_group(group).num_rows
        if at < n:
            return table.read_row_group(group, columns=[column]).column(0)[at].as_py()
        at -= n
    raise UserError(f"{path}: has no row {row}; the data changed since it was tokenised")


def _read_csv(path: Path) -> Iterator[tuple[dict, str]]:
    """The rows of a CSV file (`FILE:LINE` of each row's first line), parsed strictly: a header
    of distinct names, every row with as many fields as it, UTF-8 text; a value may span lines
    inside quotes. A bad row is a UserError naming its line.

    Python's csv module in strict mode reads it (not pyarrow, which has no strict mode): a quote
    left open merges the rows after it into one value, and strict parsing is what notices,
    where the stray quote's value closes with text after it or runs to the end of the file."""
    limit = csv.field_size_limit()
    csv.field_size_limit(2**31 - 1)  # a long document is one value (the default is 128 KiB)
    try:
        with path.open(newline="", encoding="utf-8-sig") as fh:
            reader = csv.reader(fh, strict=True)
            yield from _csv_records(path, reader)
    except UnicodeDecodeError as e:
        raise _utf8_error(path) from e
    except OSError as e:
        raise UserError(f"{path}: cannot be read ({e.strerror or e}); check the path") from e
    finally:
        csv.field_size_limit(limit)


# The fix for a bad CSV row, in every message about one.
_CSV_FIX = 'quote a value that holds a comma or a quote ("a, b"; "say ""hi""")'


def _csv_records(path: Path, reader: Any) -> Iterator[tuple[dict, str]]:
    names, start = None, 1
    try:
        for record in reader:
            if not record:  # an empty line
                start = reader.line_num + 1
                continue
            if names is None:
                names = record
                _check_header(path, names)
            elif len(record) != len(names):
                n = len(record)
                raise UserError(
                    f"{path}:{start}: {n} field{'s' if n != 1 else ''} where the header has "
                    f"{len(names)}; {_CSV_FIX}"
                )
            else:
                yield dict(zip(names, record, strict=True)), f"{path}:{start}"
            start = reader.line_num + 1
    except csv.Error as e:
        raise _quote_error(path, start, reader.line_num, str(e)) from e
    if names is None:
        raise UserError(f"{path} is empty; add a header row and data, or remove it")


def _quote_error(path: Path, start: int, line: int, why: str) -> UserError:
    """A strict-mode csv error of the row that starts on line `start` (met on `line`)."""
    if "unexpected end of data" in why:
        return UserError(
            f"{path}:{start}: a quote opened in this row is never closed (its value runs to "
            f"the end of the file, line {line}); close it; {_CSV_FIX}"
        )
    if "expected after" in why:
        span = f"closes on line {line}" if line != start else "closes"
        return UserError(
            f"{path}:{start}: a quoted value of this row {span} with more text after its "
            f"closing quote (an unbalanced quote merges rows); close each quoted value where "
            f"it ends; {_CSV_FIX}"
        )
    return UserError(f"{path}:{line}: {why}; fix this row")


def _utf8_error(path: Path) -> UserError:
    """The first line of `path` that is not UTF-8, as one line."""
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
    return UserError(f"{path}: not valid UTF-8; save the file as UTF-8")


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


def _card_configs(readme: Path) -> list[dict]:
    """The `configs:` list of a dataset card's YAML header (README.md), or [] without one."""
    text = read_text_file(readme) if readme.is_file() else ""
    if not text.startswith("---"):
        return []
    header = text[3:].split("\n---", 1)[0]
    try:
        card = yaml.safe_load(header)
    except yaml.YAMLError:
        return []
    configs = card.get("configs") if isinstance(card, dict) else None
    return [c for c in configs if isinstance(c, dict)] if isinstance(configs, list) else []


def _card_config(configs: list[dict], ref: hub.HubRef, source: str) -> dict:
    """The card's config that `ref` names (else the one marked default, or named so, or the
    first)."""
    names = [str(c.get("config_name", "default")) for c in configs]
    if ref.config is not None:
        if ref.config not in names:
            raise UserError(
                f"--data {source}: the dataset has no config {ref.config!r} (configs: "
                f"{', '.join(names)}); pass ORG/NAME/CONFIG with one of them"
            )
        return configs[names.index(ref.config)]
    marked = [c for c in configs if c.get("default") is True]
    if marked:
        return marked[0]
    return configs[names.index("default")] if "default" in names else configs[0]


def _split_patterns(config: dict) -> dict[str, list[str]]:
    """split -> file patterns of a card config's `data_files` ({} when it has none)."""
    files = config.get("data_files")
    if all(isinstance(f, str) for f in _as_list(files)):
        return {"train": _as_list(files)} if files else {}
    out: dict[str, list[str]] = {}
    for entry in _as_list(files):
        if isinstance(entry, dict) and "split" in entry and "path" in entry:
            out[str(entry["split"])] = [str(p) for p in _as_list(entry["path"])]
    return out


def _glob(pattern: str) -> re.Pattern:
    """A data_files pattern as the Hub reads it: `*` and `?` within one folder, `**` across."""
    out, i = "", 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out, i = out + "(?:.*/)?", i + 3
        elif pattern.startswith("**", i):
            out, i = out + ".*", i + 2
        elif pattern[i] == "*":
            out, i = out + "[^/]*", i + 1
        elif pattern[i] == "?":
            out, i = out + "[^/]", i + 1
        else:
            out, i = out + re.escape(pattern[i]), i + 1
    return re.compile(out)


def _as_list(value: Any) -> list:
    return value if isinstance(value, list) else [] if value is None else [value]


def _hub_dataset(source: str, split: str | None) -> _Files:
    """A dataset repository on the Hub (`ORG/NAME[/CONFIG][@REVISION]`): its card's configs or
    its folders and shard names pick the files of one split, and only those are downloaded."""
    return _hub_download(source, split)[0]


def is_file_spec(source: str) -> bool:
    """A glob, or a name ending in a data file's extension: a local path, never a Hub id."""
    return any(c in source for c in "*?[") or _kind_of(Path(source)) is not None


def pinned_source(source: str, split: str | None = None) -> str:
    """`source` itself, or for a Hub dataset the spec at the commit its files were read from
    (downloading them now if needed): what config.yaml keeps so `--resume` reads the same."""
    if source == "pydocs" or Path(source).exists() or is_file_spec(source):
        return source
    ref = hub.parse(source, dataset=True)
    if ref is None:
        return source
    return ref.pinned(_hub_download(source, split)[1].name)


def _hub_download(source: str, split: str | None) -> tuple[_Files, Path]:
    ref = hub.parse(source, dataset=True)
    assert ref is not None
    names = hub.dataset_files(ref)
    configs = []
    if "README.md" in names:
        configs = _card_configs(
            hub.download(ref, "dataset", ["README.md"], "--data", quiet=True) / "README.md"
        )
    data = [
        n
        for n in names
        if _kind_of(Path(n)) and not any(part.startswith(".") for part in Path(n).parts)
    ]
    patterns: dict[str, list[str]] = {}
    if configs:
        chosen = _card_config(configs, ref, source)
        patterns = _split_patterns(chosen)
        folder = str(chosen.get("data_dir") or "").strip("/")
        if not patterns and folder:  # a config that names a folder: its shards' names
            data = [n for n in data if n.startswith(f"{folder}/")]
    elif ref.config is not None:
        data = [n for n in data if n.startswith(f"{ref.config}/")]
        if not data:
            folders = sorted({n.split("/")[0] for n in names if "/" in n})
            raise UserError(
                f"--data {source}: the dataset has no config {ref.config!r} (folders: "
                f"{', '.join(folders) or 'none'}); pass ORG/NAME/CONFIG with one of them"
            )
    if patterns:
        want = split or (
            "train" if "train" in patterns or len(patterns) != 1 else next(iter(patterns))
        )
        if want not in patterns:
            raise UserError(
                f"{source} has no split {want!r} (splits: {', '.join(patterns)}); pass "
                "--data-split with one of them"
            )
        globs = [_glob(p) for p in patterns[want]]
        picked = [n for n in data if any(g.fullmatch(n) for g in globs)]
    else:
        picked = [str(p) for p in _pick_split([Path(n) for n in data], Path(), source, split)]
    if not picked:
        raise UserError(
            f"{source} holds no data files ({', '.join(FILE_KINDS)}) for that split; check the "
            "dataset's files on the Hub"
        )
    kind = _one_kind([Path(n) for n in picked], source).kind
    folder = hub.download(ref, "dataset", picked, "--data")
    return _Files([folder / n for n in sorted(picked)], kind), folder


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
    if hub.parse(source, dataset=True) is not None and _kind_of(path) is None:
        return _hub_dataset(source, split)
    raise UserError(
        f"data source {source} does not exist; pass --data pydocs, a file, a folder, a glob "
        "or a Hub dataset ORG/NAME[/CONFIG][@REVISION]"
    )


def check_local_sources(spec: str, split: str | None = None) -> None:
    """Refuse, before anything loads, a `--data` (or `--eval-data`) whose local files are not
    there or not data: each source of the mixture is resolved as training will resolve it,
    except a Hub dataset, which is checked when it downloads."""
    for source, _ in parse_sources(spec):
        hub_id = hub.parse(source, dataset=True) is not None and _kind_of(Path(source)) is None
        if source != "pydocs" and (Path(source).exists() or not hub_id):
            _resolve(source, split)


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


def source_items(source: str, split: str | None = None) -> tuple[bool, Iterator[tuple[Any, str]]]:
    """(is_text, items) of a source other than pydocs: a .txt source's documents as
    `(text, path)`, or a table-like source's rows as `(row, where)`, lazily."""
    found = _resolve(source, split)
    if found.kind == ".txt":
        docs = (
            (doc, str(path))
            for path in found.files
            for doc in split_documents(read_text_file(path))
        )
        return True, docs
    return False, (item for path in found.files for item in _READERS[found.kind](path))


def iter_records(source: str, split: str | None = None) -> Iterator[tuple[dict, str]]:
    """`(row, where)` for every row of a table-like source (not pydocs, not .txt)."""
    found = _resolve(source, split)
    if found.kind == ".txt":
        raise UserError(f"{source}: .txt files hold documents, not rows")
    for path in found.files:
        yield from _READERS[found.kind](path)


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
