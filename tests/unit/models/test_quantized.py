"""Quantized checkpoints read at load: gpt-oss's MXFP4 experts, against transformers' own
dequantisation, and written back dense."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_families import load_hf, make_hf, rel, tokens
from transformers.integrations import mxfp4 as hf_mxfp4

from compiletune.errors import UserError
from compiletune.models import from_hf, save_hf
from compiletune.models.quantized import dequantize_mxfp4


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


def test_other_quantized_checkpoints_are_refused(tmp_path):
    folder = tmp_path / "q"
    make_hf("qwen3").save_pretrained(folder)
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8"}
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(UserError, match="fp8"):
        from_hf(folder)
