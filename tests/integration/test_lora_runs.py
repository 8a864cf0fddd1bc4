"""LoRA runs of the trainer: adapters only, resume, --merge, bad input, and under FSDP2."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from gloo import free_port, run_in_gloo
from lora_cases import load_hf, rel_err, tiny_args, tokens
from safetensors.torch import load_file
from tiny_run import tiny_run

from compiletune.checkpoint import adapter_io
from compiletune.cli import main
from compiletune.config import resolve
from compiletune.data.tokenizer import byte_tokenizer
from compiletune.metrics import read_metrics
from compiletune.models import build_model, save_hf
from compiletune.train.loop import train

peft = pytest.importorskip("peft")


# --- the trainer --------------------------------------------------------------------------------

TEXT = "\n".join(
    f"Line {i}: a small corpus for adapters, counting {i * 7 % 13}." for i in range(300)
)


@pytest.fixture()
def corpus(tmp_path: Path) -> str:
    path = tmp_path / "corpus.txt"
    path.write_text(TEXT)
    return str(path)


@pytest.fixture()
def model_dir(tmp_path: Path) -> str:
    args = tiny_args(2)
    path = tmp_path / "tiny-base"
    save_hf(build_model(args, seed=3), path, tokenizer=byte_tokenizer())
    return str(path)


def run(tmp_path: Path, corpus: str, name: str = "run", **overrides) -> dict:
    return tiny_run(tmp_path, corpus, name, **{"lora_rank": 4, **overrides})


def test_lora_run_trains_adapters_only_and_merges(tmp_path, corpus, model_dir):
    summary = run(tmp_path, corpus, model_dir=model_dir, lr=3e-3, merge=True, max_steps=8)
    out = tmp_path / "run"
    step = out / "step_8"
    assert sorted(p.name for p in step.iterdir() if not p.name.startswith("tokenizer")) == [
        "adapter_config.json",
        "adapter_model.safetensors",
        "chat_template.jinja",
        "trainer_state.pt",
    ]
    adapters = load_file(step / adapter_io.ADAPTER_WEIGHTS)
    assert len(adapters) == 2 * 7 * 2 and all(".lora_" in k for k in adapters)
    # Optimizer state for the adapters only: 2 fp32 moments each.
    assert summary["trainable_params"] == sum(t.numel() for t in adapters.values())
    assert summary["optimizer_state_bytes"] == 8 * summary["trainable_params"] + 4 * len(adapters)
    rows = read_metrics(out / "metrics.jsonl")
    assert rows[-1]["loss"] < rows[0]["loss"]
    config = json.loads((step / adapter_io.ADAPTER_CONFIG).read_text())
    assert config["base_model_name_or_path"] == str(Path(model_dir).resolve())
    assert (config["r"], config["lora_alpha"]) == (4, 8.0)
    # The merged folder loads in transformers and equals base + adapter.
    assert summary["merged"] == str(out / "merged")
    merged = load_hf(out / "merged")
    with torch.no_grad():
        adapted = peft.PeftModel.from_pretrained(load_hf(Path(model_dir)), step).eval()
        t = tokens(vocab=300)
        assert rel_err(merged(t).logits, adapted(t).logits) <= 1e-5


def test_lora_resume_reproduces_the_uninterrupted_run(tmp_path, corpus):
    flags = {"max_steps": 6, "save_every": 3, "lora_dropout": 0.1, "lr": 3e-3}
    run(tmp_path, corpus, name="full", **flags)
    full = read_metrics(tmp_path / "full" / "metrics.jsonl")
    part = tmp_path / "part"
    part.mkdir()
    shutil.copytree(tmp_path / "full" / "step_3", part / "step_3")
    shutil.copy(tmp_path / "full" / "config.yaml", part / "config.yaml")  # written at the start
    run(tmp_path, corpus, name="part", resume=True, **flags)
    resumed = read_metrics(part / "metrics.jsonl")
    assert [r["step"] for r in resumed] == [4, 5, 6]
    assert [r["loss"] for r in resumed] == [r["loss"] for r in full[3:]]
    a = load_file(tmp_path / "full" / "step_6" / adapter_io.ADAPTER_WEIGHTS)
    b = load_file(part / "step_6" / adapter_io.ADAPTER_WEIGHTS)
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow
def test_compiled_qlora_run_matches_eager_run(tmp_path, corpus):
    """QLoRA with compile, the fused loss, selective AC and in-backward steps: the same losses as
    the eager run with the same storage, one graph per region."""
    flags = {
        "quantize_base": "nf4",
        "base_dtype": "bf16",
        "ac": "selective",
        "optimizer_in_backward": True,
        "loss": "fused",
        "max_steps": 3,
        "lr": 3e-3,
    }
    run(tmp_path, corpus, name="eager", **flags)
    comp = run(tmp_path, corpus, name="comp", compile=True, compile_backend="aot_eager", **flags)
    assert comp["compile"]["compiles"] == 2 and comp["compile"]["recompiles"] == 0
    a = read_metrics(tmp_path / "eager" / "metrics.jsonl")
    b = read_metrics(tmp_path / "comp" / "metrics.jsonl")
    for ra, rb in zip(a, b, strict=True):
        assert rb["loss"] == pytest.approx(ra["loss"], rel=1e-4)


def _unfit_dir(tmp_path: Path) -> str:
    args = tiny_args(1)
    args.dim, args.n_heads, args.n_kv_heads = 96, 4, 2  # 96 is not a multiple of 64
    path = tmp_path / "unfit"
    save_hf(build_model(args), path, tokenizer=byte_tokenizer())
    return str(path)


def _full_run(tmp_path: Path) -> str:
    corpus = tmp_path / "c.txt"
    corpus.write_text(TEXT)
    train(
        resolve(
            {},
            {
                "data": str(corpus),
                "seq_len": 32,
                "batch_size": 2,
                "max_steps": 1,
                "output_dir": str(tmp_path / "full"),
            },
        )
    )
    return str(tmp_path / "full")


BAD = [
    (lambda t: ["--lora-alpha", "8"], "--lora-alpha applies to LoRA runs; add --lora-rank"),
    (lambda t: ["--quantize-base", "nf4"], "--quantize-base applies to LoRA runs"),
    (lambda t: ["--lora-rank", "4", "--lora-targets", "q,x"], "unknown LoRA target 'x'"),
    (
        lambda t: ["--lora-rank", "4", "--lora-dropout", "1.5"],
        r"--lora-dropout must be in \[0, 1\)",
    ),
    (
        lambda t: ["--lora-rank", "4", "--quantize-base", "nf4", "--model-dir", _unfit_dir(t)],
        "dim = 96 is not a multiple of the NF4 block of 64",
    ),
]


@pytest.mark.parametrize("make_argv, needle", BAD)
def test_bad_lora_input_one_line_exit_2_nothing_written(tmp_path, capsys, make_argv, needle):
    argv = make_argv(tmp_path)
    out = tmp_path / "out"
    assert main(["train", "--max-steps", "1", *argv, "--output-dir", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("compiletune: error: "), err
    assert re.search(needle, err[0]), err[0]
    assert not out.exists()


def test_resume_refuses_the_other_kind_of_checkpoint(tmp_path, capsys):
    out = _full_run(tmp_path)
    argv = [
        "train",
        "--seq-len",
        "32",
        "--output-dir",
        out,
        "--resume",
        "--data",
        str(tmp_path / "c.txt"),
    ]
    assert main([*argv, "--lora-rank", "4"]) == 2
    err = capsys.readouterr().err
    assert "--lora-rank 0 -> 4" in err and "a resumed run keeps" in err


# --- the trainer under FSDP2 (2 processes, gloo) -------------------------------------------------


def _fsdp_runs(tmp: str, corpus: str, model_dir: str) -> dict[str, dict]:
    """name -> flags of the 2-rank run (the single-process reference has batch_size 4)."""
    common = {"data": corpus, "seq_len": 32, "batch_size": 2, "lora_rank": 4, "lr": 3e-3}
    # Full rows: whole-example padding leaves adapter entries with near-zero gradients, whose
    # Adam steps amplify summation-order noise past the adapter comparison's 1e-5.
    common["packing"] = "stream"
    return {
        "lora": {**common, "model_dir": model_dir, "max_steps": 4, "save_every": 2, "merge": True},
        "qlora": {**common, "n_layers": 2, "quantize_base": "nf4", "max_steps": 3},
        "bf16-base": {**common, "n_layers": 2, "base_dtype": "bf16", "max_steps": 2},
    }


def _lora_fsdp_worker(rank: int, port: int, tmp: str, corpus: str, model_dir: str) -> None:

    import torch.distributed as dist

    torch.set_num_threads(1)

    def body() -> None:
        runs = _fsdp_runs(tmp, corpus, model_dir)
        for name, flags in runs.items():
            train(resolve({}, {**flags, "fsdp": True, "output_dir": f"{tmp}/fsdp-{name}"}))
        # A run that died after step 2, resumed from its sharded LoRA checkpoint.
        part = Path(tmp) / "part"
        if rank == 0:
            part.mkdir()
            shutil.copytree(Path(tmp) / "fsdp-lora" / "step_2", part / "step_2")
            shutil.copy(Path(tmp) / "fsdp-lora" / "config.yaml", part / "config.yaml")
            rows = read_metrics(Path(tmp) / "fsdp-lora" / "metrics.jsonl")[:2]
            (part / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        dist.barrier()
        train(resolve({}, {**runs["lora"], "fsdp": True, "resume": True, "output_dir": str(part)}))

    run_in_gloo(rank, 2, port, body)


@pytest.mark.slow
def test_fsdp_lora_and_qlora_match_one_process_resume_and_export(tmp_path, corpus, model_dir):
    """2 ranks x 2 rows against one process with 4 rows: LoRA from --model-dir (with --merge
    and a mid-run checkpoint), QLoRA and a bf16 base (projections and embedding) on a seeded
    preset give the same losses; the sharded run's adapter folder is the single-process one
    (and loads in peft); the merged folder matches; a resume from the sharded step_2
    reproduces the run."""
    import torch.multiprocessing as mp

    port = free_port()
    mp.spawn(_lora_fsdp_worker, args=(port, str(tmp_path), corpus, model_dir), nprocs=2)
    for name, flags in _fsdp_runs(str(tmp_path), corpus, model_dir).items():
        flags = {k: v for k, v in flags.items() if k != "save_every"}
        train(resolve({}, {**flags, "batch_size": 4, "output_dir": str(tmp_path / name)}))
        want = [r["loss"] for r in read_metrics(tmp_path / name / "metrics.jsonl")]
        got = [r["loss"] for r in read_metrics(tmp_path / f"fsdp-{name}" / "metrics.jsonl")]
        assert got == pytest.approx(want, rel=1e-5), name
        last = f"step_{flags['max_steps']}"
        single, sharded = tmp_path / name / last, tmp_path / f"fsdp-{name}" / last
        files = {p.name for p in single.iterdir()}
        assert {p.name for p in sharded.iterdir()} == files | {"sharded"}
        assert (sharded / adapter_io.ADAPTER_CONFIG).read_text() == (
            single / adapter_io.ADAPTER_CONFIG
        ).read_text()
        a, b = (
            load_file(sharded / adapter_io.ADAPTER_WEIGHTS),
            load_file(single / adapter_io.ADAPTER_WEIGHTS),
        )
        assert a.keys() == b.keys()
        for k in a:
            torch.testing.assert_close(a[k], b[k], rtol=1e-4, atol=1e-5)

    # The merged export of the sharded run: the single-process one, and base + adapter in peft.
    merged = load_file(tmp_path / "fsdp-lora" / "merged" / "model.safetensors")
    ref = load_file(tmp_path / "lora" / "merged" / "model.safetensors")
    assert merged.keys() == ref.keys()
    for k in merged:
        torch.testing.assert_close(merged[k], ref[k], rtol=1e-4, atol=1e-5)
    with torch.no_grad():
        adapted = peft.PeftModel.from_pretrained(
            load_hf(Path(model_dir)), tmp_path / "fsdp-lora" / "step_4"
        ).eval()
        t = tokens(vocab=300)
        got = load_hf(tmp_path / "fsdp-lora" / "merged")(t).logits
        assert rel_err(got, adapted(t).logits) <= 1e-5

    # The resume: the same losses and adapters, bit for bit.
    full = read_metrics(tmp_path / "fsdp-lora" / "metrics.jsonl")
    resumed = read_metrics(tmp_path / "part" / "metrics.jsonl")
    assert [r["loss"] for r in resumed] == [r["loss"] for r in full]
    a = load_file(tmp_path / "fsdp-lora" / "step_4" / adapter_io.ADAPTER_WEIGHTS)
    b = load_file(tmp_path / "part" / "step_4" / adapter_io.ADAPTER_WEIGHTS)
    assert all(torch.equal(a[k], b[k]) for k in a)
