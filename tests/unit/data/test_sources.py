"""--data sources (containers) and layouts: compiletune/data/sources.py, through load_examples."""

import json
import sys

import pytest

pa = pytest.importorskip("pyarrow")
import pyarrow.csv as pacsv  # noqa: E402
import pyarrow.ipc as ipc  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402

from compiletune.data import rows as data  # noqa: E402
from compiletune.data import sources  # noqa: E402
from compiletune.data.rows import load_examples  # noqa: E402
from compiletune.data.tokenizer import byte_tokenizer  # noqa: E402
from compiletune.errors import UserError  # noqa: E402

BOS, EOS = 256, 257

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# Like Qwen3: the reasoning block of every assistant message but the last is dropped, so a
# conversation does not render as an extension of its prefixes.
REWRITING = (
    "{% for m in messages %}"
    "{% if m['role'] == 'assistant' and not loop.last %}"
    "{% set content = m['content'].split('</think>')[-1].lstrip('\n') %}"
    "{% else %}{% set content = m['content'] %}{% endif %}"
    "<|im_start|>{{ m['role'] }}\n{{ content }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

CONVERSATIONS = [
    [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi?"},
        {"role": "assistant", "content": "Hello 🤗."},
        {"role": "user", "content": "More?"},
        {"role": "assistant", "content": "No."},
    ],
    [{"role": "user", "content": "2+2"}, {"role": "assistant", "content": "4"}],
    [
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "b"},
        {"role": "user", "content": "trailing question"},
    ],
]
ROWS = {
    "text": [{"text": f"document {i}, é🤗\nline two"} for i in range(5)],
    "prompt-completion": [{"prompt": f"Q{i}: 2+{i}=", "completion": f" {2 + i}"} for i in range(5)],
    "messages": [{"messages": c} for c in CONVERSATIONS],
    "sharegpt": [
        {"conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Yo"}]},
        {
            "conversations": [
                {"from": "system", "value": "S"},
                {"from": "user", "value": "U"},
                {"from": "chatgpt", "value": "A"},
            ]
        },
    ],
    "alpaca": [
        {"instruction": "Add", "input": "2 and 2", "output": "4"},
        {"instruction": "Say hi", "input": "", "output": "hi"},
    ],
}
FLAT = ("text", "prompt-completion", "alpaca")  # layouts a csv can hold


@pytest.fixture(scope="module")
def tok():
    return byte_tokenizer()


def rows_of(examples) -> list[tuple[list[int], list[bool]]]:
    return [(e.ids, e.is_target) for e in examples]


def load(source, tok, **options):
    """load_examples' (ids, is_target) rows of `source`; `options` (fmt, columns, split) reach
    sources through data._read_source's keywords, as the CLI's --data-* flags do."""
    if not options:
        return rows_of(load_examples(str(source), tok))
    read = data._read_source
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(data, "_read_source", lambda src, t, **_: read(src, t, **options))
        return rows_of(load_examples(str(source), tok))


# ----------------------------------------------------------------------------- writers


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), "utf-8")
    return path


def write_json(path, rows):
    path.write_text(json.dumps(rows, ensure_ascii=False), encoding="utf-8")
    return path


def table_of(rows):
    """`rows` as a table with every column any row has (null where a row has none)."""
    if not rows:
        return pa.table({"text": pa.array([], pa.string())})
    schema = pa.unify_schemas([pa.Table.from_pylist([r]).schema for r in rows])
    return pa.Table.from_pylist(rows, schema=schema)


def write_parquet(path, rows, row_group_size=None):
    pq.write_table(table_of(rows), path, row_group_size=row_group_size)
    return path


def write_arrow(path, rows, stream=True):
    table = table_of(rows)
    opener = ipc.new_stream if stream else ipc.new_file
    with pa.OSFile(str(path), "wb") as sink, opener(sink, table.schema) as writer:
        writer.write_table(table, max_chunksize=2)
    return path


def write_csv(path, rows):
    pacsv.write_csv(table_of(rows), path)
    return path


