"""Techniques' per-step work as step hooks (train/hooks.py) and the objective's step as a
strategy the loop calls (train/strategy.py): the step names no technique, the loop keeps the
counters."""

from __future__ import annotations

import ast
import math
from pathlib import Path

import pytest
import torch

from compiletune.config import resolve
from compiletune.train import grpo, loop
from compiletune.train.build import build_run
from compiletune.train.hooks import InBackwardCheck, RouterBiasUpdate, StepHook
from compiletune.train.step import next_batch, train_step
from compiletune.train.strategy import StepOutcome, SupervisedStep

ROOT = Path(__file__).resolve().parents[3]


def _run(tmp_path: Path, **flags):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(f"Line {i}: a fox counts to {i * 7 % 13}." for i in range(200)))
    values = {
        "data": str(corpus),
        "seq_len": 16,
        "batch_size": 2,
        "max_steps": 3,
        "seed": 3,
        "packing": "stream",
    }
    values |= {"output_dir": str(tmp_path / "run"), "dtype": "fp32", **flags}
    return build_run(resolve({}, values), None)


class _Recorder(StepHook):
    """Writes each call into a shared log, with what the weights were at the time."""

    def __init__(self, name: str, log: list, weight: torch.Tensor) -> None:
        self.name, self.log, self.weight = name, log, weight

    def report(self, values):
        values[f"seen.{self.name}"] = torch.ones(())
        self.log.append((self.name, "report", self.weight.detach().clone()))

    def after_optimizer_step(self, result):
        self.log.append((self.name, "after_optimizer_step", self.weight.detach().clone()))


@pytest.mark.parametrize("accepted", [True, False])
def test_registered_hooks_run_once_per_step_at_their_points_in_order(tmp_path, accepted):
    """`report` once, before the check reads the values (which carry what it added);
    `after_optimizer_step` once, after the weights changed, and never for a refused step; each
    point calls the hooks in the order they were registered."""
    run = _run(tmp_path)
    weight = run.params[0]
    log: list = []
    for name in ("first", "second"):
        run.hooks.add(_Recorder(name, log, weight))
    before = weight.detach().clone()
    read: list = []

    def accept(values):
        read.append((sorted(k for k in values if k.startswith("seen.")), len(log)))
        return accepted

    for _ in range(2):
        log.clear()
        train_step(run, next_batch(run), 1e-3, accept)
        assert read[-1] == (["seen.first", "seen.second"], 2)  # both reported, before the read
        points = [(name, point) for name, point, _ in log]
        expected = [("first", "report"), ("second", "report")]
        if accepted:
            expected += [("first", "after_optimizer_step"), ("second", "after_optimizer_step")]
        assert points == expected
        if accepted:  # the optimizer had stepped when the hooks ran
            assert not torch.equal(log[-1][2], before)
            before = weight.detach().clone()
        else:
            assert torch.equal(weight, before)


def test_techniques_register_their_hooks_where_they_are_applied(tmp_path):
    """No technique: no hook. --optimizer-in-backward: its check of the weights, which the
    step's values carry (the step itself computes no weights norm)."""
    assert _run(tmp_path).hooks.hooks == []
    run = _run(tmp_path, optimizer_in_backward=True, max_grad_norm=0.0)
    assert [type(h) for h in run.hooks.hooks] == [InBackwardCheck]
    seen = {}

    def accept(values):
        seen.update(values)
        return True

    train_step(run, next_batch(run), 1e-3, accept)
    assert "grad_norm" not in seen  # stepped in backward: no gradients left to measure
    assert math.isfinite(float(seen["weights_norm"])) and float(seen["weights_norm"]) > 0


def test_the_router_bias_hook_moves_the_biases_after_the_step(tmp_path):
    """--router-bias-update-rate on a sigmoid-router MoE: registered, and after a step the
    correction biases have moved (by the step's expert loads)."""
    run = _run(tmp_path, model="debug_deepseek", router_bias_update_rate=0.05)
    assert [type(h) for h in run.hooks.hooks] == [RouterBiasUpdate]

    def biases() -> dict[str, torch.Tensor]:
        return {n: t.clone() for n, t in run.model.state_dict().items() if "score_bias" in n}

    before = biases()
    assert before
    train_step(run, next_batch(run), 1e-3, lambda values: True)
    moved = [n for n, t in biases().items() if not torch.equal(t, before[n])]
    assert moved


