"""Native decoder: preset shapes and sizes, init, tying, GQA and rope sanity."""

import dataclasses
import math

import pytest
import torch

from compiletune.errors import UserError
from compiletune.models import (
    PRESETS,
    ModelArgs,
    RopeScaling,
    Transformer,
    args_from_hf_config,
    build_model,
    families,
    from_name,
    hf_config_from_args,
    num_params,
)
from compiletune.models.rope import rope_inv_freq

# Published totals (model cards / HF safetensors metadata).
PUBLISHED_PARAMS = {
    "llama3_8b": 8_030_261_248,
    "llama2_7b": 6_738_415_616,
    "llama3_2_1b": 1_235_814_400,
    "qwen2_5_0_5b": 494_032_768,
    "mistral_7b": 7_248_023_552,
    "qwen3_8b": 8_190_735_360,
    "qwen3_32b": 32_762_123_264,
    "gemma2_2b": 2_614_341_888,
    "gemma2_9b": 9_241_705_984,
    "gemma2_27b": 27_227_128_320,
    "gemma3_1b": 999_885_952,
    "phi3_mini": 3_821_079_552,
    "phi4": 14_659_507_200,
    "phi4_mini": 3_836_021_760,
    "mistral_7b_v0_1": 7_241_732_096,
    "mistral_nemo_12b": 12_247_782_400,
}
# Model cards give these rounded (billions): the shapes must round to them.
CARD_PARAMS_B = {"qwen3_0_6b": 0.6, "qwen3_1_7b": 1.7, "qwen3_4b": 4.0, "qwen3_14b": 14.8}
CARD_PARAMS_B |= {"smollm3_3b": 3.1, "olmo3_7b": 7.3, "gemma4_31b": 30.7, "qwen3_5_9b": 9.0}
CARD_PARAMS_B |= {"gemma4_26b_a4b": 25.2, "gpt_oss_20b": 20.9, "gpt_oss_120b": 116.8}
# ... or in whole billions (Qwen3.5's cards count the vision tower beside the text model)
CARD_PARAMS_WHOLE_B = {"qwen3_5_35b_a3b": 35, "qwen3_next_80b_a3b": 80}
# (DeepSeek-V3's 671B leaves out its multi-token-prediction layer, as the preset does)
CARD_PARAMS_WHOLE_B |= {"deepseek_v3": 671}
# ... or cut to whole billions (GLM-4.5-Air's "106B": 106.85B without its MTP layer)
CARD_PARAMS_CUT_B = {"glm4_5_air": 106}
# The newer families' presets, and the transformers class that builds the same model.
HF_CLASSES = {
    "smollm3_3b": "SmolLM3Config",
    "olmo3_7b": "Olmo3Config",
    "gemma4_31b": "Gemma4TextConfig",
    "gemma4_26b_a4b": "Gemma4TextConfig",
    "gpt_oss_20b": "GptOssConfig",
    "qwen3_5_9b": "Qwen3_5TextConfig",
    "qwen3_5_35b_a3b": "Qwen3_5MoeTextConfig",
    "qwen3_next_80b_a3b": "Qwen3NextConfig",
    "deepseek_v3": "DeepseekV3Config",
    "glm4_5_air": "Glm4MoeConfig",
}


def tiny_args(**overrides) -> ModelArgs:
    args = ModelArgs(
        dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=96, ffn_dim=128, rope_theta=10000.0
    )
    return dataclasses.replace(args, **overrides)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize("name", sorted(PUBLISHED_PARAMS))
def test_published_param_counts(name):
    assert num_params(from_name(name)) == PUBLISHED_PARAMS[name]


@pytest.mark.parametrize("name", sorted(CARD_PARAMS_B))
def test_card_param_counts(name):
    assert round(num_params(from_name(name)) / 1e9, 1) == CARD_PARAMS_B[name]


@pytest.mark.parametrize("name", sorted(CARD_PARAMS_WHOLE_B))
def test_card_param_counts_whole_billions(name):
    assert round(num_params(from_name(name)) / 1e9) == CARD_PARAMS_WHOLE_B[name]


