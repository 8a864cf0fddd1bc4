"""Hub repositories named by a run's options, pinned to their commit (`pin_hub_specs`) so the
run's config.yaml reads the same files again, and a --resume that names a repository again
without a revision given the saved commit (`align_hub_specs`, no network).

Its own room because it is the one part of the run folder that reads the network (through
compiletune.hub) and the spelling of mixtures (`SOURCE:W,...`).
"""

from __future__ import annotations

from pathlib import Path

from compiletune import hub
from compiletune.config import TrainConfig, read_saved_config
from compiletune.data import sources

# Options that may name a Hub repository: (flat key, kind, flag).
_HUB_OPTIONS = (
    ("model_dir", "model", "--model-dir"),
    ("tokenizer", "tokenizer", "--tokenizer"),
    ("teacher_dir", "model", "--teacher-dir"),
    ("data", "dataset", "--data"),
    ("eval_data", "dataset", "--eval-data"),
)


def _parts(value: str, kind: str) -> list[tuple[str, str]]:
    """(source, ":W" or "") for each source of a mixture; one for a model."""
    if kind != "dataset":
        return [(value, "")]
    out = []
    for part in value.split(","):
        head, colon, tail = part.strip().rpartition(":")
        out.append((head, colon + tail) if colon and head else (part.strip(), ""))
    return out


def _hub_ref(text: str, kind: str) -> hub.HubRef | None:
    if (
        text == "pydocs"
        or Path(text).exists()
        or (kind == "dataset" and sources.is_file_spec(text))
    ):
        return None
    return hub.parse(text, dataset=kind == "dataset")


def align_hub_specs(cfg: TrainConfig) -> TrainConfig:
    """--resume naming a Hub repository again without a revision: the commit the run's
    config.yaml holds, so the resumed run reads the same files (no network)."""
    saved = (read_saved_config(cfg.run.output_dir) if cfg.run.resume else None) or {}
    changes = {}
    for key, kind, _ in _HUB_OPTIONS:
        value, was = cfg.get(key), saved.get(key)
        if not (isinstance(value, str) and isinstance(was, str)) or value == was:
            continue
        olds = {}
        for text, _ in _parts(was, kind):
            ref = _hub_ref(text, kind)
            if ref is not None and ref.revision is not None:
                olds[(ref.repo, ref.config)] = text
        parts = []
        for text, weight in _parts(value, kind):
            ref = _hub_ref(text, kind)
            if ref is not None and ref.revision is None:
                text = olds.get((ref.repo, ref.config), text)
            parts.append(text + weight)
        aligned = ",".join(parts)
        if aligned != value:
            changes[key] = aligned
    return cfg.replace(**changes) if changes else cfg


def pin_hub_specs(cfg: TrainConfig) -> TrainConfig:
    """Download what the options name on the Hub and write each as `ORG/NAME@<commit>`, so the
    run's config.yaml (and `--resume`) reads the same files. A value a resumed run keeps as its
    config.yaml has it is left as it is (pinned already, or a run from before pinning)."""
    saved = (read_saved_config(cfg.run.output_dir) if cfg.run.resume else None) or {}
    changes = {}
    for key, kind, flag in _HUB_OPTIONS:
        value = cfg.get(key)
        if not isinstance(value, str) or value == saved.get(key):
            continue
        parts = []
        for text, weight in _parts(value, kind):
            ref = _hub_ref(text, kind)
            if ref is not None and kind == "dataset":
                split = cfg.data.data_split if key == "data" else cfg.data.eval_split
                text = sources.pinned_source(text, split or cfg.data.data_split)
            elif ref is not None:
                folder = hub.model_folder(text, flag, weights=kind == "model")
                text = ref.pinned(folder.name)
            parts.append(text + weight)
        pinned = ",".join(parts) if kind == "dataset" else parts[0]
        if pinned != value:
            changes[key] = pinned
    return cfg.replace(**changes) if changes else cfg


def hub_specs(cfg: TrainConfig) -> str:
    """The run's Hub-capable options, as one string (to compare across processes)."""
    return repr([cfg.get(key) for key, _, _ in _HUB_OPTIONS])
