"""What `--lora-targets` names: the projections LoRA can adapt, by short name, and the parser of
the flag. Plain data (no torch), so the CLI checks the flag before the model loads."""

from __future__ import annotations

import re

# short name -> (attribute path inside a block, HF module name). A block has the ones of its
# kind: q/k/v/o in attention layers, in_proj_* / out_proj in linear-attention layers; the last
# two exist only in models with fused projections, where they stand for q+k+v and gate+up.
TARGETS: dict[str, tuple[str, str]] = {
    "q": ("attention.wq", "q_proj"),
    "k": ("attention.wk", "k_proj"),
    "v": ("attention.wv", "v_proj"),
    "o": ("attention.wo", "o_proj"),
    "gate": ("feed_forward.w1", "gate_proj"),
    "up": ("feed_forward.w3", "up_proj"),
    "down": ("feed_forward.w2", "down_proj"),
    # Gated DeltaNet layers: their projections by PEFT's names
    "in_proj_qkv": ("attention.in_proj_qkv", "in_proj_qkv"),
    "in_proj_z": ("attention.in_proj_z", "in_proj_z"),
    "in_proj_b": ("attention.in_proj_b", "in_proj_b"),
    "in_proj_a": ("attention.in_proj_a", "in_proj_a"),
    "out_proj": ("attention.out_proj", "out_proj"),
    "in_proj_qkvz": ("attention.in_proj_qkvz", "in_proj_qkvz"),  # the fused ones
    "in_proj_ba": ("attention.in_proj_ba", "in_proj_ba"),
    # multi-head latent attention: its projections by PEFT's names
    "q_a": ("attention.wq_a", "q_a_proj"),
    "q_b": ("attention.wq_b", "q_b_proj"),
    "kv_a": ("attention.wkv_a", "kv_a_proj_with_mqa"),
    "kv_b": ("attention.wkv_b", "kv_b_proj"),
    "qkv": ("attention.wqkv", "qkv_proj"),
    "gate_up": ("feed_forward.w13", "gate_up_proj"),
}
LINEAR_ATTENTION_TARGETS = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj")
LINEAR_ATTENTION_TARGETS += ("in_proj_qkvz", "in_proj_ba")
LATENT_TARGETS = ("q_a", "q_b", "kv_a", "kv_b")
# A fused projection is adapted when all of its parts are targets (PEFT adapts qkv_proj whole).
FUSED_PARTS = {"qkv": ("q", "k", "v"), "gate_up": ("gate", "up")}
# What a LoRASpec / --lora-targets names: every projection (fused ones via their parts).
SPEC_TARGETS = tuple(t for t in TARGETS if t not in FUSED_PARTS)


# `--lora-targets` entries with this prefix name the vision tower's projections by their module
# names in the checkpoint, as PEFT's target_modules does (`vision.q_proj`, `vision.fc1`;
# `vision.all-linear`: every linear projection of the tower); models/vision/lora.py.
VISION_PREFIX = "vision."
ALL_LINEAR = "all-linear"


def parse_targets(text: str) -> tuple[str, ...]:
    """'q,k,v,o,gate,up,down' (any subset) or 'all-linear' -> short names in `TARGETS` order;
    the `vision.` entries (`parse_tower_targets`) are left out, and may be all there is (an
    empty tuple: no decoder projection).

    Raises ValueError naming the unknown entry."""
    names = [t.strip() for t in text.split(",") if t.strip()]
    tower = parse_tower_targets(text)
    names = [n for n in names if not n.startswith(VISION_PREFIX)]
    if ALL_LINEAR in names:
        names = [n for n in names if n != ALL_LINEAR] + list(SPEC_TARGETS)
    unknown = [n for n in names if n not in SPEC_TARGETS]
    if unknown or not (names or tower):
        raise ValueError(
            f"unknown LoRA target {unknown[0] if unknown else text!r}; use a comma list of "
            f"{','.join(SPEC_TARGETS)} or all-linear, and vision.NAME for the vision tower's "
            "projections (vision.all-linear: all of them)"
        )
    return tuple(t for t in SPEC_TARGETS if t in names)


def parse_tower_targets(text: str) -> tuple[str, ...]:
    """The names after `vision.` in a --lora-targets value ('vision.q_proj,vision.fc1' ->
    ('q_proj', 'fc1'); 'all-linear' stays as such), in the order given, without repeats; which
    of them the checkpoint's tower has is checked against it (models/vision/lora.py)."""
    names = [t.strip() for t in text.split(",") if t.strip()]
    tower = [n.removeprefix(VISION_PREFIX) for n in names if n.startswith(VISION_PREFIX)]
    bad = [n for n in tower if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*|all-linear", n)]
    if bad:
        raise ValueError(
            f"LoRA target vision.{bad[0]}: name one module of the vision tower as the "
            "checkpoint names it (e.g. vision.q_proj), or vision.all-linear"
        )
    return tuple(dict.fromkeys(tower))
