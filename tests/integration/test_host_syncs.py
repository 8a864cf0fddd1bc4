"""One host sync per optimizer step, on every rung of the technique ladder (dense and MoE;
SFT, DPO, KD): the loss / grad-norm check and nothing else.

On a GPU every read of a device value on the host (`.item()`, `.tolist()`, `bool(t)`, `int(t)`,
a data-dependent size such as `nonzero`) stalls the host until the device's queue drains. The
test runs on CPU with COMPILETUNE_NO_HOST_READS=1, which makes the code take its accelerator
paths, and counts such reads inside each step after the first (which compiles):
    reads          Tensor.item / tolist / __bool__ / __int__ / __float__ / __index__, wherever
                   called (our ops' Python bodies included);
    sizes          calls whose output size depends on data (nonzero, masked_select, argwhere,
                   unique, boolean indexing).
Both are counted at the Python level: a TorchDispatchMode would not see inside our custom ops,
and under one the segment op's functorch backward cannot run.
Not counted: the host batch before it is copied (`next_batch`), and the CPU-only kernels that
never run on a GPU (the segment attention op `doc_segments`, the grouped-mm fallback `_groups`).
"""

from __future__ import annotations

import functools
import sys
import traceback
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.overrides import TorchFunctionMode

from compiletune.data.tokenizer import byte_tokenizer
from compiletune.hardware import HOST_READS_ENV
from compiletune.models import build_model, from_name
from compiletune.models.hf import save_hf
from compiletune.train import loop

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from pair_data import write_pairs  # noqa: E402
from tiny_run import tiny_run  # noqa: E402

HOST_SIDE = {"next_batch", "doc_segments", "_groups"}  # see the module docstring
READS = ("item", "tolist", "__bool__", "__int__", "__float__", "__index__")
# ops whose output size depends on the data (the host must know it)
SIZE_FROM_DATA = [(torch, n) for n in ("nonzero", "masked_select", "argwhere", "unique")]
SIZE_FROM_DATA += [(torch.Tensor, n) for n in ("nonzero", "masked_select", "argwhere", "unique")]


class Syncs:
    """Counts host reads of tensor values while `counting` (`where`: the call sites)."""

    def __init__(self) -> None:
        self.where: list[str] = []
        self.counting = False
        self.per_step: list[list[str]] = []

    def note(self, what: str) -> None:
        if not self.counting:
            return
        stack = traceback.extract_stack()[:-2]
        if any(frame.name in HOST_SIDE for frame in stack):
            return
        ours = [f for f in stack if "compiletune" in f.filename or "/models/" in f.filename]
        site = f"{ours[-1].filename.split('/')[-1]}:{ours[-1].lineno}" if ours else "?"
        self.where.append(f"{what} at {site}")


def _bool_index(index: Any) -> bool:
    parts = index if isinstance(index, tuple) else (index,)
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in parts)


class BoolIndexing(TorchFunctionMode):
    """Notes `t[mask]` (a boolean index: its output size depends on the data)."""

    def __init__(self, counter: Syncs, originals: dict | None = None) -> None:
        super().__init__()
        self.counter = counter
        # the patched reads -> the real ones: a patched read already noted itself and called
        # the real one, which lands here; calling the patched one again would note it twice
        self.originals = originals or {}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.Tensor.__getitem__ and _bool_index(args[1]):
            self.counter.note("boolean indexing")
        return self.originals.get(func, func)(*args, **(kwargs or {}))


@pytest.fixture()
def syncs(monkeypatch) -> Syncs:
    """Count per step (after the first) of every run the test starts."""
    monkeypatch.setenv(HOST_READS_ENV, "1")
    counter = Syncs()
    originals = {}
    for name in READS:
        real = getattr(torch.Tensor, name)

        @functools.wraps(real)
        def read(self, *args, _real=real, _name=name, **kwargs):
            counter.note(f"Tensor.{_name}")
            return _real(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, read)
        originals[read] = real
    for owner, name in SIZE_FROM_DATA:
        real = getattr(owner, name)

        @functools.wraps(real)
        def sized(*args, _real=real, _name=name, **kwargs):
            counter.note(_name)
            return _real(*args, **kwargs)

        monkeypatch.setattr(owner, name, sized)
        originals[sized] = real
    # Boolean indexing through a torch-function mode around the counted steps: a class-level
    # patch of Tensor.__getitem__ cannot be undone (CPython keeps the sequence slot it adds,
    # after which torch.tensor([0-d tensor, ...]) fails in every later test of the process).
    mode = BoolIndexing(counter, originals)
    real_step = loop.Trainer.one_step

    def one_step(self, stop) -> dict[str, Any]:
        first = self.step == self.run.start_step
        counter.where, counter.counting = [], not first
        try:  # every step under the mode: the compiled ones trace it from the first
            with mode:
                return real_step(self, stop)
        finally:
            counter.counting = False
            if not first:
                counter.per_step.append(counter.where)

    monkeypatch.setattr(loop.Trainer, "one_step", one_step)
    return counter


