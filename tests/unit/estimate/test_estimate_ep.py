"""`estimate-memory --ep N` (compiletune/estimate/expert_parallel.py): the fake-tensor estimate
of one rank against the same step run for real on 2 gloo ranks, its peak read from the CPU
allocator (as test_estimate.py does for FSDP), under uniform routing and under the skew the
estimate assumes; and the ladder's expert-parallel rung."""

from __future__ import annotations

import os

import pytest
import torch
import torch.multiprocessing as mp
from gloo import free_port, run_in_gloo

from compiletune.config import resolve
from compiletune.estimate import estimator as estimate
from compiletune.estimate import expert_parallel as ep_
from compiletune.estimate.fit import advice, ladder
from compiletune.estimate.fit.capacity import RESERVE_BYTES, Capacity
from compiletune.estimate.fit.printing import format_estimate
from compiletune.models import build_model
from compiletune.train.build_model import resolve_model_args

FLAGS = {
    "model": "debug_moe",
    "n_layers": 2,
    "seq_len": 256,
    "batch_size": 4,
    "dtype": "fp32",
    "loss": "plain",
    "fsdp": True,
    "ep": 2,
}
TOLERANCE = 0.10


def _rank(rank: int, port: int, flags: dict, skewed: bool, queue) -> None:
    os.environ["COMPILETUNE_LCE_EAGER"] = "1"
    torch.set_num_threads(1)
    if skewed:  # every (token, slot) to rank 0's experts: it receives both ranks' rows
        from compiletune.models.moe import MoE

        route = MoE.route

        def to_rank0(self, flat):
            weights, chosen, stats = route(self, flat)
            return weights, chosen % (self.n_experts // flags["ep"]), stats

        MoE.route = to_rank0

    def body() -> None:
        peak = estimate.measure_cpu_step(resolve({}, flags), 2)
        if rank == 0:
            queue.put(peak)

    run_in_gloo(rank, 2, port, body)


def _real(flags: dict, skewed: bool) -> int:
    queue = mp.get_context("spawn").SimpleQueue()
    args = (free_port(), flags, skewed, queue)
    mp.start_processes(_rank, args=args, nprocs=2, start_method="spawn")
    return queue.get()


@pytest.fixture(autouse=True)
def _eager_loss_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COMPILETUNE_LCE_EAGER", "1")


@pytest.mark.slow
@pytest.mark.parametrize("skewed", [False, True], ids=["uniform", "all-to-rank-0"])
def test_ep_estimate_matches_the_real_step_of_rank_0(skewed: bool) -> None:
    """Uniform routing (--ep-skew 1) against random routing, which is near uniform; --ep-skew 2
    against every row sent to rank 0's experts (the worst case for 2 ranks)."""
    flags = {**FLAGS, "ep_skew": 2.0 if skewed else 1.0}
    est = estimate.estimate_memory(resolve({}, flags), 2, round_bytes=1)
    real = _real(flags, skewed)
    assert abs(est.peak_bytes - real) <= TOLERANCE * real, (est.peak_bytes, real)


def test_ep_holds_a_share_of_the_experts_and_states_its_routing() -> None:
    """4 ranks, FSDP alone against --ep 2: each rank holds half the experts whole (FSDP: a
    quarter of them), with their optimizer state (AdamW's two fp32 moments), so the two
    differ by a quarter of the expert weights, times three; the skewed routing costs more
    than the uniform one (the rows received)."""
    base = {**FLAGS, "ep": 1}
    cfg = resolve({}, base)
    experts = sum(
        p.numel()
        for name, p in build_model(resolve_model_args(cfg), "meta").named_parameters()
        if ".experts." in name
    )
    fsdp = estimate.estimate_memory(cfg, 4, round_bytes=1)
    uniform = estimate.estimate_memory(
        resolve({}, {**base, "ep": 2, "ep_skew": 1.0}), 4, round_bytes=1
    )
    skewed = estimate.estimate_memory(
        resolve({}, {**base, "ep": 2, "ep_skew": 2.0}), 4, round_bytes=1
    )
    quarter = experts * 4 // 4  # fp32 bytes of a quarter of the experts
    for part, times in (("parameters", 1), ("optimizer_state", 2)):
        more = uniform.parts[part] - fsdp.parts[part]
        assert more == pytest.approx(times * quarter, rel=0.02), part
    assert skewed.peak_bytes > uniform.peak_bytes
    assert any("--ep 2" in n and "2 x its even share" in n for n in skewed.notes), skewed.notes
    assert skewed.setup["ep"] == 2 and "experts split over 2 (--ep)" in format_estimate(skewed)
    assert ep_.received_rows(100, 4, 2.0) == 200 and ep_.received_rows(100, 2, 8.0) == 200


def test_the_ladder_tries_expert_parallel_for_a_moe_model_on_several_gpus() -> None:
    cfg = resolve({}, {**FLAGS, "ep": 1})
    assert ep_.rungs(cfg, 1) == []
    assert ep_.rungs(resolve({}, {**FLAGS, "model": "debug", "ep": 1}), 8) == []
    ((name, flags),) = ep_.rungs(cfg, 12)  # debug_moe: 8 experts
    assert flags == {"fsdp": True, "ep": 4} and "4 ranks" in name
    rows = ladder.ladder(cfg, 2)
    assert rows[1].flags == "--ep 2" and rows[1].est is not None
    assert any("--ep 2" in n for n in rows[-1].est.notes)  # kept up the stack


def test_the_advice_adds_ep_where_it_is_enough_and_never_beside_cpu_offload() -> None:
    """FSDP alone misses a capacity that the --ep split meets (uniform routing, so that the
    split saves on this tiny model): the advice is `--ep 2` alone. Under --ep the ladder's CPU
    offload rung is not applicable (--ep refuses --cpu-offload)."""
    flags = {**FLAGS, "n_layers": 2, "ep": 1, "ep_skew": 1.0}
    cfg = resolve({}, flags)
    fsdp = estimate.estimate_memory(cfg, 2, round_bytes=1).peak_bytes
    split = estimate.estimate_memory(resolve({}, {**flags, "ep": 2}), 2, round_bytes=1).peak_bytes
    assert split < fsdp
    room = Capacity(RESERVE_BYTES + (fsdp + split) // 2)
    assert advice.advice(cfg, 2, room).startswith("add --ep 2 (")
    assert "n/a" in ladder._not_applicable(resolve({}, {**flags, "ep": 2}), {"cpu_offload": True})
