"""Qwen3.5's vision transformer, and the 3-D text positions its images give the decoder.

Images come at their own resolution. The processor cuts each into patches of p x p pixels (times
`temporal_patch_size` frames: an image is its one frame repeated) and orders them so that every
m x m block of neighbouring patches (m = spatial_merge_size) is consecutive; it gives the rows
flattened and each image's patch grid (t, h, w):

    pixels [N, c * t_p * p * p], grid_thw [n_images, 3]      N = sum of t * h * w
      -> patch embedding (a Conv3d whose stride is its kernel: one matmul per patch)
         + learned positions, bilinearly resampled from a square table to each (h, w)  [N, d]
      -> blocks: pre-LayerNorm, attention within each image (block-diagonal) with 2-D rotary
         positions (row and column angles, each on a quarter of the head), GELU MLP
      -> merger: LayerNorm, each m x m block's m^2 patches concatenated, MLP     [N / m^2, d_out]

The decoder places the merged tokens at its image-pad tokens and gives every token three
positions (time, row, column): text tokens have all three equal and count on; an image's
tokens take its grid, starting where the text stopped (`mrope_position_ids`). Qwen3.5
interleaves the three over the rotary frequencies (`mrope_angles`).
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from compiletune.errors import UserError
from compiletune.torch_internals import dynamic_dims, host_array

from .common import NameMap, activation, block_input, config_get, rotate_half


@dataclass(frozen=True)
class QwenVisionArgs:
    """Sizes of Qwen3.5's vision tower (config.json's vision_config)."""

    hidden_size: int
    intermediate_size: int
    depth: int
    num_heads: int
    out_hidden_size: int
    num_position_embeddings: int
    patch_size: int = 16
    temporal_patch_size: int = 2
    in_channels: int = 3
    spatial_merge_size: int = 2
    hidden_act: str = "gelu_pytorch_tanh"
    rope_theta: float = 10000.0

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def patch_dim(self) -> int:
        return self.in_channels * self.temporal_patch_size * self.patch_size**2

    @classmethod
    def from_hf(cls, config: Mapping | object, where: str = "config.json") -> QwenVisionArgs:
        """From a Qwen3.5 config (its `vision_config`)."""
        vision = config_get(config, "vision_config")
        if vision is None:
            raise UserError(f"{where}: a Qwen3.5 vision checkpoint needs vision_config")
        rope = config_get(vision, "rope_parameters") or {}
        args = cls(
            hidden_size=int(config_get(vision, "hidden_size")),
            intermediate_size=int(config_get(vision, "intermediate_size")),
            depth=int(config_get(vision, "depth")),
            num_heads=int(config_get(vision, "num_heads")),
            out_hidden_size=int(config_get(vision, "out_hidden_size")),
            num_position_embeddings=int(config_get(vision, "num_position_embeddings")),
            patch_size=int(config_get(vision, "patch_size", 16)),
            temporal_patch_size=int(config_get(vision, "temporal_patch_size", 2)),
            in_channels=int(config_get(vision, "in_channels", 3)),
            spatial_merge_size=int(config_get(vision, "spatial_merge_size", 2)),
            hidden_act=str(config_get(vision, "hidden_act", "gelu_pytorch_tanh")),
            rope_theta=float(rope.get("rope_theta", 10000.0)),
        )
        side = round(args.num_position_embeddings**0.5)
        if side * side != args.num_position_embeddings or args.head_dim % 4:
            raise UserError(
                f"{where}: vision_config needs a square num_position_embeddings and a head size "
                f"divisible by 4, got {args.num_position_embeddings} and {args.head_dim}"
            )
        return args


def _block_order(grid: Tensor, h: int, w: int, m: int) -> Tensor:
    """[h * w, ...] in raster order -> the processor's order, each m x m block consecutive."""
    rest = grid.shape[1:]
    blocks = grid.reshape(h // m, m, w // m, m, *rest).transpose(1, 2)
    return blocks.reshape(h * w, *rest)


def patch_positions(grid_thw: Sequence[Sequence[int]], merge: int) -> Tensor:
    """Each patch's (row, column) in its image, in the processor's order: [N, 2] long."""
    out = []
    for t, h, w in grid_thw:
        rows, cols = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
        rc = torch.stack((rows, cols), dim=-1).reshape(h * w, 2)
        out.append(_block_order(rc, h, w, merge).repeat(t, 1))
    return torch.cat(out)


def frame_ids(grid_thw: Sequence[Sequence[int]]) -> Tensor:
    """Which frame (of which image) each patch belongs to: [N] long. Attention stays within one."""
    sizes = [h * w for t, h, w in grid_thw for _ in range(t)]
    # from the host's sizes, not repeat_interleave's tensor of them: the memory estimate's fake
    # tensors have no values to size its output from
    return torch.cat([torch.full((n,), i, dtype=torch.long) for i, n in enumerate(sizes)])


class QwenVisionBlock(nn.Module):
    """x + attn(norm1(x)) with 2-D rotary positions, then x + mlp(norm2(x))."""

    def __init__(self, args: QwenVisionArgs):
        super().__init__()
        d = args.hidden_size
        self.num_heads = args.num_heads
        self.norm1 = nn.LayerNorm(d, eps=1e-6)
        self.qkv = nn.Linear(d, 3 * d)
        self.wo = nn.Linear(d, d)
        self.norm2 = nn.LayerNorm(d, eps=1e-6)
        self.fc1 = nn.Linear(d, args.intermediate_size)
        self.fc2 = nn.Linear(args.intermediate_size, d)
        self.act = activation(args.hidden_act, "vision_config")

    def attention(self, x: Tensor, cos: Tensor, sin: Tensor, mask: Tensor | None) -> Tensor:
        """x [N, d]; cos, sin [N, head_dim]; mask [N, N] bool (True: may attend) or None."""
        n, d = x.shape
        q, k, v = self.qkv(x).view(n, 3, self.num_heads, -1).unbind(1)  # each [N, h, hd]
        # Rotary in fp32 (as the checkpoint was trained), then back to the compute dtype.
        cos, sin = cos[:, None].float(), sin[:, None].float()
        q, k = ((t.float() * cos + rotate_half(t.float()) * sin).to(x.dtype) for t in (q, k))
        q, k, v = (t.transpose(0, 1)[None] for t in (q, k, v))  # [1, h, N, hd]
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.wo(out[0].transpose(0, 1).reshape(n, d))

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, mask: Tensor | None) -> Tensor:
        x = x + self.attention(self.norm1(x), cos, sin, mask)
        return x + self.fc2(self.act(self.fc1(self.norm2(x))))


