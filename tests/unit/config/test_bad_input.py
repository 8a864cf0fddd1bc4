"""Bad input, generated: every malformed data row, config.json, tokenizer folder and weights
file makes `compiletune train` print exactly one line `compiletune: error: ...` and exit 2,
with no traceback and no --output-dir written.

Each property draws a few dozen cases (hypothesis); each case fails before any training step,
most before the model's weights are read.
"""

from __future__ import annotations

import json
import re
import shutil
import tempfile
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file
from tiny_hf import save_tiny_llama

from compiletune.cli import main
from compiletune.data.tokenizer import load_tokenizer
from compiletune.errors import UserError
from compiletune.models import from_hf, load_hf_config, resolve_model_path

CASES = settings(
    max_examples=20,
    deadline=None,
    database=None,  # nothing written into the source tree
    derandomize=True,  # the same cases on every run (CI)
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
GOOD_ROW = {
    "messages": [
        {"role": "user", "content": "hello there"},
        {"role": "assistant", "content": "hi, how can I help?"},
    ]
}


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    """A tiny Llama saved by transformers with the byte tokenizer, and a good chat data file."""
    root = tmp_path_factory.mktemp("bad_input")
    save_tiny_llama(root / "model")
    (root / "good.jsonl").write_text((json.dumps(GOOD_ROW) + "\n") * 8)
    return root


def scratch(work: Path) -> Path:
    return Path(tempfile.mkdtemp(dir=work))


def copy_model(work: Path) -> Path:
    dst = scratch(work) / "model"
    shutil.copytree(work / "model", dst)
    return dst


def refused(capsys, argv: list[str], out: Path) -> str:
    """Run `compiletune train ARGV --output-dir OUT`; check the one-line refusal, return it."""
    capsys.readouterr()
    argv = ["train", *argv, "--seq-len", "16", "--batch-size", "1", "--max-steps", "1"]
    argv += ["--packing", "stream"]  # 16 tokens cut the examples: these cases are not about that
    code = main([*argv, "--output-dir", str(out)])
    captured = capsys.readouterr()
    lines = captured.err.strip("\n").split("\n")
    assert code == 2, (code, captured.err[-2000:])
    assert len(lines) == 1 and lines[0].startswith("compiletune: error: "), captured.err
    assert "Traceback" not in captured.err + captured.out
    assert not out.exists()
    return lines[0]


# ----------------------------------------------------------------------------- jsonl rows

_JUNK = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=5),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=3), inner),
    max_leaves=8,
)
_NOT_STR = _JUNK.filter(lambda v: not isinstance(v, str))
_SURROGATE = st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF)


def _message(role=None, content=None) -> dict:
    return {
        "role": "user" if role is None else role,
        "content": "x" if content is None else content,
    }


_BAD_OBJECTS = st.one_of(
    st.builds(lambda v: {"text": v}, _NOT_STR),
    st.builds(lambda v: {"prompt": "p", "completion": v}, _NOT_STR),
    st.builds(lambda v: {"prompt": v, "completion": "c"}, _NOT_STR),
    st.just({"prompt": "only a prompt"}),
    st.just({"completion": "only a completion"}),
    st.dictionaries(st.sampled_from(["txt", "msg", "input", ""]), _JUNK, max_size=3),
    st.builds(lambda v: {"messages": v}, _NOT_STR.filter(lambda v: not isinstance(v, list))),
    st.just({"messages": []}),
    st.builds(lambda v: {"messages": [v, _message("assistant")]}, _NOT_STR),
    st.builds(lambda v: {"messages": [_message(role=v), _message("assistant")]}, _NOT_STR),
    st.builds(lambda v: {"messages": [_message(), _message("assistant", v)]}, _NOT_STR),
    st.just({"messages": [{"content": "no role"}, _message("assistant")]}),
    st.just({"messages": [_message(), {"role": "assistant"}]}),
    st.just({"messages": [_message("human"), _message("assistant")]}),  # a role to map
    st.just({"messages": [_message("assistant"), _message()]}),
    st.builds(lambda s: {"text": "a" + s + "b"}, _SURROGATE),
    st.builds(lambda s: {"messages": [_message(content=s), _message("assistant")]}, _SURROGATE),
    st.builds(lambda s: {"prompt": "p", "completion": s}, _SURROGATE),
)
_BAD_LINES = st.one_of(
    st.builds(lambda o: json.dumps(o).encode(), _BAD_OBJECTS),
    st.builds(lambda v: json.dumps(v).encode(), _NOT_STR.filter(lambda v: not isinstance(v, dict))),
    st.integers(1000, 200_000).map(lambda n: b"[" * n + b"]" * n),  # nested too deeply
    st.integers(5000, 20_000).map(lambda n: b'{"text": ' + b"7" * n + b"}"),  # huge number
    st.integers(1 << 20, 4 << 20).map(lambda n: b'{"junk": "' + b"x" * n + b'"}'),  # huge line
    st.sampled_from([b"{", b'{"text": "a"', b"not json", b'{"text": "\\x"}']),
    # invalid UTF-8: a byte that never starts a character, or a cut multi-byte sequence
    st.tuples(st.text(max_size=5), st.sampled_from([b"\xff", b"\xc3", b"\xe2\x82", b"\x80"])).map(
        lambda t: b'{"text": "' + t[0].encode() + t[1] + b'"}'
    ),
)


