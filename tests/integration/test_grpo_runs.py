"""`--objective grpo` through the trainer: a tiny model learns a verifiable toy task (the reward
rises, on held-out prompts too), LoRA + compile + KL + several updates per rollout, and an exact
resume."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from tiny_run import tiny_run

from compiletune.config import resolve
from compiletune.data.tokenizer import byte_tokenizer, load_tokenizer
from compiletune.errors import UserError
from compiletune.metrics import read_metrics
from compiletune.models import from_hf
from compiletune.rl.rollout import sample_group
from compiletune.train.inputs import build_prompts

REWARDS = """
def first_digit(completions, answer, **_):
    return [1.0 if c[:1] == a else 0.0 for c, a in zip(completions, answer)]
"""


def sums(tmp_path: Path, name: str, pairs: list[tuple[int, int]]) -> str:
    path = tmp_path / name
    rows = [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a, b in pairs]
    path.write_text("\n".join(json.dumps(r) for r in rows * 4))
    return str(path)


def grpo_flags(tmp_path: Path, monkeypatch) -> dict:
    (tmp_path / "toy_rewards.py").write_text(REWARDS)
    monkeypatch.syspath_prepend(str(tmp_path))
    return {
        "model": "debug",
        "n_layers": 2,
        "objective": "grpo",
        "reward": "toy_rewards:first_digit,regex:^\\d",
        "reward_weights": "1,0.5",
        "num_generations": 8,
        "max_new_tokens": 2,
        "seq_len": 16,
        "batch_size": 8,
        "lr": 3e-3,
        "warmup_steps": 0,
        "dtype": "fp32",
    }


def held_out_reward(folder: Path, prompts: list[tuple[int, int]]) -> float:
    """The mean reward of 8 sampled completions per held-out prompt under a checkpoint."""
    model, tok = from_hf(folder).eval(), load_tokenizer(folder)
    g = torch.Generator().manual_seed(0)
    total = 0.0
    for a, b in prompts:
        ids = tok(f"{a}+{b}=")["input_ids"]
        for c in sample_group(model, ids, 8, 2, 1.0, 1.0, {tok.eos_token_id}, g):
            text = tok.decode(c, skip_special_tokens=True)
            total += (text[:1] == str(a + b)) + 0.5 * text[:1].isdigit()
    return total / (8 * len(prompts))


def test_a_tiny_model_learns_the_toy_task(tmp_path, monkeypatch):
    train = [(a, b) for a in range(5) for b in range(3)]
    held = [(a, b) for a in range(5) for b in (3, 4)]
    flags = grpo_flags(tmp_path, monkeypatch)
    # the run's own held-out reward: 8 samples of each held-out prompt every 10 steps
    held_file = tmp_path / "held.jsonl"
    rows = [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a, b in held]
    held_file.write_text("".join(json.dumps(r) + "\n" for r in rows))
    evals = {"eval_data": str(held_file), "eval_every": 10}
    data = sums(tmp_path, "train.jsonl", train)
    summary = tiny_run(tmp_path, data, **flags, **evals, max_steps=40)
    metrics = read_metrics(tmp_path / "run" / "metrics.jsonl")
    rewards = [r["reward"] for r in metrics]
    first, last = sum(rewards[:3]) / 3, sum(rewards[-10:]) / 10
    assert last > first + 0.3, rewards
    curve = [(r["step"], r["eval_reward"]) for r in metrics if "eval_reward" in r]
    assert [s for s, _ in curve] == [10, 20, 30, 40], curve
    assert all(r["eval_prompts"] == len(held) for r in metrics if "eval_reward" in r)
    assert summary["eval_reward"] == curve[-1][1]
    print("held-out reward, step: value", curve)
    tiny_run(tmp_path, sums(tmp_path, "one.jsonl", train), name="start", **flags, max_steps=1)
    before = held_out_reward(tmp_path / "start" / "step_1", held)
    after = held_out_reward(tmp_path / "run" / "step_40", held)
    assert after > before + 0.3, (before, after)
    # the run's evaluation measures that same quantity (other samples of the same policy)
    assert abs(curve[-1][1] - after) < 0.25, (curve, after)  # two means of 80 samples each


def test_lora_compile_kl_several_updates_and_exact_resume(tmp_path, monkeypatch):
    """LoRA, --compile, a KL penalty (the reference: the adapters off), two updates per
    rollout, DAPO's loss and clip; 4 steps in one go equal 2 and a resume for 2 more."""
    data = sums(tmp_path, "train.jsonl", [(a, b) for a in range(5) for b in range(5)])
    flags = grpo_flags(tmp_path, monkeypatch) | {
        "lora_rank": 4,
        "lr": 1e-2,
        "compile": True,
        "compile_backend": "aot_eager",
        "beta": 0.04,
        "grpo_iterations": 2,
        "grpo_loss": "dapo",
        "epsilon_high": 0.28,
        "batch_size": 2,
        "grad_accum": 2,
        "save_every": 2,
        "schedule": "constant",  # the same lr whatever --max-steps says
    }
    summary = tiny_run(tmp_path, data, name="whole", **flags, max_steps=4)
    assert summary["compile"]["recompiles"] == 0, summary["compile"]
    whole = read_metrics(tmp_path / "whole" / "metrics.jsonl")
    assert all(r["kl"] >= 0 and 0 <= r["ratio_clipped"] <= 1 for r in whole)
    assert any(r["kl"] > 0 for r in whole[1:])  # the adapters moved away from the reference
    assert (tmp_path / "whole" / "step_4" / "adapter_config.json").exists()
    tiny_run(tmp_path, data, name="split", **flags, max_steps=2)
    tiny_run(tmp_path, data, name="split", **flags, max_steps=4, resume=True)
    split = read_metrics(tmp_path / "split" / "metrics.jsonl")
    for key in ("reward", "loss", "completion_len", "kl"):
        assert [r[key] for r in split] == [r[key] for r in whole], key


