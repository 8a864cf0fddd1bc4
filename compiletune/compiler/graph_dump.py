"""What the compiler did, per compiled region and per stage: the record behind `--dump-graphs`.

A `RegionRecord` collects, while a region compiles, each stage's readable graph and op counts
(dynamo graph, after each pre-grad pass, joint graph, after each joint pass, partitioned forward
and backward), the generated code, what each pass reported, and the tensors the forward saves
for backward. `write_dump` turns the records into files a person can read:

    DIR/<region>/00_dynamo.txt, 01_pre_grad.<pass>.txt, ..., NN_forward.txt, NN_backward.txt
        the readable graph, headed by the op-count diff against the previous stage
    DIR/<region>/forward.code.py, backward.code.py     generated code (Inductor)
    DIR/summary.json                                   per region: passes, saved bytes, largest tensor
    DIR/index.json                                     each file: its region, stage and what it is
"""

from __future__ import annotations

import json
import math
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from compiletune.torch_internals import node_value, qualified_name, size_hint


def tensor_bytes(t: torch.Tensor) -> int:
    return math.prod(size_hint(s) for s in t.shape) * t.element_size()


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    return []


def op_counts(gm: torch.fx.GraphModule) -> Counter:
    return Counter(
        qualified_name(n.target) for n in gm.graph.nodes if n.op in ("call_function", "call_method")
    )


def largest_tensor(gm: torch.fx.GraphModule) -> dict[str, Any] | None:
    best: dict[str, Any] | None = None
    for n in gm.graph.nodes:
        for t in _tensors(node_value(n)):
            nbytes = tensor_bytes(t)
            if best is None or nbytes > best["bytes"]:
                shape = [size_hint(s) for s in t.shape]
                best = {"node": n.name, "shape": shape, "dtype": str(t.dtype), "bytes": nbytes}
    return best


def logits_like_tensors(gm: torch.fx.GraphModule, tokens: int, vocab: int) -> list[dict[str, Any]]:
    """Computed tensors shaped like full logits: a `vocab` dimension and tokens*vocab elements."""
    found = []
    for n in gm.graph.nodes:
        if n.op == "placeholder":
            continue
        for t in _tensors(node_value(n)):
            shape = [size_hint(s) for s in t.shape]
            if vocab in shape and math.prod(shape) == tokens * vocab:
                found.append({"node": n.name, "shape": shape, "dtype": str(t.dtype)})
    return found


def saved_for_backward(fw: torch.fx.GraphModule, num_fwd_outputs: int) -> list[dict[str, Any]]:
    """The tensors a partitioned forward returns for backward (its outputs past the real ones).

    `is_input` marks graph inputs (parameters, the block's input): saving those allocates
    nothing new, so they are reported apart from the activations the forward computes.
    """
    output = next(n for n in fw.graph.nodes if n.op == "output")
    rows = []
    for n in output.args[0][num_fwd_outputs:]:
        if not isinstance(n, torch.fx.Node):
            continue
        for t in _tensors(node_value(n)):
            rows.append(
                {
                    "node": n.name,
                    "shape": [size_hint(s) for s in t.shape],
                    "dtype": str(t.dtype),
                    "bytes": tensor_bytes(t),
                    "is_input": n.op == "placeholder",
                }
            )
    return rows


@dataclass
class Stage:
    name: str
    readable: str
    counts: Counter
    largest: dict[str, Any] | None


