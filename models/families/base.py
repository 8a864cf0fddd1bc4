"""What a model family is, as data: the `Family` record every family module fills in.

A family is one HF architecture (or a few close ones): its `model_type` and architecture name,
what transformers assumes when a config key is absent, the switches by which its decoder
differs from the plain pre-norm decoder (each one a `ModelArgs` field or a config key written
on save), hooks for the config fields no switch covers, its tensor names and layouts, its
presets and, where llama.cpp runs it, its GGUF export data. Shared code (models/hf_config.py,
models/hf_names.py, models/hf.py, the GGUF export, the adapter files) reads these fields and
never a family's name.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ..args import ModelArgs

Get = Callable[..., Any]  # get(key, default=None, required=False): a config value or its default
# (to native, to HF): tensor -> tensor, for a tensor a family's checkpoints lay out otherwise
# than the native module (typed loosely: this module, like the presets, loads without torch)
Layout = tuple[Callable[[Any], Any], Callable[[Any], Any]]


@dataclass(frozen=True)
class Gguf:
    """The family in llama.cpp's terms (compiletune/gguf_arch.py reads it)."""

    arch: str  # the member of gguf.MODEL_ARCH (general.architecture)
    interleave_qk: bool = False  # reorder q/k rows for llama.cpp's pairwise rotary
    norm_plus_one: bool = False  # the file stores 1 + w for every RMSNorm weight
    swa_every: int = 0  # llama.cpp's fixed pattern: every n-th layer is global (0: none)
    # the layer count of the one model llama.cpp scales queries by 1/sqrt(hidden / heads)
    # rather than 1/sqrt(head_dim) (0: none)
    wide_scale_layers: int = 0
    writes_window: bool = False  # sliding_window is written for every layer


@dataclass(frozen=True)
class Vision:
    """The family's vision-language checkpoints (`Family.multimodal`) as a vision run loads them
    (models/vision/model.py): which tower, and how the decoder takes the images."""

    tower: str  # the tower's kind: a key of models/vision/model.py's TOWERS
    image_token_key: str  # config.json's key for the image token's id
    # where the checkpoint keeps the text model's tensors, and its head
    text_prefix: str = "model.language_model."
    head: str = "lm_head.weight"
    # the layer kinds in which an image's tokens see each other (bidirectionally), given the
    # checkpoint's whole config.json; () for none
    image_blocks: Callable[[dict], tuple[str, ...]] = lambda cfg: ()
    mrope: bool = False  # text positions are 3-D (time, row, column) around the images


@dataclass(frozen=True)
class Family:
    model_type: str
    architecture: str  # config.json "architectures"[0]
    defaults: dict[str, Any]  # what transformers assumes when a key is absent
    qkv_bias: bool = False  # q/k/v projections with a bias
    qk_norm: bool = False  # RMSNorm on each q and k head
    gemma: bool = False  # (1 + w) norms, sqrt(d) embedding scale, sandwich norms, GeGLU,
    #   query_pre_attn_scalar and soft-caps, every layer's kind listed
    windows: bool = False  # reads sliding_window (and layer kinds) from the config
    qwen_window_flag: bool = False  # use_sliding_window (refused when true) and max_window_layers
    local_rope: bool = False  # a rope base of its own on sliding layers
    fused_projections: bool = False  # qkv_proj / gate_up_proj
    olmo: bool = False  # norms after attention and the MLP only (weights applied in fp32),
    #   q/k norms over the whole projection
    window_flag: bool = False  # sliding_window applies only with use_sliding_window: true
    linear_layers: bool = False  # Gated DeltaNet "linear_attention" layers beside full ones;
    #   (1 + w) norms, gated attention output
    bias_flag: bool = False  # attention_bias says whether q/k/v have biases
    writes_attention_bias: bool = False  # its config has attention_bias: false written out
    writes_mlp_bias: bool = False  # ... and mlp_bias: false
    # the default layer kinds when the config lists none
    layer_kinds: Callable[[dict, int], tuple[str, ...]] | None = None
    # mixture of experts: the ModelArgs fields from the config, and the config keys from them
    read_moe: Callable[[dict, int, Get], dict[str, Any]] | None = None
    write_moe: Callable[[ModelArgs, dict], None] | None = None
    # other fields of its own: the ModelArgs fields from the config, the config keys from them
    read_extra: Callable[[dict, int, Get], dict[str, Any]] | None = None
    write_extra: Callable[[ModelArgs, dict], None] | None = None
    # multimodal architectures whose text model this family is (its weights renamed at load)
    multimodal: tuple[str, ...] = ()
    vision: Vision | None = None  # how a vision run loads those (None: text model only)
    # quantization_config methods read (dequantized as they load) beside block-scaled fp8
    quantizations: tuple[str, ...] = ()
    # --- tensors (models/hf_names.py) ---
    # native suffix -> HF suffix inside a block (None: the standard names, models/names.py)
    block_names: Mapping[str, str] | None = None
    # experts the hub stores one tensor per expert and projection: (module path of the experts,
    # names of gate, up and down); None: none, or stacked ones named in `block_names`
    expert_names: tuple[str, tuple[str, str, str]] | None = None
    # native suffix -> (to native, to HF) for tensors stored in another layout
    layouts: Mapping[str, Layout] = field(default_factory=dict)
    # the stacked experts' gate and up columns are stored interleaved (gate, up, gate, ...):
    # so are the rows of a PEFT adapter's B over them
    gate_up_interleaved: bool = False
    # checkpoints store layers past num_hidden_layers (multi-token prediction), left unused
    extra_layers_unused: bool = False
    # --- the rest ---
    presets: Mapping[str, ModelArgs] = field(default_factory=dict)
    gguf: Gguf | None = None  # llama.cpp's terms, where the GGUF export writes the family

    @property
    def moe(self) -> bool:
        return self.read_moe is not None
