"""`train --fsdp --ep 2` on 4 gloo ranks: the mesh `dp_shard_mod_ep x ep` = [2, 2], each expert
held by two ranks (its gradient all-reduced over `dp_shard_mod_ep`), the other weights
FSDP-sharded over all 4; against one process that accumulates the 4 ranks' rows. Its step-2
checkpoint resumed under --ep 1 (FSDP alone: each rank holds other expert rows than under --ep 2,
and other rows of AdamW's moments) gives the same steps 3 and 4. The final checkpoint's HF
export (the experts gathered) loads in transformers, whose logits equal the one-process model's.
A checkpoint of the old layout (each rank's moments its own) is refused under --ep 1 in one line.
"""

from __future__ import annotations

import datetime
import os
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from gloo import free_port
from test_expert_parallel import BASE, TEXT, exported, losses, losses_by_step, rel

from compiletune import optim
from compiletune.distributed import close_group
from compiletune.errors import UserError

WORLD = 4
FLAGS = {**BASE, "router_bias_update_rate": 0.0, "max_steps": 4, "save_every": 2}


def worker(rank: int, port: int, tmp: str) -> None:
    from compiletune.config import resolve
    from compiletune.train.loop import train

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group(
        "gloo", rank=rank, world_size=WORLD, timeout=datetime.timedelta(seconds=120)
    )
    torch.set_num_threads(1)
    try:
        values = {**FLAGS, "data": f"{tmp}/corpus.txt", "fsdp": True, "ep": 2}
        train(resolve({}, {**values, "output_dir": f"{tmp}/ep"}))
        if rank == 0:  # the run cut back to its step-2 checkpoint, resumed under --ep 1
            shutil.copytree(f"{tmp}/ep", f"{tmp}/resumed", ignore=shutil.ignore_patterns("step_4"))
        dist.barrier()
        values["ep"] = 1
        train(resolve({}, {**values, "output_dir": f"{tmp}/resumed", "resume": True}))
        dist.barrier()
        # a checkpoint written before the moments were saved whole (each rank's own layout):
        # refused under another --ep in one line
        keep, optim._whole = optim._whole, lambda local, p: local
        train(resolve({}, {**values, "ep": 2, "max_steps": 2, "output_dir": f"{tmp}/old"}))
        optim._whole = keep
        try:
            train(resolve({}, {**values, "output_dir": f"{tmp}/old", "resume": True}))
        except UserError as e:
            Path(f"{tmp}/old-{rank}.txt").write_text(str(e))
        dist.barrier()
    finally:
        close_group()


@pytest.mark.slow
def test_four_ranks_ep2_match_one_process_resume_under_ep1_and_export(tmp_path):
    import transformers

    from compiletune.config import resolve
    from compiletune.models import from_hf
    from compiletune.train.loop import train

    (tmp_path / "corpus.txt").write_text(TEXT)
    mp.spawn(worker, args=(free_port(), str(tmp_path)), nprocs=WORLD, join=True)
    ref = tmp_path / "ref"
    values = {**FLAGS, "data": str(tmp_path / "corpus.txt"), "grad_accum": WORLD}
    train(resolve({}, {**values, "output_dir": str(ref)}))
    want, got = losses(ref), losses(tmp_path / "ep")
    assert len(got) == 4 and got == pytest.approx(want, rel=1e-5), (got, want)
    resumed = losses_by_step(tmp_path / "resumed")
    assert [resumed[s] for s in (3, 4)] == pytest.approx(want[2:], rel=1e-5), (resumed, want)
    for rank in range(WORLD):
        said = (tmp_path / f"old-{rank}.txt").read_text()
        assert "resume it with the --ep it was written with" in said and "\n" not in said, said
    final = tmp_path / "ep" / "step_4"
    got_t, want_t = exported(final), exported(ref / "step_4")
    assert got_t.keys() == want_t.keys() and any("experts" in k for k in got_t)
    bad = {k: rel(got_t[k], want_t[k]) for k in got_t if not rel(got_t[k], want_t[k]) <= 1e-4}
    assert not bad, bad
    # transformers reads the 4-rank export; compiletune's one-process model reads its own
    hf = transformers.AutoModelForCausalLM.from_pretrained(final, dtype=torch.float32).eval()
    mine = from_hf(ref / "step_4", dtype=torch.float32).eval()
    tokens = torch.randint(
        3, hf.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0)
    )
    with torch.no_grad():
        theirs = hf(tokens).logits
        ours = mine(tokens)
        ours = ours[0] if isinstance(ours, tuple) else ours
    assert rel(theirs, ours) <= 1e-5, rel(theirs, ours)
