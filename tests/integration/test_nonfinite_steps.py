"""Non-finite steps: a checkpoint whose pad row is zero trains as transformers does, and a step
that is not finite stops the run (SFT and GRPO) with a line that names what it found."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
import transformers
from tiny_run import tiny_run

from compiletune.cli import main
from compiletune.config import resolve
from compiletune.data.tokenizer import byte_tokenizer
from compiletune.metrics import read_metrics
from compiletune.train.build import build_run
from compiletune.train.nonfinite import cause
from compiletune.train.step import next_batch

SEQ = 64


def save_tiny_gemma3(folder: Path, pad: bool = True) -> Path:
    """The shape of the Gemma 3 that stopped at step 1 (issue 62): hidden 96, 6 layers, window 48,
    linear rope 8 on the full layers, tied embeddings, and a pad token (the byte tokenizer's bos,
    so every row starts with it) whose embedding row is zero, as transformers initialises it.
    `pad=False`: the same weights with no pad token in config.json, so the zero row trains (in
    transformers too) and the first step's gradient norm overflows."""
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
        pad_token_id=tok.bos_token_id if pad else None,
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


# ----------------------------------------------------------------------------- the stop line


def test_cause_names_the_parameters_whose_gradients_are_not_finite():
    model = torch.nn.Sequential(*(torch.nn.Linear(4, 4) for _ in range(5)))
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    model[1].weight.grad[0, 2] = float("inf")
    model[3].bias.grad[1] = float("nan")
    model[4].weight.grad[2, 2] = float("nan")
    model[4].bias.grad[3] = float("-inf")
    line = cause(model, 1.5, float("nan"))
    assert line == (
        "the gradient norm is nan: the gradients of 4 of 10 parameters are not finite "
        "(1.weight, 3.bias, 4.weight, ...)"
    )
    for p in model.parameters():  # finite gradients whose norm overflows: the largest named
        p.grad = torch.randn_like(p)
    model[2].weight.grad[1, 1] = 3e30
    line = cause(model, 1.5, float("inf"))
    assert line.endswith(
        "every gradient is finite but their norm overflows (the largest, 3e+30, is in 2.weight)"
    )
    with torch.no_grad():
        model[0].bias[0] = float("inf")
    assert cause(model, float("nan"), None) == (
        "the loss is nan: the weights of 1 of 10 parameters (0.bias) are not finite"
    )


def _one_error_line(capsys: pytest.CaptureFixture) -> str:
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and err[0].startswith("compiletune: error: "), err
    return err[0]


def test_a_first_step_that_overflows_names_the_parameter_and_blames_the_model(tmp_path, capsys):
    """Step 1 of an fp32 run: no update was applied, so neither a lower lr nor --dtype fp32 is
    the advice; the line names the parameter, and its command steps over the batch."""
    folder = save_tiny_gemma3(tmp_path / "gemma3", pad=False)
    capsys.readouterr()  # transformers' own bars
    out = tmp_path / "run"
    flags = ["--seq-len", str(SEQ), "--batch-size", "2", "--dtype", "fp32", "--max-steps", "2"]
    argv = ["train", "--model-dir", str(folder), "--data", _documents(tmp_path), *flags]
    assert main([*argv, "--output-dir", str(out)]) == 2
    line = _one_error_line(capsys)
    assert line.startswith(
        "compiletune: error: step 1: the gradient norm is inf: every gradient is finite but "
        "their norm overflows (the largest, "
    ), line
    assert "is in tok_embeddings.weight)" in line
    assert f"the weights are the ones the run started from ({folder})" in line
    assert "the learning rate is not the cause: the model or this batch is" in line
    assert "--dtype fp32" not in line and "--lr" not in line
    assert line.endswith("step over the batch: --skip-nonfinite 1 --overwrite")


def test_a_diverged_fp32_run_is_not_told_to_use_fp32(tmp_path, capsys):
    """Updates were applied before the bad step: a lower lr is the advice, and the line says
    what was not finite; fp32 already, so no --dtype fp32."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(f"Line {i}: a fox counts to {i * 7 % 13}." for i in range(300)))
    argv = ["train", "--data", str(corpus), "--seq-len", "32", "--batch-size", "2"]
    out = tmp_path / "run"
    assert main([*argv, "--lr", "1e10", "--max-steps", "8", "--output-dir", str(out)]) == 2
    line = _one_error_line(capsys)
    assert "start again with a lower learning rate (--lr 0.001 --overwrite)" in line
    assert "--dtype fp32" not in line
    # the cause, after the value: which parameters, or the forward pass
    assert re.search(
        r"step \d+: the (loss|gradient norm) is (nan|inf)( with finite weights)?: ", line
    )


def test_grpo_stops_at_a_nonfinite_gradient_norm_with_one_line(tmp_path, capsys, monkeypatch):
    """Before: every step recorded a non-finite norm, skipped its update, and the run exited 0
    with the weights unchanged. Now the check SFT runs stops it the same way."""
    folder = save_tiny_gemma3(tmp_path / "gemma3", pad=False)
    (tmp_path / "length_reward.py").write_text(
        "def length(completions, **_):\n    return [float(len(c)) for c in completions]\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"{a}+{a}="}) + "\n" for a in range(8)))
    capsys.readouterr()
    out = tmp_path / "run"
    argv = ["train", "--model-dir", str(folder), "--data", str(prompts), "--objective", "grpo"]
    argv += ["--reward", "length_reward:length", "--num-generations", "4"]
    argv += ["--max-new-tokens", "4", "--seq-len", "32", "--batch-size", "1", "--dtype", "fp32"]
    assert main([*argv, "--max-steps", "3", "--output-dir", str(out)]) == 2
    line = _one_error_line(capsys)
    assert line.startswith("compiletune: error: step 1: the gradient norm is inf: "), line
    assert "the learning rate is not the cause" in line
    (record,) = read_metrics(out / "metrics.jsonl")
    assert record["applied"] is False and record["nonfinite"].startswith("the gradient norm is")