def test_val_split_holds_prompts_out_for_the_reward_evaluation(tmp_path, monkeypatch):
    data = sums(tmp_path, "train.jsonl", [(a, b) for a in range(5) for b in range(3)])  # 60
    flags = grpo_flags(tmp_path, monkeypatch) | {"val_split": 0.25, "batch_size": 2}
    summary = tiny_run(tmp_path, data, **flags, max_steps=1)
    (record,) = read_metrics(tmp_path / "run" / "metrics.jsonl")
    # 15 distinct prompts, 4 rows each: a quarter of the distinct ones (4) held out, each once,
    # and none of their rows trained on
    assert record["eval_prompts"] == 4 and summary["eval_reward"] == record["eval_reward"]
    cfg = resolve({}, {**flags, "data": data})
    (train,), _, held = build_prompts(cfg, byte_tokenizer(), say=lambda *a: None)
    texts = [p.text for p in held.prompts]
    assert len(set(texts)) == 4 and not set(texts) & {p.text for p in train.prompts}
    assert len(train.prompts) == 11 * 4
    assert set(record["eval_rewards"]) == {"toy_rewards:first_digit", "regex:^\\d"}
    assert all(set(v) == {"mean"} for v in record["eval_rewards"].values())
    # held-out prompts without the column a reward reads: refused before training, not at its end
    bare = tmp_path / "bare.jsonl"
    bare.write_text(json.dumps({"prompt": "1+1="}) + "\n")
    flags = grpo_flags(tmp_path, monkeypatch) | {"eval_data": str(bare)}
    with pytest.raises(UserError, match=r"lack the column\(s\) answer that --data's have"):
        tiny_run(tmp_path, data, name="bare", **flags, max_steps=1)
    assert not (tmp_path / "bare" / "metrics.jsonl").exists()
    if not torch.cuda.is_available():  # CUDA graphs asked for without a GPU: refused at once
        flags = grpo_flags(tmp_path, monkeypatch) | {"rollout_cuda_graphs": True}
        with pytest.raises(UserError, match="--rollout-cuda-graphs replays CUDA graphs"):
            tiny_run(tmp_path, data, name="graphs", **flags, max_steps=1)
        assert not (tmp_path / "graphs" / "metrics.jsonl").exists()


