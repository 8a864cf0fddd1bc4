"""Pre-grad pass: fuse the output projection with cross-entropy so full logits never exist.

Matches, in a dynamo (torch-level) graph:

    logits = linear(h, W[, b])                    # [..., V]
    x = logits <views / reshapes / flatten / a token slice / .float() / .to(dtype) / .contiguous()
               / a soft-cap tanh(logits / c) * c (Gemma 2's final_logit_softcapping)>
    loss = cross_entropy(x [N, V], y [N], ignore_index=i, reduction="mean"|"sum")

and rewrites it to

    loss, lse = compiletune::linear_cross_entropy(h' [N, d], W, b, y.reshape(-1), i, reduction, ...)

where h' is h with the same token slice applied, flattened to [N, d]. The op computes the loss in
chunks of tokens with an fp32 log-sum-exp and saves only `lse [N]` for backward, so neither the
[N, V] logits nor their fp32 copy is ever allocated, in the forward or the backward.

When the graph needs gradients (the logits require grad) and `fused_loss.grads_in_forward` says
the sizes fit, it emits the one-pass op instead,

    loss, dh, dW, db = compiletune::linear_cross_entropy_with_grads(..., need_dh, need_dweight,
                                                                     accumulator)

which computes the gradients while the chunk's logits exist (three vocabulary-sized matmuls, not
four) and saves them for a backward that only scales them by the incoming gradient. `accumulator`
(how a narrow dW sums over token chunks) is resolved once, here, and written into the graph.

Why it is safe: the chain between the linear and the loss may only regroup or slice the token
dimensions (the last dimension must stay V, untouched) and change the dtype. The op upcasts to
fp32 itself, so dropping `.float()` changes nothing, and slicing tokens commutes with a linear map
applied per token. A soft-cap is elementwise and the op applies it itself (its `softcap`
argument), in fp32 per chunk. The rewrite is skipped (and the reason counted) when the logits have another
user, when cross_entropy has class weights, label smoothing, `reduction="none"`, or a class
dimension other than the last.
"""

from __future__ import annotations

import operator
from collections import Counter
from typing import Any

import torch
import torch.nn.functional as F

from compiletune.ops.ce_chunks import accumulator_choice
from compiletune.ops.fused_loss import grads_in_forward  # also registers the ops

_LINEAR = (torch._C._nn.linear, F.linear)
_CROSS_ENTROPY = (F.cross_entropy, torch.ops.aten.cross_entropy_loss.default)
# Methods that only change the dtype or the memory layout of the logits.
_DTYPE_OR_LAYOUT = {"float", "to", "contiguous", "type_as"}
# Methods that regroup token dimensions; checked to leave the last (vocab) dimension alone.
_REGROUP = {"view", "reshape", "flatten"}
_CE_ARGS = ("input", "target", "weight", "size_average", "ignore_index", "reduce", "reduction")


def _value(node: Any) -> Any:
    return (
        node.meta.get("example_value", node.meta.get("val"))
        if isinstance(node, torch.fx.Node)
        else None
    )


def _keeps_last_dim(node: torch.fx.Node, vocab: int) -> bool:
    value = _value(node)
    return isinstance(value, torch.Tensor) and value.dim() >= 1 and value.shape[-1] == vocab


def _token_slice(node: torch.fx.Node) -> bool:
    """`x[a:b]`, `x[:, :-1]`, `x[..., :-1, :]`: slices that leave the last dimension whole."""
    if node.op != "call_function" or node.target is not operator.getitem:
        return False
    base = _value(node.args[0])
    index = node.args[1] if isinstance(node.args[1], tuple) else (node.args[1],)
    if base is None or not all(isinstance(i, slice) or i is Ellipsis for i in index):
        return False
    if Ellipsis in index or len(index) == base.dim():
        return index[-1] == slice(None)
    return len(index) < base.dim()


def _softcap_input(node: torch.fx.Node) -> tuple[torch.fx.Node, float] | None:
    """(x, c) when `node` is tanh(x / c) * c (or c * tanh(x / c)) with a constant c > 0 and
    single-use intermediates, else None."""
    if node.op != "call_function" or node.target not in (operator.mul, torch.mul):
        return None
    a, b = node.args[:2]
    tanh, c = (a, b) if isinstance(a, torch.fx.Node) else (b, a)
    if not isinstance(c, (int, float)) or c <= 0 or not isinstance(tanh, torch.fx.Node):
        return None
    if tanh.target not in (torch.tanh, "tanh") or len(tanh.users) != 1:
        return None
    div = tanh.args[0]
    if not isinstance(div, torch.fx.Node) or len(div.users) != 1:
        return None
    if div.target not in (operator.truediv, torch.div) or div.args[1] != c:
        return None
    return div.args[0], float(c)


