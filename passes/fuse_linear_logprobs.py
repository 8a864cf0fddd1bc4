"""Pre-grad pass: fuse the output projection with per-token log-probabilities, so the log-softmax
over the whole vocabulary never exists.

Matches, in a dynamo (torch-level) graph:

    logits = linear(h, W)                         # [..., V], no bias
    x = logits <the chain fuse_linear_cross_entropy accepts: .float() / .to(dtype) / .contiguous(),
               views that keep the last dimension V, a token slice, a soft-cap tanh(x / c) * c>
    logp = log_softmax(x, dim=-1)                 # [N, V] or [b, s, V]; F., torch., method, aten
    picked = logp.gather(-1, index)               # index [..., 1] int64: one class per token

and rewrites the gather to

    picked = compiletune::token_logprobs(h' [N, d], W, index.reshape(-1), -100, chunk_size, c)[0]
                 .reshape_as(index)               # [..., 1], cast back if logp was not fp32

where h' is h with the same token slice applied, flattened to [N, d]. Whatever follows the gather
(`.squeeze(-1)`, `[..., 0]`, a masked sum) is left as it was. The op computes each chunk's logits,
an fp32 log-sum-exp and the picked logit, and recomputes the chunk in backward, so neither the
[N, V] logits nor the [N, V] log-probabilities are ever allocated.

Why it is safe: gather along the last dimension with one index per token is exactly
log_softmax(x)[t, index_t], which is what the op returns; the index must have the token shape of
logp (gather allows a smaller index, which picks a sub-block, so that is refused). Gather rejects
an index outside [0, V) (an error on CPU, a device assert on CUDA), so -100, the op's
ignore_index, is never a value the original graph could pick: no result is zeroed that the
original would have computed. The chain from the linear only regroups or slices
tokens and changes the dtype (the op upcasts to fp32 itself), and a soft-cap is applied by the op.
The rewrite is skipped (and the reason counted) when the logits or logp have another user (then
the full tensor is needed anyway), when the linear has a bias, when log_softmax is not over the
last dimension of a 2-D or 3-D tensor, when it computes in float64 (the op reduces in fp32, which
would change the values), or when the gather picks other than one class per token.
"""

from __future__ import annotations

import operator
from collections import Counter
from typing import Any

import torch
import torch.nn.functional as F

import compiletune.ops.fused_logprobs  # noqa: F401  (registers compiletune::token_logprobs)
from compiletune.passes.fuse_linear_cross_entropy import walk_back_to_linear
from compiletune.torch_internals import node_value

IGNORE_INDEX = -100  # never a valid gather index, so no picked value is zeroed
# Names of the positional arguments of each log_softmax form dynamo leaves in a graph.
_LOG_SOFTMAX_ARGS: dict[Any, tuple[str, ...]] = {
    F.log_softmax: ("input", "dim", "_stacklevel", "dtype"),
    torch.log_softmax: ("input", "dim", "dtype"),
    torch.special.log_softmax: ("input", "dim", "dtype"),
    torch.ops.aten.log_softmax.int: ("input", "dim", "dtype"),
    torch.ops.aten._log_softmax.default: ("input", "dim", "half_to_float"),
    "log_softmax": ("input", "dim", "dtype"),  # the Tensor method
}
_GATHER_ARGS = ("input", "dim", "index")


def _call_args(node: torch.fx.Node, names: tuple[str, ...]) -> dict[str, Any]:
    return {**dict(zip(names, node.args, strict=False)), **node.kwargs}


def _log_softmax_args(node: torch.fx.Node) -> dict[str, Any] | None:
    """The arguments by name when `node` is a log_softmax, else None."""
    if node.op == "call_function" and node.target in _LOG_SOFTMAX_ARGS:
        return _call_args(node, _LOG_SOFTMAX_ARGS[node.target])
    if node.op == "call_method" and node.target == "log_softmax":
        return _call_args(node, _LOG_SOFTMAX_ARGS["log_softmax"])
    return None


def _gather_args(node: torch.fx.Node) -> dict[str, Any] | None:
    """The arguments by name when `node` is `torch.gather(x, dim, index)` or `x.gather(...)`."""
    if (node.op == "call_function" and node.target is torch.gather) or (
        node.op == "call_method" and node.target == "gather"
    ):
        return _call_args(node, _GATHER_ARGS)
    return None


