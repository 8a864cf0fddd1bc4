"""Qwen3, Gemma 2, Gemma 3, Phi-3, sliding-window Mistral, SmolLM3, OLMo 3 and rope types, each
against transformers.

Every case is a tiny transformers model built from a config (non-trivial norms and biases) whose
mechanisms matter at the test length: windows shorter than the sequence, soft-caps small enough
to bite, longrope's long factors past a short original context, head_dim != hidden / heads.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
import transformers

from compiletune.checkpoint import adapter_io
from compiletune.cli import main
from compiletune.compiler.regions import CompileOptions, compile_regions
from compiletune.errors import UserError
from compiletune.generate import generate_ids
from compiletune.loss.head import LossHead
from compiletune.models import args_from_hf_config, from_hf, save_hf
from compiletune.models.lora import LoRASpec, apply_lora, model_targets, parse_targets

peft = pytest.importorskip("peft")

VOCAB = 128
SMALL = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)
GEMMA = dict(SMALL, num_hidden_layers=4, head_dim=16, sliding_window=8, query_pre_attn_scalar=24)
# Gated DeltaNet on three layers of four (4 value heads over 2 key heads) and the experts of
# the MoE ones (8, 2 per token, a shared one)
LINEAR = dict(SMALL, num_hidden_layers=4, head_dim=16, linear_num_key_heads=2)
LINEAR |= dict(linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=12)
EXPERTS = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32)
EXPERTS |= dict(shared_expert_intermediate_size=48)
# Gemma 4: sliding layers (window 8, head dim 16) and full ones (head dim 32, a quarter of
# their frequency pairs rotating), values normed, a final soft-cap
GEMMA4 = dict(SMALL, num_hidden_layers=6, head_dim=16, global_head_dim=32, sliding_window=8)
GEMMA4 |= dict(final_logit_softcapping=3.0, layer_types=["sliding_attention"] * 2)
GEMMA4 |= dict(hidden_size_per_layer_input=0)  # (transformers' default: 256 x 262144 per layer)
GEMMA4["layer_types"] += ["full_attention", "sliding_attention", "sliding_attention"]
GEMMA4["layer_types"] += ["full_attention"]

CASES = {
    # q/k norms, head_dim 32 != 64 / 4, tied embeddings
    "qwen3": (transformers.Qwen3Config, dict(SMALL, head_dim=32, tie_word_embeddings=True)),
    # yarn long-context scaling (Qwen2.5/Qwen3 configs)
    "qwen3_yarn": (
        transformers.Qwen3Config,
        dict(
            SMALL,
            head_dim=16,
            rope_theta=1000000.0,
            rope_scaling={
                "rope_type": "yarn",
                "factor": 4.0,
                "original_max_position_embeddings": 32,
            },
        ),
    ),
    # DeepSeek-R1-Distill-Qwen shape: Qwen2 with an (inactive) window and max_window_layers
    "r1_distill_qwen": (
        transformers.Qwen2Config,
        dict(
            SMALL,
            sliding_window=4096,
            use_sliding_window=False,
            max_window_layers=1,
            tie_word_embeddings=False,
            rope_theta=10000.0,
        ),
    ),
    # linear rope scaling on a Llama
    "llama_linear": (
        transformers.LlamaConfig,
        dict(SMALL, rope_scaling={"rope_type": "linear", "factor": 2.0}),
    ),
    # alternating window 8 / global, attention soft-cap 5 and final soft-cap 3 (small: they bite)
    "gemma2": (
        transformers.Gemma2Config,
        dict(GEMMA, attn_logit_softcapping=5.0, final_logit_softcapping=3.0),
    ),
    # local layers with their own rope base, linear scaling on the global one, q/k norms
    "gemma3": (
        transformers.Gemma3TextConfig,
        dict(
            GEMMA,
            layer_types=["sliding_attention", "sliding_attention", "full_attention"] * 1
            + ["sliding_attention"],
            rope_parameters={
                "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6},
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            },
        ),
    ),
    # Gemma 4 31B's shape: the full layer's keys are its values, with one kv head of its own
    "gemma4": (
        transformers.Gemma4TextConfig,
        dict(GEMMA4, attention_k_eq_v=True, num_global_key_value_heads=1),
    ),
    # Gemma 4 E2B/E4B's: per-layer inputs (8 wide), the last two layers attend over the keys
    # and values of the last earlier layer of their kind, with MLPs twice as wide
    "gemma4_e": (
        transformers.Gemma4TextConfig,
        dict(GEMMA4, hidden_size_per_layer_input=8, vocab_size_per_layer_input=VOCAB)
        | dict(num_kv_shared_layers=2, use_double_wide_mlp=True),
    ),
    # Gemma 4 26B-A4B's: 8 experts (2 per token) beside each layer's dense MLP
    "gemma4_moe": (
        transformers.Gemma4TextConfig,
        dict(GEMMA4, enable_moe_block=True, num_experts=8, top_k_experts=2)
        | dict(moe_intermediate_size=32, attention_k_eq_v=True, num_global_key_value_heads=1),
    ),
    # gpt-oss: a sink per head, 8-token windows on alternate layers, yarn past 32 positions,
    # 8 experts (2 per token) with biases and a SwiGLU clamped at 0.5 (small: it bites)
    "gpt_oss": (
        transformers.GptOssConfig,
        dict(SMALL, num_hidden_layers=4, head_dim=16, sliding_window=8, intermediate_size=32)
        | dict(num_local_experts=8, num_experts_per_tok=2, swiglu_limit=0.5)
        | dict(
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": 150000.0,
                "factor": 4.0,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "truncate": False,
                "original_max_position_embeddings": 32,
            }
        ),
    ),
    # DeepSeek-V3: multi-head latent attention (q and kv latents, an 8-wide interleaved rope
    # part, values 12 wide), yarn with both mscales past 32 positions; sigmoid routing with a
    # correction bias over 2 of 4 expert groups, a shared expert, routed scaling, one dense
    # layer first
    "deepseek_v3": (
        transformers.DeepseekV3Config,
        dict(SMALL, num_hidden_layers=3, num_key_value_heads=4, q_lora_rank=24)
        | dict(kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=12)
        | dict(n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2)
        | dict(first_k_dense_replace=1, n_shared_experts=1, moe_intermediate_size=32)
        | dict(routed_scaling_factor=2.5)
        | dict(
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": 10000.0,
                "factor": 8.0,
                "original_max_position_embeddings": 32,
                "mscale": 1.0,
                "mscale_all_dim": 0.8,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
            }
        ),
    ),
    # DeepSeek-V2-Lite's shape of MLA: queries through one projection, no groups
    "deepseek_v3_lite": (
        transformers.DeepseekV3Config,
        dict(SMALL, num_key_value_heads=4, q_lora_rank=None, kv_lora_rank=16)
        | dict(qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, n_routed_experts=8)
        | dict(num_experts_per_tok=2, n_group=1, topk_group=1, first_k_dense_replace=0)
        | dict(n_shared_experts=2, moe_intermediate_size=16, rope_interleave=False),
    ),
    # GLM-4.5: GQA with q/k/v biases and q/k norms, half the head rotating, the DeepSeek-V3
    # router without groups, a shared expert, one dense layer first
    "glm4_moe": (
        transformers.Glm4MoeConfig,
        dict(SMALL, num_hidden_layers=3, head_dim=32, attention_bias=True, use_qk_norm=True)
        | dict(n_routed_experts=8, num_experts_per_tok=2, first_k_dense_replace=1)
        | dict(n_shared_experts=1, moe_intermediate_size=32, routed_scaling_factor=1.5),
    ),
    # fused qkv/gate_up, partial rotary 0.5, longrope (original context 16), window 12
    "phi3": (
        transformers.Phi3Config,
        dict(
            SMALL,
            sliding_window=12,
            original_max_position_embeddings=16,
            rope_parameters={
                "rope_type": "longrope",
                "rope_theta": 10000.0,
                "partial_rotary_factor": 0.5,
                "short_factor": [1.0, 1.1, 1.3, 1.6],
                "long_factor": [1.2, 2.0, 4.0, 8.0],
                "original_max_position_embeddings": 16,
            },
        ),
    ),
    # Mistral v0.1 / Nemo: every layer windowed, head_dim 32 != 64 / 4
    "mistral_window": (transformers.MistralConfig, dict(SMALL, head_dim=32, sliding_window=8)),
    # SmolLM3 as published: every fourth layer without rope (layer 3 of 4), tied embeddings
    "smollm3": (transformers.SmolLM3Config, dict(SMALL, num_hidden_layers=4)),
    # ... with NoPE layers listed and windowed (use_sliding_window: the NoPE layers slide)
    "smollm3_window": (
        transformers.SmolLM3Config,
        dict(SMALL, no_rope_layers=[1, 0, 1, 0], use_sliding_window=True, sliding_window=8)
        | {"num_hidden_layers": 4},
    ),
    # Qwen3.5: Gated DeltaNet on three layers of four (4 value heads over 2 key heads), a gated
    # full-attention layer with (1 + w) q/k norms and a quarter of each head rotated
    "qwen3_5": (transformers.Qwen3_5TextConfig, dict(LINEAR, tie_word_embeddings=True)),
    # Qwen3.5-MoE: those layers, 8 experts of which 2 per token, a gated shared expert
    "qwen3_5_moe": (transformers.Qwen3_5MoeTextConfig, dict(LINEAR, **EXPERTS)),
    # Qwen3-Next: the same layers with fused projections grouped per key head, experts in
    # layers 0, 2, 3 (layer 1 dense: mlp_only_layers) and a gated shared expert
    "qwen3_next": (transformers.Qwen3NextConfig, dict(LINEAR, **EXPERTS, mlp_only_layers=[1])),
    # OLMo 3: norms after attention and MLP only, q/k norms over the whole projection, three
    # windowed layers per full one with their own rope base, yarn on the full layers
    "olmo3": (
        transformers.Olmo3Config,
        dict(
            SMALL,
            num_hidden_layers=4,
            sliding_window=8,
            rope_parameters={
                "full_attention": {
                    "rope_type": "yarn",
                    "factor": 4.0,
                    "original_max_position_embeddings": 32,
                    "rope_theta": 1e6,
                },
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            },
        ),
    ),
}


def make_hf(case: str, seed: int = 0) -> transformers.PreTrainedModel:
    config_cls, kwargs = CASES[case]
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(
        config_cls(**kwargs), attn_implementation="eager"
    ).eval()
    with torch.no_grad():  # non-trivial norms and biases (HF initialises them to 1/0 or 0)
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith(("router.scale", "per_expert_scale")):
                p.add_(0.1 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.05 * torch.randn_like(p))
            elif name.endswith("sinks"):  # gpt-oss's, at the scale of the scores
                p.copy_(torch.randn_like(p))
        for name, b in model.named_buffers():
            if name.endswith("layer_scalar"):  # Gemma 4's per-block output scale
                b.copy_(0.5 + torch.rand_like(b))
            elif name.endswith("e_score_correction_bias"):  # large enough to change picks
                b.copy_(0.1 * torch.randn_like(b))
    return model


def checkpoint(tmp_path, case: str):
    hf = make_hf(case)
    folder = tmp_path / f"hf-{case}"
    hf.save_pretrained(folder)
    return hf, folder


def load_hf(path) -> transformers.PreTrainedModel:
    return transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager"
    ).eval()


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def tokens(seq: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(3, VOCAB, (2, seq), generator=torch.Generator().manual_seed(seed))


def lm_loss(logits: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), t[:, 1:].flatten())


def assert_parity(ours, hf) -> None:
    # 12: inside the windows (and longrope's short factors); 40: past them; 150 (linear
    # attention): past two chunks of the gated delta rule
    seqs = (12, 40, 150) if ours.args.linear_v_heads else (12, 40)
    for seq in seqs:
        t = tokens(seq)
        with torch.no_grad():
            want, got = hf(t).logits, ours(t)
        assert rel(got, want) <= 1e-5, (seq, rel(got, want))
        assert rel(lm_loss(got, t), lm_loss(want, t)) <= 1e-5


@pytest.mark.parametrize("case", sorted(CASES))
def test_logits_equal_transformers_and_save_roundtrip(case, tmp_path):
    hf, folder = checkpoint(tmp_path, case)
    ours = from_hf(folder)
    assert_parity(ours, hf)
    save_hf(ours, tmp_path / "ours")
    reloaded = load_hf(tmp_path / "ours")
    assert type(reloaded) is type(hf)
    assert_parity(ours, reloaded)
    assert from_hf(tmp_path / "ours").args == ours.args


@pytest.mark.parametrize("case", sorted(CASES))
def test_greedy_generate_equals_transformers(case, tmp_path):
    hf, folder = checkpoint(tmp_path, case)
    prompt = tokens(6, seed=5)[0].tolist()
    want = hf.generate(
        torch.tensor([prompt]),
        attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        max_new_tokens=34,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
    )[0, len(prompt) :].tolist()
    assert list(generate_ids(from_hf(folder).eval(), prompt, 34)) == want


@pytest.mark.parametrize(
    "case",
    [
        "gemma2",
        "gemma3",
        "gemma4_e",
        "gemma4_moe",
        "gpt_oss",
        "phi3",
        "qwen3",
        "smollm3_window",
        "olmo3",
        "qwen3_5_moe",
        "qwen3_next",
        "deepseek_v3",  # (GLM-4.5: the same router on plain attention)
    ],
)
def test_compiled_equals_eager_one_graph_per_layer_kind(case, tmp_path):
    _, folder = checkpoint(tmp_path, case)
    model = from_hf(folder)
    head = LossHead(model.output, "plain", model.args.final_softcap)

    def loss_and_grads(t, model=model, head=head):
        model.zero_grad()
        loss = head(model.hidden_states(t[:, :-1]), t[:, 1:])
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in model.parameters() if p.requires_grad]

    # The gated-delta layers' A_log and dt_bias gradients sum many terms that nearly cancel:
    # eager fp32 itself is up to 1.7e-4 from fp64 there (and by how much depends on the CPU's
    # vector width and thread count), so a gradient is held to the fp64 reference as well:
    # no further from it than eager fp32 is, plus the compile tolerance.
    model64 = from_hf(folder, dtype=torch.float64)
    head64 = LossHead(model64.output, "plain", model64.args.final_softcap)
    batches = [tokens(33, seed=s) for s in range(3)]
    eager = [loss_and_grads(t) for t in batches]
    exact = [loss_and_grads(t, model64, head64)[1] for t in batches]
    regions = compile_regions(model, head, CompileOptions(backend="aot_eager", loss="fused"))
    for t, (want_loss, want_grads), ref in zip(batches, eager, exact, strict=True):
        loss, grads = loss_and_grads(t)
        assert rel(loss, want_loss) <= 1e-5
        for g, w, r in zip(grads, want_grads, ref, strict=True):
            assert rel(g, w) <= 1e-4 or rel(g, r) <= rel(w, r) + 1e-4, (rel(g, w), rel(w, r))
    stats = regions.stats()
    kinds = {(layer.region, layer.moe) for layer in model.layers}  # a MoE model's dense layers
    blocks = {k: v for k, v in stats["regions"].items() if k.startswith("block")}
    assert len(blocks) == len(kinds) and stats["recompiles"] == 0, stats
    # The soft-capped head was fused all the same: no [N, V] logits.
    (record,) = regions.backends["head"].records
    (fuse,) = [p for p in record.passes if p["pass"] == "fuse_linear_cross_entropy"]
    assert fuse["matched"] == 1, fuse


@pytest.mark.parametrize(
    "case",
    [
        "phi3",
        "gemma2",
        "gemma4",
        "gemma4_e",
        "gemma4_moe",
        "gpt_oss",
        "qwen3",
        "smollm3",
        "olmo3",
        "qwen3_5",
        "qwen3_5_moe",
        "qwen3_next",
        "deepseek_v3",
        "deepseek_v3_lite",
        "glm4_moe",
    ],
)
def test_lora_adapter_loads_in_peft(case, tmp_path):
    hf, folder = checkpoint(tmp_path, case)
    spec = LoRASpec(rank=4, alpha=8.0, targets=("q", "k", "v", "o", "gate", "up", "down"))
    base = from_hf(folder)
    if case.startswith(("qwen3", "deepseek", "glm")) or case == "gpt_oss":  # as it has them
        targets = model_targets(base.args, parse_targets("all-linear"))
        spec = LoRASpec(rank=4, alpha=8.0, targets=targets)
    model = apply_lora(base, spec, dtype=torch.float32, seed=3).eval()
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)  # Gemma 4's per-layer inputs too
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    adapter_io.save_adapter(model, tmp_path / "adapter", base_model=str(folder))
    config = json.loads((tmp_path / "adapter" / adapter_io.ADAPTER_CONFIG).read_text())
    if case == "phi3":  # PEFT's names for the fused projections
        assert config["target_modules"] == ["down_proj", "gate_up_proj", "o_proj", "qkv_proj"]
    if case.startswith("qwen3_5"):
        assert {"in_proj_qkv", "in_proj_z", "out_proj", "q_proj"} <= set(config["target_modules"])
    if case == "qwen3_next":
        assert {"in_proj_qkvz", "in_proj_ba", "out_proj"} <= set(config["target_modules"])
    if case in ("gpt_oss", "deepseek_v3", "glm4_moe"):  # the experts too, as PEFT names them
        experts = ["mlp.experts.down_proj", "mlp.experts.gate_up_proj"]
        assert config["target_parameters"] == experts
    if case == "deepseek_v3":
        assert {"q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"} == set(
            config["target_modules"]
        )
    t = tokens(20)
    with torch.no_grad():
        ours = model(t)
        loaded = peft.PeftModel.from_pretrained(load_hf(folder), tmp_path / "adapter").eval()
        assert rel(loaded(t).logits, ours) <= 1e-5
        adapter_io.save_merged(model, tmp_path / "merged")
        # W + BA folded rounds otherwise than x W + (x A) B: fp32 noise, amplified by Gemma 4's
        # unscaled attention scores
        assert rel(load_hf(tmp_path / "merged")(t).logits, ours) <= 1e-4
    # and the adapter folder reads back as the same spec (targets from the tensors)
    assert adapter_io.read_adapter_spec(tmp_path / "adapter").targets == spec.targets


def test_fused_projection_targets_must_be_whole(tmp_path):
    _, folder = checkpoint(tmp_path, "phi3")
    with pytest.raises(UserError, match="qkv_proj"):
        apply_lora(from_hf(folder), LoRASpec(4, 8.0, targets=("q", "v")), dtype=torch.float32)


def _with_vision(case: str) -> transformers.PretrainedConfig:
    """The multimodal config of case `case`'s text model beside a one-layer vision tower."""
    tower = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2)
    text = CASES[case][0](**CASES[case][1]).to_dict()
    if case.startswith("gemma3"):
        vision = transformers.SiglipVisionConfig(**tower, image_size=28, patch_size=14)
        return transformers.Gemma3Config(
            text_config=text, vision_config=vision.to_dict(), mm_tokens_per_image=4
        )
    vision = transformers.Gemma4VisionConfig(**tower, num_key_value_heads=2, head_dim=16)
    return transformers.Gemma4Config(
        text_config=text, vision_config=vision.to_dict(), audio_config=None
    )


