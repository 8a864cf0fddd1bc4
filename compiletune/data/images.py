"""Images in conversations: `messages` whose content is a list of parts.

    {"messages": [
        {"role": "user", "content": [
            {"type": "image", "image": "charts/q3.png"},
            {"type": "text", "text": "What does the chart show?"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "Sales rose ..."}]}]}

An image part names a local file; a relative path is read from the data file's folder (so a data
set moves with its images). `parse_image_messages` checks a row's parts and gives the messages as
the processors' chat templates take them (`{"type": "image"}` placeholders) with the images in
order; `load_image` opens one; `process_example` hands both to the checkpoint's own processor
(transformers' `AutoProcessor`), which resizes and normalises the pixels and whose chat template
places the image tokens.

Every problem with a row (a part that is not text or image, a missing, unreadable or oversized
image) is a `UserError` of one line that names the row (`where`: FILE:LINE) and the fix.

Pillow is an optional dependency, the `vision` extra: text-only runs never import it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from compiletune.errors import UserError

if TYPE_CHECKING:
    from PIL.Image import Image

# Larger images are refused rather than decoded: a processor resizes every image to at most a
# few megapixels anyway, and a 100-megapixel scan would take gigabytes in a data worker.
# (Pillow's own guard against decompression bombs warns at about 89 MP.)
MAX_IMAGE_PIXELS = 64 * 1024 * 1024

PART_TYPES = ("text", "image")


def pil() -> Any:
    """The PIL package; a `UserError` naming the extra when Pillow is not installed."""
    # Imported here, not at the top: Pillow is the optional `vision` extra, and text-only runs
    # import this module's package without needing it.
    try:
        import PIL.Image
    except ImportError:
        raise UserError(
            "the data has images, which need Pillow: pip install 'compiletune[vision]'"
        ) from None
    return PIL


@dataclass(frozen=True)
class ImageRef:
    """One image of a row: its file and where the row names it (for errors)."""

    path: Path
    where: str  # FILE:LINE messages[i].content[j]


def has_image_parts(messages: Any) -> bool:
    """Whether a row's `messages` hold content parts (lists) rather than plain strings."""
    return isinstance(messages, list) and any(
        isinstance(m, dict) and isinstance(m.get("content"), list) for m in messages
    )


def _text_part(part: dict, where: str) -> dict:
    text = part.get("text")
    if not isinstance(text, str):
        raise UserError(f'{where}: a text part needs "text": a string; fix the row')
    return {"type": "text", "text": text}


def _image_part(part: dict, folder: Path, where: str) -> ImageRef:
    name = part.get("image")
    if not isinstance(name, str) or not name:
        got = "missing" if name is None else f"a {type(name).__name__}"
        raise UserError(
            f'{where}: an image part needs "image": a file path (got {got}); fix the row'
        )
    path = Path(name).expanduser()
    path = path if path.is_absolute() else folder / path
    if not path.is_file():
        raise UserError(
            f"{where}: image {name} not found (looked for {path}; relative paths are read from "
            "the data file's folder); fix the path or remove the row"
        )
    return ImageRef(path, where)


def _content(content: Any, folder: Path, where: str) -> tuple[list[dict], list[ImageRef]]:
    """One message's content as parts, and its images."""
    if isinstance(content, str):
        return [{"type": "text", "text": content}], []
    if not isinstance(content, list):
        raise UserError(
            f"{where}: content must be a string or a list of parts, got "
            f"{type(content).__name__}; fix the row"
        )
    parts, images = [], []
    for j, part in enumerate(content):
        at = f"{where}.content[{j}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text":
            parts.append(_text_part(part, at))
        elif kind == "image":
            images.append(_image_part(part, folder, at))
            parts.append({"type": "image"})
        else:
            got = f"type {kind!r}" if isinstance(part, dict) else f"a {type(part).__name__}"
            raise UserError(
                f'{at}: a content part must be {{"type": "text" or "image", ...}}, got {got} '
                "(images only: no video or audio); fix the row"
            )
    return parts, images


def parse_image_messages(
    messages: Any, data_file: str | Path, where: str
) -> tuple[list[dict], list[ImageRef]]:
    """A row's `messages` with content parts -> (messages for the processor's chat template,
    with `{"type": "image"}` where each image goes; the images in the order they appear).

    `data_file` is the file the row came from: relative image paths are read from its folder.
    `where` names the row in errors (FILE:LINE). Files are checked to exist, not opened.
    """
    if not isinstance(messages, list) or not messages:
        raise UserError(f'{where}: "messages" must be a non-empty list of messages; fix the row')
    folder = Path(data_file).expanduser().resolve().parent
    out, images = [], []
    for i, message in enumerate(messages):
        at = f"{where} messages[{i}]"
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise UserError(f'{at}: a message needs "role": a string; fix the row')
        parts, found = _content(message.get("content"), folder, at)
        extra = {k: v for k, v in message.items() if k not in ("role", "content") and v is not None}
        out.append({"role": message["role"], "content": parts, **extra})
        images += found
    return out, images


def load_image(ref: ImageRef, max_pixels: int = MAX_IMAGE_PIXELS) -> Image:
    """The image `ref` names, decoded as RGB. A file Pillow cannot read, or one of more than
    `max_pixels` pixels (checked from its header, before decoding), is a `UserError`."""
    PIL = pil()
    try:
        with PIL.Image.open(ref.path) as image:
            width, height = image.size
            if width * height > max_pixels:
                raise _oversized(ref, f"{width}x{height}", max_pixels)
            return image.convert("RGB")  # decodes the pixels (a truncated file fails here)
    except PIL.Image.DecompressionBombError:
        raise _oversized(ref, "too large for Pillow", max_pixels) from None
    except (PIL.UnidentifiedImageError, OSError, SyntaxError) as error:
        reason = " ".join(str(error).split()) or type(error).__name__
        raise UserError(
            f"{ref.where}: image {ref.path} cannot be read ({reason}); replace the file or "
            "remove the row"
        ) from None


def _oversized(ref: ImageRef, size: str, max_pixels: int) -> UserError:
    return UserError(
        f"{ref.where}: image {ref.path} is {size}, over the limit of {max_pixels} pixels; "
        "downscale it or remove the row"
    )


def process_example(
    processor: Any, messages: list[dict], images: list[ImageRef], max_pixels: int = MAX_IMAGE_PIXELS
) -> dict[str, Any]:
    """One conversation through the checkpoint's processor: the chat template renders it with
    the image placeholders, the processor expands them to the image tokens and prepares the
    pixels. Returns its tensors ([1, s] input_ids and attention_mask, pixel_values, and what
    the family adds: token_type_ids for Gemma 3, image_grid_thw for Qwen3.5)."""
    text = processor.apply_chat_template(messages, tokenize=False)
    pictures = [load_image(ref, max_pixels) for ref in images]
    if not pictures:
        return dict(processor(text=[text], return_tensors="pt"))
    return dict(processor(text=[text], images=[pictures], return_tensors="pt"))
