"""Shipped recipes: YAML run files for common model x technique x GPU cases (`configs/`).

Each recipe starts with a comment header that `compiletune configs` lists and a test keeps true
(it re-estimates every recipe and fails when one no longer fits its GPUs):

    # Llama 3.1 8B, LoRA r16, on one 24 GB GPU        <- the case
    # gpus: 1 x 24 GiB                                 <- what it is for
    # host: 64 GiB                                     <- (optional) host memory it needs
    # estimated peak: 19.3 GiB per GPU                 <- compiletune estimate-memory
    # if it does not fit: --seq-len 2048 first, then --ac full

Values written `<like this>` are placeholders (a local model folder, the user's data): `train`
refuses them with a line saying what to put there; `estimate-memory` does not need them (the
recipe's `model` preset gives the architecture).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from compiletune.errors import UserError

_PLACEHOLDER = re.compile(r"^<[^<>]+>$")
# Values a recipe may leave as a placeholder, with the flag that sets each.
PLACEHOLDER_FIELDS = {
    "model_dir": "--model-dir",
    "tokenizer": "--tokenizer",
    "data": "--data",
    "eval_data": "--eval-data",
}


def is_placeholder(value: object) -> bool:
    return isinstance(value, str) and bool(_PLACEHOLDER.match(value.strip()))


@dataclass
class Recipe:
    name: str
    path: Path
    case: str  # the header's first line
    gpus: int
    gpu_gib: float
    host_gib: float | None
    estimate_gib: float
    advice: str
    values: dict[str, Any]

    @property
    def technique(self) -> str:
        v = self.values
        if v.get("lora_rank"):
            kind = "QLoRA" if v.get("quantize_base") else "LoRA"
            kind += f" r{v['lora_rank']}"
        else:
            kind = "full"
        extra = [
            f"ac {v['ac']}" if v.get("ac") not in (None, "none") else "",
            "8-bit" if v.get("optimizer") == "adamw8bit" else "",
            "in-backward" if v.get("optimizer_in_backward") else "",
            "CPU offload" if v.get("cpu_offload") else "",
        ]
        return ", ".join([kind, *(e for e in extra if e)])


def recipes_dir() -> Path:
    return Path(str(resources.files("compiletune.configs")))


def _header(path: Path) -> dict[str, str]:
    lines = []
    for line in path.read_text().splitlines():
        if not line.startswith("#"):
            break
        lines.append(line.lstrip("#").strip())
    if not lines:
        raise ValueError(f"{path}: a recipe starts with its comment header")
    out = {"case": lines[0]}
    for line in lines[1:]:
        key, sep, value = line.partition(":")
        if sep:
            out[key.strip()] = value.strip()
    return out


def _gib(text: str) -> float:
    return float(text.split()[0])


def read(path: Path) -> Recipe:
    """One recipe file (its header and its values, keys as the config spells them)."""
    h = _header(path)
    try:
        count, _, size = h["gpus"].partition(" x ")
        values = yaml.safe_load(path.read_text()) or {}
        return Recipe(
            name=path.stem,
            path=path,
            case=h["case"],
            gpus=int(count),
            gpu_gib=_gib(size),
            host_gib=_gib(h["host"]) if "host" in h else None,
            estimate_gib=_gib(h["estimated peak"]),
            advice=h["if it does not fit"],
            values={str(k).replace("-", "_"): v for k, v in values.items()},
        )
    except (KeyError, ValueError) as e:
        raise ValueError(f"{path}: bad recipe header ({e})") from e


def all_recipes() -> list[Recipe]:
    return [read(p) for p in sorted(recipes_dir().glob("*.yaml"))]


def find(name: str) -> Path | None:
    """The shipped recipe called `name` (with or without .yaml), or None."""
    stem = name.removesuffix(".yaml")
    if "/" in stem or not stem:
        return None
    path = recipes_dir() / f"{stem}.yaml"
    return path if path.is_file() else None


def get(name: str) -> Recipe:
    path = find(name)
    if path is None:
        names = ", ".join(r.name for r in all_recipes())
        raise UserError(f"no shipped recipe named '{name}'; the recipes are: {names}")
    return read(path)


def check_no_placeholders(cfg: Any) -> None:
    """Refuse a run whose config (a TrainConfig; config/ imports this module) still holds a recipe's placeholder: `train`
    calls this before it writes anything; the memory estimate does not need these values."""
    for field, flag in PLACEHOLDER_FIELDS.items():
        value = cfg.get(field)
        if is_placeholder(value):
            raise UserError(
                f"{flag} is still the recipe's placeholder {value}: set it in your copy of the "
                f"recipe (`compiletune configs copy NAME run.yaml`) or pass {flag} on the "
                "command line"
            )


def format_table(recipes: list[Recipe]) -> str:
    rows = [("recipe", "model", "technique", "GPUs", "est. GiB/GPU")]
    for r in recipes:
        gpus = f"{r.gpus} x {r.gpu_gib:g} GiB"
        rows.append(
            (r.name, str(r.values.get("model", "")), r.technique, gpus, f"{r.estimate_gib:.1f}")
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join(
        "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in rows
    )
