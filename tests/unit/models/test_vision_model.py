"""The vision-language model (decoder + tower, models/vision/model.py) against transformers'
ForConditionalGeneration on the same weights: logits with one and two images, gradients, and
save -> transformers loads -> the same logits. Tiny configs built from transformers' own config
classes (tests/vision_cases.py), random weights and random images made here; fp32.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import transformers
from vision_cases import (
    IMAGE_TOKEN,
    gemma3_config,
    gemma4_config,
    gemma4_patches,
    qwen35_config,
    randomize,
    rel,
)

from compiletune.models.cache import KVCache
from compiletune.models.hf import from_hf, save_hf
from compiletune.models.vision.inputs import ImageInputs
from compiletune.models.vision.model import VisionLanguageModel

TOL = 1e-5


def _text(n: int, gen: torch.Generator) -> torch.Tensor:
    return torch.randint(1, 280, (n,), generator=gen)


@dataclass
class Case:
    """A family's tiny transformers model and how to make a row with images for it."""

    hf_class: Any
    config: Any
    image_token: int

    def model(self) -> Any:
        torch.manual_seed(0)
        hf = self.hf_class(self.config).eval()
        for i, (name, module) in enumerate(hf.model.named_children()):
            if name != "language_model":  # the towers' zero-initialised weights drawn too
                randomize(module, 10 + i)
        return hf


def gemma3_case() -> Case:
    cfg = gemma3_config().to_dict()
    # two layers (sliding, full) with a window shorter than an image: the mask's AND and OR
    cfg["text_config"].update(
        num_hidden_layers=2,
        sliding_window=8,
        layer_types=["sliding_attention", "full_attention"],
    )
    return Case(
        transformers.Gemma3ForConditionalGeneration,
        transformers.Gemma3Config.from_dict(cfg),
        299,
    )


def qwen35_case() -> Case:
    return Case(transformers.Qwen3_5ForConditionalGeneration, qwen35_config(), IMAGE_TOKEN)


def gemma4_case() -> Case:
    cfg = gemma4_config().to_dict()
    cfg["text_config"].update(sliding_window=8, use_bidirectional_attention="vision")
    return Case(
        transformers.Gemma4ForConditionalGeneration, transformers.Gemma4Config.from_dict(cfg), 290
    )


