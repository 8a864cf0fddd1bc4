"""A vision-language model: the native decoder with its family's vision tower.

`VisionLanguageModel` is a `Transformer` (every trainer mechanism that walks the decoder's
blocks sees the same blocks) with one more child, `vision_tower`, and three differences in its
forward when a batch carries images (`ImageInputs`):

- embedding: the tower's image embeddings replace the token embeddings at the image tokens'
  places (the chat template put one image token per embedding; the family's config names its
  id), as transformers' `...ForConditionalGeneration` does with `masked_scatter`; the per-layer
  inputs (Gemma 4) see those tokens as padding, as transformers' do;
- attention: the tokens of one image see each other on the layer kinds the family names
  (`Vision.image_blocks`: Gemma 3 every layer, Gemma 4 its sliding ones), `mask.ImageBlocks`;
- positions: Qwen3.5's 3-D (time, row, column) text positions (`Vision.mrope`), computed from
  the token ids and `image_grid_thw` (per document in packed rows), rotate q and k with the
  interleaved multi-axis rotary.

Which tower a family has is data (`Family.vision`, models/families/); the towers by kind are
`TOWERS` below. The checkpoint is the family's `...ForConditionalGeneration` layout: the text
model's tensors under `Vision.text_prefix`, the tower's under its own names (`NameMap`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from compiletune.errors import UserError
from compiletune.torch_internals import is_fake

from ..args import ModelArgs
from ..cache import KVCache
from ..decoder import Transformer
from ..families import FAMILIES
from ..families.base import Vision
from ..lora import FrozenLinear, LoRALinear, LoRASpec
from ..names import strip_wrappers
from ..rope import rope_inv_freq
from . import lora as tower_lora
from .common import NameMap, hf_state_dict, load_hf_state_dict
from .gemma4 import Gemma4VisionArgs, Gemma4VisionTower, gemma4_vision_names
from .inputs import ImageInputs
from .mask import ImageBlocks, image_runs
from .qwen import (
    Qwen35VisionTower,
    QwenVisionArgs,
    grid_values,
    mrope_angles,
    qwen35_vision_names,
    row_positions,
)
from .siglip import Gemma3VisionTower, SiglipArgs, gemma3_vision_names

TOWER = "vision_tower"  # the tower's attribute (and its parameters' name prefix)
# the image processor's files of a checkpoint folder: a vision model keeps them from its source
# and writes them beside every save, so AutoProcessor loads a saved step unchanged
PROCESSOR_FILES = ("preprocessor_config.json", "processor_config.json")


@dataclass(frozen=True)
class TowerKind:
    """How to build a kind of tower from a checkpoint's config, name its tensors, and run it on
    a batch's `ImageInputs` (-> image embeddings [n_image_tokens, d_text], in token order)."""

    args: Any  # a class with from_hf(config, where)
    build: Callable[[Any], nn.Module]
    names: Callable[[Any], NameMap]
    features: Callable[[nn.Module, ImageInputs], Tensor]
    blocks: str = "layers"  # the tower's attribute holding its blocks (each compiled alone)
    # (checkpoint prefix, prefix in transformers' model) where they differ: PEFT's names
    peft_prefixes: tuple[tuple[str, str], ...] = ()


def _gemma3_features(tower: nn.Module, images: ImageInputs) -> Tensor:
    return tower(images.pixel_values).flatten(0, 1)


def _qwen_features(tower: nn.Module, images: ImageInputs) -> Tensor:
    if images.image_grid_thw is None:
        raise ValueError("Qwen3.5's images need image_grid_thw (the processor gives it)")
    return tower(images.pixel_values, images.image_grid_thw)


def _gemma4_features(tower: nn.Module, images: ImageInputs) -> Tensor:
    if images.image_position_ids is None:
        raise ValueError("Gemma 4's images need image_position_ids (the processor gives them)")
    return tower(images.pixel_values, images.image_position_ids)


TOWERS: dict[str, TowerKind] = {
    "siglip": TowerKind(
        SiglipArgs,
        Gemma3VisionTower,
        gemma3_vision_names,
        _gemma3_features,
        peft_prefixes=(("vision_tower.vision_model.", "model.vision_tower."),),
    ),
    "qwen": TowerKind(
        QwenVisionArgs, Qwen35VisionTower, qwen35_vision_names, _qwen_features, "blocks"
    ),
    "gemma4": TowerKind(Gemma4VisionArgs, Gemma4VisionTower, gemma4_vision_names, _gemma4_features),
}


