"""Config hooks and tensor names of mechanisms that several families share, each read and written
as the families' configs spell them: top-k expert counts, sigmoid routing with expert groups and
shared experts, Gated DeltaNet layers."""

from __future__ import annotations

from typing import Any

from compiletune.errors import UserError

from ..args import ModelArgs
from ..names import BLOCK_NAMES
from .base import Get


def routed_names(router: str, *more: dict[str, str]) -> dict[str, str]:
    """The standard block names with a MoE block's router `router` (and more names, such as
    its shared experts')."""
    names = {**BLOCK_NAMES, "feed_forward.router.weight": router}
    for extra in more:
        names |= extra
    return names


def top_k(get: Get, n_experts: int) -> int:
    top_k = get("num_experts_per_tok")
    if not 0 < top_k <= n_experts:
        raise UserError(
            f"config.json num_experts_per_tok {top_k} must be between 1 and the expert count "
            f"{n_experts}"
        )
    return top_k


def read_sigmoid_moe(cfg: dict, n_layers: int, get: Get) -> dict[str, Any]:
    """Sigmoid routing with a correction bias within expert groups, shared experts, the first
    `first_k_dense_replace` layers dense."""
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
