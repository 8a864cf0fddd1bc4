"""What only a CUDA GPU can check: the GPU paths against their CPU-tested references.

Skipped without a GPU (CI); `bench/gpu_check.py --part 1` runs them (`pytest -m cuda`). The
fused head's Triton kernels are checked in tests/unit/ops/test_fused_loss.py (also `cuda`).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from compiletune.models import attention as attn
from compiletune.models.attention import causal_attention
from compiletune.ops.host_copy import offload_to_host, reload_from_host

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit" / "models"))
from gloo import free_port  # noqa: E402
from test_attention import doc_ids_for, reference  # noqa: E402
from tiny_run import tiny_run  # noqa: E402

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

CASES = [
    (40, 0.0, None),
    (40, 0.0, [[300, 20, 280], [600]]),
    (0, 4.0, None),
    (40, 4.0, [[50, 500, 50], [1, 599]]),
    (0, 0.0, [[100, 500], [600]]),
]


def corpus(tmp_path: Path, n_docs: int = 300) -> str:
    """Many short documents: rows pack several, so runs are document-masked."""
    docs = [
        f"Document {i}: " + " ".join(f"w{(i * j) % 17}" for j in range(i % 9 + 3))
        for i in range(n_docs)
    ]
    path = tmp_path / "docs.txt"
    path.write_text("\n\n\n".join(docs))
    return str(path)


@pytest.mark.parametrize("backend", ["flex", "segments"])
@pytest.mark.parametrize("window, softcap, docs", CASES)
def test_masked_attention_with_grads(monkeypatch, backend, window, softcap, docs):
    """Both CUDA attention paths against the dense fp64 reference, gradients included."""
    if backend == "flex" and not attn._HAS_FLEX:
        pytest.skip("no FlexAttention in this torch")
    monkeypatch.setenv(attn.BACKEND_ENV, backend)
    g = torch.Generator(device="cuda").manual_seed(0)
    b, h, s, hd = 2, 3, 600, 64

    def rand():
        return torch.randn(b, h, s, hd, generator=g, device="cuda", requires_grad=True)

    q, k, v = rand(), rand(), rand()
    doc_ids = doc_ids_for(docs).cuda() if docs else None
    grad = torch.randn(b, h, s, hd, generator=g, device="cuda")
    out = causal_attention(q, k, v, 0.125, doc_ids, window, softcap)
    got = [out, *torch.autograd.grad(out, (q, k, v), grad)]
    ref = reference(q, k, v, 0.125, doc_ids, window, softcap)
    want = [ref, *torch.autograd.grad(ref, (q, k, v), grad)]
    for a, w in zip(got, want, strict=True):
        torch.testing.assert_close(a, w, rtol=2e-3, atol=2e-3)


@pytest.mark.parametrize("window, docs", [(0, None), (40, [[50, 500, 50], [1, 599]])])
def test_sinks_through_flexattention_with_grads(window, docs):
    """gpt-oss's sinks on CUDA's path: FlexAttention's output and log-sum-exp (differentiated
    through), against the dense fp64 reference, the sinks' gradient included."""
    if not attn._HAS_FLEX:
        pytest.skip("no FlexAttention in this torch")
    g = torch.Generator(device="cuda").manual_seed(0)
    b, h, s, hd = 2, 3, 600, 64
    q, k, v = (
        torch.randn(b, h, s, hd, generator=g, device="cuda", requires_grad=True) for _ in range(3)
    )
    sinks = torch.randn(h, generator=g, device="cuda").requires_grad_()
    doc_ids = doc_ids_for(docs).cuda() if docs else None
    mask = attn.flex_block_mask(doc_ids, window, b, s, q.device)
    grad = torch.randn(b, h, s, hd, generator=g, device="cuda")
    out = causal_attention(q, k, v, 0.125, mask, window, sinks=sinks)
    got = [out, *torch.autograd.grad(out, (q, k, v, sinks), grad)]
    ref = reference(q, k, v, 0.125, doc_ids, window, 0.0, sinks)
    want = [ref, *torch.autograd.grad(ref, (q, k, v, sinks), grad)]
    for a, w in zip(got, want, strict=True):
        torch.testing.assert_close(a, w, rtol=2e-3, atol=2e-3)


