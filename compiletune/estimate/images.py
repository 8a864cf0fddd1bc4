"""What the estimate knows of a run's images: whether its `--data` holds image conversations (a
look at its first rows' messages and their images' headers, no pixels decoded), and a fake
batch's images of the shapes the checkpoint's processor would give.

A run whose data holds images loads the checkpoint's vision tower (train/build_model.py
`wants_vision`); the estimate then builds the same model, so the tower's weights (and with
--train-vision its gradients and optimizer state) are counted, and steps a fake batch whose rows
hold as many images as the most any row peeked holds:

- Gemma 3 (SigLIP): every image is resized to `vision_config.image_size`, `mm_tokens_per_image`
  tokens each; the shapes follow from the config alone (random pixels).
- Qwen3.5 (dynamic resolution) and Gemma 4: an image's patches and tokens follow its size. The
  estimate takes the largest image (by pixels) of the rows peeked, prepares one image of that
  size with the checkpoint's own processor (as `data/image_batch.py` does) and counts its image
  tokens as tokenising does (the processor expands the chat template's placeholder); every image
  of the fake batch is that one. Where the processor cannot be loaded (it needs torchvision) or
  no image's size can be read, the step holds no images (the tower's weights only); the
  estimate's notes say which.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from compiletune.config import TrainConfig
from compiletune.data.image_tokens import image_placeholder
from compiletune.data.images import has_images, pil, row_images
from compiletune.data.tokenizer import load_processor
from compiletune.errors import UserError
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
    step). `image`: that one image as the processor prepared it (Qwen3.5, Gemma 4), else
    random pixels of `pixels` are drawn (Gemma 3). `note`: what the estimate's notes say."""

    per_row: int
    tokens: int
    token_id: int
    pixels: tuple[int, ...] | None
    image: ImageInputs | None = None
    note: str | None = None


def images_per_row(source: str | None, rows: int = PEEK_ROWS) -> int:
    """The most images a row holds among the first `rows` rows of `source` where it is a local
    JSON-lines file of conversations (`messages`); 0 for any other source, or text rows."""
    return _peek(source, rows, _stamp(source))[0]


def largest_image(source: str | None, rows: int = PEEK_ROWS) -> tuple[int, int] | None:
    """The (width, height) of the largest image (by pixels) the first `rows` rows of `source`
    name, read from the files' headers; None where no image file could be read."""
    return _peek(source, rows, _stamp(source))[1]


def _stamp(source: str | None) -> tuple[int, int] | None:
    """What says a file changed (its modification time and size), for `_peek`'s cache."""
    try:
        st = Path(source).stat() if source else None
    except OSError:
        return None
    return None if st is None else (st.st_mtime_ns, st.st_size)


# an estimate asks for its data's images once a step it runs, a search many times
@functools.lru_cache(maxsize=4)
def _peek(
    source: str | None, rows: int, stamp: tuple[int, int] | None
) -> tuple[int, tuple[int, int] | None]:
    if not source:
        return 0, None
    path = Path(source)
    if path.suffix not in (".jsonl", ".json") or not path.is_file():
        return 0, None
    most, sizes = 0, []
    with path.open() as f:
        for i, line in enumerate(f):
            if i >= rows:
                break
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                break  # a .json array or a bad line: the reader will say; no images known
            messages = row.get("messages") if isinstance(row, dict) else None
            if has_images(messages):
                most = max(most, _count_images(messages))
                sizes += _image_sizes(row, path, i + 1)
    return most, max(sizes, key=lambda s: s[0] * s[1], default=None)


def _image_sizes(row: dict, data_file: Path, line: int) -> list[tuple[int, int]]:
    """The (width, height) of each image file row `row` names (paths resolved as the data
    path resolves them); images that cannot be found or read are left out (the run says)."""
    images = row_images(row, data_file, None, "images", "messages")
    out = []
    for part in (p for m in row["messages"] if isinstance(m, dict) for p in _parts(m)):
        try:
            ref = images.image(part.get("image"), (), f"{data_file}:{line}")
            with pil().Image.open(ref.path) as image:  # the header only
                out.append(image.size)
        except (UserError, OSError, SyntaxError, ValueError):
            continue
    return out


def _parts(message: dict) -> list[dict]:
    content = message.get("content")
    if not isinstance(content, list):
        return []
    return [p for p in content if isinstance(p, dict) and p.get("type") == "image"]


