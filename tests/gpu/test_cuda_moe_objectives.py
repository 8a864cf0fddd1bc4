"""CUDA checks of the MoE grouped matmul and the --objective heads (skipped without a GPU).

`bench/gpu_check.py --part 1` runs them with the rest of tests/gpu (`pytest -m cuda`).
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from compiletune.data.tokenizer import byte_tokenizer
from compiletune.metrics import read_metrics
from compiletune.models import build_model, from_name, save_hf
from compiletune.ops.fused_logprobs import token_divergence, token_logprobs
from compiletune.ops.grouped_mm import grouped_mm, uses_native

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from gloo import free_port  # noqa: E402
from pair_data import WORDS, write_pairs  # noqa: E402
from tiny_run import tiny_run  # noqa: E402

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

TEXT = "\n".join(
    f"Row {i}: experts route tokens, and token {i * 7 % 23} goes to expert {i % 8}."
    for i in range(400)
)
MOE = {"model": "debug_moe", "n_layers": 3, "lr": 3e-3, "seq_len": 128, "batch_size": 4}


def _loop(x: torch.Tensor, w: torch.Tensor, counts: list[int]) -> torch.Tensor:
    out, start = [], 0
    for e, n in enumerate(counts):
        out.append(x[start : start + n] @ w[e])
        start += n
    return torch.cat(out)


@pytest.mark.parametrize("counts", [[0, 40, 0, 88], [128, 0, 0, 0], [17, 33, 0, 78]])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_grouped_mm_on_cuda_equals_a_loop(counts, dtype):
    """bf16 on sm90+ runs torch._grouped_mm, fp32 the custom op: forward and both gradients
    against a per-expert loop in fp64, empty experts (gradient exactly zero) included."""
    g = torch.Generator(device="cuda").manual_seed(0)
    n, k, m = sum(counts), 64, 96
    x = torch.randn(n, k, generator=g, device="cuda").to(dtype).requires_grad_()
    w = (torch.randn(len(counts), k, m, generator=g, device="cuda") * 0.1).to(dtype)
    w.requires_grad_()
    offs = torch.tensor(counts, device="cuda").cumsum(0).to(torch.int32)
    if dtype == torch.bfloat16 and torch.cuda.get_device_capability() >= (9, 0):
        assert uses_native(x, w)
    grad = torch.randn(n, m, generator=g, device="cuda").to(dtype)
    out = grouped_mm(x, w, offs)
    gx, gw = torch.autograd.grad(out, (x, w), grad)
    xd, wd = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    ref = _loop(xd, wd, counts)
    rx, rw = torch.autograd.grad(ref, (xd, wd), grad.double())
    tol = {"rtol": 2e-2, "atol": 2e-2} if dtype == torch.bfloat16 else {"rtol": 1e-4, "atol": 1e-4}
    for a, b in ((out, ref), (gx, rx), (gw, rw)):
        torch.testing.assert_close(a.double(), b, **tol)
    for e, c in enumerate(counts):
        if c == 0:
            assert gw[e].abs().max().item() == 0


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_moe_compiled_run_follows_eager(tmp_path, dtype):
    """debug_moe through the trainer with inductor on CUDA: 0 recompiles, router metrics, and
    the compiled losses follow eager (bf16: torch._grouped_mm inside the compiled block)."""
    data = tmp_path / "corpus.txt"
    data.write_text(TEXT)
    run = {**MOE, "dtype": dtype, "max_steps": 6, "loss": "fused"}
    eager = tiny_run(tmp_path, str(data), "eager", **run)
    comp = tiny_run(tmp_path, str(data), "compiled", **run, compile=True, ac="selective")
    assert comp["compile"]["recompiles"] == 0, comp["compile"]
    tol = 1e-3 if dtype == "fp32" else 3e-2
    assert comp["first_loss"] == pytest.approx(eager["first_loss"], rel=tol)
    assert comp["final_loss"] < comp["first_loss"]
    records = read_metrics(tmp_path / "compiled" / "metrics.jsonl")
    assert all(r["router_aux_loss"] > 0 for r in records)


def test_token_logprobs_and_divergence_on_cuda():
    """The chunked heads in bf16 on CUDA against fp64 full logits, gradients included."""
    g = torch.Generator(device="cuda").manual_seed(0)
    n, d, v = 1000, 256, 50000
    h = (torch.randn(n, d, generator=g, device="cuda") * 0.5).bfloat16().requires_grad_()
    w = (torch.randn(v, d, generator=g, device="cuda") * 0.05).bfloat16().requires_grad_()
    th = torch.randn(n, d, generator=g, device="cuda").bfloat16()
    tw = (torch.randn(v, d, generator=g, device="cuda") * 0.05).bfloat16()
    t = torch.randint(0, v, (n,), generator=g, device="cuda")
    t[::7] = -100
    lp = token_logprobs(h, w, t)
    (gh,) = torch.autograd.grad(lp.sum(), (h,))
    hd, wd = h.detach().double().requires_grad_(), w.detach().double()
    ref = torch.log_softmax(hd @ wd.t(), -1).gather(1, t.clamp_min(0)[:, None]).squeeze(1)
    ref = torch.where(t == -100, 0.0, ref)
    (rh,) = torch.autograd.grad(ref.sum(), (hd,))
    torch.testing.assert_close(lp.double(), ref, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(gh.double(), rh, rtol=3e-2, atol=3e-2)
    mask = t != -100
    kl = token_divergence(h, w, th, tw, mask, temperature=2.0)
    s = torch.log_softmax(hd @ wd.t() / 2.0, -1)
    te = torch.log_softmax(th.double() @ tw.double().t() / 2.0, -1)
    ref_kl = torch.where(mask, (te.exp() * (te - s)).sum(-1), 0.0)
    torch.testing.assert_close(kl.double(), ref_kl, rtol=3e-2, atol=3e-3)


def _pairs(tmp_path: Path) -> str:
    return write_pairs(tmp_path / "pairs.jsonl", 200)


@pytest.mark.parametrize(
    "flags",
    [
        {"objective": "dpo", "compile": True, "ac": "selective"},
        {"objective": "dpo", "lora_rank": 8, "lr": 3e-3, "compile": True},
        {"objective": "simpo", "simpo_gamma": 0.2, "dtype": "bf16"},
    ],
    ids=["dpo-compiled", "dpo-lora-compiled", "simpo-bf16"],
)
def test_preference_objectives_on_cuda(tmp_path, flags):
    """Compiled runs go through the fuse_linear_logprobs pass; the reference pass keeps
    FlexAttention compiled; the memory pre-flight check runs (each warned before)."""
    run = {"model": "debug", "n_layers": 2, "seq_len": 128, "batch_size": 4, "lr": 1e-3}
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        summary = tiny_run(tmp_path, _pairs(tmp_path), **{**run, "max_steps": 12, **flags})
    bad = [str(w.message) for w in seen if "pre-flight" in str(w.message)]
    bad += [str(w.message) for w in seen if "without torch.compile" in str(w.message)]
    assert not bad, bad
    records = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert records[-1]["loss"] < records[0]["loss"]
    assert records[-1]["reward_margin"] > records[0]["reward_margin"]
    if flags.get("compile"):
        assert summary["compile"]["recompiles"] == 0, summary["compile"]


def test_kd_on_cuda(tmp_path):
    args = from_name("debug")
    args.n_layers = 3
    save_hf(build_model(args, seed=7), tmp_path / "teacher", tokenizer=byte_tokenizer())
    r = random.Random(1)
    (tmp_path / "t.txt").write_text(
        "\n\n\n".join(" ".join(r.choice(WORDS) for _ in range(40)) for _ in range(200))
    )
    tiny_run(
        tmp_path,
        str(tmp_path / "t.txt"),
        model="debug",
        n_layers=2,
        seq_len=128,
        batch_size=4,
        lr=3e-3,
        max_steps=20,
        objective="kd",
        teacher_dir=str(tmp_path / "teacher"),
        kd_ratio=1.0,
        kd_temperature=2.0,
        compile=True,
    )
    records = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert records[-1]["kd_divergence"] < records[0]["kd_divergence"]


@pytest.mark.parametrize("objective", ["dpo", "kd"])
def test_objective_under_one_gpu_nccl_fsdp(tmp_path, objective):
    """`torchrun --nproc-per-node 1 ... --fsdp --objective`: the reference or teacher sharded
    over NCCL, compiled (inductor), end to end."""
    if objective == "kd":
        args = from_name("debug")
        args.n_layers = 3
        save_hf(build_model(args, seed=7), tmp_path / "teacher", tokenizer=byte_tokenizer())
        data = tmp_path / "t.txt"
        data.write_text("\n\n\n".join(f"line {i}: " + " ".join(WORDS) for i in range(200)))
        extra = ["--teacher-dir", str(tmp_path / "teacher"), "--data", str(data)]
    else:
        extra = ["--data", _pairs(tmp_path), "--val-split", "0.1", "--eval-every", "6"]
    out = tmp_path / "fsdp"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "1"]
    cmd += ["--master-port", str(free_port())]  # tests run side by side (xdist)
    cmd += ["-m", "compiletune", "train", "--fsdp", "--objective", objective, *extra]
    cmd += ["--model", "debug", "--n-layers", "2", "--seq-len", "128", "--batch-size", "4"]
    cmd += ["--max-steps", "6", "--compile", "--output-dir", str(out)]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "pre-flight" not in proc.stderr, proc.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["processes"] == 1 and summary["compile"]["recompiles"] == 0
    assert summary["final_loss"] < summary["first_loss"]
