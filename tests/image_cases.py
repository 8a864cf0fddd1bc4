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


QWEN_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% for p in m['content'] %}"
    "{% if p['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% else %}{{ p['text'] }}{% endif %}{% endfor %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
QWEN_TOKENS = {"image_token": "<|image_pad|>"}
QWEN_TOKENS |= {"vision_start_token": "<|vision_start|>", "vision_end_token": "<|vision_end|>"}


class TinyQwenProcessor(transformers.Qwen3VLProcessor):
    """Qwen3.5's processor without its video processor (transformers' video processors need
    torchvision, not installed here, so AutoProcessor cannot load Qwen3.5's: tests hand this one
    to the code in place of its `load_processor`)."""

    def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kw):
        transformers.ProcessorMixin.__init__(
            self, image_processor, tokenizer, chat_template=chat_template
        )
        self.image_token, self.image_token_id = tokenizer.image_token, tokenizer.image_token_id
        self.vision_start_token = QWEN_TOKENS["vision_start_token"]
        self.vision_end_token = QWEN_TOKENS["vision_end_token"]
        self.video_token = "<|video_pad|>"


def tokenizer_with(tokens: dict[str, str]) -> transformers.PreTrainedTokenizerFast:
    """The byte tokenizer with a family's image tokens (ids 259 on)."""
    base = byte_tokenizer()
    base.add_special_tokens({"additional_special_tokens": list(tokens.values())})
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=base.backend_tokenizer,
        bos_token=base.bos_token,
        eos_token=base.eos_token,
        pad_token=base.pad_token,
        extra_special_tokens=tokens,
    )


def qwen_processor(max_side: int = 32) -> TinyQwenProcessor:
    """Patches of 4 merged 2x2: 16x16 pixels take 4 image tokens, 32x32 take 16; images of
    more than `max_side` squared pixels are scaled down to that."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,  # beside Gemma 3's above, for the Qwen3.5 tests only
    )

    images = Qwen2VLImageProcessorPil(
        patch_size=4, temporal_patch_size=2, merge_size=2, min_pixels=8 * 8, max_pixels=max_side**2
    )
    return TinyQwenProcessor(images, tokenizer_with(QWEN_TOKENS), chat_template=QWEN_TEMPLATE)


def save_tiny_qwen35_checkpoint(folder, processor: TinyQwenProcessor) -> None:
    """A tiny Qwen3.5 vision checkpoint (random tower) whose image tokens are `processor`'s,
    saved with the processor's files in `folder`."""
    import torch
    from vision_cases import qwen35_config, randomize

    config = qwen35_config()
    # Gated DeltaNet heads of the text model's size (transformers' defaults are a 9B's)
    text = config.text_config
    text.linear_num_key_heads, text.linear_num_value_heads = 2, 4
    text.linear_key_head_dim = text.linear_value_head_dim = 16
    tok = processor.tokenizer
    config.image_token_id = tok.image_token_id
    config.vision_start_token_id = tok.convert_tokens_to_ids(processor.vision_start_token)
    config.vision_end_token_id = tok.convert_tokens_to_ids(processor.vision_end_token)
    torch.manual_seed(0)
    hf = transformers.Qwen3_5ForConditionalGeneration(config).eval()
    randomize(hf.model.visual, 3)
    hf.save_pretrained(folder)
    processor.save_pretrained(folder)


GEMMA4_TEMPLATE = (
    "{% for m in messages %}<|turn>{{ 'model' if m['role'] == 'assistant' else m['role'] }}\n"
    "{% for p in m['content'] %}"
    "{% if p['type'] == 'image' %}<|image|>{% else %}{{ p['text'] }}{% endif %}"
    "{% endfor %}<turn|>\n{% endfor %}{% if add_generation_prompt %}<|turn>model\n{% endif %}"
)
GEMMA4_TOKENS = {"image_token": "<|image|>", "boi_token": "<|image>", "eoi_token": "<image|>"}


class TinyGemma4Processor(transformers.Gemma4Processor):
    """Gemma 4's processor without its video processor (which needs torchvision) or audio."""

    def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kw):
        self.image_seq_length = 70
        self.image_token_id, self.image_token = tokenizer.image_token_id, tokenizer.image_token
        self.boi_token, self.eoi_token = tokenizer.boi_token, tokenizer.eoi_token
        self.video_token, self.video_token_id = "<|video|>", None
        self.audio_token = self.audio_token_id = None
        # transformers' input check asks for these even without audio (never used here)
        self.boa_token, self.eoa_token = "<|audio>", "<audio|>"
        transformers.ProcessorMixin.__init__(
            self, image_processor, tokenizer, chat_template=chat_template
        )


def gemma4_processor() -> TinyGemma4Processor:
    """Patches of 4 pooled 2x2, at most 70 image tokens an image."""
    from transformers.models.gemma4.image_processing_pil_gemma4 import (
        Gemma4ImageProcessorPil,  # beside Gemma 3's above, for the Gemma 4 tests only
    )

    images = Gemma4ImageProcessorPil(patch_size=4, pooling_kernel_size=2, max_soft_tokens=70)
    tokenizer = tokenizer_with(GEMMA4_TOKENS)
    return TinyGemma4Processor(images, tokenizer, chat_template=GEMMA4_TEMPLATE)


def save_tiny_gemma4_checkpoint(folder, processor: TinyGemma4Processor) -> None:
    """A tiny Gemma 4 vision checkpoint (random tower) whose image tokens are `processor`'s,
    saved with the processor's files in `folder`."""
    from vision_cases import gemma4_pair

    hf, _, _ = gemma4_pair()
    tok = processor.tokenizer
    hf.config.image_token_id = tok.image_token_id
    hf.config.boi_token_id = tok.convert_tokens_to_ids(tok.boi_token)
    hf.config.eoi_token_id = tok.convert_tokens_to_ids(tok.eoi_token)
    hf.save_pretrained(folder)
    processor.save_pretrained(folder)
