"""Gemma 3's vision tower: a SigLIP encoder and the multi-modal projector that turns its patches
into the decoder's image tokens.

    pixels [n, 3, S, S]
      -> patch embedding (conv, stride = patch) + learned positions   [n, (S/p)^2, d]
      -> encoder layers (pre-LayerNorm, bidirectional attention, GELU MLP)
      -> post LayerNorm
      -> projector: average-pool the patch grid to mm_tokens_per_image tokens,
         RMSNorm (1 + w), matmul into the text width                   [n, mm_tokens, d_text]

The image size is fixed by the checkpoint (Gemma 3's processor resizes, and pans and scans into
several such crops): a pixel tensor of another size is refused rather than interpolated.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from compiletune.errors import UserError
from compiletune.torch_internals import dynamic_dims

from .common import NameMap, activation, block_input, config_get


@dataclass(frozen=True)
class SiglipArgs:
    """Sizes of a SigLIP tower with Gemma 3's projector (from config.json)."""

    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    image_size: int
    patch_size: int
    num_channels: int = 3
    layer_norm_eps: float = 1e-6
    hidden_act: str = "gelu_pytorch_tanh"
    text_hidden_size: int = 0  # the projector's output width
    mm_tokens_per_image: int = 256

    @property
    def patches_per_side(self) -> int:
        return self.image_size // self.patch_size

    @classmethod
    def from_hf(cls, config: Mapping | object, where: str = "config.json") -> SiglipArgs:
        """From a Gemma 3 config (its `vision_config`, `text_config` and `mm_tokens_per_image`)."""
        vision = config_get(config, "vision_config")
        text = config_get(config, "text_config")
        if vision is None or text is None:
            raise UserError(
                f"{where}: a Gemma 3 vision checkpoint needs vision_config and text_config; "
                "this is a text-only config"
            )
        if config_get(vision, "vision_use_head", False):
            raise UserError(
                f"{where}: vision_config.vision_use_head is true; Gemma 3's tower has no "
                "pooling head (set it to false or use a Gemma 3 checkpoint)"
            )
        args = cls(
            hidden_size=int(config_get(vision, "hidden_size")),
            intermediate_size=int(config_get(vision, "intermediate_size")),
            num_layers=int(config_get(vision, "num_hidden_layers")),
            num_heads=int(config_get(vision, "num_attention_heads")),
            image_size=int(config_get(vision, "image_size")),
            patch_size=int(config_get(vision, "patch_size")),
            num_channels=int(config_get(vision, "num_channels", 3)),
            layer_norm_eps=float(config_get(vision, "layer_norm_eps", 1e-6)),
            hidden_act=str(config_get(vision, "hidden_act", "gelu_pytorch_tanh")),
            text_hidden_size=int(config_get(text, "hidden_size")),
            mm_tokens_per_image=int(config_get(config, "mm_tokens_per_image", 256)),
        )
        side = round(args.mm_tokens_per_image**0.5)
        if side * side != args.mm_tokens_per_image or args.patches_per_side % side:
            raise UserError(
                f"{where}: mm_tokens_per_image={args.mm_tokens_per_image} must be a square whose "
                f"side divides the {args.patches_per_side} patches per side"
            )
        return args


class SiglipAttention(nn.Module):
    """Bidirectional multi-head attention over one image's patches."""

    def __init__(self, args: SiglipArgs):
        super().__init__()
        d = args.hidden_size
        self.num_heads = args.num_heads
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(d, d) for _ in range(4))

    def forward(self, x: Tensor) -> Tensor:
        """x: [n, s, d] -> [n, s, d]."""
        n, s, d = x.shape
        heads = [
            w(x).view(n, s, self.num_heads, -1).transpose(1, 2) for w in (self.wq, self.wk, self.wv)
        ]
        out = F.scaled_dot_product_attention(*heads)  # [n, h, s, hd]
        return self.wo(out.transpose(1, 2).reshape(n, s, d))


class SiglipLayer(nn.Module):
    """Pre-LayerNorm encoder layer: x + attn(norm1(x)), then x + mlp(norm2(x))."""

    def __init__(self, args: SiglipArgs):
        super().__init__()
        d, eps = args.hidden_size, args.layer_norm_eps
        self.norm1 = nn.LayerNorm(d, eps=eps)
        self.attn = SiglipAttention(args)
        self.norm2 = nn.LayerNorm(d, eps=eps)
        self.fc1 = nn.Linear(d, args.intermediate_size)
        self.fc2 = nn.Linear(args.intermediate_size, d)
        self.act = activation(args.hidden_act, "vision_config")

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.fc2(self.act(self.fc1(self.norm2(x))))


