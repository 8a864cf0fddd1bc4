"""Images in `messages` content parts: parsing, the errors that name the row, and pixels through
the checkpoint's own processor into the native vision towers.

Every image is a small PNG written here; every processor is a tiny one saved here and read back
with `AutoProcessor` (nothing is downloaded).
"""

from __future__ import annotations

import sys

import pytest
import torch
import transformers
from image_cases import png, save_tiny_gemma3_processor
from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
from vision_cases import (
    gemma3_pair,
    gemma4_pair,
    hf_gemma3_features,
    hf_gemma4_features,
    hf_qwen35_features,
    qwen35_pair,
    rel,
)

from compiletune.data.images import (
    ImageRef,
    has_image_parts,
    load_image,
    parse_image_messages,
    process_example,
)
from compiletune.errors import UserError


def conversation(*user_parts, reply: str = "a red square") -> list[dict]:
    return [
        {"role": "user", "content": list(user_parts)},
        {"role": "assistant", "content": [{"type": "text", "text": reply}]},
    ]


@pytest.fixture
def data_dir(tmp_path):
    """data/train.jsonl's folder, with data/img/a.png (20x12) and data/img/b.png (9x30)."""
    png(tmp_path / "data" / "img" / "a.png", 20, 12, seed=1)
    png(tmp_path / "data" / "img" / "b.png", 9, 30, seed=2)
    return tmp_path / "data"


