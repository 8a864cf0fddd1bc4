"""GRPO's pieces: the loss against an fp64 formula written out here, advantages, rewards (their
errors), the batched sampler, prompts from the data, and a run of `--objective grpo`."""

from __future__ import annotations

import json
import math
import re
import sys

import pytest
import torch

from compiletune.config import resolve
from compiletune.errors import UserError
from compiletune.loss.grpo import GrpoOptions, advantages, grpo_loss
from compiletune.rl import rewards as rw
from compiletune.rl.rollout import decode_step, sample_group, sample_prompts, sample_rows


def formula(logp, old, ref, adv, mask, kind, eps_low, eps_high, beta, max_new):
    """The loss token by token in fp64, as the papers write it."""
    n, t = len(logp), len(logp[0])
    per_seq, total, tokens = [], 0.0, 0
    for i in range(n):
        terms = []
        for j in range(t):
            if not mask[i][j]:
                continue
            ratio = math.exp(logp[i][j] - old[i][j])
            a = adv[i]
            term = -min(ratio * a, min(max(ratio, 1 - eps_low), 1 + eps_high) * a)
            if beta:
                d = ref[i][j] - logp[i][j]
                term += beta * (math.exp(d) - d - 1)
            terms.append(term)
        per_seq.append(sum(terms) / max(1, len(terms)))
        total += sum(terms)
        tokens += len(terms)
    if kind == "grpo":
        return sum(per_seq) / n
    if kind == "dr_grpo":
        return total / (n * max_new)
    return total / tokens


@pytest.mark.parametrize("kind", ["grpo", "dr_grpo", "dapo"])
@pytest.mark.parametrize("beta", [0.0, 0.04])
def test_loss_and_gradients_equal_the_formula(kind, beta):
    g = torch.Generator().manual_seed(0)
    n, t = 6, 9
    logp = (-torch.rand(n, t, generator=g, dtype=torch.float64) * 3).requires_grad_()
    old = logp.detach() + 0.3 * torch.randn(n, t, generator=g, dtype=torch.float64)
    ref = logp.detach() + 0.5 * torch.randn(n, t, generator=g, dtype=torch.float64)
    adv = torch.randn(n, generator=g, dtype=torch.float64)
    mask = torch.rand(n, t, generator=g) < 0.7
    mask[:, 0] = True
    opts = GrpoOptions(kind, eps_low=0.2, eps_high=0.28, beta=beta, max_new_tokens=12)
    loss, sums = grpo_loss(logp, old, ref if beta else None, adv, mask, opts)
    grad = torch.autograd.grad(loss, logp)[0]
    args = (old.tolist(), ref.tolist(), adv.tolist(), mask.tolist(), kind, 0.2, 0.28, beta, 12)
    want = formula(logp.tolist(), *args)
    assert loss.item() == pytest.approx(want, rel=1e-9)
    # the gradient by central differences of the formula, token by token
    h = 1e-6
    for i, j in [(0, 0), (2, 3), (5, 8), (3, 1)]:
        up, down = logp.detach().clone(), logp.detach().clone()
        up[i, j] += h
        down[i, j] -= h
        fd = (formula(up.tolist(), *args) - formula(down.tolist(), *args)) / (2 * h)
        assert grad[i, j].item() == pytest.approx(fd, rel=1e-5, abs=1e-9)
    assert ("kl" in sums) == bool(beta)
    # split into two micro-batches with the whole step's normaliser: the same loss
    denominator = {"grpo": n, "dr_grpo": n * 12, "dapo": int(mask.sum())}[kind]
    parts = [
        grpo_loss(logp[s], old[s], ref[s] if beta else None, adv[s], mask[s], opts, denominator)[0]
        for s in (slice(0, 2), slice(2, n))
    ]
    assert sum(parts).item() == pytest.approx(loss.item(), rel=1e-12)


def test_advantages_are_group_normalised():
    r = torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 2.0, 2.0, 2.0])
    a = advantages(r, 4)
    first = r[:4] - r[:4].mean()
    assert torch.allclose(a[:4], first / (r[:4].std() + 1e-4))
    assert torch.equal(a[4:], torch.zeros(4))  # a group that agrees teaches nothing
    assert torch.allclose(advantages(r, 4, scale=False)[:4], first)  # Dr. GRPO


