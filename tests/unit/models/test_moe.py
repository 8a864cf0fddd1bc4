"""Mixture of experts: Qwen3-MoE and Mixtral against transformers, the grouped matmul against a
per-expert loop, compiled against eager, and LoRA on experts against peft."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
import transformers
from safetensors import safe_open

from compiletune.compiler.regions import CompileOptions, compile_regions
from compiletune.errors import UserError
from compiletune.loss.head import LossHead
from compiletune.models import args_from_hf_config, from_hf, save_hf
from compiletune.models.moe import MoE, router_losses, update_score_bias
from compiletune.ops.grouped_mm import grouped_mm

VOCAB = 96
SMALL = dict(
    vocab_size=VOCAB,
    hidden_size=48,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    num_experts_per_tok=2,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)
CASES = {
    # 6 experts, top-2 renormalised, layer 1 dense (mlp_only_layers), head_dim 16 != 48 / 4
    "qwen3_moe": (
        transformers.Qwen3MoeConfig,
        dict(
            SMALL,
            intermediate_size=80,
            moe_intermediate_size=32,
            num_experts=6,
            norm_topk_prob=True,
            mlp_only_layers=[1],
            head_dim=16,
            router_aux_loss_coef=0.05,
        ),
    ),
    # Qwen3-MoE's default: top-k weights not renormalised
    "qwen3_moe_unnormed": (
        transformers.Qwen3MoeConfig,
        dict(SMALL, intermediate_size=80, moe_intermediate_size=32, num_experts=4),
    ),
    "mixtral": (
        transformers.MixtralConfig,
        dict(SMALL, intermediate_size=40, num_local_experts=5, router_aux_loss_coef=0.02),
    ),
}


def make_hf(case: str, seed: int = 0) -> transformers.PreTrainedModel:
    config_cls, kwargs = CASES[case]
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(
        config_cls(**kwargs), attn_implementation="eager"
    )
    with torch.no_grad():  # non-trivial norms; a router that prefers some experts
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
            elif name.endswith("gate.weight"):
                p.normal_(0.0, 0.3)
    return model.eval()


def checkpoint(tmp_path, case: str):
    hf = make_hf(case)
    folder = tmp_path / f"hf-{case}"
    hf.save_pretrained(folder)
    return hf, folder


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def tokens(seq: int, seed: int = 1, rows: int = 2) -> torch.Tensor:
    return torch.randint(3, VOCAB, (rows, seq), generator=torch.Generator().manual_seed(seed))


def our_loss(model, t: torch.Tensor, coef: float) -> torch.Tensor:
    """Mean next-token CE + coef * load-balancing loss: what transformers' loss is."""
    stats: list[torch.Tensor] = []
    h = model.hidden_states(t, router_stats=stats)
    logits = model.logits(h)
    ce = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), t[:, 1:].flatten())
    aux, _ = router_losses(stats, model.args.n_experts)
    return ce + coef * aux


@pytest.mark.parametrize("case", sorted(CASES))
def test_logits_loss_aux_and_gradients_equal_transformers(case, tmp_path):
    hf, folder = checkpoint(tmp_path, case)
    ours = from_hf(folder)
    args = ours.args
    assert args.n_experts == hf.config.num_experts if "qwen" in case else args.n_experts == 5
    if case == "qwen3_moe":
        assert args.dense_layers == (1,) and not ours.layers[1].moe and ours.layers[2].moe
    coef = hf.config.router_aux_loss_coef
    t = tokens(24)
    hf.train()  # gradients of the same function; dropout is 0 and jitter off
    out = hf(t, labels=t, output_router_logits=True)
    out.loss.backward()
    loss = our_loss(ours, t, coef)
    loss.backward()
    assert rel(ours(t), out.logits) <= 1e-5
    assert rel(loss, out.loss) <= 1e-5, (loss.item(), out.loss.item())
    # the aux loss is on: removing it changes the loss by coef * aux
    assert abs(out.aux_loss.item() * coef) > 1e-4
    hf_grads = dict(hf.named_parameters())
    ours_hf = {}
    from compiletune.models.hf_names import hf_pieces

    for name, p in ours.named_parameters():
        for hf_name, index, _ in hf_pieces(name, tuple(p.shape), args.family):
            ours_hf[hf_name] = p.grad[index]
    checked = 0
    for name, p in hf_grads.items():
        if name.endswith("experts.gate_up_proj"):  # transformers' in-memory layout
            base = name.removesuffix("gate_up_proj")
            names = ("gate_proj", "up_proj") if "qwen" in case else ("w1", "w3")
            prefix = base if "qwen" in case else base.replace(".mlp.", ".block_sparse_moe.")
            for e in range(p.shape[0]):
                got = torch.cat([ours_hf[f"{prefix}{e}.{n}.weight"] for n in names])
                assert rel(got, p.grad[e]) <= 1e-5, (name, e)
        elif name.endswith("experts.down_proj"):
            base = name.removesuffix("down_proj")
            n = "down_proj" if "qwen" in case else "w2"
            prefix = base if "qwen" in case else base.replace(".mlp.", ".block_sparse_moe.")
            for e in range(p.shape[0]):
                assert rel(ours_hf[f"{prefix}{e}.{n}.weight"], p.grad[e]) <= 1e-5, (name, e)
        else:
            key = name if "qwen" in case else name.replace(".mlp.gate.", ".block_sparse_moe.gate.")
            assert rel(ours_hf[key], p.grad) <= 1e-5, name
        checked += 1
    assert checked == len(hf_grads)


