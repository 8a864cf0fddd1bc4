"""before_train.prepare: what `compiletune train` runs before the trainer, above train/ and
estimate/: on a GPU the pre-flight estimate refuses a step that cannot fit and hands the
trainer its estimate; on a CPU nothing is estimated."""

from __future__ import annotations

import pytest
import torch

from compiletune import before_train
from compiletune.config import resolve
from compiletune.errors import UserError
from compiletune.estimate import estimator
from compiletune.estimate.fit.capacity import RESERVE_BYTES

SMALL = {"model": "debug", "n_layers": 2, "seq_len": 64, "batch_size": 2, "dtype": "fp32"}


@pytest.fixture(autouse=True)
def _eager_loss_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COMPILETUNE_LCE_EAGER", "1")


def test_on_a_cpu_nothing_is_estimated(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*a: object, **k: object) -> None:
        raise AssertionError("estimated on a CPU")

    monkeypatch.setattr(before_train, "pick_device", lambda: torch.device("cpu"))
    monkeypatch.setattr(before_train, "preflight_check", refuse)
    cfg = resolve({}, SMALL)
    assert before_train.prepare(cfg) == (cfg, None)


def test_on_a_gpu_the_preflight_refuses_or_returns_the_estimate(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The estimate the trainer is handed is the estimator's own, and a GPU too small for it is
    refused before the trainer starts (a fake GPU: its capacity is all the check reads)."""
    cfg = resolve({}, SMALL)
    peak = estimator.estimate_memory(cfg).peak_bytes
    monkeypatch.setattr(before_train, "pick_device", lambda: torch.device("cuda"))
    room = {"bytes": peak + RESERVE_BYTES + 2**20}
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (0, room["bytes"]))
    planned, gib = before_train.prepare(cfg)
    assert planned == cfg and gib == peak / 2**30
    assert before_train.prepare(cfg.replace(preflight=False)) == (
        cfg.replace(preflight=False),
        None,
    )
    room["bytes"] = peak
    with pytest.raises(UserError, match="--no-preflight skips this check"):
        before_train.prepare(cfg)
