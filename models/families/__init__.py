"""The registry of model families: every family module's `Family` entries, looked up by
`model_type` (`FAMILIES`) or by architecture (`BY_ARCHITECTURE`); their presets, by name, are
`models/presets.py`'s `PRESETS`.

A family lives in one module of this package (`models/families/<name>.py`): its `Family` entry
(config defaults, switches, read/write hooks), tensor names and layouts, presets and GGUF data.
Shared code reads those entries; adding a family whose mechanisms exist is one new module, one
line below, and one entry in the family tests (docs/development.md walks through it).
"""

from __future__ import annotations

from . import (
    deepseek_v3,
    gemma2,
    gemma3,
    gemma4,
    glm4_moe,
    gpt_oss,
    llama,
    mistral,
    mixtral,
    olmo3,
    phi3,
    qwen2,
    qwen3,
    qwen3_5,
    qwen3_moe,
    qwen3_next,
    smollm3,
)
from .base import Family, Get, Gguf

# The family of a ModelArgs that names none (models/args.py gives the same default).
DEFAULT_FAMILY = llama.FAMILY.model_type

# Every family, in the order `compiletune models` lists their presets.
_ALL: tuple[Family, ...] = (
    llama.FAMILY,
    mistral.FAMILY,
    qwen2.FAMILY,
    qwen3.FAMILY,
    phi3.FAMILY,
    gemma2.FAMILY,
    gemma3.FAMILY,
    smollm3.FAMILY,
    olmo3.FAMILY,
    gemma4.FAMILY,
    *qwen3_5.FAMILIES,
    qwen3_next.FAMILY,
    gpt_oss.FAMILY,
    qwen3_moe.FAMILY,
    deepseek_v3.FAMILY,
    glm4_moe.FAMILY,
    mixtral.FAMILY,
)

FAMILIES: dict[str, Family] = {f.model_type: f for f in _ALL}
BY_ARCHITECTURE: dict[str, Family] = {f.architecture: f for f in _ALL}
MOE_FAMILIES: tuple[str, ...] = tuple(f.model_type for f in _ALL if f.moe)
__all__ = ["BY_ARCHITECTURE", "DEFAULT_FAMILY", "FAMILIES", "MOE_FAMILIES", "Family", "Get", "Gguf"]
