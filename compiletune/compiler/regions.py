"""`--compile`: compile each transformer block and the loss head through compiletune's backend.

Regions:
    block  one backend object for all blocks, so N identical blocks compile once (layers of
           another kind, sliding-window ones, are a second region: `block.sliding`; so are
           the blocks past the first --offload-activations N: `block.on_device`)
    head   the loss head (output projection + cross-entropy), where the fused-loss pass works
    vision a vision-language model's tower blocks (one graph for all; under --ac as blocks are)

Each block is compiled in place (`module.compile`), so parameter names, checkpoints and, later,
FSDP wrapping see the same module tree; FSDP hooks stay outside the traced region.
Shapes are static: every batch is [batch_size, seq_len] (the data pipeline pads nothing and never
yields a short batch), so a run compiles each region once and never recompiles per step.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from compiletune.choices import CompileBackend, choices
from compiletune.compiler.activation import ActivationPolicy
from compiletune.compiler.backend import CompiletuneBackend, Pass
from compiletune.compiler.graph_dump import write_dump
from compiletune.loss.head import LossHead
from compiletune.passes.activation_policy import POLICIES, tag_activation_policy
from compiletune.passes.fuse_linear_cross_entropy import fuse_linear_cross_entropy
from compiletune.passes.fuse_linear_logprobs import fuse_linear_logprobs
from compiletune.passes.offload_activations import offload_activations
from compiletune.torch_internals import node_value

BACKENDS = choices(CompileBackend)


@dataclass
class CompileOptions:
    backend: str = "inductor"  # inductor | aot_eager (same passes, no code generation)
    loss: str = "fused"  # fused -> the head gets the fuse_linear_{cross_entropy,logprobs} passes
    dump: bool = False
    loss_chunk_size: int = 0  # tokens per chunk of the fused loss; 0 = from a memory budget
    ac: ActivationPolicy = field(default_factory=ActivationPolicy)
    # the first N blocks move what they save to host memory (offload_target.py says why the
    # first; the head is excluded)
    offload_blocks: int = 0


def block_passes(opts: CompileOptions, with_policy: bool, offload: bool) -> list[Pass]:
    """The pipeline of a transformer block (`with_policy`: a block the --ac policy applies to;
    `offload`: one of the blocks that offload)."""
    passes = []
    if with_policy and opts.ac.kind in POLICIES:
        tag = functools.partial(tag_activation_policy, policy=opts.ac.kind)
        passes.append(Pass(f"activation_policy.{opts.ac.kind}", "joint", tag))
    if offload:
        passes.append(Pass("offload_activations", "partitioned", offload_activations))
    return passes


def head_passes(opts: CompileOptions) -> list[Pass]:
    """The pipeline of the loss head."""
    passes = []
    if opts.loss == "fused":
        fuse = functools.partial(fuse_linear_cross_entropy, chunk_size=opts.loss_chunk_size)
        passes.append(Pass("fuse_linear_cross_entropy", "pre_grad", fuse))
        logprobs = functools.partial(fuse_linear_logprobs, chunk_size=opts.loss_chunk_size)
        passes.append(Pass("fuse_linear_logprobs", "pre_grad", logprobs))
    return passes


def head_logits_shape(gm: torch.fx.GraphModule) -> tuple[int, int] | None:
    """(tokens, vocab) of a head graph: targets [b, s] (int) and the weight's rows [V, d]."""
    tokens = vocab = None
    for n in gm.graph.nodes:
        if n.op != "placeholder":
            continue
        v = node_value(n)
        if not isinstance(v, torch.Tensor):
            continue
        if v.dtype in (torch.int64, torch.int32):
            tokens = v.numel()
        elif v.dim() == 2 and v.is_floating_point():
            vocab = max(vocab or 0, int(v.shape[0]))
    return (tokens, vocab) if tokens and vocab else None