FOOLING = """
import os, signal, sys, threading, time
calls = []
def text(completions, **_):
    return ["1" if i % 2 else "0" for i in range(len(completions))]
def by_index(completions, **_):
    return {i: float(i % 2) for i in range(len(completions))}
def all_none(completions, **_):
    return [None] * len(completions)
def extreme(completions, **_):
    return [1e308 if i % 2 else -1e308 for i in range(len(completions))]
def unscaled(completions, **_):  # with --no-scale-rewards: advantages of 1e13
    return [1e13 if i % 2 else -1e13 for i in range(len(completions))]
def some_none(completions, **_):
    return [None if i % 4 == 0 else 1.0 for i in range(len(completions))]
def _second(completions, then):
    calls.append(1)
    return [1.0] * len(completions) if len(calls) == 1 else then()
def exits0(completions, **_):
    return _second(completions, lambda: sys.exit(0))
def exits3(completions, **_):
    return _second(completions, lambda: sys.exit(3))
def interrupts(completions, **_):
    def stop():
        raise KeyboardInterrupt
    return _second(completions, stop)
def _hang(completions):
    end = time.monotonic() + 20  # bounded: a guard that failed fails the test, not hangs it
    while time.monotonic() < end:
        time.sleep(0.01)
    return [1.0] * len(completions)
def hangs(completions, **_):
    return _second(completions, lambda: _hang(completions))
def ctrl_c(completions, **_):
    def press():
        threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGINT)).start()
        return _hang(completions)
    return _second(completions, press)
"""


def fooling_flags(tmp_path: Path, monkeypatch, reward: str) -> dict:
    import sys

    (tmp_path / "fooling.py").write_text(FOOLING)
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("fooling", None)  # a fresh call count per run
    return grpo_flags(tmp_path, monkeypatch) | {
        "reward": f"fooling:{reward}",
        "reward_weights": None,
        "num_generations": 4,
        "batch_size": 2,
        "max_steps": 3,
    }


@pytest.mark.parametrize(
    "reward, match",
    [
        ("text", r"returned str '0' for completion 0 of 8 \(text: convert it with float\(\)\)"),
        ("by_index", "returned a dict of 8 entries for 8 completions; return a list"),
        ("all_none", "returned None for all 8 completions of the step"),
        ("extreme", r"returned values from -1e\+308 to 1e\+308 .*too large .*scale that reward"),
        ("unscaled", r"returned values from -1e\+13 to 1e\+13 .*too large .*scale that reward"),
    ],
)
def test_a_reward_that_would_fool_the_trainer_stops_it_naming_the_reward(
    tmp_path, monkeypatch, reward, match
):
    """Before: text and a dict's keys trained with loss 0.0 and exit 0; +-1e308 stopped the
    run advising a lower learning rate without naming the reward; unscaled advantages past
    1e12 trained on (or, larger, overflowed the gradient norm, blamed on the model)."""
    data = sums(tmp_path, "train.jsonl", [(a, b) for a in range(5) for b in range(3)])
    flags = fooling_flags(tmp_path, monkeypatch, reward)
    if reward == "unscaled":
        flags["scale_rewards"] = False
    with pytest.raises(UserError, match=f"^reward 'fooling:{reward}' {match}"):
        tiny_run(tmp_path, data, **flags)


def test_none_is_a_reward_that_does_not_apply_and_is_counted(tmp_path, monkeypatch):
    data = sums(tmp_path, "train.jsonl", [(a, b) for a in range(5) for b in range(3)])
    flags = fooling_flags(tmp_path, monkeypatch, "some_none") | {"max_steps": 1}
    tiny_run(tmp_path, data, **flags)
    (record,) = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert record["rewards"]["fooling:some_none"] == {"mean": 1.0, "std": 0.0, "none": 2}
    assert record["reward"] == 6 / 8  # a None adds nothing to its completion's reward
    assert record["advantage_std"] > 0


