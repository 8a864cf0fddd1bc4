"""`--compile --ac selective` in the memory estimate: each block keeps what the compiled block
saves for its backward, not what eager selective checkpointing caches.

The estimate runs selective blocks eagerly, where checkpointing caches every matmul output until
the block's backward. The compiled block saves only what its backward reads: not the MLP's down
projection, whose output (under LoRA: the base's and the adapter's) only flows into the
residual sum. The GPU's 8B LoRA / QLoRA peaks were 1.9 GiB under their estimates for this
(bench/reports/2026-11-27-gpu-check-h200-speed.md). Here the estimate's bytes kept per block are
compared with the compiled block's saved tensors as the partitioner chose them (`aot_eager`:
the same passes and partition as Inductor, without code generation), plus the block's output
(the next block's input, which the compiled block saves as an input).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from compiletune.compiler.ac_policy import parse_ac
from compiletune.compiler.regions import CompileOptions, compile_regions
from compiletune.config import resolve
from compiletune.estimate import depth, estimator, tracker
from compiletune.loss.head import LossHead
from compiletune.models import build_model, from_name
from compiletune.models.lora import LoRASpec, apply_lora

BATCH, SEQ, RANK = 2, 256, 16
SMALL = {"model": "debug", "n_layers": 3, "seq_len": SEQ, "batch_size": BATCH, "dtype": "fp32"}
CASES = {
    "full": {},
    "lora": {"lora_rank": RANK},
    "qlora": {"lora_rank": RANK, "quantize_base": "nf4"},
}


def _estimate_kept_per_block(flags: dict) -> int:
    """Bytes one block's forward leaves alive in the estimate: blocks 1 and 2 run the same ops
    from states that differ by what block 1 kept, so their peaks differ by exactly that."""
    cfg = resolve({}, {**SMALL, **flags, "ac": "selective", "compile": True})
    t = tracker.Tracker({tracker.ACT_HOST})
    estimator.run_step(cfg, None, t)
    first, second = (t.segments[("forward", 1, "block", i)].peak for i in (1, 2))
    return second - first


def _compiled_kept_per_block(flags: dict, dump: Path) -> int:
    """What the compiled block saves for backward (activations, not its inputs), plus its
    output [b, s, d]."""
    args = dataclasses.replace(from_name("debug"), n_layers=2)
    model = build_model(args, seed=0)
    if flags.get("lora_rank"):
        spec = LoRASpec(rank=RANK, alpha=2.0 * RANK)
        apply_lora(model, spec, dtype=torch.float32, quantize=flags.get("quantize_base"))
    head = LossHead(model.output)
    opts = CompileOptions(backend="aot_eager", loss="plain", dump=True, ac=parse_ac("selective"))
    regions = compile_regions(model, head, opts)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, args.vocab_size, (BATCH, SEQ), generator=g)
    targets = torch.randint(0, args.vocab_size, (BATCH, SEQ), generator=g)
    head(model.hidden_states(tokens), targets).backward()
    saved = regions.write_dump(dump)["block"]["saved_activation_bytes"]
    return saved + BATCH * SEQ * args.dim * 4


@pytest.mark.parametrize("flags", list(CASES.values()), ids=list(CASES))
def test_selective_blocks_keep_what_the_compiled_block_saves(flags: dict, tmp_path: Path) -> None:
    estimated = _estimate_kept_per_block(flags)
    compiled = _compiled_kept_per_block(flags, tmp_path)
    # The eager cache's down projection is a tenth of a block here (two of them under LoRA):
    # 1% tells the two apart and leaves room for a scalar or two of bookkeeping.
    assert abs(estimated - compiled) <= 0.01 * compiled, (estimated, compiled)


def test_the_eager_step_keeps_the_cache_it_holds() -> None:
    """Without --compile the estimate is the eager step's, which does hold every cached
    matmul output (test_estimate.py checks that step against the real one)."""
    flags = CASES["lora"]
    compiled = _estimate_kept_per_block(flags)
    cfg = resolve({}, {**SMALL, **flags, "ac": "selective"})
    t = tracker.Tracker({tracker.ACT_HOST})
    estimator.run_step(cfg, None, t)
    first, second = (t.segments[("forward", 1, "block", i)].peak for i in (1, 2))
    # the down projection's base and adapter outputs, [b * s, d] each
    assert second - first - compiled == 2 * BATCH * SEQ * from_name("debug").dim * 4


def test_depth_shortcut_keeps_what_each_block_forgets(monkeypatch: pytest.MonkeyPatch) -> None:
    """The 8B estimate runs two short models and extends them: each block forgets the same
    bytes, so the extended step equals the whole one."""
    flags = {"model": "debug", "n_layers": 16, "seq_len": 64, "batch_size": 2, "dtype": "fp32"}
    cfg = resolve({}, {**flags, **CASES["qlora"], "ac": "selective", "compile": True})
    short = estimator.estimate_memory(cfg).to_dict()
    assert any("repeating blocks" in n for n in short["notes"]), short["notes"]
    monkeypatch.setattr(depth, "shortcut_depths", lambda cfg, args: None)
    whole = estimator.estimate_memory(cfg).to_dict()
    for d in (short, whole):
        d.pop("seconds"), d.pop("notes")
    assert short == whole
