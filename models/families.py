"""The HF architectures compiletune reads and writes, one `Family` entry each.

A family is data: which HF architecture and `model_type` it is, what transformers assumes when a
config key is absent, and the switches by which its decoder differs from Llama's (each one a
`ModelArgs` field or a config key written on save). `models/hf.py` reads and writes every
family through these entries, so a new family is one new entry (with a hook where its config
has fields no other family has) plus its tests.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from . import family_hooks as hooks
from .args import ModelArgs
from .family_hooks import Get


@dataclass(frozen=True)
class Family:
    model_type: str
    architecture: str  # config.json "architectures"[0]
    defaults: dict[str, Any]  # what transformers assumes when a key is absent
    qkv_bias: bool = False  # q/k/v projections with a bias (Qwen2)
    qk_norm: bool = False  # RMSNorm on each q and k head
    gemma: bool = False  # (1 + w) norms, sqrt(d) embedding scale, sandwich norms, GeGLU,
    #   query_pre_attn_scalar and soft-caps, every layer's kind listed
    windows: bool = False  # reads sliding_window (and layer kinds) from the config
    qwen_window_flag: bool = False  # use_sliding_window (refused when true) and max_window_layers
    local_rope: bool = False  # a rope base of its own on sliding layers (Gemma 3)
    fused_projections: bool = False  # qkv_proj / gate_up_proj (Phi-3)
    olmo: bool = False  # norms after attention and the MLP only (weights applied in fp32),
    #   q/k norms over the whole projection
    window_flag: bool = False  # sliding_window applies only with use_sliding_window: true
    linear_layers: bool = False  # Gated DeltaNet "linear_attention" layers beside full ones;
    #   (1 + w) norms, gated attention output (Qwen3.5, Qwen3-Next)
    bias_flag: bool = False  # attention_bias says whether q/k/v have biases (GLM-4.5)
    writes_attention_bias: bool = False  # its config has attention_bias: false written out
    writes_mlp_bias: bool = False  # ... and mlp_bias: false
    # the default layer kinds when the config lists none (Gemma's patterns)
    layer_kinds: Callable[[dict, int], tuple[str, ...]] | None = None
    # mixture of experts: the ModelArgs fields from the config, and the config keys from them
    read_moe: Callable[[dict, int, Get], dict[str, Any]] | None = None
    write_moe: Callable[[ModelArgs, dict], None] | None = None
    # other fields of its own: the ModelArgs fields from the config, the config keys from them
    read_extra: Callable[[dict, int, Get], dict[str, Any]] | None = None
    write_extra: Callable[[ModelArgs, dict], None] | None = None

    @property
    def moe(self) -> bool:
        return self.read_moe is not None


# --- the table -------------------------------------------------------------------------------

# What transformers' Gemma 2 and Gemma 3 configs both assume when a key is absent.
_GEMMA_DEFAULTS: dict[str, Any] = {
    "hidden_size": 2304,
    "intermediate_size": 9216,
    "num_hidden_layers": 26,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True,
    "pad_token_id": 0,
    "query_pre_attn_scalar": 256,
    "sliding_window": 4096,
    "hidden_activation": "gelu_pytorch_tanh",
}
_QWEN_DEFAULTS: dict[str, Any] = {"rms_norm_eps": 1e-6, "max_position_embeddings": 32768}
# What transformers' Qwen3.5, Qwen3.5-MoE and Qwen3-Next configs assume for their
# linear-attention layers and rotary fraction.
_LINEAR_DEFAULTS: dict[str, Any] = {
    "head_dim": 256,
    "partial_rotary_factor": 0.25,
    "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 32,
}

FAMILIES: dict[str, Family] = {
    f.model_type: f
    for f in (
        Family(
            "llama",
            "LlamaForCausalLM",
            {"rms_norm_eps": 1e-6, "max_position_embeddings": 2048},
            writes_attention_bias=True,
            writes_mlp_bias=True,
        ),
        Family(
            "qwen2",
            "Qwen2ForCausalLM",
            {**_QWEN_DEFAULTS, "num_key_value_heads": 32},
            qkv_bias=True,
            qwen_window_flag=True,
        ),
        Family(
            "qwen3",
            "Qwen3ForCausalLM",
            {**_QWEN_DEFAULTS, "num_key_value_heads": 32, "head_dim": 128},
            qk_norm=True,
            qwen_window_flag=True,
            writes_attention_bias=True,
        ),
        Family(
            "mistral",
            "MistralForCausalLM",
            {
                "rms_norm_eps": 1e-6,
                "max_position_embeddings": 4096 * 32,
                "num_key_value_heads": 8,
                "sliding_window": 4096,
            },
            windows=True,
        ),
        Family(
            "gemma2",
            "Gemma2ForCausalLM",
            {
                **_GEMMA_DEFAULTS,
                "vocab_size": 256000,
                "max_position_embeddings": 8192,
                "attn_logit_softcapping": 50.0,
                "final_logit_softcapping": 30.0,
            },
            gemma=True,
            windows=True,
            writes_attention_bias=True,
            layer_kinds=hooks.gemma2_kinds,
        ),
        Family(
            "gemma3_text",
            "Gemma3ForCausalLM",
            {
                **_GEMMA_DEFAULTS,
                "vocab_size": 262208,
                "max_position_embeddings": 131072,
                "rope_theta": 1000000.0,
                "rope_local_base_freq": 10000.0,
                "sliding_window_pattern": 6,
            },
            qk_norm=True,
            gemma=True,
            windows=True,
            local_rope=True,
            writes_attention_bias=True,
            layer_kinds=hooks.gemma3_kinds,
        ),
        Family(
            "gemma4_text",
            "Gemma4ForCausalLM",
            {
                **_GEMMA_DEFAULTS,
                "vocab_size": 262144,
                "num_hidden_layers": 30,
                "max_position_embeddings": 131072,
                "sliding_window": 512,
                "query_pre_attn_scalar": None,
                "global_head_dim": 512,
                "hidden_size_per_layer_input": 256,
                "vocab_size_per_layer_input": 262144,
            },
            qk_norm=True,
            gemma=True,
            windows=True,
            local_rope=True,
            writes_attention_bias=True,
            layer_kinds=hooks.gemma4_kinds,
            read_moe=hooks.read_gemma4_moe,
            read_extra=hooks.read_gemma4,
            write_extra=hooks.write_gemma4,
        ),
        Family(
            "phi3",
            "Phi3ForCausalLM",
            {
                "vocab_size": 32064,
                "pad_token_id": 32000,
                "rms_norm_eps": 1e-5,
                "max_position_embeddings": 4096,
                "tie_word_embeddings": False,
            },
            windows=True,
            fused_projections=True,
            write_extra=hooks.write_phi3,
        ),
        Family(
            "smollm3",
            "SmolLM3ForCausalLM",
            {
                "vocab_size": 128256,
                "pad_token_id": 128004,
                "hidden_size": 2048,
                "intermediate_size": 11008,
                "num_hidden_layers": 36,
                "num_attention_heads": 16,
                "num_key_value_heads": 4,
                "max_position_embeddings": 32768,
                "rms_norm_eps": 1e-6,
                "rope_theta": 2000000.0,
                "tie_word_embeddings": True,
            },
            windows=True,
            window_flag=True,
            writes_attention_bias=True,
            writes_mlp_bias=True,
            layer_kinds=hooks.smollm3_kinds,
            read_extra=hooks.read_smollm3,
            write_extra=hooks.write_smollm3,
        ),
        Family(
            "olmo3",
            "Olmo3ForCausalLM",
            {
                "vocab_size": 50304,
                "pad_token_id": 1,
                "hidden_size": 4096,
                "intermediate_size": 11008,
                "num_hidden_layers": 32,
                "num_attention_heads": 32,
                "max_position_embeddings": 2048,
                "rms_norm_eps": 1e-5,
                "rope_theta": 500000.0,
                "sliding_window": 4096,
                "tie_word_embeddings": False,
            },
            qk_norm=True,
            olmo=True,
            windows=True,
            local_rope=True,
            writes_attention_bias=True,
            layer_kinds=hooks.olmo3_kinds,
        ),
        Family(
            "qwen3_5_text",
            "Qwen3_5ForCausalLM",
            {
                "vocab_size": 248320,
                "hidden_size": 4096,
                "intermediate_size": 12288,
                "num_hidden_layers": 32,
                "num_attention_heads": 16,
                "num_key_value_heads": 4,
                "max_position_embeddings": 32768,
                "rms_norm_eps": 1e-6,
                "tie_word_embeddings": False,
                **_LINEAR_DEFAULTS,
            },
            qk_norm=True,
            linear_layers=True,
            writes_attention_bias=True,
            layer_kinds=hooks.qwen3_5_kinds,
            read_extra=hooks.read_linear,
            write_extra=hooks.write_linear,
        ),
        Family(
            "qwen3_5_moe_text",
            "Qwen3_5MoeForCausalLM",
            {
                "vocab_size": 248320,
                "hidden_size": 2048,
                "num_hidden_layers": 40,
                "num_attention_heads": 16,
                "num_key_value_heads": 2,
                "max_position_embeddings": 32768,
                "rms_norm_eps": 1e-6,
                "tie_word_embeddings": False,
                **_LINEAR_DEFAULTS,
                "moe_intermediate_size": 512,
                "shared_expert_intermediate_size": 512,
                "num_experts_per_tok": 8,
                "num_experts": 256,
                "router_aux_loss_coef": 0.001,
            },
            qk_norm=True,
            linear_layers=True,
            writes_attention_bias=True,
            layer_kinds=hooks.qwen3_5_kinds,
            read_moe=hooks.read_qwen3_5_moe,
            write_moe=hooks.write_qwen3_5_moe,
            read_extra=hooks.read_linear,
            write_extra=hooks.write_linear,
        ),
        Family(
            "qwen3_next",
            "Qwen3NextForCausalLM",
            {
                "vocab_size": 151936,
                "hidden_size": 2048,
                "intermediate_size": 5632,
                "num_hidden_layers": 48,
                "num_attention_heads": 16,
                "num_key_value_heads": 2,
                "max_position_embeddings": 32768,
                "rms_norm_eps": 1e-6,
                "tie_word_embeddings": False,
                **_LINEAR_DEFAULTS,
                "decoder_sparse_step": 1,
                "moe_intermediate_size": 512,
                "shared_expert_intermediate_size": 512,
                "num_experts_per_tok": 10,
                "num_experts": 512,
                "num_local_experts": 512,
                "norm_topk_prob": True,
                "router_aux_loss_coef": 0.001,
            },
            qk_norm=True,
            linear_layers=True,
            writes_attention_bias=True,
            layer_kinds=hooks.qwen3_5_kinds,
            read_moe=hooks.read_qwen3_next,
            write_moe=hooks.write_qwen3_next,
            write_extra=hooks.write_linear,
        ),
        Family(
            "gpt_oss",
            "GptOssForCausalLM",
            {
                "vocab_size": 201088,
                "hidden_size": 2880,
                "intermediate_size": 2880,
                "num_hidden_layers": 36,
                "num_attention_heads": 64,
                "num_key_value_heads": 8,
                "head_dim": 64,
                "sliding_window": 128,
                "max_position_embeddings": 131072,
                "rms_norm_eps": 1e-5,
                "rope_theta": 150000.0,
                "tie_word_embeddings": False,
                "num_local_experts": 128,
                "num_experts_per_tok": 4,
                "router_aux_loss_coef": 0.001,
                "swiglu_limit": 7.0,
                "swiglu_alpha": 1.702,
                "attention_bias": True,
            },
            qkv_bias=True,
            windows=True,
            layer_kinds=hooks.gemma2_kinds,
            read_moe=hooks.read_gpt_oss_moe,
            write_moe=hooks.write_gpt_oss,
            read_extra=hooks.read_gpt_oss,
        ),
        Family(
            "qwen3_moe",
            "Qwen3MoeForCausalLM",
            {
                **_QWEN_DEFAULTS,
                "num_key_value_heads": 4,
                "num_experts": 128,
                "num_local_experts": 128,
                "num_experts_per_tok": 8,
                "moe_intermediate_size": 768,
                "norm_topk_prob": False,
                "decoder_sparse_step": 1,
                "router_aux_loss_coef": 0.001,
            },
            qk_norm=True,
            qwen_window_flag=True,
            writes_attention_bias=True,
            read_moe=hooks.read_qwen3_moe,
            write_moe=hooks.write_qwen3_moe,
        ),
        Family(
            "deepseek_v3",
            "DeepseekV3ForCausalLM",
            {
                "vocab_size": 129280,
                "hidden_size": 7168,
                "intermediate_size": 18432,
                "moe_intermediate_size": 2048,
                "num_hidden_layers": 61,
                "num_attention_heads": 128,
                "n_shared_experts": 1,
                "n_routed_experts": 256,
                "routed_scaling_factor": 2.5,
                "kv_lora_rank": 512,
                "q_lora_rank": 1536,
                "qk_rope_head_dim": 64,
                "v_head_dim": 128,
                "qk_nope_head_dim": 128,
                "n_group": 8,
                "topk_group": 4,
                "num_experts_per_tok": 8,
                "first_k_dense_replace": 3,
                "norm_topk_prob": True,
                "max_position_embeddings": 4096,
                "rms_norm_eps": 1e-6,
                "rope_theta": 10000.0,
                "rope_interleave": True,
            },
            read_moe=hooks.read_sigmoid_moe,
            write_moe=hooks.write_sigmoid_moe,
            read_extra=hooks.read_mla,
            write_extra=hooks.write_mla,
        ),
        Family(
            "glm4_moe",
            "Glm4MoeForCausalLM",
            {
                "vocab_size": 151552,
                "hidden_size": 4096,
                "intermediate_size": 10944,
                "num_hidden_layers": 46,
                "num_attention_heads": 96,
                "num_key_value_heads": 8,
                "max_position_embeddings": 131072,
                "rms_norm_eps": 1e-5,
                "rope_theta": 10000.0,
                "partial_rotary_factor": 0.5,
                "moe_intermediate_size": 1408,
                "num_experts_per_tok": 8,
                "n_shared_experts": 1,
                "n_routed_experts": 128,
                "routed_scaling_factor": 1.0,
                "n_group": 1,
                "topk_group": 1,
                "first_k_dense_replace": 1,
                "norm_topk_prob": True,
            },
            bias_flag=True,
            read_moe=hooks.read_sigmoid_moe,
            write_moe=hooks.write_sigmoid_moe,
            read_extra=hooks.read_glm4_moe,
            write_extra=hooks.write_glm4_moe,
        ),
        Family(
            "mixtral",
            "MixtralForCausalLM",
            {
                "rms_norm_eps": 1e-5,
                "max_position_embeddings": 131072,
                "num_key_value_heads": 8,
                "rope_theta": 1000000.0,
                "num_local_experts": 8,
                "num_experts_per_tok": 2,
                "router_aux_loss_coef": 0.001,
            },
            windows=True,
            read_moe=hooks.read_mixtral,
            write_moe=hooks.write_mixtral,
        ),
    )
}
BY_ARCHITECTURE = {f.architecture: f for f in FAMILIES.values()}
MOE_FAMILIES = tuple(name for name, f in FAMILIES.items() if f.moe)
