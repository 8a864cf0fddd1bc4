"""The native vision towers against transformers' own, on the same weights.

Tiny configs are built here from transformers' config classes, every weight is drawn at random (the
checkpoints' zero-initialised projector and norm weights would hide a wrong formula), and pixels are
random tensors: nothing is downloaded. fp32 throughout; image features must match to rel <= 1e-5.
"""

from __future__ import annotations

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file
from vision_cases import (
    IMAGE_TOKEN,
    gemma3_config,
    gemma3_pair,
    gemma4_config,
    gemma4_pair,
    gemma4_patches,
    hf_gemma3_features,
    hf_gemma4_features,
    hf_qwen35_features,
    qwen35_config,
    qwen35_pair,
    rel,
)

from compiletune.errors import UserError
from compiletune.models.vision.common import NameMap, hf_state_dict, load_hf_state_dict
from compiletune.models.vision.gemma4 import (
    Gemma4VisionArgs,
    Gemma4VisionTower,
    gemma4_vision_names,
)
from compiletune.models.vision.qwen import (
    QwenVisionArgs,
    mrope_angles,
    mrope_position_ids,
    qwen35_vision_names,
)
from compiletune.models.vision.siglip import Gemma3VisionTower, SiglipArgs, gemma3_vision_names

TOL = 1e-5


def hf_param(hf_params: dict, name_map: NameMap, hf_name: str) -> torch.nn.Parameter:
    """transformers' in-memory parameter for checkpoint name `hf_name`."""
    found = [n for n in name_map.candidates(hf_name) if n in hf_params]
    assert found, hf_name
    return hf_params[found[0]]


def check_grads(
    ours: torch.nn.Module, hf: torch.nn.Module, name_map: NameMap, zero: tuple[str, ...] = ()
) -> None:
    """Every parameter's gradient in `ours` equals transformers' for the same tensor. Those named
    in `zero` (key biases: softmax ignores a shift shared by every key) are zero by the algebra
    and only rounding in both, so they are held to be tiny instead."""
    hf_params = dict(hf.named_parameters())
    for native, p in ours.named_parameters():
        ref = hf_param(hf_params, name_map, name_map.names[native]).grad
        assert ref is not None, native
        if native.endswith(zero):
            weight = dict(ours.named_parameters())[native.replace(".bias", ".weight")].grad
            assert max(p.grad.norm(), ref.norm()) <= 1e-5 * weight.norm(), native
            continue
        assert ref.abs().sum() > 0, native
        assert rel(p.grad, ref) <= TOL, (native, rel(p.grad, ref))


def save_with_our_names(tmp_path, hf_model, ours, name_map: NameMap, drop: tuple[str, ...]):
    """hf_model saved by transformers, then its vision tensors replaced by `ours` under our
    names: the folder a compiletune save would write."""
    folder = tmp_path / "ckpt"
    hf_model.save_pretrained(folder)
    path = folder / "model.safetensors"
    tensors = {k: v for k, v in load_file(path).items() if not k.startswith(drop)}
    theirs = len(tensors)
    tensors.update({k: v.clone() for k, v in hf_state_dict(ours, name_map).items()})
    assert len(tensors) == theirs + len(name_map.names)  # no name of ours collides with theirs
    save_file(tensors, path, metadata={"format": "pt"})
    return folder


# ---------------------------------------------------------------- Gemma 3 (SigLIP + projector)


@pytest.fixture(scope="module")
def gemma3():
    return gemma3_pair()


@pytest.mark.parametrize("n_images", [1, 2])
def test_gemma3_features_equal_transformers(gemma3, n_images):
    hf, ours, args = gemma3
    pixels = torch.randn(n_images, 3, args.image_size, args.image_size)
    with torch.no_grad():
        ref = hf_gemma3_features(hf, pixels)
        out = ours(pixels)
    assert out.shape == (n_images, 16, 40) == ref.shape
    assert rel(out, ref) <= TOL
    # the images are computed apart: the second image does not change the first's tokens
    if n_images == 2:
        with torch.no_grad():
            assert rel(ours(pixels[:1]), out[:1]) <= TOL


def test_gemma3_gradients_equal_transformers(gemma3):
    hf, ours, args = gemma3
    hf.zero_grad()
    ours.zero_grad()
    pixels = torch.randn(2, 3, args.image_size, args.image_size)
    weights = torch.randn(2, 16, 40)
    ref_pixels, our_pixels = (pixels.clone().requires_grad_() for _ in range(2))
    (hf_gemma3_features(hf, ref_pixels) * weights).sum().backward()
    (ours(our_pixels) * weights).sum().backward()
    assert rel(our_pixels.grad, ref_pixels.grad) <= TOL
    check_grads(ours, hf, gemma3_vision_names(args), zero=("attn.wk.bias",))