def _is_last(dim: Any, ndim: int) -> bool:
    return isinstance(dim, int) and dim in (-1, ndim - 1)


def _one_class_per_token(gather: torch.fx.Node, logp_value: torch.Tensor) -> bool:
    """True when `gather` picks one class per token along logp's last dimension: its index is
    int64 shaped [*logp.shape[:-1], 1] (gather also allows a smaller index: a sub-block)."""
    args = _gather_args(gather)
    index = node_value(args.get("index"))
    if args.get("sparse_grad", False) or not _is_last(args.get("dim"), logp_value.dim()):
        return False
    return (
        isinstance(index, torch.Tensor)
        and index.dtype == torch.int64
        and tuple(index.shape) == (*logp_value.shape[:-1], 1)
    )


def _refusal(ls_args: dict[str, Any], logp: torch.fx.Node, logp_value: Any) -> str | None:
    """Why the log_softmax `logp` and its user are left alone, or None to rewrite them."""
    if not isinstance(logp_value, torch.Tensor) or logp_value.dim() not in (2, 3):
        return "log_softmax input is not [N, V] or [b, s, V]"
    if not _is_last(ls_args.get("dim"), logp_value.dim()):
        return "log_softmax is not over the last dimension"
    if logp_value.dtype == torch.float64:
        return "log_softmax computes in float64 (the op reduces in fp32)"
    if len(logp.users) != 1:
        return "log_softmax output has other users"
    (user,) = logp.users
    args = _gather_args(user)
    if args is None or args.get("input") is not logp:
        return "log_softmax output feeds something other than a gather"
    if not _one_class_per_token(user, logp_value):
        return "gather picks other than one class per token along the last dimension"
    return None


def fuse_linear_logprobs(
    gm: torch.fx.GraphModule, chunk_size: int = 0
) -> tuple[torch.fx.GraphModule, dict[str, Any]]:
    """Rewrite every linear -> log_softmax -> gather chain in `gm`. Returns (gm, stats).

    stats: matched (chains rewritten), skipped (reason -> count), logits_shapes (the [N, V] that
    no longer exist).
    """
    graph = gm.graph
    matched, skipped, shapes = 0, Counter(), []
    for logp in list(graph.nodes):
        ls_args = _log_softmax_args(logp)
        if ls_args is None:
            continue
        logp_value = node_value(logp)
        reason = _refusal(ls_args, logp, logp_value)
        if reason is not None:
            skipped[reason] += 1
            continue
        (gather,) = logp.users
        vocab = logp_value.shape[-1]
        linear, slices, softcap = walk_back_to_linear(ls_args["input"], vocab)
        if linear is None:
            skipped["logits reach log_softmax through other ops or have other users"] += 1
            continue
        h, weight = linear.args[0], linear.args[1]
        bias = linear.args[2] if len(linear.args) > 2 else linear.kwargs.get("bias")
        if bias is not None:
            skipped["the linear has a bias (the op takes none)"] += 1
            continue
        w_value = node_value(weight)
        if not isinstance(w_value, torch.Tensor) or w_value.dim() != 2:
            skipped["the linear's weight is not [V, d]"] += 1
            continue
        index = _gather_args(gather)["index"]

        with graph.inserting_before(gather):
            for s in reversed(slices):  # re-apply token slices, innermost first
                h = graph.call_function(operator.getitem, (h, s.args[1]))
            h_flat = graph.call_method("reshape", (h, -1, w_value.shape[-1]))
            targets = graph.call_method("reshape", (index, -1))
            op = torch.ops.compiletune.token_logprobs.default
            fused = graph.call_function(
                op, (h_flat, weight, targets, IGNORE_INDEX, chunk_size, softcap)
            )
            picked = graph.call_function(operator.getitem, (fused, 0))  # [N] fp32
            picked = graph.call_method("reshape_as", (picked, index))  # [..., 1]
            if logp_value.dtype != torch.float32:
                picked = graph.call_method("to", (picked, logp_value.dtype))
        gather.replace_all_uses_with(picked)
        graph.erase_node(gather)
        matched += 1
        shapes.append([int(logp_value.numel() // vocab), int(vocab)])
    graph.eliminate_dead_code()  # the linear, its chain and the log_softmax are now unused
    gm.recompile()
    return gm, {"matched": matched, "skipped": dict(skipped), "logits_shapes": shapes}