@pytest.mark.parametrize(
    "reward, match",
    [
        ("exits0", r"called sys.exit\(0\)"),
        ("exits3", r"called sys.exit\(3\)"),
        ("interrupts", "raised KeyboardInterrupt"),
        ("hangs", "ran past --reward-timeout 0.5s"),
        ("ctrl_c", "was interrupted by SIGINT"),
    ],
)
def test_a_reward_that_stops_ends_the_run_as_ctrl_c_does(
    tmp_path, monkeypatch, capsys, reward, match
):
    """A reward's sys.exit (0 or 3) or KeyboardInterrupt at step 2, a reward past
    --reward-timeout, and one Ctrl-C while a reward runs: the step is abandoned, step_1 is
    written, one line names the reward, the command exits 130 (before: exit 0 or 3 with no
    checkpoint and no line; the hang outlived a Ctrl-C)."""
    from compiletune import cli

    data = sums(tmp_path, "train.jsonl", [(a, b) for a in range(5) for b in range(3)])
    flags = fooling_flags(tmp_path, monkeypatch, reward) | {"reward_timeout": 0.5}
    if reward == "ctrl_c":
        flags["reward_timeout"] = 60.0
    argv = ["train", "--data", data, "--output-dir", str(tmp_path / "run")]
    for key, value in flags.items():
        if value is not None:
            argv += [f"--{key.replace('_', '-')}", str(value)]
    assert cli.main(argv) == 130
    out = capsys.readouterr().out
    assert f"step 2: reward 'fooling:{reward}' " in out and re.search(match, out), out
    assert "stopped early" in out
    assert (tmp_path / "run" / "step_1").is_dir() and not (tmp_path / "run" / "step_2").exists()
    assert [r["step"] for r in read_metrics(tmp_path / "run" / "metrics.jsonl")] == [1]


def test_rewards_and_sizes_that_cannot_work_are_refused_before_the_first_step(
    tmp_path, monkeypatch
):
    """An empty regex: (before: it matched everything) refused before the model loads;
    exact:answer on a row whose answer is null (before: compared with the text "None") refused
    naming the row; --num-generations 1000000 (before: an allocator's traceback) refused by
    the rollout's size before it is allocated; --reward-timeout must be positive."""
    import compiletune.train.loop as loop

    data = sums(tmp_path, "train.jsonl", [(a, b) for a in range(5) for b in range(3)])
    flags = grpo_flags(tmp_path, monkeypatch) | {"reward_weights": None, "max_steps": 1}
    build = loop.build_run

    def no_model(*a, **k):
        raise AssertionError("the model was built")

    monkeypatch.setattr(loop, "build_run", no_model)
    with pytest.raises(UserError, match=r"^--reward 'regex:': regex: needs its PATTERN"):
        tiny_run(tmp_path, data, name="regex", **flags | {"reward": "regex:"})
    monkeypatch.setattr(loop, "build_run", build)
    nulls = tmp_path / "nulls.jsonl"
    rows = [{"prompt": "1+1=", "answer": "2"}, {"prompt": "1+2=", "answer": None}]
    nulls.write_text("\n".join(json.dumps(r) for r in rows))
    with pytest.raises(UserError, match=rf"1 of 2 rows of --data {nulls} have no 'answer' "
                       rf"\(null or missing\), the first at {nulls}:2"):  # fmt: skip
        tiny_run(tmp_path, str(nulls), name="nulls", **flags | {"reward": "exact:answer"})
    many = flags | {"num_generations": 1_000_000, "seq_len": 32, "max_new_tokens": 16}
    with pytest.raises(UserError, match=r"^--num-generations 1000000: the rollout decodes "
                       r"--batch-size 8 x 1000000 = 8,000,000 completions at once, .* GiB"):  # fmt: skip
        tiny_run(tmp_path, data, name="many", **many)
    for name in ("regex", "nulls", "many"):
        assert not (tmp_path / name / "metrics.jsonl").exists()
    with pytest.raises(UserError, match="--reward-timeout must be a positive number"):
        resolve({}, {**flags, "data": data, "reward_timeout": 0})


def test_a_reward_that_stops_in_the_held_out_evaluation_stops_the_run(
    tmp_path, monkeypatch, capsys
):
    """sys.exit(0) from a reward scoring the held-out prompts after the last step: the step
    is saved, one line names the reward and the evaluation, and the run counts as stopped early
    (exit 130), not as done."""
    data = sums(tmp_path, "train.jsonl", [(a, b) for a in range(5) for b in range(3)])
    flags = fooling_flags(tmp_path, monkeypatch, "exits0") | {"val_split": 0.25, "max_steps": 1}
    summary = tiny_run(tmp_path, data, **flags)
    out = capsys.readouterr().out
    assert "the held-out evaluation: reward 'fooling:exits0' called sys.exit(0)" in out, out
    assert summary["interrupted"] and summary["checkpoint"].endswith("step_1")
    assert summary["eval_reward"] is None and "stopped early" in out
