"""ImageInputs: the image tensors of a processor's output, moved and concatenated."""

import torch

from compiletune.models.vision.inputs import ImageInputs


def test_from_processor_keeps_image_keys_only():
    batch = {
        "input_ids": torch.ones(1, 5, dtype=torch.long),
        "pixel_values": torch.rand(4, 12),
        "image_grid_thw": [[1, 2, 2]],
    }
    images = ImageInputs.from_processor(batch)
    assert images is not None and images.image_position_ids is None
    assert images.image_grid_thw.tolist() == [[1, 2, 2]] and images.num_images == 1
    assert ImageInputs.from_processor({"input_ids": batch["input_ids"]}) is None


def test_to_casts_pixels_only_and_concat():
    a = ImageInputs(torch.rand(2, 3, 8), image_position_ids=torch.zeros(2, 3, 2, dtype=torch.long))
    b = a.to("cpu", dtype=torch.float64)
    assert b.pixel_values.dtype == torch.float64 and b.image_position_ids.dtype == torch.long
    both = ImageInputs.concat([a, a])
    assert both.num_images == 4 and both.image_position_ids.shape == (4, 3, 2)
    assert ImageInputs.concat([]) is None