@pytest.mark.parametrize("case", ["qwen3_moe", "mixtral"])
def test_save_writes_the_hub_layout_and_transformers_reloads_it(case, tmp_path):
    hf, folder = checkpoint(tmp_path, case)
    ours = from_hf(folder)
    save_hf(ours, tmp_path / "ours")
    with safe_open(str(tmp_path / "ours" / "model.safetensors"), "pt") as f:
        names = set(f.keys())  # noqa: SIM118
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        assert names == set(f.keys())  # noqa: SIM118
    expert = "mlp.experts.3.up_proj" if "qwen" in case else "block_sparse_moe.experts.3.w3"
    assert f"model.layers.0.{expert}.weight" in names
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "ours", dtype=torch.float32, attn_implementation="eager"
    ).eval()
    assert type(reloaded) is type(hf)
    t = tokens(20)
    with torch.no_grad():
        assert rel(reloaded(t).logits, hf(t).logits) <= 1e-6
    assert from_hf(tmp_path / "ours").args == ours.args
    config = json.loads((tmp_path / "ours" / "config.json").read_text())
    assert config["router_aux_loss_coef"] == hf.config.router_aux_loss_coef


def test_grouped_mm_equals_a_per_expert_loop_with_empty_experts():
    g = torch.Generator().manual_seed(0)
    counts = [5, 0, 9, 0, 2, 0]  # empty experts first, middle and last
    n, k, m = sum(counts) + 3, 7, 5  # 3 trailing rows belong to no expert: zeros
    x = torch.randn(n, k, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(len(counts), k, m, generator=g, dtype=torch.float64, requires_grad=True)
    offs = torch.tensor(counts).cumsum(0).to(torch.int32)
    got = grouped_mm(x, w, offs)
    ref, start = [], 0
    for e, c in enumerate(counts):
        ref.append(x[start : start + c] @ w[e])
        start += c
    ref.append(x.new_zeros(3, m))
    ref = torch.cat(ref)
    assert torch.equal(got, ref)
    up = torch.randn(n, m, generator=g, dtype=torch.float64)
    (got * up).sum().backward()
    gx, gw = x.grad.clone(), w.grad.clone()
    x.grad = w.grad = None
    (ref * up).sum().backward()
    assert torch.allclose(gx, x.grad) and torch.allclose(gw, w.grad)
    assert torch.equal(gw[1], torch.zeros_like(gw[1]))  # no rows: no gradient
    torch.library.opcheck(torch.ops.compiletune.grouped_mm.default, (x.detach(), w.detach(), offs))


def _moe_block(seed: int = 0) -> MoE:
    torch.manual_seed(seed)
    block = MoE(dim=16, ffn_dim=24, n_experts=8, top_k=2, norm_topk=True)
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, 0.5)
    return block


