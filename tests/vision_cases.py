"""Tiny vision-language models for the vision tests: transformers' own Gemma 3 and Qwen3.5 built
from configs here, every vision weight drawn at random (the checkpoints' zero-initialised projector
and norm weights would hide a wrong formula), and the native tower loaded from their tensors."""

from __future__ import annotations

import torch
import transformers

from compiletune.models.vision.common import load_hf_state_dict
from compiletune.models.vision.gemma4 import (
    Gemma4VisionArgs,
    Gemma4VisionTower,
    gemma4_vision_names,
)
from compiletune.models.vision.qwen import Qwen35VisionTower, QwenVisionArgs, qwen35_vision_names
from compiletune.models.vision.siglip import Gemma3VisionTower, SiglipArgs, gemma3_vision_names


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    assert torch.isfinite(a).all() and torch.isfinite(b).all()
    return ((a - b).norm() / b.norm()).item()


def randomize(module: torch.nn.Module, seed: int) -> None:
    """Every parameter drawn fresh (transformers zero-initialises some vision weights)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.2)


def gemma3_config(**overrides) -> transformers.Gemma3Config:
    vision = dict(
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        image_size=32,
        patch_size=4,
        vision_use_head=False,
    )
    text = dict(
        hidden_size=40,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        vocab_size=300,
    )
    top = dict(mm_tokens_per_image=16, image_token_index=299, boi_token_index=297)
    return transformers.Gemma3Config(
        text_config=text, vision_config=vision, eoi_token_index=298, **{**top, **overrides}
    )


def hf_gemma3_features(hf, pixels: torch.Tensor) -> torch.Tensor:
    return hf.model.get_image_features(pixels).pooler_output


IMAGE_TOKEN = 290


def qwen35_config() -> transformers.Qwen3_5Config:
    vision = dict(
        hidden_size=32,
        intermediate_size=48,
        depth=2,
        num_heads=2,
        patch_size=4,
        temporal_patch_size=2,
        spatial_merge_size=2,
        out_hidden_size=40,
        num_position_embeddings=16,
    )
    text = dict(
        hidden_size=40,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        vocab_size=300,
        layer_types=["linear_attention", "full_attention"],
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 10000.0,
            "partial_rotary_factor": 0.5,
            "mrope_section": [3, 3, 2],
            "mrope_interleaved": True,
        },
    )
    return transformers.Qwen3_5Config(
        text_config=text, vision_config=vision, image_token_id=IMAGE_TOKEN
    )


def hf_qwen35_features(hf, pixels: torch.Tensor, grid: torch.Tensor) -> torch.Tensor:
    return torch.cat(hf.model.get_image_features(pixels, grid).pooler_output)


def gemma3_pair() -> tuple[
    transformers.Gemma3ForConditionalGeneration, Gemma3VisionTower, SiglipArgs
]:
    """transformers' tiny Gemma 3 (eval, random vision weights) and our tower on its tensors."""
    torch.manual_seed(0)
    config = gemma3_config()
    hf = transformers.Gemma3ForConditionalGeneration(config).eval()
    randomize(hf.model.vision_tower, 1)
    randomize(hf.model.multi_modal_projector, 2)
    args = SiglipArgs.from_hf(config.to_dict())
    ours = Gemma3VisionTower(args)
    load_hf_state_dict(ours, hf.state_dict(), gemma3_vision_names(args), "tiny")
    return hf, ours, args


def qwen35_pair() -> tuple[
    transformers.Qwen3_5ForConditionalGeneration, Qwen35VisionTower, QwenVisionArgs
]:
    """transformers' tiny Qwen3.5 (eval, random vision weights) and our tower on its tensors."""
    torch.manual_seed(0)
    config = qwen35_config()
    hf = transformers.Qwen3_5ForConditionalGeneration(config).eval()
    randomize(hf.model.visual, 3)
    args = QwenVisionArgs.from_hf(config.to_dict())
    ours = Qwen35VisionTower(args)
    load_hf_state_dict(ours, hf.state_dict(), qwen35_vision_names(args), "tiny")
    return hf, ours, args


def gemma4_config() -> transformers.Gemma4Config:
    """Clipped linears and standardisation on, so their stored tensors are exercised."""
    vision = dict(
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        patch_size=4,
        pooling_kernel_size=2,
        position_embedding_size=64,
        standardize=True,
        use_clipped_linears=True,
    )
    text = dict(
        hidden_size=40,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        global_head_dim=16,
        vocab_size=300,
        vocab_size_per_layer_input=300,
        hidden_size_per_layer_input=8,
        layer_types=["sliding_attention", "full_attention"],
    )
    tokens = dict(image_token_id=290, boi_token_id=291, eoi_token_id=292, video_token_id=293)
    tokens.update(boa_token_id=294, eoa_token_index=295, audio_token_id=296)
    return transformers.Gemma4Config(
        text_config=text, vision_config=vision, audio_config=None, **tokens
    )


def gemma4_pair() -> tuple[
    transformers.Gemma4ForConditionalGeneration, Gemma4VisionTower, Gemma4VisionArgs
]:
    """transformers' tiny Gemma 4 (eval, random vision weights, clipping bounds that clip) and
    our tower on its tensors."""
    torch.manual_seed(0)
    config = gemma4_config()
    hf = transformers.Gemma4ForConditionalGeneration(config).eval()
    randomize(hf.model.vision_tower, 4)
    randomize(hf.model.embed_vision, 5)
    gen = torch.Generator().manual_seed(6)
    with torch.no_grad():
        for name, bound in hf.model.vision_tower.named_buffers():
            if name.endswith(("_min", "_max")):  # |bound| in [0.5, 1.5]: some values clip
                sign = -1.0 if name.endswith("_min") else 1.0
                bound.fill_(sign * (0.5 + torch.rand((), generator=gen).item()))
            elif name.endswith(("std_bias", "std_scale")):
                bound.copy_(torch.randn(bound.shape, generator=gen))
    args = Gemma4VisionArgs.from_hf(config.to_dict())
    ours = Gemma4VisionTower(args)
    load_hf_state_dict(ours, hf.state_dict(), gemma4_vision_names(args), "tiny")
    return hf, ours, args


def gemma4_patches(grids: list[tuple[int, int]], max_patches: int, patch_dim: int, seed: int = 0):
    """Random pixels [b, max_patches, patch_dim] in [0, 1] and (x, y) positions, (-1, -1) after
    each image's w x h patches, as Gemma 4's processor pads them."""
    gen = torch.Generator().manual_seed(seed)
    pixels = torch.rand(len(grids), max_patches, patch_dim, generator=gen)
    positions = torch.full((len(grids), max_patches, 2), -1, dtype=torch.long)
    for i, (w, h) in enumerate(grids):
        ys, xs = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
        positions[i, : w * h] = torch.stack((xs.flatten(), ys.flatten()), dim=-1)
        pixels[i, w * h :] = 0
    return pixels, positions


def hf_gemma4_features(hf, pixels: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    return torch.cat(hf.model.get_image_features(pixels, positions).pooler_output)
