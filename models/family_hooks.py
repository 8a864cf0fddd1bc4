"""The hooks of the families in `families.py` whose configs have fields of their own: the
`ModelArgs` fields read from a config (`read_*`), the config keys written from them (`write_*`),
and the default layer kinds of the families that list none (`*_kinds`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from compiletune.errors import UserError

from .args import ModelArgs

Get = Callable[..., Any]  # get(key, default=None, required=False): a config value or its default


def gemma2_kinds(cfg: dict, n_layers: int) -> tuple[str, ...]:
    return tuple("sliding" if i % 2 == 0 else "full" for i in range(n_layers))


def gemma3_kinds(cfg: dict, n_layers: int) -> tuple[str, ...]:
    pattern = int(cfg.get("sliding_window_pattern") or cfg.get("_sliding_window_pattern") or 6)
    return tuple("full" if (i + 1) % pattern == 0 else "sliding" for i in range(n_layers))


def gemma4_kinds(cfg: dict, n_layers: int) -> tuple[str, ...]:
    """Five sliding layers per full one, and the last layer full (transformers' default)."""
    kinds = gemma3_kinds({}, n_layers)
    return (*kinds[:-1], "full")


def read_gemma4(cfg: dict, n_layers: int, get: Get) -> dict[str, Any]:
    """Gemma 4: plain-weight norms applied in fp32, unit scores scale, values normed; the full
    layers' own head size and kv heads (`global_head_dim` / `num_global_key_value_heads`, or
    transformers 5.2x's `per_layer_config`), keys as values there (`attention_k_eq_v`); kv
    sharing, double-wide MLPs, per-layer inputs."""
    kinds = [cfg.get("layer_types") or [], gemma4_kinds(cfg, n_layers)]
    kinds = [k.removesuffix("_attention") for k in (kinds[0] or kinds[1])]
    head_dim = get("head_dim")
    k_eq_v = bool(get("attention_k_eq_v", False))
    global_dim = get("global_head_dim")
    global_kv = get("num_global_key_value_heads") if k_eq_v else None
    overrides = cfg.get("per_layer_config")
    if overrides is not None:
        if not isinstance(overrides, dict):
            raise UserError("config.json per_layer_config must be an object")
        full = {str(i) for i, kind in enumerate(kinds) if kind == "full"}
        values = [overrides.get(i, overrides.get(int(i))) for i in full]
        extra = set(map(str, overrides)) - full
        if extra or any(v != values[0] for v in values) or not values:
            raise UserError(
                "config.json per_layer_config must give every full-attention layer the same "
                "overrides and no other layer any (Gemma 4's pattern)"
            )
        unknown = set(values[0] or {}) - {"head_dim", "num_key_value_heads"}
        if unknown:
            raise UserError(
                f"config.json per_layer_config sets {sorted(unknown)[0]!r}, which is not supported"
            )
        global_dim = (values[0] or {}).get("head_dim", global_dim)
        global_kv = (values[0] or {}).get("num_key_value_heads", global_kv)
    shared = int(get("num_kv_shared_layers", 0))
    if not 0 <= shared < n_layers:
        raise UserError(
            f"config.json num_kv_shared_layers {shared} must be below num_hidden_layers {n_layers}"
        )
    first = n_layers - shared
    if shared and set(kinds[first:]) - set(kinds[:first]):
        raise UserError(
            "config.json num_kv_shared_layers: a shared layer has no earlier layer of its kind "
            "to take keys and values from"
        )
    ple = int(get("hidden_size_per_layer_input", 0) or 0)
    rope = cfg.get("rope_parameters") or {}
    full_rope = rope.get("full_attention") or {} if isinstance(rope, dict) else {}
    rope_type = full_rope.get("rope_type", "default")
    fields: dict[str, Any] = dict(
        norm_plus_one=False,
        norm_weight_fp32=True,
        query_pre_attn_scalar=1.0,
        v_norm=True,
        global_head_dim=global_dim if global_dim and global_dim != head_dim else None,
        global_kv_heads=global_kv
        if global_kv and global_kv != get("num_key_value_heads")
        else None,
        kv_from_k=k_eq_v,
        kv_shared_layers=shared,
        wide_shared_mlp=bool(get("use_double_wide_mlp", False)),
        ple_dim=ple,
        ple_vocab=int(get("vocab_size_per_layer_input") or get("vocab_size")) if ple else 0,
        layer_scalar=True,
    )
    if rope_type == "proportional":
        fields["rotary_dim"] = None  # the rotated fraction is the rope scaling's own
    return fields


def read_gemma4_moe(cfg: dict, n_layers: int, get: Get) -> dict[str, Any]:
    """Gemma 4 26B-A4B: experts beside every layer's dense MLP (`enable_moe_block`)."""
    if not get("enable_moe_block", False):
        return {}
    n_experts = get("num_experts", required=True)
    top_k = cfg.get("top_k_experts")
    if not (isinstance(top_k, int) and 0 < top_k <= n_experts):
        raise UserError(
            f"config.json top_k_experts {top_k!r} must be between 1 and num_experts {n_experts}"
        )
    return dict(
        n_experts=n_experts,
        top_k=top_k,
        moe_ffn_dim=get("moe_intermediate_size", required=True),
        norm_topk=True,
        mlp_beside_experts=True,
    )


def write_gemma4(args: ModelArgs, cfg: dict) -> None:
    for key in ("query_pre_attn_scalar", "attn_logit_softcapping", "rope_local_base_freq"):
        cfg.pop(key, None)
    cfg.pop("rope_scaling", None)  # the per-kind rope_parameters say it
    cfg.pop("partial_rotary_factor", None)
    global_dim = args.head_dim_of("full")
    global_kv = args.kv_heads_of("full")
    overrides = {"head_dim": global_dim}
    if args.kv_from_k:
        overrides["num_key_value_heads"] = global_kv
    full = [i for i in range(args.n_layers) if args.layer_kind(i) == "full"]
    cfg.update(
        global_head_dim=global_dim,
        num_global_key_value_heads=global_kv if args.kv_from_k else None,
        per_layer_config={str(i): dict(overrides) for i in full},
        attention_k_eq_v=args.kv_from_k,
        num_kv_shared_layers=args.kv_shared_layers,
        use_double_wide_mlp=args.wide_shared_mlp,
        hidden_size_per_layer_input=args.ple_dim,
        vocab_size_per_layer_input=args.ple_vocab or args.vocab_size,
        enable_moe_block=args.mlp_beside_experts,
        num_experts=args.n_experts or None,
        top_k_experts=args.top_k or None,
        moe_intermediate_size=args.moe_ffn_dim or None,
    )


def read_gpt_oss_moe(cfg: dict, n_layers: int, get: Get) -> dict[str, Any]:
    n_experts = cfg.get("num_local_experts") or get("num_experts") or get("num_local_experts")
    return dict(
        n_experts=n_experts,
        top_k=top_k(get, n_experts),
        moe_ffn_dim=get("intermediate_size"),
        norm_topk=True,  # softmax over the chosen logits = renormalised top-k probabilities
        router_aux_coef=float(get("router_aux_loss_coef")),
    )


def read_gpt_oss(cfg: dict, n_layers: int, get: Get) -> dict[str, Any]:
    """gpt-oss: sinks, o_proj's bias, the experts' biases and clamped SwiGLU, norms whose
    weight multiplies in fp32."""
    return dict(
        attn_sinks=True,
        o_bias=bool(get("attention_bias", True)),
        expert_bias=True,
        swiglu_limit=float(get("swiglu_limit")),
        swiglu_alpha=float(get("swiglu_alpha")),
        norm_weight_fp32=True,
    )


def write_gpt_oss(args: ModelArgs, cfg: dict) -> None:
    cfg.update(
        num_local_experts=args.n_experts,
        num_experts_per_tok=args.top_k,
        intermediate_size=args.moe_ffn_dim,
        router_aux_loss_coef=args.router_aux_coef,
        swiglu_limit=args.swiglu_limit,
        swiglu_alpha=args.swiglu_alpha,
        attention_bias=True,
    )
    cfg.pop("num_experts", None)


def read_sigmoid_moe(cfg: dict, n_layers: int, get: Get) -> dict[str, Any]:
    """DeepSeek-V3 / GLM-4.5: sigmoid routing with a correction bias within expert groups,
    shared experts, the first `first_k_dense_replace` layers dense."""
    n_experts = get("n_routed_experts") or get("num_local_experts")
    first = int(get("first_k_dense_replace") or 0)
    if not 0 <= first <= n_layers:
        raise UserError(
            f"config.json first_k_dense_replace {first} must be within 0..{n_layers} layers"
        )
    groups, picked = int(get("n_group") or 1), int(get("topk_group") or 1)
    if n_experts % groups or not 0 < picked <= groups:
        raise UserError(
            f"config.json n_group {groups} / topk_group {picked}: the groups must divide the "
            f"{n_experts} experts and topk_group be 1..n_group"
        )
    return dict(
        n_experts=n_experts,
        top_k=top_k(get, n_experts),
        moe_ffn_dim=get("moe_intermediate_size"),
        norm_topk=bool(get("norm_topk_prob")),
        dense_layers=tuple(range(first)),
        router_aux_coef=float(get("router_aux_loss_coef", 0.0) or 0.0),
        shared_ffn_dim=get("moe_intermediate_size") * int(get("n_shared_experts") or 0),
        router_score="sigmoid",
        n_groups=groups,
        topk_groups=picked,
        routed_scale=float(get("routed_scaling_factor")),
    )


def write_sigmoid_moe(args: ModelArgs, cfg: dict) -> None:
    shared, rest = divmod(args.shared_ffn_dim, args.moe_ffn_dim)
    dense = args.dense_layers == tuple(range(len(args.dense_layers)))
    if args.router_score != "sigmoid" or rest or not dense or args.shared_expert_gate:
        raise UserError(
            f"a {args.family} model routes by sigmoid scores, has ungated shared experts as wide "
            "as a multiple of the routed ones and its dense layers first; these args have no "
            f"{args.family} checkpoint"
        )
    cfg.update(
        n_routed_experts=args.n_experts,
        num_experts_per_tok=args.top_k,
        moe_intermediate_size=args.moe_ffn_dim,
        n_shared_experts=shared,
        first_k_dense_replace=len(args.dense_layers),
        norm_topk_prob=args.norm_topk,
        n_group=args.n_groups,
        topk_group=args.topk_groups,
        routed_scaling_factor=args.routed_scale,
    )
    if args.router_aux_coef:
        cfg["router_aux_loss_coef"] = args.router_aux_coef
    cfg.pop("num_local_experts", None)


def read_mla(cfg: dict, n_layers: int, get: Get) -> dict[str, Any]:
    """DeepSeek-V3's multi-head latent attention: config.json's head_dim is the rope part
    (transformers sets it so), the q/k head is nope + rope wide."""
    rope, nope = int(get("qk_rope_head_dim")), int(get("qk_nope_head_dim"))
    if rope % 2 or rope <= 0 or nope <= 0:
        raise UserError(
            f"config.json qk_rope_head_dim {rope} must be even and positive, qk_nope_head_dim "
            f"{nope} positive"
        )
    dim, heads = get("hidden_size"), get("num_attention_heads")
    return dict(
        kv_rank=int(get("kv_lora_rank")),
        q_rank=int(cfg.get("q_lora_rank") or 0),
        v_head_dim=int(get("v_head_dim")),
        head_dim=nope + rope if nope + rope != dim // heads else None,
        rotary_dim=rope,
        rope_interleave=bool(get("rope_interleave", True)),
        n_kv_heads=heads,
    )


def write_mla(args: ModelArgs, cfg: dict) -> None:
    rope = args.rotary_dim or 0
    cfg.update(
        kv_lora_rank=args.kv_rank,
        q_lora_rank=args.q_rank or None,
        qk_rope_head_dim=rope,
        qk_nope_head_dim=args.hd - rope,
        v_head_dim=args.v_head_dim,
        rope_interleave=args.rope_interleave,
        head_dim=rope,
        num_key_value_heads=args.n_heads,
        attention_bias=False,
    )
    cfg.pop("partial_rotary_factor", None)
    if isinstance(cfg.get("rope_parameters"), dict):
        cfg["rope_parameters"].pop("partial_rotary_factor", None)


def read_glm4_moe(cfg: dict, n_layers: int, get: Get) -> dict[str, Any]:
    return dict(qk_norm=bool(get("use_qk_norm", False)))


def write_glm4_moe(args: ModelArgs, cfg: dict) -> None:
    cfg.update(use_qk_norm=args.qk_norm, attention_bias=args.qkv_bias)


def olmo3_kinds(cfg: dict, n_layers: int) -> tuple[str, ...]:
    return tuple("full" if (i + 1) % 4 == 0 else "sliding" for i in range(n_layers))


def smollm3_rope_layers(cfg: dict, n_layers: int) -> list[int]:
    """SmolLM3's no_rope_layers: 1 where the layer rotates, 0 where it is a NoPE layer; by
    default every `no_rope_layer_interval`-th layer is NoPE."""
    listed = cfg.get("no_rope_layers")
    if listed is None:
        interval = cfg.get("no_rope_layer_interval", 4)
        if not (isinstance(interval, int) and not isinstance(interval, bool) and interval >= 1):
            raise UserError("config.json no_rope_layer_interval must be a positive integer")
        return [int((i + 1) % interval != 0) for i in range(n_layers)]
    if not (
        isinstance(listed, list)
        and len(listed) == n_layers
        and all(v in (0, 1) and not isinstance(v, float) for v in listed)
    ):
        raise UserError(
            f"config.json no_rope_layers must list 1 (rope) or 0 (no rope) for each of the "
            f"{n_layers} layers"
        )
    return [int(v) for v in listed]


def smollm3_kinds(cfg: dict, n_layers: int) -> tuple[str, ...]:
    # transformers: with use_sliding_window, the NoPE layers are the sliding ones
    rope = smollm3_rope_layers(cfg, n_layers)
    return tuple("full" if r else "sliding" for r in rope)


def read_smollm3(cfg: dict, n_layers: int, get: Get) -> dict[str, Any]:
    rope = smollm3_rope_layers(cfg, n_layers)
    return dict(nope_layers=tuple(i for i, r in enumerate(rope) if not r))


def write_smollm3(args: ModelArgs, cfg: dict) -> None:
    cfg["no_rope_layers"] = [int(args.rope(i)) for i in range(args.n_layers)]
    cfg["use_sliding_window"] = args.sliding_window is not None


def qwen3_5_kinds(cfg: dict, n_layers: int) -> tuple[str, ...]:
    interval = cfg.get("full_attention_interval", 4)
    if not (isinstance(interval, int) and not isinstance(interval, bool) and interval >= 1):
        raise UserError("config.json full_attention_interval must be a positive integer")
    return tuple("full" if (i + 1) % interval == 0 else "linear" for i in range(n_layers))


def read_linear(cfg: dict, n_layers: int, get: Get) -> dict[str, Any]:
    fields = dict(
        linear_k_heads=get("linear_num_key_heads"),
        linear_v_heads=get("linear_num_value_heads"),
        linear_k_dim=get("linear_key_head_dim"),
        linear_v_dim=get("linear_value_head_dim"),
        linear_conv=get("linear_conv_kernel_dim"),
    )
    if fields["linear_v_heads"] % fields["linear_k_heads"]:
        raise UserError(
            f"config.json linear_num_value_heads {fields['linear_v_heads']} is not a multiple "
            f"of linear_num_key_heads {fields['linear_k_heads']}"
        )
    return fields


def write_linear(args: ModelArgs, cfg: dict) -> None:
    cfg.update(
        linear_num_key_heads=args.linear_k_heads,
        linear_num_value_heads=args.linear_v_heads,
        linear_key_head_dim=args.linear_k_dim,
        linear_value_head_dim=args.linear_v_dim,
        linear_conv_kernel_dim=args.linear_conv,
    )


def top_k(get: Get, n_experts: int) -> int:
    top_k = get("num_experts_per_tok")
    if not 0 < top_k <= n_experts:
        raise UserError(
            f"config.json num_experts_per_tok {top_k} must be between 1 and the expert count "
            f"{n_experts}"
        )
    return top_k


def read_qwen3_moe(cfg: dict, n_layers: int, get: Get) -> dict[str, Any]:
    # the hub's configs say num_experts; transformers 5 saves num_local_experts
    n_experts = cfg.get("num_experts") or get("num_local_experts") or get("num_experts")
    step = int(get("decoder_sparse_step") or 1)
    only = cfg.get("mlp_only_layers") or []
    if not isinstance(only, list) or not all(
        isinstance(i, int) and 0 <= i < n_layers for i in only
    ):
        raise UserError(f"config.json mlp_only_layers must list layer indices in 0..{n_layers - 1}")
    return dict(
        n_experts=n_experts,
        top_k=top_k(get, n_experts),
        moe_ffn_dim=get("moe_intermediate_size"),
        norm_topk=bool(get("norm_topk_prob")),
        dense_layers=tuple(i for i in range(n_layers) if i in only or (i + 1) % step),
        router_aux_coef=float(get("router_aux_loss_coef")),
    )


def read_qwen3_5_moe(cfg: dict, n_layers: int, get: Get) -> dict[str, Any]:
    n_experts = get("num_experts")
    return dict(
        n_experts=n_experts,
        top_k=top_k(get, n_experts),
        moe_ffn_dim=get("moe_intermediate_size"),
        ffn_dim=get("moe_intermediate_size"),  # no dense layer: the experts' width stands in
        norm_topk=True,
        dense_layers=(),
        router_aux_coef=float(get("router_aux_loss_coef")),
        shared_ffn_dim=get("shared_expert_intermediate_size"),
        shared_expert_gate=True,
    )


def write_qwen3_5_moe(args: ModelArgs, cfg: dict) -> None:
    if args.dense_layers or not args.norm_topk or not args.shared_expert_gate:
        raise UserError(
            "a Qwen3.5-MoE model has a MoE feed-forward in every layer, renormalised top-k "
            "weights and a gated shared expert; these args have no Qwen3.5-MoE checkpoint"
        )
    cfg.update(
        num_experts=args.n_experts,
        num_experts_per_tok=args.top_k,
        moe_intermediate_size=args.moe_ffn_dim,
        shared_expert_intermediate_size=args.shared_ffn_dim,
        router_aux_loss_coef=args.router_aux_coef,
    )
    cfg.pop("intermediate_size", None)


def read_qwen3_next(cfg: dict, n_layers: int, get: Get) -> dict[str, Any]:
    fields = read_qwen3_moe(cfg, n_layers, get)
    fields.update(
        shared_ffn_dim=get("shared_expert_intermediate_size"),
        shared_expert_gate=True,
        **read_linear(cfg, n_layers, get),
        linear_fused=True,
    )
    return fields


def write_qwen3_next(args: ModelArgs, cfg: dict) -> None:
    write_qwen3_moe(args, cfg)
    cfg["shared_expert_intermediate_size"] = args.shared_ffn_dim
    cfg.pop("num_local_experts", None)


def write_qwen3_moe(args: ModelArgs, cfg: dict) -> None:
    cfg.update(
        num_experts=args.n_experts,
        num_local_experts=args.n_experts,  # transformers 5's name; both read either
        num_experts_per_tok=args.top_k,
        moe_intermediate_size=args.moe_ffn_dim,
        norm_topk_prob=args.norm_topk,
        decoder_sparse_step=1,
        mlp_only_layers=list(args.dense_layers),
        router_aux_loss_coef=args.router_aux_coef,
    )


def read_mixtral(cfg: dict, n_layers: int, get: Get) -> dict[str, Any]:
    if get("router_jitter_noise", 0.0):
        raise UserError(
            f"config.json sets router_jitter_noise: {cfg['router_jitter_noise']}, which is "
            "not supported; set it 0 (Mixtral checkpoints ship with 0)"
        )
    n_experts = get("num_local_experts")
    return dict(
        n_experts=n_experts,
        top_k=top_k(get, n_experts),
        moe_ffn_dim=get("intermediate_size"),
        norm_topk=True,
        dense_layers=(),
        router_aux_coef=float(get("router_aux_loss_coef")),
    )


def write_mixtral(args: ModelArgs, cfg: dict) -> None:
    if not args.norm_topk or args.dense_layers or args.moe_ffn_dim != args.ffn_dim:
        raise UserError(
            "a Mixtral model renormalises its top-k weights, has no dense layers and one "
            "MLP width; these args have no Mixtral checkpoint"
        )
    cfg.update(
        num_local_experts=args.n_experts,
        num_experts_per_tok=args.top_k,
        router_aux_loss_coef=args.router_aux_coef,
        router_jitter_noise=0.0,
    )


def write_phi3(args: ModelArgs, cfg: dict) -> None:
    rs = args.rope_scaling
    cfg["original_max_position_embeddings"] = (
        rs.original_max_position_embeddings if rs is not None else args.max_seq_len
    )
    if rs is not None and rs.rope_type == "longrope" and rs.attention_factor is None:
        # the only form transformers 4.x's Phi-3 validation accepts
        cfg["rope_scaling"] = {
            "type": "longrope",
            "short_factor": list(rs.short_factor),
            "long_factor": list(rs.long_factor),
        }
