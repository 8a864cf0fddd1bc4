"""generation_config.json travels with the weights: a fine-tuned chat model loaded in
transformers still stops at the end of a turn (issue 44, item 1)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers
from tiny_run import tiny_run

from compiletune.data.tokenizer import byte_tokenizer
from compiletune.models import build_model, from_name, save_hf
from compiletune.models.generation_config import end_of_turn_id, generation_config_for

EOT = "<|eot_id|>"
# Llama 3's shape: every message closed by <|eot_id|>, which is not the tokenizer's eos.
LLAMA3 = (
    "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}"
    "<|end_header_id|>\n\n{{ m['content'] }}" + EOT + "{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)


def chat_tokenizer():
    tok = byte_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": [EOT]})
    tok.chat_template = LLAMA3
    return tok


def test_end_of_turn_comes_from_the_template():
    tok = chat_tokenizer()
    eot = tok.convert_tokens_to_ids(EOT)
    assert end_of_turn_id(tok) == eot != tok.eos_token_id
    # added to the source's end tokens, the source's other settings kept
    source = {"eos_token_id": tok.eos_token_id, "temperature": 0.6, "do_sample": True}
    got = generation_config_for(source, tok)
    assert got == {**source, "eos_token_id": [tok.eos_token_id, eot]}
    assert generation_config_for(got, tok) == got  # already there: unchanged
    # no source: one is written for the end of turn alone
    assert generation_config_for(None, tok)["eos_token_id"] == [tok.eos_token_id, eot]
    # a template that closes turns with eos (the byte tokenizer's own), or none: nothing to add
    assert generation_config_for(None, byte_tokenizer()) is None
    plain = byte_tokenizer()
    plain.chat_template = None
    assert end_of_turn_id(plain) is None
    assert generation_config_for(source, plain) == source


def _stops_at_end_of_turn(folder: Path, eot: int) -> bool:
    """Whether transformers' greedy generate, pushed to emit <|eot_id|> first, stops there."""
    model = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    prompt = torch.tensor([[256, 72, 105]])
    out = model.generate(prompt, max_new_tokens=6, do_sample=False, sequence_bias={(eot,): 1000.0})
    assert out[0, 3].item() == eot  # the bias made the first new token the end of turn
    return out.shape[1] == 4


@pytest.mark.slow
def test_checkpoints_and_merged_keep_the_generation_config(tmp_path):
    tok = chat_tokenizer()
    eot = tok.convert_tokens_to_ids(EOT)
    source = tmp_path / "source"
    args = from_name("debug")
    args.n_layers = 1
    save_hf(build_model(args, seed=0), source, tokenizer=tok)
    settings = {"eos_token_id": tok.eos_token_id, "temperature": 0.6, "do_sample": True}
    (source / "generation_config.json").write_text(json.dumps(settings))
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("A short text to train on, twice over. " * 40)

    tiny_run(tmp_path, str(corpus), "full", model_dir=str(source), max_steps=1)
    lora = {"lora_rank": 4, "merge": True, "model_dir": str(source), "max_steps": 1}
    tiny_run(tmp_path, str(corpus), "lora", **lora)
    for folder in (tmp_path / "full/step_1", tmp_path / "lora/step_1", tmp_path / "lora/merged"):
        saved = json.loads((folder / "generation_config.json").read_text())
        assert saved == {**settings, "eos_token_id": [tok.eos_token_id, eot]}, folder
    for folder in (tmp_path / "full/step_1", tmp_path / "lora/merged"):
        assert _stops_at_end_of_turn(folder, eot)
        # what it guards against: the same weights without the file talk past the turn's end
        (folder / "generation_config.json").unlink()
        assert not _stops_at_end_of_turn(folder, eot)
