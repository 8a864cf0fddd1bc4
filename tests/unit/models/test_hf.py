"""HF parity: tiny transformers models -> from_hf -> same logits/loss -> save_hf -> HF loads it.

Every model is built from a config here and saved to tmp_path; nothing is downloaded.
"""

import dataclasses
import json
import re

import pytest
import torch
import torch.nn.functional as F
import transformers
from safetensors import safe_open
from safetensors.torch import save_file

from compiletune.errors import UserError
from compiletune.models import (
    PRESETS,
    args_from_hf_config,
    build_model,
    from_hf,
    from_name,
    hf_config_from_args,
    load_hf_config,
    save_hf,
)
from compiletune.models.hf_names import to_hf_name, to_native_name

VOCAB = 128
SMALL = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
)
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    # small, so that the test positions (up to ~100) cross every frequency band
    "original_max_position_embeddings": 32,
}

# name -> (config class, kwargs). Written with 4.x-style keyword names, which 5.x also accepts.
CASES = {
    "llama2": (
        transformers.LlamaConfig,
        dict(SMALL, num_key_value_heads=4, rms_norm_eps=1e-5, rope_theta=10000.0),
    ),
    "llama3_1": (
        transformers.LlamaConfig,
        dict(
            SMALL,
            head_dim=16,
            rms_norm_eps=1e-5,
            rope_theta=500000.0,
            rope_scaling=LLAMA3_ROPE,
            max_position_embeddings=1024,
        ),
    ),
    "llama3_2_tied": (
        transformers.LlamaConfig,
        dict(
            SMALL,
            head_dim=32,  # != hidden / heads, like Llama 3.2 3B's explicit head_dim
            rope_theta=500000.0,
            rope_scaling=dict(LLAMA3_ROPE, factor=32.0),
            max_position_embeddings=1024,
            tie_word_embeddings=True,
        ),
    ),
    "qwen2_5_tied": (
        transformers.Qwen2Config,
        dict(SMALL, rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=True),
    ),
    "mistral": (
        transformers.MistralConfig,
        dict(SMALL, head_dim=16, rope_theta=1000000.0, sliding_window=4096),
    ),
}


def make_hf_model(case: str, seed: int = 0) -> transformers.PreTrainedModel:
    config_cls, kwargs = CASES[case]
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config_cls(**kwargs)).eval()
    with torch.no_grad():  # non-trivial norms and biases (HF initialises them to 1 and 0)
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.1 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.05 * torch.randn_like(p))
    return model


def save_pretrained(model, path, **kwargs):
    # transformers 4.x needs safe_serialization=True for safetensors; 5.x always writes them.
    if transformers.__version__.startswith("4."):
        kwargs["safe_serialization"] = True
    model.save_pretrained(path, **kwargs)


def read_tensors(file) -> dict[str, torch.Tensor]:
    with safe_open(str(file), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (not a dict)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def lm_loss(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), tokens[:, 1:].flatten())


def assert_parity(ours, hf_model, seed: int = 1, seq_len: int = 100):
    torch.manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (2, seq_len))
    with torch.no_grad():
        ref = hf_model(tokens).logits
        got = ours(tokens)
    assert got.shape == ref.shape
    assert rel_err(got, ref) <= 1e-5
    assert rel_err(lm_loss(got, tokens), lm_loss(ref, tokens)) <= 1e-5


def load_hf(path):
    return transformers.AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()


@pytest.mark.parametrize("case", sorted(CASES))
def test_parity_roundtrip(case, tmp_path):
    hf_model = make_hf_model(case)
    save_pretrained(hf_model, tmp_path / "hf")
    ours = from_hf(tmp_path / "hf")
    assert ours.hf_config["architectures"] == hf_model.config.architectures
    assert all(p.dtype == torch.float32 for p in ours.parameters())
    assert_parity(ours, hf_model)

    save_hf(ours, tmp_path / "ours")
    files = sorted(p.name for p in (tmp_path / "ours").iterdir())
    # transformers' generation_config.json travels with the weights
    assert files == ["config.json", "generation_config.json", "model.safetensors"]
    for name in ("hf", "ours"):
        assert ours.generation_config == json.loads((tmp_path / name / files[1]).read_text())
    with safe_open(str(tmp_path / "ours" / "model.safetensors"), framework="pt") as f:
        assert f.metadata() == {"format": "pt"}
        assert ("lm_head.weight" in f.keys()) == (not ours.args.tie_embeddings)  # noqa: SIM118
    reloaded = load_hf(tmp_path / "ours")
    assert type(reloaded) is type(hf_model)
    assert_parity(ours, reloaded)
    # and our loader reads our own output back unchanged
    again = from_hf(tmp_path / "ours")
    assert again.args == ours.args
    for (name, a), b in zip(ours.state_dict().items(), again.state_dict().values(), strict=True):
        assert torch.equal(a, b), name


