"""MoE models through the trainer: every technique on a debug MoE model, router metrics, exact
resume, and estimate-memory counting the experts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from tiny_run import tiny_run

from compiletune.cli import main
from compiletune.errors import UserError
from compiletune.metrics import read_metrics
from compiletune.models import from_hf

TEXT = "\n".join(
    f"Row {i}: experts route tokens, and token {i * 7 % 23} goes to expert {i % 8}."
    for i in range(300)
)
MOE = {"model": "debug_moe", "n_layers": 3, "lr": 3e-3, "max_steps": 4}


@pytest.fixture()
def corpus(tmp_path: Path) -> str:
    path = tmp_path / "corpus.txt"
    path.write_text(TEXT)
    return str(path)


def losses(run_dir: Path) -> list[float]:
    return [r["loss"] for r in read_metrics(run_dir / "metrics.jsonl")]


@pytest.mark.parametrize(
    "flags",
    [
        {},
        {"compile": True, "compile_backend": "aot_eager", "ac": "selective", "loss": "fused"},
        {"compile": True, "compile_backend": "aot_eager", "offload_activations": True},
        {"ac": "full"},
        {"optimizer_in_backward": True},
        {"optimizer": "adamw8bit"},
        {"lora_rank": 4, "lr": 1e-2},
        {"lora_rank": 4, "quantize_base": "nf4", "lr": 1e-2},
    ],
    ids=[
        "eager",
        "compiled-selective",
        "offload",
        "ac-full",
        "in-backward",
        "8bit",
        "lora",
        "qlora",
    ],
)
def test_moe_trains_with_each_technique(tmp_path, corpus, flags):
    summary = tiny_run(tmp_path, corpus, **{**MOE, **flags})
    records = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert len(records) == 4 and records[-1]["loss"] < records[0]["loss"]
    for r in records:
        assert r["router_aux_loss"] > 0 and r["router_z_loss"] > 0
        load = r["expert_load"]
        # layer 1 is dense: two MoE layers; 2 rows x 32 tokens x top-2 over 8 experts = 16 each
        assert len(load["min"]) == 2 and load["mean"] == pytest.approx(16.0)
        assert 0 <= r["expert_load_min"] <= 1 <= r["expert_load_max"]
    if flags.get("compile"):
        assert summary["compile"]["recompiles"] == 0, summary["compile"]
        assert set(summary["compile"]["regions"]) == {"block", "block.dense", "head"}


def test_router_coefficients_reach_the_loss(tmp_path, corpus):
    """--router-aux-coef changes the trajectory; 0 turns it off (the loss is the CE alone)."""
    base = {**MOE, "max_steps": 3}
    tiny_run(tmp_path, corpus, "off", **base, router_aux_coef=0.0)
    tiny_run(tmp_path, corpus, "on", **base, router_aux_coef=1.0)
    tiny_run(tmp_path, corpus, "z", **base, router_aux_coef=0.0, router_z_coef=0.1)
    off, on, z = (losses(tmp_path / n) for n in ("off", "on", "z"))
    assert off[0] == on[0] == z[0]  # the first loss is before any update
    assert off[1:] != on[1:] and off[1:] != z[1:]


def test_resume_is_exact(tmp_path, corpus):
    tiny_run(tmp_path, corpus, "whole", **MOE)
    tiny_run(tmp_path, corpus, "split", **{**MOE, "max_steps": 2})
    tiny_run(tmp_path, corpus, "split", **MOE, resume=True)
    assert losses(tmp_path / "split") == losses(tmp_path / "whole")
    want = read_metrics(tmp_path / "whole" / "metrics.jsonl")[-1]["expert_load"]
    assert read_metrics(tmp_path / "split" / "metrics.jsonl")[-1]["expert_load"] == want


def test_router_bias_balancing_moves_the_biases_by_the_rate(tmp_path, corpus):
    """--router-bias-update-rate (DeepSeek-V3's auxiliary-loss-free balancing): after each step
    every expert's correction bias moved by the rate, up where it was underloaded; the saved
    checkpoint holds the moved biases. Models without such a router, and LoRA runs, refuse it."""
    rate, steps = 0.25, 3
    tiny_run(tmp_path, corpus, model="debug_deepseek", max_steps=steps, lr=1e-3)
    tiny_run(
        tmp_path / "b",
        corpus,
        model="debug_deepseek",
        max_steps=steps,
        lr=1e-3,
        router_bias_update_rate=rate,
    )
    plain = from_hf(tmp_path / "run" / f"step_{steps}")
    moved = from_hf(tmp_path / "b" / "run" / f"step_{steps}")
    for a, b in zip(plain.layers[1:], moved.layers[1:], strict=True):
        assert not a.feed_forward.score_bias.any()
        steps_taken = b.feed_forward.score_bias / rate  # -1, 0 (load exactly the mean), +1
        assert torch.equal(steps_taken, steps_taken.round()) and steps_taken.abs().max() <= steps
        assert steps_taken.abs().sum() >= steps  # at least one expert off balance a step
    for flags in ({"model": "debug_moe"}, {"model": "debug_deepseek", "lora_rank": 4}):
        with pytest.raises(UserError, match="router-bias-update-rate"):
            tiny_run(tmp_path / "c", corpus, router_bias_update_rate=rate, max_steps=1, **flags)


def test_estimate_memory_counts_every_expert(capsys):
    code = main(["estimate-memory", "--model", "mixtral_8x7b", "--seq-len", "256", "--json"])
    assert code == 0
    report = json.loads(capsys.readouterr().out)
    # 46.7B parameters in bf16 (every expert), and AdamW's two moments of each
    params_gib = report["parts_gib"]["parameters"]
    assert params_gib == pytest.approx(46.70e9 * 2 / 2**30, rel=0.02)
    assert report["setup"]["params"] == 46_702_792_704
    assert report["parts_gib"]["optimizer_state"] >= 2 * params_gib * 0.95