@CASES
@given(before=st.integers(0, 3), line=_BAD_LINES)
def test_bad_jsonl_row(work, capsys, before, line):
    folder = scratch(work)
    data = folder / "data.jsonl"
    data.write_bytes((json.dumps(GOOD_ROW).encode() + b"\n") * before + line + b"\n")
    msg = refused(capsys, ["--data", str(data)], folder / "out")
    assert f"{data}:{before + 1}" in msg


@settings(CASES, max_examples=15)
@given(text=st.text(max_size=20), bad=st.sampled_from([b"\xff", b"\xc0\xaf", b"\xed\xa0\x80"]))
def test_txt_with_invalid_utf8(work, capsys, text, bad):
    folder = scratch(work)
    data = folder / "data.txt"
    data.write_bytes(b"good line\n" + text.encode() + bad + b"\nmore\n")
    assert f"{data}:" in refused(capsys, ["--data", str(data)], folder / "out")


# ----------------------------------------------------------------------------- config.json

_INT_FIELDS = [
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "vocab_size",
    "max_position_embeddings",
]
_WRONG_INT = st.one_of(
    st.integers(-5, 0),
    st.booleans(),
    st.floats(allow_nan=False).filter(lambda f: not f.is_integer()),
    st.text(max_size=4),
    st.lists(st.integers(), max_size=2),
    st.dictionaries(st.text(max_size=2), st.integers(), max_size=2),
)
_CONFIG_CHANGES = st.one_of(
    st.tuples(st.sampled_from(_INT_FIELDS), _WRONG_INT),
    st.tuples(
        st.sampled_from(["rms_norm_eps", "rope_theta"]),
        st.text(max_size=3) | st.lists(st.integers(), max_size=2) | st.integers(-3, 0),
    ),
    st.tuples(st.just("tie_word_embeddings"), st.integers() | st.text(max_size=3)),
    st.tuples(st.just("hidden_act"), st.integers() | st.lists(st.text(max_size=2), max_size=2)),
    st.tuples(
        st.just("architectures"),
        st.text(min_size=1, max_size=5) | st.lists(st.integers(), min_size=1, max_size=2),
    ),
    st.tuples(
        st.just("rope_scaling"),
        st.text(max_size=3) | st.integers() | st.lists(st.integers(), min_size=1),
    ),
    st.tuples(
        st.just("layer_types"),
        st.lists(st.just("full_attention"), max_size=5).filter(lambda v: len(v) != 2),
    ),
    # a required field missing (None: delete it)
    st.tuples(
        st.sampled_from(
            [
                "hidden_size",
                "num_hidden_layers",
                "num_attention_heads",
                "vocab_size",
                "intermediate_size",
            ]
        ),
        st.none(),
    ),
)


@CASES
@given(change=_CONFIG_CHANGES)
def test_bad_config_field(work, capsys, change):
    model = copy_model(work)
    key, value = change
    cfg = json.loads((model / "config.json").read_text())
    if value is None:
        del cfg[key]
    else:
        cfg[key] = value
    (model / "config.json").write_text(json.dumps(cfg))
    argv = ["--model-dir", str(model), "--data", str(work / "good.jsonl")]
    msg = refused(capsys, argv, model.parent / "out")
    # the config named, never a tokenizer that could not load (transformers reads config.json)
    assert ("config.json" in msg or "checkpoint" in msg) and "load the tokenizer" not in msg, msg


