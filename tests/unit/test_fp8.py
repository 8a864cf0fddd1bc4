"""--fp8: the blocks' linears as torchao float8 training linears (emulated on a CPU).

The bounds: e4m3 (inputs, weights) rounds each value to within 2^-4 of itself, e5m2 (output
gradients) to within 2^-3: an RMS error of about 0.125 / sqrt(3) = 7% a cast for gradients.
Summed over a dot product the errors mostly cancel in the loss (within 1%); a weight gradient
carries the casts of every layer's output gradient above it (up to eight in these two-block
models: sqrt(8) x 7% = 20%), so each converted weight's gradient, and the whole gradient, is
within 25% of full precision's in L2. In a MoE model the noise can flip a token's top-k
experts, a jump no such bound covers: there the loss alone is checked, and that the router and
the experts stay in high precision. A wrong scale is
off by its factor, far outside both; an unconverted model would pass trivially, which is why
the converted count is checked too.
"""

from __future__ import annotations

import pytest
import torch
import transformers

pytest.importorskip("torchao")

from compiletune import fp8  # noqa: E402
from compiletune.config import resolve  # noqa: E402
from compiletune.errors import UserError  # noqa: E402
from compiletune.estimate.estimator import estimate_memory  # noqa: E402
from compiletune.loss.head import LossHead  # noqa: E402
from compiletune.metrics import read_metrics  # noqa: E402
from compiletune.models import build_model, from_name  # noqa: E402
from compiletune.train.loop import train  # noqa: E402


