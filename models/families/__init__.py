"""The registry of model families: every family module's `Family` entries, looked up by
`model_type`, by architecture or by preset name.

A family lives in one module of this package (`models/families/<name>.py`): its `Family` entry
(config defaults, switches, read/write hooks), tensor names and layouts, presets and GGUF data.
Shared code reads those entries; adding a family whose mechanisms exist is one new module, one
line below, and one entry in the family tests (docs/development.md walks through it).
"""

from __future__ import annotations

from . import legacy, llama
from .base import Family, Get, Gguf

# The family of a ModelArgs that names none (models/args.py gives the same default).
DEFAULT_FAMILY = llama.FAMILY.model_type

# Every family, in the order `compiletune models` lists their presets.
_ALL: tuple[Family, ...] = (llama.FAMILY, *legacy.FAMILIES)

FAMILIES: dict[str, Family] = {f.model_type: f for f in _ALL}
BY_ARCHITECTURE: dict[str, Family] = {f.architecture: f for f in _ALL}
MOE_FAMILIES: tuple[str, ...] = tuple(f.model_type for f in _ALL if f.moe)
# preset name -> (its family, its ModelArgs)
_PRESET_FAMILY: dict[str, Family] = {name: f for f in _ALL for name in f.presets}

__all__ = ["BY_ARCHITECTURE", "DEFAULT_FAMILY", "FAMILIES", "MOE_FAMILIES", "Family", "Get", "Gguf"]


def family_of_preset(name: str) -> Family | None:
    """The family whose module defines preset `name`, or None."""
    return _PRESET_FAMILY.get(name)