@settings(CASES, max_examples=15)
@given(
    text=st.one_of(
        st.builds(json.dumps, _JUNK.filter(lambda v: not isinstance(v, dict))),
        st.sampled_from(["", "{", '{"hidden_size": 32,}', "[1, 2", "\x00"]),
        st.integers(1000, 100_000).map(lambda n: "[" * n + "]" * n),
    )
)
def test_config_json_not_an_object(work, capsys, text):
    model = copy_model(work)
    (model / "config.json").write_text(text)
    argv = ["--model-dir", str(model), "--data", str(work / "good.jsonl")]
    assert f"{model / 'config.json'}" in refused(capsys, argv, model.parent / "out")


def test_missing_model_folder_and_config(work, capsys):
    folder = scratch(work)
    data = ["--data", str(work / "good.jsonl")]
    msg = refused(capsys, ["--model-dir", str(folder / "none"), *data], folder / "out")
    assert "model folder" in msg and "does not exist" in msg and "tokenizer folder" not in msg
    model = copy_model(work)
    (model / "config.json").unlink()
    assert "has no config.json" in refused(capsys, ["--model-dir", str(model), *data], folder / "o")


def test_hub_id_not_cached_and_cached(work, capsys, monkeypatch):
    cache = scratch(work)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))  # what compiletune/hub.py reads
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    argv = ["--model-dir", "someorg/tiny-model", "--data", str(work / "good.jsonl")]
    msg = refused(capsys, argv, cache / "out")
    assert (
        "--model-dir someorg/tiny-model: no such local path, and not in the HF cache" in msg
        and "HF_HUB_OFFLINE" in msg
    )
    # the same id in the local HF cache: found there, nothing downloaded
    repo = cache / "models--someorg--tiny-model"
    shutil.copytree(work / "model", repo / "snapshots" / "abc123")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("abc123")
    assert resolve_model_path("someorg/tiny-model") == repo / "snapshots" / "abc123"
    assert load_hf_config("someorg/tiny-model")["hidden_size"] == 32


# ----------------------------------------------------------------------------- tokenizer

_TOKENIZER_FILES = ["tokenizer.json", "tokenizer_config.json", "chat_template.jinja"]


@settings(CASES, max_examples=15)
@given(
    removed=st.sets(st.sampled_from(_TOKENIZER_FILES), min_size=1),
    cut=st.none() | st.integers(0, 2000),
)
def test_tokenizer_missing_pieces(work, capsys, removed, cut):
    model = copy_model(work)
    for name in removed:
        (model / name).unlink()
    if cut is not None and (model / "tokenizer.json").exists():
        data = (model / "tokenizer.json").read_bytes()
        (model / "tokenizer.json").write_bytes(data[:cut])
    argv = ["--model-dir", str(model), "--data", str(work / "good.jsonl")]
    refused(capsys, argv, model.parent / "out")


def test_tokenizer_without_vocabulary_is_refused(work):
    """tokenizer_config.json naming a tokenizer class, without tokenizer.json: transformers
    builds a tokenizer of the special tokens only, which encodes text to nothing."""
    model = copy_model(work)
    (model / "tokenizer.json").unlink()
    cfg = json.loads((model / "tokenizer_config.json").read_text())
    cfg["tokenizer_class"] = "LlamaTokenizer"
    (model / "tokenizer_config.json").write_text(json.dumps(cfg))
    with pytest.raises(UserError, match="tokenizer.json is missing"):
        load_tokenizer(model)


# ----------------------------------------------------------------------------- weights

_WEIGHT_CHANGES = st.one_of(
    st.tuples(st.just("shape"), st.integers(0, 100)),
    st.tuples(
        st.just("dtype"), st.sampled_from([torch.int32, torch.int64, torch.int8, torch.bool])
    ),
    st.tuples(st.just("nan"), st.sampled_from([float("nan"), float("inf"), float("-inf")])),
    st.tuples(st.just("missing"), st.integers(0, 100)),
    st.tuples(st.just("truncate"), st.floats(0.0, 0.999)),
)


@CASES
@given(pick=st.integers(0, 1000), change=_WEIGHT_CHANGES)
def test_bad_weights(work, capsys, pick, change):
    model = copy_model(work)
    file = model / "model.safetensors"
    kind, value = change
    if kind == "truncate":
        data = file.read_bytes()
        file.write_bytes(data[: int(len(data) * value)])
    else:
        tensors = load_file(str(file))
        name = sorted(tensors)[pick % len(tensors)]
        t = tensors[name]
        if kind == "shape":
            tensors[name] = torch.zeros(*t.shape[:-1], t.shape[-1] + 1 + value % 3)
        elif kind == "dtype":
            tensors[name] = t.to(value)
        elif kind == "nan":
            t.view(-1)[pick % t.numel()] = value
        else:
            del tensors[name]
        save_file(tensors, str(file), metadata={"format": "pt"})
    argv = ["--model-dir", str(model), "--data", str(work / "good.jsonl")]
    msg = refused(capsys, argv, model.parent / "out")
    assert str(file) in msg or (kind == "missing" and str(model) in msg)


