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

import io
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from compiletune.data.sources import read_cell
from compiletune.errors import UserError

if TYPE_CHECKING:
    from PIL.Image import Image

# Larger images are refused rather than decoded: a processor resizes every image to at most a
# few megapixels anyway, and a 100-megapixel scan would take gigabytes in a data worker.
# (Pillow's own guard against decompression bombs warns at about 89 MP.)
MAX_IMAGE_PIXELS = 64 * 1024 * 1024

PART_TYPES = ("text", "image")


class ImageError(UserError):
    """A row's image that cannot be used (missing, unreadable, oversized): the row is skipped
    instead under --skip-bad-images."""


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
    """One image of a row: its file, or (an image held in the row itself: a parquet or arrow
    column of a Hub dataset) its bytes and the row's place, and where the row names it (for
    errors). The token cache keeps `to_json()`, never pixels."""

    path: Path | None
    where: str  # FILE:LINE messages[i].content[j]
    data: bytes | None = field(default=None, repr=False, compare=False)  # in-row image's bytes
    # an in-row image: (data file, row from 1, column, keys into the column's cell)
    row: tuple[str, int, str, tuple] | None = None

    def to_json(self) -> dict[str, Any]:
        """What the token cache keeps: the file, or the row and which of its images."""
        if self.path is not None:
            return {"path": str(self.path), "where": self.where}
        assert self.row is not None, "an in-row image knows its row"
        file, row, column, keys = self.row
        return {"file": file, "row": row, "column": column, "keys": list(keys), "where": self.where}

    @classmethod
    def from_json(cls, ref: dict[str, Any]) -> ImageRef:
        if "path" in ref:
            return cls(Path(ref["path"]), ref["where"])
        row = (ref["file"], int(ref["row"]), ref["column"], tuple(ref["keys"]))
        return cls(None, ref["where"], row=row)

    @property
    def name(self) -> str:
        """The image as a message names it: its file, or its place in the row."""
        if self.path is not None:
            return str(self.path)
        assert self.row is not None
        return f"{self.row[2]}{''.join(f'[{k!r}]' for k in self.row[3])}"


def has_image_parts(messages: Any) -> bool:
    """Whether a row's `messages` hold content parts (lists) rather than plain strings."""
    return isinstance(messages, list) and any(
        isinstance(m, dict) and isinstance(m.get("content"), list) for m in messages
    )


def has_images(messages: Any) -> bool:
    """Whether a row's `messages` hold an image part."""
    return has_image_parts(messages) and any(
        isinstance(p, dict) and p.get("type") == "image"
        for m in messages
        if isinstance(m, dict) and isinstance(m.get("content"), list)
        for p in m["content"]
    )


@dataclass
class RowImages:
    """Where a row's images come from besides files: its image column (`images`, a list, or
    `image`, one), which image parts without an "image" value take in order, and the row's
    place in its parquet or arrow file (FILE, row from 1) so the cache can name them."""

    folder: Path  # relative paths are read from here (the data file's folder)
    column: str | None = None  # the row's image column, when it has one
    values: list = field(default_factory=list)  # that column's images
    listed: bool = True  # the column holds a list of images (else one image)
    place: tuple[str, int] | None = None  # (data file, row from 1) of parquet / arrow rows
    messages_column: str = "messages"
    taken: int = 0  # column images given to parts so far

    def image(self, value: Any, keys: tuple, where: str) -> ImageRef:
        """The image of a part: `value` (a path, or an in-row {"bytes", "path"}), or with no
        value the column's next image. `keys`: where `value` sits in its column's cell."""
        column = self.messages_column
        if value is None and self.column is not None:
            if self.taken >= len(self.values):
                raise UserError(
                    f'{where}: an image part without "image" takes the row\'s next image from '
                    f"its {self.column!r} column, which holds {len(self.values)}; add the image "
                    "to the column or remove the part"
                )
            value, column = self.values[self.taken], str(self.column)
            keys = (self.taken,) if self.listed else ()
            self.taken += 1
        if isinstance(value, str) and value:
            return _file_image(value, self.folder, where)
        if isinstance(value, dict) and isinstance(value.get("bytes"), bytes):
            if self.place is None:
                raise UserError(
                    f"{where}: an image held in the row (bytes) is read from parquet or arrow "
                    "files only; save the image to a file and name its path"
                )
            row = (self.place[0], self.place[1], column, keys)
            return ImageRef(None, where, data=value["bytes"], row=row)
        if isinstance(value, dict) and isinstance(value.get("path"), str) and value["path"]:
            return _file_image(value["path"], self.folder, where)
        got = "missing" if value is None else f"a {type(value).__name__}"
        raise UserError(
            f'{where}: an image part needs "image": a file path (got {got}), or the row an '
            '"images" column holding the image; fix the row'
        )


def row_images(
    row: dict, data_file: str | Path, place: tuple[str, int] | None, column: str, messages: str
) -> RowImages:
    """The image source of `row` (from `data_file`; `place`: its file and row number when an
    in-row image can be read back from there): its `column` of images ("images" unless
    --data-columns maps it), else an `image` column of one image. `messages`: the column of
    the conversation."""
    folder = Path(data_file).expanduser().resolve().parent
    for name in (column, "image"):
        value = row.get(name)
        if value is not None:
            listed = isinstance(value, list)
            values = list(value) if listed else [value]
            return RowImages(folder, name, values, listed, place, messages)
    return RowImages(folder, None, [], True, place, messages)


