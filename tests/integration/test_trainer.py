"""The training loop end to end on tiny models: loss, metrics, checkpoints, resume, bad input."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file
from tiny_run import tiny_run

from compiletune.cli import main
from compiletune.config import resolve
from compiletune.data.tokenizer import byte_tokenizer
from compiletune.errors import UserError
from compiletune.metrics import read_metrics
from compiletune.models import build_model, from_name, save_hf
from compiletune.train.loop import train

TEXT = "\n".join(
    f"Line {i}: the quick brown fox jumps over the lazy dog, and counts to {i * 7 % 13}."
    for i in range(400)
)


@pytest.fixture()
def corpus(tmp_path: Path) -> str:
    path = tmp_path / "corpus.txt"
    path.write_text(TEXT)
    return str(path)


run = tiny_run


def test_loss_falls_and_metrics_are_written(tmp_path, corpus):
    summary = run(tmp_path, corpus, max_steps=30, lr=3e-3)
    rows = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(1, 31))
    for key in ("step", "loss", "lr", "tokens_per_s", "peak_mem_gib"):
        assert all(isinstance(r[key], (int, float)) for r in rows), key
    first = sum(r["loss"] for r in rows[:3]) / 3
    last = sum(r["loss"] for r in rows[-3:]) / 3
    assert last < 0.7 * first, (first, last)
    assert summary["steps"] == 30 and not summary["interrupted"]
    saved = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert saved["final_loss"] == pytest.approx(rows[-1]["loss"])
    assert (tmp_path / "run" / "config.yaml").is_file()


def test_checkpoint_loads_and_generates_in_transformers(tmp_path, corpus):
    run(tmp_path, corpus, max_steps=2)
    step_dir = tmp_path / "run" / "step_2"
    hf = transformers.AutoModelForCausalLM.from_pretrained(step_dir)
    tok = transformers.AutoTokenizer.from_pretrained(step_dir)
    ids = tok("The quick", return_tensors="pt").input_ids
    out = hf.generate(ids, max_new_tokens=5, do_sample=False)
    assert out.shape[1] == ids.shape[1] + 5
    assert isinstance(tok.decode(out[0]), str)


def test_grad_accumulation_equals_one_big_batch(tmp_path, corpus):
    # Batches deal rows in one order, so 2 micro-batches of 2 rows are the rows of one batch of 4.
    run(tmp_path, corpus, name="big", batch_size=4, grad_accum=1, max_steps=1)
    run(tmp_path, corpus, name="acc", batch_size=2, grad_accum=2, max_steps=1)
    big = read_metrics(tmp_path / "big" / "metrics.jsonl")[0]
    acc = read_metrics(tmp_path / "acc" / "metrics.jsonl")[0]
    assert acc["loss"] == pytest.approx(big["loss"], rel=1e-5)
    assert acc["grad_norm"] == pytest.approx(big["grad_norm"], rel=1e-4)
    w_big = load_file(tmp_path / "big" / "step_1" / "model.safetensors")
    w_acc = load_file(tmp_path / "acc" / "step_1" / "model.safetensors")
    for name, tensor in w_big.items():
        torch.testing.assert_close(w_acc[name], tensor, rtol=1e-4, atol=1e-5)


def test_resume_reproduces_the_uninterrupted_run(tmp_path, capsys):
    # A corpus of ~25 rows so that 8 steps of 4 rows cross an epoch boundary after the resume.
    corpus = tmp_path / "small.txt"
    corpus.write_text(TEXT[:1600])
    corpus = str(corpus)
    flags = {"max_steps": 8, "save_every": 4, "seq_len": 64, "batch_size": 4}
    first = run(tmp_path, corpus, name="full", **flags)
    full = read_metrics(tmp_path / "full" / "metrics.jsonl")
    # a text corpus is one stream cut into rows: no padding
    assert all((r["tokens"], r["padding"]) == (4 * 64, 0) for r in full)
    assert (first["tokens"], first["padding_tokens"]) == (8 * 4 * 64, 0)
    assert first["run_totals"]["tokens"] == first["tokens"]

    # A run that died after step 4: its step_4 checkpoint, a stale half-written save, and
    # metrics lines past the checkpoint that the resumed run must replace.
    part = tmp_path / "part"
    part.mkdir()
    shutil.copytree(tmp_path / "full" / "step_4", part / "step_4")
    shutil.copy(tmp_path / "full" / "config.yaml", part / "config.yaml")  # written at the start
    (part / ".tmp-step_6").mkdir()
    (part / "metrics.jsonl").write_text(
        "".join(json.dumps(r) + "\n" for r in full[:5])  # step 5 was logged, not saved
    )
    capsys.readouterr()
    again = run(tmp_path, corpus, name="part", resume=True, **flags)
    resumed = read_metrics(part / "metrics.jsonl")
    assert [r["step"] for r in resumed] == list(range(1, 9))
    assert [r["loss"] for r in resumed] == [r["loss"] for r in full]
    # The summary counts this invocation's 4 steps, and the run's 8 apart.
    assert (again["steps"], again["first_step"], again["step"]) == (4, 5, 8)
    assert again["tokens"] == sum(r["tokens"] for r in full[4:])
    assert again["run_totals"]["steps"] == 8
    assert again["run_totals"]["tokens"] == first["tokens"]
    closing = capsys.readouterr().out.strip().splitlines()[-1]
    assert closing.startswith("done: steps 5-8 (4 this time, 8 in all)"), closing
    assert f"{again['tokens']} tokens this time" in closing
    assert f", {first['tokens']} in all in " in closing
    assert full[-1]["epoch"] >= 1  # the epoch boundary was crossed after the resume point
    a = load_file(tmp_path / "full" / "step_8" / "model.safetensors")
    b = load_file(part / "step_8" / "model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_fine_tune_from_hf_dir_with_prompt_completion(tmp_path):
    # A tiny HF-format Llama with the byte tokenizer, as a user's --model-dir.
    args = from_name("debug")
    args.n_layers, args.dim, args.ffn_dim, args.n_heads, args.n_kv_heads = 2, 64, 128, 4, 2
    model_dir = tmp_path / "tiny-llama"
    save_hf(build_model(args, seed=3), model_dir, tokenizer=byte_tokenizer())
    data = tmp_path / "sft.jsonl"
    lines = [{"prompt": f"Q: what is {i} + {i}? A: ", "completion": str(2 * i)} for i in range(300)]
    data.write_text("\n".join(json.dumps(x) for x in lines))
    summary = train(
        resolve(
            {},
            {
                "model_dir": str(model_dir),
                "data": str(data),
                "seq_len": 64,
                "batch_size": 2,
                "max_steps": 3,
                "output_dir": str(tmp_path / "ft"),
            },
        )
    )
    assert summary["steps"] == 3
    rows = read_metrics(tmp_path / "ft" / "metrics.jsonl")
    # Only completions (a few digits + eos per example) are targets.
    assert all(r["targets"] < 0.25 * r["tokens"] for r in rows)
    # Whole examples pad their rows: tokens count the examples' own, padding apart.
    assert all(r["tokens"] + r["padding"] == 2 * 64 for r in rows)
    assert summary["padding_tokens"] == sum(r["padding"] for r in rows) > 0
    assert summary["tokens"] == sum(r["tokens"] for r in rows)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ft" / "step_3")
    assert hf.config.num_hidden_layers == 2


def test_bf16_run_is_finite(tmp_path, corpus):
    summary = run(tmp_path, corpus, dtype="bf16", max_steps=3)
    assert torch.isfinite(torch.tensor(summary["final_loss"]))
    cfg = json.loads((tmp_path / "run" / "step_3" / "config.json").read_text())
    assert cfg.get("torch_dtype", cfg.get("dtype")) == "bfloat16"


# --- bad input: one line, exit code 2, nothing written -------------------------------------


def _bad_jsonl(tmp_path: Path) -> str:
    p = tmp_path / "bad.jsonl"
    p.write_text('{"text": "fine"}\n{"text": broken}\n')
    return str(p)


def _short_txt(tmp_path: Path) -> str:
    p = tmp_path / "short.txt"
    p.write_text("tiny")
    return str(p)


def _long_prompts(tmp_path: Path) -> str:
    p = tmp_path / "long.jsonl"
    p.write_text(json.dumps({"prompt": "a long question " * 4, "completion": " yes"}) + "\n")
    return str(p)


def _mismatched_dir(tmp_path: Path) -> str:
    args = from_name("debug")
    args.n_layers, args.dim, args.ffn_dim, args.n_heads, args.n_kv_heads = 1, 64, 128, 4, 2
    d = tmp_path / "mismatch"
    save_hf(build_model(args), d, tokenizer=byte_tokenizer())
    config = json.loads((d / "config.json").read_text())
    config["intermediate_size"] = 96  # the weights say 128
    (d / "config.json").write_text(json.dumps(config))
    return str(d)


def _big_tokenizer(tmp_path: Path) -> str:
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"w{i}": i for i in range(600)} | {"[UNK]": 600}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]")
    fast.save_pretrained(tmp_path / "bigtok")
    return str(tmp_path / "bigtok")


def _file_as_parent(tmp_path: Path) -> str:
    (tmp_path / "afile").write_text("x")
    return str(tmp_path / "afile" / "out")


BAD = [
    (lambda t: ["--model", "llama9_1b"], "unknown"),
    (lambda t: ["--model-dir", str(t / "nowhere")], "nowhere"),
    (lambda t: ["--model-dir", _mismatched_dir(t)], "feed_forward|mlp|128|96"),
    (lambda t: ["--data", _bad_jsonl(t)], "bad.jsonl:2"),
    (lambda t: ["--data", _short_txt(t), "--packing", "stream"], "seq-len"),
    (
        lambda t: ["--data", _long_prompts(t), "--seq-len", "8"],
        "truncated away .* --truncation left",
    ),
    (lambda t: ["--seq-len", "40000"], "beyond the model's 32768 positions"),
    (lambda t: ["--tokenizer", _big_tokenizer(t)], "601 tokens"),
    (lambda t: ["--output-dir", _file_as_parent(t)], "cannot create it \\(Not a directory\\)"),
    (lambda t: ["--output-dir", "/proc/compiletune-run"], "/proc/compiletune-run: cannot create"),
    (lambda t: ["--output-dir", ""], "--output-dir is empty"),
    (lambda t: ["--lr", "inf"], "--lr must be a finite number"),
    (lambda t: ["--resume", "--overwrite"], "contradict"),
    (lambda t: ["--resume"], "holds no complete checkpoint"),
    (lambda t: ["--model", "debug_128k", "--model-dir", _mismatched_dir(t)], "--model debug_128k"),
]


@pytest.mark.parametrize("make_argv, needle", BAD)
def test_bad_input_one_line_exit_2_nothing_written(tmp_path, capsys, make_argv, needle):
    argv = make_argv(tmp_path)
    out = tmp_path / "out"
    if "--output-dir" not in argv:
        argv += ["--output-dir", str(out)]
    assert main(["train", "--max-steps", "1", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("compiletune: error: "), err
    assert re.search(needle, err[0]), err[0]
    assert not out.exists()


def test_existing_run_needs_resume_or_overwrite(tmp_path, corpus, capsys):
    run(tmp_path, corpus, max_steps=1)
    with pytest.raises(UserError, match="--resume to continue, --overwrite"):
        run(tmp_path, corpus, max_steps=1)
    run(tmp_path, corpus, max_steps=2, overwrite=True)
    names = sorted(p.name for p in (tmp_path / "run").iterdir() if p.name.startswith("step_"))
    assert names == ["step_2"]


def test_a_folder_of_someone_elses_files_is_not_a_run_folder(tmp_path, corpus, capsys):
    """A non-empty folder that is not a run is refused (nothing written into it); a subfolder
    of it is fine, and --overwrite trains beside the files and never deletes them."""
    mine = tmp_path / "notes"
    mine.mkdir()
    (mine / "todo.txt").write_text("buy milk")
    (mine / "photos").mkdir()
    capsys.readouterr()
    argv = ["train", "--data", corpus, "--max-steps", "1", "--seq-len", "32", "--batch-size", "2"]
    assert main([*argv, "--output-dir", str(mine)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "holds files that are not a compiletune run's" in err[0], err
    assert "photos, todo.txt" in err[0] and f"{mine / 'run'}" in err[0]
    assert sorted(p.name for p in mine.iterdir()) == ["photos", "todo.txt"]  # untouched
    assert main([*argv, "--output-dir", str(mine / "run")]) == 0
    assert main([*argv, "--output-dir", str(mine), "--overwrite"]) == 0
    out = capsys.readouterr().out
    assert "they are kept" in out
    assert (mine / "todo.txt").read_text() == "buy milk" and (mine / "step_1").is_dir()
    # now a run's folder, with the user's files beside it: a second run asks for --resume
    assert main([*argv, "--output-dir", str(mine)]) == 2
    assert "--resume to continue" in capsys.readouterr().err
    assert main([*argv, "--output-dir", str(mine), "--overwrite"]) == 0
    assert (mine / "todo.txt").read_text() == "buy milk"


def test_models_command_lists_presets(capsys):
    assert main(["models"]) == 0
    out = capsys.readouterr().out
    assert "llama3_1_8b" in out and "8.03B" in out and "qwen2_5_0_5b" in out


@pytest.mark.slow
def test_sigint_saves_a_checkpoint_and_exits_130(tmp_path, corpus):
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "compiletune", "train", "--data", corpus, "--seq-len", "32"]
    cmd += ["--batch-size", "2", "--max-steps", "100000", "--output-dir", str(out)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    metrics = out / "metrics.jsonl"
    deadline = time.time() + 120
    while time.time() < deadline and not (
        metrics.exists() and len(metrics.read_text().splitlines()) >= 2
    ):
        time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 130, stderr
    assert "stopped early" in stdout
    steps = len(read_metrics(metrics))
    assert (out / f"step_{steps}" / "trainer_state.pt").is_file()
    assert not any(p.name.startswith(".tmp") for p in out.iterdir())
    env = {**os.environ}
    resumed = subprocess.run(
        [*cmd[:-4], "--max-steps", str(steps + 1), "--output-dir", str(out), "--resume"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert resumed.returncode == 0, resumed.stderr
    assert len(read_metrics(metrics)) == steps + 1


# --- optimizers in the loop -------------------------------------------------------------------


def test_in_backward_run_equals_ordinary_run(tmp_path, corpus):
    common = {"max_steps": 4, "max_grad_norm": 0.0}
    run(tmp_path, corpus, name="plain", **common)
    run(tmp_path, corpus, name="inbw", optimizer_in_backward=True, **common)
    a = read_metrics(tmp_path / "plain" / "metrics.jsonl")
    b = read_metrics(tmp_path / "inbw" / "metrics.jsonl")
    assert [r["loss"] for r in a] == [r["loss"] for r in b]
    wa = load_file(tmp_path / "plain" / "step_4" / "model.safetensors")
    wb = load_file(tmp_path / "inbw" / "step_4" / "model.safetensors")
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


def test_adamw8bit_in_backward_resumes_exactly(tmp_path, corpus):
    flags = {"max_steps": 6, "save_every": 3, "optimizer": "adamw8bit"}
    flags["optimizer_in_backward"] = True
    summary = run(tmp_path, corpus, name="full", **flags)
    assert summary["optimizer"] == "adamw8bit in-backward"
    full = read_metrics(tmp_path / "full" / "metrics.jsonl")
    part = tmp_path / "part"
    part.mkdir()
    shutil.copytree(tmp_path / "full" / "step_3", part / "step_3")
    shutil.copy(tmp_path / "full" / "config.yaml", part / "config.yaml")
    run(tmp_path, corpus, name="part", resume=True, **flags)
    resumed = read_metrics(part / "metrics.jsonl")  # steps 4..6: the copy held no metrics
    assert [r["step"] for r in resumed] == [4, 5, 6]
    assert [r["loss"] for r in resumed] == [r["loss"] for r in full[3:]]


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["--optimizer-in-backward", "--max-grad-norm", "1"], "--max-grad-norm 0"),
        (["--optimizer-in-backward", "--grad-accum", "2"], "--grad-accum"),
        (["--bf16-compensation", "kahan"], "--dtype bf16"),
    ],
)
def test_contradictory_optimizer_flags(tmp_path, capsys, argv, needle):
    assert main(["train", *argv, "--output-dir", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and needle in err[0], err
    assert not (tmp_path / "o").exists()
