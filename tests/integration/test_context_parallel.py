"""Context parallelism (--cp) on CPU with gloo: one sequence split over 2 processes.

The model-level cases run each model's forward and backward on one row split over two ranks
(each rank its half of the tokens, attention exchanged over heads: models/seq_parallel.py) and
compare the summed loss and the summed gradients with one process on the whole row (fp32,
rel <= 1e-5): a document-masked row, sliding windows with soft-caps, GQA whose kv heads the
ranks cannot split, sinks, latent attention, and LoRA. The trainer-level cases run `train`
with --cp 2 against one process on the same global batch, and resume exactly.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from gloo import free_port, run_in_gloo

from compiletune.config import resolve
from compiletune.errors import UserError
from compiletune.metrics import read_metrics
from compiletune.models import build_model, from_name
from compiletune.models.lora import LoRASpec, apply_lora
from compiletune.models.seq_parallel import SeqShards, split_sequence
from compiletune.train.loop import train

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed unavailable")

SEQ = 48  # tokens in the row; each rank holds 24


def _model(case: str) -> torch.nn.Module:
    name = {"docs": "debug", "lora": "debug", "gqa1": "debug"}.get(case, f"debug_{case}")
    args = from_name(name)
    args.n_layers = 2
    if case in ("gemma2", "gpt_oss"):  # windows shorter than the row (Gemma 2: and soft-caps)
        args.sliding_window = 8
    if case == "gqa1":  # one kv head: repeated before the exchange
        args.n_kv_heads = 1
    model = build_model(args, seed=3)
    if case == "lora":
        apply_lora(model, LoRASpec(rank=4, alpha=8.0), dtype=torch.float32)
        gen = torch.Generator().manual_seed(1)
        for name, p in model.named_parameters():
            if "lora_b" in name:  # nonzero, so every adapter weight has a gradient
                p.data = torch.randn(p.shape, generator=gen) * 0.1
    if case == "gpt_oss":
        gen = torch.Generator().manual_seed(2)
        for block in model.layers:
            block.attention.sinks.data = torch.randn(block.attention.sinks.shape, generator=gen)
    return model


def _row(vocab: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, vocab, (1, SEQ + 1), generator=gen)
    doc_ids = torch.tensor([[0] * 13 + [1] * 20 + [2] * 15])  # documents across the split
    starts = {0: 0, 1: 13, 2: 33}
    positions = torch.tensor([[i - starts[int(d)] for i, d in enumerate(doc_ids[0])]])
    return {
        "inputs": tokens[:, :-1],
        "targets": tokens[:, 1:],
        "doc_ids": doc_ids,
        "pos": positions,
    }


def _loss(model, row: dict[str, torch.Tensor], docs: bool, shards: SeqShards | None):
    inputs, targets, pos = row["inputs"], row["targets"], row["pos"]
    if shards is not None:
        inputs, targets, pos = shards.piece(inputs), shards.piece(targets), shards.piece(pos)
    h = model.hidden_states(inputs, pos, row["doc_ids"]) if docs else model.hidden_states(inputs)
    logits = model.logits(h).float()
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum")


CASES = ("docs", "gemma2", "gqa1", "gpt_oss", "deepseek", "lora")


def _model_worker(rank: int, port: int) -> None:
    torch.set_num_threads(1)

    def body() -> None:
        for case in CASES:
            docs = case in ("docs", "deepseek", "lora")
            model = _model(case)
            row = _row(model.args.vocab_size)
            ref = _loss(model, row, docs, None)
            ref.backward()
            want = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
            model.zero_grad(set_to_none=True)
            split_sequence(model, SeqShards(2, rank, dist.group.WORLD))
            loss = _loss(model, row, docs, SeqShards(2, rank))
            loss.backward()
            dist.all_reduce(loss := loss.detach())
            torch.testing.assert_close(loss, ref.detach(), rtol=1e-5, atol=0, msg=case)
            got = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
            assert got.keys() == want.keys(), case
            for n, g in got.items():
                dist.all_reduce(g)
                scale = want[n].abs().max().clamp_min(1e-6)
                err = (g - want[n]).abs().max() / scale
                assert err <= 1e-5, f"{case} {n}: {err}"

    run_in_gloo(rank, 2, port, body)


def test_two_ranks_give_one_rows_loss_and_gradients() -> None:
    mp.spawn(_model_worker, args=(free_port(),), nprocs=2)


# ----------------------------------------------------------------------------- the trainer

TEXT = "\n".join(f"Line {i}: context split over ranks, value {i * 7 % 13}." for i in range(200))
BASE = {"seq_len": 64, "batch_size": 2, "max_steps": 3, "n_layers": 2, "lr": 3e-3}


def _variants(tmp: str) -> dict[str, tuple[dict, dict]]:
    """name -> (flags of the --cp 2 run on 2 ranks, flags of the one-process reference)."""
    base = {**BASE, "data": f"{tmp}/corpus.txt"}
    gemma = {**base, "model": "debug_gemma2"}
    dpo = {**base, "data": f"{tmp}/pairs.jsonl", "objective": "dpo", "seq_len": 128}
    dpo |= {"val_split": 0.1, "eval_every": 2}
    return {
        # with full checkpointing (the recompute exchanges again) and MLP tiles
        "cp": (
            {**base, "save_every": 2, "eval_data": base["data"], "ac": "full", "mlp_tile": 16},
            base | {"eval_data": base["data"]},
        ),
        "cp-gemma2-lora-compiled": (
            {**gemma, "lora_rank": 4, "compile": True, "compile_backend": "aot_eager"},
            {**gemma, "lora_rank": 4},
        ),
        "cp-dpo": (dpo, dpo),
    }


def _train_worker(rank: int, port: int, tmp: str) -> None:
    torch.set_num_threads(1)

    def body() -> None:
        for name, (flags, _) in _variants(tmp).items():
            train(resolve({}, {**flags, "fsdp": True, "cp": 2, "output_dir": f"{tmp}/{name}"}))
            torch.compiler.reset()
        # a run that died after step 2: resumed from it, step 3 repeats exactly
        if rank == 0:
            part = Path(tmp) / "resumed"
            part.mkdir()
            shutil.copytree(Path(tmp) / "cp" / "step_2", part / "step_2")
            shutil.copy(Path(tmp) / "cp" / "config.yaml", part / "config.yaml")
            lines = (Path(tmp) / "cp" / "metrics.jsonl").read_text().splitlines(keepends=True)
            (part / "metrics.jsonl").write_text("".join(lines[:2]))
        dist.barrier()
        flags = _variants(tmp)["cp"][0]
        train(
            resolve(
                {}, {**flags, "fsdp": True, "cp": 2, "resume": True, "output_dir": f"{tmp}/resumed"}
            )
        )

    run_in_gloo(rank, 2, port, body)


def _losses(run_dir: Path) -> list[float]:
    rows = read_metrics(run_dir / "metrics.jsonl")
    return [r["loss"] for r in rows] + [r["eval_loss"] for r in rows if "eval_loss" in r]


@pytest.mark.slow
def test_cp_trains_like_one_process_and_resumes(tmp_path: Path) -> None:
    """--cp 2 on 2 ranks (one group sharing every row) against one process with the same rows:
    plain text with a held-out evaluation, full checkpointing and MLP tiles, Gemma 2's windows and soft-caps under LoRA and
    compile, DPO's per-pair sums over pieces of the rows; a resume repeats the run exactly."""
    (tmp_path / "corpus.txt").write_text(TEXT)
    with (tmp_path / "pairs.jsonl").open("w") as f:
        for i in range(60):
            row = {"prompt": f"Q{i}: say {i % 7}.", "chosen": f" {i % 7}.", "rejected": " no!"}
            f.write(json.dumps(row) + "\n")
    mp.spawn(_train_worker, args=(free_port(), str(tmp_path)), nprocs=2)
    for name, (_, ref) in _variants(str(tmp_path)).items():
        train(resolve({}, {**ref, "output_dir": str(tmp_path / f"ref-{name}")}))
        want, got = _losses(tmp_path / f"ref-{name}"), _losses(tmp_path / name)
        assert got == pytest.approx(want, rel=1e-5), name
    assert _losses(tmp_path / "resumed") == _losses(tmp_path / "cp")
    summary = json.loads((tmp_path / "cp-gemma2-lora-compiled" / "summary.json").read_text())
    assert summary["compile"]["recompiles"] == 0


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        ({"cp": 2}, "--cp 2 splits each sequence over 2 processes; add --fsdp"),
        ({"cp": 0}, "--cp must be a positive process count"),
        ({"cp": 2, "fsdp": True, "seq_len": 33}, "must be a multiple of --cp 2"),
    ],
)
def test_bad_cp_flags(flags: dict, message: str) -> None:
    with pytest.raises(UserError, match=message):
        resolve({}, flags)


