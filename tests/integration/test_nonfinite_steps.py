"""Non-finite steps: a checkpoint whose pad row is zero trains as transformers does, and a step
that is not finite stops the run (SFT and GRPO) with a line that names what it found."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers
from tiny_run import tiny_run

from compiletune.config import resolve
from compiletune.data.tokenizer import byte_tokenizer
from compiletune.metrics import read_metrics
from compiletune.train.build import build_run
from compiletune.train.step import next_batch

SEQ = 64


def save_tiny_gemma3(folder: Path) -> Path:
    """The shape of the Gemma 3 that stopped at step 1 (issue 62): hidden 96, 6 layers, window 48,
    linear rope 8 on the full layers, tied embeddings, and a pad token (the byte tokenizer's bos,
    so every row starts with it) whose embedding row is zero, as transformers initialises it."""
    tok = byte_tokenizer()
    config = transformers.Gemma3TextConfig(
        vocab_size=300,
        hidden_size=96,
        intermediate_size=192,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=32,
        query_pre_attn_scalar=32,
        sliding_window=48,
        layer_types=(["sliding_attention"] * 2 + ["full_attention"]) * 2,
        rope_parameters={
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        },
        max_position_embeddings=256,
        tie_word_embeddings=True,
        pad_token_id=tok.bos_token_id,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
    )
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        model.get_input_embeddings().weight[tok.bos_token_id].zero_()
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def _documents(tmp_path: Path) -> str:
    """Two documents longer than a row: each row is one document, no padding."""
    path = tmp_path / "docs.jsonl"
    texts = ["def add(a, b):\n    return a + b\n" * 6, "The quick brown fox jumps. " * 8]
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return str(path)


def _reference_grad_norm(folder: Path, inputs: torch.Tensor, targets: torch.Tensor) -> float:
    """transformers' gradient norm for the loss the trainer takes: the mean cross-entropy over
    the batch's target tokens."""
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    logits = model(input_ids=inputs).logits.float()
    loss = torch.nn.functional.cross_entropy(
        logits.flatten(0, 1), targets.flatten(), ignore_index=-100, reduction="sum"
    ) / int((targets != -100).sum())
    loss.backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    return float(torch.nn.utils.get_total_norm(grads))


def test_zero_pad_row_first_step_has_transformers_gradient_norm(tmp_path):
    """Every row starts with the pad token, whose embedding is zero: its hidden state stays zero
    through the blocks, where each RMSNorm's slope is 1/sqrt(eps), so the gradient reaching its
    row is ~1e27 per element. transformers' embedding (padding_idx) gives that row no gradient
    from the lookup; the trainer's must not either (before: "the gradient norm is inf")."""
    folder = save_tiny_gemma3(tmp_path / "gemma3")
    flags = dict(model_dir=str(folder), seq_len=SEQ, batch_size=2, dtype="fp32", max_steps=1)
    data = _documents(tmp_path)
    tiny_run(tmp_path, data, **flags)
    (record,) = read_metrics(tmp_path / "run" / "metrics.jsonl")
    # the batch the run's first step drew, from the same build
    probe = flags | {"data": data, "output_dir": str(tmp_path / "probe")}
    batch = next_batch(build_run(resolve({}, probe), None)).micro[0]
    assert (batch["inputs"][:, 0] == byte_tokenizer().bos_token_id).all()
    assert bool((batch["targets"] != -100).all())  # no padding: the reference needs no mask
    expected = _reference_grad_norm(folder, batch["inputs"], batch["targets"])
    assert "nonfinite" not in record, record
    assert record["grad_norm"] == pytest.approx(expected, rel=1e-4)