@pytest.fixture
def emulate(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(fp8.EMULATE_ENV, "1")


def _loss_and_grads(model, t: torch.Tensor):
    head = LossHead(model.output, "plain", model.args.final_softcap)
    loss = head(model.hidden_states(t[:, :-1]), t[:, 1:]) / t[:, 1:].numel()
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize(
    ("recipe", "preset"),
    [("rowwise", "debug"), ("tensorwise", "debug"), ("rowwise", "debug_moe")],
)
def test_float8_step_tracks_full_precision(recipe: str, preset: str) -> None:
    args = from_name(preset)
    args.n_layers = 2
    t = torch.randint(0, args.vocab_size, (2, 65), generator=torch.Generator().manual_seed(3))
    ref_loss, ref = _loss_and_grads(build_model(args, seed=1), t)
    model = build_model(args, seed=1)
    n, kept = fp8.convert_blocks(model, recipe, emulate=True, fsdp=False)
    linears = sum(type(m) is torch.nn.Linear for m in build_model(args).layers.modules())
    routers = sum(line.endswith("a router") for line in kept)
    assert n == linears - routers and n > 0
    if preset == "debug_moe":  # the router stays; the stacked experts are not linears
        assert kept == ["feed_forward.router: a router"]
    loss, grads = _loss_and_grads(model, t)
    assert abs(loss - ref_loss) <= 0.01 * ref_loss
    assert grads.keys() == ref.keys()
    if preset == "debug_moe":  # float8 noise can flip a token's top-k experts: no bound per
        return  # gradient holds there, only the loss's
    float8 = {
        f"layers.{n}.weight"
        for n, m in model.layers.named_modules()
        if type(m).__name__ == "Float8Linear"
    }
    assert len(float8) == n
    for name in float8:  # each converted weight's gradient
        err = float((grads[name] - ref[name]).norm() / ref[name].norm())
        assert err <= 0.25, (name, err)
    # every gradient together (norm weights' sums cancel more, so per tensor they stray more)
    whole = torch.cat([g.flatten() for g in grads.values()])
    want = torch.cat([ref[k].flatten() for k in grads])
    assert (whole - want).norm() <= 0.25 * want.norm()


def test_float8_lora_base_tracks_full_precision() -> None:
    """LoRA over a float8 base: every frozen projection's matmul goes through torchao's float8
    casts (the adapters stay in fp32), and the step's loss and the adapters' gradients track
    the same LoRA model without float8 within the bounds above."""
    from compiletune.models.lora import FrozenLinear, LoRASpec, apply_lora

    args = from_name("debug")
    args.n_layers = 2
    t = torch.randint(0, args.vocab_size, (2, 65), generator=torch.Generator().manual_seed(3))

    def lora_model():
        model = apply_lora(build_model(args, seed=1), LoRASpec(4, 8.0), dtype=torch.float32)
        with torch.no_grad():  # B = 0 would leave A without a gradient
            for name, p in model.named_parameters():
                if name.endswith("lora_b"):
                    p.copy_(0.02 * torch.randn(p.shape, generator=torch.Generator().manual_seed(7)))
        return model

    ref_loss, ref = _loss_and_grads(lora_model(), t)
    model = lora_model()
    n, kept = fp8.convert_blocks(model, "rowwise", emulate=True, fsdp=False)
    frozen = [m for m in model.layers.modules() if isinstance(m, FrozenLinear)]
    assert n == len(frozen) == 7 * args.n_layers and kept == []
    assert all(m.float8 is not None for m in frozen) and "matmul=float8" in repr(frozen[0])
    loss, grads = _loss_and_grads(model, t)
    assert grads.keys() == ref.keys() and all("lora_" in k for k in grads)
    assert abs(loss - ref_loss) <= 0.01 * ref_loss
    whole = torch.cat([g.flatten() for g in grads.values()])
    want = torch.cat([ref[k].flatten() for k in grads])
    assert 0 < (whole - want).norm() <= 0.25 * want.norm()  # float8 did round something


def test_fp8_is_refused_where_it_cannot_run(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(fp8.EMULATE_ENV, raising=False)
    with pytest.raises(UserError, match="--fp8 runs float8 matmuls on a GPU"):
        fp8.check_device(torch.device("cpu"))
    with pytest.raises(UserError, match="--fp8 with --quantize-base nf4"):
        resolve({}, {"fp8": "rowwise", "lora_rank": 4, "quantize_base": "nf4"})
    assert resolve({}, {"fp8": "rowwise", "lora_rank": 4}).techniques.fp8 == "rowwise"
    with pytest.raises(UserError, match="--fp8 must be one of"):
        resolve({}, {"fp8": "blockwise"})


@pytest.mark.slow
def test_fp8_trains_compiled_and_saves_plain_weights(emulate, tmp_path) -> None:
    """3 compiled steps (one graph per block kind, 0 recompiles) within 1% of the same run
    without --fp8, and a checkpoint with the same tensors as one without: transformers loads it."""
    flags = {"n_layers": 2, "max_steps": 3, "seq_len": 64, "batch_size": 2, "dtype": "fp32"}
    flags |= {"compile": True, "compile_backend": "aot_eager"}
    train(resolve({}, {**flags, "output_dir": str(tmp_path / "plain")}))
    train(resolve({}, {**flags, "fp8": "rowwise", "output_dir": str(tmp_path / "fp8")}))
    want = [r["loss"] for r in read_metrics(tmp_path / "plain" / "metrics.jsonl")]
    got = [r["loss"] for r in read_metrics(tmp_path / "fp8" / "metrics.jsonl")]
    assert got == pytest.approx(want, rel=0.01)
    import json

    summary = json.loads((tmp_path / "fp8" / "summary.json").read_text())
    assert summary["compile"]["recompiles"] == 0
    saved = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "fp8" / "step_3")
    plain = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "plain" / "step_3")
    assert saved.state_dict().keys() == plain.state_dict().keys()


def test_estimate_counts_the_float8_casts(emulate) -> None:
    """The estimate runs torchao's own float8 linears on fake tensors: the casts' temporaries
    appear (more bytes than without), and the ladder shows the fp8 rung."""
    flags = {"model": "debug", "n_layers": 2, "seq_len": 1024, "batch_size": 2}
    plain = estimate_memory(resolve({}, flags), 1)
    cast = estimate_memory(resolve({}, {**flags, "fp8": "tensorwise"}), 1)
    assert cast.peak_bytes != plain.peak_bytes
    assert cast.parts["temporaries"] > plain.parts["temporaries"]