def test_moe_block_compiles_once_across_routings_and_equals_eager():
    block = _moe_block()
    inputs = [torch.randn(2, 12, 16, generator=torch.Generator().manual_seed(s)) for s in range(5)]
    inputs[3] = inputs[3] * 0 + inputs[3][:, :1]  # every token the same: two experts get all

    def run(fn, x):
        block.zero_grad()
        y, stats = fn(x)
        (y.square().sum() + stats[8:16].sum()).backward()
        return y.detach(), stats.detach(), [p.grad.clone() for p in block.parameters()]

    eager = [run(block, x) for x in inputs]
    loads = {tuple(stats[:8].tolist()) for _, stats, _ in eager}
    assert len(loads) == 5  # five different routings
    assert min(eager[3][1][:8]) == 0  # and some experts got no token at all
    from compiletune.compiler.backend import CompiletuneBackend

    backend = CompiletuneBackend("block", [], mode="inductor")
    compiled = torch.compile(block, backend=backend, fullgraph=True, dynamic=False)
    for x, (y, stats, grads) in zip(inputs, eager, strict=True):
        cy, cstats, cgrads = run(compiled, x)
        assert rel(cy, y) <= 1e-5 and torch.equal(cstats[:8], stats[:8])
        assert all(rel(a, b) <= 1e-5 for a, b in zip(cgrads, grads, strict=True))
    assert backend.compiles == 1


def test_compiled_model_equals_eager_one_graph_per_block_kind(tmp_path):
    _, folder = checkpoint(tmp_path, "qwen3_moe")
    model = from_hf(folder)
    head = LossHead(model.output, "plain", None)

    def loss_and_grads(t):
        model.zero_grad()
        stats: list[torch.Tensor] = []
        loss = head(model.hidden_states(t[:, :-1], router_stats=stats), t[:, 1:])
        loss = loss + router_losses(stats, model.args.n_experts)[0]
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in model.parameters()]

    batches = [tokens(33, seed=s) for s in range(3)]
    eager = [loss_and_grads(t) for t in batches]
    regions = compile_regions(model, head, CompileOptions(backend="aot_eager", loss="fused"))
    for t, (want_loss, want_grads) in zip(batches, eager, strict=True):
        loss, grads = loss_and_grads(t)
        assert rel(loss, want_loss) <= 1e-5
        assert all(rel(g, w) <= 1e-4 for g, w in zip(grads, want_grads, strict=True))
    stats = regions.stats()
    blocks = sorted(k for k in stats["regions"] if k.startswith("block"))
    assert blocks == ["block", "block.dense"] and stats["recompiles"] == 0, stats


def test_router_losses_match_their_formulas():
    e = 4
    logits = torch.randn(2, 10, e, dtype=torch.float64)
    probs = logits.softmax(-1)
    chosen = probs.topk(2, dim=-1).indices
    tokens_ = torch.stack([F.one_hot(c, e).sum((0, 1)) for c in chosen]).double()
    stats = [
        torch.cat(
            [
                tokens_[i],
                probs[i].sum(0),
                logits[i].logsumexp(-1).square().sum()[None],
                torch.tensor([10.0], dtype=torch.float64),
            ]
        )
        for i in range(2)
    ]
    aux, z = router_losses(stats, e)
    n = 20
    want_aux = e * ((tokens_.sum(0) / n) * (probs.sum((0, 1)) / n)).sum()
    assert torch.allclose(aux, want_aux)
    assert torch.allclose(z, logits.logsumexp(-1).square().mean())


def test_moe_config_errors_name_the_field():
    cfg = transformers.MixtralConfig(**CASES["mixtral"][1], router_jitter_noise=0.1).to_dict()
    cfg["architectures"] = ["MixtralForCausalLM"]
    with pytest.raises(UserError, match="router_jitter_noise"):
        args_from_hf_config(cfg)
    cfg = transformers.LlamaConfig(hidden_size=32, num_attention_heads=4).to_dict()
    cfg.update(architectures=["LlamaForCausalLM"], num_local_experts=4)
    with pytest.raises(UserError, match="num_local_experts"):
        args_from_hf_config(cfg)