def test_linear_attention_under_cp_is_refused_before_anything_loads(tmp_path, monkeypatch):
    """`torchrun --nproc-per-node 2 ... --fsdp --cp 2` on a Qwen3.5 folder: rank 0's build
    refuses from config.json alone, naming the linear-attention layers (the folder has no
    weights and no tokenizer, which the build would read first)."""
    import transformers

    from compiletune.distributed import DistEnv
    from compiletune.train.build import build_run

    folder = tmp_path / "qwen3_5"
    config = transformers.Qwen3_5TextConfig(
        vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_num_key_heads=2,
        linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=12,
    )  # fmt: skip
    config.save_pretrained(folder)  # config.json alone
    monkeypatch.setenv("WORLD_SIZE", "2")  # as torchrun sets it
    flags = {"model_dir": str(folder), "data": str(tmp_path / "none.txt"), "fsdp": True, "cp": 2}
    cfg = resolve({}, {**flags, "seq_len": 32, "output_dir": str(tmp_path / "out")})
    rank0 = DistEnv(0, 2, 0, 2, torch.device("cpu"), owns_group=False)
    with pytest.raises(UserError) as e:
        build_run(cfg, rank0)
    assert str(e.value).startswith("--cp 2 cannot split the recurrence of the model's 3 "), e.value
    assert "linear-attention layers (of 4" in str(e.value) and "drop --cp" in str(e.value)