def test_flex_is_the_cuda_default():
    assert attn.attention_backend(torch.device("cuda")) == (
        "flex" if attn._HAS_FLEX else "segments"
    )
    # eager dispatch-mode selective checkpointing cannot run a compiled FlexAttention
    assert attn.attention_backend(torch.device("cuda"), eager_selective=True) == "segments"


@pytest.mark.parametrize("ac", ["selective", "full"])
def test_flex_under_checkpointing_with_grads(monkeypatch, ac):
    """A compiled block under each policy runs FlexAttention (bf16, documents masked) and its
    loss and gradients follow the segment op's eager block (Inductor's Triton kernels)."""
    from compiletune.compiler.activation import parse_ac
    from compiletune.compiler.regions import CompileOptions, compile_regions
    from compiletune.loss.head import LossHead
    from compiletune.models import build_model, from_name

    args = from_name("debug")
    args.n_layers = 2
    torch.manual_seed(0)
    base = build_model(args, seed=0).cuda()
    other = build_model(args, seed=0).cuda()
    hb, ho = LossHead(base.output), LossHead(other.output)
    opts = CompileOptions(loss="plain", ac=parse_ac(ac), dump=True)
    regions = compile_regions(other, ho, opts)
    tokens = torch.randint(0, args.vocab_size, (2, 512), device="cuda")
    targets = torch.randint(0, args.vocab_size, (2, 512), device="cuda")
    doc_ids = doc_ids_for([[100, 412], [300, 12, 200]]).cuda()
    positions = torch.cat([torch.arange(n) for n in (100, 412, 300, 12, 200)]).view(2, 512).cuda()

    def run(model, head, backend):
        monkeypatch.setenv(attn.BACKEND_ENV, backend)
        loss = head(model.hidden_states(tokens, positions, doc_ids), targets)
        loss.backward()
        return [loss.detach(), *(p.grad for p in model.parameters())]

    got, want = run(other, ho, "flex"), run(base, hb, "segments")
    for a, w in zip(got, want, strict=True):
        torch.testing.assert_close(a, w, rtol=2e-3, atol=2e-4)
    counts = {s.name: s.counts for s in regions.backends["block"].records[0].stages}
    assert counts["forward"]["torch.ops.higher_order.flex_attention"] == 1
    assert counts["backward"]["torch.ops.higher_order.flex_attention"] == (ac == "full")


