"""What a compiled `--ac selective` block keeps for its backward, read from the eager step the
estimate runs.

The estimate runs every block eagerly: a selective block through `torch.utils.checkpoint` with
the policy that saves matmul and attention outputs (compiler/activation.py). Eager selective
checkpointing caches the output of every such op until the block's backward recomputes it,
whether or not the backward reads it. A compiled block saves only what its backward graph
reads (the partitioner cuts the joint graph there), so an output whose every use passes it on
without reading its values, through adds, subtractions, scaling by a number, casts and views,
to the block's output, is never saved. In a Llama block that is the MLP's down projection
(`h + w2(x)`: the next block keeps the sum as its input): one [tokens, dim] tensor per block in
a full fine-tune, and under LoRA two (`base(x) + scale * B(A(x))`, each a matmul output), which
the estimate counted as kept. For an 8B model at 4096 tokens a block that is 64 MiB, 2 GiB over
32 blocks: the LoRA and QLoRA rows' over-estimate on the GPU.

`follow_selective_blocks(model, policy, tracker)` follows each selective block's forward op by
op (a dispatch mode beneath checkpointing's own, which sees the ops it caches) and, when the
block's forward ends, stops counting the cached outputs no op of the block read
(`Tracker.forget`). Only for `--compile`: the eager step does hold them.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_leaves

from compiletune.compiler.ac_policy import ActivationPolicy
from compiletune.estimate import memory_internals as mi
from compiletune.estimate.tracker import Tracker
from compiletune.passes.activation_policy import SAVE_OPS

aten = torch.ops.aten
# The cached ops whose backward reads their inputs, never their output (attention's backward
# reads its output and log-sum-exp; a maximum's, its result): only these outputs can go unread.
_MATMULS = frozenset({aten.mm.default, aten.addmm.default, aten.bmm.default}) & SAVE_OPS
# Ops whose backward reads none of their inputs' values (the gradient passes through, scaled
# at most by a number): a cached output that only flows through these is not read.
_PASS_ON = frozenset(
    {
        aten.add.Tensor,
        aten.sub.Tensor,
        aten.neg.default,
        aten._to_copy.default,
        aten.clone.default,
    }
)
# Scaling by a number: its backward reads the number, not the tensor.
_SCALE = frozenset({aten.mul.Tensor, aten.div.Tensor})
_DEVICE = torch.ops.prim.device.default


class _Uses(mi.TorchDispatchMode):
    """Every op of one block's forward: which storages it takes in, whether its backward may
    read them, and what it makes; and the matmul outputs the selective policy caches.

    A storage is named by a number of its own (`_name`), not by its address: a freed storage's
    address is given to a new one later in the block, while what flowed through the freed one
    still counts."""

    def __init__(self) -> None:
        super().__init__()
        self.names: dict[int, int] = {}  # storage address -> its name, while it lives
        # storage name -> its uses: (whether the op's backward may read it, the op's outputs)
        self.uses: dict[int, list[tuple[bool, tuple[int, ...]]]] = {}
        # Alive anyway: checkpointing caches them (this holds them only while the block runs).
        self.cached: list[tuple[Tensor, int]] = []

    def _name(self, t: Tensor, new: bool = False) -> int:
        key = t.untyped_storage()._cdata
        if new or key not in self.names:
            self.names[key] = len(self.uses)
            self.uses[len(self.uses)] = []
        return self.names[key]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        kwargs = kwargs or {}
        if func is _DEVICE:
            return func(*args, **kwargs)
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented
        out = func(*args, **kwargs)
        inputs = [a for a in tree_leaves((args, kwargs)) if isinstance(a, Tensor)]
        taken = [self._name(t) for t in inputs]
        # An op's output is a new storage unless it is a view or the op wrote into an input.
        addresses = {t.untyped_storage()._cdata for t in inputs}
        made = tuple(
            self._name(t, new=func not in mi.VIEWS and t.untyped_storage()._cdata not in addresses)
            for t in tree_leaves(out)
            if isinstance(t, Tensor)
        )
        passes = func in mi.VIEWS or func in _PASS_ON or (func in _SCALE and len(inputs) == 1)
        for name in taken:
            self.uses[name].append((not passes, made))
        if func in _MATMULS:
            self.cached.append((out, made[0]))
        return out

    def unread(self, outputs: Any) -> list[Tensor]:
        """The cached matmul outputs that no op of the block read, directly or through ops
        that pass values on, and that are not the block's `outputs` (kept anyway)."""
        kept = {self._name(t) for t in tree_leaves(outputs) if isinstance(t, Tensor)}
        return [t for t, name in self.cached if name not in kept and not self._read(name)]

    def _read(self, name: int) -> bool:
        """Whether an op that reads values takes in storage `name` or anything made from it
        by ops that pass values on."""
        seen, todo = {name}, [name]
        while todo:
            for reads, made in self.uses[todo.pop()]:
                if reads:
                    return True
                todo += [k for k in made if k not in seen]
                seen.update(made)
        return False


def follow_selective_blocks(model: Any, policy: ActivationPolicy, tracker: Tracker) -> None:
    """Under `tracker`, stop counting what each selective block caches and its backward never
    reads, when the block's forward ends (see the module docstring)."""
    if policy.kind != "selective":
        return
    for i, block in enumerate(model.layers):
        if policy.applies_to(i):
            block.forward = functools.partial(_followed, block.forward, tracker)


def _followed(forward: Callable[..., Any], tracker: Tracker, *args: Any, **kwargs: Any) -> Any:
    # Without grad (a reference model's forward) checkpointing caches nothing: holding the
    # matmul outputs here would keep what the step frees.
    if tracker.phase != "forward" or not torch.is_grad_enabled():
        return forward(*args, **kwargs)
    uses = _Uses()
    with uses:
        out = forward(*args, **kwargs)
    for t in uses.unread(out):
        tracker.forget(t)
    return out
