"""A sharded checkpoint resumed on another number of processes (resharding on load).

Straight runs on 2 gloo ranks (`--fsdp`; `--fsdp --ep 2`; LoRA on the experts under --ep 2),
4 steps of 2 rows per rank, checkpoints at steps 2 and 4. Each is cut back to step 2 and
resumed on 1 process with 4 rows, and on 4 ranks with 1 row each (--ep 1, 2 or 4): the global
batch is the same 4 rows, so steps 3 and 4 must equal the straight run's (rel 1e-5, fp32), and
the step-4 checkpoint's weights, AdamW moments and step counts must equal the straight run's.
The model is MoE with no load-balancing loss (each rank's own, so it depends on the split) and
no dropout (each rank draws its own). 8-bit AdamW, whose blocks are cut from each process's
shard, is refused on another number of processes in one line.
"""

from __future__ import annotations

import datetime
import json
import os
import random
import shutil
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from gloo import free_port

from compiletune.checkpoint import steps as ckpt
from compiletune.distributed import SHARDED_DIR, close_group
from compiletune.errors import UserError

TEXT = "\n".join(f"Row {i}: a line about resharding, number {i * 13 % 19}." for i in range(200))
BASE = {"model": "debug_moe", "n_layers": 2, "seq_len": 32, "lr": 3e-3, "packing": "stream"}
BASE |= {"router_aux_coef": 0.0, "max_steps": 4, "save_every": 2, "fsdp": True}
LORA = {"lora_rank": 4, "lora_targets": "q,v,gate,up,down"}
# name -> (flags of every run, --ep on 2 ranks, --ep on 4 ranks); 1 process: --ep 1
CASES = {
    "full": ({}, 1, 1),
    "ep": ({}, 2, 4),
    "lora-ep": (LORA, 2, 2),
}
ROWS = 4  # the global batch of every run


