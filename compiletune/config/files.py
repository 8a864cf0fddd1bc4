"""YAML files of run options: `--config` files and shipped recipes (read), a run's config.yaml
(written as it starts, read by --resume)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from compiletune import recipes
from compiletune.config.schema import FIELD_NAMES, TrainConfig
from compiletune.errors import UserError, closest

SAVED_CONFIG = "config.yaml"


def load_yaml(path: str) -> dict[str, Any]:
    """Read a YAML run file, or a shipped recipe by name (`compiletune configs`), into a dict of
    config keys (dashes or underscores accepted)."""
    p = Path(path)
    if not p.is_file():
        shipped = recipes.find(path)
        if shipped is None:
            raise UserError(
                f"--config {path}: no such file or shipped recipe; pass the path of a YAML run "
                "file or a name from `compiletune configs`"
            )
        p = shipped
    try:
        text = p.read_bytes().decode("utf-8")
    except UnicodeDecodeError as e:
        raise UserError(
            f"--config {path}: not UTF-8 text (byte 0x{e.object[e.start]:02x} at offset "
            f"{e.start}); save the file as UTF-8"
        ) from e
    except OSError as e:
        raise UserError(f"--config {path}: cannot be read ({e.strerror}); fix the path") from e
    try:
        raw = yaml.safe_load(text) or {}
    except yaml.YAMLError as e:
        raise UserError(f"--config {path}: not valid YAML ({e}); fix the file") from e
    if not isinstance(raw, dict):
        raise UserError(f"--config {path}: expected a mapping of option: value at the top level")
    out: dict[str, Any] = {}
    spelled: dict[str, Any] = {}
    for key, value in raw.items():
        name = str(key).replace("-", "_")
        if name not in FIELD_NAMES:
            raise UserError(f"--config {path}: {unknown_option(key)}")
        if name in out:
            raise UserError(
                f"--config {path}: '{spelled[name]}' and '{key}' are the same option; keep one"
            )
        out[name], spelled[name] = value, key
    return out


def unknown_option(key: Any) -> str:
    """'unknown option K; did you mean N?' with the nearest option name, or the known ones."""
    name = str(key).replace("-", "_")
    near = closest(name, sorted(FIELD_NAMES))
    if near:
        return f"unknown option '{key}'; did you mean '{near}'?"
    return f"unknown option '{key}'; known options: {', '.join(sorted(FIELD_NAMES))}"


def save_yaml(cfg: TrainConfig, path: Path) -> None:
    path.write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))


def read_saved_config(output_dir: str | Path) -> dict[str, Any] | None:
    """A run's `config.yaml` (None if the folder has none): its known options, flat."""
    path = Path(output_dir) / SAVED_CONFIG
    if not path.is_file():
        return None
    try:
        raw = yaml.safe_load(path.read_text())
    except (yaml.YAMLError, UnicodeDecodeError, OSError) as e:
        raise UserError(
            f"{path}: cannot read the run's saved config ({type(e).__name__}); restore it, or "
            "delete it and pass every flag of the run again with --resume"
        ) from e
    if not isinstance(raw, dict):
        raise UserError(f"{path}: expected option: value lines; restore or delete the file")
    for key in raw:
        if key not in FIELD_NAMES:
            raise UserError(f"{path}: {unknown_option(key)} Remove or correct that line")
    return dict(raw)