def test_weights_loaded_are_checked_directly(work):
    model = copy_model(work)
    file = model / "model.safetensors"
    tensors = load_file(str(file))
    tensors["model.layers.0.self_attn.q_proj.weight"] = torch.ones(32, 32, dtype=torch.int32)
    save_file(tensors, str(file), metadata={"format": "pt"})
    with pytest.raises(UserError, match=r"q_proj\.weight' is stored as I32"):
        from_hf(model)


def test_checkpoint_without_weights_is_incomplete(work, capsys):
    model = copy_model(work)
    step = model.parent / "step_3"
    model.rename(step)
    (step / "model.safetensors").unlink()
    argv = ["--model-dir", str(step), "--data", str(work / "good.jsonl")]
    assert "is incomplete" in refused(capsys, argv, step.parent / "out")


# ----------------------------------------------------------------------------- YAML run files


def _wrong_value(field) -> st.SearchStrategy:
    """Values of the wrong type (or out of range) for a config field."""
    import typing

    from compiletune.config import hints_of, unwrap

    hint = next(h for cls in _SECTION_CLASSES for n, h in hints_of(cls).items() if n == field.name)
    typ, _ = unwrap(hint)
    junk = st.lists(st.integers(), min_size=1, max_size=2) | st.dictionaries(
        st.text(max_size=3), st.integers(), min_size=1, max_size=2
    )
    if typing.get_origin(typ) is typing.Literal:
        allowed = typing.get_args(typ)
        return junk | st.text(max_size=8).filter(lambda s: s not in allowed)
    if typ is bool:
        return junk | st.sampled_from(["maybe", "on please", 2, 1.5])
    if typ is int:
        return junk | st.sampled_from(["eight", 1.5, True, "1e3"])
    if typ is float:
        return junk | st.sampled_from(["fast", ".nan", float("inf"), float("-inf"), True])
    return junk | st.integers() | st.booleans()  # a str field


def _section_classes() -> list[type]:
    from compiletune.config import SECTIONS

    return list(SECTIONS.values())


_SECTION_CLASSES = _section_classes()


@st.composite
def _bad_yaml(draw) -> str:
    import dataclasses

    import yaml

    from compiletune.config import key_of

    kind = draw(st.sampled_from(["wrong value", "unknown key", "not a mapping", "syntax", "twice"]))
    fields = [f for cls in _SECTION_CLASSES for f in dataclasses.fields(cls)]
    if kind == "wrong value":
        # not the options `refused` passes as flags (a flag overrides the file)
        given = {"seq_len", "batch_size", "max_steps", "output_dir"}
        f = draw(st.sampled_from([f for f in fields if key_of(f) not in given]))
        value = draw(_wrong_value(f))
        if value == ".nan":
            return f"{key_of(f)}: .nan\n"
        return yaml.safe_dump({key_of(f): value})
    if kind == "unknown key":
        key = draw(st.text("abcdefgh_-", min_size=1, max_size=10))
        known = {key_of(f) for f in fields}
        if key.replace("-", "_") in known:
            key += "_x"
        return yaml.safe_dump({key: 1, "seq_len": 16})
    if kind == "not a mapping":
        return yaml.safe_dump(draw(st.lists(st.integers(), min_size=1) | st.text(min_size=1)))
    if kind == "syntax":
        return draw(
            st.sampled_from(["a: [1, 2\n", "seq_len: 1\n  bad: indent\n", "{: }", "- a\nb: c\n"])
        )
    f = draw(st.sampled_from([f for f in fields if "_" in key_of(f)]))
    return f"{key_of(f)}: 1\n{key_of(f).replace('_', '-')}: 2\n"


@CASES
@given(text=_bad_yaml())
def test_bad_yaml_run_file(work, capsys, text):
    folder = scratch(work)
    (folder / "run.yaml").write_text(text)
    line = refused(capsys, ["--config", str(folder / "run.yaml")], folder / "out")
    assert "--config" in line or re.search(r"--[a-z]", line), line
