"""--mlp-tile: a block's MLP part over a few tokens at a time gives the same loss and gradients
as over the whole row, eagerly and compiled, while the step's transient memory shrinks."""

from __future__ import annotations

import pytest
import torch

from compiletune.compiler.regions import CompileOptions, compile_regions
from compiletune.config import resolve
from compiletune.estimate.estimator import estimate_memory, measure_cpu_step
from compiletune.loss.head import LossHead
from compiletune.models import build_model, from_name


def _loss_and_grads(model, head, t: torch.Tensor):
    model.zero_grad()
    loss = head(model.hidden_states(t[:, :-1]), t[:, 1:])
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize(
    ("preset", "compiled"),
    [("debug", False), ("debug_gemma2", False), ("debug_gemma2", True)],  # Gemma 2: norms after
)
def test_tiled_mlp_equals_the_whole_row(preset: str, compiled: bool) -> None:
    args = from_name(preset)
    args.n_layers = 2
    model = build_model(args, seed=4)
    head = LossHead(model.output, "plain", model.args.final_softcap)
    t = torch.randint(0, args.vocab_size, (2, 41), generator=torch.Generator().manual_seed(2))
    want_loss, want = _loss_and_grads(model, head, t)
    for block in model.layers:
        block.mlp_tile = 16  # 40 tokens: tiles of 16, 16 and 8
    regions = None
    if compiled:
        regions = compile_regions(model, head, CompileOptions(backend="aot_eager", loss="plain"))
    for _ in range(2 if compiled else 1):
        loss, got = _loss_and_grads(model, head, t)
        torch.testing.assert_close(loss, want_loss, rtol=1e-5, atol=0)
        for n, g in got.items():  # sums over tiles in another order: relative to the norm
            assert (g - want[n]).norm() <= 1e-5 * want[n].norm(), n
    if regions is not None:
        assert regions.stats()["recompiles"] == 0


def test_tiling_lowers_the_peak_estimated_and_measured() -> None:
    """A 4096-token row with tiles of 512 tokens: the estimate (the trainer's own step on fake
    tensors) sees the smaller transient, and the real CPU step's peak falls as well, the
    estimate within 10% of it."""
    flags = {"model": "debug", "n_layers": 2, "seq_len": 4096, "batch_size": 1, "ac": "full"}
    flags |= {"dtype": "fp32"}
    whole = estimate_memory(resolve({}, flags), 1)
    tiles = estimate_memory(resolve({}, {**flags, "mlp_tile": 512}), 1)
    assert tiles.parts["temporaries"] < whole.parts["temporaries"]
    assert tiles.peak_bytes < whole.peak_bytes
    measured = measure_cpu_step(resolve({}, {**flags, "mlp_tile": 512}))
    assert measured < measure_cpu_step(resolve({}, flags))
    assert abs(tiles.peak_bytes - measured) <= 0.1 * measured