def test_builtin_rewards_and_their_errors(tmp_path, monkeypatch):
    fns = rw.load_rewards("exact:answer,contains:answer,regex:^\\d+$,length:3", "1,0.5,1,2")
    assert [f.weight for f in fns] == [1.0, 0.5, 1.0, 2.0]
    cols = {"answer": ["7", "12", "7"]}
    comps, ids = [" 7 ", "x12y", "abc"], [[1], [1, 2, 3, 4, 5, 6], [1, 2, 3]]
    got = [rw.score(f, ["p"] * 3, comps, ids, cols) for f in fns]
    assert got == [[1.0, 0.0, 0.0], [1.0, 1.0, 0.0], [0.0, 0.0, 0.0], [0.0, -1.0, 0.0]]
    with pytest.raises(UserError, match="no column 'answer'"):
        rw.score(fns[0], ["p"], ["7"], [[1]], {"label": ["7"]})
    for bad in ("nonsense", "regex:(", "length:0", "nomodule_xyz:fn"):
        with pytest.raises(UserError, match="--reward"):
            rw.load_rewards(bad)
    with pytest.raises(UserError, match="--reward-weights"):
        rw.load_rewards("exact:a,exact:b", "1")
    # a user's function that misbehaves: one line naming it
    (tmp_path / "my_rewards.py").write_text(
        "def boom(completions, **_):\n    raise KeyError('x')\n"
        "def short(completions, **_):\n    return [1.0]\n"
        "def nan(completions, **_):\n    return [float('nan')] * len(completions)\n"
        "def good(completions, prompts, completion_ids, **cols):\n"
        "    return [float(len(c)) for c in completions]\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("my_rewards", None)
    for name, match in (
        ("boom", "raised KeyError"),
        ("short", "returned 1 values for 2"),
        ("nan", "returned float nan"),
    ):
        (fn,) = rw.load_rewards(f"my_rewards:{name}")
        with pytest.raises(UserError, match=f"my_rewards:{name}.*{match}"):
            rw.score(fn, ["p", "q"], ["a", "bb"], [[1], [2]], {})
    (good,) = rw.load_rewards("my_rewards:good")
    assert rw.score(good, ["p", "q"], ["a", "bb"], [[1], [2]], {}) == [1.0, 2.0]


def test_sample_rows_greedy_nucleus_and_temperature():
    g = torch.Generator().manual_seed(0)
    logits = torch.tensor([[0.0, 5.0, 1.0], [3.0, 0.0, 0.0]])
    assert sample_rows(logits, 0.0, 1.0, g).tolist() == [1, 0]
    # a nucleus of 0.5 keeps only the most likely token: always it
    for _ in range(20):
        assert sample_rows(logits, 1.0, 0.5, g).tolist() == [1, 0]
    draws = torch.stack([sample_rows(logits, 1.0, 1.0, g) for _ in range(400)])
    assert set(draws[:, 0].tolist()) == {0, 1, 2}  # every token has its chance
    # the draws follow the distribution; a token of probability 0 never comes
    probs = torch.tensor([0.7, 0.2, 0.1, 0.0])
    many = sample_rows(probs.log().expand(20000, 4), 1.0, 1.0, g)
    freq = torch.bincount(many, minlength=4).float() / many.numel()
    assert torch.allclose(freq, probs, atol=0.015) and freq[3] == 0


@pytest.mark.parametrize(
    "preset",
    ["debug_gemma2", "debug_gemma4", "debug_qwen3_5", "debug_gpt_oss", "debug_deepseek"]
    + ["longrope"],
)
def test_prompts_of_different_lengths_decode_together_as_each_alone(preset):
    """One batch of prompts of 3, 11 and 6 tokens (2 completions each, each row at its own
    position in one static cache) samples what each prompt sampled alone does, from the same
    streams, greedy and at temperature 1, eagerly and with the decode step compiled (--compile's
    rollout), which samples what eager decoding does and is one graph for every batch and
    cache size (4 rollouts of 3 sizes). Windows shrunk to 5 so that the per-row window masks
    matter; Gemma 2's soft-caps, Gemma 4's shared caches and per-layer inputs, Qwen3.5's
    linear-attention states, gpt-oss's sinks, DeepSeek's latent attention; Phi-3's longrope
    with an original context of 12, which the longest prompt's rows pass and the shortest's
    never reach (each row picks its factors by its own position)."""
    import dataclasses

    from torch._dynamo.testing import CompileCounterWithBackend

    from compiletune.models import RopeScaling, build_model, from_name

    if preset == "longrope":
        factors = tuple(1.0 + i / 4 for i in range(12))
        scaling = RopeScaling(4.0, rope_type="longrope", original_max_position_embeddings=12)
        scaling.short_factor, scaling.long_factor = (1.0,) * 12, factors
        args = dataclasses.replace(from_name("debug_phi3"), rope_scaling=scaling)
    else:
        args = from_name(preset)
    if args.sliding_window:
        args = dataclasses.replace(args, sliding_window=5)
    model = build_model(args, seed=0).eval()
    prompts = [list(range(7, 10)), list(range(20, 31)), list(range(40, 46))]
    counter = CompileCounterWithBackend("eager")
    sampled = []
    for temperature, backend in ((0.0, None), (1.0, counter), (1.0, None)):
        streams = [torch.Generator().manual_seed(i) for i in range(3)]
        together = sample_prompts(
            model, prompts, 2, 9, temperature, 1.0, set(), streams, compile_backend=backend
        )
        assert all(len(c) == 9 for c in together)
        assert len({tuple(c) for c in together}) > 1  # the prompts do lead somewhere else
        sampled.append(together)
        if len(sampled) == 3:  # sampled eagerly: what the compiled step sampled
            break
        alone = [
            c
            for i, p in enumerate(prompts)
            for c in sample_group(
                model, p, 2, 9, temperature, 1.0, set(), torch.Generator().manual_seed(i),
                compile_backend=backend,
            )
        ]  # fmt: skip
        assert together == alone
    assert sampled[2] == sampled[1]  # compiled decoding samples what eager decoding does
    assert sum(len(g.graph.nodes) > 0 for g in counter.graphs) == 1  # the step: one graph
    assert decode_step(model, counter) is decode_step(model, counter)  # kept with the model
    with pytest.raises(ValueError, match="3 prompts need as many generators"):
        sample_prompts(model, prompts, 2, 4, 1.0, 1.0, set(), streams[:2])


def test_grpo_flags_are_checked():
    base = {"objective": "grpo", "reward": "exact:answer", "seq_len": 64, "max_new_tokens": 16}
    for change, match in (
        ({"num_generations": 1}, "--num-generations"),
        ({"max_new_tokens": 64}, "--max-new-tokens"),
        ({"temperature": 0.0}, "--temperature"),
        ({"epsilon_high": 1.5}, "--epsilon-high"),
        ({"grpo_iterations": 0}, "--grpo-iterations"),
        ({"eval_split": "test"}, "--eval-split picks a split of --eval-data"),
    ):
        with pytest.raises(UserError, match=match):
            resolve({}, {**base, **change})
    with pytest.raises(UserError, match="--num-generations applies to --objective grpo"):
        resolve({}, {"num_generations": 8})
    assert resolve({}, base).objective.beta == 0.0
    assert resolve({}, {"objective": "dpo"}).objective.beta == 0.1


def sums_data(tmp_path, n=64):
    rows = [{"prompt": f"{i % 5}+{i % 3}=", "answer": str(i % 5 + i % 3)} for i in range(n)]
    path = tmp_path / "sums.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows))
    return str(path)


def test_the_estimate_counts_an_updates_completions():
    from compiletune.estimate.estimator import estimate_memory

    flags = {"model": "debug", "objective": "grpo", "seq_len": 64, "max_new_tokens": 16}
    flags |= {"dtype": "fp32", "n_layers": 2}
    small, large = (estimate_memory(resolve({}, {**flags, "num_generations": g})) for g in (2, 8))
    assert large.parts["activations"] > 3 * small.parts["activations"]
    assert any("grpo" in n for n in large.notes)
    # the rollout: --batch-size x 8 completions decoded together, their KV cache of 64
    # positions (2 layers, 2 kv heads of 32, fp32), their logits (fp32: logits, probabilities,
    # cdf) and one step's keys and values repeated to every query head, beside the weights
    # and the optimizer state
    from compiletune.models import from_name

    args, rows = from_name("debug"), resolve({}, flags).data.batch_size * 8
    assert args.n_kv_heads == 2 and args.hd == 32 and args.n_heads > 2
    kv = rows * 64 * 2 * 2 * 2 * 32 * 4
    logits = 3 * rows * args.vocab_size * 4
    repeated = rows * args.n_heads * 64 * 2 * 32 * 4
    assert large.phase_peaks["rollout"] == (
        kv + logits + repeated + large.parts["parameters"] + large.parts["optimizer_state"]
    )


BAD_REWARDS = """
import numpy as np, torch
def text(completions, **_):
    return ["1" if i % 2 else "0" for i in range(len(completions))]
def by_index(completions, **_):
    return {i: 1.0 for i in range(len(completions))}
def nothing(completions, **_):
    return None
def all_none(completions, **_):
    return [None] * len(completions)
def one(completions, **_):
    return 1.0
def one_tensor(completions, **_):
    return torch.tensor(1.0)
def short(completions, **_):
    return [1.0] * (len(completions) - 1)
def huge_int(completions, **_):
    return [10**400] * len(completions)
def scalars(completions, **_):
    return [True, 2, np.float32(0.5), np.int64(3), torch.tensor(0.25), None][: len(completions)]
def array(completions, **_):
    return np.arange(len(completions), dtype=np.float64)
"""


def test_reward_values_are_checked_one_finite_number_or_none_each(tmp_path, monkeypatch):
    """Text, a dict {index: value}, None, None for every completion, one number, the wrong
    length, a number too large for a float: one line naming the reward and what it returned
    (before: "0"/"1" and a dict's keys were trained on). numpy and torch scalars and arrays
    are numbers; None is a completion the reward does not apply to."""
    (tmp_path / "bad_rewards.py").write_text(BAD_REWARDS)
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("bad_rewards", None)
    comps = ["a", "b", "c", "d", "e", "f"]
    ids = [[1]] * 6
    for name, match in (
        ("text", r"returned str '0' for completion 0 of 6 \(text"),
        ("by_index", "returned a dict of 6 entries for 6 completions; return a list"),
        ("nothing", "returned NoneType None for 6 completions"),
        ("all_none", "returned None for all 6 completions of the step"),
        ("one", "returned float 1.0 for 6 completions"),
        ("one_tensor", "returned float 1.0 for 6 completions"),
        ("short", "returned 5 values for 6 completions"),
        ("huge_int", "returned int 1000.* for completion 0 of 6; rewards must be finite"),
    ):
        (fn,) = rw.load_rewards(f"bad_rewards:{name}")
        with pytest.raises(UserError, match=f"^reward 'bad_rewards:{name}' {match}"):
            rw.score(fn, ["p"] * 6, comps, ids, {})
    (fn,) = rw.load_rewards("bad_rewards:scalars")
    assert rw.score(fn, ["p"] * 6, comps, ids, {}) == [1.0, 2.0, 0.5, 3.0, 0.25, None]
    (fn,) = rw.load_rewards("bad_rewards:array")
    assert rw.score(fn, ["p"] * 6, comps, ids, {}) == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]


