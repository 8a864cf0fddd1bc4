"""Quantized checkpoints read at load: gpt-oss's MXFP4 experts and DeepSeek-V3's block-scaled
fp8 weights, against transformers' own dequantisation, and written back dense."""

from __future__ import annotations

import json

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file
from test_families import load_hf, make_hf, rel, tokens
from transformers.integrations import mxfp4 as hf_mxfp4

from compiletune.errors import UserError
from compiletune.models import from_hf, save_hf
from compiletune.models.quantized import dequantize_fp8_blocks, dequantize_mxfp4


def random_mxfp4(rows_shape: tuple[int, ...], cols: int, seed: int) -> tuple[torch.Tensor, ...]:
    """Blocks and scales as the hub stores them: random codes, scales around 2 ** -3."""
    g = torch.Generator().manual_seed(seed)
    blocks = torch.randint(0, 256, (*rows_shape, cols // 32, 16), generator=g, dtype=torch.uint8)
    scales = torch.randint(121, 127, (*rows_shape, cols // 32), generator=g, dtype=torch.uint8)
    return blocks, scales


def test_dequantize_equals_transformers():
    blocks, scales = random_mxfp4((3, 40), 64, seed=0)
    ours = dequantize_mxfp4(blocks, scales).transpose(1, 2)  # the model's [E, in, out]
    theirs = hf_mxfp4.convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
    assert torch.equal(ours, theirs)
    with pytest.raises(ValueError, match="do not match"):
        dequantize_mxfp4(blocks, scales[..., :1])


def test_gpt_oss_mxfp4_checkpoint_loads_dequantized_and_saves_dense(tmp_path):
    hf = make_hf("gpt_oss")
    hf.save_pretrained(tmp_path / "dense")
    weights = load_file(tmp_path / "dense" / "model.safetensors")
    # the experts' weights replaced by MXFP4 blocks and scales, as the hub's gpt-oss has them
    for name in [n for n in weights if n.endswith(("gate_up_proj", "down_proj"))]:
        param = weights.pop(name)  # [E, in, out]
        blocks, scales = random_mxfp4((param.shape[0], param.shape[2]), param.shape[1], seed=1)
        weights[name + "_blocks"], weights[name + "_scales"] = blocks, scales
        dense = hf_mxfp4.convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
        hf.get_parameter(name).data.copy_(dense)  # transformers' dequantisation, in its model
    folder = tmp_path / "mxfp4"
    folder.mkdir()
    save_file(weights, folder / "model.safetensors")
    config = json.loads((tmp_path / "dense" / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": []}
    (folder / "config.json").write_text(json.dumps(config))
    ours = from_hf(folder)
    t = tokens(24)
    with torch.no_grad():
        assert rel(ours(t), hf(t).logits) <= 1e-5
        save_hf(ours, tmp_path / "out")  # dense, without the quantization config
        saved = json.loads((tmp_path / "out" / "config.json").read_text())
        assert "quantization_config" not in saved
        assert rel(load_hf(tmp_path / "out")(t).logits, ours(t)) <= 1e-5


def quantize_fp8_blocks(w: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """w [rows, cols] -> (float8_e4m3fn codes, fp32 scale_inv per block), as DeepSeek's
    checkpoints are made: each block's largest magnitude maps to the format's 448."""
    rows, cols = w.shape
    pad = w.new_zeros(-(-rows // block) * block, -(-cols // block) * block)
    pad[:rows, :cols] = w
    tiles = pad.unflatten(0, (-1, block)).unflatten(2, (-1, block))  # [R, b, C, b]
    scale = tiles.abs().amax(dim=(1, 3)).clamp_min(1e-12) / 448.0  # [R, C]
    expanded = scale.repeat_interleave(block, 0).repeat_interleave(block, 1)[:rows, :cols]
    return (w / expanded).to(torch.float8_e4m3fn), scale


def test_fp8_dequantize_checks_the_scales():
    w = torch.randn(40, 24)
    codes, scale = quantize_fp8_blocks(w, 16)
    assert scale.shape == (3, 2)
    dense = dequantize_fp8_blocks(codes, scale, (16, 16), torch.float32)
    assert rel(dense, w) < 0.05  # fp8's 3 mantissa bits
    with pytest.raises(ValueError, match="needs scales"):
        dequantize_fp8_blocks(codes, scale[:2], (16, 16), torch.float32)


def test_deepseek_fp8_checkpoint_loads_as_transformers_dequantizes_it(tmp_path):
    """Every projection of the blocks (attention, dense MLP, experts one by one, shared experts)
    stored as float8 with 8 x 8 block scales (the hub's use 128 x 128), as DeepSeek-V3's
    checkpoint is; the router, norms, embedding and head stay dense. transformers dequantizes
    such a checkpoint on a CPU; ours reads it to the same model, and saves it dense. (The
    block divides every shape here: transformers derives the block from the scale grid, which
    holds only then; DeepSeek's own rule, partial blocks at the edges, is the test above.)"""
    make_hf("deepseek_v3").save_pretrained(tmp_path / "dense")
    weights = load_file(tmp_path / "dense" / "model.safetensors")
    for name in list(weights):
        inside = name.startswith("model.layers.") and name.endswith("proj.weight")
        if inside and ".gate." not in name:
            weights[name], weights[name + "_scale_inv"] = quantize_fp8_blocks(weights[name], 8)
    folder = tmp_path / "fp8"
    folder.mkdir()
    save_file(weights, folder / "model.safetensors")
    config = json.loads((tmp_path / "dense" / "config.json").read_text())
    quant = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic"}
    config["quantization_config"] = quant | {"weight_block_size": [8, 8]}
    (folder / "config.json").write_text(json.dumps(config))
    ours = from_hf(folder, dtype=torch.float32)
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    t = tokens(24)
    with torch.no_grad():
        assert rel(ours(t), hf(t).logits) <= 1e-5
        save_hf(ours, tmp_path / "out")
        assert "quantization_config" not in json.loads((tmp_path / "out/config.json").read_text())
        assert rel(load_hf(tmp_path / "out")(t).logits, ours(t)) <= 1e-5


def test_other_quantized_checkpoints_are_refused(tmp_path):
    folder = tmp_path / "q"
    make_hf("qwen3").save_pretrained(folder)
    config = json.loads((folder / "config.json").read_text())
    for quant, match in (({"quant_method": "awq"}, "awq"), ({"quant_method": "fp8"}, "per-tensor")):
        config["quantization_config"] = quant
        (folder / "config.json").write_text(json.dumps(config))
        with pytest.raises(UserError, match=match):
            from_hf(folder)