def save_to_disk(folder, rows, shards=1):
    """The layout `datasets.Dataset.save_to_disk` writes: state.json + data-*.arrow (stream)."""
    folder.mkdir(parents=True)
    names = [f"data-{i:05d}-of-{shards:05d}.arrow" for i in range(shards)]
    per = -(-len(rows) // shards) if rows else 0
    for i, name in enumerate(names):
        part = rows[i * per : (i + 1) * per] if rows else []
        table = table_of(part)
        with pa.OSFile(str(folder / name), "wb") as sink, ipc.new_stream(sink, table.schema) as w:
            w.write_table(table)
    (folder / "dataset_info.json").write_text("{}")
    state = {"_data_files": [{"filename": n} for n in names], "_fingerprint": "x", "_split": None}
    (folder / "state.json").write_text(json.dumps(state))
    return folder


def save_dict_to_disk(folder, splits: dict):
    folder.mkdir(parents=True)
    for name, rows in splits.items():
        save_to_disk(folder / name, rows)
    (folder / "dataset_dict.json").write_text(json.dumps({"splits": list(splits)}))
    return folder


# ----------------------------------------------------------------------------- containers


@pytest.mark.parametrize("layout", list(ROWS))
def test_same_examples_whatever_the_container(tok, tmp_path, layout):
    rows = ROWS[layout]
    want = load(write_jsonl(tmp_path / "d.jsonl", rows), tok)
    assert want and all(ids[0] == BOS for ids, _ in want)
    shards = tmp_path / "shards"
    shards.mkdir()
    write_parquet(shards / "train-00000-of-00002.parquet", rows[:1])
    write_parquet(shards / "train-00001-of-00002.parquet", rows[1:])
    write_parquet(shards / "test-00000-of-00001.parquet", rows[:1])  # another split: not read
    containers = [
        write_json(tmp_path / "d.json", rows),
        write_json(tmp_path / "obj.json", {"version": 1, "data": rows}),
        write_parquet(tmp_path / "d.parquet", rows, row_group_size=2),
        write_arrow(tmp_path / "stream.arrow", rows),
        write_arrow(tmp_path / "file.arrow", rows, stream=False),
        save_to_disk(tmp_path / "saved", rows, shards=2),
        save_dict_to_disk(tmp_path / "saved_dict", {"train": rows, "test": rows[:1]}),
        shards,
    ]
    if layout in FLAT:
        containers.append(write_csv(tmp_path / "d.csv", rows))
    for container in containers:
        assert load(container, tok) == want, container.name
    jsonl_shards = tmp_path / "jsonl_shards"
    jsonl_shards.mkdir()
    write_jsonl(jsonl_shards / "a.jsonl", rows[:2])
    write_jsonl(jsonl_shards / "b.jsonl", rows[2:])
    assert load(jsonl_shards, tok) == want
    assert load(f"{jsonl_shards}/*.jsonl", tok) == want
    # A DatasetDict split and a shard split are picked with --data-split.
    first = load(write_jsonl(tmp_path / "first.jsonl", rows[:1]), tok)
    assert load(tmp_path / "saved_dict", tok, split="test") == first
    assert load(shards, tok, split="test") == load(shards / "test-00000-of-00001.parquet", tok)


def test_folders_written_by_datasets(tok, tmp_path):
    datasets = pytest.importorskip("datasets")
    rows = ROWS["messages"] + [{"messages": CONVERSATIONS[1]}] * 3
    want = load(write_jsonl(tmp_path / "d.jsonl", rows), tok)
    dataset = datasets.Dataset.from_list(rows)
    dataset.save_to_disk(str(tmp_path / "saved"), num_shards=2)
    assert load(tmp_path / "saved", tok) == want
    datasets.DatasetDict({"train": dataset, "eval": dataset.select([1])}).save_to_disk(
        str(tmp_path / "dict")
    )
    assert load(tmp_path / "dict", tok) == want
    assert load(tmp_path / "dict", tok, split="eval") == want[1:2]
    dataset.to_parquet(str(tmp_path / "d.parquet"))
    dataset.to_json(str(tmp_path / "lines.json"))  # JSON lines under a .json name
    for path in ("d.parquet", "lines.json"):
        assert load(tmp_path / path, tok) == want


def test_txt_and_folder_of_txt(tok, tmp_path):
    (tmp_path / "a.txt").write_text("one\n\n\ntwo\n", encoding="utf-8")
    (tmp_path / "b.txt").write_text("three", encoding="utf-8")
    both = load(tmp_path, tok)
    assert [tok.decode(ids[1:-1]) for ids, _ in both] == ["one", "two", "three"]
    assert load(tmp_path / "a.txt", tok) == both[:2]


def test_csv_cells_are_text(tok, tmp_path):
    path = tmp_path / "n.csv"
    path.write_text('prompt,completion\n"1+1, in words",2\n3,"multi\nline"\n', encoding="utf-8")
    got = sources.iter_records(str(path))
    assert [r for r, _ in got] == [
        {"prompt": "1+1, in words", "completion": "2"},
        {"prompt": "3", "completion": "multi\nline"},
    ]


def test_records_are_read_in_batches(tmp_path):
    path = write_parquet(tmp_path / "big.parquet", [{"text": str(i)} for i in range(3000)])
    records = sources.iter_records(str(path))
    assert next(records) == ({"text": "0"}, f"{path}:row 1")
    *_, last = records
    assert last == ({"text": "2999"}, f"{path}:row 3000")


def test_hf_cache_dataset_offline(tok, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))  # what compiletune/hub.py reads
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(
        UserError,
        match=r"--data org/set: no such local path, and not in the HF cache .* HF_HUB_OFFLINE set",
    ):
        load_examples("org/set", tok)
    repo = tmp_path / "hub" / "datasets--org--set"
    commit = "0" * 40
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    data = repo / "snapshots" / commit / "data"
    data.mkdir(parents=True)
    rows = ROWS["prompt-completion"]
    write_parquet(data / "train-00000-of-00001.parquet", rows)
    write_parquet(data / "test-00000-of-00001.parquet", rows[:2])
    (repo / "snapshots" / commit / "README.md").write_text("# a card")
    want = load(write_jsonl(tmp_path / "d.jsonl", rows), tok)
    assert load("org/set", tok) == want
    assert load("org/set", tok, split="test") == want[:2]
    with pytest.raises(UserError, match=r"has no split 'dev' \(splits: test, train\)"):
        load("org/set", tok, split="dev")
    assert sources.source_files("org/set") == [data / "train-00000-of-00001.parquet"]


