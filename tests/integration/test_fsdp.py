"""FSDP2 on CPU with gloo: 2 processes train like one process on the same global batch.

Every multi-process case compares against a single-process run of the same global batch
(N ranks x --batch-size rows = one process with N x --batch-size rows): fp32 losses within
1e-5 relative, bf16 mixed precision within the bf16 bound.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import transformers
from gloo import free_port, run_in_gloo
from safetensors.torch import load_file

from compiletune.checkpoint.steps import check_resumable, convert_to_hf
from compiletune.cli import main
from compiletune.config import resolve
from compiletune.data.tokenizer import byte_tokenizer
from compiletune.distributed import mesh_shape
from compiletune.errors import UserError
from compiletune.metrics import read_metrics
from compiletune.models import build_model, from_name, save_hf
from compiletune.optim import ADAMW_BETAS
from compiletune.train.loop import train

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed unavailable")

TEXT = "\n".join(
    f"Row {i}: a packed line of text about sharding, number {i * 11 % 17}." for i in range(300)
)
BASE = {"seq_len": 32, "batch_size": 2, "max_steps": 3, "n_layers": 2, "lr": 3e-3}


def _losses(run_dir: Path) -> list[float]:
    """Training losses of each step, then the held-out loss where the run evaluated."""
    rows = read_metrics(run_dir / "metrics.jsonl")
    names = ("reward_margin", "kd_divergence", "reward", "kl", "eval_reward")
    extras = [r[k] for r in rows for k in names if k in r]
    return [r["loss"] for r in rows] + extras + [r["eval_loss"] for r in rows if "eval_loss" in r]


# ----------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        ({"sharding": "grad-op"}, "--sharding is a setting of FSDP"),
        ({"cpu_offload": True}, "--cpu-offload is a setting of FSDP"),
        ({"dtype": "bf16-mixed"}, "bf16-mixed is FSDP's mixed precision"),
        ({"fsdp": True, "sharding": "zero3"}, "--sharding must be one of"),
        ({"fsdp": True, "shard_size": 2}, "--shard-size"),
    ],
)
def test_bad_fsdp_flags(flags: dict, message: str) -> None:
    with pytest.raises(UserError, match=message):
        resolve({}, flags)


def test_torchrun_without_fsdp_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(UserError, match="4 processes were launched but --fsdp is off"):
        resolve({}, {})


def test_mesh_shapes() -> None:
    assert mesh_shape("full", 8, None, 4) == (8,)
    assert mesh_shape("grad-op", 8, None, 4) == (8,)
    assert mesh_shape("none", 8, None, 4) == (8, 1)
    assert mesh_shape("hybrid", 8, None, 4) == (2, 4)  # shard within a node of 4
    assert mesh_shape("hybrid", 8, 2, 4) == (4, 2)
    with pytest.raises(UserError, match="does not divide"):
        mesh_shape("hybrid", 8, 3, 4)


def test_checkpoint_kind_must_match_the_launch(tmp_path: Path) -> None:
    single = tmp_path / "step_1"
    single.mkdir()
    with pytest.raises(UserError, match="single-process checkpoint"):
        check_resumable(single, {}, world=2)
    check_resumable(single, {}, world=None)
    sharded = tmp_path / "step_2"
    (sharded / "sharded").mkdir(parents=True)
    with pytest.raises(UserError, match=r"checkpoint of 2 processes; resume it with --fsdp"):
        check_resumable(sharded, {"world_size": 2}, world=None)
    check_resumable(sharded, {"world_size": 2}, world=4)  # resharded as it loads
    eight = {"world_size": 2, "config": {"optimizer": "adamw8bit"}}
    with pytest.raises(UserError, match=r"8-bit AdamW .* resume with 2 processes$"):
        check_resumable(sharded, eight, world=4)
    check_resumable(sharded, eight, world=2)
    state = {"world_size": 2, "config": {"sharding": "full"}}
    with pytest.raises(UserError, match="resume with the same --sharding"):
        check_resumable(sharded, state, world=2, sharding="hybrid")
    check_resumable(sharded, state, world=2, sharding="full")


def test_lora_under_fsdp_flags_and_checkpoint_kind(tmp_path: Path) -> None:
    resolve({}, {"fsdp": True, "lora_rank": 4, "quantize_base": "nf4"})  # allowed
    with pytest.raises(UserError, match="bf16-mixed does not apply to LoRA runs"):
        resolve({}, {"fsdp": True, "lora_rank": 4, "dtype": "bf16-mixed"})
    step = tmp_path / "step_2"
    (step / "sharded").mkdir(parents=True)
    (step / "adapter_config.json").write_text("{}")
    with pytest.raises(UserError, match="LoRA checkpoint of an FSDP run of 2 processes"):
        check_resumable(step, {"world_size": 2}, world=None)
    check_resumable(step, {"world_size": 2}, world=2)
    with pytest.raises(UserError, match="loads in peft as is"):
        convert_to_hf(step, tmp_path / "out")


def test_convert_refuses_what_it_cannot_convert(tmp_path: Path) -> None:
    hf = tmp_path / "hf"
    save_hf(build_model(from_name("debug")), hf)
    with pytest.raises(UserError, match="already an HF folder"):
        convert_to_hf(hf, tmp_path / "out")
    (hf / "sharded").mkdir()
    with pytest.raises(UserError, match="not empty"):
        convert_to_hf(hf, hf)
    assert main(["convert", str(tmp_path / "nothing"), str(tmp_path / "o")]) == 2


# ----------------------------------------------------------------------------- torchrun, end to end


@pytest.mark.slow
def test_torchrun_matches_one_process_resumes_and_exports(tmp_path: Path, capsys) -> None:
    """`torchrun --nproc-per-node 2 -m compiletune train --fsdp`: the same losses as one process
    with the whole global batch; a resume from the sharded step_2 reproduces the run exactly;
    the final HF export and a converted step_2 load in transformers."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(TEXT)
    # A chat tokenizer whose turns end in a token of their own: the sharded checkpoint, and so
    # its conversion, carry it in generation_config.json.
    tok = byte_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": ["<|eot_id|>"]})
    tok.chat_template = "{% for m in messages %}{{ m['content'] }}<|eot_id|>{% endfor %}"
    tok.save_pretrained(tmp_path / "tok")
    flags = {**BASE, "max_steps": 4, "data": str(corpus), "tokenizer": str(tmp_path / "tok")}
    train(resolve({}, {**flags, "batch_size": 4, "output_dir": str(tmp_path / "single")}))

    def torchrun(out: Path, *extra: str) -> None:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"]
        cmd += ["--master-port", str(free_port()), "-m", "compiletune", "train", "--fsdp"]
        for key, value in flags.items():
            cmd += [f"--{key.replace('_', '-')}", str(value)]
        cmd += ["--save-every", "2", "--output-dir", str(out), *extra]
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
        assert done.returncode == 0, done.stderr[-3000:]

    torchrun(tmp_path / "fsdp")
    single, fsdp = _losses(tmp_path / "single"), _losses(tmp_path / "fsdp")
    assert fsdp == pytest.approx(single, rel=1e-5)
    step2 = tmp_path / "fsdp" / "step_2"
    assert (step2 / "sharded").is_dir() and not (step2 / "model.safetensors").exists()

    # A run that died after step 2: resume from the sharded checkpoint.
    part = tmp_path / "part"
    part.mkdir()
    shutil.copytree(step2, part / "step_2")
    shutil.copy(tmp_path / "fsdp" / "config.yaml", part / "config.yaml")  # written at the start
    (part / "metrics.jsonl").write_text(
        "".join(json.dumps(r) + "\n" for r in read_metrics(tmp_path / "fsdp" / "metrics.jsonl")[:2])
    )
    torchrun(part, "--resume")
    assert _losses(part) == _losses(tmp_path / "fsdp")
    a = load_file(tmp_path / "fsdp" / "step_4" / "model.safetensors")
    b = load_file(part / "step_4" / "model.safetensors")
    ref = load_file(tmp_path / "single" / "step_4" / "model.safetensors")
    assert a.keys() == ref.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    # Against one process the gradients are sums in another order (two ranks' halves, reduce-
    # scattered), equal to a few ulps of their terms. AdamW's step lr * m / sqrt(v) ignores a
    # gradient's size, so an element whose terms cancel to the rounding noise can step either
    # way: no elementwise tolerance under that step holds for every CPU and reduction order
    # (atol 1e-5 failed by 1.1e-5 on an AVX-512 EPYC and by 1.4e-5 under AVX2, one element each;
    # the median difference is 2e-9). The bound: the most one element can differ, 2 * sum of
    # lr_t * max |m_hat / sqrt(v_hat)| (by Cauchy-Schwarz, below), and each whole tensor's
    # difference (its L2 norm) no larger than that one element's. A shard left unstepped, stale
    # or misplaced differs by ~lr in every element, hundreds of times this.
    beta1, beta2 = ADAMW_BETAS  # the trainer's AdamW
    steps, lr = flags["max_steps"], flags["lr"]  # the schedule never exceeds the peak lr
    step_ratio = max(
        (1 - beta1)
        / math.sqrt(1 - beta2)
        * math.sqrt(sum((beta1**2 / beta2) ** j for j in range(t)))
        * math.sqrt(1 - beta2**t)
        / (1 - beta1**t)
        for t in range(1, steps + 1)
    )
    bound = 2 * steps * lr * step_ratio
    for k in a:
        assert torch.linalg.vector_norm(a[k] - ref[k]) <= bound, k

    # The final export and a converted sharded checkpoint are ordinary HF folders.
    tokens = torch.randint(0, 256, (1, 16))
    exported = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "fsdp" / "step_4")
    reference = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "single" / "step_4")
    with torch.no_grad():
        torch.testing.assert_close(
            exported(tokens).logits, reference(tokens).logits, rtol=1e-4, atol=1e-4
        )
    # a shard cut short (a disk that filled, a copy that stopped): one line naming it
    damaged = tmp_path / "damaged" / "step_2"
    shutil.copytree(step2, damaged)
    shard = sorted((damaged / "sharded").glob("*.distcp"))[-1]
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    assert main(["convert", str(damaged), str(tmp_path / "nope")]) == 2
    assert f"shard {shard} is cut short" in capsys.readouterr().err
    assert not (tmp_path / "nope").exists()
    # kill -9 in the middle of a convert leaves no folder that looks like a model
    killed = subprocess.run(
        [sys.executable, "-m", "compiletune", "convert", str(step2), str(tmp_path / "converted")],
        env={**os.environ, "COMPILETUNE_KILL_AT": "convert"},
        timeout=300,
    )
    assert killed.returncode == -9 and not (tmp_path / "converted").exists()
    assert main(["convert", str(step2), str(tmp_path / "converted")]) == 0
    converted = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "converted")
    saved = load_file(tmp_path / "converted" / "model.safetensors")
    got = dict(converted.named_parameters())
    assert all(torch.equal(got[k], v) for k, v in saved.items())
    assert transformers.AutoTokenizer.from_pretrained(tmp_path / "converted") is not None
    eos = transformers.GenerationConfig.from_pretrained(tmp_path / "converted").eos_token_id
    assert eos == [tok.eos_token_id, tok.convert_tokens_to_ids("<|eot_id|>")]
    # The last checkpoint holds its own fp32 export; a bf16 conversion must not mix it in.
    assert (
        main(
            [
                "convert",
                str(tmp_path / "fsdp" / "step_4"),
                str(tmp_path / "bf16"),
                "--dtype",
                "bf16",
            ]
        )
        == 0
    )
    half = load_file(tmp_path / "bf16" / "model.safetensors")
    assert {t.dtype for t in half.values()} == {torch.bfloat16}
    assert sorted(p.name for p in (tmp_path / "bf16").glob("model*")) == ["model.safetensors"]