def test_gemma3_names_round_trip(gemma3, tmp_path):
    """Our names load into transformers' modules with strict=True, and a folder saved with them
    loads through from_pretrained with no missing key and the same features."""
    hf, ours, args = gemma3
    names = gemma3_vision_names(args)
    saved = hf_state_dict(ours, names)
    tower = {k.removeprefix("vision_tower.vision_model."): v for k, v in saved.items()}
    projector = {
        k.removeprefix("multi_modal_projector."): tower.pop(k)
        for k in list(tower)
        if k.startswith("multi_modal_projector.")
    }
    fresh = transformers.Gemma3ForConditionalGeneration(gemma3_config())
    fresh.model.vision_tower.load_state_dict(tower, strict=True)
    fresh.model.multi_modal_projector.load_state_dict(projector, strict=True)

    folder = save_with_our_names(
        tmp_path, hf, ours, names, ("vision_tower.", "multi_modal_projector.")
    )
    loaded, info = transformers.AutoModelForImageTextToText.from_pretrained(
        folder, output_loading_info=True
    )
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    pixels = torch.randn(1, 3, args.image_size, args.image_size)
    with torch.no_grad():
        assert rel(hf_gemma3_features(loaded.eval(), pixels), ours(pixels)) <= TOL
    # and our loader reads what transformers 5 writes (vision_tower. without vision_model.)
    assert "vision_tower.vision_model.post_layernorm.bias" in load_file(
        folder / "model.safetensors"
    )
    again = Gemma3VisionTower(args)
    hf.save_pretrained(tmp_path / "theirs")
    load_hf_state_dict(again, load_file(tmp_path / "theirs" / "model.safetensors"), names, "theirs")
    with torch.no_grad():
        assert torch.equal(again(pixels), ours(pixels))


def test_gemma3_config_errors():
    config = gemma3_config().to_dict()
    config["vision_config"]["vision_use_head"] = True
    with pytest.raises(UserError, match="vision_use_head"):
        SiglipArgs.from_hf(config, "ckpt/config.json")
    config = gemma3_config(mm_tokens_per_image=12).to_dict()
    with pytest.raises(UserError, match="mm_tokens_per_image=12"):
        SiglipArgs.from_hf(config)
    with pytest.raises(UserError, match="text-only"):
        SiglipArgs.from_hf({"hidden_size": 8})


def test_missing_tensor_names_the_checkpoint(gemma3):
    _, ours, args = gemma3
    names = gemma3_vision_names(args)
    tensors = hf_state_dict(ours, names)
    tensors.pop("vision_tower.vision_model.encoder.layers.1.mlp.fc2.bias")
    with pytest.raises(UserError, match=r"ckpt: .*layers\.1\.mlp\.fc2\.bias is missing"):
        load_hf_state_dict(Gemma3VisionTower(args), tensors, names, "ckpt")
    tensors = hf_state_dict(ours, names)
    tensors["multi_modal_projector.mm_input_projection_weight"] = torch.zeros(3, 3)
    with pytest.raises(UserError, match="shape"):
        load_hf_state_dict(Gemma3VisionTower(args), tensors, names, "ckpt")


# ---------------------------------------------------------------- Qwen3.5 (ViT + merger + mrope)


@pytest.fixture(scope="module")
def qwen35():
    return qwen35_pair()


# one image of each of two sizes (one not square), two images of different sizes, a 2-frame grid
GRIDS = [[[1, 4, 6]], [[1, 8, 4]], [[1, 4, 6], [1, 6, 6]], [[2, 4, 4]]]