def test_models_that_cannot_split_their_rows_are_refused(tmp_path: Path, capsys) -> None:
    """Linear attention (a recurrence), longrope (each piece would pick its own factors), heads
    that --cp does not divide, a KD teacher that cannot split: one line each, before training."""
    import transformers

    from compiletune.cli import main
    from compiletune.models import args_from_hf_config, save_hf
    from compiletune.models.seq_parallel import unsplittable

    rope = {"rope_type": "longrope", "rope_theta": 1e4, "original_max_position_embeddings": 16}
    rope |= {"short_factor": [1.0] * 8, "long_factor": [2.0] * 8}
    phi3 = transformers.Phi3Config(
        hidden_size=64, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2,
        max_position_embeddings=64, original_max_position_embeddings=16, rope_parameters=rope,
    )  # fmt: skip
    assert "longrope" in unsplittable(args_from_hf_config(phi3.to_dict()), 2, 2)
    assert "recurrence" in unsplittable(from_name("debug_qwen3_5"), 2, 2)
    assert "8 attention heads" in unsplittable(from_name("debug"), 3, 3)
    assert unsplittable(from_name("debug"), 2, 4) is None
    teacher = from_name("debug_qwen3_5")
    teacher.n_layers = 4
    save_hf(build_model(teacher), tmp_path / "teacher", tokenizer=None)
    flags = ["--model", "debug", "--n-layers", "2", "--gpus", "2", "--fsdp", "--cp", "2"]
    flags += ["--objective", "kd", "--teacher-dir", str(tmp_path / "teacher")]
    assert main(["estimate-memory", *flags]) == 2
    assert "--cp 2: the teacher cannot split" in capsys.readouterr().err
