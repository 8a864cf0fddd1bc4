"""LoRA / QLoRA modules: NF4 against a float reference, parity with PEFT (both directions),
merged export, compile (one graph, nothing dequantized saved), FSDP2 sharding of the modules.
LoRA runs of the trainer are tests/integration/test_lora_runs.py."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from gloo import free_port, run_in_gloo
from lora_cases import hf_base, load_hf, randomize_adapters, rel_err, tiny_args, tokens
from safetensors.torch import load_file

from compiletune.checkpoint import adapter_io
from compiletune.compiler.regions import CompileOptions, compile_regions
from compiletune.errors import UserError
from compiletune.loss.head import LossHead
from compiletune.models import build_model, from_hf, from_name, save_hf
from compiletune.models.lora import (
    FrozenLinear,
    LoRALinear,
    LoRASpec,
    apply_lora,
    model_targets,
    parse_targets,
)
from compiletune.models.nf4 import BLOCK, CODE, MAX_ABS_ERROR, dequantize_nf4, quantize_nf4

peft = pytest.importorskip("peft")


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
    seven = ("q", "k", "v", "o", "gate", "up", "down")
    linear = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj")
    latent = ("q_a", "q_b", "kv_a", "kv_b")
    assert parse_targets("all-linear") == seven + linear + ("in_proj_qkvz", "in_proj_ba") + latent
    # what a model has of them: a Llama no linear-attention projections, Qwen3.5 both kinds
    assert model_targets(from_name("debug"), parse_targets("all-linear")) == seven
    assert model_targets(from_name("debug_qwen3_5"), parse_targets("all-linear")) == seven + linear
    with pytest.raises(UserError, match="none of these projections"):
        model_targets(from_name("debug"), ("in_proj_z", "out_proj"))
    assert parse_targets("v, q,down") == ("q", "v", "down")
    with pytest.raises(ValueError, match="'x'"):
        parse_targets("q,x")
    with pytest.raises(ValueError, match="'qkv'"):  # fused projections are named by their parts
        parse_targets("qkv,o")


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


def test_qlora_gemma4_merged_export_loads_in_transformers(tmp_path):
    """Gemma 4 under QLoRA: the per-layer inputs stay frozen, the blocks' per-layer projections
    are frozen (NF4 where their width divides), and the merged export is a transformers
    Gemma 4 that computes what the QLoRA model computes."""
    transformers = pytest.importorskip("transformers")
    model = build_model(from_name("debug_gemma4"), seed=4)
    spec = LoRASpec(rank=2, alpha=2.0)
    apply_lora(model, spec, dtype=torch.float32, quantize="nf4")
    randomize_adapters(model)
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    assert model.layers[0].per_layer.gate.quantized  # 256 wide: NF4
    assert not model.layers[0].per_layer.up.quantized  # 32 wide: kept in the base dtype
    save_hf(model, tmp_path / "merged", merge_lora=True)
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "merged", dtype=torch.float32, attn_implementation="eager"
    ).eval()
    t = torch.randint(0, 512, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert rel_err(hf(t).logits, model(t)) <= 1e-4


# --- compile ------------------------------------------------------------------------------------


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
    from torch.distributed.fsdp import fully_shard

    from compiletune.torch_internals import fsdp_allow_integer_params

    torch.set_num_threads(1)

    def body() -> None:
        model = _qlora_for_fsdp()
        head = LossHead(model.output, "plain")
        # One unit per block: its NF4 codes (uint8), scales and adapters (fp32) together.
        fsdp_allow_integer_params()  # as apply_fsdp does (torch 2.11)
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

    run_in_gloo(rank, world, port, body)


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
