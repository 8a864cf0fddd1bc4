"""Parameter counts from a model's shape alone (`num_params`), checked against the built
model for every preset."""

from __future__ import annotations

from .args import ModelArgs


def _latent_attention_params(args: ModelArgs) -> int:
    """Parameters of one multi-head latent attention mixer (models/mla.py)."""
    d, h, hd, rd = args.dim, args.n_heads, args.hd, args.rotary_dim or 0
    q = d * args.q_rank + args.q_rank + args.q_rank * h * hd if args.q_rank else d * h * hd
    kv = d * (args.kv_rank + rd) + args.kv_rank + args.kv_rank * h * (hd - rd + args.v_head_dim)
    return q + kv + h * args.v_head_dim * d


def _attention_params(args: ModelArgs, index: int) -> int:
    """Parameters of the softmax-attention mixer of layer `index`."""
    if args.kv_rank:
        return _latent_attention_params(args)
    kind, d = args.layer_kind(index), args.dim
    hd, kv_heads = args.head_dim_of(kind), args.kv_heads_of(kind)
    q_out, kv_out = args.n_heads * hd, kv_heads * hd
    own_kv = args.kv_mode(index) != "reuse"
    n_kv = own_kv * (1 if args.kv_from_k and kind == "full" else 2)  # k and v projections
    total = d * q_out + n_kv * d * kv_out + q_out * d
    if args.qkv_bias:
        total += q_out + n_kv * kv_out
    if args.qk_norm:
        total += q_out + own_kv * kv_out if args.qk_norm_whole else (1 + own_kv) * hd
    if args.attn_output_gate:
        total += d * q_out  # q_proj's gate rows
    return total + d * args.o_bias + args.n_heads * args.attn_sinks


def _linear_params(args: ModelArgs) -> int:
    """Parameters of one Gated DeltaNet mixer."""
    d = args.dim
    key_dim = args.linear_k_heads * args.linear_k_dim
    value_dim = args.linear_v_heads * args.linear_v_dim
    conv = 2 * key_dim + value_dim
    total = d * (conv + value_dim + 2 * args.linear_v_heads) + value_dim * d  # projections
    return total + conv * args.linear_conv + 2 * args.linear_v_heads + args.linear_v_dim


def params_text(n: int) -> str:
    """A parameter count in the unit that fits it: 52.0K, 3.3M, 1.24B."""
    if n >= 1e9:
        return f"{n / 1e9:.2f}B"
    if n >= 1e6:
        return f"{n / 1e6:.1f}M"
    return f"{n / 1e3:.1f}K" if n >= 1e3 else str(n)


def num_params(args: ModelArgs) -> int:
    """Parameter count from the shape alone; a tied embedding counts once."""
    d = args.dim
    norms = 2 * args.pre_norms + 2 * args.sandwich_norms
    moe = args.n_experts * (d + 3 * d * args.moe_ffn_dim)  # router row + SwiGLU, per expert
    if args.shared_ffn_dim:
        moe += 3 * d * args.shared_ffn_dim + d * args.shared_expert_gate
    if args.mlp_beside_experts:  # router scales, three norms (+ the dense MLP below)
        moe += d + args.n_experts + 3 * d
    if args.router_score == "sigmoid":  # the correction bias
        moe += args.n_experts
    if args.expert_bias:  # the router's and both projections' biases
        moe += args.n_experts * (1 + 2 * args.moe_ffn_dim + d)
    blocks = 0
    for i in range(args.n_layers):
        linear = args.layer_kind(i) == "linear"
        blocks += _linear_params(args) if linear else _attention_params(args, i)
        dense = 3 * d * args.ffn_dim_of(i)  # fused or not: the same weights
        blocks += (moe + dense * args.mlp_beside_experts) if args.is_moe(i) else dense
        blocks += norms * d + args.layer_scalar
        if args.ple_dim:  # gate, up, norm
            blocks += 2 * d * args.ple_dim + d
    embeddings = args.vocab_size * d * (1 if args.tie_embeddings else 2)
    if args.ple_dim:  # embedding, projection, norm
        width = args.n_layers * args.ple_dim
        embeddings += args.ple_vocab * width + d * width + args.ple_dim
    return embeddings + blocks + d  # + final norm
