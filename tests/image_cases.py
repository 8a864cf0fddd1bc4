"""Images and processors made in the tests: random PNGs and a tiny Gemma 3 processor (over the
byte tokenizer) saved to a folder that `AutoProcessor` reads back. Shared by the data, training
and estimate tests, from any folder under tests/ (pytest puts this folder on the path)."""

from __future__ import annotations

import numpy as np
import torch
import transformers
from PIL import Image
from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil
from vision_cases import gemma3_config, randomize

from compiletune.data.tokenizer import byte_tokenizer


def png(path, width: int, height: int, seed: int = 0, mode: str = "RGB"):
    """A random-coloured PNG of `width` x `height` at `path` (folders made)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    Image.fromarray(pixels).convert(mode).save(path)
    return path


GEMMA3_TEMPLATE = (
    "{% for m in messages %}### {{ m['role'] }}:\n{% for p in m['content'] %}"
    "{% if p['type'] == 'image' %}<start_of_image>{% else %}{{ p['text'] }}{% endif %}"
    "{% endfor %}<|end_of_text|>{% endfor %}"
)


def save_tiny_gemma3_processor(folder) -> None:
    """Gemma 3's processor over the byte tokenizer with Gemma 3's image tokens: 32x32 pixels,
    16 image tokens per image."""
    tokens = {"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>"}
    tokens["image_token"] = "<image_soft_token>"
    base = byte_tokenizer()
    base.add_special_tokens({"additional_special_tokens": list(tokens.values())})
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=base.backend_tokenizer,
        bos_token=base.bos_token,
        eos_token=base.eos_token,
        pad_token=base.pad_token,
        extra_special_tokens=tokens,
    )
    processor = transformers.Gemma3Processor(
        image_processor=Gemma3ImageProcessorPil(size={"height": 32, "width": 32}),
        tokenizer=tokenizer,
        chat_template=GEMMA3_TEMPLATE,
        image_seq_length=16,
    )
    processor.save_pretrained(folder)


def save_tiny_gemma3_checkpoint(folder) -> None:
    """A tiny Gemma 3 vision checkpoint (random tower and projector) with its processor, in
    `folder`: what the image runs from the CLI train."""
    torch.manual_seed(0)
    hf = transformers.Gemma3ForConditionalGeneration(
        gemma3_config(image_token_index=261, boi_token_index=259)
    ).eval()
    randomize(hf.model.vision_tower, 1)
    randomize(hf.model.multi_modal_projector, 2)
    hf.save_pretrained(folder)
    save_tiny_gemma3_processor(folder)