def _count_images(messages: list) -> int:
    return sum(len(_parts(m)) for m in messages if isinstance(m, dict))


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
    image, note = None, None
    if vision.tower == "siglip":
        s = SiglipArgs.from_hf(config)
        pixels = (s.num_channels, s.image_size, s.image_size)
        tokens = s.mm_tokens_per_image
    else:
        pixels, tokens = None, 0
        size = largest_image(cfg.data.source)
        folder = cfg.model.tokenizer or folder
        prepared = _prepared(str(folder), size, token_id) if size is not None else None
        if prepared is None:
            why = (
                "the checkpoint's processor could not prepare one"
                if size
                else "no image file of the first rows could be read"
            )
            note = f"images: not in the step ({why}); the tower's weights are counted"
        else:
            image, tokens = prepared
            pixels = tuple(image.pixel_values.shape)
            note = (
                f"images as the largest of the first {PEEK_ROWS} rows': {size[0]}x{size[1]}, "
                f"{tokens} tokens each"
            )
    # the images of a row fit in it, with a token before and after (none fits: no images);
    # a size-dependent tower's images each with a text token after (each run of image tokens
    # is one image: Qwen3.5's 3-D positions)
    if not tokens:
        fits = per_row
    elif image is None:
        fits = (cfg.data.seq_len - 2) // tokens
    else:
        fits = (cfg.data.seq_len - 1) // (tokens + 1)
    if not fits:
        pixels = image = None
        if note is not None:
            note = f"images: not in the step ({tokens} tokens each: none fits --seq-len)"
    return ImagePlan(max(1, min(per_row, fits)), tokens, token_id, pixels, image, note)


@functools.lru_cache(maxsize=4)
def _prepared(folder: str, size: tuple[int, int], token_id: int) -> tuple[ImageInputs, int] | None:
    """One image of `size` (width, height) as the processor in `folder` prepares it, and its
    image tokens (`token_id`) as tokenising counts them; None where the processor cannot be
    loaded (a missing package) or cannot place an image (no chat template that does)."""
    try:
        processor = load_processor(folder)
        if processor is None:
            return None
        picture = pil().Image.new("RGB", size, (127, 127, 127))
        prepared = processor.image_processor(images=[picture], return_tensors="pt")
        return ImageInputs.from_processor(prepared), _image_tokens(processor, picture, token_id)
    except (UserError, ValueError):  # the run itself says what is wrong, with the row
        return None


def _image_tokens(processor: Any, picture: Any, token_id: int) -> int:
    """The image tokens the processor gives `picture` where a chat template places an image
    (the placeholder it expands: `data/image_tokens.py`)."""
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "x"}]}]
    text = processor.apply_chat_template(messages, tokenize=False)
    placeholder = image_placeholder(processor, text, 1, "the estimate's image")
    ids = processor(text=[placeholder], images=[picture], add_special_tokens=False)
    return sum(1 for i in ids["input_ids"][0] if i == token_id)


def add_images(batch: dict[str, Tensor], plan: ImagePlan) -> dict:
    """`batch` (random tokens) with `plan`'s images: each row's image tokens from its second
    position on (one run for all of a row's random pixels; a text token after each prepared
    image's), without targets (the loss is on the reply's text)."""
    if plan.pixels is None:
        return batch
    tokens, targets = batch["inputs"], batch["targets"]
    rows = tokens.shape[0]
    tokens[tokens == plan.token_id] = 0  # a random token that is the image token's id: text
    if plan.image is None:  # random pixels (Gemma 3): one run of the row's image tokens
        runs = [(1, plan.per_row * plan.tokens)]
    else:  # each image's own run of tokens, a text token after it
        runs = [(1 + i * (plan.tokens + 1), plan.tokens) for i in range(plan.per_row)]
    for start, n in runs:
        tokens[:, start : start + n] = plan.token_id
        targets[:, start : start + n] = IGNORE_INDEX
    count = rows * plan.per_row
    if plan.image is not None:
        images = ImageInputs.concat([plan.image] * count)
    else:
        images = ImageInputs(torch.randn(count, *plan.pixels))
    return {
        **batch,
        "images": images,
        "image_rows": torch.arange(rows).repeat_interleave(plan.per_row),
    }
