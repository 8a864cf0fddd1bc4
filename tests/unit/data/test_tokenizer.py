import pytest
from transformers import AutoTokenizer

from compiletune.data.tokenizer import byte_tokenizer, load_tokenizer
from compiletune.errors import UserError

TEXTS = [
    "hello world",
    "  leading spaces, trailing space ",
    "line one\nline two\n\n\ttabbed\r\nwindows line\n",
    "héllo wörld — ünïcödé, 日本語, emoji 🤗🚀👩‍👩‍👧, zero\u200bwidth",
    "",
    " ",
    "\n",
]


@pytest.fixture(scope="module")
def tok():
    return byte_tokenizer()


def test_special_ids_and_size(tok):
    assert len(tok) == 259
    assert tok.bos_token == "<|begin_of_text|>" and tok.bos_token_id == 256
    assert tok.eos_token == "<|end_of_text|>" and tok.eos_token_id == 257
    assert tok.pad_token == "<|pad|>" and tok.pad_token_id == 258


@pytest.mark.parametrize("text", TEXTS)
def test_byte_round_trip(tok, text):
    ids = tok.encode(text, add_special_tokens=False)
    assert ids == list(text.encode("utf-8"))  # ids are exactly the UTF-8 bytes
    assert tok.decode(ids) == text


def test_default_call_adds_bos_only(tok):
    assert tok("ab")["input_ids"] == [256, 97, 98]
    # Special-token text inside the input maps to the special id, like HF tokenizers do.
    assert tok.encode("a<|end_of_text|>", add_special_tokens=False) == [97, 257]


def test_save_and_reload_with_auto_tokenizer(tok, tmp_path):
    tok.save_pretrained(tmp_path)
    again = AutoTokenizer.from_pretrained(str(tmp_path), local_files_only=True)
    assert len(again) == 259
    assert (again.bos_token_id, again.eos_token_id, again.pad_token_id) == (256, 257, 258)
    for text in TEXTS:
        ids = again.encode(text, add_special_tokens=False)
        assert ids == list(text.encode("utf-8"))
        assert again.decode(ids) == text
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    assert again.apply_chat_template(messages, tokenize=False) == tok.apply_chat_template(
        messages, tokenize=False
    )
    loaded = load_tokenizer(tmp_path)
    assert loaded.encode("🤗", add_special_tokens=False) == list("🤗".encode())


def test_chat_template_renders(tok):
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi?"},
        {"role": "assistant", "content": "Hello."},
    ]
    text = tok.apply_chat_template(messages, tokenize=False)
    assert text == (
        "<|begin_of_text|>### system:\nBe brief.<|end_of_text|>"
        "### user:\nHi?<|end_of_text|>### assistant:\nHello.<|end_of_text|>"
    )
    prompt = tok.apply_chat_template(messages[:2], tokenize=False, add_generation_prompt=True)
    assert prompt.endswith("<|end_of_text|>### assistant:\n")
    assert text.startswith(prompt)
    ids = tok.encode(text, add_special_tokens=False)
    assert ids[0] == 256 and ids[-1] == 257 and ids.count(256) == 1


def test_load_tokenizer_errors(tmp_path):
    with pytest.raises(UserError, match="does not exist"):
        load_tokenizer(tmp_path / "nope")
    with pytest.raises(UserError, match="no tokenizer files"):
        load_tokenizer(tmp_path)


def test_config_json_transformers_refuses_is_named_not_the_tokenizer(tmp_path):
    """AutoTokenizer reads config.json too: a field transformers' strict config refuses there
    (n_group "4") is reported as config.json's, not as a tokenizer that could not load."""
    import json

    import transformers

    transformers.DeepseekV3Config(n_group=4, topk_group=2).save_pretrained(tmp_path)
    byte_tokenizer().save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(cfg | {"n_group": "4"}))
    with pytest.raises(UserError) as e:
        load_tokenizer(tmp_path, "--tokenizer")
    msg = str(e.value)
    assert str(tmp_path / "config.json") in msg and "n_group" in msg, msg
    assert "could not load the tokenizer" not in msg, msg