class Qwen35VisionTower(nn.Module):
    """Qwen3.5's vision transformer: processor patches to the decoder's image tokens."""

    def __init__(self, args: QwenVisionArgs):
        super().__init__()
        self.args = args
        d, m = args.hidden_size, args.spatial_merge_size
        kernel = (args.temporal_patch_size, args.patch_size, args.patch_size)
        self.patch_embed = nn.Conv3d(args.in_channels, d, kernel, stride=kernel)
        self.pos_embed = nn.Embedding(args.num_position_embeddings, d)
        self.blocks = nn.ModuleList(QwenVisionBlock(args) for _ in range(args.depth))
        self.merge_norm = nn.LayerNorm(d, eps=1e-6)
        self.merge_fc1 = nn.Linear(d * m * m, d * m * m)
        self.merge_fc2 = nn.Linear(d * m * m, args.out_hidden_size)
        # Row and column angles each take a quarter of the head (cos/sin repeat them per half).
        quarter = torch.arange(0, args.head_dim // 2, 2, dtype=torch.float) / (args.head_dim // 2)
        self.register_buffer("inv_freq", 1.0 / args.rope_theta**quarter, persistent=False)

    def positions(self, grid_thw: Sequence[Sequence[int]]) -> Tensor:
        """The learned position table resampled (bilinear, corners aligned) to each image's
        (h, w) grid, in the processor's patch order: [N, d]."""
        side = round(self.args.num_position_embeddings**0.5)
        table = self.pos_embed.weight.reshape(side, side, -1).permute(2, 0, 1)[None]
        out = []
        for t, h, w in grid_thw:
            grid = F.interpolate(table, size=(h, w), mode="bilinear", align_corners=True)
            rows = grid[0].permute(1, 2, 0).reshape(h * w, -1)
            out.append(_block_order(rows, h, w, self.args.spatial_merge_size).repeat(t, 1))
        return torch.cat(out)

    def rotary(self, grid_thw: Sequence[Sequence[int]]) -> tuple[Tensor, Tensor]:
        """cos, sin [N, head_dim]: row angles then column angles, the pair repeated per half."""
        rc = patch_positions(grid_thw, self.args.spatial_merge_size).to(self.inv_freq.device)
        angles = (rc[..., None].float() * self.inv_freq).flatten(1)  # [N, head_dim / 2]
        angles = torch.cat((angles, angles), dim=-1)
        return angles.cos(), angles.sin()

    def forward(self, pixels: Tensor, grid_thw: Tensor | Sequence[Sequence[int]]) -> Tensor:
        """pixels [N, c * t_p * p * p] (the processor's `pixel_values`), grid_thw [n, 3] ->
        image tokens [N / m^2, out_hidden_size], the images one after another."""
        grid = [tuple(int(v) for v in row) for row in grid_values(grid_thw)]
        a = self.args
        if pixels.dim() != 2 or pixels.shape[1] != a.patch_dim:
            raise ValueError(f"pixels must be [patches, {a.patch_dim}], got {tuple(pixels.shape)}")
        if pixels.shape[0] != sum(t * h * w for t, h, w in grid):
            raise ValueError(f"{pixels.shape[0]} patches, but grid_thw {grid} gives another count")
        weight = self.patch_embed.weight
        x = F.linear(pixels.to(weight.dtype), weight.flatten(1), self.patch_embed.bias)
        x = x + self.positions(grid).to(x.dtype)
        cos, sin = self.rotary(grid)
        frames = frame_ids(grid).to(x.device)
        # One frame: every patch sees every other; several: a block-diagonal mask.
        mask = None if len(grid) == 1 and grid[0][0] == 1 else frames[:, None] == frames[None]
        # compiled blocks (compiletune/compiler/regions.py): any patch count, one graph
        x = block_input(x, self.blocks)
        for t in (x, cos, sin):
            dynamic_dims(t, (0,))
        if mask is not None:
            dynamic_dims(mask, (0, 1))
        for block in self.blocks:
            x = block(x, cos, sin, mask)
        merged = self.merge_norm(x).reshape(-1, self.merge_fc1.in_features)
        return self.merge_fc2(F.gelu(self.merge_fc1(merged)))


_BLOCK_NAMES = {
    "norm1": "norm1",
    "qkv": "attn.qkv",
    "wo": "attn.proj",
    "norm2": "norm2",
    "fc1": "mlp.linear_fc1",
    "fc2": "mlp.linear_fc2",
}
_PREFIX = "model.visual."


def qwen35_vision_names(args: QwenVisionArgs) -> NameMap:
    """Native name -> checkpoint name for every parameter of `Qwen35VisionTower(args)` (the
    published checkpoints' `model.visual.*`; loading also accepts a bare `visual.*`)."""
    names = {
        "patch_embed.weight": _PREFIX + "patch_embed.proj.weight",
        "patch_embed.bias": _PREFIX + "patch_embed.proj.bias",
        "pos_embed.weight": _PREFIX + "pos_embed.weight",
    }
    for kind in ("weight", "bias"):
        names[f"merge_norm.{kind}"] = f"{_PREFIX}merger.norm.{kind}"
        names[f"merge_fc1.{kind}"] = f"{_PREFIX}merger.linear_fc1.{kind}"
        names[f"merge_fc2.{kind}"] = f"{_PREFIX}merger.linear_fc2.{kind}"
        for i in range(args.depth):
            for native, hf in _BLOCK_NAMES.items():
                names[f"blocks.{i}.{native}.{kind}"] = f"{_PREFIX}blocks.{i}.{hf}.{kind}"
    return NameMap(names, ((_PREFIX, "visual."),))


def _image_runs(row_ids: Tensor, image_token_id: int) -> list[tuple[bool, int, int]]:
    """The row cut into runs of text and of image tokens: (is_image, start, end)."""
    runs, start = [], 0
    for is_image, group in itertools.groupby((row_ids == image_token_id).tolist()):
        n = len(list(group))
        runs.append((is_image, start, start + n))
        start += n
    return runs


def row_positions(
    row_ids: Tensor, grids: Sequence[Sequence[int]], image_token_id: int, merge: int
) -> tuple[Tensor, int]:
    """[3, s] positions of one row (no padding) and how many images it used."""
    pieces, pos, used = [], 0, 0
    for is_image, start, end in _image_runs(row_ids, image_token_id):
        if not is_image:
            pieces.append(torch.arange(pos, pos + end - start).expand(3, -1))
            pos += end - start
            continue
        if used >= len(grids):
            raise ValueError("more runs of image tokens than images in image_grid_thw")
        t, h, w = grids[used]
        used += 1
        h, w = h // merge, w // merge
        if end - start != t * h * w:
            raise ValueError(f"a run of {end - start} image tokens for an image of {t * h * w}")
        tt, hh, ww = torch.meshgrid(
            torch.arange(t), torch.arange(h), torch.arange(w), indexing="ij"
        )
        pieces.append(torch.stack((tt, hh, ww)).reshape(3, -1) + pos)
        # The text after an image goes on from its largest row / column index (not its count).
        pos += max(h, w)
    return torch.cat(pieces, dim=1), used


def mrope_position_ids(
    input_ids: Tensor,
    image_grid_thw: Tensor | None,
    image_token_id: int,
    spatial_merge_size: int,
    attention_mask: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """The decoder's 3-D (time, row, column) positions for rows holding images.

    input_ids [b, s]; image_grid_thw [n, 3], the images in the order their tokens appear (row
    by row); attention_mask [b, s] (0: padding, which gets position 0). Returns positions
    [3, b, s] and deltas [b, 1]: the next position minus the row's length, which generation
    adds to plain 1-D positions after the prompt.
    """
    grids = [] if image_grid_thw is None else torch.as_tensor(image_grid_thw).tolist()
    b, s = input_ids.shape
    positions = torch.zeros(3, b, s, dtype=torch.long)
    deltas, used = [], 0
    for i in range(b):
        keep = (
            torch.ones(s, dtype=torch.bool) if attention_mask is None else attention_mask[i].bool()
        )
        row, n = row_positions(
            input_ids[i][keep].cpu(), grids[used:], image_token_id, spatial_merge_size
        )
        used += n
        positions[:, i, keep.cpu()] = row
        deltas.append(int(row.max()) + 1 - row.shape[1])
    if used != len(grids):
        raise ValueError(f"{len(grids)} images in image_grid_thw, {used} runs of image tokens")
    return positions.to(input_ids.device), torch.tensor(deltas, device=input_ids.device)[:, None]


def mrope_angles(position_ids: Tensor, inv_freq: Tensor, mrope_section: Sequence[int]) -> Tensor:
    """Rotary angles [b, s, f] for 3-D positions [3, b, s] and frequencies inv_freq [f].

    Qwen3.5 interleaves the axes over the frequencies: frequency j takes the row position when
    j % 3 == 1 and j < 3 * section[1], the column position when j % 3 == 2 and
    j < 3 * section[2], and the time position otherwise. With the three positions equal (text)
    this is plain 1-D rotary. cos/sin of the result, repeated per half, rotate q and k.
    """
    angles = position_ids[..., None].float() * inv_freq.float()  # [3, b, s, f]
    f = inv_freq.shape[0]
    j = torch.arange(f, device=inv_freq.device)
    axis = torch.zeros(f, dtype=torch.long, device=inv_freq.device)
    axis[(j % 3 == 1) & (j < 3 * mrope_section[1])] = 1
    axis[(j % 3 == 2) & (j < 3 * mrope_section[2])] = 2
    return angles.gather(0, axis.expand(1, *angles.shape[1:-1], f)).squeeze(0)


def grid_values(grid_thw: Tensor | Sequence[Sequence[int]]) -> list[list[int]]:
    """An `image_grid_thw`'s values: read on the host (a real tensor's, also under the memory
    estimate's fake mode, whose step reads a real batch), as the tower's shapes follow from them."""
    if isinstance(grid_thw, Tensor):
        return host_array(grid_thw.cpu()).tolist()
    return [list(row) for row in grid_thw]
