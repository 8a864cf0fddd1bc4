"""Module and parameter names as the model defines them, whatever wraps it, and the HF names of
the tensors every family shares (models/hf_names.py maps them; plain data, no torch)."""

from __future__ import annotations

# Wrappers that torch.compile / activation checkpointing / FSDP insert into parameter names.
_WRAPPER_PARTS = ("_orig_mod.", "_checkpoint_wrapped_module.", "_fsdp_wrapped_module.")


def strip_wrappers(native: str) -> str:
    """A parameter or module name without the parts wrappers insert (`_orig_mod.`, ...)."""
    for part in _WRAPPER_PARTS:
        native = native.replace(part, "")
    return native


# native name <-> HF name for the tensors outside the blocks
GLOBAL_NAMES = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    # per-layer inputs (a small embedding per layer fed into each block)
    "per_layer_inputs.embed.weight": "model.embed_tokens_per_layer.weight",
    "per_layer_inputs.projection.weight": "model.per_layer_model_projection.weight",
    "per_layer_inputs.norm.weight": "model.per_layer_projection_norm.weight",
}
# native suffix <-> HF suffix inside block i ("layers.{i}." <-> "model.layers.{i}."): the names
# of every mechanism's tensors as most HF decoders name them; a family whose checkpoints name
# some otherwise says so in its module (`Family.block_names`). A model has only the tensors its
# ModelArgs give it (q/k norms, fused wqkv and w13 only where the projections are fused).
BLOCK_NAMES = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wq.bias": "self_attn.q_proj.bias",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wk.bias": "self_attn.k_proj.bias",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wv.bias": "self_attn.v_proj.bias",
    "attention.wqkv.weight": "self_attn.qkv_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "attention.q_norm.weight": "self_attn.q_norm.weight",
    "attention.k_norm.weight": "self_attn.k_norm.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "feed_forward.w13.weight": "mlp.gate_up_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    # multi-head latent attention (models/mla.py)
    "attention.wq_a.weight": "self_attn.q_a_proj.weight",
    "attention.q_a_norm.weight": "self_attn.q_a_layernorm.weight",
    "attention.wq_b.weight": "self_attn.q_b_proj.weight",
    "attention.wkv_a.weight": "self_attn.kv_a_proj_with_mqa.weight",
    "attention.kv_a_norm.weight": "self_attn.kv_a_layernorm.weight",
    "attention.wkv_b.weight": "self_attn.kv_b_proj.weight",
    # Gated DeltaNet layers (models/linear_attention.py)
    **{
        f"attention.{name}": f"linear_attn.{name}"
        for name in (
            "in_proj_qkv.weight",
            "in_proj_z.weight",
            "in_proj_qkvz.weight",
            "in_proj_ba.weight",
            "in_proj_b.weight",
            "in_proj_a.weight",
            "conv1d.weight",
            "dt_bias",
            "A_log",
            "norm.weight",
            "out_proj.weight",
        )
    },
}
# MoE blocks: the router's HF name is the family's; the routed experts the hub stores one tensor
# per expert and projection are (module path of the experts, names of gate, up and down), most
# often these; native experts.w13 holds gate and up of every expert, experts.w2 down.
PER_EXPERT_NAMES = ("mlp.experts", ("gate_proj", "up_proj", "down_proj"))
# a shared expert beside the routed ones, scaled by sigmoid(x . gate) (models/moe.py)
GATED_SHARED_EXPERT_NAMES = {
    "feed_forward.shared.w1.weight": "mlp.shared_expert.gate_proj.weight",
    "feed_forward.shared.w3.weight": "mlp.shared_expert.up_proj.weight",
    "feed_forward.shared.w2.weight": "mlp.shared_expert.down_proj.weight",
    "feed_forward.shared.gate.weight": "mlp.shared_expert_gate.weight",
}
# sigmoid routing: the router's correction bias, and the (ungated) shared experts
SIGMOID_ROUTER_NAMES = {
    "feed_forward.score_bias": "mlp.gate.e_score_correction_bias",
    "feed_forward.shared.w1.weight": "mlp.shared_experts.gate_proj.weight",
    "feed_forward.shared.w3.weight": "mlp.shared_experts.up_proj.weight",
    "feed_forward.shared.w2.weight": "mlp.shared_experts.down_proj.weight",
}