def test_reward_specs_that_reward_everything_are_refused_when_parsed():
    """An empty regex: (before: it matched every completion, silently) and any pattern that
    matches every text; a built-in without its argument."""
    for spec, match in (
        ("regex:", "regex: needs its PATTERN"),
        ("regex:.*", "matches any text"),
        ("regex:(answer)?", "matches any text"),
        ("exact:", "exact: needs its COLUMN"),
        ("contains:", "contains: needs its COLUMN"),
        ("length:", "length: needs its N"),
    ):
        with pytest.raises(UserError, match=f"^--reward '?{re.escape(spec)}'?: .*{match}"):
            rw.load_rewards(spec)
    (fn,) = rw.load_rewards("regex:^$")  # only an empty completion: a pattern that selects
    assert rw.score(fn, ["p", "p"], ["", "x"], [[1], [2]], {}) == [1.0, 0.0]


def test_a_null_answer_is_refused_naming_its_row():
    """exact:/contains: on a row whose column is null (JSON null) or missing: refused before
    training, naming the first such row and how many (before: compared with the text
    "None")."""
    from compiletune.data.prompts import Prompt

    rows = [Prompt([1], "1+1=", {"answer": "2"}, "d.jsonl:1")]
    rows += [Prompt([1], "2+2=", {"answer": None}, "d.jsonl:2")]
    rows += [Prompt([1], "3+3=", {}, "d.jsonl:3")]
    (exact,) = rw.load_rewards("exact:answer")
    with pytest.raises(UserError, match=r"'exact:answer': 2 of 3 rows of --data d.jsonl have no "
                       r"'answer' \(null or missing\), the first at d.jsonl:2"):  # fmt: skip
        rw.check_columns([exact], rows, "--data d.jsonl")
    (contains,) = rw.load_rewards("contains:label")
    with pytest.raises(UserError, match="has no column 'label' .*answer"):
        rw.check_columns([contains], rows, "--data d.jsonl")
    rw.check_columns([exact, *rw.load_rewards("regex:^\\d")], rows[:1], "--data d.jsonl")
    with pytest.raises(UserError, match="'exact:answer': a row's 'answer' is null"):
        rw.score(exact, ["p"], ["2"], [[1]], {"answer": [None]})  # a caller that skipped it