def walk_back_to_linear(
    x: torch.fx.Node, vocab: int
) -> tuple[torch.fx.Node | None, list[torch.fx.Node], float]:
    """From cross_entropy's input back to the linear that made the logits, through dtype or
    layout changes, regroupings that keep the vocabulary dimension, token slices taken before
    any regrouping (returned, to re-apply to h) and at most one soft-cap (its constant returned, 0.0 without). None when the
    logits reach it any other way or have another user: then they must exist, and the pair is
    left alone."""
    slices: list[torch.fx.Node] = []
    softcap = 0.0
    node = x
    while not (node.op == "call_function" and node.target in _LINEAR):
        if len(node.users) != 1:
            return None, slices, softcap  # the logits (or a view of them) are used elsewhere
        capped = _softcap_input(node) if softcap == 0.0 else None
        if capped is not None:
            node, softcap = capped
            continue
        if node.op == "call_method" and node.target in _DTYPE_OR_LAYOUT:
            pass
        elif node.op == "call_method" and node.target in _REGROUP:
            # a token slice taken after a regroup indexes the regrouped tokens: it cannot be
            # re-applied to h as it is
            if slices or not _keeps_last_dim(node, vocab):
                return None, slices, softcap
        elif _token_slice(node):
            slices.append(node)
        else:
            return None, slices, softcap
        node = node.args[0]
        if not isinstance(node, torch.fx.Node):
            return None, slices, softcap
    return (node if len(node.users) == 1 else None), slices, softcap


def fuse_linear_cross_entropy(
    gm: torch.fx.GraphModule,
    chunk_size: int = 0,
    z_loss: float = 0.0,
    softcap: float = 0.0,
    accumulator: str = "",
) -> tuple[torch.fx.GraphModule, dict[str, Any]]:
    """Rewrite every linear -> cross_entropy pair in `gm`. Returns (gm, stats).
    accumulator: auto | fp32 | bf16 ("" = $COMPILETUNE_LCE_ACCUMULATOR or auto).

    stats: matched (pairs rewritten), skipped (reason -> count), logits_shapes (the [N, V] that
    no longer exist).
    """
    graph = gm.graph
    accumulator = accumulator_choice(accumulator)
    matched, one_pass_count, skipped, shapes = 0, 0, Counter(), []
    for ce in list(graph.nodes):
        if ce.op != "call_function" or ce.target not in _CROSS_ENTROPY:
            continue
        kwargs = {**dict(zip(_CE_ARGS, ce.args, strict=False)), **ce.kwargs}
        reduction = kwargs.get("reduction", "mean")
        if kwargs.get("weight") is not None or kwargs.get("label_smoothing", 0.0) not in (0, 0.0):
            skipped["class weights or label smoothing"] += 1
            continue
        if reduction not in ("mean", "sum") or kwargs.get("size_average") is not None:
            skipped[f"reduction {reduction!r}"] += 1
            continue
        x = kwargs["input"]
        ce_in = _value(x)
        if not isinstance(ce_in, torch.Tensor) or ce_in.dim() != 2:
            skipped["cross_entropy input is not [N, V]"] += 1
            continue
        vocab = ce_in.shape[-1]

        linear, slices, capped = walk_back_to_linear(x, vocab)
        if linear is None:
            skipped["logits reach cross_entropy through other ops or have other users"] += 1
            continue
        h, weight = linear.args[0], linear.args[1]
        bias = linear.args[2] if len(linear.args) > 2 else linear.kwargs.get("bias")
        w_value = _value(weight)
        hidden = w_value.shape[-1]
        # The logits' example value requires grad only when grad mode is on and an input
        # requires it (a graph traced under no_grad, for evaluation, gets the forward-only op).
        need = [bool(getattr(_value(x), "requires_grad", False)) for x in (h, weight, bias)]
        one_pass = bool(getattr(_value(linear), "requires_grad", False)) and grads_in_forward(
            int(ce_in.shape[0]), vocab, hidden, w_value.dtype, chunk_size, need[1], accumulator
        )

        with graph.inserting_before(ce):
            for s in reversed(slices):  # re-apply token slices, innermost first
                h = graph.call_function(operator.getitem, (h, s.args[1]))
            h_flat = graph.call_method("reshape", (h, -1, hidden))
            y_flat = graph.call_method("reshape", (kwargs["target"], -1))
            args = (
                h_flat,
                weight,
                bias,
                y_flat,
                int(kwargs.get("ignore_index", -100)),
                reduction,
                chunk_size,
                z_loss,
                capped or softcap,
            )
            if one_pass:
                op = torch.ops.compiletune.linear_cross_entropy_with_grads.default
                args = (*args, need[0], need[1] or need[2], accumulator)
            else:
                op = torch.ops.compiletune.linear_cross_entropy.default
            fused = graph.call_function(op, args)
            loss = graph.call_function(operator.getitem, (fused, 0))
        ce.replace_all_uses_with(loss)
        graph.erase_node(ce)
        matched += 1
        one_pass_count += int(one_pass)
        shapes.append([int(d) for d in ce_in.shape])
    graph.eliminate_dead_code()  # the linear and the chain to cross_entropy are now unused
    gm.recompile()
    return gm, {
        "matched": matched,
        "one_pass": one_pass_count,
        "skipped": dict(skipped),
        "logits_shapes": shapes,
    }