def test_parts_parse_with_paths_relative_to_the_data_file(data_dir, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # relative to the data file, not to where the run starts
    absolute = str(data_dir / "img" / "b.png")
    messages = [{"role": "system", "content": "Be brief."}] + conversation(
        {"type": "image", "image": "img/a.png"},
        {"type": "text", "text": "and"},
        {"type": "image", "image": absolute},
    )
    assert has_image_parts(messages) and not has_image_parts(messages[:1])
    out, images = parse_image_messages(messages, data_dir / "train.jsonl", "train.jsonl:3")
    assert [ref.path for ref in images] == [data_dir / "img" / "a.png", data_dir / "img" / "b.png"]
    assert images[0].where == "train.jsonl:3 messages[1].content[0]"
    assert out[0] == {"role": "system", "content": [{"type": "text", "text": "Be brief."}]}
    assert out[1]["content"] == [
        {"type": "image"},
        {"type": "text", "text": "and"},
        {"type": "image"},
    ]
    assert out[2]["role"] == "assistant"
    picture = load_image(images[1])
    assert picture.mode == "RGB" and picture.size == (9, 30)


def test_grey_images_come_as_rgb(tmp_path):
    path = png(tmp_path / "grey.png", 7, 5, mode="L")
    picture = load_image(ImageRef(path, "d.jsonl:1"))
    assert picture.mode == "RGB" and picture.size == (7, 5)


def test_missing_image_names_the_row(data_dir):
    messages = conversation({"type": "image", "image": "img/nope.png"})
    with pytest.raises(UserError) as caught:
        parse_image_messages(messages, data_dir / "train.jsonl", "train.jsonl:7")
    message = str(caught.value)
    assert message.startswith("train.jsonl:7 messages[0].content[0]: image img/nope.png not found")
    assert str(data_dir / "img" / "nope.png") in message and "\n" not in message


@pytest.mark.parametrize("content", [b"not a png at all", "truncated"])
def test_unreadable_image_names_the_row(tmp_path, content):
    path = tmp_path / "bad.png"
    if content == "truncated":  # a real PNG header, its pixel data cut off
        png(path, 64, 64)
        path.write_bytes(path.read_bytes()[:200])
    else:
        path.write_bytes(content)
    with pytest.raises(
        UserError, match=r"^d\.jsonl:2 messages\[0\]\.content\[1\]: image .*bad\.png cannot be read"
    ):
        load_image(ImageRef(path, "d.jsonl:2 messages[0].content[1]"))


def test_oversized_image_names_the_row(data_dir):
    ref = ImageRef(data_dir / "img" / "a.png", "d.jsonl:4 messages[0].content[0]")
    assert load_image(ref, max_pixels=240).size == (20, 12)  # exactly the limit passes
    with pytest.raises(
        UserError, match=r"^d\.jsonl:4 .*a\.png is 20x12, over the limit of 239 pixels"
    ):
        load_image(ref, max_pixels=239)


@pytest.mark.parametrize(
    ("part", "error"),
    [
        ({"type": "video", "video": "v.mp4"}, r"got type 'video' \(images only"),
        ({"type": "image"}, r'an image part needs "image": a file path \(got missing\)'),
        ({"type": "image", "image": 3}, r"\(got a int\)"),
        ({"type": "text"}, r'a text part needs "text"'),
        ("just a string", r"got a str"),
    ],
)
def test_bad_parts_name_the_row(data_dir, part, error):
    with pytest.raises(
        UserError, match=r"^d\.jsonl:9 messages\[0\]\.content\[0\]: " + ".*" + error
    ):
        parse_image_messages(conversation(part), data_dir / "d.jsonl", "d.jsonl:9")


def test_bad_messages_name_the_row(data_dir):
    with pytest.raises(UserError, match=r'^d\.jsonl:1: "messages" must be a non-empty list'):
        parse_image_messages([], data_dir / "d.jsonl", "d.jsonl:1")
    with pytest.raises(UserError, match=r'^d\.jsonl:1 messages\[1\]: a message needs "role"'):
        parse_image_messages(
            [{"role": "user", "content": "x"}, {"content": "y"}], "d.jsonl", "d.jsonl:1"
        )
    with pytest.raises(
        UserError, match=r"^d\.jsonl:1 messages\[0\]: content must be a string or a list"
    ):
        parse_image_messages([{"role": "user", "content": {"a": 1}}], "d.jsonl", "d.jsonl:1")


def test_missing_pillow_names_the_extra(tmp_path, monkeypatch):
    path = png(tmp_path / "a.png", 4, 4)
    monkeypatch.setitem(sys.modules, "PIL", None)  # `import PIL...` now raises ImportError
    monkeypatch.setitem(sys.modules, "PIL.Image", None)
    with pytest.raises(UserError, match=r"need Pillow: pip install 'compiletune\[vision\]'"):
        load_image(ImageRef(path, "d.jsonl:1"))


# ------------------------------------------------ pixels: the checkpoint's processor -> the tower


def test_gemma3_processor_pixels_through_the_native_tower(data_dir, tmp_path):
    """Two PNGs of different sizes -> AutoProcessor (a saved tiny Gemma 3 processor) -> 16 image
    tokens each in the ids, pixels that the native tower turns into the features transformers'
    tower gives."""
    save_tiny_gemma3_processor(tmp_path / "proc")
    processor = transformers.AutoProcessor.from_pretrained(tmp_path / "proc")
    messages, images = parse_image_messages(
        conversation(
            {"type": "image", "image": "img/a.png"},
            {"type": "text", "text": "Which is taller?"},
            {"type": "image", "image": "img/b.png"},
        ),
        data_dir / "train.jsonl",
        "train.jsonl:1",
    )
    batch = process_example(processor, messages, images)
    image_token = processor.tokenizer.image_token_id
    assert (batch["input_ids"] == image_token).sum() == 2 * 16
    assert batch["pixel_values"].shape == (2, 3, 32, 32)

    hf, ours, _ = gemma3_pair()
    with torch.no_grad():
        ref = hf_gemma3_features(hf, batch["pixel_values"])
        out = ours(batch["pixel_values"])
    assert rel(out, ref) <= 1e-5


def test_qwen35_image_processor_pixels_through_the_native_tower(data_dir):
    """Qwen3.5's image processor (its AutoProcessor also needs a video processor, which needs
    torchvision) on two PNGs of different sizes: patches and grids that the native tower turns
    into the features transformers' tower gives."""
    _, images = parse_image_messages(
        conversation(
            {"type": "image", "image": "img/a.png"}, {"type": "image", "image": "img/b.png"}
        ),
        data_dir / "train.jsonl",
        "train.jsonl:1",
    )
    image_processor = Qwen2VLImageProcessorPil(
        patch_size=4, temporal_patch_size=2, merge_size=2, min_pixels=8 * 8, max_pixels=32 * 32
    )
    inputs = image_processor(images=[load_image(ref) for ref in images], return_tensors="pt")
    grid = inputs["image_grid_thw"]
    assert len(grid) == 2 and not torch.equal(grid[0], grid[1])  # two sizes

    hf, ours, _ = qwen35_pair()
    with torch.no_grad():
        ref = hf_qwen35_features(hf, inputs["pixel_values"], grid)
        out = ours(inputs["pixel_values"], grid)
    assert rel(out, ref) <= 1e-5


def test_gemma4_image_processor_pixels_through_the_native_tower(data_dir):
    """Gemma 4's image processor on two PNGs of different aspect ratios: padded patches and
    positions that the native tower turns into the features transformers' tower gives, as many
    tokens as the processor counts."""
    _, images = parse_image_messages(
        conversation(
            {"type": "image", "image": "img/a.png"}, {"type": "image", "image": "img/b.png"}
        ),
        data_dir / "train.jsonl",
        "train.jsonl:1",
    )
    image_processor = Gemma4ImageProcessorPil(
        patch_size=4, pooling_kernel_size=2, max_soft_tokens=70
    )
    inputs = image_processor(images=[load_image(ref) for ref in images], return_tensors="pt")
    pixels, positions = inputs["pixel_values"], inputs["image_position_ids"]

    hf, ours, _ = gemma4_pair()
    with torch.no_grad():
        ref = hf_gemma4_features(hf, pixels, positions)
        out = ours(pixels, positions)
    assert out.shape[0] == int(inputs["num_soft_tokens_per_image"].sum())
    assert rel(out, ref) <= 1e-5


@pytest.mark.parametrize(
    "error,names",
    [
        (ValueError("Can't load video processor for 'x'"), "pip install torchvision"),
        (OSError("preprocessor_config.json is not valid JSON"), "compiletune[vision]"),
    ],
)
def test_a_processor_that_cannot_load_names_what_to_install(tmp_path, monkeypatch, error, names):
    from compiletune.data.tokenizer import load_processor

    (tmp_path / "preprocessor_config.json").write_text("{}")

    def fail(*args, **kwargs):
        raise error

    monkeypatch.setattr(transformers.AutoProcessor, "from_pretrained", fail)
    with pytest.raises(UserError, match="could not load the image processor") as caught:
        load_processor(tmp_path)
    assert names in str(caught.value) and "\n" not in str(caught.value)
