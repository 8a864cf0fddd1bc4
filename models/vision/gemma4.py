"""Gemma 4's image encoder and the embedder that projects its soft tokens into the decoder.

Images come at their own aspect ratio as a padded batch of patches: the processor gives each image
up to `max_patches` rows of p x p x 3 pixel values in [0, 1] and each row's (x, y) patch position,
(-1, -1) for padding.

    pixels [b, P, 3 p^2], positions [b, P, 2]
      -> linear patch embedding of 2 (pixels - 0.5), + a learned x embedding + a learned y
         embedding (zero for padding)                                        [b, P, d]
      -> layers: RMSNorm (w) around attention and around a gated GELU MLP (four norms a layer);
         attention with RMS-normed q, k (weighted) and v (unweighted), scale 1, grouped k/v
         heads, padding keys masked, and 2-D rotary positions: x on the first half of each head,
         y on the second
      -> pool every k x k neighbouring patches (k = pooling_kernel_size) by their positions,
         times sqrt(d) in fp32, padding dropped, optionally standardised
      -> embedder: unweighted RMSNorm, linear into the text width           [n_tokens, d_text]

`use_clipped_linears` checkpoints clamp each linear's input and output to stored bounds; those
bounds, and the standardisation's bias and scale, are tensors of the checkpoint like the weights.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from compiletune.errors import UserError
from compiletune.torch_internals import dynamic_dims, is_fake, real_ops

from .common import NameMap, activation, block_input, config_get, rotate_half


@dataclass(frozen=True)
class Gemma4VisionArgs:
    """Sizes of Gemma 4's image encoder and embedder (config.json)."""

    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    patch_size: int
    position_embedding_size: int
    pooling_kernel_size: int
    text_hidden_size: int
    rms_norm_eps: float = 1e-6
    hidden_act: str = "gelu_pytorch_tanh"
    rope_theta: float = 100.0
    use_clipped_linears: bool = False
    standardize: bool = False

    @classmethod
    def from_hf(cls, config: Mapping | object, where: str = "config.json") -> Gemma4VisionArgs:
        """From a Gemma 4 config (its `vision_config` and `text_config`)."""
        vision, text = config_get(config, "vision_config"), config_get(config, "text_config")
        if vision is None or text is None:
            raise UserError(
                f"{where}: a Gemma 4 vision checkpoint needs vision_config and text_config"
            )
        if config_get(vision, "output_proj_dims") not in (None, config_get(vision, "hidden_size")):
            raise UserError(f"{where}: vision_config.output_proj_dims is not supported yet")
        rope = config_get(vision, "rope_parameters") or {}
        heads = int(config_get(vision, "num_attention_heads"))
        args = cls(
            hidden_size=int(config_get(vision, "hidden_size")),
            intermediate_size=int(config_get(vision, "intermediate_size")),
            num_layers=int(config_get(vision, "num_hidden_layers")),
            num_heads=heads,
            num_kv_heads=int(config_get(vision, "num_key_value_heads", heads)),
            head_dim=int(config_get(vision, "head_dim")),
            patch_size=int(config_get(vision, "patch_size")),
            position_embedding_size=int(config_get(vision, "position_embedding_size")),
            pooling_kernel_size=int(config_get(vision, "pooling_kernel_size")),
            text_hidden_size=int(config_get(text, "hidden_size")),
            rms_norm_eps=float(config_get(vision, "rms_norm_eps", 1e-6)),
            hidden_act=str(config_get(vision, "hidden_activation", "gelu_pytorch_tanh")),
            rope_theta=float(rope.get("rope_theta", 100.0)),
            use_clipped_linears=bool(config_get(vision, "use_clipped_linears", False)),
            standardize=bool(config_get(vision, "standardize", False)),
        )
        if args.head_dim % 4 or args.num_heads % args.num_kv_heads:
            raise UserError(
                f"{where}: vision_config needs head_dim divisible by 4 and num_attention_heads "
                f"divisible by num_key_value_heads, got {args.head_dim}, {heads}, {args.num_kv_heads}"
            )
        return args


def rms(x: Tensor, eps: float, weight: Tensor | None = None) -> Tensor:
    """RMSNorm over the last dim in fp32, weight w (not 1 + w) when given, cast back."""
    y = x.float()
    y = y * (y.pow(2).mean(-1, keepdim=True) + eps).pow(-0.5)
    return (y if weight is None else y * weight.float()).to(x.dtype)


class ClippedLinear(nn.Linear):
    """A bias-free linear; with `clip`, its input and output clamped to the checkpoint's bounds."""

    def __init__(self, d_in: int, d_out: int, clip: bool):
        super().__init__(d_in, d_out, bias=False)
        self.clip = clip
        if clip:
            for name in ("input_min", "output_min"):
                self.register_buffer(name, torch.tensor(-float("inf")))
            for name in ("input_max", "output_max"):
                self.register_buffer(name, torch.tensor(float("inf")))

    def forward(self, x: Tensor) -> Tensor:
        if not self.clip:
            return super().forward(x)
        y = super().forward(torch.clamp(x, self.input_min, self.input_max))
        return torch.clamp(y, self.output_min, self.output_max)