def _imported(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            names |= {f"{node.module}.{a.name}" for a in node.names} | {node.module or ""}
    return names


def test_the_step_names_no_technique():
    """step.py imports neither fp8, the router-bias update nor the optimizer module, and reads
    none of their switches: their per-step work reaches it as hooks."""
    path = ROOT / "compiletune" / "train" / "step.py"
    imported = _imported(path)
    assert "compiletune.fp8" in _imported(ROOT / "compiletune" / "train" / "hooks.py")  # seen
    for name in (
        "compiletune.fp8",
        "compiletune.optim",
        "compiletune.models.moe.update_score_bias",
    ):
        assert not any(i == name or i.startswith(name + ".") for i in imported), name
    source = path.read_text()
    for switch in ("techniques.fp8", "router_bias_update_rate", "optimizer_in_backward"):
        assert switch not in source, switch


# ----------------------------------------------------------------------------- the strategy


class _Scripted:
    """A step strategy that returns prepared outcomes, recording the step numbers it got."""

    def __init__(self, outcomes):
        self.outcomes, self.steps = list(outcomes), []

    def one_step(self, step, stop):
        self.steps.append(step)
        return self.outcomes.pop(0)


def _trainer(strategy, start_step=0):
    trainer = object.__new__(loop.Trainer)  # the loop's counters alone, no build
    trainer.run = type("R", (), {"start_step": start_step})()
    trainer.strategy, trainer.step = strategy, start_step
    trainer.tokens_done = trainer.padding_done = trainer.targets_done = 0
    trainer.first_loss = trainer.last_loss = float("nan")
    return trainer


def test_the_loop_keeps_the_counters_from_what_the_strategy_returns():
    outcomes = [
        StepOutcome({"step": 6}, tokens=10, targets=8, padding=2, loss=3.0),
        StepOutcome({"step": 7, "nonfinite": "x"}, tokens=5, targets=4, loss=None),
        StepOutcome({"step": 8}, tokens=7, targets=6, padding=1, loss=2.0),
        None,  # abandoned: nothing counted
    ]
    strategy = _Scripted(outcomes)
    trainer = _trainer(strategy, start_step=5)
    records = [trainer.one_step(stop=None) for _ in range(4)]
    assert records == [{"step": 6}, {"step": 7, "nonfinite": "x"}, {"step": 8}, None]
    assert strategy.steps == [5, 6, 7, 8]
    assert trainer.step == 8
    assert (trainer.tokens_done, trainer.targets_done, trainer.padding_done) == (22, 18, 3)
    assert (trainer.first_loss, trainer.last_loss) == (3.0, 2.0)


def test_a_first_step_that_is_not_finite_leaves_the_first_loss_to_the_next():
    strategy = _Scripted([StepOutcome({}, 1, 1, loss=None), StepOutcome({}, 1, 1, loss=4.0)])
    trainer = _trainer(strategy)
    trainer.one_step(None)
    assert math.isnan(trainer.first_loss)
    trainer.one_step(None)
    assert trainer.first_loss == trainer.last_loss == 4.0


def test_grpo_and_the_supervised_step_are_strategies_that_never_see_the_trainer():
    """Both implement `one_step(step, stop)`; grpo.py takes no trainer and names none."""
    for cls in (grpo.GrpoStep, SupervisedStep):
        assert list(cls.one_step.__code__.co_varnames[:3]) == ["self", "step", "stop"]
    for module in ("grpo", "strategy"):
        tree = ast.parse((ROOT / "compiletune" / "train" / f"{module}.py").read_text())
        args = {a.arg for f in ast.walk(tree) if isinstance(f, ast.arguments) for a in f.args}
        assert "trainer" not in args, module
