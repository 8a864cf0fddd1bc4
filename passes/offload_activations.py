"""Partitioned-graph pass: move what a block saves for backward to host memory and back.

Matches, after the min-cut partitioner, every floating-point tensor the forward graph returns
for the backward that the forward computed, and the block's input when the backward keeps it
(a graph input shaped like the forward's first output, the block's output: the hidden state;
under `--ac full` it is all a block saves, and nothing else holds it once the next block has
run), dense in memory (copied with its strides unchanged), at least `min_bytes` large. Not
parameters (other graph inputs, which stay alive anyway) nor integer RNG states (tiny).
Rewrites:

    forward:  return (..., a, ...)             ->  a_host = compiletune::offload_to_host(a)
                                                   return (..., a_host, ...)
    backward: def forward(..., a, ...)         ->  a_dev = compiletune::reload_from_host(a, device)
              uses of a                        ->  uses of a_dev

Why it is safe: the backward receives the same values, only through a copy to host and back;
saved tensors and backward placeholders correspond by position, which the partitioner fixes.
"""

from __future__ import annotations

from typing import Any

import torch

import compiletune.ops.host_copy  # noqa: F401  (registers the compiletune::*_host ops)
from compiletune.torch_internals import fake_call


def _value(node: torch.fx.Node) -> Any:
    return node.meta.get("val")


def _dense(t: torch.Tensor) -> bool:
    """Non-overlapping and without gaps: a copy with the same strides is well defined."""
    if t.numel() == 0:
        return False
    span = 1 + sum((size - 1) * stride for size, stride in zip(t.shape, t.stride(), strict=True))
    return all(s >= 0 for s in t.stride()) and span == t.numel()


def offload_activations(
    fw: torch.fx.GraphModule,
    bw: torch.fx.GraphModule,
    num_fwd_outputs: int,
    min_bytes: int = 0,
) -> tuple[torch.fx.GraphModule, torch.fx.GraphModule, dict[str, Any]]:
    output = next(n for n in fw.graph.nodes if n.op == "output")
    outs = list(output.args[0])
    saved = outs[num_fwd_outputs:]
    bw_inputs = [
        n for n in bw.graph.nodes if n.op == "placeholder" and not n.name.startswith("tangents")
    ]
    if len(bw_inputs) != len(saved):  # not the layout this pass understands: leave it alone
        return fw, bw, {"matched": 0, "skipped": "saved values and backward inputs differ"}
    last_placeholder = bw_inputs[-1] if bw_inputs else None
    # Saved symbolic sizes (a dynamic dimension: varlen attention's number of documents) are
    # the forward's last outputs but the backward's first inputs: pair each with its own.
    sym = [
        isinstance(n, torch.fx.Node) and isinstance(_value(n), (torch.SymInt, int)) for n in saved
    ]
    n_sym = sum(sym)
    if n_sym:
        if any(sym[: len(saved) - n_sym]):  # sizes not at the end: a layout not understood
            return fw, bw, {"matched": 0, "skipped": "saved sizes are not the forward's last"}
        bw_inputs = bw_inputs[n_sym:] + bw_inputs[:n_sym]
    first_out = _value(outs[0]) if outs and isinstance(outs[0], torch.fx.Node) else None
    hidden_shape = first_out.shape if isinstance(first_out, torch.Tensor) else None
    moved, moved_bytes, inputs_moved, input_bytes = 0, 0, 0, 0
    for i, (node, bw_in) in enumerate(zip(saved, bw_inputs, strict=True)):
        val = _value(node) if isinstance(node, torch.fx.Node) else None
        if (
            node is None
            or not isinstance(node, torch.fx.Node)
            or not isinstance(val, torch.Tensor)
            or (node.op == "placeholder" and val.shape != hidden_shape)
            or not val.is_floating_point()
            or not _dense(val)
        ):
            continue
        nbytes = val.numel() * val.element_size()
        if nbytes < min_bytes:
            continue
        with fw.graph.inserting_before(output):
            host = fw.graph.call_function(torch.ops.compiletune.offload_to_host.default, (node,))
            host.meta["val"] = fake_call(torch.ops.compiletune.offload_to_host.default, val)
        outs[num_fwd_outputs + i] = host
        with bw.graph.inserting_after(last_placeholder):
            back = bw.graph.call_function(
                torch.ops.compiletune.reload_from_host.default, (bw_in, val.device)
            )
            back.meta["val"] = fake_call(
                torch.ops.compiletune.reload_from_host.default, _value(bw_in), val.device
            )
        bw_in.replace_all_uses_with(back, delete_user_cb=lambda user, b=back: user is not b)
        moved += 1
        moved_bytes += nbytes
        if node.op == "placeholder":
            inputs_moved, input_bytes = inputs_moved + 1, input_bytes + nbytes
    output.args = (tuple(outs),)
    fw.recompile()
    bw.recompile()
    stats = {
        "matched": moved,
        "offloaded_bytes": moved_bytes,
        "inputs": inputs_moved,
        "offloaded_input_bytes": input_bytes,  # of offloaded_bytes: the block's input
    }
    return fw, bw, stats