def vision_of(args: ModelArgs, where: str = "config.json") -> Vision:
    """The family's `Vision` entry; a family without one is a `UserError`."""
    fam = FAMILIES.get(args.family)
    if fam is None or fam.vision is None:
        raise UserError(
            f"{where}: family {args.family!r} has no vision tower in compiletune; vision "
            "checkpoints: "
            + ", ".join(a for f in FAMILIES.values() if f.vision for a in f.multimodal)
        )
    return fam.vision


def tower_targets(args: ModelArgs, config: dict, where: str = "config.json") -> tuple[str, ...]:
    """The names `--lora-targets vision.NAME` may give on the tower `config` (a checkpoint's
    whole config.json) describes, sorted (built on the meta device: no weights)."""
    kind = TOWERS[vision_of(args, where).tower]
    tower_args = kind.args.from_hf(config, where)
    with torch.device("meta"):
        tower = kind.build(tower_args)
    found = tower_lora.tower_linears(tower, kind.names(tower_args).names, kind.peft_prefixes)
    return tuple(sorted({tower_lora.target_name(hf) for _, hf in found}))


def is_vision_checkpoint(config: dict) -> bool:
    """Is `config` (a checkpoint's whole config.json) one `from_hf(..., vision=True)` loads: a
    vision-language architecture whose family has a tower here?"""
    archs = config.get("architectures") or []
    return any(arch in f.multimodal and f.vision for f in FAMILIES.values() for arch in archs[:1])


