"""compiletune's torch.compile backend: a pipeline of FX passes in front of Inductor.

    dynamo graph of one region (a block, or the loss head)
      -> pre-grad passes   (torch-level graph; e.g. fuse linear + cross_entropy)
      -> AOTAutograd joint forward+backward graph
      -> joint passes      (aten-level; e.g. tag nodes save / recompute)
      -> min-cut partitioner (honours the tags; optional activation memory budget)
      -> partitioned passes (forward and backward graphs together; e.g. offload saved tensors)
      -> Inductor (`mode="inductor"`), or the partitioned graphs run eagerly (`mode="aot_eager"`)

A pass is a pure function `gm -> (gm, stats)` (a partitioned pass: `(fw, bw, num_fwd_outputs)
-> (fw, bw, stats)`). `Pass` names it and says at which stage it runs.
One backend object serves all identical blocks, so dynamo compiles the block once and reuses it
(dynamo keys its cache on the backend object too).
"""

from __future__ import annotations

import functools
import inspect
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch

from compiletune import torch_internals as ti
from compiletune.choices import CompileBackend, choices
from compiletune.compiler.graph_dump import RegionRecord, logits_like_tensors, saved_for_backward


@dataclass(frozen=True)
class Pass:
    """One entry of the pipeline: `fn(gm) -> (gm, stats)` run at `stage`."""

    name: str
    stage: Literal["pre_grad", "joint", "partitioned"]
    fn: Callable

    def source_files(self) -> tuple[str, ...]:
        fn = self.fn.func if isinstance(self.fn, functools.partial) else self.fn
        return (inspect.getfile(fn),)

    def cache_key(self) -> str:
        fn = self.fn
        if isinstance(fn, functools.partial):
            return f"{self.name}:{sorted(fn.keywords.items())!r}:{fn.args!r}"
        return self.name


# The record of the region being compiled. A module global (not an attribute of the
# partitioner) keeps the partitioner small and picklable: Inductor pickles it into cache keys.
_RECORDING: list[RegionRecord] = []


class _Partitioner(ti.CustomPartitionerFn):
    """Runs the joint passes on the joint graph, then the min-cut partitioner."""

    def __init__(self, joint_passes: tuple[Pass, ...], partitioned: tuple[Pass, ...] = ()) -> None:
        self.joint_passes = joint_passes
        self.partitioned = partitioned

    def uuid(self) -> str:
        # Hash the code of every pass (and this file) so an edited pass never reuses a stale
        # cached compile.
        passes = self.joint_passes + self.partitioned
        files = {__file__, *(f for p in passes for f in p.source_files())}
        extra = "|".join(p.cache_key() for p in passes)
        return ti.get_hash_for_files(tuple(sorted(files)), extra=extra)

    def __call__(self, gm: torch.fx.GraphModule, joint_inputs: Any, **kwargs: Any):
        record = _RECORDING[-1] if _RECORDING else None
        if record is not None:
            record.add_stage("joint", gm)
        for p in self.joint_passes:
            gm, stats = p.fn(gm)
            if record is not None:
                record.add_pass(p.name, "joint", stats)
                record.add_stage(f"joint.{p.name}", gm)
        fw, bw = ti.min_cut_partition(gm, joint_inputs, **kwargs)
        if record is not None:
            record.add_stage("forward", fw)
            record.add_stage("backward", bw)
            record.saved = saved_for_backward(fw, kwargs["num_fwd_outputs"])
            if record.watch:
                for stage, graph in (("forward", fw), ("backward", bw)):
                    record.big_tensors[stage] = logits_like_tensors(graph, *record.watch)
        for p in self.partitioned:
            fw, bw, stats = p.fn(fw, bw, kwargs["num_fwd_outputs"])
            if record is not None:
                record.add_pass(p.name, "partitioned", stats)
                record.add_stage(f"forward.{p.name}", fw)
                record.add_stage(f"backward.{p.name}", bw)
        return fw, bw


class CompiletuneBackend:
    """`torch.compile(module, backend=CompiletuneBackend(...))`.

    region: name of what it compiles ("block", "head"), used in records and dumps.
    passes: the pipeline, in order; pre-grad passes run before joint passes.
    mode: "inductor" (code generation) or "aot_eager" (same passes and partition, no codegen).
    memory_budget: the partitioner's activation memory budget (None = min-cut default, 1.0).
    dump: keep readable graphs and generated code (turns the AOTAutograd cache off).
    watch: given the dynamo graph (before any pass), the (tokens, vocab) of a loss head; the
        record then lists every logits-shaped tensor of the partitioned forward and backward,
        which shows whether full logits survive the passes.
    """

    def __init__(
        self,
        region: str,
        passes: list[Pass] | tuple[Pass, ...] = (),
        mode: CompileBackend = "inductor",
        memory_budget: float | None = None,
        dump: bool = False,
        watch: Callable[[torch.fx.GraphModule], tuple[int, int] | None] | None = None,
    ) -> None:
        if mode not in choices(CompileBackend):
            raise ValueError(f"unknown compile backend mode {mode!r}")
        self.region = region
        self.pre_grad = tuple(p for p in passes if p.stage == "pre_grad")
        self.joint = tuple(p for p in passes if p.stage == "joint")
        self.partitioned = tuple(p for p in passes if p.stage == "partitioned")
        self.mode = mode
        self.memory_budget = memory_budget
        self.dump = dump
        self.watch = watch
        self.records: list[RegionRecord] = []

    @property
    def compiles(self) -> int:
        return len(self.records)

    @property
    def compile_seconds(self) -> float:
        return sum(r.compile_seconds for r in self.records)

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable:
        t0 = time.perf_counter()
        n = len(self.records)
        name = self.region if n == 0 else f"{self.region}.recompile{n}"
        record = RegionRecord(name, keep_graphs=self.dump)
        self.records.append(record)
        record.watch = self.watch(gm) if self.watch else None
        record.add_stage("dynamo", gm)
        for p in self.pre_grad:
            gm, stats = p.fn(gm)
            record.add_pass(p.name, "pre_grad", stats)
            record.add_stage(f"pre_grad.{p.name}", gm)
        partitioner = _Partitioner(self.joint, self.partitioned)
        inside_call = True

        def on_compiled(kind: str, compiled: Any, seconds: float) -> None:
            if not inside_call:  # a backward compiled lazily, at the first backward
                record.compile_seconds += seconds
            code = getattr(compiled, "source_code", None)
            if self.dump and code:
                record.code[kind] = code

        _RECORDING.append(record)
        try:
            with ti.functorch_patch(self.memory_budget, autograd_cache=not self.dump):
                if self.mode == "aot_eager":
                    compiled = ti.compile_no_codegen(gm, example_inputs, partitioner)
                else:
                    compiled = ti.compile_inductor(gm, example_inputs, partitioner, on_compiled)
        finally:
            _RECORDING.pop()
            inside_call = False
            record.compile_seconds += time.perf_counter() - t0
        return compiled