def test_sharded_roundtrip(tmp_path):
    hf_model = make_hf_model("llama3_1")
    save_pretrained(hf_model, tmp_path / "hf", max_shard_size="100KB")
    assert (tmp_path / "hf" / "model.safetensors.index.json").is_file()
    ours = from_hf(tmp_path / "hf")
    assert_parity(ours, hf_model)

    save_hf(ours, tmp_path / "ours", max_shard_bytes=100_000)
    out = tmp_path / "ours"
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(p.name for p in out.glob("*.safetensors"))
    assert len(shards) > 2 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    assert set(index["weight_map"].values()) == set(shards)
    assert index["metadata"]["total_size"] == sum(p.numel() * 4 for p in ours.parameters())
    assert_parity(ours, load_hf(out))

    # saving again unsharded into the same folder leaves no stale shards or index behind
    save_hf(ours, out)
    names = ["config.json", "generation_config.json", "model.safetensors"]
    assert sorted(p.name for p in out.iterdir()) == names
    assert_parity(ours, load_hf(out))


def test_dtype_from_config_and_override(tmp_path):
    hf_model = make_hf_model("qwen2_5_tied").to(torch.bfloat16)
    save_pretrained(hf_model, tmp_path / "hf")
    assert all(p.dtype == torch.bfloat16 for p in from_hf(tmp_path / "hf").parameters())
    ours = from_hf(tmp_path / "hf", dtype=torch.float32)
    assert all(p.dtype == torch.float32 for p in ours.parameters())
    save_hf(ours, tmp_path / "ours", dtype=torch.bfloat16)
    cfg = load_hf_config(tmp_path / "ours")
    assert cfg["torch_dtype"] == "bfloat16"
    with safe_open(str(tmp_path / "ours" / "model.safetensors"), framework="pt") as f:
        assert f.get_tensor("model.norm.weight").dtype == torch.bfloat16


@pytest.mark.parametrize("case", ["llama3_1", "qwen2_5_tied"])
def test_bf16_error_no_worse_than_hf(case, tmp_path):
    """bf16 from_hf vs an fp64 reference: no worse than HF's own bf16 forward (plus slack)."""
    hf_model = make_hf_model(case)
    save_pretrained(hf_model, tmp_path / "hf")
    ours = from_hf(tmp_path / "hf", dtype=torch.bfloat16)
    hf_bf16 = make_hf_model(case).to(torch.bfloat16)
    torch.manual_seed(2)
    tokens = torch.randint(0, VOCAB, (2, 100))
    with torch.no_grad():
        ref = hf_model.double()(tokens).logits
        ours_err = rel_err(ours(tokens), ref)
        hf_err = rel_err(hf_bf16(tokens).logits, ref)
    assert ours_err <= 1.25 * hf_err + 1e-3


def test_tied_checkpoint_with_lm_head_present(tmp_path):
    hf_model = make_hf_model("llama3_2_tied")
    save_pretrained(hf_model, tmp_path / "hf")
    file = tmp_path / "hf" / "model.safetensors"
    tensors = read_tensors(file)
    assert "lm_head.weight" not in tensors
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
    save_file(tensors, str(file), metadata={"format": "pt"})
    ours = from_hf(tmp_path / "hf")
    assert ours.output.weight is ours.tok_embeddings.weight
    assert_parity(ours, hf_model)


def test_save_hf_keeps_base_config_fields_and_tokenizer(tmp_path):
    hf_model = make_hf_model("mistral")
    save_pretrained(hf_model, tmp_path / "hf")
    ours = from_hf(tmp_path / "hf")
    ours.hf_config["bos_token_id"] = 7

    class FakeTokenizer:
        def save_pretrained(self, path):
            (tmp_path / "ours" / "tokenizer.json").write_text("{}")

    save_hf(ours, tmp_path / "ours", tokenizer=FakeTokenizer())
    cfg = load_hf_config(tmp_path / "ours")
    assert cfg["bos_token_id"] == 7 and cfg["sliding_window"] == 4096
    assert (tmp_path / "ours" / "tokenizer.json").is_file()


def test_save_random_init_model_loads_in_hf(tmp_path):
    args = dataclasses.replace(from_name("debug"), n_layers=2, vocab_size=VOCAB)
    ours = build_model(args, seed=0)
    save_hf(ours, tmp_path / "ours")
    assert_parity(ours, load_hf(tmp_path / "ours"), seq_len=64)


# --- config mapping ----------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_config_roundtrip_presets(name):
    args = from_name(name)
    cfg = json.loads(json.dumps(hf_config_from_args(args, torch.bfloat16)))
    assert args_from_hf_config(cfg) == args


