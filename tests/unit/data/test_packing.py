"""`--packing whole` (the default): every example whole in one row, best-fit-decreasing, and the
held-out loss of a set independent of --seq-len and equal to transformers' per-example loss."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from compiletune.data.rows import check_rows, load_examples, pack_store
from compiletune.data.token_store import ExampleRows, MemoryStore
from compiletune.data.tokenizer import byte_tokenizer
from compiletune.errors import UserError
from compiletune.loss.head import IGNORE_INDEX
from compiletune.models import build_model, from_name
from compiletune.models.hf import save_hf
from compiletune.train import evaluate

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def random_docs(n: int, longest: int, seed: int = 0) -> list[tuple[np.ndarray, np.ndarray]]:
    """Documents of random lengths (2..longest tokens); targets a random suffix of each."""
    r = np.random.default_rng(seed)
    docs = []
    for _ in range(n):
        m = int(r.integers(2, longest + 1))
        ids = r.integers(1, 250, m).astype(np.int32)
        flags = (np.arange(m) >= int(r.integers(0, m))).astype(np.uint8)
        flags[-1] = 1
        docs.append((ids, flags))
    return docs


@pytest.mark.parametrize("truncation", ["right", "left"])
def test_every_example_is_whole_in_one_row(truncation):
    L = 32
    docs = random_docs(300, 45)
    data = ExampleRows(MemoryStore.from_documents(docs), L, truncation)
    batch = data.all_rows()
    assert batch["inputs"].shape == (data.rows, L)
    seen = []
    for row in range(data.rows):
        at = 0
        doc = batch["doc_ids"][row].numpy()
        pos = batch["positions"][row].numpy()
        for d in range(int(doc.max()) + 1):
            span = np.flatnonzero(doc == d)
            assert span[0] == at and np.array_equal(span, np.arange(at, at + len(span)))
            at += len(span)
            inputs = batch["inputs"][row].numpy()[span]
            targets = batch["targets"][row].numpy()[span]
            if (targets == IGNORE_INDEX).all() and (inputs == 0).all() and at == L:
                continue  # the padding
            assert np.array_equal(pos[span], np.arange(len(span)))  # positions restart
            seen.append((inputs, targets))
    kept = []
    for ids, flags in docs:
        n = min(len(ids), L + 1)
        part = slice(0, n) if truncation == "right" else slice(len(ids) - n, len(ids))
        ids, flags = ids[part], flags[part]
        if (flags[1:] > 0).any():
            kept.append((ids[:-1], np.where(flags[1:] > 0, ids[1:], IGNORE_INDEX)))
    key = lambda pair: tuple(np.asarray(x, np.int64).tobytes() for x in pair)  # noqa: E731
    assert sorted(map(key, seen)) == sorted(map(key, kept))  # each example once, whole
    longer = sum(len(ids) > L + 1 for ids, _ in docs)
    assert data.truncated == longer and data.lost_tokens == sum(
        max(0, len(i) - L - 1) for i, _ in docs
    )
    assert "truncated" in data.summary() and f"({truncation})" in data.summary()


def test_best_fit_decreasing_fills_rows_and_is_deterministic():
    docs = random_docs(500, 20, seed=3)
    a = ExampleRows(MemoryStore.from_documents(docs), 64)
    b = ExampleRows(MemoryStore.from_documents(docs), 64)
    assert all(
        torch.equal(x, y) for x, y in zip(a.all_rows().values(), b.all_rows().values(), strict=True)
    )
    inputs = sum(len(ids) - 1 for ids, _ in docs)
    assert a.rows <= math.ceil(inputs / 64) + 1  # within a row of the least possible
    assert a.fill_ratio == pytest.approx(inputs / (a.rows * 64)) and a.fill_ratio > 0.95
    # what a run counts as tokens: the examples' inputs, never the padding
    assert a.real_inputs(np.arange(a.rows)) == inputs
    rows = np.array([0, a.rows - 1, a.rows - 1])
    batch = a.take(rows)
    padding, keys = 0, ("doc_ids", "inputs", "targets")
    for doc, inputs, targets in zip(*(batch[k] for k in keys), strict=True):
        last = doc == doc.max()  # the padding: a last document of token 0 and no target
        padding += int(last.sum()) * bool((inputs[last] == 0).all() and (targets[last] < 0).all())
    assert padding > 0 and a.real_inputs(rows) == 3 * 64 - padding
    assert a.packs_documents() and "fill 9" in a.summary()


def _held_out(tmp_path: Path, lengths: int = 60) -> MemoryStore:
    tok = byte_tokenizer()
    tok.chat_template = CHATML
    rows = []
    for i in range(lengths):
        q = f"what is {i} plus {i % 7}?"
        rows.append(
            {
                "messages": [
                    {"role": "user", "content": q},
                    {"role": "assistant", "content": f"{i + i % 7}" + " and so on" * (i % 5)},
                ]
            }
        )
    path = tmp_path / "chat.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows))
    return MemoryStore.from_examples(load_examples(str(path), tok)), tok


def _model(tok):
    args = from_name("debug")
    args.n_layers, args.vocab_size = 2, len(tok)
    return build_model(args, seed=5)


def test_held_out_loss_does_not_depend_on_seq_len(tmp_path):
    store, tok = _held_out(tmp_path)
    model = _model(tok)
    longest = int(store._lens.max())

    def loss(packing: str, seq_len: int) -> float:
        data = pack_store(store, seq_len, packing, keep_tail=True)
        return evaluate(model, data, "plain", 4, torch.device("cpu"), True)["eval_loss"]

    whole = [loss("whole", L) for L in (longest, longest + 37, 3 * longest)]
    assert whole[1] == pytest.approx(whole[0], rel=1e-5) and whole[2] == pytest.approx(
        whole[0], rel=1e-5
    )
    # the stream packing cuts examples at row boundaries: its loss moves with --seq-len
    stream = [loss("stream", L) for L in (longest - 5, longest + 37)]
    assert abs(stream[0] - stream[1]) > 1e-3 * abs(stream[0])


def test_eval_loss_equals_transformers_per_example_loss(tmp_path):
    """What a held-out set scores packed whole equals each example run alone through the
    transformers model of the same weights (a chat template; targets on the replies)."""
    transformers = pytest.importorskip("transformers")
    store, tok = _held_out(tmp_path, 24)
    model = _model(tok)
    save_hf(model, tmp_path / "hf", tokenizer=tok)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    data = pack_store(store, int(store._lens.max()) + 20, "whole")
    got = evaluate(model, data, "plain", 4, torch.device("cpu"), True)
    total, count = 0.0, 0
    with torch.no_grad():
        for d in range(store.n_docs):
            ids, flags = store.document(d)
            logp = torch.log_softmax(
                hf(torch.tensor(ids[None], dtype=torch.long)).logits[0].double(), -1
            )
            for t in np.flatnonzero(flags[1:] > 0):
                total -= float(logp[t, int(ids[t + 1])])
                count += 1
    assert got["eval_targets"] == count
    assert got["eval_loss"] == pytest.approx(total / count, rel=1e-4)


def test_a_run_reports_its_fill_ratio(tmp_path):
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from tiny_run import tiny_run

    _, tok = _held_out(tmp_path, 40)
    summary = tiny_run(tmp_path, str(tmp_path / "chat.jsonl"), seq_len=96, max_steps=1)
    assert 0.5 < summary["fill_ratio"] <= 1.0


def test_examples_with_nothing_to_learn_are_counted_and_left_out(tmp_path):
    """A conversation without an assistant reply, a blank reply, a blank completion and a
    blank text teach nothing (not even to stop): packing leaves them out and says how many;
    a source of nothing else is refused."""
    tok = byte_tokenizer()

    def chat(*turns):
        return {"messages": [{"role": r, "content": c} for r, c in turns]}

    groups = [  # (a row with something to learn, rows with nothing) per layout
        (
            chat(("user", "hi"), ("assistant", "yo")),
            [
                chat(("user", "hi"), ("user", "again")),
                chat(("user", "hi"), ("assistant", " "), ("user", "?"), ("assistant", "")),
            ],
        ),
        (
            {"conversations": [{"from": "human", "value": "a"}, {"from": "gpt", "value": "b"}]},
            [
                {"conversations": [{"from": "human", "value": ""}, {"from": "gpt", "value": ""}]},
            ],
        ),
        ({"prompt": "p", "completion": "c"}, [{"prompt": "p", "completion": ""}]),
        ({"text": "words"}, [{"text": "  "}]),
    ]
    for k, (good, rows) in enumerate(groups):
        path = tmp_path / f"d{k}.jsonl"
        path.write_text("\n".join(json.dumps(r) for r in [good, *rows, good]) + "\n")
        examples = load_examples(str(path), tok)
        assert [any(e.is_target) for e in examples] == [True] + [False] * len(rows) + [True]
        data = pack_store(MemoryStore.from_examples(examples), 64, "whole", "right")
        assert data.dropped == len(rows)
        assert f"{len(rows)} with nothing to learn left out" in data.summary()
        assert len(data._docs) == 2
        only = tmp_path / f"only{k}.jsonl"
        only.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
        store = MemoryStore.from_examples(load_examples(str(only), tok))
        with pytest.raises(UserError, match="no row has a token to predict"):
            check_rows(pack_store(store, 64, "whole", "right"), str(only))
