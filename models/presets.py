"""Named model shapes, as data: every family's presets (each defined in its family's module,
models/families/), and the lookup by name.

Published shapes are those of each model's HF config.json (base models). `head_dim` is left
None wherever it equals dim // n_heads (e.g. Llama 3.2's explicit 64 and 128) and set where it
differs (Qwen3 0.6B/4B/32B, Gemma, Mistral-Nemo), the same canonical form `args_from_hf_config`
produces, so a preset and a checkpoint's config compare equal. `num_params` counts parameters
from the shape alone.
"""

from __future__ import annotations

import copy
import difflib
import re

from compiletune.errors import UserError, closest

from .args import ModelArgs
from .families import FAMILIES

# every family module's presets, family by family (models/families/__init__.py)
PRESETS: dict[str, ModelArgs] = {
    name: args for f in FAMILIES.values() for name, args in f.presets.items()
}


def from_name(name: str) -> ModelArgs:
    """A copy of preset `name` (safe to modify)."""
    if name not in PRESETS:
        near = closest(name, PRESETS)
        # a guess alone can be far off (llama9_1t -> llama2_13b): the family's presets beside it
        family = re.match(r"[a-z]+", name.lower())
        same = [p for p in PRESETS if family and p.startswith(family.group())]
        if near and difflib.SequenceMatcher(None, name, near).ratio() >= 0.85:
            same = []  # a typo of one preset: the guess is the answer
        hint = f"did you mean {near!r}?" if near else "no preset is near that name;"
        hint += f" the {family.group()} presets: {', '.join(same)}" if same else ""
        if not near and not same:
            hint = f"choose one of: {', '.join(PRESETS)}"
        raise UserError(
            f"unknown model preset {name!r}; {hint} (`compiletune models` lists them with sizes)"
        )
    return copy.deepcopy(PRESETS[name])