@dataclass
class RegionRecord:
    name: str
    keep_graphs: bool = False  # readable graphs are only worth their cost for --dump-graphs
    stages: list[Stage] = field(default_factory=list)
    passes: list[dict[str, Any]] = field(default_factory=list)
    saved: list[dict[str, Any]] = field(default_factory=list)
    code: dict[str, str] = field(default_factory=dict)
    compile_seconds: float = 0.0
    watch: tuple[int, int] | None = None  # (tokens, vocab) of a loss head
    big_tensors: dict[str, list[dict[str, Any]]] = field(default_factory=dict)

    def add_stage(self, name: str, gm: torch.fx.GraphModule) -> None:
        if not self.keep_graphs:
            return
        self.stages.append(
            Stage(name, gm.print_readable(print_output=False), op_counts(gm), largest_tensor(gm))
        )

    def add_pass(self, name: str, stage: str, stats: dict[str, Any]) -> None:
        self.passes.append(
            {"pass": name, "stage": stage, "fired": stats.get("matched", 0) > 0, **stats}
        )

    def summary(self) -> dict[str, Any]:
        activation_bytes = sum(r["bytes"] for r in self.saved if not r["is_input"])
        offloaded = sum(p.get("offloaded_bytes", 0) for p in self.passes)
        inputs_moved = sum(p.get("offloaded_input_bytes", 0) for p in self.passes)
        out: dict[str, Any] = {
            "passes": self.passes,
            "saved_activation_bytes": activation_bytes,
            "offloaded_bytes": offloaded,
            "saved_activation_bytes_on_device": activation_bytes - (offloaded - inputs_moved),
            "saved_input_bytes": sum(r["bytes"] for r in self.saved if r["is_input"]),
            "offloaded_input_bytes": inputs_moved,
            "saved": self.saved,
            "largest_tensor": {s.name: s.largest for s in self.stages},
            "compile_seconds": round(self.compile_seconds, 3),
        }
        if self.watch:
            # Filled only when the partitioner ran (not on an AOTAutograd cache hit).
            tokens, vocab = self.watch
            out["logits_shape"] = [tokens, vocab]
            out["logits_like_tensors"] = self.big_tensors
            out["full_logits_exist"] = any(self.big_tensors.values())
        return out


# What each stage's graph is, by the stage name's first part (the rest names a pass).
_STAGES = {
    "dynamo": "the graph dynamo captured (torch-level ops)",
    "pre_grad": "the dynamo graph after the pre-grad pass",
    "joint": "the joint forward+backward graph (aten ops)",
    "forward": "the partitioned forward (outputs past the real ones are saved for backward)",
    "backward": "the partitioned backward",
}


def _describe(stage: str) -> str:
    kind, _, pass_name = stage.partition(".")
    what = _STAGES.get(kind, stage)
    if pass_name and kind != "pre_grad":
        return f"{what}, after the {pass_name} pass"
    return f"{what} {pass_name}".strip()


def write_dump(records: list[RegionRecord], directory: Path) -> dict[str, Any]:
    """Write every record under `directory` and return the summary written to summary.json.
    `index.json` lists each file written with its region, stage and what it is, in order, so a
    reader need not guess from file names."""
    directory.mkdir(parents=True, exist_ok=True)
    summary = {}
    index: list[dict[str, str]] = [
        {
            "file": "summary.json",
            "region": "",
            "stage": "",
            "what": "per region: passes, saved "
            "activations, largest tensor per stage, compile seconds",
        }
    ]
    for rec in records:
        folder = directory / rec.name
        folder.mkdir(exist_ok=True)
        previous: Counter | None = None
        for i, stage in enumerate(rec.stages):
            header = ""
            if previous is not None:
                diff = {
                    k: stage.counts[k] - previous[k]
                    for k in sorted(set(stage.counts) | set(previous))
                    if stage.counts[k] != previous[k]
                }
                header = f"# op-count diff against the previous stage: {json.dumps(diff)}\n"
            header += f"# largest tensor: {json.dumps(stage.largest)}\n\n"
            name = f"{i:02d}_{stage.name}.txt"
            (folder / name).write_text(header + stage.readable)
            entry = {"region": rec.name, "stage": stage.name, "what": _describe(stage.name)}
            index.append({"file": f"{rec.name}/{name}", **entry})
            previous = stage.counts
        for kind, code in rec.code.items():
            (folder / f"{kind}.code.py").write_text(code)
            what = f"the code Inductor generated for the {kind}"
            index.append(
                {
                    "file": f"{rec.name}/{kind}.code.py",
                    "region": rec.name,
                    "stage": kind,
                    "what": what,
                }
            )
        summary[rec.name] = rec.summary()
    (directory / "summary.json").write_text(json.dumps(summary, indent=2, default=str) + "\n")
    (directory / "index.json").write_text(json.dumps(index, indent=2) + "\n")
    return summary