def _join(rank: int, world: int, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group(
        "gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=120)
    )
    torch.set_num_threads(1)


def straight_worker(rank: int, port: int, tmp: str) -> None:
    """The straight runs on 2 ranks, and an 8-bit AdamW run to step 2."""
    from compiletune.config import resolve
    from compiletune.train.loop import train

    _join(rank, 2, port)
    try:
        for name, (flags, ep, _) in CASES.items():
            values = {**BASE, **flags, "ep": ep, "batch_size": ROWS // 2}
            train(
                resolve({}, {**values, "data": f"{tmp}/corpus.txt", "output_dir": f"{tmp}/{name}"})
            )
        values = {**BASE, "batch_size": 2, "max_steps": 2, "optimizer": "adamw8bit"}
        train(resolve({}, {**values, "data": f"{tmp}/corpus.txt", "output_dir": f"{tmp}/8bit"}))
        dist.barrier()
    finally:
        close_group()


def resume_worker(rank: int, world: int, port: int, tmp: str, data: str) -> None:
    """Each straight run cut back to step 2 (copied by the test), resumed on `world` processes
    (on the straight runs' `data`)."""
    from compiletune.config import resolve
    from compiletune.train.loop import train

    _join(rank, world, port)
    try:
        if world == 1:  # refused, each in one line: 8-bit AdamW; the global batch 4 -> 2 rows
            said = []
            for out, flags in (("8bit", {"optimizer": "adamw8bit"}), ("full-on-1", {})):
                values = {**BASE, **flags, "batch_size": 4 if flags else 2, "resume": True}
                try:
                    train(resolve({}, {**values, "data": data, "output_dir": f"{tmp}/{out}"}))
                except UserError as e:
                    said.append(str(e))
            Path(f"{tmp}/said.json").write_text(json.dumps(said))
        for name, (flags, _, ep4) in CASES.items():
            values = {**BASE, **flags, "ep": ep4 if world == 4 else 1, "batch_size": ROWS // world}
            out = f"{tmp}/{name}-on-{world}"
            train(resolve({}, {**values, "data": data, "output_dir": out, "resume": True}))
        dist.barrier()
    finally:
        close_group()


def saved_tensors(ckpt: Path) -> dict[str, torch.Tensor]:
    """Every whole tensor of a step's sharded checkpoint (weights, moments) and rank 0's step
    counts, read without a process group; a LoRA checkpoint's adapters beside them."""
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import load_file
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    folder = ckpt / SHARDED_DIR
    meta = FileSystemReader(str(folder)).read_metadata().state_dict_metadata
    keep = ("model.", "optimizer_whole.", "optimizer.rank0.state.")
    want = {
        k: torch.empty(tuple(md.size), dtype=md.properties.dtype)
        for k, md in meta.items()
        if k.startswith(keep) and isinstance(md, TensorStorageMetadata)
    }
    nested: dict = {}
    for k, t in want.items():  # DCP reads a nested dict whose flattened keys are these
        *path, last = _path(k)
        node = nested
        for p in path:
            node = node.setdefault(p, {})
        node[last] = t
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(nested, checkpoint_id=str(folder), no_dist=True)
    adapters = ckpt / "adapter_model.safetensors"
    if adapters.is_file():
        want |= {f"adapter.{k}": t for k, t in load_file(adapters).items()}
    return want


def _path(key: str) -> list[str]:
    """A saved key's place in the nested dict it was saved from: a parameter name (dots and
    all) is one level."""
    if key.startswith("model."):
        return ["model", key.removeprefix("model.")]
    head = "optimizer.rank0.state" if key.startswith("optimizer.rank0.") else "optimizer_whole"
    name, state = key.removeprefix(head + ".").rsplit(".", 1)
    return [*head.split("."), name, state]


def losses_by_step(folder: Path) -> dict[int, float]:
    from compiletune.metrics import read_metrics

    return {r["step"]: r["loss"] for r in read_metrics(folder / "metrics.jsonl") if "loss" in r}


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm()) if b.norm() > 0 else float(a.abs().max())


@pytest.fixture(scope="module")
def straight(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("straight")
    (tmp / "corpus.txt").write_text(TEXT)
    mp.spawn(straight_worker, args=(free_port(), str(tmp)), nprocs=2, join=True)
    return tmp


def _resume_on(world: int, straight: Path, tmp: Path) -> None:
    for name in CASES:
        shutil.copytree(
            straight / name, tmp / f"{name}-on-{world}", ignore=shutil.ignore_patterns("step_4")
        )
    if world == 1:
        shutil.copytree(straight / "8bit", tmp / "8bit")
    mp.spawn(
        resume_worker,
        args=(world, free_port(), str(tmp), str(straight / "corpus.txt")),
        nprocs=world,
        join=True,
    )


def _check_equal(world: int, straight: Path, tmp: Path) -> None:
    failures = []
    for name in CASES:
        want = losses_by_step(straight / name)
        got = losses_by_step(tmp / f"{name}-on-{world}")
        assert sorted(want) == [1, 2, 3, 4] and sorted(got) == [1, 2, 3, 4], (name, want, got)
        if [got[s] for s in (3, 4)] != pytest.approx([want[s] for s in (3, 4)], rel=1e-5):
            failures.append(f"{name}: losses {got} vs straight {want}")
        assert want[4] != pytest.approx(want[2], rel=1e-3)  # the steps moved the weights
        a = saved_tensors(tmp / f"{name}-on-{world}" / "step_4")
        b = saved_tensors(straight / name / "step_4")
        assert a.keys() == b.keys() and any(k.startswith("optimizer_whole.") for k in a), name
        assert any("exp_avg_sq" in k for k in a) and any(k.endswith(".step") for k in a), name
        bad = {k: rel(a[k], b[k]) for k in a if not rel(a[k], b[k]) <= 1e-5}
        if bad:
            failures.append(f"{name}: step-4 tensors differ: {sorted(bad.items())[:4]}")
    assert not failures, "\n".join(failures)


@pytest.mark.slow
def test_two_ranks_resumed_on_one_process(straight, tmp_path):
    """2 ranks -> 1 process (--fsdp, a group of one, --ep 1): the same steps 3 and 4 and the
    same weights and moments; an 8-bit AdamW checkpoint is refused in one line, and so is a
    resume whose global batch would halve (--batch-size 2 on 1 process)."""
    _resume_on(1, straight, tmp_path)
    _check_equal(1, straight, tmp_path)
    eight, batch = json.loads((tmp_path / "said.json").read_text())
    assert "8-bit AdamW" in eight and eight.endswith("resume with 2 processes"), eight
    assert "global batch 4 -> 2 rows per step" in batch and "--batch-size 4 keeps it" in batch
    assert "\n" not in eight + batch, (eight, batch)


@pytest.mark.slow
def test_two_ranks_resumed_on_four(straight, tmp_path):
    """2 ranks -> 4 ranks, 1 row each (--ep 1, 4, and 2 over a [2, 2] mesh)."""
    _resume_on(4, straight, tmp_path)
    _check_equal(4, straight, tmp_path)


def test_a_changed_global_batch_is_a_change_and_a_kept_one_is_not():
    from compiletune.config import resolve
    from compiletune.train.run_dir.resume import judge_resume, judge_world_change

    saved = {"batch_size": 2, "grad_accum": 1, "cp": 1}
    kept = resolve({}, {**BASE, "batch_size": 4})
    changed, notes = judge_world_change(kept, saved, 2, 1, ["--batch-size 2 -> 4", "--seed 0 -> 1"])
    assert changed == ["--seed 0 -> 1"]
    assert "on 1 process (" in notes[0] and "stays 4 rows per step" in notes[0], notes
    halved = resolve({}, {**BASE, "batch_size": 2})
    with pytest.raises(UserError, match=r"global batch 4 -> 2 rows .*--batch-size 4 keeps it"):
        judge_resume(halved, {**saved, "max_steps": 4}, 2, (2, 1))
    lines = judge_resume(halved.replace(accept_changes=True), {**saved, "max_steps": 4}, 2, (2, 1))
    assert any("continue at the row the run had reached" in x for x in lines), lines
    assert judge_world_change(halved, saved, 2, 2, []) == ([], [])  # the same processes


def test_cuda_rng_states_of_more_gpus_than_this_process_sees(monkeypatch):
    """A checkpoint saved where 8 GPUs were visible, resumed where 2 are: the 2 states are
    restored, not an IndexError (which the resume reported as a damaged trainer_state.pt)."""
    restored = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda s, i: restored.append((i, int(s[0]))))
    cuda = [torch.tensor([10 + i], dtype=torch.uint8) for i in range(8)]
    state = {"python": random.getstate(), "torch": torch.get_rng_state(), "cuda": cuda}
    ckpt.set_rng_state(state)
    assert restored == [(0, 10), (1, 11)]


def test_a_single_process_checkpoint_gets_no_batch_advice_under_fsdp(tmp_path):
    """A single-process checkpoint resumed with --fsdp on 2 processes is refused by the
    checkpoint's own check (it resumes in one process); the run folder's judgement before it
    says nothing of a changed global batch, whose advice could not help."""
    from compiletune.cli import main
    from compiletune.config import resolve
    from compiletune.train.run_dir.contents import check_output_dir

    out = str(tmp_path / "run")
    flags = ["--n-layers", "1", "--batch-size", "2", "--seq-len", "64", "--output-dir", out]
    assert main(["train", "--max-steps", "1", *flags]) == 0
    values = {"n_layers": 1, "batch_size": 2, "seq_len": 64, "output_dir": out}
    cfg = resolve({}, {**values, "resume": True, "fsdp": True, "max_steps": 2})
    _, notes = check_output_dir(cfg, 2)
    assert not any("global batch" in n or "processes" in n for n in notes), notes
