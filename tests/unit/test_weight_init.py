"""Hashed initial weights (compiletune.weight_init): the distribution, the same values for any
shard layout, and an FSDP random init that never holds a full copy of the model."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from gloo import free_port, run_in_gloo

from compiletune import weight_init
from compiletune.config import resolve
from compiletune.distributed import DistEnv, apply_fsdp, build_mesh
from compiletune.estimate.tracker import Tracker
from compiletune.gather import full_tensor
from compiletune.models import Transformer, build_model, from_name
from compiletune.train.build import build_run

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed unavailable")


def _draws(n: int, dtype: torch.dtype, key: int = 11, start: int = 0) -> torch.Tensor:
    t = torch.empty(n, dtype=dtype)
    weight_init.hashed_normal_(t, 0.02, key, start)
    return t


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_hashed_draws_are_normal_in_the_parameters_dtype(dtype: torch.dtype) -> None:
    """N(0, 0.02) in the tensor's own dtype: mean, std, the share within one and two std and
    the fourth moment of a normal; two keys draw unrelated values."""
    n = 1 << 21
    t = _draws(n, dtype)
    assert t.dtype == dtype
    z = t.double() / 0.02
    assert abs(z.mean().item()) < 5 / math.sqrt(n)
    assert z.std().item() == pytest.approx(1.0, abs=0.01)
    assert (z.abs() < 1).double().mean().item() == pytest.approx(0.6827, abs=0.003)
    assert (z.abs() < 2).double().mean().item() == pytest.approx(0.9545, abs=0.002)
    assert (z**4).mean().item() == pytest.approx(3.0, abs=0.05)
    other = _draws(n, dtype, key=12).double() / 0.02
    assert abs((z * other).mean().item()) < 5 / math.sqrt(n)
    assert torch.unique(t).numel() > (1000 if dtype == torch.bfloat16 else n // 2)


def test_a_shard_draws_the_values_of_its_indices() -> None:
    """Values start..start+n of a key are the same however the whole is cut, past 2**32 too,
    and the torch-op path (other devices) draws what the C++ kernel draws."""
    whole = _draws(10_000, torch.float32)
    for start, n in [(0, 1), (3, 1000), (4096, 777), (9000, 1000)]:
        assert torch.equal(_draws(n, torch.float32, start=start), whole[start : start + n])
    ref = weight_init._torch_draws(10_000, 0, 11, 0.02, torch.device("cpu"))
    torch.testing.assert_close(whole, ref, rtol=1e-6, atol=1e-8)
    edge = (1 << 32) - 1500  # a kernel chunk straddles 2**32 here
    across = _draws(3000, torch.float32, start=edge)
    torch.testing.assert_close(across[1000:], _draws(2000, torch.float32, start=edge + 1000))
    ref = weight_init._torch_draws(3000, edge, 11, 0.02, torch.device("cpu"))
    torch.testing.assert_close(across, ref, rtol=1e-6, atol=1e-8)
    strided = torch.empty(40, 30).t()  # not contiguous: the torch path, into place
    weight_init.hashed_normal_(strided, 0.02, 11)
    torch.testing.assert_close(strided.flatten(), _draws(1200, torch.float32), rtol=1e-6, atol=1e-8)


def test_a_slice_of_rows_draws_the_rows_of_the_whole() -> None:
    """A plain parameter holding rows first_row.. of the whole (--ep's experts on one rank)
    draws those rows' values."""
    whole = torch.empty(8, 3, 5)
    weight_init.hashed_normal_(whole, 0.02, 5)
    part = torch.nn.Parameter(torch.empty(2, 3, 5))
    part.first_row = 4
    weight_init.hashed_normal_(part.detach(), 0.02, 5, weight_init.shard_offset(part))
    assert torch.equal(part.detach(), whole[4:6])


def _one_process_weights() -> dict[str, torch.Tensor]:
    args = from_name("debug")
    args.n_layers = 2
    model = weight_init.init_hashed(build_model(args, init=False), seed=3)
    return {k: v.clone() for k, v in model.state_dict().items()}


def _sharded_worker(rank: int, port: int, out: str) -> None:
    torch.set_num_threads(1)

    def body() -> None:
        args = from_name("debug")
        args.n_layers = 2
        with torch.device("meta"):
            model = Transformer(args)
        env = DistEnv(rank, 2, rank, 2, torch.device("cpu"), owns_group=False)
        apply_fsdp(model, build_mesh(env, "full", None), cpu_offload=True)
        model.to_empty(device="cpu")
        weight_init.init_hashed(model, seed=3)
        full = {k: full_tensor(v.detach()).clone() for k, v in model.state_dict().items()}
        if rank == 0:
            torch.save(full, out)

    run_in_gloo(rank, 2, port, body)


def test_two_ranks_draw_the_weights_one_process_draws(tmp_path: Path) -> None:
    """Each of 2 FSDP ranks draws its own shard (odd row counts included: the vocabulary
    split unevenly), and the gathered model is the one a single process draws."""
    out = str(tmp_path / "sharded.pt")
    mp.spawn(_sharded_worker, args=(free_port(), out), nprocs=2)
    sharded = torch.load(out)
    one = _one_process_weights()
    assert sharded.keys() == one.keys()
    for name, value in one.items():
        assert torch.equal(sharded[name], value), name
    assert one["layers.0.attention.wq.weight"].std().item() == pytest.approx(0.02, rel=0.05)


def test_fsdp_random_init_holds_no_full_copy(tmp_path: Path) -> None:
    """`build_run` of an FSDP run with --cpu-offload and a random init: every storage it
    allocates is counted (the estimator's Tracker on real tensors) and the peak stays near the
    parameters and optimizer state it keeps: no rank builds the whole model to hand out shards
    (that path peaked at a second copy of the parameters)."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("Some text to train on, repeated. " * 200)
    cfg = resolve(
        {},
        {
            "model": "debug",
            "n_layers": 2,
            "data": str(corpus),
            "seq_len": 32,
            "batch_size": 1,
            "fsdp": True,
            "cpu_offload": True,
            "optimizer": "adamw8bit",
            "output_dir": str(tmp_path / "run"),
        },
    )
    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1
    )
    try:
        env = DistEnv(0, 1, 0, 1, torch.device("cpu"), owns_group=False)
        with Tracker(set()) as tracker:
            run = build_run(cfg, env)
        peak = max(seg.peak for seg in tracker.segments.values())
        params = sum(p.to_local().numel() * p.element_size() for p in run.model.parameters())
        state = run.optimizer.state_bytes()
        assert run.model.output.weight.to_local().std().item() == pytest.approx(0.02, rel=0.05)
    finally:
        dist.destroy_process_group()
    # the parameters, their 8-bit state and scratch far below a second copy of the weights
    assert peak < state + 1.4 * params, (peak, params, state)
    assert peak >= params + state