def _file_image(name: str, folder: Path, where: str) -> ImageRef:
    path = Path(name).expanduser()
    path = path if path.is_absolute() else folder / path
    if not path.is_file():
        raise ImageError(
            f"{where}: image {name} not found (looked for {path}; relative paths are read from "
            "the data file's folder); fix the path or remove the row"
        )
    return ImageRef(path, where)


def _text_part(part: dict, where: str) -> dict:
    text = part.get("text")
    if not isinstance(text, str):
        raise UserError(f'{where}: a text part needs "text": a string; fix the row')
    return {"type": "text", "text": text}


def _content(
    content: Any, images: RowImages, i: int, where: str
) -> tuple[list[dict], list[ImageRef]]:
    """Message i's content as parts, and its images."""
    if isinstance(content, str):
        return [{"type": "text", "text": content}], []
    if not isinstance(content, list):
        raise UserError(
            f"{where}: content must be a string or a list of parts, got "
            f"{type(content).__name__}; fix the row"
        )
    parts, refs = [], []
    for j, part in enumerate(content):
        at = f"{where}.content[{j}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text":
            parts.append(_text_part(part, at))
        elif kind == "image":
            refs.append(images.image(part.get("image"), (i, "content", j, "image"), at))
            parts.append({"type": "image"})
        else:
            got = f"type {kind!r}" if isinstance(part, dict) else f"a {type(part).__name__}"
            raise UserError(
                f'{at}: a content part must be {{"type": "text" or "image", ...}}, got {got} '
                "(images only: no video or audio); fix the row"
            )
    return parts, refs


def parse_image_messages(
    messages: Any, data_file: str | Path, where: str, images: RowImages | None = None
) -> tuple[list[dict], list[ImageRef]]:
    """A row's `messages` with content parts -> (messages for the processor's chat template,
    with `{"type": "image"}` where each image goes; the images in the order they appear).

    `data_file` is the file the row came from: relative image paths are read from its folder.
    `images`: the row's image column (`row_images`), for parts without an "image" value.
    `where` names the row in errors (FILE:LINE). Files are checked to exist, not opened.
    """
    if not isinstance(messages, list) or not messages:
        raise UserError(f'{where}: "messages" must be a non-empty list of messages; fix the row')
    folder = Path(data_file).expanduser().resolve().parent
    images = images or RowImages(folder)
    out, refs = [], []
    for i, message in enumerate(messages):
        at = f"{where} messages[{i}]"
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise UserError(f'{at}: a message needs "role": a string; fix the row')
        parts, found = _content(message.get("content"), images, i, at)
        extra = {k: v for k, v in message.items() if k not in ("role", "content") and v is not None}
        out.append({"role": message["role"], "content": parts, **extra})
        refs += found
    if images.taken < len(images.values):
        raise UserError(
            f"{where}: the row's {images.column!r} column holds {len(images.values)} images and "
            f"its messages place {images.taken}; add an image part for each image"
        )
    return out, refs


def load_image(ref: ImageRef, max_pixels: int = MAX_IMAGE_PIXELS) -> Image:
    """The image `ref` names, decoded as RGB. A file Pillow cannot read, or one of more than
    `max_pixels` pixels (checked from its header, before decoding), is a `UserError`."""
    PIL = pil()
    try:
        source = ref.path if ref.path is not None else io.BytesIO(_image_bytes(ref))
        with PIL.Image.open(source) as image:
            width, height = image.size
            if width * height > max_pixels:
                raise _oversized(ref, f"{width}x{height}", max_pixels)
            return image.convert("RGB")  # decodes the pixels (a truncated file fails here)
    except PIL.Image.DecompressionBombError:
        raise _oversized(ref, "too large for Pillow", max_pixels) from None
    except (PIL.UnidentifiedImageError, OSError, SyntaxError) as error:
        reason = " ".join(str(error).split()) or type(error).__name__
        raise ImageError(
            f"{ref.where}: image {ref.name} cannot be read ({reason}); replace the file or "
            "remove the row"
        ) from None


def _oversized(ref: ImageRef, size: str, max_pixels: int) -> UserError:
    return ImageError(
        f"{ref.where}: image {ref.name} is {size}, over the limit of {max_pixels} pixels; "
        "downscale it or remove the row"
    )


def _image_bytes(ref: ImageRef) -> bytes:
    """An in-row image's bytes: held since the row was read, else read back from its row."""
    if ref.data is not None:
        return ref.data
    assert ref.row is not None, "an image is a file or in a row"
    file, row, column, keys = ref.row
    value = read_cell(Path(file), row, column)
    try:
        for key in keys:
            value = value[key]
        return value["bytes"]
    except (KeyError, IndexError, TypeError):
        raise ImageError(
            f"{ref.where}: the image is no longer in {file} (row {row}, column {column!r}); the "
            "data changed since it was tokenised: run again to tokenise it anew"
        ) from None


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
