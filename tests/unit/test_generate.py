"""`compiletune generate`: KV-cache decoding equals full forwards and transformers' greedy output."""

from __future__ import annotations

import io
import re

import pytest
import torch
import transformers
from tiny_run import tiny_run

from compiletune.cli import main
from compiletune.data.tokenizer import byte_tokenizer
from compiletune.generate import (
    Sampling,
    encode_prompt,
    generate_ids,
    run_generate,
    top_p_filter,
)
from compiletune.models import from_hf
from compiletune.models.decoder import KVCache

VOCAB = 260  # the byte tokenizer's 259 tokens, and one spare

CONFIGS = {
    # GQA, llama3 rope scaling, explicit head_dim
    "llama": transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        rope_theta=500000.0,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16,
        },
        max_position_embeddings=256,
        bos_token_id=256,
        eos_token_id=257,
    ),
    # q/k/v bias, tied embeddings
    "qwen2": transformers.Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=1,
        tie_word_embeddings=True,
        max_position_embeddings=256,
        bos_token_id=256,
        eos_token_id=257,
    ),
}


def make_checkpoint(tmp_path, family: str):
    """A tiny random HF model with the byte tokenizer, saved as a user's folder."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(CONFIGS[family]).eval()
    with torch.no_grad():  # larger weights: peaked next-token distributions, no near-ties
        for name, p in model.named_parameters():
            if not name.endswith("norm.weight"):
                p.normal_(0.0, 0.3 if "embed" in name or "lm_head" in name else 0.1)
    folder = tmp_path / family
    model.save_pretrained(folder)
    byte_tokenizer().save_pretrained(folder)
    return model, folder


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_greedy_matches_transformers_generate(tmp_path, family):
    hf, folder = make_checkpoint(tmp_path, family)
    tok = byte_tokenizer()
    prompt = tok("The quick brown fox")["input_ids"]
    want = hf.generate(
        torch.tensor([prompt]),
        attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        max_new_tokens=40,
        do_sample=False,
        eos_token_id=None,  # compare all 40 tokens
        pad_token_id=tok.pad_token_id,
    )[0, len(prompt) :].tolist()
    ours = from_hf(folder).eval()
    assert list(generate_ids(ours, prompt, 40)) == want


def test_cached_logits_equal_full_forward(tmp_path):
    _, folder = make_checkpoint(tmp_path, "llama")
    model = from_hf(folder).eval()
    tokens = torch.randint(0, 256, (1, 30), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full = model(tokens)  # [1, 30, v]
        cache = KVCache(model.args, 1, 30, torch.float32, "cpu")
        # a prefill of 12 tokens, one step of 1, a chunk of 5, then one at a time
        pieces = [tokens[:, :12], tokens[:, 12:13], tokens[:, 13:18]]
        pieces += [tokens[:, i : i + 1] for i in range(18, 30)]
        cached = torch.cat([model.output(model.hidden_states_cached(p, cache)) for p in pieces], 1)
    assert cache.length == 30
    torch.testing.assert_close(cached, full, rtol=1e-5, atol=1e-5)


def test_top_p_filter():
    probs = torch.tensor([0.1, 0.5, 0.15, 0.25])
    assert top_p_filter(probs, 0.7).tolist() == [0.0, 0.5, 0.0, 0.25]  # 0.5 + 0.25 >= 0.7
    assert top_p_filter(probs, 0.5).tolist() == [0.0, 0.5, 0.0, 0.0]
    assert top_p_filter(probs, 1.0).tolist() == probs.tolist()


def test_sampling_is_seeded_and_tiny_top_p_is_greedy(tmp_path):
    _, folder = make_checkpoint(tmp_path, "llama")
    model = from_hf(folder).eval()
    prompt = byte_tokenizer()("Once")["input_ids"]

    def sample(seed, top_p=0.9, temperature=1.5):
        return list(generate_ids(model, prompt, 30, Sampling(temperature, top_p, seed)))

    assert sample(1) == sample(1)
    assert sample(1) != sample(2)
    assert sample(5, top_p=1e-6) == list(generate_ids(model, prompt, 30))


def test_chat_prompt_uses_the_template():
    tok = byte_tokenizer()
    ids = encode_prompt(tok, "hi", chat=True)
    assert tok.decode(ids) == "<|begin_of_text|>### user:\nhi<|end_of_text|>### assistant:\n"
    history = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
    assert tok.decode(encode_prompt(tok, "c", True, history)).count("### ") == 4
    assert encode_prompt(tok, "hi", chat=False) == tok("hi")["input_ids"]


def test_generate_command_and_chat_session(tmp_path, capsys):
    _, folder = make_checkpoint(tmp_path, "qwen2")
    assert (
        main(["generate", "--model-dir", str(folder), "--prompt", "Hi", "--max-new-tokens", "8"])
        == 0
    )
    captured = capsys.readouterr()
    assert len(captured.out) > 0 and re.search(r"\d+ tokens in [\d.]+s", captured.err)
    out = io.StringIO()
    replies = run_generate(
        str(folder),
        None,
        True,
        6,
        Sampling(),
        stdin=io.StringIO("hello\nand then?\n\nnot read\n"),
        out=out,
        log=lambda line: None,
    )
    assert len(replies) == 2  # the empty line ended the session


@pytest.mark.parametrize(
    "argv, needle",
    [
        ([], "pass --prompt TEXT, or --chat"),
        (["--prompt", "x", "--top-p", "0.9"], "add --temperature"),
        (["--prompt", "x", "--max-new-tokens", "1000"], "exceeds the model's 256 positions"),
    ],
)
def test_generate_bad_input(tmp_path, capsys, argv, needle):
    _, folder = make_checkpoint(tmp_path, "llama")
    capsys.readouterr()  # transformers' save progress bar
    assert main(["generate", "--model-dir", str(folder), *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and needle in err[0], err


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["--temperature", "nan"], "--temperature must be a finite number >= 0"),
        (["--temperature", "inf"], "--temperature must be a finite number >= 0"),
        (["--temperature", "1", "--top-p", "nan"], "--top-p must be in (0, 1]"),
        (["--max-new-tokens", "0"], "--max-new-tokens must be at least 1"),
        # what Python makes of a command-line byte that is not UTF-8 (surrogateescape)
        (["--prompt", b"ab\xffc".decode("utf-8", "surrogateescape")], "byte 0xff at offset 2"),
    ],
)
def test_generate_input_is_checked_before_anything_loads(tmp_path, capsys, argv, needle):
    """The model folder does not exist: these are reported first, as one line."""
    missing = str(tmp_path / "none")
    assert main(["generate", "--model-dir", missing, "--prompt", "x", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and needle in err[0], err


def test_chat_input_that_is_not_utf8_names_its_line(tmp_path, capsys, monkeypatch):
    _, folder = make_checkpoint(tmp_path, "llama")
    stdin = io.TextIOWrapper(io.BytesIO(b"hello\nbad \xfe\xff here\n"), encoding="utf-8")
    monkeypatch.setattr("sys.stdin", stdin)
    capsys.readouterr()
    argv = ["generate", "--model-dir", str(folder), "--chat", "--max-new-tokens", "2"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert "stdin line 2 is not valid UTF-8 (byte 0xfe at offset 4)" in err[-1], err
    assert not any("Traceback" in line for line in err)


def test_generate_missing_model_dir(tmp_path, capsys):
    assert main(["generate", "--model-dir", str(tmp_path / "none"), "--prompt", "x"]) == 2
    assert "does not exist" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert main(["generate", "--model-dir", str(tmp_path / "empty"), "--prompt", "x"]) == 2
    assert "holds neither config.json nor a LoRA adapter" in capsys.readouterr().err


def _greedy(folder, prompt="The quick brown", n=16) -> str:
    return run_generate(
        str(folder), prompt, False, n, Sampling(), out=io.StringIO(), log=lambda line: None
    )[0]


@pytest.mark.parametrize("base", ["folder", "preset"])
def test_generate_from_lora_checkpoint_equals_merged(tmp_path, base):
    """A LoRA run's step_N (adapters only) generates what its --merge export generates."""
    data = tmp_path / "d.txt"
    data.write_text("the quick brown fox jumps over the lazy dog. " * 40)
    if base == "folder":
        _, folder = make_checkpoint(tmp_path, "llama")
        where = {"model_dir": str(folder)}
    else:
        where = {"model": "debug", "n_layers": 2}
    tiny_run(
        tmp_path,
        str(data),
        lora_rank=4,
        lr=0.05,
        merge=True,
        max_steps=4,
        save_every=4,
        dtype="fp32",
        **where,
    )
    out = tmp_path / "run"
    step = out / "step_4"
    assert (step / "adapter_config.json").is_file() and not (step / "config.json").exists()
    text = _greedy(step)
    assert text == _greedy(out / "merged")
    if base == "folder":  # the adapters were applied: the base alone continues differently
        assert text != _greedy(folder)


def test_generate_lora_checkpoint_without_its_base(tmp_path, capsys):
    _, folder = make_checkpoint(tmp_path, "llama")
    data = tmp_path / "d.txt"
    data.write_text("some text to learn from, repeated. " * 20)
    tiny_run(tmp_path, str(data), lora_rank=4, max_steps=1, model_dir=str(folder))
    step = tmp_path / "run" / "step_1"
    moved = tmp_path / "elsewhere"
    folder.rename(moved)
    capsys.readouterr()
    assert main(["generate", "--model-dir", str(step), "--prompt", "x"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "names the base model" in err[0] and str(folder) in err[0], err
