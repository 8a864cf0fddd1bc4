"""What the LoRA tests share: tiny HF bases, small model shapes, adapter helpers."""

from __future__ import annotations

from pathlib import Path

import torch
import transformers

from compiletune.models import from_name
from compiletune.models.lora import LoRALinear

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


def tiny_args(layers: int = 3):
    args = from_name("debug")
    args.n_layers, args.dim, args.ffn_dim, args.n_heads, args.n_kv_heads = layers, 64, 128, 4, 2
    args.vocab_size = 300
    return args