@pytest.mark.parametrize("name", sorted(CARD_PARAMS_CUT_B))
def test_card_param_counts_cut_to_billions(name):
    assert int(num_params(from_name(name)) / 1e9) == CARD_PARAMS_CUT_B[name]


@pytest.mark.parametrize("name", sorted(HF_CLASSES))
def test_preset_config_builds_the_same_model_in_transformers(name):
    """The preset written as config.json is a transformers model of the same size (built on
    the meta device), and reads back as the preset."""
    import transformers

    args = from_name(name)
    cfg = hf_config_from_args(args, torch.bfloat16)
    config_cls = getattr(transformers, HF_CLASSES[name])
    hf_cfg = config_cls(**{k: v for k, v in cfg.items() if k != "architectures"})
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(hf_cfg)
    # Gemma 4's per-block scalars and DeepSeek-V3's correction biases: buffers there
    scalars = [
        b
        for n, b in model.named_buffers()
        if n.endswith(("layer_scalar", "e_score_correction_bias"))
    ]
    assert sum(p.numel() for p in [*model.parameters(), *scalars]) == num_params(args)
    assert args_from_hf_config(cfg) == args


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_num_params_matches_meta_model(name):
    args = from_name(name)
    with torch.device("meta"):
        model = Transformer(args)
    # parameters() yields a tied tensor once, like num_params counts it
    assert sum(p.numel() for p in model.parameters()) == num_params(args)


def test_preset_flags():
    assert from_name("llama3_2_1b").tie_embeddings and from_name("llama3_2_1b").hd == 64
    assert from_name("qwen2_5_7b").qkv_bias and not from_name("qwen2_5_7b").tie_embeddings
    assert from_name("llama3_1_8b").rope_scaling == RopeScaling(8.0, 1.0, 4.0, 8192)
    assert from_name("llama3_8b").rope_scaling is None
    assert (
        from_name("mistral_7b").family == "mistral" and from_name("mistral_7b").vocab_size == 32768
    )
    assert 3e6 < num_params(from_name("debug")) < 5e6
    assert 140e6 < num_params(from_name("llama3_150m")) < 170e6


def test_from_name_unknown_lists_presets():
    with pytest.raises(UserError, match="llama3_8b") as e:
        from_name("llama9_1t")
    assert "llama9_1t" in str(e.value)


def test_from_name_returns_copy():
    args = from_name("llama3_1_8b")
    args.dim = 1
    args.rope_scaling.factor = 2.0
    assert PRESETS["llama3_1_8b"].dim == 4096
    assert PRESETS["llama3_1_8b"].rope_scaling.factor == 8.0


def test_tied_weights_share_storage():
    model = build_model(tiny_args(tie_embeddings=True))
    assert model.output.weight is model.tok_embeddings.weight
    assert model.output.weight.data_ptr() == model.tok_embeddings.weight.data_ptr()
    untied = build_model(tiny_args())
    assert untied.output.weight.data_ptr() != untied.tok_embeddings.weight.data_ptr()


def test_init_deterministic_and_shaped():
    args = tiny_args(qkv_bias=True)
    a, b, c = build_model(args, seed=3), build_model(args, seed=3), build_model(args, seed=4)
    for (name, pa), pb, pc in zip(
        a.named_parameters(), b.parameters(), c.parameters(), strict=True
    ):
        assert torch.equal(pa, pb), name
        if name.endswith("norm.weight"):
            assert torch.equal(pa, torch.ones_like(pa)), name
        elif name.endswith("bias"):
            assert torch.equal(pa, torch.zeros_like(pa)), name
        else:
            assert not torch.equal(pa, pc), name
            assert 0.015 < pa.std().item() < 0.025, name


