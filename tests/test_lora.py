"""LoRA / QLoRA: NF4 against a float reference, parity with PEFT (both directions), merged export,
compile (one graph, nothing dequantized saved), and LoRA runs in the trainer (resume, --merge)."""

from __future__ import annotations

import copy
import json
import re
import shutil
from pathlib import Path

import pytest
import torch
import transformers
from gloo import free_port, join_gloo
from safetensors.torch import load_file
from tiny_run import tiny_run

from compiletune import adapter_io
from compiletune.cli import main
from compiletune.compile import CompileOptions, compile_regions
from compiletune.config import resolve
from compiletune.loss import LossHead
from compiletune.metrics import read_metrics
from compiletune.models import build_model, from_hf, from_name, save_hf
from compiletune.models.lora import (
    TARGETS,
    FrozenLinear,
    LoRALinear,
    LoRASpec,
    apply_lora,
    parse_targets,
)
from compiletune.models.nf4 import BLOCK, CODE, MAX_ABS_ERROR, dequantize_nf4, quantize_nf4
from compiletune.tokenizer import byte_tokenizer
from compiletune.train.loop import train

peft = pytest.importorskip("peft")

SMALL = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
)
HF_CASES = {
    "llama": (transformers.LlamaConfig, dict(SMALL, rms_norm_eps=1e-5, rope_theta=10000.0)),
    "qwen2_tied": (
        transformers.Qwen2Config,
        dict(SMALL, rms_norm_eps=1e-6, rope_theta=1e6, tie_word_embeddings=True),
    ),
}


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def hf_base(tmp_path: Path, case: str) -> Path:
    """A tiny HF model saved as a base folder (random, seeded)."""
    config_cls, kwargs = HF_CASES[case]
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config_cls(**kwargs))
    path = tmp_path / f"base-{case}"
    model.save_pretrained(path)
    return path


def load_hf(path: Path) -> torch.nn.Module:
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def tokens(b: int = 2, s: int = 16, vocab: int = 128, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, vocab, (b, s), generator=torch.Generator().manual_seed(seed))