# ----------------------------------------------------------------------------- layouts


def test_sharegpt_and_alpaca_equal_their_messages(tok, tmp_path):
    share = load(write_jsonl(tmp_path / "s.jsonl", ROWS["sharegpt"]), tok)
    as_messages = [
        {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"}]},
        {
            "messages": [
                {"role": "system", "content": "S"},
                {"role": "user", "content": "U"},
                {"role": "assistant", "content": "A"},
            ]
        },
    ]
    assert share == load(write_jsonl(tmp_path / "m.jsonl", as_messages), tok)
    alpaca = load(write_jsonl(tmp_path / "a.jsonl", ROWS["alpaca"]), tok)
    as_messages = [
        {
            "messages": [
                {"role": "user", "content": "Add\n\n2 and 2"},
                {"role": "assistant", "content": "4"},
            ]
        },
        {
            "messages": [
                {"role": "user", "content": "Say hi"},
                {"role": "assistant", "content": "hi"},
            ]
        },
    ]
    assert alpaca == load(write_jsonl(tmp_path / "am.jsonl", as_messages), tok)


def test_alpaca_without_chat_template_is_prompt_completion(tmp_path):
    plain = byte_tokenizer()
    plain.chat_template = None
    path = write_jsonl(tmp_path / "a.jsonl", ROWS["alpaca"])
    prompts = [
        {
            "prompt": "### Instruction:\nAdd\n\n### Input:\n2 and 2\n\n### Response:\n",
            "completion": "4",
        },
        {"prompt": "### Instruction:\nSay hi\n\n### Response:\n", "completion": "hi"},
    ]
    assert load(path, plain) == load(write_jsonl(tmp_path / "p.jsonl", prompts), plain)


def test_data_columns_and_forced_format(tok, tmp_path):
    want = load(write_jsonl(tmp_path / "pc.jsonl", ROWS["prompt-completion"]), tok)
    renamed = [
        {"question": r["prompt"], "answer": r["completion"]} for r in ROWS["prompt-completion"]
    ]
    path = write_parquet(tmp_path / "qa.parquet", renamed)
    assert load(path, tok, columns="prompt=question, completion=answer") == want
    assert (
        load(path, tok, fmt="prompt-completion", columns="prompt=question,completion=answer")
        == want
    )
    # Inside messages: the list and its role/content keys.
    want = load(write_jsonl(tmp_path / "m.jsonl", ROWS["messages"]), tok)
    dialogs = [
        {"dialog": [{"speaker": m["role"], "text": m["content"]} for m in r["messages"]]}
        for r in ROWS["messages"]
    ]
    path = write_parquet(tmp_path / "d.parquet", dialogs)
    assert load(path, tok, columns="messages=dialog,role=speaker,content=text") == want
    # A forced layout reads only its own columns.
    both = write_jsonl(
        tmp_path / "both.jsonl", [{"text": "all of it", "prompt": "p", "completion": "c"}]
    )
    assert load(both, tok) == load(both, tok, fmt="prompt-completion")
    assert load(both, tok, fmt="text") == load(
        write_jsonl(tmp_path / "t.jsonl", [{"text": "all of it"}]), tok
    )


def test_template_that_rewrites_earlier_turns(tmp_path):
    rewriting = byte_tokenizer()
    rewriting.chat_template = REWRITING
    messages = [
        {"role": "system", "content": "Sys"},
        {"role": "user", "content": "Q1"},
        {"role": "assistant", "content": "<think>r1</think>\nA1"},
        {"role": "user", "content": "Q2"},
        {"role": "assistant", "content": "<think>r2</think>\nA2"},
    ]
    examples = load_examples(
        str(write_jsonl(tmp_path / "c.jsonl", [{"messages": messages}])), rewriting
    )
    assert len(examples) == 2  # one per assistant turn
    for example, i in zip(examples, (2, 4), strict=True):
        context = rewriting.apply_chat_template(
            messages[:i], tokenize=False, add_generation_prompt=True
        )
        through = rewriting.apply_chat_template(messages[: i + 1], tokenize=False)
        assert through.startswith(context)
        n_context = 1 + len(context.encode())  # bos, then bytes
        assert example.ids == [BOS, *through.encode(), EOS]
        assert example.is_target == [False] * n_context + [True] * (len(example.ids) - n_context)
    # The second example's context has the first reply without its reasoning, as at inference;
    # the reply trained on keeps it.
    second = rewriting.decode(examples[1].ids)
    assert "r1" not in second and "<think>r2</think>\nA2<|im_end|>" in second
    assert "<think>r1</think>\nA1" in rewriting.decode(examples[0].ids)
    # A template that extends its prefixes still gives one example with every reply a target.
    chatml = byte_tokenizer()
    chatml.chat_template = CHATML
    (example,) = load_examples(str(tmp_path / "c.jsonl"), chatml)
    runs = chatml.decode([i for i, t in zip(example.ids, example.is_target, strict=True) if t])
    assert (
        runs == "<think>r1</think>\nA1<|im_end|>\n<think>r2</think>\nA2<|im_end|>\n<|end_of_text|>"
    )


# ----------------------------------------------------------------------------- bad input


def one_line(info) -> str:
    message = str(info.value)
    assert "\n" not in message
    return message


def test_error_no_usable_column_names_columns_and_flags(tok, tmp_path):
    path = write_parquet(tmp_path / "x.parquet", [{"question": "q", "answer": "a"}])
    with pytest.raises(UserError) as info:
        load_examples(str(path), tok)
    message = one_line(info)
    assert f"{path}:row 1: no known key (found: answer, question)" in message
    assert "--data-columns" in message and "--data-format" in message
    with pytest.raises(
        UserError,
        match=r'row 1: no "prompt" or "completion" column for --data-format prompt-completion \(found: answer, question\); map one with --data-columns prompt=COLUMN',
    ):
        load(path, tok, fmt="prompt-completion")


def test_error_row_of_another_shape_names_file_and_row(tok, tmp_path):
    rows = [{"text": "a"}, {"text": "b"}, {"prompt": "p", "completion": "c"}]
    path = write_parquet(tmp_path / "mixed.parquet", rows)
    with pytest.raises(
        UserError,
        match=r"mixed\.parquet:row 3: a prompt-completion row, but the rows before are text rows",
    ):
        load_examples(str(path), tok)
    folder = tmp_path / "f"
    folder.mkdir()
    write_jsonl(folder / "1.jsonl", [{"text": "a"}])
    write_jsonl(folder / "2.jsonl", [{"messages": CONVERSATIONS[1]}])
    with pytest.raises(UserError, match=r"2\.jsonl:1: a messages row, but .*1\.jsonl:1"):
        load_examples(str(folder), tok)
    bad = [
        ({"text": None}, r'row 1: "text" must be a string, got a NoneType'),
        (
            {"conversations": [{"from": "alien", "value": "x"}]},
            r"row 1: conversations\[0\]\[.from.\] is 'alien'; ShareGPT roles are human",
        ),
        (
            {"messages": [{"from": "user", "value": "x"}]},
            r'\["role"\] is missing \(keys: from, value; map them with --data-columns role=...,content=...\)',
        ),
        ({"instruction": "i", "input": "x"}, r'"output" must be a string, got missing'),
    ]
    for i, (row, message) in enumerate(bad):
        path = write_json(tmp_path / f"bad{i}.json", [row])
        with pytest.raises(UserError, match=rf"bad{i}\.json:.*{message}"):
            load_examples(str(path), tok)


def test_error_empty_sources_and_splits(tok, tmp_path):
    empty = [
        write_jsonl(tmp_path / "e.jsonl", []),
        write_json(tmp_path / "e.json", []),
        write_parquet(tmp_path / "e.parquet", []),
    ]
    for path in empty:
        with pytest.raises(UserError, match="has no examples"):
            load_examples(str(path), tok)
    (tmp_path / "e.csv").write_text("")
    with pytest.raises(UserError, match=r"e\.csv is empty"):
        load_examples(str(tmp_path / "e.csv"), tok)
    saved = save_dict_to_disk(tmp_path / "dd", {"train": ROWS["text"], "test": []})
    with pytest.raises(UserError, match=r"split 'test' of .*dd has no examples"):
        load(saved, tok, split="test")
    with pytest.raises(
        UserError, match=r"dd has no split 'dev' \(splits: train, test\); pass --data-split"
    ):
        load(saved, tok, split="dev")
    with pytest.raises(UserError, match=r"is one file; drop --data-split"):
        load(tmp_path / "e.json", tok, split="train")


def test_error_unknown_format_and_bad_columns(tok, tmp_path):
    path = write_jsonl(tmp_path / "t.jsonl", ROWS["text"])
    cases = [
        ({"fmt": "chatml"}, r"--data-format 'chatml' is not a layout; use auto, text, "),
        ({"columns": "prompt"}, r"--data-columns: 'prompt' is not FIELD=COLUMN"),
        ({"columns": "query=q"}, r"--data-columns: unknown field 'query'; fields: text, prompt"),
        (
            {"fmt": "text", "columns": "prompt=q"},
            r"maps prompt, which --data-format text does not read",
        ),
    ]
    for kw, message in cases:
        with pytest.raises(UserError, match=message):
            load(path, tok, **kw)
    (tmp_path / "m").mkdir()
    write_jsonl(tmp_path / "m" / "a.jsonl", ROWS["text"])
    write_parquet(tmp_path / "m" / "b.parquet", ROWS["text"])
    with pytest.raises(UserError, match=r"several kinds \(\.jsonl, \.parquet\)"):
        load_examples(str(tmp_path / "m"), tok)
    with pytest.raises(UserError, match=r"matches no data file"):
        load_examples(str(tmp_path / "*.nothing"), tok)


def test_error_not_utf8(tok, tmp_path):
    for name in ("t.txt", "t.jsonl"):
        path = tmp_path / name
        path.write_bytes(b'{"text": "ok"}\n{"text": "caf\xe9"}\n')
        with pytest.raises(
            UserError, match=rf"{name}:2: not valid UTF-8 \(byte 0xe9 at offset 28\)"
        ):
            load_examples(str(path), tok)
    path = tmp_path / "t.csv"
    path.write_bytes(b"text\ncaf\xe9\n")
    with pytest.raises(UserError, match=r"t\.csv:2: not valid UTF-8 \(byte 0xe9 at offset 8\)"):
        load_examples(str(path), tok)


def test_error_without_pyarrow_names_the_extra(tok, tmp_path, monkeypatch):
    path = write_parquet(tmp_path / "d.parquet", ROWS["text"])
    monkeypatch.setitem(sys.modules, "pyarrow", None)
    with pytest.raises(
        UserError,
        match=r"d\.parquet: reading \.parquet data needs pyarrow.*pip install 'compiletune\[data\]'",
    ):
        load_examples(str(path), tok)
    # jsonl needs no pyarrow
    assert load_examples(str(write_jsonl(tmp_path / "d.jsonl", ROWS["text"])), tok)


# ----------------------------------------------------------------------------- fingerprint


def test_fingerprint_follows_content(tmp_path):
    folder = tmp_path / "f"
    folder.mkdir()
    write_jsonl(folder / "a.jsonl", ROWS["text"][:2])
    write_jsonl(folder / "b.jsonl", ROWS["text"][2:])
    first = sources.fingerprint(str(folder), None)
    assert len(first) == 64 and first == sources.fingerprint(str(folder), None)
    copy = tmp_path / "copy"
    copy.mkdir()
    for p in folder.iterdir():
        (copy / ("renamed_" + p.name)).write_bytes(p.read_bytes())
    assert sources.fingerprint(str(copy), None) == first  # the content, not the names
    write_jsonl(folder / "b.jsonl", ROWS["text"][3:])
    assert sources.fingerprint(str(folder), None) != first
    assert sources.source_files(str(folder)) == [folder / "a.jsonl", folder / "b.jsonl"]
    saved = save_dict_to_disk(tmp_path / "dd", {"train": ROWS["text"], "test": ROWS["text"][:1]})
    assert sources.fingerprint(str(saved), "train") != sources.fingerprint(str(saved), "test")
    assert sources.fingerprint("pydocs", None) == sources.fingerprint("pydocs", None)
    assert sources.source_files("pydocs") == []


@pytest.mark.parametrize(
    "text, line, message",
    [
        ("prompt,completion\nhi,there\na,b,c\nx,y\n", 3, "3 fields where the header has 2"),
        ("prompt,completion\nhi,there\nonly\n", 3, "1 field where the header has 2"),
        # a value may span lines inside quotes: the bad record is on the file's line 6
        ('prompt,completion\n"hi\nthere",ok\nx,"multi\nline"\nbad,row,here\n', 6, "3 fields"),
        ('prompt,completion\n"hi\nthere",ok\n"unterminated,x\n', 4, "a quote opened in"),
    ],
)
def test_csv_errors_name_the_line(tok, tmp_path, text, line, message):
    path = tmp_path / "bad.csv"
    path.write_text(text, encoding="utf-8")
    with pytest.raises(UserError, match=rf"bad\.csv:{line}: {message}.*quote a value"):
        load_examples(str(path), tok)


@pytest.mark.parametrize(
    "text, line, message",
    [
        # a quote opened mid-file closes two lines on, followed by text: rows 2-4 would merge
        (
            'prompt,completion\n"What is 2+2?,4\nCapital of France?,Paris\n"Say hi",hello\nx,y\n',
            2,
            "a quoted value of this row closes on line 4 with more text after its closing quote",
        ),
        # a quote opened in the last rows never closes: they would merge into one value
        (
            'prompt,completion\na,b\nc,"d\ne,f\n',
            3,
            "a quote opened in this row is never closed .*line 4",
        ),
    ],
)
def test_csv_unbalanced_quote_names_the_line(tok, tmp_path, text, line, message):
    """An unbalanced quote merged rows silently (pyarrow read both files as valid rows); the
    strict reader names the line of the row where the quote opened."""
    path = tmp_path / "q.csv"
    path.write_text(text, encoding="utf-8")
    with pytest.raises(UserError, match=rf"q\.csv:{line}: {message}.*quote a value"):
        load_examples(str(path), tok)


def test_csv_bytes_and_header_are_checked(tok, tmp_path):
    path = tmp_path / "bytes.csv"
    path.write_bytes(b"prompt,completion\nhi,there\nok,\xff\xfebad\n")
    with pytest.raises(
        UserError, match=r"bytes\.csv:3: not valid UTF-8 \(byte 0xff at offset 30\); save"
    ):
        load_examples(str(path), tok)
    path = tmp_path / "dup.csv"
    path.write_text("prompt,completion,prompt\na,b,c\n", encoding="utf-8")
    with pytest.raises(UserError, match=r"dup\.csv:1: the header names column 'prompt' twice"):
        load_examples(str(path), tok)
    path = tmp_path / "blank.csv"
    path.write_text("prompt,,completion\na,b,c\n", encoding="utf-8")
    with pytest.raises(UserError, match=r"blank\.csv:1: header column 2 has no name"):
        load_examples(str(path), tok)


def _chat(*roles: str) -> dict:
    return {"messages": [{"role": r, "content": f"turn {i}"} for i, r in enumerate(roles)]}


def test_roles_outside_the_template_are_refused_or_mapped(tok, tmp_path):
    path = tmp_path / "roles.jsonl"
    path.write_text("\n".join(json.dumps(_chat(*r)) for r in [("user", "assistant")] * 2))
    path.write_text(path.read_text() + "\n" + json.dumps(_chat("human", "bot")) + "\n")
    # The test tokenizer's template renders any role by name, but names none: only system,
    # user and assistant pass unmapped.
    with pytest.raises(
        UserError, match=r"roles\.jsonl:3: messages\[0\] has role 'human'.*--data-roles human=user"
    ):
        load_examples(str(path), tok)
    mapped = load_examples(str(path), tok, roles="human=user,bot=assistant")
    assert mapped[2].ids == mapped[0].ids  # the same conversation once its roles are mapped
    assert mapped[2].is_target == mapped[0].is_target
    # A role the template names (Qwen's and ChatML-style templates name "tool") passes as is.
    named = byte_tokenizer()
    named.chat_template = tok.chat_template + "{# 'tool' #}"
    tool = tmp_path / "tool.jsonl"
    tool.write_text(json.dumps(_chat("user", "tool", "assistant")) + "\n")
    assert len(load_examples(str(tool), named)) == 1
    with pytest.raises(UserError, match=r"messages\[1\] has role 'tool'"):
        load_examples(str(tool), tok)
    for spec, message in [
        ("human", "is not FROM=TO"),
        ("human=boss", "must become one of system, user, assistant, tool"),
        ("a=user,a=system", "a is mapped twice"),
    ]:
        with pytest.raises(UserError, match=f"--data-roles: .*{message}"):
            load_examples(str(path), tok, roles=spec)


def test_sharegpt_roles_can_be_mapped(tok, tmp_path):
    path = tmp_path / "share.jsonl"
    row = {"conversations": [{"from": "bing", "value": "q"}, {"from": "gpt", "value": "a"}]}
    path.write_text(json.dumps(row) + "\n")
    with pytest.raises(UserError, match=r"share\.jsonl:1: .*'bing'.*--data-roles bing=user"):
        load_examples(str(path), tok)
    assert len(load_examples(str(path), tok, roles="bing=user")) == 1