def test_build_model_dtype_and_no_buffers():
    model = build_model(tiny_args(), dtype=torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    assert list(model.buffers()) == []
    logits = model(torch.randint(0, 96, (2, 5)))
    assert logits.dtype == torch.bfloat16


def test_forward_shape_and_hidden_states():
    torch.manual_seed(0)
    model = build_model(tiny_args(), seed=1)
    tokens = torch.randint(0, 96, (3, 11))
    logits = model(tokens)
    assert logits.shape == (3, 11, 96)
    hidden = model.hidden_states(tokens)
    assert hidden.shape == (3, 11, 64)
    assert torch.equal(logits, model.output(hidden))
    positions = torch.arange(11).expand(3, 11)
    assert torch.equal(model(tokens, positions), logits)


def test_causal():
    torch.manual_seed(0)
    model = build_model(tiny_args(), seed=1)
    tokens = torch.randint(0, 96, (1, 12))
    changed = tokens.clone()
    changed[0, 8:] = (changed[0, 8:] + 1) % 96
    a, b = model(tokens), model(changed)
    assert rel_err(b[:, :8], a[:, :8]) < 1e-6
    assert not torch.allclose(a[:, 8:], b[:, 8:])


def test_gqa_matches_mha_with_repeated_kv_heads():
    """kv head j must serve query heads j*n_rep .. (j+1)*n_rep - 1 (HF repeat_kv)."""
    torch.manual_seed(0)
    gqa = build_model(tiny_args(n_heads=4, n_kv_heads=2), seed=5)
    mha = build_model(tiny_args(n_heads=4, n_kv_heads=4), seed=6)
    sd = gqa.state_dict()
    hd, n_rep = 16, 2
    for i in range(2):
        for w in ("wk", "wv"):
            key = f"layers.{i}.attention.{w}.weight"
            heads = sd[key].view(2, hd, 64)  # [kv heads, hd, d]
            sd[key] = heads.repeat_interleave(n_rep, dim=0).reshape(4 * hd, 64)
    mha.load_state_dict(sd)
    tokens = torch.randint(0, 96, (2, 9))
    assert rel_err(mha(tokens), gqa(tokens)) < 1e-6


def test_rope_depends_only_on_relative_position():
    torch.manual_seed(0)
    model = build_model(tiny_args(), seed=2)
    tokens = torch.randint(0, 96, (2, 10))
    shifted = torch.arange(10).expand(2, 10) + 37
    assert rel_err(model(tokens, shifted), model(tokens)) < 1e-5
    # ...and does depend on positions: reversing them changes the output
    assert rel_err(model(tokens, torch.arange(10).flip(0).expand(2, 10)), model(tokens)) > 1e-3


def test_llama3_rope_scaling_frequencies():
    rs = RopeScaling(
        factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192
    )
    base = rope_inv_freq(from_name("llama3_8b"))
    scaled = rope_inv_freq(from_name("llama3_1_8b"))
    assert base.shape == scaled.shape == (64,)
    wavelen = 2 * math.pi / base
    high = wavelen < 8192 / rs.high_freq_factor
    low = wavelen > 8192 / rs.low_freq_factor
    assert torch.equal(scaled[high], base[high])
    assert torch.allclose(scaled[low], base[low] / rs.factor)
    mid = ~high & ~low
    assert (
        mid.any()
        and (scaled[mid] < base[mid]).all()
        and (scaled[mid] > base[mid] / rs.factor).all()
    )
    # inv_freq follows theta ** (-2i / hd)
    assert torch.allclose(base, 500000.0 ** (-torch.arange(0, 128, 2).double() / 128).float())


def test_head_dim_override():
    args = tiny_args(head_dim=32)
    assert args.hd == 32 and tiny_args().hd == 16
    model = build_model(args)
    assert model.layers[0].attention.wq.weight.shape == (4 * 32, 64)
    assert model(torch.randint(0, 96, (1, 4))).shape == (1, 4, 96)


def test_the_family_registry_holds_each_family_once_with_its_presets():
    """Every family module's entry is registered once (a second entry of one model_type or
    architecture would silently replace the first), each preset is defined by the module of
    the family it names, and a ModelArgs that names no family has the registry's default."""
    entries = families._ALL
    assert len({f.model_type for f in entries}) == len(entries) == len(families.FAMILIES)
    assert len({f.architecture for f in entries}) == len(families.BY_ARCHITECTURE) == len(entries)
    homes = {name: f.model_type for f in entries for name in f.presets}
    assert len(homes) == sum(len(f.presets) for f in entries) == len(PRESETS)
    assert {name: args.family for name, args in PRESETS.items()} == homes
    assert ModelArgs(1, 1, 1, 1, 1, 1).family == families.DEFAULT_FAMILY