class VisionLanguageModel(Transformer):
    """The decoder of `args` plus the vision tower `config` (the checkpoint's whole
    config.json, a dict) describes. The tower is built on the current default device in the
    default dtype; `load_tower` replaces it with the checkpoint's."""

    def __init__(self, args: ModelArgs, config: dict, where: str = "config.json"):
        super().__init__(args)
        self.vision = vision = vision_of(args, where)
        self.hf_config = config
        kind = TOWERS[vision.tower]
        self.tower_args = kind.args.from_hf(config, where)
        self.vision_tower = kind.build(self.tower_args)
        token = config.get(vision.image_token_key)
        if not isinstance(token, int) or isinstance(token, bool):
            raise UserError(f"{where}: {vision.image_token_key} (the image token's id) is missing")
        self.image_token_id = token
        self.image_kinds = vision.image_blocks(config)
        self.mrope_section: tuple[int, ...] = ()
        if vision.mrope:
            text = config.get("text_config") or {}
            rope = text.get("rope_parameters") or text.get("rope_scaling") or {}
            section = rope.get("mrope_section")
            if not (isinstance(section, list) and len(section) == 3):
                raise UserError(
                    f"{where}: text_config's rope_parameters need mrope_section [t, h, w]"
                )
            self.mrope_section = tuple(int(n) for n in section)
            if args.rope_scaling is not None:
                raise UserError(
                    f"{where}: rope scaling with 3-D (mrope) positions is not supported"
                )

    # --- the tower's tensors ----------------------------------------------------------------

    @property
    def names(self) -> NameMap:
        return TOWERS[self.vision.tower].names(self.tower_args)

    def load_tower(
        self, tensors: Mapping[str, Tensor], where: str, device: Any = None, dtype: Any = None
    ) -> None:
        """A new tower on `device` in `dtype` (default: the embedding's) from `tensors`
        (checkpoint name -> tensor, read on demand)."""
        ref = self.tok_embeddings.weight
        device = ref.device if device is None else device
        with torch.device(device):
            tower = TOWERS[self.vision.tower].build(self.tower_args)
        tower.to(dtype or ref.dtype)
        load_hf_state_dict(tower, tensors, self.names, where)
        self.vision_tower = tower

    def tower_entries(
        self, gather: Callable[[Tensor], Tensor] = lambda t: t, merge: bool = False
    ) -> list[tuple[str, tuple[int, ...], Callable[[], Tensor]]]:
        """(checkpoint name, shape, fetch) of every tower tensor, for `write_hf_folder`. An
        adapted projection gives its base weight, with the adapter folded in if `merge`."""
        names = self.names.names
        lora = {
            strip_wrappers(n): m
            for n, m in self.vision_tower.named_modules()
            if isinstance(m, FrozenLinear)
        }
        out = []
        for native, tensor in self.vision_tower.state_dict().items():
            native = strip_wrappers(native)
            module, _, leaf = native.rpartition(".")
            fetch = lambda t=tensor: gather(t).detach()  # noqa: E731
            if module in lora and leaf in ("lora_a", "lora_b"):
                continue  # (saved in the adapter folder)
            if module in lora and leaf == "weight":
                m = lora[module]
                fetch = m.merged_weight if merge and isinstance(m, LoRALinear) else m.dense_weight
            out.append((names[native], tuple(tensor.shape), fetch))
        return out

    def tower_modules(self) -> list[tuple[str, str]]:
        """(native module name, module name in transformers' model) of the tower's linear
        projections, in module order; native names start with `vision_tower.`."""
        kind = TOWERS[self.vision.tower]
        found = tower_lora.tower_linears(self.vision_tower, self.names.names, kind.peft_prefixes)
        return [(f"{TOWER}.{native}", hf) for native, hf in found]

    def adapt_tower(self, spec: LoRASpec, dtype: torch.dtype, seed: int) -> None:
        """LoRA on the tower's projections `spec.vision` names (models/vision/lora.py); the
        rest of the tower frozen. Adapters drawn from a generator seeded with `seed` + 1."""
        modules = self.tower_modules()
        names = {tower_lora.target_name(hf) for _, hf in modules}
        wanted = set(tower_lora.resolve(spec.vision, names, self.args.family))
        adapted = [
            n.removeprefix(f"{TOWER}.") for n, hf in modules if tower_lora.target_name(hf) in wanted
        ]
        tower_lora.adapt(self.vision_tower, adapted, spec, dtype, seed + 1)

    def tower_state_dict(self) -> dict[str, Tensor]:
        """The tower's tensors under the checkpoint's names."""
        return hf_state_dict(self.vision_tower, self.names)

    def read_processor_files(self, folder: Path) -> None:
        """Keep the image processor's files of checkpoint `folder` (`PROCESSOR_FILES`)."""
        self.processor_files = {
            name: (folder / name).read_text()
            for name in PROCESSOR_FILES
            if (folder / name).is_file()
        }

    def write_processor_files(self, folder: Path) -> None:
        """Write the kept processor files into `folder` (those a tokenizer save left out)."""
        for name, text in getattr(self, "processor_files", {}).items():
            if not (folder / name).exists():
                (folder / name).write_text(text)

    def vision_blocks(self) -> nn.ModuleList:
        """The tower's blocks, which the per-block compile compiles as one region."""
        return getattr(self.vision_tower, TOWERS[self.vision.tower].blocks)

    def train_vision(self, on: bool) -> None:
        """Make the tower's parameters trainable (`on`) or frozen (the default of a run)."""
        for p in self.vision_tower.parameters():
            p.requires_grad_(on)

    # --- the forward ------------------------------------------------------------------------

    def image_features(self, images: ImageInputs) -> Tensor:
        """The tower's image embeddings [n_image_tokens, d_text] for a batch's images."""
        kind = TOWERS[self.vision.tower]
        return kind.features(self.vision_tower, images)

    def inputs(self, tokens: Tensor, images: Any = None) -> tuple[Tensor, Tensor | None]:
        is_image = tokens == self.image_token_id
        # the image token's id may lie past the vocabulary: embed padding there (replaced below)
        pad = self.args.pad_id if self.args.pad_id is not None else 0
        text = tokens.masked_fill(is_image, pad)
        h = self.embed(text)
        if images is not None:
            features = self.image_features(images).to(h.dtype)
            # (a fake tensor, the memory estimate's, has no count to check: its batch is built
            # with one image token per embedding, estimate/images.py)
            n = features.shape[0] if is_fake(is_image) else int(is_image.sum())
            if features.shape[0] != n:
                raise ValueError(
                    f"{n} image tokens in the batch, but its images give {features.shape[0]} "
                    "embeddings; the token ids and the images are from different examples"
                )
            h = h.masked_scatter(is_image[..., None], features)
        ple = None if self.per_layer_inputs is None else self.per_layer_inputs(text, h)
        return h, ple

    def hidden_states(
        self,
        tokens: Tensor,
        positions: Tensor | None = None,
        doc_ids: Tensor | None = None,
        router_stats: list[Tensor] | None = None,
        documents: tuple[Tensor, int] | None = None,
        images: Any = None,
    ) -> Tensor:
        if images is not None and self.mrope_section:
            positions = self.mrope_positions(tokens, images, doc_ids)
        if images is not None and self.image_kinds:
            runs = image_runs(tokens, self.image_token_id)
            doc_ids, documents = ImageBlocks(runs, self.image_kinds, doc_ids), None
        return super().hidden_states(tokens, positions, doc_ids, router_stats, documents, images)

    def hidden_states_cached(self, tokens: Tensor, cache: KVCache, images: Any = None) -> Tensor:
        """As the decoder's; `images` go with the prompt's first pass (an empty cache), and
        their tokens see each other there as in training."""
        if images is not None and not cache.prefill:
            raise ValueError("images go with the prompt's first pass, into an empty cache")
        if images is not None and self.image_kinds:
            cache.images = ImageBlocks(image_runs(tokens, self.image_token_id), self.image_kinds)
        try:
            return super().hidden_states_cached(tokens, cache, images)
        finally:
            cache.images = None

    def cached_positions(self, tokens: Tensor, cache: KVCache, images: Any = None) -> Tensor:
        """Qwen3.5 with images: the prompt's 3-D positions; the tokens after it go on from the
        largest (each row's lead over its token count kept in `cache.position_offset`)."""
        if images is not None and self.mrope_section:
            positions = self.mrope_positions(tokens, images)
            cache.position_offset = positions.amax(dim=(0, 2)) + 1 - tokens.shape[1]  # [b]
            return positions
        positions = super().cached_positions(tokens, cache, images)
        offset = cache.position_offset
        return positions + offset[:, None] if isinstance(offset, Tensor) else positions

    def mrope_positions(
        self, tokens: Tensor, images: ImageInputs, doc_ids: Tensor | None = None
    ) -> Tensor:
        """[3, b, s] positions: each document's (each row's without `doc_ids`) from 0, its
        images' tokens at (time, row, column) offsets, the text after an image on from them."""
        b, s = tokens.shape
        if is_fake(tokens):  # the memory estimate's: no values, and only the shape counts
            return torch.arange(s, device=tokens.device).repeat(3, b, 1)
        grids = [] if images.image_grid_thw is None else grid_values(images.image_grid_thw)
        merge = self.tower_args.spatial_merge_size
        out = torch.zeros(3, b, s, dtype=torch.long)
        host = tokens.cpu()
        docs = None if doc_ids is None else doc_ids.cpu()
        used = 0
        for i in range(b):
            for start, end in _segments(docs[i] if docs is not None else None, s):
                row, n = row_positions(host[i, start:end], grids[used:], self.image_token_id, merge)
                out[:, i, start:end] = row
                used += n
        if used != len(grids):
            raise ValueError(f"{len(grids)} images in image_grid_thw, {used} runs of image tokens")
        return out.to(tokens.device)

    def ropes(
        self, positions: Tensor, dtype: torch.dtype, rowwise: bool = False
    ) -> dict[str, tuple[Tensor, Tensor]]:
        if positions.dim() != 3:
            return super().ropes(positions, dtype, rowwise)
        out = {}
        for kind in {layer.kind for layer in self.layers}:
            inv_freq = rope_inv_freq(self.args, positions.device, kind)
            freqs = mrope_angles(positions, inv_freq, self.mrope_section)  # [b, s, rd / 2]
            emb = torch.cat((freqs, freqs), dim=-1)
            out[kind] = (emb.cos().to(dtype), emb.sin().to(dtype))
        return out


