"""build_run as a caller outside the trainer sees it (train/observer.py): plain options and one
observer, told each part as it begins, with every allocation of the build inside its scope."""

from __future__ import annotations

import contextlib

import pytest
import torch

from compiletune.config import resolve
from compiletune.train import BuildOptions, build_run
from compiletune.train.observer import PHASES
from compiletune.train.step import StepBatch, backward_pass, optimizer_step

SMALL = {"model": "debug", "n_layers": 2, "seq_len": 32, "batch_size": 2, "dtype": "fp32"}


class Recorder:
    """An observer that notes each phase, whether it began inside the scope, and how many
    trainable parameters it was shown."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, bool, int]] = []
        self.inside = False

    @contextlib.contextmanager
    def scope(self):
        self.inside = True
        try:
            yield
        finally:
            self.inside = False

    def observe(self, phase: str, params: list[torch.nn.Parameter]) -> None:
        self.seen.append((phase, self.inside, len(params)))


def test_the_observer_sees_each_part_in_order_inside_its_scope() -> None:
    cfg = resolve({}, SMALL)
    watcher = Recorder()
    opts = BuildOptions(device=torch.device("cpu"), read_inputs=False, compile=False)
    run = build_run(cfg, None, opts, watcher)
    assert run.batches is None and run.tokenizer is None  # nothing was read
    n = len(run.params)
    assert n == sum(1 for p in run.model.parameters() if p.requires_grad) > 0
    assert watcher.seen == [("params", True, 0), ("optimizer", True, n)]
    rows, seq = cfg.data.batch_size, cfg.data.seq_len
    tokens = torch.randint(0, run.args.vocab_size, (rows, seq))
    batch = StepBatch([{"inputs": tokens, "targets": tokens.roll(-1, 1)}], rows * seq)
    with watcher.scope():  # the caller runs the step in its scope, as the estimator does
        done = backward_pass(run, batch)
        optimizer_step(run, done)
    assert [phase for phase, _, _ in watcher.seen] == list(PHASES)
    assert all(inside for _, inside, _ in watcher.seen)


def test_a_fake_build_reads_nothing() -> None:
    with pytest.raises(ValueError, match="read_inputs=False"):
        BuildOptions(fake=True)