# ----------------------------------------------------------------------------- variants in one spawn


def _variants(tmp: Path, corpus: str, tied_dir: str) -> dict[str, dict]:
    """name -> (flags for the 2-rank run, flags for the single-process reference)."""
    base = {**BASE, "data": corpus}
    from_dir = {k: v for k, v in base.items() if k != "n_layers"} | {"model_dir": tied_dir}
    moe = {**base, "model": "debug_moe", "router_aux_coef": 0.1}
    dpo = {**base, "data": str(tmp / "pairs.jsonl"), "objective": "dpo", "seq_len": 128}
    four = {**base, "n_layers": 4, "max_steps": 2}
    q35 = {**four, "model": "debug_qwen3_5_moe", "router_aux_coef": 0.1}
    dpo |= {"val_split": 0.1, "eval_every": 3}
    grpo = {**base, "data": str(tmp / "pairs.jsonl"), "objective": "grpo", "reward": "regex:\\d"}
    grpo |= {"num_generations": 4, "max_new_tokens": 4, "grpo_iterations": 2, "beta": 0.04}
    grpo |= {"eval_data": str(tmp / "held.jsonl"), "eval_every": 2}  # 5 prompts: 3 + 2
    dpo_lc = {**dpo, "lora_rank": 4, "compile": True, "compile_backend": "aot_eager"}
    kd = {**base, "objective": "kd", "teacher_dir": tied_dir, "kd_ratio": 0.5}
    return {
        "grad-op": ({**base, "sharding": "grad-op"}, base),
        "none": ({**base, "sharding": "none"}, base),
        "hybrid": ({**base, "sharding": "hybrid", "shard_size": 1}, base),
        "cpu-offload": ({**base, "cpu_offload": True}, base),
        "compiled": (
            {**base, "compile": True, "compile_backend": "aot_eager", "ac": "selective"},
            base,
        ),
        "in-backward": (
            {**base, "optimizer_in_backward": True},
            {**base, "max_grad_norm": 0.0},
        ),
        "tied-model-dir": (from_dir, from_dir),
        "bf16-mixed": ({**base, "dtype": "bf16-mixed"}, base),
        "bf16": ({**base, "dtype": "bf16"}, {**base, "dtype": "bf16"}),
        "eval": ({**base, "eval_data": corpus}, {**base, "eval_data": corpus}),
        # the new families' mechanisms sharded: sandwich norms, soft-caps, layer kinds, fused
        # projections (compiled: one region per layer kind)
        "gemma2-compiled": (
            {**base, "model": "debug_gemma2", "compile": True, "compile_backend": "aot_eager"},
            {**base, "model": "debug_gemma2"},
        ),
        "phi3-lora": (
            {**base, "model": "debug_phi3", "lora_rank": 4},
            {**base, "model": "debug_phi3", "lora_rank": 4},
        ),
        # all four layers of the new families' patterns: OLMo 3's norms after, whole-projection
        # q/k norms and windows; Qwen3.5's Gated DeltaNet layers beside gated attention;
        # SmolLM3's NoPE layer
        "olmo3-compiled": (
            {**four, "model": "debug_olmo3", "compile": True, "compile_backend": "aot_eager"},
            {**four, "model": "debug_olmo3"},
        ),
        # (Qwen3.5-MoE: the linear-attention layers with routed and shared experts; the
        # router losses are per rank's rows, so the reference takes two micro-batches)
        "qwen3_5_moe-compiled": (
            {**q35, "compile": True, "compile_backend": "aot_eager"},
            {**q35, "grad_accum": 2},
        ),
        # Gemma 4's per-layer inputs (a unit of their own), keys and values handed from block
        # to block, a full layer's wider head with keys as values
        "gemma4-compiled": (
            {**four, "model": "debug_gemma4", "compile": True, "compile_backend": "aot_eager"},
            {**four, "model": "debug_gemma4"},
        ),
        # gpt-oss's sinks and windows with frozen experts (biases, clamped SwiGLU) under LoRA;
        # the router losses are per rank's rows, so the reference takes two micro-batches
        "gpt_oss-lora": (
            {**four, "model": "debug_gpt_oss", "lora_rank": 4, "router_aux_coef": 0.1},
            {**four, "model": "debug_gpt_oss", "lora_rank": 4, "router_aux_coef": 0.1}
            | {"grad_accum": 2},
        ),
        # DeepSeek-V3's latent attention and sigmoid routing, its correction biases nudged
        # after each step by the loads of both ranks (DTensor shards of the bias)
        "deepseek-balanced": (
            {**four, "model": "debug_deepseek", "router_bias_update_rate": 0.05},
            {**four, "model": "debug_deepseek", "router_bias_update_rate": 0.05}
            | {"grad_accum": 2},
        ),
        "smollm3-lora": (
            {**four, "model": "debug_smollm3", "lora_rank": 4},
            {**four, "model": "debug_smollm3", "lora_rank": 4},
        ),
        # MoE (each block one unit, experts included). The router losses are means over each
        # rank's rows, so the reference takes the same rows as two accumulated micro-batches.
        "moe-compiled": (
            {**moe, "compile": True, "compile_backend": "aot_eager", "ac": "selective"},
            {**moe, "grad_accum": 2},
        ),
        "moe-lora": ({**moe, "lora_rank": 4}, {**moe, "lora_rank": 4, "grad_accum": 2}),
        # --objective: the DPO reference (a sharded frozen copy, or the LoRA policy with its
        # adapters off) and the KD teacher (sharded; another model of the same vocabulary)
        "dpo": (dpo, dpo),
        "dpo-lora-compiled": (dpo_lc, {**dpo, "lora_rank": 4}),
        "dpo-precompute": ({**dpo, "precompute_ref": True}, {**dpo, "precompute_ref": True}),
        "kd": (kd, kd),
        "kd-lora": ({**kd, "lora_rank": 4}, {**kd, "lora_rank": 4}),
        "kd-grad-op": ({**kd, "sharding": "grad-op"}, kd),
        # grpo: each rank samples its prompts' completions with the weights gathered, the
        # same completions one process samples for the same prompts (seeded per prompt of the
        # global batch); two updates per rollout and a KL penalty to a sharded reference (LoRA
        # under FSDP: the variants above; grpo with LoRA: tests/integration/test_grpo_runs.py);
        # the held-out reward from each rank's share of 5 held-out prompts (3 and 2)
        "grpo": (grpo, grpo),
        # --fp8 tensorwise (torchao, emulated): sharded weights all-gathered in float8 with
        # scales precomputed after each step; the one process casts whole weights
        "fp8-tensorwise": ({**base, "fp8": "tensorwise"}, {**base, "fp8": "tensorwise"}),
        # LoRA over a float8 base, compiled: the frozen projections' float8 matmuls traced
        # into each block's graph, the adapters in fp32
        "fp8-lora-compiled": (
            {**base, "fp8": "rowwise", "lora_rank": 4, "compile": True}
            | {"compile_backend": "aot_eager"},
            {**base, "fp8": "rowwise", "lora_rank": 4},
        ),
    }


