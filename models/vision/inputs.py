"""`ImageInputs`: a batch's images as the decoder's forward takes them (`images=`).

The interface between the data side (compiletune/data: the checkpoint's own processor runs in the
data workers) and the model side (models/: the vision towers and the decoder's image-token merge).
It holds exactly the image tensors the checkpoint's processor (transformers' `AutoProcessor`)
returns for a batch's images, under transformers' key names:

- `pixel_values`: every family. Gemma 3: [n_images, C, H, W]. Qwen3.5: the flattened patches of
  all images, [n_patches, C * temporal_patch * patch * patch]. Gemma 4: [n_images, max_patches,
  patch * patch * C] (each image's patches padded to the same count).
- `image_grid_thw`: Qwen3.5, [n_images, 3] (frames, patch rows, patch columns) per image.
- `image_position_ids`: Gemma 4, [n_images, max_patches, 2] (column, row) per patch, -1 on the
  padding patches.

Images are in the order their image tokens appear in the batch (row by row, left to right), the
order the processor gives when called on the batch's texts and images together. The image tokens
themselves are already in the token ids (the chat template placed them; the config's
`image_token_id` / `image_token_index`): the model finds them there, so the processor's per-token
type ids (`token_type_ids`, `mm_token_type_ids`) are not carried. Qwen3.5's 3-D text positions
are computed by the model from the token ids and `image_grid_thw`.

In a training batch (a dict) they are `batch["images"]`, with `batch["image_rows"]` (int64
[n_images], the row of each image): `compiletune/train/forward.py`'s `local_batch` keeps a part's
rows' images with `select`, and `forward_hidden` passes them as `images=`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields

import numpy as np
import torch
from torch import Tensor

from compiletune.torch_internals import host_array, host_tensor, is_fake

# transformers' key names, in the order they are carried
IMAGE_KEYS = ("pixel_values", "image_grid_thw", "image_position_ids")


@dataclass
class ImageInputs:
    """A batch's image tensors under the processor's key names (see the module docstring)."""

    pixel_values: Tensor
    image_grid_thw: Tensor | None = None
    image_position_ids: Tensor | None = None

    @classmethod
    def from_processor(cls, batch: Mapping) -> ImageInputs | None:
        """The image tensors out of a processor's output (a `BatchFeature` or any mapping; other
        keys such as `input_ids` are ignored); None when it holds no `pixel_values`."""
        if batch.get("pixel_values") is None:
            return None
        values = {}
        for key in IMAGE_KEYS:
            value = batch.get(key)
            values[key] = None if value is None else torch.as_tensor(value)
        return cls(**values)

    def to(self, device: torch.device | str, dtype: torch.dtype | None = None) -> ImageInputs:
        """The same inputs on `device`; `dtype`, when given, applies to `pixel_values` only (the
        grids and positions stay integers)."""
        out = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if value is not None:
                value = value.to(device, dtype=dtype if f.name == "pixel_values" else None)
            out[f.name] = value
        return ImageInputs(**out)

    @property
    def num_images(self) -> int:
        """How many images the batch holds."""
        if self.image_grid_thw is not None:
            return int(self.image_grid_thw.shape[0])
        return int(self.pixel_values.shape[0])

    def select(self, index: Tensor) -> ImageInputs | None:
        """The images at `index` (int [k], in the batch's order), in that order; None for none.
        Qwen3.5's flattened patches are picked by each image's t * h * w patch count."""
        index = torch.as_tensor(index, dtype=torch.long).cpu()
        if index.numel() == 0:
            return None
        grid = self.image_grid_thw
        if grid is None:
            pixels = self.pixel_values[index.to(self.pixel_values.device)]
            positions = self.image_position_ids
            if positions is not None and not is_fake(positions):  # on the host, as the grids
                positions = host_tensor(host_array(positions.cpu())[host_array(index)])
                positions = positions.to(self.image_position_ids.device)
            elif positions is not None:
                positions = positions[index.to(positions.device)]
            return ImageInputs(pixels, image_position_ids=positions)
        # on the host's values (numpy), so that the memory estimate's fake mode, whose step
        # reads a real batch, keeps the picked grid real: the tower's shapes follow from it
        picks = host_array(index)
        grids = host_array(grid.cpu())
        counts = grids.prod(-1)
        starts = np.cumsum(counts) - counts
        patches = np.concatenate([np.arange(starts[i], starts[i] + counts[i]) for i in picks])
        return ImageInputs(
            self.pixel_values[host_tensor(patches).to(self.pixel_values.device)],
            image_grid_thw=host_tensor(grids[picks]).to(grid.device),
        )

    @staticmethod
    def concat(parts: list[ImageInputs]) -> ImageInputs | None:
        """Several examples' images as one batch's (in order); None for none. Gemma 4's padded
        patches must have the same count in every part (the processor pads to one fixed count)."""
        if not parts:
            return None
        out = {}
        for f in fields(ImageInputs):
            values = [getattr(p, f.name) for p in parts]
            present = [v for v in values if v is not None]
            if present and len(present) != len(values):
                raise ValueError(f"ImageInputs.concat: {f.name} is missing from some parts")
            out[f.name] = torch.cat(present, dim=0) if present else None
        return ImageInputs(**out)