class Gemma4VisionLayer(nn.Module):
    """x + norm(attn(norm(x))), then x + norm(mlp(norm(x)))."""

    def __init__(self, args: Gemma4VisionArgs):
        super().__init__()
        self.args = args
        d, hd, clip = args.hidden_size, args.head_dim, args.use_clipped_linears
        self.wq = ClippedLinear(d, args.num_heads * hd, clip)
        self.wk = ClippedLinear(d, args.num_kv_heads * hd, clip)
        self.wv = ClippedLinear(d, args.num_kv_heads * hd, clip)
        self.wo = ClippedLinear(args.num_heads * hd, d, clip)
        self.q_norm = nn.Parameter(torch.ones(hd))
        self.k_norm = nn.Parameter(torch.ones(hd))
        self.gate = ClippedLinear(d, args.intermediate_size, clip)
        self.up = ClippedLinear(d, args.intermediate_size, clip)
        self.down = ClippedLinear(args.intermediate_size, d, clip)
        # the four norms: before / after attention, before / after the MLP
        self.norms = nn.ParameterList(nn.Parameter(torch.ones(d)) for _ in range(4))
        self.act = activation(args.hidden_act, "vision_config")

    def attention(self, x: Tensor, cos: Tensor, sin: Tensor, key_mask: Tensor) -> Tensor:
        """x [b, P, d]; cos, sin [b, P, head_dim]; key_mask [b, P] (True: a real patch)."""
        b, n, _ = x.shape
        a, eps = self.args, self.args.rms_norm_eps
        q = rms(self.wq(x).view(b, n, a.num_heads, -1), eps, self.q_norm)
        k = rms(self.wk(x).view(b, n, a.num_kv_heads, -1), eps, self.k_norm)
        v = rms(self.wv(x).view(b, n, a.num_kv_heads, -1), eps)
        q, k = (_rotate_2d(t, cos[:, :, None], sin[:, :, None]) for t in (q, k))
        groups = a.num_heads // a.num_kv_heads
        k, v = (t.repeat_interleave(groups, dim=2) for t in (k, v))
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [b, h, P, hd]
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=key_mask[:, None, None], scale=1.0)
        return self.wo(out.transpose(1, 2).reshape(b, n, -1))

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, key_mask: Tensor) -> Tensor:
        eps, norms = self.args.rms_norm_eps, self.norms
        x = x + rms(self.attention(rms(x, eps, norms[0]), cos, sin, key_mask), eps, norms[1])
        h = rms(x, eps, norms[2])
        return x + rms(self.down(self.act(self.gate(h)) * self.up(h)), eps, norms[3])