@pytest.mark.parametrize("case", ["gemma3", "gemma4_e"])
def test_vision_checkpoint_loads_its_text_model(tmp_path, case):
    torch.manual_seed(0)
    mm = transformers.AutoModelForImageTextToText.from_config(_with_vision(case)).eval()
    mm.save_pretrained(tmp_path / "mm")
    ours = from_hf(tmp_path / "mm")
    assert ours.args.family == CASES[case][0].model_type
    t = tokens(20)
    with torch.no_grad():
        assert rel(ours(t), mm(input_ids=t).logits) <= 1e-5
    save_hf(ours, tmp_path / "text")  # written as the text model
    assert rel(load_hf(tmp_path / "text")(t).logits, ours(t).detach()) <= 1e-5


@pytest.mark.parametrize(
    "change, field",
    [
        ({"architectures": ["Qwen2MoeForCausalLM"]}, "architectures"),
        ({"num_experts": 8}, "num_experts"),
        ({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "rope_type"),
        ({"rope_scaling": {"rope_type": "longrope", "long_mscale": 1.2}}, "long_mscale"),
        ({"rope_scaling": {"rope_type": "longrope", "short_factor": [1.0]}}, "long_factor"),
    ],
)
def test_unsupported_options_exit_2_naming_the_field(tmp_path, capsys, change, field):
    _, folder = checkpoint(tmp_path, "qwen3")
    cfg = json.loads((folder / "config.json").read_text())
    cfg.pop("rope_parameters", None)
    cfg.update(change)
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UserError, match=field):
        args_from_hf_config(cfg)
    capsys.readouterr()
    code = main(["estimate-memory", "--model-dir", str(folder), "--device-memory", "80"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and field in err[0], err


def test_phi3_longrope_original_context_and_saved_form(tmp_path):
    """transformers reads Phi-3's original context from the top-level key (default 4096), and
    4.x's Phi-3 accepts only {type, short_factor, long_factor} as rope_scaling."""
    _, folder = checkpoint(tmp_path, "phi3")
    cfg = json.loads((folder / "config.json").read_text())
    cfg.pop("original_max_position_embeddings")
    cfg["rope_parameters"]["original_max_position_embeddings"] = 64
    assert args_from_hf_config(cfg).rope_scaling.original_max_position_embeddings == 4096
    ours = from_hf(folder)
    save_hf(ours, tmp_path / "ours")
    saved = json.loads((tmp_path / "ours" / "config.json").read_text())
    assert sorted(saved["rope_scaling"]) == ["long_factor", "short_factor", "type"]
    assert saved["original_max_position_embeddings"] == 16


@pytest.mark.parametrize(
    "case",
    ["qwen3_5", "qwen3_next", "olmo3", "smollm3_window", "gemma4_e", "gpt_oss", "deepseek_v3"],
)
def test_packed_documents_equal_each_document_alone(case, tmp_path):
    """A row packing three documents (document ids, positions restarting) gives each document
    what it gives alone: no attention, convolution or recurrent state crosses a boundary."""
    _, folder = checkpoint(tmp_path, case)
    model = from_hf(folder)
    lengths = (70, 9, 61)  # the second document inside one chunk of the gated delta rule
    row = tokens(sum(lengths))[:1]
    doc_ids = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])[None]
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    with torch.no_grad():
        packed = model(row, positions, doc_ids)
        start = 0
        for n in lengths:
            alone = model(row[:, start : start + n])
            assert rel(packed[:, start : start + n], alone) <= 1e-5, (case, start)
            start += n
