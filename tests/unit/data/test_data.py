import hashlib
import json
import random
import subprocess
import sys

import pytest
import torch

from compiletune.data.corpus import pydoc_corpus
from compiletune.data.rows import (
    IGNORE_INDEX,
    Batches,
    Example,
    PackedData,
    count_targets,
    load_examples,
    pack,
)
from compiletune.data.tokenizer import byte_tokenizer
from compiletune.errors import UserError

BOS, EOS = 256, 257

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture(scope="module")
def tok():
    return byte_tokenizer()


def b(text: str) -> list[int]:
    """Byte-tokenizer ids of `text`."""
    return list(text.encode("utf-8"))


def write_jsonl(path, rows):
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n", encoding="utf-8")
    return str(path)


def target_runs(example: Example) -> list[list[int]]:
    """Maximal runs of consecutive target ids."""
    runs, current = [], []
    for i, t in zip(example.ids, example.is_target, strict=True):
        if t:
            current.append(i)
        elif current:
            runs.append(current)
            current = []
    if current:
        runs.append(current)
    return runs


# ----------------------------------------------------------------------------- sources


def test_txt_documents_split_on_double_empty_lines(tok, tmp_path):
    path = tmp_path / "notes.txt"
    path.write_text(
        "First doc.\n\nStill first, é🤗.\n\n\n\nSecond doc.\n  \n\n\n", encoding="utf-8"
    )
    examples = load_examples(str(path), tok)
    assert len(examples) == 2
    first, second = examples
    assert first.ids == [BOS] + b("First doc.\n\nStill first, é🤗.") + [EOS]
    assert first.is_target == [False] + [True] * (len(first.ids) - 1)
    assert second.ids == [BOS] + b("Second doc.") + [EOS]


def test_txt_without_gap_is_one_document(tok, tmp_path):
    path = tmp_path / "one.txt"
    path.write_text("  indented start\npara\n\npara two\n", encoding="utf-8")
    (example,) = load_examples(str(path), tok)
    assert example.ids == [BOS] + b("  indented start\npara\n\npara two") + [EOS]


def test_jsonl_text(tok, tmp_path):
    path = write_jsonl(tmp_path / "t.jsonl", [{"text": "abc"}, {"text": " x\ny"}])
    a, c = load_examples(path, tok)
    assert a.ids == [BOS, *b("abc"), EOS] and a.is_target == [False, True, True, True, True]
    assert c.ids == [BOS, *b(" x\ny"), EOS]


def test_prompt_completion_masking_exact(tok, tmp_path):
    path = write_jsonl(tmp_path / "pc.jsonl", [{"prompt": "Q: 2+2=", "completion": " 4"}])
    (example,) = load_examples(path, tok)
    assert example.ids == [BOS, *b("Q: 2+2="), *b(" 4"), EOS]
    assert example.is_target == [False] * (1 + len("Q: 2+2=")) + [True, True, True]


def test_chat_masking_targets_only_assistant_turns(tok, tmp_path):
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi?"},
        {"role": "assistant", "content": "Hello 🤗."},
        {"role": "user", "content": "More?"},
        {"role": "assistant", "content": "No."},
    ]
    path = write_jsonl(tmp_path / "chat.jsonl", [{"messages": messages}])
    (example,) = load_examples(path, tok)
    rendered = tok.apply_chat_template(messages, tokenize=False)
    assert example.ids == tok.encode(rendered, add_special_tokens=False)
    assert example.ids[0] == BOS and example.ids[-1] == EOS
    assert example.ids.count(BOS) == 1
    runs = [tok.decode(run) for run in target_runs(example)]
    assert runs == ["Hello 🤗.<|end_of_text|>", "No.<|end_of_text|>"]


def test_chat_masking_with_other_template(tok, tmp_path):
    # A ChatML-style template: no bos, end-of-turn marker then newline, no eos of its own.
    chatml = byte_tokenizer()
    chatml.chat_template = CHATML
    messages = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Yo"},
        {"role": "user", "content": "Bye"},
    ]
    path = write_jsonl(
        tmp_path / "chat.jsonl", [{"messages": messages}, {"messages": messages[:2]}]
    )
    ending_user, ending_assistant = load_examples(path, chatml)
    assert ending_user.ids[0] == BOS and ending_user.ids[-1] == EOS
    assert [chatml.decode(r) for r in target_runs(ending_user)] == ["Yo<|im_end|>\n"]
    # eos appended after an assistant reply is a target; after a user turn it is not.
    assert ending_user.is_target[-1] is False
    assert [chatml.decode(r) for r in target_runs(ending_assistant)] == [
        "Yo<|im_end|>\n<|end_of_text|>"
    ]