def test_both_rope_config_styles():
    v4 = {
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "intermediate_size": 96,
        "vocab_size": 128,
        "rms_norm_eps": 1e-5,
        "max_position_embeddings": 1024,
        "rope_theta": 500000.0,
        "rope_scaling": dict(LLAMA3_ROPE),
        "torch_dtype": "bfloat16",
    }
    v5 = {k: v for k, v in v4.items() if k not in ("rope_theta", "rope_scaling", "torch_dtype")}
    v5["rope_parameters"] = dict(LLAMA3_ROPE, rope_theta=500000.0)
    v5["dtype"] = "bfloat16"
    a4, a5 = args_from_hf_config(v4), args_from_hf_config(v5)
    assert a4 == a5
    assert a4.rope_theta == 500000.0 and a4.rope_scaling.original_max_position_embeddings == 32
    # old-style {"type": ...} key and no rope at all
    legacy = dict(v4, rope_scaling=dict(LLAMA3_ROPE, type="llama3"))
    del legacy["rope_scaling"]["rope_type"]
    assert args_from_hf_config(legacy) == a4
    plain = args_from_hf_config(
        {k: v for k, v in v4.items() if k not in ("rope_theta", "rope_scaling")}
    )
    assert plain.rope_scaling is None and plain.rope_theta == 10000.0


def test_name_mapping_roundtrip():
    model = build_model(
        dataclasses.replace(from_name("debug"), n_layers=2, qkv_bias=True), init=False
    )
    names = [n for n, _ in model.named_parameters()]
    hf_names = [to_hf_name(n) for n in names]
    assert "model.layers.1.self_attn.k_proj.bias" in hf_names
    assert to_hf_name("layers.0.feed_forward.w1.weight") == "model.layers.0.mlp.gate_proj.weight"
    assert (
        to_hf_name("layers.0.ffn_norm.weight") == "model.layers.0.post_attention_layernorm.weight"
    )
    assert [to_native_name(n) for n in hf_names] == names
    with pytest.raises(UserError, match="vision_tower"):
        to_native_name("model.vision_tower.weight")


# --- errors ------------------------------------------------------------------------------


def write_config(path, **changes):
    cfg = load_hf_config(path)
    for key, value in changes.items():
        if value is None:
            cfg.pop(key, None)
        else:
            cfg[key] = value
    (path / "config.json").write_text(json.dumps(cfg))


@pytest.fixture
def llama_dir(tmp_path):
    save_pretrained(make_hf_model("llama3_1"), tmp_path / "hf")
    return tmp_path / "hf"


def test_error_unsupported_architecture(llama_dir):
    write_config(llama_dir, architectures=["GPT2LMHeadModel"])
    with pytest.raises(UserError, match="GPT2LMHeadModel"):
        from_hf(llama_dir)


@pytest.mark.parametrize("rope_type", ["dynamic", "ntk"])
def test_error_unknown_rope_type(llama_dir, rope_type):
    rope = {"rope_type": rope_type, "factor": 4.0, "original_max_position_embeddings": 32}
    write_config(llama_dir, rope_scaling=rope, rope_parameters=dict(rope, rope_theta=500000.0))
    with pytest.raises(UserError, match=rope_type):
        from_hf(llama_dir)


def test_error_shape_mismatch_names_tensor_and_shapes(llama_dir):
    write_config(llama_dir, intermediate_size=128)
    with pytest.raises(UserError) as e:
        from_hf(llama_dir)
    # names the first mismatching tensor (gate/up: [ffn, d]; down: [d, ffn]) and both shapes
    msg = str(e.value)
    assert re.match(r"model\.layers\.0\.mlp\.(gate|up|down)_proj\.weight: checkpoint has \[", msg)
    assert (
        "checkpoint has [96, 64], model expects [128, 64]" in msg
        or "checkpoint has [64, 96], model expects [64, 128]" in msg
    )


def test_error_missing_tensor(llama_dir):
    file = llama_dir / "model.safetensors"
    tensors = read_tensors(file)
    del tensors["model.layers.1.self_attn.v_proj.weight"]
    save_file(tensors, str(file), metadata={"format": "pt"})
    with pytest.raises(UserError, match=r"model\.layers\.1\.self_attn\.v_proj\.weight"):
        from_hf(llama_dir)


def test_error_unexpected_tensor(llama_dir):
    file = llama_dir / "model.safetensors"
    tensors = read_tensors(file)
    tensors["model.layers.0.self_attn.q_proj.bias"] = torch.zeros(64)
    save_file(tensors, str(file), metadata={"format": "pt"})
    with pytest.raises(
        UserError, match=r"unexpected tensor 'model\.layers\.0\.self_attn\.q_proj\.bias'"
    ):
        from_hf(llama_dir)


