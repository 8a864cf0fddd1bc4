"""`--offload-activations N|all|auto`: the target parsed once where the config is resolved, the
first N blocks offloaded by the compiler with numerics unchanged, the memory estimate following
N, and auto's plan the fewest blocks that fit."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from compiletune.cli import build_parser, main
from compiletune.compiler.activation import parse_ac
from compiletune.compiler.offload_target import OffloadTarget
from compiletune.compiler.regions import CompileOptions, compile_regions
from compiletune.config import read_saved_config, resolve, save_yaml
from compiletune.errors import UserError
from compiletune.estimate import estimator, offload_plan
from compiletune.estimate.fit import ladder
from compiletune.estimate.fit.capacity import RESERVE_BYTES, Capacity, fits
from compiletune.estimate.offload_plan import plan_offload
from compiletune.loss.head import LossHead
from compiletune.models import build_model, from_name
from compiletune.train.build_model import resolve_model_args

# Four blocks of 512-token rows: what a block saves matters next to the tiny weights.
FOUR = {"model": "debug", "n_layers": 4, "seq_len": 512, "batch_size": 2, "dtype": "fp32"}
FOUR |= {"loss": "plain", "compile": True}


@pytest.fixture(autouse=True)
def _eager_loss_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COMPILETUNE_LCE_EAGER", "1")


@pytest.mark.parametrize(
    "value, blocks, auto, saved",
    [
        (True, None, False, True),  # the flag alone / `true` in YAML: every block, as before N
        ("all", None, False, True),
        (False, 0, False, False),
        (0, 0, False, False),
        (3, 3, False, 3),
        ("3", 3, False, 3),
        ("auto", 0, True, "auto"),
    ],
)
def test_the_target_is_parsed_once_and_written_back_as_given(value, blocks, auto, saved, tmp_path):
    cfg = resolve({"offload_activations": value}, {"compile": True})  # as a YAML value
    target = cfg.techniques.offload_activations
    assert target == OffloadTarget(blocks, auto)
    assert resolve({}, {"compile": True, "offload_activations": value}).techniques == cfg.techniques
    save_yaml(cfg, tmp_path / "config.yaml")  # a run's config.yaml, read back by --resume
    assert read_saved_config(tmp_path)["offload_activations"] == saved
    assert cfg.replace(seq_len=64).techniques.offload_activations == target
    if not auto:
        assert target.count(6) == (6 if blocks is None else blocks)


def test_the_flag_alone_and_with_a_value():
    parse = build_parser().parse_args
    assert parse(["train", "--offload-activations", "--compile"]).offload_activations is True
    assert parse(["train", "--offload-activations", "2"]).offload_activations == "2"
    assert "offload_activations" not in vars(parse(["train"]))  # the YAML's value survives


@pytest.mark.parametrize(
    "argv, says",
    [
        (["train", "--compile", "--offload-activations", "-1"], "got '-1'"),
        (["train", "--compile", "--offload-activations", "half"], "or auto, got 'half'"),
        (["train", "--compile", "--offload-activations", "atuo"], "did you mean 'auto'?"),
        (["estimate-memory", "--compile", "--offload-activations", "auto"], "--device-memory"),
        (
            ["estimate-memory", "--n-layers", "2", "--compile", "--offload-activations", "3"],
            "--offload-activations 3: the model has 2 blocks; pass at most 2",
        ),
    ],
)
def test_bad_values_are_one_line_naming_the_input(argv, says, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert says in err[-1] and err[-1].startswith("compiletune: error:"), err


def test_a_count_past_the_models_blocks_is_refused_by_train(tmp_path, capsys):
    argv = ["train", "--model", "debug", "--n-layers", "2", "--compile", "--max-steps", "1"]
    argv += ["--offload-activations", "5", "--output-dir", str(tmp_path / "run"), "--no-save"]
    assert main(argv) == 2
    assert "the model has 2 blocks" in capsys.readouterr().err


def _tiny(layers: int, seed: int = 0) -> torch.nn.Module:
    args = from_name("debug")
    args.n_layers, args.dim, args.ffn_dim, args.n_heads, args.n_kv_heads = layers, 64, 160, 4, 2
    args.vocab_size = 300
    return build_model(args, seed=seed)


def _step(model, head, tokens, targets):
    model.zero_grad(set_to_none=True)
    loss = head(model.hidden_states(tokens), targets)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("ac", ["none", "full"])
def test_the_first_n_blocks_offload_and_loss_and_grads_do_not_change(ac, tmp_path):
    base = _tiny(3, seed=3)
    other = copy.deepcopy(base)
    hb, ho = LossHead(base.output), LossHead(other.output)
    compile_regions(base, hb, CompileOptions(backend="aot_eager", loss="plain", ac=parse_ac(ac)))
    opts = CompileOptions(
        backend="aot_eager", loss="plain", ac=parse_ac(ac), offload_blocks=2, dump=True
    )
    regions = compile_regions(other, ho, opts)
    g = torch.Generator().manual_seed(1)
    tokens, targets = (torch.randint(0, 300, (2, 24), generator=g) for _ in range(2))
    lb, gb = _step(base, hb, tokens, targets)
    lo, go = _step(other, ho, tokens, targets)
    torch.testing.assert_close(lo, lb, rtol=1e-6, atol=0)
    for name in gb:
        torch.testing.assert_close(go[name], gb[name], rtol=1e-5, atol=1e-7, msg=name)
    # blocks 0 and 1 offload (one graph), block 2 keeps what it saves (a region of its own)
    assert set(regions.backends) == {"block", "block.on_device", "head"}
    summary = regions.write_dump(tmp_path)
    assert summary["block"]["offloaded_bytes"] > 0
    assert all(p["pass"] != "offload_activations" for p in summary["block.on_device"]["passes"])


def _per_block_offloaded_bytes(cfg) -> int:
    """What one block of `cfg`'s model offloads in the real compiled step on this CPU (the
    offload pass's count): the compiler's own figure, to hold the estimate to."""
    one = dataclasses.replace(resolve_model_args(cfg), n_layers=1)  # bytes of one block
    model = build_model(one, seed=0)
    ac = parse_ac(cfg.techniques.ac)
    opts = CompileOptions(backend="aot_eager", loss="plain", ac=ac, offload_blocks=1, dump=True)
    regions = compile_regions(model, LossHead(model.output), opts)
    rows, seq = cfg.data.batch_size, cfg.data.seq_len
    tokens = torch.randint(0, model.args.vocab_size, (rows, seq))
    _step(model, LossHead(model.output), tokens, tokens)
    (record,) = regions.backends["block"].records
    return record.summary()["offloaded_bytes"]


def test_the_estimate_follows_the_blocks_offloaded():
    """Under --ac full a block saves its input (the hidden state): the estimate counts on the
    host N times what the real compiled block offloads, and, while the step's peak is the turn
    from forward to backward, that much less on the device (a step whose activations matter:
    six blocks of 2048-token rows, the MLP in tiles)."""
    long = {**FOUR, "ac": "full", "n_layers": 6, "seq_len": 2048, "mlp_tile": 256}
    long["batch_size"] = 4  # (at 2 the backward's temporaries are the peak past 1.4 blocks)
    cfg = resolve({}, long)
    per_block = _per_block_offloaded_bytes(cfg)
    assert per_block == cfg.data.batch_size * cfg.data.seq_len * resolve_model_args(cfg).dim * 4
    est = {
        n: estimator.estimate_memory(cfg.replace(offload_activations=n), 1, 1) for n in (0, 1, 3, 6)
    }
    for n, e in est.items():
        assert e.host_parts["activations"] == pytest.approx(n * per_block, rel=0.02), n
        assert e.setup["offload_activations"] == n
    for n in (1, 3):
        moved = est[0].parts["activations"] - est[n].parts["activations"]
        assert moved == pytest.approx(n * per_block, rel=0.02), n
    assert est[6].peak_bytes <= est[3].peak_bytes < est[1].peak_bytes < est[0].peak_bytes


def test_auto_picks_the_fewest_blocks_that_fit(monkeypatch, capsys):
    """With the GPU's memory set between the peaks at N - 1 and N blocks offloaded, auto
    answers N: it fits, and N - 1 does not."""
    cfg = resolve({}, FOUR)
    peaks = [
        estimator.estimate_memory(cfg.replace(offload_activations=n)).peak_bytes for n in range(5)
    ]
    assert peaks[1] > peaks[2] > peaks[3], peaks
    room = (peaks[1] + peaks[2]) // 2 + RESERVE_BYTES  # between N = 1 and N = 2
    capacity = Capacity(room, 1 << 40)
    auto = resolve({}, {**FOUR, "offload_activations": "auto"})
    planned, est = plan_offload(auto, 1, capacity)
    assert planned.techniques.offload_activations == OffloadTarget(2)
    assert fits(est, capacity) and est.peak_bytes == peaks[2]
    below = estimator.estimate_memory(cfg.replace(offload_activations=1))
    assert not fits(below, capacity)
    assert any("auto: 2 of 4 blocks" in n for n in est.notes)
    # the estimate asked for next (estimate-memory's, after the plan) is the plan's
    assert estimator.estimate_memory(planned) is est
    # train plans for the share of the GPU its process may allocate (a bench's memory cap)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda i: (0, 2 * room))
    monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", lambda i: 0.5, raising=False)
    monkeypatch.setattr(offload_plan, "machine_host_bytes", lambda: 1 << 40)
    assert offload_plan.plan_for_this_gpu(auto).techniques.offload_activations == OffloadTarget(2)
    assert "the first 2 of 4 blocks offload" in capsys.readouterr().out
    # room for the step with no offload: none
    none, _ = plan_offload(auto, 1, Capacity(peaks[0] + RESERVE_BYTES, 1 << 40))
    assert none.techniques.offload_activations == OffloadTarget(0)


def test_auto_says_what_would_fit_when_no_number_of_blocks_does():
    cfg = resolve({}, {**FOUR, "offload_activations": "auto"})
    every = estimator.estimate_memory(cfg.replace(offload_activations=True))
    tight = Capacity(every.peak_bytes + RESERVE_BYTES - (1 << 20), 1 << 40)
    with pytest.raises(UserError, match=r"even with all 4 blocks offloaded .*; add --") as e:
        plan_offload(cfg, 1, tight)
    assert "\n" not in str(e.value)


def test_a_run_that_offloads_every_block_has_the_length_ladders_offload_rung():
    (changes,) = [c for name, c in ladder.LENGTH_RUNGS if "offload_activations" in c]
    every = resolve({}, {"compile": True, "offload_activations": True})
    assert ladder.flags_to_add(every, changes) == {}
    some = resolve({}, {"compile": True, "offload_activations": 2})
    assert ladder.flags_to_add(some, changes) == {"offload_activations": OffloadTarget(None)}
    assert ladder.flags_text(changes) == "--compile --offload-activations"
