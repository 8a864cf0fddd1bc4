"""Image conversations as tokens: the checkpoint's processor expands each image placeholder of
the chat template's rendering into the image's tokens, piece by piece, so the target flags of
the text pieces (the assistant's replies, `layouts.chat_examples`) carry over unchanged.

The number of tokens an image takes can depend on its size (Qwen3.5's dynamic resolution), so
tokenising reads every image once; the token cache then keeps the ids and the images'
references (`ImageRef.to_json`), and a batch prepares the pixels again from those
(`image_batch.py`).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from compiletune.data.images import MAX_IMAGE_PIXELS, ImageRef, load_image
from compiletune.errors import UserError

# The processor attributes that may hold what a chat template writes where an image goes:
# Qwen3.5 writes its image token (<|image_pad|>), Gemma 3 its begin-of-image token (which its
# processor also names `image_token`), Gemma 4 its own.
_PLACEHOLDERS = ("image_token", "boi_token")


def image_placeholder(processor: Any, text: str, n_images: int, where: str) -> str:
    """The text the processor's chat template writes for each image: the candidate that
    `text` (a rendered conversation) holds exactly `n_images` times."""
    counts = {}
    for name in _PLACEHOLDERS:
        token = getattr(processor, name, None)
        if isinstance(token, str) and token:
            counts[token] = text.count(token)
            if counts[token] == n_images:
                return token
    found = ", ".join(f"{t} {n} times" for t, n in counts.items()) or "no image token"
    raise UserError(
        f"{where}: the processor's chat template places {found} for the row's {n_images} "
        "images, so its image tokens cannot be matched to the images; use the checkpoint's own "
        "processor (chat_template.jinja / processor_config.json)"
    )


def image_token_ids(processor: Any) -> list[int]:
    """The ids of the tokens that stand for image features: never targets."""
    ids = {getattr(processor, "image_token_id", None)}
    ids.add(getattr(processor.tokenizer, "image_token_id", None))
    return sorted(i for i in ids if isinstance(i, int))


def encode_image_pieces(
    pieces: list[tuple[str, bool]],
    images: list[ImageRef],
    processor: Any,
    where: str,
    max_pixels: int = MAX_IMAGE_PIXELS,
) -> list[list[int]]:
    """The token ids of each text piece of an image example, its image placeholders expanded
    by the processor into the tokens of the images they stand for (in order). Every image is
    read (a missing, unreadable or oversized one is an `ImageError` naming the row)."""
    text = "".join(t for t, _ in pieces)
    placeholder = image_placeholder(processor, text, len(images), where)
    pictures = [load_image(ref, max_pixels) for ref in images]
    out, k = [], 0
    for piece, _ in pieces:
        n = piece.count(placeholder)
        kw = {"images": pictures[k : k + n]} if n else {}
        k += n
        try:
            ids = processor(text=[piece], add_special_tokens=False, return_tensors="np", **kw)
        except UserError:
            raise
        except Exception as e:  # the processor's own checks (sizes, counts)
            why = " ".join(str(e).split())[:200] or type(e).__name__
            raise UserError(f"{where}: the processor cannot prepare this row ({why})") from e
        out.append(np.asarray(ids["input_ids"][0]).tolist())
    return out