@dataclass
class CompiledRegions:
    backends: dict[str, CompiletuneBackend] = field(default_factory=dict)

    def stats(self) -> dict[str, Any]:
        """Compiles per region (1 each is the goal) and seconds spent in the backend."""
        per_region = {
            name: {"compiles": b.compiles, "compile_seconds": round(b.compile_seconds, 2)}
            for name, b in self.backends.items()
        }
        return {
            "compiles": sum(b.compiles for b in self.backends.values()),
            "recompiles": sum(max(0, b.compiles - 1) for b in self.backends.values()),
            "compile_seconds": round(sum(b.compile_seconds for b in self.backends.values()), 2),
            "regions": per_region,
        }

    def write_dump(self, directory: Path) -> dict[str, Any]:
        records = [r for b in self.backends.values() for r in b.records]
        summary = write_dump(records, directory)
        return summary


def _inputs_require_grad(model: torch.nn.Module) -> None:
    """With a frozen embedding (LoRA), block 0's input would not require grad while every other
    block's does; dynamo guards on that, so block 0 would compile a second graph. A forward hook
    marks the embedding output as requiring grad, which keeps one graph for all blocks at the
    cost of block 0's input gradient (one block's dx matmuls) in every backward."""
    emb = model.tok_embeddings
    if emb.weight.requires_grad or not any(p.requires_grad for p in model.layers.parameters()):
        return

    def hook(module: torch.nn.Module, inputs: Any, output: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled() and not output.requires_grad:
            output = output.detach().requires_grad_()
        return output

    emb.register_forward_hook(hook)


def _compile_tower(
    blocks: torch.nn.ModuleList, opts: CompileOptions, backends: dict[str, CompiletuneBackend]
) -> None:
    """Compile a vision tower's blocks as the region `vision` (one graph for every block: the
    towers mark their image and patch counts dynamic), under --ac as decoder blocks are (the
    tower's own block index picks the --ac-every blocks; the others are `vision.no_ac`).
    --offload-activations counts decoder blocks only: the tower's blocks keep what they save."""
    for index, block in enumerate(blocks):
        with_policy = opts.ac.applies_to(index)
        name = "vision" if with_policy or opts.ac.kind == "none" else "vision.no_ac"
        if name not in backends:
            backends[name] = CompiletuneBackend(
                name,
                block_passes(opts, with_policy, offload=False),
                mode=opts.backend,
                dump=opts.dump,
                memory_budget=opts.ac.budget if with_policy else None,
            )
        block.compile(backend=backends[name], fullgraph=True, dynamic=False)


def compile_regions(
    model: torch.nn.Module, head: LossHead, opts: CompileOptions
) -> CompiledRegions:
    """Compile every block of `model.layers` and `head` in place; returns their backends."""
    if opts.backend not in BACKENDS:
        raise ValueError(f"unknown compile backend {opts.backend!r}")
    backends: dict[str, CompiletuneBackend] = {}
    _inputs_require_grad(model)
    for index, block in enumerate(model.layers):
        # Blocks under the policy and blocks outside it are two regions (two compiles); within a
        # region one backend object serves every block, so each region compiles once.
        # Sliding-window, linear-attention and rope-less layers are regions of their own
        # (`block.region`): one graph per kind of block.
        with_policy = opts.ac.applies_to(index)
        name = "block" if with_policy or opts.ac.kind == "none" else "block.no_ac"
        # Blocks past the first --offload-activations N keep what they save: a region too.
        offload = index < opts.offload_blocks
        if opts.offload_blocks and not offload:
            name += ".on_device"
        region = getattr(block, "region", "full")
        if region != "full":
            name += f".{region}"
        if model.args.n_experts and not block.moe:  # a dense layer of a MoE model
            name += ".dense"
        if name not in backends:
            backends[name] = CompiletuneBackend(
                name,
                block_passes(opts, with_policy, offload),
                mode=opts.backend,
                dump=opts.dump,
                memory_budget=opts.ac.budget if with_policy else None,
            )
        block.compile(backend=backends[name], fullgraph=True, dynamic=False)
    vision = getattr(model, "vision_blocks", None)  # a vision-language model's tower
    if vision is not None:
        _compile_tower(vision(), opts, backends)
    heads = CompiletuneBackend(
        "head", head_passes(opts), mode=opts.backend, dump=opts.dump, watch=head_logits_shape
    )
    head.compile(backend=heads, fullgraph=True, dynamic=False)
    return CompiledRegions({**backends, "head": heads})
