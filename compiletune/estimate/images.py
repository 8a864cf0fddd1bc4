"""What the estimate knows of a run's images: whether its `--data` holds image conversations (a
look at its first rows' messages, no pixels read), and a fake batch's images of the shapes the
checkpoint's processor would give.

A run whose data holds images loads the checkpoint's vision tower (train/build_model.py
`wants_vision`); the estimate then builds the same model, so the tower's weights (and with
--train-vision its gradients and optimizer state) are counted. The image activations are counted
where the tower's input shapes follow from the checkpoint's config alone: Gemma 3 (SigLIP, every
image resized to `vision_config.image_size`, `mm_tokens_per_image` tokens each). Qwen3.5's and
Gemma 4's depend on each image's size; their runs are estimated with the tower but without
images in the step (a note says so).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from compiletune.config import TrainConfig
from compiletune.data.images import has_images
from compiletune.loss.head import IGNORE_INDEX
from compiletune.models.args import ModelArgs
from compiletune.models.hf_config import load_hf_config
from compiletune.models.vision.inputs import ImageInputs
from compiletune.models.vision.model import is_vision_checkpoint, vision_of
from compiletune.models.vision.siglip import SiglipArgs

# how many of the data's first rows the estimate looks at for images
PEEK_ROWS = 256


@dataclass(frozen=True)
class ImagePlan:
    """A fake batch's images: `per_row` images in every row (the most any row peeked holds),
    each `tokens` image tokens of id `token_id`; `pixels`: one image's pixel_values shape, or
    None where the tower's input shapes are not known without the images (no images in the
    step)."""

    per_row: int
    tokens: int
    token_id: int
    pixels: tuple[int, ...] | None


def images_per_row(source: str | None, rows: int = PEEK_ROWS) -> int:
    """The most images a row holds among the first `rows` rows of `source` where it is a local
    JSON-lines file of conversations (`messages`); 0 for any other source, or text rows."""
    if not source:
        return 0
    path = Path(source)
    if path.suffix not in (".jsonl", ".json") or not path.is_file():
        return 0
    most = 0
    with path.open() as f:
        for i, line in enumerate(f):
            if i >= rows:
                break
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                return most  # a .json array or a bad line: the reader will say; no images known
            messages = row.get("messages") if isinstance(row, dict) else None
            if has_images(messages):
                most = max(most, _count_images(messages))
    return most


def _count_images(messages: list) -> int:
    return sum(
        1
        for m in messages
        if isinstance(m, dict) and isinstance(m.get("content"), list)
        for p in m["content"]
        if isinstance(p, dict) and p.get("type") == "image"
    )


def image_plan(cfg: TrainConfig, args: ModelArgs) -> ImagePlan | None:
    """The images of the estimate's fake batches for `cfg`: None unless its --data holds images
    and --model-dir is a vision checkpoint (the run loads the tower)."""
    folder = cfg.model.model_dir
    if folder is None:
        return None
    per_row = images_per_row(cfg.data.source)
    if not per_row:
        return None
    config = load_hf_config(folder)
    if not is_vision_checkpoint(config):
        return None  # the run refuses this (train/inputs.py check_vision); text only here
    vision = vision_of(args)
    token_id = int(config[vision.image_token_key])
    if vision.tower == "siglip":
        s = SiglipArgs.from_hf(config)
        pixels = (s.num_channels, s.image_size, s.image_size)
        tokens = s.mm_tokens_per_image
    else:
        pixels, tokens = None, 0
    # the images of a row fit in it, with a token before and after (none fits: no images)
    fits = (cfg.data.seq_len - 2) // tokens if tokens else per_row
    if not fits:
        pixels = None
    return ImagePlan(max(1, min(per_row, fits)), tokens, token_id, pixels)


def add_images(batch: dict[str, Tensor], plan: ImagePlan) -> dict:
    """`batch` (random tokens) with `plan`'s images: each row's image tokens from its second
    position on, without targets (the loss is on the reply's text), and random pixels."""
    if plan.pixels is None:
        return batch
    tokens, targets = batch["inputs"], batch["targets"]
    rows = tokens.shape[0]
    n = plan.per_row * plan.tokens
    tokens[tokens == plan.token_id] = 0  # a random token that is the image token's id: text
    tokens[:, 1 : 1 + n] = plan.token_id
    targets[:, 1 : 1 + n] = IGNORE_INDEX
    count = rows * plan.per_row
    return {
        **batch,
        "images": ImageInputs(torch.randn(count, *plan.pixels)),
        "image_rows": torch.arange(rows).repeat_interleave(plan.per_row),
    }