def test_jsonl_bom_crlf_and_blank_lines(tok, tmp_path):
    path = tmp_path / "lines.jsonl"
    lines = [
        "\ufeff" + json.dumps({"text": "t"}),  # a byte-order mark from a Windows editor
        json.dumps({"text": "line\u2028separator"}, ensure_ascii=False),
        "",
        "   ",
        json.dumps({"text": "x", "extra": 1}),
    ]
    path.write_text("\r\n".join(lines), encoding="utf-8")
    examples = load_examples(str(path), tok)
    assert len(examples) == 3
    assert examples[0].ids == [BOS, *b("t"), EOS]
    assert examples[1].ids == [BOS, *b("line\u2028separator"), EOS]
    # One layout per source: a row of another shape is refused, naming its line.
    path.write_text("\n".join([*lines, json.dumps({"prompt": "p", "completion": "c"})]))
    with pytest.raises(UserError, match=r"lines\.jsonl:6: a prompt-completion row, but .* text"):
        load_examples(str(path), tok)


def test_pydocs_source(tok):
    examples = load_examples("pydocs", tok)
    assert len(examples) == len(pydoc_corpus()) >= 50
    assert all(e.ids[0] == BOS and e.ids[-1] == EOS for e in examples)


def test_pydocs_corpus_size_and_determinism():
    docs = pydoc_corpus()
    size = sum(len(d.encode("utf-8")) for d in docs)
    assert size > 100_000
    assert docs == pydoc_corpus()
    assert len(set(docs)) == len(docs)
    # Same corpus in a fresh interpreter (different import state, different hash seed).
    digest = hashlib.sha256("\0".join(docs).encode()).hexdigest()
    code = (
        "import hashlib; from compiletune.data.corpus import pydoc_corpus; "
        "print(hashlib.sha256('\\0'.join(pydoc_corpus()).encode()).hexdigest())"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == digest


# ----------------------------------------------------------------------------- errors


def test_error_missing_file(tok, tmp_path):
    with pytest.raises(UserError, match="does not exist"):
        load_examples(str(tmp_path / "missing.jsonl"), tok)


def test_error_unsupported_extension_and_empty_directory(tok, tmp_path):
    path = tmp_path / "data.xlsx"
    path.write_text("a,b\n")
    with pytest.raises(UserError, match=r"data\.xlsx: unsupported data file type \.xlsx"):
        load_examples(str(path), tok)
    with pytest.raises(UserError, match="is a folder without data files"):
        load_examples(str(tmp_path), tok)


def test_error_malformed_jsonl_names_file_and_line(tok, tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"text": "ok"}\n\n{"text": "broken"\n', encoding="utf-8")
    with pytest.raises(UserError, match=r"bad\.jsonl:3: invalid JSON") as info:
        load_examples(str(path), tok)
    assert "fix the line" in str(info.value)


def test_error_unknown_keys(tok, tmp_path):
    path = write_jsonl(tmp_path / "keys.jsonl", [{"text": "ok"}, {"input": "x", "output": "y"}])
    with pytest.raises(UserError, match=r"keys\.jsonl:2: no known key \(found: input, output\)"):
        load_examples(path, tok)


def test_error_bad_values(tok, tmp_path):
    cases = [
        ([1, 2], "expected a JSON object"),
        ({"prompt": "p"}, '"completion" is missing'),
        ({"text": 3}, '"text" must be a string'),
        ({"messages": [{"role": "user"}]}, '"messages" must be a list'),
        ({"messages": [{"role": "human", "content": "x"}]}, "has role 'human'"),
        ({"messages": [{"role": "assistant", "content": "x"}]}, "starts with an assistant"),
    ]
    for i, (row, message) in enumerate(cases):
        path = write_jsonl(tmp_path / f"v{i}.jsonl", [row])
        with pytest.raises(UserError, match=rf"v{i}\.jsonl:1: .*{message}"):
            load_examples(path, tok)


def test_error_chat_without_template(tmp_path):
    plain = byte_tokenizer()
    plain.chat_template = None
    messages = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
    path = write_jsonl(tmp_path / "c.jsonl", [{"messages": messages}])
    with pytest.raises(UserError, match=r"c\.jsonl:1: .*chat template.*pass --tokenizer"):
        load_examples(path, plain)


def test_error_empty_dataset(tok, tmp_path):
    for name in ("empty.txt", "empty.jsonl"):
        path = tmp_path / name
        path.write_text("\n\n  \n", encoding="utf-8")
        with pytest.raises(UserError, match="has no examples"):
            load_examples(str(path), tok)


def test_error_too_short_for_seq_len(tok, tmp_path):
    path = tmp_path / "short.txt"
    path.write_text("tiny", encoding="utf-8")
    examples = load_examples(str(path), tok)  # bos + 4 bytes + eos = 6 tokens
    with pytest.raises(
        UserError, match=r"short\.txt has 6 tokens; seq-len 8 needs at least 9; lower --seq-len"
    ):
        pack(examples, 8, source=str(path))
    assert pack(examples, 5).inputs.shape == (1, 5)


def test_error_no_targets_at_all():
    examples = [Example([1, 2, 3, 4], [False] * 4)]
    with pytest.raises(UserError, match="no row has a token to predict"):
        pack(examples, 2)


# ----------------------------------------------------------------------------- packing


def test_pack_small_by_hand():
    examples = [
        Example([1, 2, 3], [False, True, True]),
        Example([4, 5], [False, True]),
        Example([6, 7, 8, 9], [False, True, True, True]),
    ]
    data = pack(examples, 3)  # stream 1..9: (9 - 1) // 3 = 2 rows
    assert data.inputs.tolist() == [[1, 2, 3], [4, 5, 6]]
    assert data.targets.tolist() == [[2, 3, IGNORE_INDEX], [5, IGNORE_INDEX, 7]]
    assert data.positions.tolist() == [[0, 1, 2], [0, 1, 0]]
    assert data.doc_ids.tolist() == [[0, 0, 0], [0, 0, 1]]
    assert data.inputs.dtype == data.targets.dtype == data.positions.dtype == torch.int64
    assert data.doc_ids.dtype == torch.int32


def test_pack_keep_tail_pads_a_last_row_and_loses_no_target():
    examples = [
        Example([1, 2, 3], [False, True, True]),
        Example([4, 5], [False, True]),
        Example([6, 7, 8, 9], [False, True, True, True]),
    ]
    # 9 tokens, seq 3: 2 full rows, the tail 7 8 9 padded with one token into a third.
    data = pack(examples, 3, keep_tail=True)
    assert data.inputs.tolist() == [[1, 2, 3], [4, 5, 6], [7, 8, 9]]
    assert data.targets.tolist()[2] == [8, 9, IGNORE_INDEX]
    assert int((data.targets != IGNORE_INDEX).sum()) == 6  # every target: 2 + 1 + 3
    assert int((pack(examples, 3).targets != IGNORE_INDEX).sum()) == 4  # without: 8, 9 lost
    # A stream that fills its rows exactly gets no padded row.
    assert pack(examples, 4, keep_tail=True).inputs.tolist() == pack(examples, 4).inputs.tolist()
    # 7 tokens, seq 5: the padding is a document of its own and never a target.
    data = pack(examples[:1] + examples[2:], 5, keep_tail=True)
    assert data.inputs.tolist() == [[1, 2, 3, 6, 7], [8, 9, 0, 0, 0]]
    assert data.targets.tolist()[1] == [9] + [IGNORE_INDEX] * 4
    assert data.doc_ids.tolist()[1] == [0, 0, 1, 1, 1]


def test_pack_drops_rows_without_targets():
    examples = [
        Example([1, 2, 3, 4, 5], [False, True, True, False, False]),
        Example([6, 7, 8, 9, 10, 11, 12], [False, False, False, False, True, True, True]),
    ]
    # Stream 1..12 gives (12 - 1) // 3 = 3 rows; the middle one ([4, 5, 6] -> [5, 6, 7]) has
    # no target and is dropped.
    data = pack(examples, 3)
    assert data.inputs.tolist() == [[1, 2, 3], [7, 8, 9]]
    assert data.targets.tolist() == [[2, 3, IGNORE_INDEX], [IGNORE_INDEX, IGNORE_INDEX, 10]]


def random_examples(rng: random.Random, count: int) -> list[Example]:
    examples = []
    for _ in range(count):
        n = rng.randint(1, 40)
        ids = [rng.randrange(1000) for _ in range(n)]
        examples.append(Example(ids, [rng.random() < 0.7 for _ in range(n)]))
    return examples


def test_pack_matches_stream_definition():
    rng = random.Random(0)
    examples = random_examples(rng, 50)
    seq_len = 16
    stream = [i for e in examples for i in e.ids]
    is_target = [t for e in examples for t in e.is_target]
    doc = [d for d, e in enumerate(examples) for _ in e.ids]
    offset = [p for e in examples for p in range(len(e.ids))]  # position inside its document
    data = pack(examples, seq_len)
    expected_rows = []
    for r in range((len(stream) - 1) // seq_len):
        s = r * seq_len
        inputs = stream[s : s + seq_len]
        # A target counts only inside one document (never the next document's first token).
        targets = [
            stream[s + j + 1]
            if is_target[s + j + 1] and doc[s + j + 1] == doc[s + j]
            else IGNORE_INDEX
            for j in range(seq_len)
        ]
        if all(t == IGNORE_INDEX for t in targets):
            continue
        # Positions count from the document start, or from the row start for a document
        # carried over from the previous row.
        positions = [min(offset[s + j], j) for j in range(seq_len)]
        doc_ids = [doc[s + j] - doc[s] for j in range(seq_len)]
        expected_rows.append((inputs, targets, positions, doc_ids))
    assert data.inputs.tolist() == [row[0] for row in expected_rows]
    assert data.targets.tolist() == [row[1] for row in expected_rows]
    assert data.positions.tolist() == [row[2] for row in expected_rows]
    assert data.doc_ids.tolist() == [row[3] for row in expected_rows]


def test_load_and_pack_deterministic(tok, tmp_path):
    text = write_jsonl(
        tmp_path / "d.jsonl", [{"text": f"doc {i} " * (i % 7 + 1)} for i in range(60)]
    )
    pc = write_jsonl(
        tmp_path / "pc.jsonl", [{"prompt": f"p{i}", "completion": f"c{i}"} for i in range(20)]
    )
    first = pack(load_examples(text, tok) + load_examples(pc, tok), 32)
    second = pack(load_examples(text, tok) + load_examples(pc, tok), 32)
    for name in ("inputs", "targets", "positions", "doc_ids"):
        assert torch.equal(getattr(first, name), getattr(second, name))
    # Targets are the next input token wherever they are not masked.
    inner = first.targets[:, :-1]
    mask = inner != IGNORE_INDEX
    assert torch.equal(inner[mask], first.inputs[:, 1:][mask])


# ----------------------------------------------------------------------------- batches


def toy_data(rows: int, seq_len: int = 4) -> PackedData:
    """One document 0, 1, 2, ...: row r holds inputs r*L .. r*L+L-1, each target the next."""
    n = rows * seq_len + 1
    data = pack([Example(list(range(n)), [True] * n)], seq_len)
    assert data.rows == rows
    return data


def row_ids(batch) -> list[int]:
    return (batch["inputs"][:, 0] // batch["inputs"].shape[1]).tolist()


def test_batches_shapes_and_epoch_coverage():
    data = toy_data(12)
    batches = Batches(data, 4, seed=0)
    seen = []
    for _ in range(3):
        batch = batches.next()
        assert set(batch) == {"inputs", "targets", "positions", "doc_ids"}
        assert all(v.shape == (4, 4) for v in batch.values())
        assert batch.pop("doc_ids").dtype == torch.int32
        assert all(v.dtype == torch.int64 for v in batch.values())
        assert count_targets(batch) == 16
        seen += row_ids(batch)
    assert sorted(seen) == list(range(12))  # one epoch visits every row once
    assert batches.epoch == 1 and batches.state_dict() == {"epoch": 1, "index": 0}
    assert row_ids(batches.next()) != seen[:4]  # a new order for the new epoch


def test_batches_deterministic_and_seeded():
    def run(seed):
        batches = Batches(toy_data(10), 3, seed)
        return [row_ids(batches.next()) for _ in range(8)]

    assert run(1) == run(1)
    assert run(1) != run(2)


def test_batches_cross_epoch_batches_are_full():
    batches = Batches(toy_data(10), 4, seed=3)
    ids = [row_ids(batches.next()) for _ in range(5)]  # 20 rows = exactly two epochs
    flat = [i for batch in ids for i in batch]
    assert sorted(flat[:10]) == list(range(10)) and sorted(flat[10:]) == list(range(10))
    assert batches.state_dict() == {"epoch": 2, "index": 0}


def test_batches_fewer_rows_than_batch_size():
    batches = Batches(toy_data(3), 8, seed=0)
    batch = batches.next()
    assert batch["inputs"].shape == (8, 4)
    ids = row_ids(batch)
    assert sorted(ids[:3]) == sorted(ids[3:6]) == [0, 1, 2]  # two whole epochs, then a part
    assert batches.epoch == 2


@pytest.mark.parametrize("stop_after", [1, 2, 3, 6])  # mid-epoch and right after a boundary
def test_batches_resume_equals_uninterrupted(stop_after):
    data = toy_data(10)
    reference = Batches(data, 4, seed=7)
    expected = [reference.next() for _ in range(12)]

    first = Batches(data, 4, seed=7)
    for _ in range(stop_after):
        first.next()
    state = json.loads(json.dumps(first.state_dict()))
    resumed = Batches(data, 4, seed=7)
    resumed.load_state_dict(state)
    for want in expected[stop_after:]:
        got = resumed.next()
        for key in want:
            assert torch.equal(got[key], want[key])


def test_batches_bad_state():
    batches = Batches(toy_data(5), 2, seed=0)
    with pytest.raises(UserError, match="does not fit this data"):
        batches.load_state_dict({"epoch": 0, "index": 99})
    with pytest.raises(UserError, match="batch size"):
        Batches(toy_data(5), 0, seed=0)