def test_error_missing_folder_config_weights(tmp_path, llama_dir):
    with pytest.raises(UserError, match="does not exist"):
        from_hf(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError, match="config.json"):
        from_hf(tmp_path / "empty")
    (llama_dir / "model.safetensors").unlink()
    with pytest.raises(UserError, match="safetensors"):
        from_hf(llama_dir)


def test_error_missing_field_and_unsupported_options(llama_dir):
    cfg = load_hf_config(llama_dir)
    for key in ("hidden_size", "num_hidden_layers", "vocab_size", "intermediate_size"):
        with pytest.raises(UserError, match=key):
            args_from_hf_config({k: v for k, v in cfg.items() if k != key})
    qwen = dict(cfg, architectures=["Qwen2ForCausalLM"], use_sliding_window=True)
    with pytest.raises(UserError, match="use_sliding_window"):
        args_from_hf_config(qwen)
    with pytest.raises(UserError, match="attention_bias"):
        args_from_hf_config(dict(cfg, attention_bias=True))
    with pytest.raises(UserError, match="hidden_act"):
        args_from_hf_config(dict(cfg, hidden_act="gelu"))
    with pytest.raises(UserError, match="qkv_bias"):
        hf_config_from_args(dataclasses.replace(from_name("debug"), qkv_bias=True), torch.float32)


@pytest.mark.parametrize(
    ("config_class", "scaling"),
    [
        # Llama 3.1's published scaling: 8k trained, 128k positions
        (
            transformers.LlamaConfig,
            {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192,
            },
        ),
        # Qwen2.5 / Qwen3's yarn: 32k trained, x4 (and x8 past the published 128k)
        (
            transformers.Qwen2Config,
            {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 32768},
        ),
    ],
)
def test_long_rope_positions_equal_transformers(config_class, scaling) -> None:
    """cos/sin at positions 128k..256k (a long-context run's) equal transformers' rotary
    embedding of the same config bit for bit: the same fp32 frequencies and angles the
    checkpoints were trained with (llama3 and yarn scaling), so a long row's last tokens rotate
    exactly as transformers rotates them."""
    from compiletune.models.rope import rope_cos_sin

    config = config_class(
        hidden_size=512,
        num_attention_heads=4,
        num_key_value_heads=2,
        rope_theta=500000.0 if scaling["rope_type"] == "llama3" else 1000000.0,
        rope_scaling=scaling,
        max_position_embeddings=262144,
    )
    args = args_from_hf_config(config.to_dict())
    positions = torch.cat([torch.arange(131064, 131080), torch.arange(262128, 262144)])[None]
    rotary = getattr(transformers.models, config.model_type)
    module = getattr(rotary, f"modeling_{config.model_type}")
    cls = next(v for k, v in vars(module).items() if k.endswith("RotaryEmbedding"))
    hf_cos, hf_sin = cls(config)(torch.zeros(1, dtype=torch.float32), positions)
    cos, sin = rope_cos_sin(args, positions, torch.float32)
    assert torch.equal(cos, hf_cos) and torch.equal(sin, hf_sin)


@pytest.mark.parametrize(
    "config, key",
    [
        (
            transformers.Qwen3_5TextConfig(
                **SMALL, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4
            ),
            "linear_conv_kernel_dim",
        ),
        (
            transformers.DeepseekV3Config(
                **SMALL, n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2
            ),
            "n_group",
        ),
    ],
)
def test_family_field_written_as_a_string_names_config_json(tmp_path, capsys, config, key):
    """A family's own integer field written as a string ("4") is one line naming config.json,
    the key, the value and the type wanted: not a tokenizer that could not load (transformers'
    strict config refuses it when AutoTokenizer reads config.json)."""
    from compiletune.cli import main
    from compiletune.data.tokenizer import byte_tokenizer

    folder = tmp_path / "model"
    config.save_pretrained(folder)  # no weights: the config is refused before they are read
    byte_tokenizer().save_pretrained(folder)
    cfg = json.loads((folder / "config.json").read_text())
    cfg[key] = str(cfg[key])
    (folder / "config.json").write_text(json.dumps(cfg))
    (tmp_path / "d.txt").write_text("hello world " * 50)
    capsys.readouterr()
    argv = ["train", "--model-dir", str(folder), "--data", str(tmp_path / "d.txt")]
    code = main([*argv, "--max-steps", "1", "--output-dir", str(tmp_path / "out")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert str(folder / "config.json") in err[0] and repr(key) in err[0], err
    assert f'"{cfg[key]}"' in err[0] and "integer" in err[0] and "tokenizer" not in err[0]