@pytest.mark.parametrize("grid", GRIDS, ids=["4x6", "8x4", "two", "t2"])
def test_qwen35_features_equal_transformers(qwen35, grid):
    hf, ours, args = qwen35
    grid = torch.tensor(grid)
    pixels = torch.randn(int(grid.prod(-1).sum()), args.patch_dim)
    with torch.no_grad():
        ref = hf_qwen35_features(hf, pixels, grid)
        out = ours(pixels, grid)
    assert out.shape == ref.shape == (int(grid.prod(-1).sum()) // 4, 40)
    assert rel(out, ref) <= TOL
    if len(grid) == 2:  # attention stays within an image: the first is the same alone
        first = int(grid[0].prod())
        with torch.no_grad():
            assert rel(ours(pixels[:first], grid[:1]), out[: first // 4]) <= TOL


def test_qwen35_gradients_equal_transformers(qwen35):
    hf, ours, args = qwen35
    hf.zero_grad()
    ours.zero_grad()
    grid = torch.tensor([[1, 4, 6], [1, 6, 6]])
    pixels = torch.randn(int(grid.prod(-1).sum()), args.patch_dim)
    weights = torch.randn(pixels.shape[0] // 4, 40)
    ref_pixels, our_pixels = (pixels.clone().requires_grad_() for _ in range(2))
    (hf_qwen35_features(hf, ref_pixels, grid) * weights).sum().backward()
    (ours(our_pixels, grid) * weights).sum().backward()
    assert rel(our_pixels.grad, ref_pixels.grad) <= TOL
    check_grads(ours, hf, qwen35_vision_names(qwen35[2]))


def test_qwen35_names_round_trip(qwen35, tmp_path):
    hf, ours, args = qwen35
    names = qwen35_vision_names(args)
    saved = {k.removeprefix("model.visual."): v for k, v in hf_state_dict(ours, names).items()}
    fresh = transformers.Qwen3_5ForConditionalGeneration(qwen35_config())
    fresh.model.visual.load_state_dict(saved, strict=True)

    folder = save_with_our_names(tmp_path, hf, ours, names, ("model.visual.",))
    loaded, info = transformers.AutoModelForImageTextToText.from_pretrained(
        folder, output_loading_info=True
    )
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    grid = torch.tensor([[1, 4, 6]])
    pixels = torch.randn(24, args.patch_dim)
    with torch.no_grad():
        assert rel(hf_qwen35_features(loaded.eval(), pixels, grid), ours(pixels, grid)) <= TOL


def qwen_rows(pad_left: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Two rows: text, an image (grid 1x4x6 -> 6 tokens), text, an image (1x6x6 -> 9 tokens),
    text; and text, an image (1x8x4 -> 8 tokens), text, left-padded by `pad_left`."""
    gen = torch.Generator().manual_seed(5)

    def text(n):
        return torch.randint(0, 280, (n,), generator=gen)

    def image(n):
        return torch.full((n,), IMAGE_TOKEN)

    first = torch.cat([text(3), image(6), text(2), image(9), text(4)])
    second = torch.cat(
        [torch.zeros(pad_left, dtype=torch.long), text(5), image(8), text(11 - pad_left)]
    )
    ids = torch.stack([first, second])
    mask = torch.ones_like(ids)
    mask[1, :pad_left] = 0
    grid = torch.tensor([[1, 4, 6], [1, 6, 6], [1, 8, 4]])
    return ids, mask, grid


@pytest.mark.parametrize("pad_left", [0, 3])
def test_qwen35_mrope_positions_equal_transformers(qwen35, pad_left):
    hf, _, args = qwen35
    ids, mask, grid = qwen_rows(pad_left)
    types = (ids == IMAGE_TOKEN).int() * mask
    ref, ref_deltas = hf.model.get_rope_index(ids, types, grid, attention_mask=mask)
    ours, deltas = mrope_position_ids(ids, grid, IMAGE_TOKEN, args.spatial_merge_size, mask)
    assert torch.equal(ours[:, mask.bool()], ref[:, mask.bool()])
    assert torch.equal(deltas, ref_deltas)
    # an image's tokens do not count on one by one: positions end below the row's length
    assert ours[:, 0].max() < ids.shape[1] - 1


def test_qwen35_mrope_counts_checked():
    ids, _, grid = qwen_rows(0)
    with pytest.raises(ValueError, match="3 images in image_grid_thw, 2 runs"):
        mrope_position_ids(ids[:1], grid, IMAGE_TOKEN, 2)
    with pytest.raises(ValueError, match="a run of 6 image tokens for an image of 8"):
        mrope_position_ids(ids[:1], grid[[2, 1]], IMAGE_TOKEN, 2)


def test_qwen35_mrope_angles_equal_transformers(qwen35):
    hf, _, args = qwen35
    ids, mask, grid = qwen_rows(0)
    positions, _ = mrope_position_ids(ids, grid, IMAGE_TOKEN, args.spatial_merge_size, mask)
    rotary = hf.model.language_model.rotary_emb
    cos, sin = rotary(torch.zeros(1, dtype=torch.float32), positions)
    angles = mrope_angles(positions, rotary.inv_freq, [3, 3, 2])
    angles = torch.cat((angles, angles), dim=-1)
    assert rel(angles.cos(), cos) <= TOL and rel(angles.sin(), sin) <= TOL
    # and not the plain 1-D angles of the time axis (the rows hold images)
    plain = torch.cat([positions[0, ..., None] * rotary.inv_freq] * 2, dim=-1)
    assert rel(plain.cos(), cos) > 1e-3


# ---------------------------------------------------------------- Gemma 4 (image encoder + embedder)

# (w, h) patch grids, and the padded patch count of the batch
GEMMA4_BATCHES = {"one": ([(8, 4)], 32), "two": ([(8, 4), (6, 6)], 40)}


@pytest.fixture(scope="module")
def gemma4():
    return gemma4_pair()


@pytest.mark.parametrize("batch", GEMMA4_BATCHES, ids=list(GEMMA4_BATCHES))
def test_gemma4_features_equal_transformers(gemma4, batch):
    hf, ours, args = gemma4
    grids, max_patches = GEMMA4_BATCHES[batch]
    pixels, positions = gemma4_patches(grids, max_patches, 3 * args.patch_size**2)
    with torch.no_grad():
        ref = hf_gemma4_features(hf, pixels, positions)
        out = ours(pixels, positions)
    tokens = sum(w * h for w, h in grids) // 4
    assert out.shape == ref.shape == (tokens, 40)
    assert rel(out, ref) <= TOL
    if len(grids) == 2:  # padding and the other image change nothing: the first alone
        with torch.no_grad():
            alone = ours(*gemma4_patches(grids[:1], 32, 3 * args.patch_size**2))
        assert rel(alone, out[:8]) <= TOL


def test_gemma4_clipping_bounds_are_applied(gemma4):
    """The stored bounds clip (so loading them matters): without them the features differ."""
    _, ours, args = gemma4
    pixels, positions = gemma4_patches(*GEMMA4_BATCHES["two"], 3 * args.patch_size**2)
    unclipped = Gemma4VisionTower(args)
    unclipped.load_state_dict(ours.state_dict())
    with torch.no_grad():
        for name, bound in unclipped.named_buffers():
            if name.endswith(("_min", "_max")):
                bound.fill_(float("inf") if name.endswith("_max") else -float("inf"))
        assert rel(unclipped(pixels, positions), ours(pixels, positions)) > 1e-3


def test_gemma4_gradients_equal_transformers(gemma4):
    hf, ours, args = gemma4
    hf.zero_grad()
    ours.zero_grad()
    pixels, positions = gemma4_patches(*GEMMA4_BATCHES["two"], 3 * args.patch_size**2)
    weights = torch.randn(17, 40)
    ref_pixels, our_pixels = (pixels.clone().requires_grad_() for _ in range(2))
    (hf_gemma4_features(hf, ref_pixels, positions) * weights).sum().backward()
    (ours(our_pixels, positions) * weights).sum().backward()
    assert rel(our_pixels.grad, ref_pixels.grad) <= TOL
    check_grads(ours, hf, gemma4_vision_names(args))


def test_gemma4_names_round_trip(gemma4, tmp_path):
    hf, ours, args = gemma4
    names = gemma4_vision_names(args)
    saved = hf_state_dict(ours, names)
    tower = {k.removeprefix("model.vision_tower."): v for k, v in saved.items()}
    embedder = {
        "embedding_projection.weight": tower.pop("model.embed_vision.embedding_projection.weight")
    }
    fresh = transformers.Gemma4ForConditionalGeneration(gemma4_config())
    fresh.model.vision_tower.load_state_dict(tower, strict=True)
    fresh.model.embed_vision.load_state_dict(embedder, strict=True)

    folder = save_with_our_names(
        tmp_path, hf, ours, names, ("model.vision_tower.", "model.embed_vision.")
    )
    loaded, info = transformers.AutoModelForImageTextToText.from_pretrained(
        folder, output_loading_info=True
    )
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    pixels, positions = gemma4_patches(*GEMMA4_BATCHES["two"], 3 * args.patch_size**2)
    with torch.no_grad():
        assert (
            rel(hf_gemma4_features(loaded.eval(), pixels, positions), ours(pixels, positions))
            <= TOL
        )


def test_qwen35_and_gemma4_config_errors():
    config = qwen35_config().to_dict()
    config["vision_config"]["num_position_embeddings"] = 15
    with pytest.raises(UserError, match="ckpt/config.json: vision_config needs a square"):
        QwenVisionArgs.from_hf(config, "ckpt/config.json")
    with pytest.raises(UserError, match="needs vision_config"):
        QwenVisionArgs.from_hf({"text_config": {}})
    config = gemma4_config().to_dict()
    config["vision_config"]["num_key_value_heads"] = 3
    with pytest.raises(UserError, match="divisible by num_key_value_heads, got 8, 4, 3"):
        Gemma4VisionArgs.from_hf(config)
