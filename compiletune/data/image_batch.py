"""A batch's images: the pixels of the images its rows hold, prepared when the batch is taken
(the token cache keeps only their references, `ImageRef.to_json`).

`ImagePrep(processor)` is what `ExampleRows` calls with each row's image references: the
checkpoint's own image processor resizes and normalises the images of all rows in one call, in
the order their image tokens come (row by row, each row's examples in order), which is the order
the model merges them in. The batch gets `images` (`ImageInputs`) and `image_rows` (the row of
each image, int64 [n_images]: what a rank's share of the rows needs to pick its images).
"""

from __future__ import annotations

import itertools
from functools import partial
from typing import Any

import torch

from compiletune.data.images import MAX_IMAGE_PIXELS, ImageRef, load_image
from compiletune.data.token_store import PIXEL_JOB
from compiletune.models.vision.inputs import ImageInputs


class ImagePrep:
    """Prepares the pixels of a batch's images with the checkpoint's processor."""

    def __init__(self, processor: Any, max_pixels: int = MAX_IMAGE_PIXELS) -> None:
        self.processor, self.max_pixels = processor, max_pixels

    def __call__(self, refs_per_row: list[list[dict]]) -> dict[str, Any]:
        """`images` and `image_rows` of a batch whose row j holds `refs_per_row[j]`; nothing
        when no row holds an image."""
        refs = [ImageRef.from_json(ref) for row in refs_per_row for ref in row]
        if not refs:
            return {}
        pictures = [load_image(ref, self.max_pixels) for ref in refs]
        prepared = self.processor.image_processor(images=pictures, return_tensors="pt")
        rows = [j for j, row in enumerate(refs_per_row) for _ in row]
        return {
            "images": ImageInputs.from_processor(prepared),
            "image_rows": torch.tensor(rows, dtype=torch.int64),
        }


def join_batches(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """Batches of rows joined row after row (a mixture's draws): tensors concatenated, images
    concatenated in row order with their rows renumbered. Parts whose pixels are still to
    prepare (`PIXEL_JOB`) give a joined batch with one job that prepares and joins them."""
    keys = [k for k in parts[0] if k not in ("images", "image_rows", PIXEL_JOB)]
    out: dict[str, Any] = {k: torch.cat([p[k] for p in parts]) for k in keys}
    sizes = [p["inputs"].shape[0] for p in parts]
    jobs = [p.get(PIXEL_JOB) for p in parts]
    if any(job is not None for job in jobs):
        out[PIXEL_JOB] = partial(_join_jobs, sizes, jobs)
    else:
        out |= join_images(sizes, parts)
    return out


def _join_jobs(sizes: list[int], jobs: list[Any]) -> dict[str, Any]:
    return join_images(sizes, [{} if job is None else job() for job in jobs])


def join_images(sizes: list[int], parts: list[dict[str, Any]]) -> dict[str, Any]:
    """The `images` and `image_rows` of parts of `sizes` rows joined in order (nothing when
    none holds an image)."""
    with_images = [(i, p) for i, p in enumerate(parts) if p.get("images") is not None]
    if not with_images:
        return {}
    starts = [0, *itertools.accumulate(sizes)]
    return {
        "images": ImageInputs.concat([p["images"] for _, p in with_images]),
        "image_rows": torch.cat([p["image_rows"] + starts[i] for i, p in with_images]),
    }