def _variant_worker(rank: int, port: int, tmp: str, corpus: str, tied_dir: str) -> None:
    torch.set_num_threads(1)

    def body() -> None:
        for name, (flags, _) in _variants(Path(tmp), corpus, tied_dir).items():
            cfg = resolve({}, {**flags, "fsdp": True, "output_dir": f"{tmp}/{name}"})
            train(cfg)
            torch.compiler.reset()

    run_in_gloo(rank, 2, port, body)


@pytest.mark.slow
def test_fsdp_variants_match_one_process(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Sharding modes, CPU offload, compile + activation policy + fused loss, in-backward,
    a tied model loaded by rank 0 from --model-dir, bf16 mixed precision and pure bf16, a
    held-out evaluation and MoE models (compiled; LoRA on experts): each 2-rank run
    against a single process with the whole global batch."""
    monkeypatch.setenv("COMPILETUNE_FP8_EMULATE", "1")  # the workers inherit it
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(TEXT)
    tied = from_name("debug")
    tied.n_layers, tied.tie_embeddings, tied.qkv_bias, tied.family = 2, True, True, "qwen2"
    tied_dir = tmp_path / "tied-qwen"
    save_hf(build_model(tied, seed=5), tied_dir, tokenizer=byte_tokenizer())
    with (tmp_path / "pairs.jsonl").open("w") as f:
        for i in range(60):
            row = {"prompt": f"Q{i}: say {i % 7}.", "chosen": f" {i % 7}.", "rejected": " no!"}
            f.write(json.dumps(row) + "\n")
    held = [
        {"prompt": f"Held {i}: say {i}.", "chosen": f" {i}.", "rejected": " no!"} for i in range(5)
    ]
    (tmp_path / "held.jsonl").write_text("".join(json.dumps(r) + "\n" for r in held))

    mp.spawn(
        _variant_worker,
        args=(free_port(), str(tmp_path), str(corpus), str(tied_dir)),
        nprocs=2,
    )
    references: dict[str, list[float]] = {}
    failures = []
    for name, (_, ref_flags) in _variants(tmp_path, str(corpus), str(tied_dir)).items():
        key = json.dumps(ref_flags, sort_keys=True)
        if key not in references:
            out = tmp_path / f"ref-{len(references)}"
            rows = 4 // ref_flags.get("grad_accum", 1)  # the global batch: 4 rows a step
            train(resolve({}, {**ref_flags, "batch_size": rows, "output_dir": str(out)}))
            references[key] = _losses(out)
        want, got = references[key], _losses(tmp_path / name)
        # bf16: within bf16's precision (mixed: against the fp32 run; pure: another reduction order).
        # fp8: float8's rounding turns the reduction orders' last bits into whole float8 steps
        # for a few values (e4m3: 2^-4 of each), which moves the loss by up to ~0.5%.
        rel = 2e-2 if name.startswith("bf16") else 1e-2 if name.startswith("fp8") else 1e-5
        if got != pytest.approx(want, rel=rel):
            failures.append(f"{name}: {got} vs one process {want}")
    assert not failures, "\n".join(failures)
    for name in ("compiled", "fp8-lora-compiled"):
        summary = json.loads((tmp_path / name / "summary.json").read_text())
        assert summary["compile"]["recompiles"] == 0 and summary["processes"] == 2, name


def test_fsdp_integer_parameter_shim():
    """What FSDP2's parameter module sees on torch 2.11 (torch_internals): integer data gets no
    gradient flag, floats keep theirs, and every other attribute is torch.nn's."""
    from compiletune.torch_internals import _FsdpNN

    nn_ = _FsdpNN()
    codes = nn_.Parameter(torch.zeros(4, dtype=torch.uint8))
    assert isinstance(codes, torch.nn.Parameter) and not codes.requires_grad
    assert nn_.Parameter(torch.zeros(4)).requires_grad
    assert not nn_.Parameter(torch.zeros(4), requires_grad=False).requires_grad
    assert nn_.Linear is torch.nn.Linear


# ----------------------------------------------------------------------------- faults


def _torchrun(out: Path, corpus: Path, env: dict[str, str], *extra: str):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"]
    cmd += ["--master-port", str(free_port()), "-m", "compiletune", "train", "--fsdp"]
    for key, value in {**BASE, "data": str(corpus)}.items():
        cmd += [f"--{key.replace('_', '-')}", str(value)]
    cmd += ["--output-dir", str(out), *extra]
    env = {**os.environ, "OMP_NUM_THREADS": "1", **env}
    # Without the ranks agreeing on a failure, the ranks that did not fail would wait at a
    # barrier for the process group's timeout (30 minutes): the 120 s limit is that check.
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)


