"""A vision-language model's tower under the trainer's parallel and memory mechanisms: FSDP2 (a
unit per tower block, `distributed.apply_fsdp`) on 2 gloo ranks equals one process. A tiny
Gemma 3 vision checkpoint (tests/vision_cases.py), the tower trainable (--train-vision); fp32."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers
from gloo import free_port, run_in_gloo
from vision_cases import gemma3_config, randomize, rel

from compiletune.loss.head import LossHead
from compiletune.models.hf import from_hf
from compiletune.models.vision.inputs import ImageInputs

IMAGE_TOKEN = 299  # gemma3_config's image_token_index


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("gemma3")
    torch.manual_seed(0)
    hf = transformers.Gemma3ForConditionalGeneration(gemma3_config()).eval()
    randomize(hf.model.vision_tower, 1)
    randomize(hf.model.multi_modal_projector, 2)
    hf.save_pretrained(folder)
    return folder


def load(folder: Path, train_vision: bool = True, lora: bool = False):
    """The model, its tower trainable (`train_vision`), or with `lora` LoRA on the decoder's
    q/v and the tower's q_proj/fc1 (random adapters, the same in every process)."""
    model = from_hf(folder, dtype=torch.float32, vision=True)
    model.train_vision(train_vision)
    if lora:
        from lora_cases import randomize_adapters

        from compiletune.models.lora import LoRASpec, apply_lora

        spec = LoRASpec(rank=4, alpha=8.0, targets=("q", "v"), vision=("fc1", "q_proj"))
        apply_lora(model, spec, dtype=torch.float32, seed=1)
        randomize_adapters(model)
    return model


def row(seed: int = 0) -> tuple[torch.Tensor, ImageInputs]:
    """One row of two 32x32 images (16 tokens each) between text."""
    gen = torch.Generator().manual_seed(seed)
    pieces = [torch.randint(1, 290, (3,), generator=gen)]
    for _ in range(2):
        pieces += [torch.full((16,), IMAGE_TOKEN), torch.randint(1, 290, (4,), generator=gen)]
    pixels = torch.randn(2, 3, 32, 32, generator=gen)
    return torch.cat(pieces)[None], ImageInputs(pixels)


def loss_and_grads(model, head) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    ids, images = row()
    loss = head(model.hidden_states(ids, images=images), torch.roll(ids, -1, dims=1))
    loss.backward()
    grads = {}
    for name, p in model.named_parameters():
        if p.grad is not None:
            g = p.grad
            grads[name] = g.full_tensor() if hasattr(g, "full_tensor") else g
    return loss.detach(), grads


def _fsdp_worker(rank: int, world: int, port: int, folder: str, out: str, lora: bool) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    from compiletune.distributed import apply_fsdp

    torch.set_num_threads(1)

    def body() -> None:
        model = load(Path(folder), lora=lora)
        apply_fsdp(model, init_device_mesh("cpu", (world,)))
        kinds = {type(b).__name__ for b in model.vision_blocks()}
        loss, grads = loss_and_grads(model, LossHead(model.output, "plain"))
        if rank == 0:
            torch.save((loss, grads, kinds), out)

    run_in_gloo(rank, world, port, body)


@pytest.mark.slow
@pytest.mark.parametrize("lora", [False, True], ids=["train-vision", "lora-on-the-tower"])
def test_fsdp_tower_blocks_are_units_and_equal_one_process(tmp_path, checkpoint, lora):
    import torch.multiprocessing as mp

    out = str(tmp_path / "rank0.pt")
    args = (2, free_port(), str(checkpoint), out, lora)
    mp.start_processes(_fsdp_worker, args=args, nprocs=2, start_method="spawn")
    loss, grads, kinds = torch.load(out)
    assert all(k.startswith("FSDP") for k in kinds)  # each tower block its own unit
    ref = load(checkpoint, lora=lora)
    ref_loss, ref_grads = loss_and_grads(ref, LossHead(ref.output, "plain"))
    assert rel(loss, ref_loss) <= 1e-5
    tower = [n for n in ref_grads if n.startswith("vision_tower.")]
    assert tower and (not lora or all(n.endswith(("lora_a", "lora_b")) for n in tower))
    assert grads.keys() == ref_grads.keys()
    for name, g in ref_grads.items():
        assert rel(grads[name], g) <= 1e-5, name


def compiled_run(folder: Path, ac: str):
    """Loss and gradients of one compiled step (aot_eager) under `--ac ac`, and the tower
    region's record."""
    from compiletune.compiler.activation import parse_ac
    from compiletune.compiler.regions import CompileOptions, compile_regions

    model = load(folder)
    head = LossHead(model.output, "plain")
    opts = CompileOptions(backend="aot_eager", loss="plain", dump=True, ac=parse_ac(ac))
    regions = compile_regions(model, head, opts)
    loss, grads = loss_and_grads(model, head)
    (record,) = regions.backends["vision"].records  # one graph for the tower's blocks
    return loss, grads, record.summary()


@pytest.mark.slow
def test_activation_policies_on_the_tower_keep_loss_and_gradients(checkpoint):
    """--ac full / selective under --compile: the tower's region runs the policy pass (it
    fires, and the tower's blocks save less), and the loss and every gradient (the tower's
    included) equal the run without a policy."""
    ref_loss, ref_grads, ref_record = compiled_run(checkpoint, "none")
    assert any(n.startswith("vision_tower.") for n in ref_grads)
    for ac in ("full", "selective"):
        loss, grads, record = compiled_run(checkpoint, ac)
        fired = {p["pass"] for p in record["passes"] if p["fired"]}
        assert f"activation_policy.{ac}" in fired
        assert record["saved_activation_bytes"] < ref_record["saved_activation_bytes"], ac
        assert rel(loss, ref_loss) <= 1e-6
        assert grads.keys() == ref_grads.keys()
        for name, g in ref_grads.items():
            assert rel(grads[name], g) <= 1e-5, (ac, name)


def test_eager_activation_policy_wraps_the_tower_blocks(checkpoint):
    """Without --compile, --ac full checkpoints the tower's blocks too (torch.utils.checkpoint),
    with the same loss and gradients."""
    from compiletune.compiler.activation import apply_eager_checkpointing, parse_ac

    ref = load(checkpoint)
    ref_loss, ref_grads = loss_and_grads(ref, LossHead(ref.output, "plain"))
    model = load(checkpoint)
    count = apply_eager_checkpointing(model, parse_ac("full"))
    assert count == len(model.layers) + len(model.vision_blocks())
    loss, grads = loss_and_grads(model, LossHead(model.output, "plain"))
    assert rel(loss, ref_loss) <= 1e-6
    for name, g in ref_grads.items():
        assert rel(grads[name], g) <= 1e-6, name