def batch(family: str, n_images: int, seed: int = 0) -> tuple[torch.Tensor, ImageInputs, dict]:
    """One row: text, then each image's tokens between text; the images as the processor gives
    them, and the extra keyword arguments transformers' forward needs."""
    gen = torch.Generator().manual_seed(seed)
    if family == "gemma3":
        pixels = torch.randn(n_images, 3, 32, 32, generator=gen)
        images, counts = ImageInputs(pixels), [16] * n_images
    elif family == "qwen35":
        grid = torch.tensor([[1, 4, 6], [1, 6, 4]][:n_images])
        pixels = torch.randn(int(grid.prod(-1).sum()), 96, generator=gen)
        images, counts = ImageInputs(pixels, image_grid_thw=grid), [6] * n_images
    else:
        grids, max_patches = ([(8, 4)], 32) if n_images == 1 else ([(8, 4), (6, 6)], 40)
        pixels, positions = gemma4_patches(grids, max_patches, 48, seed)
        images = ImageInputs(pixels, image_position_ids=positions)
        counts = [w * h // 4 for w, h in grids]
    token = {"gemma3": 299, "qwen35": IMAGE_TOKEN, "gemma4": 290}[family]
    pieces = [_text(3, gen)]
    for n in counts:
        pieces += [torch.full((n,), token), _text(4, gen)]
    ids = torch.cat(pieces)[None]
    types = (ids == token).long()
    kwargs = dict(pixel_values=images.pixel_values)
    if family == "gemma3":
        kwargs["token_type_ids"] = types
    elif family == "qwen35":
        kwargs.update(image_grid_thw=images.image_grid_thw, mm_token_type_ids=types)
    else:
        kwargs.update(image_position_ids=images.image_position_ids, mm_token_type_ids=types)
    return ids, images, kwargs


CASES = {"gemma3": gemma3_case, "qwen35": qwen35_case, "gemma4": gemma4_case}


@pytest.fixture(scope="module", params=list(CASES))
def loaded(request, tmp_path_factory):
    """(family, transformers' model, ours loaded with vision=True from its saved folder)."""
    case = CASES[request.param]()
    hf = case.model()
    folder = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(folder)
    ours = from_hf(folder, dtype=torch.float32, vision=True)
    return request.param, hf, ours


@pytest.mark.parametrize("n_images", [1, 2])
def test_logits_equal_transformers(loaded, n_images):
    family, hf, ours = loaded
    assert isinstance(ours, VisionLanguageModel)
    ids, images, kwargs = batch(family, n_images)
    with torch.no_grad():
        ref = hf(input_ids=ids, **kwargs).logits
        out = ours(ids, images=images)
    assert out.shape == ref.shape
    assert rel(out, ref) <= TOL
    # the images matter: other pixels give other logits
    other = dataclasses.replace(images, pixel_values=torch.rand_like(images.pixel_values))
    with torch.no_grad():
        assert rel(ours(ids, images=other), ref) > 1e-3


def test_tower_frozen_by_default(loaded):
    _, _, ours = loaded
    assert not any(p.requires_grad for p in ours.vision_tower.parameters())
    assert ours.tok_embeddings.weight.requires_grad
    assert ours.norm.weight.requires_grad


def test_gradients_equal_transformers(loaded):
    """With the tower trainable, one loss's gradients on the tower's and the decoder's weights
    equal transformers' (the embedding's: both the text rows and, through the scatter, none at
    the image tokens)."""
    family, hf, ours = loaded
    ids, images, kwargs = batch(family, 2, seed=1)
    weights = torch.randn(*ids.shape, hf.config.get_text_config().vocab_size)
    ours.train_vision(True)
    try:
        hf.zero_grad()
        ours.zero_grad()
        (hf(input_ids=ids, **kwargs).logits * weights).sum().backward()
        (ours(ids, images=images) * weights).sum().backward()
        hf_params = dict(hf.named_parameters())
        names = ours.names
        checked = 0
        for native, p in ours.vision_tower.named_parameters():
            found = [n for n in names.candidates(names.names[native]) if n in hf_params]
            ref = hf_params[found[0]].grad
            if ref.norm() > 1e-6:  # key biases: zero by the algebra in both
                assert rel(p.grad, ref) <= 1e-4, native
                checked += 1
        assert checked > 10
        embed = hf.get_input_embeddings().weight.grad
        assert rel(ours.tok_embeddings.weight.grad, embed) <= 1e-4
    finally:
        ours.train_vision(False)
        ours.zero_grad()


def test_save_transformers_loads_equal_logits(loaded, tmp_path):
    family, hf, ours = loaded
    save_hf(ours, tmp_path)
    # the source's image processor files go beside every save (none in these tiny folders)
    assert not (tmp_path / "preprocessor_config.json").exists()
    back = type(hf).from_pretrained(tmp_path, dtype=torch.float32).eval()
    ids, images, kwargs = batch(family, 2, seed=2)
    with torch.no_grad():
        ref = back(input_ids=ids, **kwargs).logits
        assert rel(ours(ids, images=images), ref) <= TOL
    # and the folder loads back into ours with the same tower
    again = from_hf(tmp_path, dtype=torch.float32, vision=True)
    loaded_back = again.vision_tower.state_dict()
    for name, tensor in ours.vision_tower.state_dict().items():
        assert torch.equal(tensor, loaded_back[name]), name


def test_text_load_drops_the_tower(loaded, tmp_path):
    family, hf, _ = loaded
    hf.save_pretrained(tmp_path)
    text = from_hf(tmp_path, dtype=torch.float32)
    assert not isinstance(text, VisionLanguageModel)
    ids, images, _ = batch(family, 1)
    with pytest.raises(ValueError, match="images were given to a text model"):
        text(ids, images=images)


def test_packed_rows_equal_the_examples_alone(loaded):
    """Two examples packed in one row (doc_ids, positions restarting) give the logits each
    gives alone: the image blocks and Qwen3.5's 3-D positions stay within their document."""
    family, _, ours = loaded
    (a, ia, _), (b, ib, _) = batch(family, 1, seed=3), batch(family, 2, seed=4)
    row = torch.cat([a, b], dim=1)
    doc_ids = torch.cat([torch.zeros_like(a), torch.ones_like(b)], dim=1)
    positions = torch.cat([torch.arange(a.shape[1]), torch.arange(b.shape[1])])[None]
    both = ImageInputs.concat([ia, ib]) if family != "gemma4" else None
    if both is None:  # Gemma 4's processor pads every image to one patch count
        pad = ib.pixel_values.shape[1] - ia.pixel_values.shape[1]
        grow = torch.nn.functional.pad
        both = ImageInputs(
            torch.cat([grow(ia.pixel_values, (0, 0, 0, pad)), ib.pixel_values]),
            image_position_ids=torch.cat(
                [grow(ia.image_position_ids, (0, 0, 0, pad), value=-1), ib.image_position_ids]
            ),
        )
    with torch.no_grad():
        packed = ours(row, positions, doc_ids, images=both)
        alone = torch.cat([ours(a, images=ia), ours(b, images=ib)], dim=1)
    assert rel(packed, alone) <= TOL


def test_the_trainers_forward_passes_images(loaded):
    """compiletune/train/forward.py: a batch's `images` reach the tower (packed or not)."""
    from compiletune.train.forward import forward_hidden

    family, _, ours = loaded
    ids, images, _ = batch(family, 1, seed=5)
    data = {
        "inputs": ids,
        "positions": torch.arange(ids.shape[1])[None],
        "doc_ids": torch.zeros_like(ids),
        "images": images,
    }
    with torch.no_grad():
        want = ours.hidden_states(ids, images=images)
        for doc_mask in (False, True):
            assert rel(forward_hidden(ours, data, doc_mask), want) <= TOL


def test_greedy_generation_with_an_image_equals_transformers(loaded):
    """Prefill with the image (its tokens' mask and Qwen3.5's 3-D positions), then one token a
    step through the cache: the same greedy tokens as transformers' generate."""
    family, hf, ours = loaded
    ids, images, kwargs = batch(family, 1, seed=6)
    new = 6
    with torch.no_grad():
        ref = hf.generate(input_ids=ids, **kwargs, max_new_tokens=new, do_sample=False)
        cache = KVCache(
            ours.args, batch=1, max_len=ids.shape[1] + new, dtype=torch.float32, device="cpu"
        )
        tokens, got = ids, []
        for step in range(new):
            hidden = ours.hidden_states_cached(tokens, cache, images if step == 0 else None)
            got.append(int(ours.logits(hidden[0, -1]).argmax()))
            tokens = torch.tensor([[got[-1]]])
    assert got == ref[0, ids.shape[1] :].tolist()


def qwen35_moe_config() -> transformers.Qwen3_5MoeConfig:
    """The tiny Qwen3.5 with 4 experts (2 a token) and a shared expert in every layer."""
    cfg = qwen35_config().to_dict()
    text = {k: v for k, v in cfg["text_config"].items() if k != "intermediate_size"}
    text.update(
        model_type="qwen3_5_moe_text",
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=32,
    )
    vision = {**cfg["vision_config"], "model_type": "qwen3_5_moe"}
    return transformers.Qwen3_5MoeConfig(
        text_config=text, vision_config=vision, image_token_id=IMAGE_TOKEN
    )


@pytest.mark.slow
def test_qwen35_moe_logits_and_save_equal_transformers(tmp_path):
    case = Case(transformers.Qwen3_5MoeForConditionalGeneration, qwen35_moe_config(), IMAGE_TOKEN)
    hf = case.model()
    hf.save_pretrained(tmp_path / "source")
    ours = from_hf(tmp_path / "source", dtype=torch.float32, vision=True)
    ids, images, kwargs = batch("qwen35", 2)
    with torch.no_grad():
        assert rel(ours(ids, images=images), hf(input_ids=ids, **kwargs).logits) <= TOL
    save_hf(ours, tmp_path / "saved")
    back = type(hf).from_pretrained(tmp_path / "saved", dtype=torch.float32).eval()
    with torch.no_grad():
        assert rel(ours(ids, images=images), back(input_ids=ids, **kwargs).logits) <= TOL


def qwen_row(grid: list[int], s: int, seed: int) -> tuple[torch.Tensor, ImageInputs]:
    """A row of `s` tokens holding one Qwen3.5 image of patch grid `grid` (t, h, w)."""
    gen = torch.Generator().manual_seed(seed)
    n = grid[0] * grid[1] * grid[2] // 4
    ids = torch.cat([_text(3, gen), torch.full((n,), IMAGE_TOKEN), _text(s - 3 - n, gen)])
    pixels = torch.randn(n * 4, 96, generator=gen)
    return ids[None], ImageInputs(pixels, image_grid_thw=torch.tensor([grid]))


@pytest.mark.slow
def test_compiled_blocks_equal_eager_over_images_of_two_sizes(loaded):
    """The per-block compile (compiletune/compiler/regions.py) of a vision model, the tower's
    blocks too: the loss and gradients of eager, no recompile when the next batch's image has
    another size (Qwen3.5's patch count is dynamic, its 3-D positions data), or under Gemma 4's
    dense image mask."""
    import copy

    from compiletune.compiler.regions import CompileOptions, compile_regions
    from compiletune.loss.head import LossHead

    family, _, ours = loaded
    if family == "gemma3":
        pytest.skip("Gemma 4 covers the dense image mask here (CI time)")
    eager = ours
    compiled = copy.deepcopy(ours)
    compiled.tie_weights()
    head_e, head_c = LossHead(eager.output, "plain"), LossHead(compiled.output, "plain")
    regions = compile_regions(compiled, head_c, CompileOptions(backend="aot_eager", loss="plain"))
    if family == "qwen35":
        batches = [qwen_row([1, 4, 6], 24, 7), qwen_row([1, 6, 6], 24, 8)]
    else:
        # two images each: a batch of one image is a graph of its own (dynamo specialises 1)
        batches = [batch(family, 2, seed=seed)[:2] for seed in (8, 9)]
        s = max(ids.shape[1] for ids, _ in batches)
        pad = torch.ones(1, s, dtype=torch.long)
        batches = [(torch.cat([ids, pad[:, ids.shape[1] :]], 1), im) for ids, im in batches]
    for ids, images in batches:
        targets = torch.roll(ids, -1, dims=1)
        grads = []
        for model, head in ((eager, head_e), (compiled, head_c)):
            model.zero_grad(set_to_none=True)
            loss = head(model.hidden_states(ids, images=images), targets)
            loss.backward()
            grads.append((loss.detach(), [p.grad for p in model.layers.parameters()]))
        (le, ge), (lc, gc) = grads
        assert rel(lc, le) <= TOL
        for a, b in zip(gc, ge, strict=True):
            if b is not None and b.norm() > 0:
                assert rel(a, b) <= 1e-4
    stats = regions.stats()
    assert stats["recompiles"] == 0
    assert stats["regions"]["vision"]["compiles"] == 1  # the tower's blocks: one graph


def test_is_vision_checkpoint():
    from compiletune.models.vision.model import is_vision_checkpoint

    assert is_vision_checkpoint({"architectures": ["Gemma3ForConditionalGeneration"]})
    assert is_vision_checkpoint({"architectures": ["Qwen3_5MoeForConditionalGeneration"]})
    assert not is_vision_checkpoint({"architectures": ["Gemma3ForCausalLM"]})
    assert not is_vision_checkpoint({})


def test_clear_errors(loaded, tmp_path):
    """Image tokens and images that do not match, and vision=True on a text checkpoint."""
    from compiletune.errors import UserError
    from compiletune.models import build_model, from_name

    family, _, ours = loaded
    ids, images, _ = batch(family, 2)
    one = images.select(torch.tensor([0]))
    with torch.no_grad(), pytest.raises(ValueError, match="image tokens|runs of image tokens"):
        ours(ids, images=one)
    text = build_model(from_name("debug"))
    save_hf(text, tmp_path)
    with pytest.raises(UserError, match="has no vision tower"):
        from_hf(tmp_path, vision=True)


def test_processor_files_follow_the_model(tmp_path):
    case = gemma3_case()
    case.model().save_pretrained(tmp_path / "source")
    (tmp_path / "source" / "preprocessor_config.json").write_text('{"size": 32}\n')
    ours = from_hf(tmp_path / "source", dtype=torch.float32, vision=True)
    save_hf(ours, tmp_path / "saved")
    assert (tmp_path / "saved" / "preprocessor_config.json").read_text() == '{"size": 32}\n'


def test_lora_adapter_loads_in_peft_with_equal_logits(loaded, tmp_path):
    """A LoRA vision model's adapter folder: PEFT puts it on transformers' ForConditionalGeneration
    (the decoder's projections only, under model.language_model.) with our logits, and it loads
    back into ours."""
    import peft
    from lora_cases import randomize_adapters

    from compiletune.checkpoint import adapter_io
    from compiletune.models.lora import LoRASpec, apply_lora

    family, hf, _ = loaded
    hf.save_pretrained(tmp_path / "base")
    spec = LoRASpec(rank=4, alpha=8.0, targets=("q", "v"))

    def lora_model():
        model = from_hf(tmp_path / "base", dtype=torch.float32, vision=True)
        return apply_lora(model, spec, dtype=torch.float32, seed=3).eval()

    ours = lora_model()
    randomize_adapters(ours)
    adapter_io.save_adapter(ours, tmp_path / "adapter", base_model=str(tmp_path / "base"))
    ids, images, kwargs = batch(family, 1)
    with torch.no_grad():
        want = ours(ids, images=images)
        base = type(hf).from_pretrained(tmp_path / "base", dtype=torch.float32)
        theirs = peft.PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
        assert rel(theirs(input_ids=ids, **kwargs).logits, want) <= TOL
        again = lora_model()
        adapter_io.load_adapter(again, tmp_path / "adapter")
        assert rel(again(ids, images=images), want) <= TOL


# --- LoRA on the tower's projections (--lora-targets vision.*, models/vision/lora.py) ---------

TOWER_NAMES = {
    "gemma3": ("fc1", "fc2", "k_proj", "out_proj", "q_proj", "v_proj"),
    "qwen35": ("linear_fc1", "linear_fc2", "proj", "qkv"),
    "gemma4": (
        *("down_proj", "embedding_projection", "gate_proj", "input_proj", "k_proj", "o_proj"),
        *("q_proj", "up_proj", "v_proj"),
    ),
}


def test_tower_targets_are_the_checkpoints_module_names():
    """The names --lora-targets vision.NAME takes are those of the tower's linear modules in
    transformers' model (PEFT's target_modules), the Gemma 3 projector (a plain matrix) not
    among them; an unknown one is one line listing the tower's."""
    from compiletune.errors import UserError
    from compiletune.models.hf_config import args_from_hf_config
    from compiletune.models.lora_targets import parse_targets, parse_tower_targets
    from compiletune.models.vision.lora import resolve
    from compiletune.models.vision.model import tower_targets

    for family, case in CASES.items():
        hf = case().hf_class(case().config)
        config = {**hf.config.to_dict(), "architectures": [type(hf).__name__]}
        got = tower_targets(args_from_hf_config(config), config)
        assert got == TOWER_NAMES[family] == tuple(sorted(_tower_linears(hf))), family
    assert parse_targets("q,v,vision.q_proj,vision.fc1") == ("q", "v")
    assert parse_targets("vision.all-linear") == ()  # the tower alone
    assert parse_tower_targets("q,vision.fc1,vision.q_proj,vision.fc1") == ("fc1", "q_proj")
    assert resolve(("all-linear",), TOWER_NAMES["qwen35"], "x") == TOWER_NAMES["qwen35"]
    with pytest.raises(UserError, match="has no linear projection named q_proj; it has "):
        resolve(("q_proj",), TOWER_NAMES["qwen35"], "x")
    with pytest.raises(ValueError, match="vision.a.b"):
        parse_targets("q,vision.a.b")


def _tower_linears(hf: Any) -> set[str]:
    """The last part of the name of every Linear in transformers' towers (the wrapper's, for
    Gemma 4's `q_proj.linear`)."""
    prefixes = ("model.vision_tower.", "model.visual.", "model.embed_vision.")
    return {
        n.removesuffix(".linear").rsplit(".", 1)[-1]
        for n, m in hf.named_modules()
        if n.startswith(prefixes) and isinstance(m, torch.nn.Linear)
    }


def tower_lora_pair(
    family: str, hf: Any, folder: Any, targets: tuple[str, ...] = (), peft_model: bool = True
):
    """(ours with LoRA on every projection of the tower (and the decoder's `targets`), random
    adapters, saved to folder/adapter; PEFT's model of that folder, trainable, or None without
    `peft_model`). Gemma 4's clipping bounds are set so that some values clip (transformers'
    are +-inf)."""
    import peft
    from lora_cases import randomize_adapters

    from compiletune.checkpoint import adapter_io
    from compiletune.models.lora import LoRASpec, apply_lora

    hf = copy.deepcopy(hf)
    gen = torch.Generator().manual_seed(6)
    for name, bound in hf.named_buffers():
        if name.endswith(("_min", "_max")):
            sign = -1.0 if name.endswith("_min") else 1.0
            bound.fill_(sign * (0.5 + torch.rand((), generator=gen).item()))
    hf.save_pretrained(folder / "base")
    ours = from_hf(folder / "base", dtype=torch.float32, vision=True)
    spec = LoRASpec(rank=4, alpha=8.0, targets=targets, vision=TOWER_NAMES[family])
    apply_lora(ours, spec, dtype=torch.float32, seed=3)
    randomize_adapters(ours)
    adapter_io.save_adapter(ours, folder / "adapter", base_model=str(folder / "base"))
    if not peft_model:
        return ours.eval(), None
    base = type(hf).from_pretrained(folder / "base", dtype=torch.float32)
    theirs = peft.PeftModel.from_pretrained(base, folder / "adapter", is_trainable=True)
    return ours.eval(), theirs.eval()


def test_lora_on_the_towers_projections_loads_in_peft_with_equal_logits(loaded, tmp_path):
    """`--lora-targets vision.all-linear` (the tower alone): the adapter folder's keys are
    PEFT's names of the tower's modules, PEFT on transformers' model gives our logits with one
    and two images, the adapters matter, and the folder loads back into ours (and into the
    text model alone)."""
    from safetensors import safe_open

    from compiletune.checkpoint import adapter_io
    from compiletune.models.lora import apply_lora

    family, hf, _ = loaded
    ours, theirs = tower_lora_pair(family, hf, tmp_path)
    with safe_open(str(tmp_path / "adapter" / "adapter_model.safetensors"), "pt") as f:
        saved = set(f.keys())
    peft_keys = {k.replace(".default", "") for k, _ in theirs.named_parameters() if "lora_" in k}
    assert saved == peft_keys and len(saved) > 8
    assert all(
        k.startswith(
            (
                "base_model.model.model.vision_tower.",
                "base_model.model.model.visual.",
                "base_model.model.model.embed_vision.",
            )
        )
        for k in saved
    )
    spec = adapter_io.read_adapter_spec(tmp_path / "adapter")
    assert spec.targets == () and spec.vision == TOWER_NAMES[family]
    again = from_hf(tmp_path / "base", dtype=torch.float32, vision=True)
    apply_lora(again, spec, dtype=torch.float32)
    adapter_io.load_adapter(again, tmp_path / "adapter")
    for n_images in (1, 2):
        ids, images, kwargs = batch(family, n_images, seed=4)
        with torch.no_grad():
            want = ours(ids, images=images)
            assert rel(theirs(input_ids=ids, **kwargs).logits, want) <= TOL
            assert rel(again.eval()(ids, images=images), want) <= TOL
            with theirs.disable_adapter():  # the tower's adapters change the logits
                assert rel(theirs(input_ids=ids, **kwargs).logits, want) > 1e-3
    # the text model alone (a text-only run, `generate` without an image) loads the folder,
    # leaving the tower's adapters out, and gives PEFT's text-only logits
    text = apply_lora(from_hf(tmp_path / "base", dtype=torch.float32), spec, dtype=torch.float32)
    adapter_io.load_adapter(text, tmp_path / "adapter")
    ids = torch.randint(1, 280, (1, 12), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        assert rel(text.eval()(ids), theirs(input_ids=ids).logits) <= TOL


def test_tower_adapter_gradients_equal_peft(loaded, tmp_path):
    """One loss's gradients reach the tower's adapters (and the decoder's), equal to PEFT's on
    transformers' model; no frozen weight of the tower or the decoder gets one."""
    family, hf, _ = loaded
    ours, theirs = tower_lora_pair(family, hf, tmp_path, targets=("q", "v"))
    ids, images, kwargs = batch(family, 2, seed=5)
    weights = torch.randn(*ids.shape, hf.config.get_text_config().vocab_size)
    (ours(ids, images=images) * weights).sum().backward()
    (theirs(input_ids=ids, **kwargs).logits * weights).sum().backward()
    modules = dict(theirs.named_modules())
    checked = 0
    for native, peft_name in ours.tower_modules():
        mine = ours.get_submodule(native)
        other = modules[f"base_model.model.{peft_name}"]
        for ab, theirs_ab in (("lora_a", other.lora_A), ("lora_b", other.lora_B)):
            grad = getattr(mine, ab).grad
            assert grad is not None and grad.norm() > 0, (native, ab)
            assert rel(grad, theirs_ab["default"].weight.grad) <= 1e-4, (native, ab)
            checked += 1
    assert checked == 2 * len(ours.tower_modules())
    trained = {n for n, p in ours.named_parameters() if p.grad is not None}
    assert trained == {n for n, p in ours.named_parameters() if p.requires_grad}
    assert all(n.endswith(("lora_a", "lora_b")) for n in trained)
    assert any(n.startswith("layers.") for n in trained)


def test_merged_export_folds_the_tower_adapters(loaded, tmp_path):
    """--merge of a run with tower adapters: transformers' class loads the merged folder (the
    tower's weights with their adapters folded in, Gemma 4's clipping bounds kept) with our
    logits."""
    from compiletune.checkpoint import adapter_io

    family, hf, _ = loaded
    ours, _ = tower_lora_pair(family, hf, tmp_path, targets=("q",), peft_model=False)
    adapter_io.save_merged(ours, tmp_path / "merged", dtype=torch.float32)
    merged = type(hf).from_pretrained(tmp_path / "merged", dtype=torch.float32).eval()
    ids, images, kwargs = batch(family, 2, seed=6)
    with torch.no_grad():
        assert rel(merged(input_ids=ids, **kwargs).logits, ours(ids, images=images)) <= TOL


# Gemma 4's tower projections are Linears inside clipping modules: PEFT needs the inner one
GEMMA4_PEFT = r".*language_model.*\.(q_proj|v_proj)|.*vision_tower.*\.(q_proj|v_proj)\.linear"
PEFT_TARGETS = {  # as a PEFT user writes them (decoder and tower), and the tower's names here
    "gemma3": (["q_proj", "v_proj"], ("q_proj", "v_proj")),
    "qwen35": (["q_proj", "v_proj", "qkv"], ("qkv",)),
    "gemma4": (GEMMA4_PEFT, ("q_proj", "v_proj")),
}


def test_an_adapter_peft_made_on_the_tower_loads_into_ours(loaded, tmp_path):
    """PEFT's own adapter on the decoder's q/v and tower projections (random A and B) loads
    into ours: its targets read back as --lora-targets would name them, our logits equal
    PEFT's."""
    import peft

    from compiletune.checkpoint import adapter_io
    from compiletune.models.lora import apply_lora

    family, hf, _ = loaded
    hf.save_pretrained(tmp_path / "base")
    target_modules, tower = PEFT_TARGETS[family]
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=target_modules)
    config.init_lora_weights = False  # B random too: the adapters change the logits
    base = type(hf).from_pretrained(tmp_path / "base", dtype=torch.float32)
    torch.manual_seed(8)
    theirs = peft.get_peft_model(base, config).eval()
    theirs.save_pretrained(tmp_path / "adapter")
    spec = adapter_io.read_adapter_spec(tmp_path / "adapter")
    assert (spec.targets, spec.vision) == (("q", "v"), tower)
    ours = from_hf(tmp_path / "base", dtype=torch.float32, vision=True)
    apply_lora(ours, spec, dtype=torch.float32)
    adapter_io.load_adapter(ours, tmp_path / "adapter")
    ids, images, kwargs = batch(family, 2, seed=9)
    with torch.no_grad():
        want = theirs(input_ids=ids, **kwargs).logits
        assert rel(ours.eval()(ids, images=images), want) <= TOL
        with theirs.disable_adapter():
            assert rel(theirs(input_ids=ids, **kwargs).logits, want) > 1e-3