def test_flex_has_no_host_sync(monkeypatch):
    """The flex path runs with CUDA's sync debug mode set to error: no .item()/.tolist()."""
    monkeypatch.setenv(attn.BACKEND_ENV, "flex")
    q, k, v = (torch.randn(2, 4, 512, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    doc_ids = doc_ids_for([[100, 412], [512]]).cuda()
    causal_attention(q, k, v, 0.125, doc_ids, 0, 0.0)  # compile outside the check
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        causal_attention(q, k, v, 0.125, doc_ids, 0, 0.0)
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_offload_ops_on_streams():
    """The side-stream copy to pinned memory survives the source's memory being reused by the
    compute stream, and reloads equal."""
    x = torch.randn(4096, 4096, device="cuda")
    want = x.cpu()
    host = offload_to_host(x)
    assert host.is_pinned()
    del x
    for _ in range(4):  # allocations that would reuse x's block if it were not recorded
        torch.randn(4096, 4096, device="cuda").mul_(3)
    back = reload_from_host(host, torch.device("cuda"))
    torch.testing.assert_close(back.cpu(), want, rtol=0, atol=0)


def _run(tmp_path, data, name, **kw):
    return tiny_run(tmp_path, data, name, **{"seq_len": 128, "batch_size": 4, "max_steps": 8, **kw})


@pytest.mark.parametrize(
    "extra",
    [
        {},
        {"ac": "selective"},
        {"ac": "full"},
        {"offload_activations": True},
        {"ac": "selective", "offload_activations": True},
        {"offload_activations": 1},  # the first block only: two regions, each compiled once
        {"optimizer": "adamw8bit"},
        {"optimizer": "adamw8bit", "optimizer_in_backward": True},
        {"lora_rank": 8},
        {"lora_rank": 8, "quantize_base": "nf4"},
    ],
    ids=lambda e: ",".join(f"{k}={v}" for k, v in e.items()) or "plain",
)
def test_compiled_run_follows_eager(tmp_path, extra):
    """Inductor on CUDA (Triton kernels) for each technique: no recompiles, and the compiled
    run's losses follow the eager run's (fp32 parameters, documents masked)."""
    data = corpus(tmp_path)
    common = {"dtype": "fp32", "loss": "fused", **extra}
    # offloading is a pass of the compile pipeline: its eager reference runs without it
    eager_flags = {k: v for k, v in common.items() if k != "offload_activations"}
    eager = _run(tmp_path, data, "eager", **eager_flags)
    comp = _run(tmp_path, data, "compiled", compile=True, **common)
    assert comp["doc_mask"] is True
    assert comp["compile"]["recompiles"] == 0, comp["compile"]
    losses = {k: (eager[k], comp[k]) for k in ("first_loss", "final_loss")}
    assert comp["first_loss"] == pytest.approx(eager["first_loss"], rel=1e-3), losses
    assert comp["final_loss"] == pytest.approx(eager["final_loss"], rel=2e-2), losses
    assert comp["final_loss"] < comp["first_loss"]


def test_bf16_run_with_dump_graphs(tmp_path):
    """The default GPU dtype through the whole pipeline, graphs dumped per stage."""
    dump = tmp_path / "dump"
    summary = _run(tmp_path, corpus(tmp_path), "bf16", compile=True, dump_graphs=str(dump))
    assert summary["compile"]["recompiles"] == 0
    assert summary["final_loss"] < summary["first_loss"]
    on_disk = json.loads((dump / "summary.json").read_text())
    assert on_disk, "empty graph summary"


def test_one_gpu_nccl_fsdp(tmp_path):
    """`torchrun --nproc-per-node 1 ... --fsdp`: FSDP2 over NCCL on one GPU, end to end."""
    out = tmp_path / "fsdp"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "1"]
    cmd += ["--master-port", str(free_port())]  # tests run side by side (xdist)
    cmd += ["-m", "compiletune", "train", "--fsdp", "--data", corpus(tmp_path)]
    cmd += ["--seq-len", "128", "--batch-size", "4", "--max-steps", "6"]
    cmd += ["--output-dir", str(out)]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["processes"] == 1 and summary["final_loss"] < summary["first_loss"]


@pytest.mark.parametrize("preset", ["debug", "debug_gemma4", "debug_qwen3_5", "debug_gpt_oss"])
@pytest.mark.parametrize("backend", [None, "inductor"])
def test_rollout_cuda_graphs_sample_what_plain_decoding_does(preset, backend, monkeypatch):
    """--rollout-cuda-graphs: the decode step captured once per batch of prompts over its static
    cache and replayed samples the tokens plain decoding samples (fp32, greedy and sampled; 3
    prompts of different lengths; eager and inductor-compiled steps). The compiled dense step is
    captured; a step that cannot be (gpt-oss's experts in fp32 take the exact grouped-matmul
    fallback, which reads its row counts on the host) falls back to plain decoding with the
    same tokens."""
    from compiletune.models import build_model, from_name
    from compiletune.rl import rollout

    monkeypatch.setattr(rollout._GraphedStep, "FAILED", None)
    made = []
    init = rollout._GraphedStep.__init__

    def record(self, *args):
        init(self, *args)
        made.append(self)

    monkeypatch.setattr(rollout._GraphedStep, "__init__", record)
    model = build_model(from_name(preset), device="cuda", seed=0).eval()
    prompts = [list(range(7, 10)), list(range(20, 31)), list(range(40, 46))]
    for temperature in (0.0, 1.0):
        got = [
            rollout.sample_prompts(
                model, prompts, 2, 12, temperature, 1.0, set(),
                [torch.Generator("cuda").manual_seed(i) for i in range(3)],
                compile_backend=backend, cuda_graphs=graphs,
            )
            for graphs in (False, True)
        ]  # fmt: skip
        assert got[1] == got[0] and all(len(c) == 12 for c in got[1])
    assert len(made) == 2
    assert torch.cuda.current_stream() == torch.cuda.default_stream()  # given back, even failed
    if preset == "debug" and backend == "inductor":
        assert all(s.graph is not None for s in made), rollout._GraphedStep.FAILED
    if preset == "debug_gpt_oss":  # fp32 experts: the fallback's host row counts
        assert rollout._GraphedStep.FAILED is not None