def _segments(doc_ids: Tensor | None, s: int) -> Iterator[tuple[int, int]]:
    """(start, end) of each run of equal doc ids in a row; the whole row without them."""
    if doc_ids is None:
        yield 0, s
        return
    start = 0
    values = doc_ids.tolist()
    for j in range(1, s + 1):
        if j == s or values[j] != values[start]:
            yield start, j
            start = j


def text_checkpoint_name(vision: Vision, hf: str) -> str:
    """The ForConditionalGeneration name of a text-model tensor's `model.` / `lm_head.` name."""
    if hf == "lm_head.weight":
        return vision.head
    return vision.text_prefix + hf.removeprefix("model.")


def vision_config(model: VisionLanguageModel, text: dict, dtype: torch.dtype) -> dict:
    """The checkpoint's config.json with `text` (the decoder's config as written for its text
    model) as its text_config."""
    cfg = dict(model.hf_config)
    inner = {k: v for k, v in text.items() if k not in ("architectures", "torch_dtype")}
    old = cfg.get("text_config") or {}
    cfg["text_config"] = {**old, **inner}
    for key in ("rope_parameters", "rope_scaling"):  # keys the decoder does not read stay
        if isinstance(old.get(key), dict) and isinstance(inner.get(key), dict):
            cfg["text_config"][key] = {**old[key], **inner[key]}
    cfg["dtype" if "dtype" in cfg else "torch_dtype"] = str(dtype).removeprefix("torch.")
    if "tie_word_embeddings" in cfg and "tie_word_embeddings" in text:
        cfg["tie_word_embeddings"] = text["tie_word_embeddings"]
    return cfg
