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


def test_select_picks_images_and_their_patches():
    grid = torch.tensor([[1, 2, 2], [1, 2, 4], [1, 4, 2]])
    pixels = torch.arange(20.0)[:, None].expand(20, 3)
    qwen = ImageInputs(pixels, image_grid_thw=grid)
    picked = qwen.select(torch.tensor([0, 2]))
    assert picked.image_grid_thw.tolist() == [[1, 2, 2], [1, 4, 2]]
    assert picked.pixel_values[:, 0].tolist() == [0, 1, 2, 3, *range(12, 20)]
    gemma = ImageInputs(torch.rand(3, 4, 6), image_position_ids=torch.rand(3, 4, 2))
    assert torch.equal(gemma.select(torch.tensor([1])).pixel_values, gemma.pixel_values[1:2])
    assert gemma.select(torch.tensor([], dtype=torch.long)) is None


def test_local_batch_keeps_its_rows_images():
    from compiletune.train.forward import local_batch

    images = ImageInputs(torch.arange(3.0)[:, None, None, None].expand(3, 3, 2, 2))
    batch = {
        "inputs": torch.zeros(3, 5, dtype=torch.long),
        "images": images,
        "image_rows": torch.tensor([0, 2, 2]),
    }
    part = local_batch(batch, slice(1, 3), None, torch.device("cpu"))
    assert part["inputs"].shape == (2, 5) and "image_rows" not in part
    assert part["images"].pixel_values[:, 0, 0, 0].tolist() == [1.0, 2.0]
    assert "images" not in local_batch(batch, slice(1, 2), None, torch.device("cpu"))