def _corpus(tmp_path: Path) -> str:
    docs = [
        f"Document {i}: " + " ".join(f"w{(i * j) % 17}" for j in range(i % 9 + 3))
        for i in range(200)
    ]
    path = tmp_path / "docs.txt"
    path.write_text("\n\n\n".join(docs))
    return str(path)


AOT = {"compile": True, "compile_backend": "aot_eager"}
FUSED = {"loss": "fused"}  # the default only from a 32k vocabulary or under --compile
RUNGS = {
    "plain": {"loss": "plain"},
    "fused": FUSED,
    "compile": AOT,
    "selective AC": {**AOT, "ac": "selective"},
    "full AC": {**AOT, "ac": "full"},
    "optimizer in backward": {
        **AOT,
        "ac": "selective",
        "optimizer_in_backward": True,
        "max_grad_norm": 0,
    },
    "8-bit AdamW": {**AOT, "optimizer": "adamw8bit"},
    "offload": {**AOT, "offload_activations": True},
    "LoRA": {**AOT, "lora_rank": 8},
    "QLoRA": {**FUSED, "lora_rank": 8, "quantize_base": "nf4"},
    "MoE": {**FUSED, "model": "debug_moe", "n_layers": 2},
    "MoE compiled": {"model": "debug_moe", "n_layers": 2, **AOT},
}


def _check(syncs: Syncs, summary: dict) -> None:
    assert summary["steps"] >= 3 and len(syncs.per_step) >= 2, syncs.per_step
    for where in syncs.per_step:
        assert len(where) == 1, where  # the one read: the step's values in `read_once`
        assert "Tensor.tolist at step.py" in where[0], where


@pytest.mark.parametrize("rung", list(RUNGS), ids=list(RUNGS))
def test_one_host_sync_per_step(tmp_path, syncs, rung):
    flags = {"seq_len": 64, "batch_size": 2, "max_steps": 3, "dtype": "fp32", **RUNGS[rung]}
    _check(syncs, tiny_run(tmp_path, _corpus(tmp_path), **flags))


@pytest.mark.parametrize("objective", ["dpo", "kd"])
def test_one_host_sync_per_step_of_an_objective(tmp_path, syncs, objective):
    flags = {
        "seq_len": 64,
        "batch_size": 2,
        "max_steps": 3,
        "dtype": "fp32",
        "objective": objective,
    }
    if objective == "kd":
        save_hf(build_model(from_name("debug"), seed=7), tmp_path / "t", tokenizer=byte_tokenizer())
        flags["teacher_dir"] = str(tmp_path / "t")
        data = _corpus(tmp_path)
    else:
        data = write_pairs(tmp_path / "pairs.jsonl", n=60)
    _check(syncs, tiny_run(tmp_path, data, **flags))


def test_read_once_brings_every_value_back_in_its_shape():
    from compiletune.train.step import read_once

    values = {
        "loss_sum": torch.tensor(2.5),
        "grad_norm": torch.tensor(0.25, dtype=torch.float64),
        "expert_tokens": torch.tensor([[1, 2, 3], [4, 5, 6]]),
        "extra.kl": torch.tensor([0.5, 1.5]),
    }
    host = read_once(values)
    assert host == {
        "loss_sum": 2.5,
        "grad_norm": 0.25,
        "expert_tokens": [[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]],
        "extra.kl": [0.5, 1.5],
    }
    assert read_once({}) == {}


def test_boolean_indexing_is_noted_and_leaves_tensors_as_they_were():
    counter = Syncs()
    counter.counting = True
    x = torch.arange(6.0)
    with BoolIndexing(counter):
        x[x > 2]
        x[1:3]
    assert [w.split(" at ")[0] for w in counter.where] == ["boolean indexing"]
    # no class-level patch: torch.tensor still takes a list of 0-d tensors
    assert torch.tensor([torch.tensor(1), torch.tensor(2)]).tolist() == [1, 2]