@pytest.mark.parametrize(
    "case, targets",
    [
        ("qwen3_moe", ("q", "k", "v", "o", "gate", "up", "down")),
        ("mixtral", ("q", "v", "down")),
        ("mixtral", ("o", "gate", "up")),
    ],
)
def test_lora_on_experts_loads_in_peft_and_merges(case, targets, tmp_path):
    from compiletune.checkpoint import adapter_io
    from compiletune.models.lora import LoRASpec, apply_lora

    peft = pytest.importorskip("peft")
    hf, folder = checkpoint(tmp_path, case)
    spec = LoRASpec(rank=3, alpha=6.0, targets=targets)
    model = apply_lora(from_hf(folder), spec, dtype=torch.float32, seed=3).eval()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    adapter_io.save_adapter(model, tmp_path / "adapter", base_model=str(folder))
    config = json.loads((tmp_path / "adapter" / adapter_io.ADAPTER_CONFIG).read_text())
    expert = {"gate": "mlp.experts.gate_up_proj", "down": "mlp.experts.down_proj"}
    assert config["target_parameters"] == sorted(v for k, v in expert.items() if k in targets)
    t = tokens(20)
    with torch.no_grad():
        ours = model(t)
        base = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
        loaded = peft.PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
        assert rel(loaded(t).logits, ours) <= 1e-5
        assert rel(hf(t).logits, ours) > 1e-3  # the adapters do change the model
        adapter_io.save_merged(model, tmp_path / "merged")
        merged = transformers.AutoModelForCausalLM.from_pretrained(
            tmp_path / "merged", dtype=torch.float32
        )
        assert rel(merged(t).logits, ours) <= 1e-5
    # the folder reads back as the same spec and the same weights
    assert adapter_io.read_adapter_spec(tmp_path / "adapter").targets == spec.targets
    again = apply_lora(from_hf(folder), spec, dtype=torch.float32, seed=9).eval()
    adapter_io.load_adapter(again, tmp_path / "adapter")
    with torch.no_grad():
        assert torch.equal(again(t), ours)


def test_qlora_experts_are_nf4_and_train(tmp_path):
    from compiletune.models import build_model, from_name
    from compiletune.models.lora import FrozenExperts, LoRASpec, apply_lora, dense_tensors
    from compiletune.models.names import strip_wrappers

    args = from_name("debug_moe")
    args.n_layers, args.vocab_size = 2, 128
    model = build_model(args, seed=0)
    t = tokens(16)
    with torch.no_grad():
        dense = model(t)
    spec = LoRASpec(rank=4, alpha=8.0)
    apply_lora(model, spec, dtype=torch.float32, quantize="nf4", seed=0)
    experts = model.layers[0].feed_forward.experts
    assert isinstance(experts, FrozenExperts) and experts.quantized
    assert experts.w13_codes.dtype == torch.uint8 and experts.w13 is None
    # adapters start at zero: the model is the plain one with its weights rounded to NF4
    plain = build_model(args, seed=1)
    with torch.no_grad():
        rounded = {name: make() for name, _, make in dense_tensors(model)}
        plain.load_state_dict({strip_wrappers(k): v for k, v in rounded.items()})
        assert rel(model(t), plain(t)) <= 1e-5
        assert 0.01 < rel(model(t), dense) < 0.5  # NF4 rounding shows, and no more than that
    head = LossHead(model.output, "plain", None)
    stats: list[torch.Tensor] = []
    loss = head(model.hidden_states(t[:, :-1], router_stats=stats), t[:, 1:])
    (loss + router_losses(stats, args.n_experts)[0]).backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    assert any("lora_a_w13" in n for n in grads) and all(g is not None for g in grads.values())
    assert not model.layers[0].feed_forward.router.weight.requires_grad


@pytest.mark.parametrize("case", ["qwen3_moe", "mixtral"])
def test_greedy_generate_equals_transformers(case, tmp_path):
    from compiletune.generate import generate_ids

    hf, folder = checkpoint(tmp_path, case)
    prompt = tokens(6, seed=5)[0].tolist()
    want = hf.generate(
        torch.tensor([prompt]),
        attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        max_new_tokens=20,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
    )[0, len(prompt) :].tolist()
    assert list(generate_ids(from_hf(folder).eval(), prompt, 20)) == want


def test_score_bias_update_steps_towards_balance_in_fp32():
    """Auxiliary-loss-free balancing: underloaded experts' biases go up by the rate, overloaded
    ones down, an expert at the mean stays; a bf16 bias keeps steps far below its precision
    (an fp32 copy accumulates them)."""
    moe = MoE(16, 8, 4, 2, True, score="sigmoid").to(torch.bfloat16)
    moe.score_bias.data.fill_(1.0)
    load = torch.tensor([[0.0, 2.0, 6.0, 0.0]])  # mean 2
    for _ in range(10):
        assert update_score_bias(moe, load, 1e-3) == 1
    want = torch.tensor([1.01, 1.0, 0.99, 1.01])
    assert torch.equal(moe.score_bias, want.to(torch.bfloat16))  # not 1.0: no step was lost
    assert torch.allclose(moe._score_bias_fp32, want, atol=1e-6)
    with pytest.raises(ValueError, match="routers"):
        update_score_bias(moe, torch.zeros(2, 4), 1e-3)