class Gemma3VisionTower(nn.Module):
    """SigLIP encoder + Gemma 3's multi-modal projector: pixels to the decoder's image tokens."""

    def __init__(self, args: SiglipArgs):
        super().__init__()
        self.args = args
        d = args.hidden_size
        self.patch_embed = nn.Conv2d(args.num_channels, d, args.patch_size, stride=args.patch_size)
        self.pos_embed = nn.Embedding(args.patches_per_side**2, d)
        self.layers = nn.ModuleList(SiglipLayer(args) for _ in range(args.num_layers))
        self.post_norm = nn.LayerNorm(d, eps=args.layer_norm_eps)
        # Projector: RMSNorm stored as w, applied as (1 + w) in fp32 (Gemma's norm), and a
        # [d_vision, d_text] matrix used as x @ W (not a Linear: the checkpoint stores it so).
        self.proj_norm = nn.Parameter(torch.zeros(d))
        self.proj = nn.Parameter(torch.zeros(d, args.text_hidden_size))

    def encode(self, pixels: Tensor) -> Tensor:
        """pixels [n, c, S, S] -> the encoder's last hidden states [n, (S/p)^2, d]."""
        size = self.args.image_size
        if pixels.dim() != 4 or tuple(pixels.shape[-2:]) != (size, size):
            raise ValueError(
                f"Gemma 3's vision tower takes pixels [n, c, {size}, {size}] (the processor's "
                f"size), got {tuple(pixels.shape)}"
            )
        x = self.patch_embed(pixels.to(self.patch_embed.weight.dtype))  # [n, d, S/p, S/p]
        x = block_input(x.flatten(2).transpose(1, 2) + self.pos_embed.weight, self.layers)
        dynamic_dims(x, (0,))  # compiled layers: any number of images, one graph
        for layer in self.layers:
            x = layer(x)
        return self.post_norm(x)

    def project(self, hidden: Tensor) -> Tensor:
        """[n, (S/p)^2, d] -> [n, mm_tokens_per_image, d_text]."""
        n, _, d = hidden.shape
        side = self.args.patches_per_side
        grid = hidden.transpose(1, 2).reshape(n, d, side, side)
        kernel = side // round(self.args.mm_tokens_per_image**0.5)
        pooled = F.avg_pool2d(grid, kernel, stride=kernel).flatten(2).transpose(1, 2)
        x = pooled.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.args.layer_norm_eps)
        x = (x * (1.0 + self.proj_norm.float())).to(hidden.dtype)
        return (x @ self.proj).to(hidden.dtype)

    def forward(self, pixels: Tensor) -> Tensor:
        """pixels [n, c, S, S] -> image token embeddings [n, mm_tokens_per_image, d_text]."""
        return self.project(self.encode(pixels))


# The published Gemma 3 checkpoints' names (transformers 4 and 5 both load them).
_PREFIX = "vision_tower.vision_model."
_LAYER_NAMES = {
    "norm1": "layer_norm1",
    "attn.wq": "self_attn.q_proj",
    "attn.wk": "self_attn.k_proj",
    "attn.wv": "self_attn.v_proj",
    "attn.wo": "self_attn.out_proj",
    "norm2": "layer_norm2",
    "fc1": "mlp.fc1",
    "fc2": "mlp.fc2",
}


def gemma3_vision_names(args: SiglipArgs) -> NameMap:
    """Native name -> checkpoint name for every parameter of `Gemma3VisionTower(args)`.

    Loading also accepts transformers 5's `save_pretrained` names (`vision_tower.` without
    `vision_model.`) and the in-memory `model.` prefix of `Gemma3ForConditionalGeneration`."""
    names = {
        "patch_embed.weight": _PREFIX + "embeddings.patch_embedding.weight",
        "patch_embed.bias": _PREFIX + "embeddings.patch_embedding.bias",
        "pos_embed.weight": _PREFIX + "embeddings.position_embedding.weight",
        "post_norm.weight": _PREFIX + "post_layernorm.weight",
        "post_norm.bias": _PREFIX + "post_layernorm.bias",
        "proj_norm": "multi_modal_projector.mm_soft_emb_norm.weight",
        "proj": "multi_modal_projector.mm_input_projection_weight",
    }
    for i in range(args.num_layers):
        for native, hf in _LAYER_NAMES.items():
            for kind in ("weight", "bias"):
                names[f"layers.{i}.{native}.{kind}"] = f"{_PREFIX}encoder.layers.{i}.{hf}.{kind}"
    aliases = (
        (_PREFIX, "vision_tower."),
        (_PREFIX, "model.vision_tower."),
        ("multi_modal_projector.", "model.multi_modal_projector."),
    )
    return NameMap(names, aliases)