@pytest.mark.slow
def test_a_save_error_on_one_rank_stops_every_rank_with_one_line(tmp_path: Path) -> None:
    """A full disk on one rank, in each part of a sharded save (its shards, inside
    torch.distributed.checkpoint; rank 0's HF export, where the other rank is gathering; rank 0's
    training state, after the last collective): every rank stops at once with the same line
    naming the rank, and no half-written folder is left."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(TEXT)
    for at in ("shards@1", "export@0", "state@0"):
        out = tmp_path / at
        done = _torchrun(out, corpus, {"COMPILETUNE_FAIL_AT": at}, "--max-steps", "2")
        assert done.returncode != 0
        rank = at.split("@")[1]
        lines = [x for x in done.stderr.splitlines() if x.startswith("compiletune: error:")]
        assert len(lines) == 2 and lines[0] == lines[1], done.stderr[-3000:]
        assert lines[0].startswith(f"compiletune: error: rank {rank}: the disk of "), lines[0]
        assert "step_2 could not be written" in lines[0]
        assert sorted(p.name for p in out.iterdir()) == ["config.yaml", "metrics.jsonl"]


@pytest.mark.slow
def test_kill_9_during_the_fsdp_final_export_then_resume(tmp_path: Path) -> None:
    """SIGKILL in rank 0 while it writes the final HF export (rank 1 gathering): torchrun
    stops both, only whole checkpoints are visible, and `--resume` under torchrun finishes the
    run from step_2 with an export transformers loads."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(TEXT)
    out = tmp_path / "run"
    flags = ("--max-steps", "4", "--save-every", "2")
    done = _torchrun(out, corpus, {"COMPILETUNE_KILL_AT": "export"}, *flags)
    assert done.returncode != 0
    steps = sorted(p.name for p in out.iterdir() if p.name.startswith("step_"))
    assert steps == ["step_2"]
    assert (out / "step_2" / "sharded").is_dir()
    done = _torchrun(out, corpus, {}, *flags, "--resume")
    assert done.returncode == 0, done.stderr[-3000:]
    assert not [p.name for p in out.iterdir() if p.name.startswith((".tmp", ".old"))]
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl")] == [1, 2, 3, 4]
    transformers.AutoModelForCausalLM.from_pretrained(out / "step_4")


@pytest.mark.slow
def test_a_diverged_fsdp_run_names_its_cause_on_every_rank(tmp_path: Path) -> None:
    """The cause of a non-finite step is read over every rank's shards (a collective that every
    rank joins, since all take the same decision): both ranks stop with the same line."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(TEXT)
    done = _torchrun(tmp_path / "run", corpus, {}, "--lr", "1e10", "--max-steps", "4")
    assert done.returncode != 0
    lines = [x for x in done.stderr.splitlines() if x.startswith("compiletune: error:")]
    assert len(lines) == 2 and lines[0] == lines[1], done.stderr[-3000:]
    assert "is nan" in lines[0] or "is inf" in lines[0], lines[0]
    assert "a lower learning rate" in lines[0] and "--dtype fp32" not in lines[0]