STOPPING = """
import os, signal, sys, threading, time
calls = []
def exits0(completions, **_):
    sys.exit(0)
def exits3(completions, **_):
    sys.exit(3)
def interrupts(completions, **_):
    raise KeyboardInterrupt
def hangs(completions, **_):
    end = time.monotonic() + 20  # bounded, so that a guard that failed fails the test
    while time.monotonic() < end:
        time.sleep(0.01)
    return [1.0] * len(completions)
def swallows(completions, **_):
    end = time.monotonic() + 20
    while time.monotonic() < end:
        try:
            time.sleep(0.01)
        except BaseException:
            break  # a reward that catches everything and returns anyway
    return [1.0] * len(completions)
def ctrl_c(completions, **_):
    threading.Timer(0.2, os.kill, (os.getpid(), signal.SIGINT)).start()
    return hangs(completions)
"""


def test_a_rewards_exit_interrupt_time_limit_and_ctrl_c_are_the_runs_stop(tmp_path, monkeypatch):
    """sys.exit(0), sys.exit(3) and KeyboardInterrupt from a reward, a reward past
    --reward-timeout (also one that swallows the cut), and Ctrl-C while a reward runs under
    the loop's own SIGINT handler (which only notes the signal, so that before one Ctrl-C did
    not stop it): RewardStopped naming the reward; the handlers and timer come back."""
    import signal

    (tmp_path / "stopping.py").write_text(STOPPING)
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("stopping", None)
    noted = []
    previous = signal.signal(signal.SIGINT, lambda *_: noted.append(1))  # as StopSignal does
    try:
        timer, alarm = signal.getitimer(signal.ITIMER_REAL), signal.getsignal(signal.SIGALRM)
        for name, timeout, match in (
            ("exits0", None, r"called sys.exit\(0\)"),
            ("exits3", None, r"called sys.exit\(3\)"),
            ("interrupts", None, "raised KeyboardInterrupt"),
            ("hangs", 0.2, "ran past --reward-timeout 0.2s"),
            ("swallows", 0.2, "ran past --reward-timeout 0.2s"),
            ("ctrl_c", 60.0, "was interrupted by SIGINT"),
        ):
            (fn,) = rw.load_rewards(f"stopping:{name}")
            with pytest.raises(rw.RewardStopped, match=f"^reward 'stopping:{name}' {match}"):
                rw.score(fn, ["p"], ["a"], [[1]], {}, timeout)
            # the timer and handler as they were (pytest-timeout's own, where it runs)
            left, interval = signal.getitimer(signal.ITIMER_REAL)
            assert (left > 0) == (timer[0] > 0) and left <= timer[0] and interval == timer[1]
            assert signal.getsignal(signal.SIGALRM) == alarm
        handler = signal.getsignal(signal.SIGINT)
        assert not noted and handler is not previous and handler(signal.SIGINT, None) is None
        assert noted == [1]  # the loop's handler is back
    finally:
        signal.signal(signal.SIGINT, previous)