def _rotate_2d(t: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotary on each half of the head apart (x angles on the first, y on the second)."""
    halves = zip(t.chunk(2, -1), cos.chunk(2, -1), sin.chunk(2, -1), strict=True)
    return torch.cat([h * c + rotate_half(h) * s for h, c, s in halves], dim=-1)


class Gemma4VisionTower(nn.Module):
    """Gemma 4's image encoder + embedder: processor patches to the decoder's image tokens."""

    def __init__(self, args: Gemma4VisionArgs):
        super().__init__()
        self.args = args
        d = args.hidden_size
        self.patch_embed = nn.Linear(3 * args.patch_size**2, d, bias=False)
        self.pos_embed = nn.Parameter(torch.ones(2, args.position_embedding_size, d))
        self.layers = nn.ModuleList(Gemma4VisionLayer(args) for _ in range(args.num_layers))
        if args.standardize:
            self.register_buffer("std_bias", torch.zeros(d))
            self.register_buffer("std_scale", torch.ones(d))
        self.proj = nn.Linear(d, args.text_hidden_size, bias=False)
        quarter = torch.arange(0, args.head_dim // 2, 2, dtype=torch.float) / (args.head_dim // 2)
        self.register_buffer("inv_freq", 1.0 / args.rope_theta**quarter, persistent=False)

    def embed(self, pixels: Tensor, positions: Tensor, real: Tensor) -> Tensor:
        """Patch embedding plus the x and y position embeddings (none for padding): [b, P, d]."""
        x = self.patch_embed((2 * (pixels - 0.5)).to(self.patch_embed.weight.dtype))
        xy = positions.clamp(min=0)
        pos = self.pos_embed[0][xy[..., 0]] + self.pos_embed[1][xy[..., 1]]
        return x + pos * real[..., None]

    def pool(self, hidden: Tensor, positions: Tensor, real: Tensor) -> Tensor:
        """Average each k x k block of patches by position, scale by sqrt(d) in fp32, drop the
        cells no patch fell in: [b, P, d] -> [n_tokens, d] fp32, the images one after another."""
        b, n, d = hidden.shape
        k = self.args.pooling_kernel_size
        cells = n // (k * k)
        cell = pooling_cells(positions, k)
        total = hidden.new_zeros(b, cells, d, dtype=torch.float)
        total.scatter_add_(1, cell[..., None].expand(b, n, d), hidden.float() * real[..., None])
        if is_fake(hidden) and not is_fake(positions):
            # the memory estimate's fake step on a real batch: the kept cells from the real
            # positions (a fake mask has no count to size the tokens by)
            with real_ops():
                kept = filled_cells(positions, k, cells)
        else:
            kept = filled_cells(positions, k, cells)
        return (total / (k * k) * self.args.hidden_size**0.5).flatten(0, 1)[kept]

    def forward(self, pixels: Tensor, positions: Tensor) -> Tensor:
        """pixels [b, P, 3 p^2] in [0, 1] and positions [b, P, 2] ((x, y); (-1, -1) padding), as
        the processor gives them -> image tokens [n_tokens, text_hidden_size]."""
        a = self.args
        if pixels.dim() != 3 or pixels.shape[1] % a.pooling_kernel_size**2:
            raise ValueError(
                f"pixels must be [images, patches, {3 * a.patch_size**2}], got {tuple(pixels.shape)}"
            )
        real = (positions != -1).any(dim=-1)  # [b, P]
        x = block_input(self.embed(pixels, positions, real), self.layers)
        angles = positions[..., None].float() * self.inv_freq  # [b, P, 2, head_dim / 4]
        angles = torch.cat([angles[:, :, 0]] * 2 + [angles[:, :, 1]] * 2, dim=-1)
        cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
        for t in (x, cos, sin, real):  # compiled layers: any number of images, one graph
            dynamic_dims(t, (0,))
        for layer in self.layers:
            x = layer(x, cos, sin, real)
        tokens = self.pool(x, positions, real)
        if a.standardize:
            tokens = (tokens - self.std_bias.float()) * self.std_scale.float()
        return self.proj(rms(tokens.to(x.dtype), a.rms_norm_eps))


_LAYER_NAMES = {
    "wq": "self_attn.q_proj",
    "wk": "self_attn.k_proj",
    "wv": "self_attn.v_proj",
    "wo": "self_attn.o_proj",
    "gate": "mlp.gate_proj",
    "up": "mlp.up_proj",
    "down": "mlp.down_proj",
}
_NORM_NAMES = (
    "input_layernorm",
    "post_attention_layernorm",
    "pre_feedforward_layernorm",
    "post_feedforward_layernorm",
)
_CLIP_BOUNDS = ("input_min", "input_max", "output_min", "output_max")
_PREFIX = "model.vision_tower."


def gemma4_vision_names(args: Gemma4VisionArgs) -> NameMap:
    """Native name -> checkpoint name for every tensor of `Gemma4VisionTower(args)` (weights,
    and the clipping bounds and standardisation of checkpoints that have them)."""
    names = {
        "patch_embed.weight": _PREFIX + "patch_embedder.input_proj.weight",
        "pos_embed": _PREFIX + "patch_embedder.position_embedding_table",
        "proj.weight": "model.embed_vision.embedding_projection.weight",
    }
    if args.standardize:
        names["std_bias"], names["std_scale"] = _PREFIX + "std_bias", _PREFIX + "std_scale"
    for i in range(args.num_layers):
        ours, theirs = f"layers.{i}.", f"{_PREFIX}encoder.layers.{i}."
        names[ours + "q_norm"] = theirs + "self_attn.q_norm.weight"
        names[ours + "k_norm"] = theirs + "self_attn.k_norm.weight"
        for j, norm in enumerate(_NORM_NAMES):
            names[f"{ours}norms.{j}"] = f"{theirs}{norm}.weight"
        for native, hf in _LAYER_NAMES.items():
            names[f"{ours}{native}.weight"] = f"{theirs}{hf}.linear.weight"
            for bound in _CLIP_BOUNDS if args.use_clipped_linears else ():
                names[f"{ours}{native}.{bound}"] = f"{theirs}{hf}.{bound}"
    return NameMap(names)


def pooling_cells(positions: Tensor, k: int) -> Tensor:
    """positions [b, P, 2] -> [b, P] long: the k x k pooling cell of each patch in its image
    (row-major over the image's cells; padding patches fall in cell 0, with no weight)."""
    xy = positions.clamp(min=0)
    width = (xy[..., 0].amax(dim=-1, keepdim=True) + 1) // k  # cells per row of each image
    return xy[..., 0] // k + width * (xy[..., 1] // k)


def filled_cells(positions: Tensor, k: int, cells: int) -> Tensor:
    """[n_tokens] long: the flat indices (image * cells + cell) of the pooling cells some real
    patch falls in, images one after another: the image tokens `pool` keeps."""
    real = (positions != -1).any(dim=-1)  # [b, P]
    filled = torch.zeros(positions.shape[0], cells, dtype=torch.long, device=positions.device)
    filled.scatter_add_(1, pooling_cells(positions, k), real.long())
    return (filled.flatten() > 0).nonzero()[:, 0]