def randomize_adapters(model: torch.nn.Module, seed: int = 1) -> None:
    """B starts at zero (the adapted model equals the base); parity tests need non-zero B."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, LoRALinear):
                m.lora_a.copy_(torch.randn(m.lora_a.shape, generator=g) * 0.1)
                m.lora_b.copy_(torch.randn(m.lora_b.shape, generator=g) * 0.1)


# --- NF4 --------------------------------------------------------------------------------------


def nf4_reference(w: torch.Tensor) -> torch.Tensor:
    """Round trip by brute force: nearest of the 16 codes to w / blockwise absmax, in fp64."""
    out, cols = w.shape
    blocks = w.double().view(out, cols // BLOCK, BLOCK)
    scale = blocks.abs().amax(-1, keepdim=True)
    x = blocks / scale.clamp_min(1e-300)
    code = torch.tensor(CODE, dtype=torch.float64)
    nearest = code[(x[..., None] - code).abs().argmin(-1)]
    return (nearest * scale).view(out, cols)


def test_nf4_round_trip_within_the_format_bound():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(48, 256, generator=g) * 0.02
    w[3, 17] = 0.5  # an outlier coarsens only its own block
    w[5, :BLOCK] = 0.0  # an all-zero block
    codes, scales = quantize_nf4(w)
    assert codes.dtype == torch.uint8 and codes.shape == (48, 128)
    assert scales.dtype == torch.float32 and scales.shape == (48, 256 // BLOCK)
    back = dequantize_nf4(codes, scales, torch.float32)
    err = (back - w).abs().view(48, -1, BLOCK)
    bound = MAX_ABS_ERROR * scales[..., None] * (1 + 1e-6)
    assert bool((err <= bound).all())
    assert abs(MAX_ABS_ERROR - 0.1519) < 1e-4  # half the gap between -1 and -0.696
    torch.testing.assert_close(back.double(), nf4_reference(w), rtol=1e-6, atol=1e-9)
    assert back[5, :BLOCK].eq(0).all()
    # Code values times the block's absmax come back exactly.
    exact = torch.tensor(CODE).repeat(8).view(2, 64) * 0.37
    torch.testing.assert_close(dequantize_nf4(*quantize_nf4(exact), torch.float32), exact)
    # Mean relative error on normal weights: what 4 bits buy (a sanity range, not a bound).
    assert 0.02 < float((back - w).norm() / w.norm()) < 0.15
    assert dequantize_nf4(codes, scales, torch.bfloat16).dtype == torch.bfloat16


@pytest.mark.parametrize("stored", ["nf4", "bf16"])
def test_frozen_linear_matches_float_reference(stored):
    """Forward and backward of a LoRA projection whose base is NF4 / bf16, against fp32 math on
    the same (rounded) base weight."""
    g = torch.Generator().manual_seed(0)
    linear = torch.nn.Linear(128, 64, bias=True)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(64, 128, generator=g) * 0.05)
    spec = LoRASpec(rank=4, alpha=8.0)
    layer = LoRALinear(
        copy.deepcopy(linear),
        spec,
        base_dtype=torch.bfloat16 if stored == "bf16" else torch.float32,
        quantize="nf4" if stored == "nf4" else None,
        dtype=torch.float32,
        generator=g,
    )
    with torch.no_grad():
        layer.lora_b.normal_(0, 0.1, generator=g)
    w_ref = (
        dequantize_nf4(*quantize_nf4(linear.weight), torch.float32)
        if stored == "nf4"
        else linear.weight.detach().bfloat16().float()
    )
    a_ref = layer.lora_a.detach().clone().requires_grad_()
    b_ref = layer.lora_b.detach().clone().requires_grad_()
    x = torch.randn(3, 5, 128, generator=g, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    y = layer(x)
    y_ref = x_ref @ w_ref.T + linear.bias.detach() + spec.scale * (x_ref @ a_ref.T) @ b_ref.T
    assert rel_err(y, y_ref) <= 1e-5
    grad = torch.randn(y.shape, generator=g)
    y.backward(grad)
    y_ref.backward(grad)
    assert rel_err(x.grad, x_ref.grad) <= 1e-5
    assert rel_err(layer.lora_a.grad, a_ref.grad) <= 1e-5
    assert rel_err(layer.lora_b.grad, b_ref.grad) <= 1e-5
    frozen = [n for n, p in layer.named_parameters() if not p.requires_grad]
    if stored == "nf4":
        assert set(frozen) == {"weight_codes", "weight_scales", "bias"} and layer.weight is None
    else:
        assert set(frozen) == {"weight", "bias"} and layer.weight.dtype == torch.bfloat16


def test_parse_targets():
    assert parse_targets("all-linear") == tuple(TARGETS)
    assert parse_targets("v, q,down") == ("q", "v", "down")
    with pytest.raises(ValueError, match="'x'"):
        parse_targets("q,x")


# --- PEFT parity --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "case, targets",
    [("llama", ["q_proj", "v_proj", "down_proj"]), ("qwen2_tied", "all-linear")],
)
def test_peft_adapter_loads_and_gives_peft_logits(tmp_path, case, targets):
    """PEFT makes and saves an adapter; compiletune reads it onto its own model: same logits."""
    base = hf_base(tmp_path, case)
    torch.manual_seed(1)
    peft_model = peft.get_peft_model(
        load_hf(base),
        # init_lora_weights=False: random B, so the adapter changes the logits.
        peft.LoraConfig(
            r=4, lora_alpha=12, target_modules=targets, init_lora_weights=False, lora_dropout=0.0
        ),
    ).eval()
    peft_model.save_pretrained(tmp_path / "adapter")
    spec = adapter_io.read_adapter_spec(tmp_path / "adapter")
    assert spec.rank == 4 and spec.scale == 3.0
    model = apply_lora(from_hf(base), spec, dtype=torch.float32).eval()
    adapter_io.load_adapter(model, tmp_path / "adapter")
    t = tokens()
    with torch.no_grad():
        ours, theirs, plain = model(t), peft_model(t).logits, load_hf(base)(t).logits
    assert rel_err(ours, theirs) <= 1e-5
    assert rel_err(plain, theirs) > 1e-3  # the adapter matters


@pytest.mark.parametrize("case", ["llama", "qwen2_tied"])
def test_exported_adapter_loads_in_peft_and_merged_equals_base_plus_adapter(tmp_path, case):
    base = hf_base(tmp_path, case)
    spec = LoRASpec(rank=4, alpha=8.0, targets=("q", "k", "o", "gate", "up"))
    model = apply_lora(from_hf(base), spec, dtype=torch.float32, seed=3).eval()
    randomize_adapters(model)
    adapter_io.save_adapter(model, tmp_path / "adapter", base_model=str(base))
    config = json.loads((tmp_path / "adapter" / adapter_io.ADAPTER_CONFIG).read_text())
    assert config["target_modules"] == ["gate_proj", "k_proj", "o_proj", "q_proj", "up_proj"]
    t = tokens(seed=2)
    with torch.no_grad():
        ours = model(t)
        loaded = peft.PeftModel.from_pretrained(load_hf(base), tmp_path / "adapter").eval()
        assert rel_err(loaded(t).logits, ours) <= 1e-5
        # Merged: a plain HF folder, no adapter files; W' = W + alpha / r * B A.
        adapter_io.save_merged(model, tmp_path / "merged")
        assert not (tmp_path / "merged" / adapter_io.ADAPTER_CONFIG).exists()
        merged = load_hf(tmp_path / "merged")
        assert rel_err(merged(t).logits, ours) <= 1e-5
    weights = load_file(tmp_path / "merged" / "model.safetensors")
    base_weights = load_file(base / "model.safetensors")
    wq = model.layers[1].attention.wq
    expected = base_weights["model.layers.1.self_attn.q_proj.weight"] + 2.0 * (
        wq.lora_b.detach() @ wq.lora_a.detach()
    )
    torch.testing.assert_close(weights["model.layers.1.self_attn.q_proj.weight"], expected)
    # Projections without an adapter are the base's, bit for bit.
    name = "model.layers.0.self_attn.v_proj.weight"
    assert torch.equal(weights[name], base_weights[name])


def test_qlora_merged_is_dequantized_base_plus_adapter(tmp_path):
    args = tiny_args()
    model = build_model(args, seed=4)
    reference = copy.deepcopy(model)
    apply_lora(
        model, LoRASpec(rank=2, alpha=2.0, targets=("v",)), dtype=torch.float32, quantize="nf4"
    )
    randomize_adapters(model)
    save_hf(model, tmp_path / "merged", merge_lora=True)
    weights = load_file(tmp_path / "merged" / "model.safetensors")
    w = reference.layers[0].attention.wv.weight.detach()
    wv = model.layers[0].attention.wv
    expected = (
        dequantize_nf4(*quantize_nf4(w), torch.float32) + wv.lora_b.detach() @ wv.lora_a.detach()
    )
    torch.testing.assert_close(weights["model.layers.0.self_attn.v_proj.weight"], expected)
    assert torch.equal(
        weights["model.embed_tokens.weight"], reference.tok_embeddings.weight.detach()
    )


# --- compile ------------------------------------------------------------------------------------


def tiny_args(layers: int = 3):
    args = from_name("debug")
    args.n_layers, args.dim, args.ffn_dim, args.n_heads, args.n_kv_heads = layers, 64, 128, 4, 2
    args.vocab_size = 300
    return args


def test_compiled_qlora_matches_eager_with_one_graph_and_no_dequantized_weight_saved():
    model = build_model(tiny_args(), seed=5)
    apply_lora(
        model,
        LoRASpec(rank=4, alpha=8.0),
        dtype=torch.float32,
        base_dtype=torch.bfloat16,
        quantize="nf4",
    )
    randomize_adapters(model)
    compiled = copy.deepcopy(model)
    head_e, head_c = LossHead(model.output, "plain"), LossHead(compiled.output, "plain")
    regions = compile_regions(
        compiled, head_c, CompileOptions(backend="aot_eager", loss="plain", dump=True)
    )
    t = tokens(s=24, vocab=300, seed=6)
    targets = tokens(s=24, vocab=300, seed=7)
    losses, grads = [], []
    for m, head in ((model, head_e), (compiled, head_c)):
        loss = head(m.hidden_states(t), targets)
        loss.backward()
        losses.append(loss.detach())
        grads.append({n: p.grad for n, p in m.named_parameters() if p.requires_grad})
    assert rel_err(losses[1], losses[0]) <= 1e-5
    assert grads[0].keys() == grads[1].keys() and len(grads[0]) == 3 * 7 * 2
    for name in grads[0]:
        assert rel_err(grads[1][name], grads[0][name]) <= 1e-4, name
    stats = regions.stats()
    assert stats["regions"]["block"]["compiles"] == 1 and stats["recompiles"] == 0
    # What a block keeps for backward: the NF4 codes (inputs), never a rebuilt [out, in] weight.
    (record,) = regions.backends["block"].records
    frozen = [m for m in compiled.modules() if isinstance(m, FrozenLinear)]
    weight_shapes = {(m.out_features, m.in_features) for m in frozen}
    weight_shapes |= {(i, o) for o, i in weight_shapes}  # the partitioner may save W^T
    rebuilt = [s for s in record.saved if not s["is_input"] and tuple(s["shape"]) in weight_shapes]
    assert not rebuilt, rebuilt


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
    assert "holds full weights, not a LoRA adapter" in capsys.readouterr().err


# --- FSDP2 (the sharded LoRA run itself comes with the trainer's --fsdp) -------------------------


def _qlora_for_fsdp() -> torch.nn.Module:
    args = tiny_args(2)
    args.dim, args.ffn_dim = 128, 256
    model = build_model(args, seed=1)
    spec = LoRASpec(rank=4, alpha=8.0)
    apply_lora(model, spec, dtype=torch.float32, base_dtype=torch.bfloat16, quantize="nf4")
    randomize_adapters(model)
    return model


def _fsdp_worker(rank: int, world: int, port: int, out: str) -> None:

    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    torch.set_num_threads(1)
    join_gloo(rank, world, port)
    try:
        model = _qlora_for_fsdp()
        head = LossHead(model.output, "plain")
        # One unit per block: its NF4 codes (uint8), scales and adapters (fp32) together.
        for module in [model.tok_embeddings, *model.layers, model.norm, head]:
            fully_shard(module)
        t = tokens(vocab=300, seed=3)
        loss = head(model.hidden_states(t), t)
        loss.backward()
        grads = {n: p.grad.full_tensor() for n, p in model.named_parameters() if p.requires_grad}
        wq = model.layers[0].attention.wq
        kinds = {n: type(p).__name__ for n, p in wq.named_parameters()}
        if rank == 0:
            torch.save((loss.detach(), grads, kinds), out)
        # Every rank's queued collectives (FSDP's asynchronous reduce-scatters) finish before the
        # group is torn down: destroying gloo with work in flight aborts the process.
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_fsdp2_shards_frozen_nf4_and_adapters_in_one_unit(tmp_path):
    import torch.multiprocessing as mp

    port = free_port()
    out = str(tmp_path / "rank0.pt")
    mp.start_processes(_fsdp_worker, args=(2, port, out), nprocs=2, start_method="spawn")
    loss, grads, kinds = torch.load(out)
    assert set(kinds.values()) == {"DTensor"} and {"weight_codes", "lora_a"} <= kinds.keys()
    model = _qlora_for_fsdp()
    t = tokens(vocab=300, seed=3)
    ref = LossHead(model.output, "plain")(model.hidden_states(t), t)
    ref.backward()
    assert rel_err(loss, ref) <= 1e-5
    for name, p in model.named_parameters():
        if p.requires_grad:
            assert rel_err(grads[name], p.grad) <= 1e-5, name


# --- the trainer under FSDP2 (2 processes, gloo) -------------------------------------------------


def _fsdp_runs(tmp: str, corpus: str, model_dir: str) -> dict[str, dict]:
    """name -> flags of the 2-rank run (the single-process reference has batch_size 4)."""
    common = {"data": corpus, "seq_len": 32, "batch_size": 2, "lora_rank": 4, "lr": 3e-3}
    return {
        "lora": {**common, "model_dir": model_dir, "max_steps": 4, "save_every": 2, "merge": True},
        "qlora": {**common, "n_layers": 2, "quantize_base": "nf4", "max_steps": 3},
        "bf16-base": {**common, "n_layers": 2, "base_dtype": "bf16", "max_steps": 2},
    }


def _lora_fsdp_worker(rank: int, port: int, tmp: str, corpus: str, model_dir: str) -> None:

    import torch.distributed as dist

    torch.set_num_threads(1)
    join_gloo(rank, 2, port)
    try:
        runs = _fsdp_runs(tmp, corpus, model_dir)
        for name, flags in runs.items():
            train(resolve({}, {**flags, "fsdp": True, "output_dir": f"{tmp}/fsdp-{name}"}))
        # A run that died after step 2, resumed from its sharded LoRA checkpoint.
        part = Path(tmp) / "part"
        if rank == 0:
            part.mkdir()
            shutil.copytree(Path(tmp) / "fsdp-lora" / "step_2", part / "step_2")
            rows = read_metrics(Path(tmp) / "fsdp-lora" / "metrics.jsonl")[:2]
            (part / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        dist.barrier()
        train(resolve({}, {**runs["lora"], "fsdp": True, "resume": True, "output_dir": str(part)}))
    finally:
        dist.destroy_process_group()


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
