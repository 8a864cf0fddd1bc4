"""A tiny Llama saved by transformers with the byte tokenizer: the HF folder tests read."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import transformers

from compiletune.data.tokenizer import byte_tokenizer


def save_tiny_llama(folder: Path, **sizes: Any) -> Path:
    """Write the folder (seed 0); `sizes` override LlamaConfig fields."""
    config = transformers.LlamaConfig(
        **{
            "vocab_size": 300,
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "max_position_embeddings": 128,
            **sizes,
        }
    )
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    byte_tokenizer().save_pretrained(folder)
    return folder
