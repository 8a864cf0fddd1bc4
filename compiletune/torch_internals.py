"""Every private PyTorch API compiletune uses, in one place.

A PyTorch upgrade that moves or renames one of these touches this file only. Checked on torch
2.13 (CPU); the names below exist since torch 2.9 (`custom_partitioner_fn` arrived in 2.9).

Route: our backend runs its own pre-grad passes on the dynamo graph, then hands the graph to
Inductor's `compile_fx` with a `CustomPartitionerFn`. Inductor traces the joint forward+backward
graph (AOTAutograd), runs its joint-graph passes and then calls our partitioner, which runs our
joint passes and the min-cut partitioner. Going through `compile_fx` (rather than assembling
`aot_autograd` ourselves) keeps Inductor's decompositions, wrappers and the AOTAutograd cache.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch
from torch._inductor.custom_graph_pass import CustomPartitionerFn, get_hash_for_files
from torch.fx.node import _get_qualified_name

__all__ = [
    "CustomPartitionerFn",
    "all_to_all_autograd",
    "autograd_inside_op",
    "below_inplace_or_view",
    "compile_inductor",
    "compile_no_codegen",
    "dynamo_graphs_compiled",
    "dynamic_cpu_kernel_options",
    "fake_call",
    "fsdp_allow_integer_params",
    "is_fake",
    "functorch_patch",
    "get_hash_for_files",
    "host_array",
    "load_cpp_kernel",
    "min_cut_partition",
    "native_grouped_mm",
    "qualified_name",
    "size_hint",
]

Partition = Callable[..., tuple[torch.fx.GraphModule, torch.fx.GraphModule]]


def qualified_name(target: Any) -> str:
    """A stable, address-free name for an FX node target (for op counts in dumps)."""
    if isinstance(target, str):
        return "." + target  # call_method
    if isinstance(target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        return str(target)
    try:
        return _get_qualified_name(target)
    except Exception:
        return getattr(target, "__name__", repr(target))


def all_to_all_autograd(t: torch.Tensor, group: Any) -> torch.Tensor:
    """Chunk i of `t`'s first dimension goes to rank i of `group`; the result holds rank i's
    chunk for us at i. Differentiable (its backward is the reverse exchange) and traceable by
    dynamo: the functional collective, not the in-place `dist.all_to_all_single`."""
    from torch.distributed import _functional_collectives as funcol  # a distributed-only module

    out = funcol.all_to_all_single_autograd(t, None, None, group)
    return funcol.wait_tensor(out) if isinstance(out, funcol.AsyncCollectiveTensor) else out


def node_value(node: torch.fx.Node) -> Any:
    """The (fake) value of a node: dynamo graphs carry 'example_value', AOT graphs 'val'."""
    return node.meta.get("val", node.meta.get("example_value"))


def size_hint(x: int | torch.SymInt, fallback: int = 4096) -> int:
    """The concrete value of an int or a SymInt (its hint); works across torch versions."""
    if isinstance(x, int):
        return x
    hint = getattr(getattr(x, "node", None), "hint", None)
    return int(hint) if hint is not None else fallback


def dynamic_cpu_kernel_options() -> dict[str, Any]:
    """`torch.compile(options=...)` for a function called with many sizes on CPU: its C++ kernels
    always open an OpenMP parallel region and take the thread count at run time. Without it a
    dynamic-shape kernel keeps the threading Inductor chose for the size it was compiled at:
    compiled at a small parameter, the optimizer's step ran single-threaded on every large one
    (measured: 5.2 vs 3.0 ns per value on 2 cores). Empty where this torch lacks the setting."""
    from torch._inductor import config as inductor_config

    return {"cpp.dynamic_threads": True} if hasattr(inductor_config.cpp, "dynamic_threads") else {}


def below_inplace_or_view() -> contextlib.AbstractContextManager:
    """Dispatch below ADInplaceOrView (and autograd) in this block: in-place ops bump no
    version counter and views are not recorded as views (`_base` stays None).

    Used around calls of torch.compile'd helpers. Dynamo guards on the inputs' dispatch keys as
    the thread sees them, and AOTAutograd's first call of a compiled graph runs custom ops
    under a checking dispatch mode that excludes ADInplaceOrView while later calls do not: one
    state for all calls keeps one compile. A reshape done here is a plain alias, which Dynamo
    does not trace back to the tensor it came from.
    """
    return torch._C._AutoDispatchBelowADInplaceOrView()


@contextlib.contextmanager
def autograd_inside_op() -> Iterator[None]:
    """Autograd inside a custom op's implementation, which runs below autograd (its dispatch
    keys excluded): the op can differentiate a library's autograd function it wraps
    (ops/gated_delta.py, flash-linear-attention's kernels)."""
    keys = torch._C.DispatchKey
    with (
        torch._C._SetExcludeDispatchKeyGuard(keys.AutogradFunctionality, False),
        torch._C._SetExcludeDispatchKeyGuard(keys.ADInplaceOrView, False),
        torch.enable_grad(),
    ):
        yield


def dynamo_graphs_compiled() -> int:
    """Graphs Dynamo has compiled in this process so far, over every torch.compile'd function
    (a recompile adds one). Read before and after a run for that run's count."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def dynamic_dims(t: torch.Tensor, dims: tuple[int, ...]) -> None:
    """Compile `t`'s dimensions `dims` as symbolic sizes from the first graph on (the others
    stay static; no error if the tracer must specialise one, as for a size of 1)."""
    for d in dims:
        torch._dynamo.maybe_mark_dynamic(t, d)


def load_cpp_kernel(argtypes: list[str], source: str) -> Callable[..., None]:
    """Compile `source` (C++ defining `extern "C" void kernel(...)` with these argument types)
    with Inductor's C++ toolchain and flags (-O3 -march=native, OpenMP, its vector ISA headers
    `torch/csrc/inductor/cpp_prefix.h`), cached on disk by the source's hash like Inductor's own
    kernels. Tensors are passed by data pointer. Raises whatever compiling or loading raises.

    Always with -ffp-contract=off, Inductor's default, even where its setting says otherwise:
    a kernel written to round once per operation must not have multiply-adds fused at the
    compiler's choice (with TORCHINDUCTOR_CPP_ENABLE_FLOATING_POINT_CONTRACT_FLAG=fast, g++ fused
    7 in the 8-bit AdamW kernel on AVX-512 and 6 on AVX2: different numbers per CPU)."""
    from torch._inductor import config as inductor_config
    from torch._inductor.codecache import CppPythonBindingsCodeCache

    patch = {}
    if hasattr(inductor_config.cpp, "enable_floating_point_contract_flag"):
        patch["cpp.enable_floating_point_contract_flag"] = "off"
    with inductor_config.patch(patch):
        return CppPythonBindingsCodeCache.load_pybinding(argtypes, source)


def min_cut_partition(gm: torch.fx.GraphModule, joint_inputs: Any, **kwargs: Any):
    """AOTAutograd's min-cut partitioner; honours node.meta['recompute'] tags."""
    # Inductor's and AOTAutograd's compilers are imported when first used: importing them costs
    # seconds that the commands which never compile (estimate-memory, eager runs) should not pay.
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    kwargs.setdefault("compiler", "inductor")
    return min_cut_rematerialization_partition(gm, joint_inputs, **kwargs)


@contextlib.contextmanager
def functorch_patch(
    memory_budget: float | None = None, autograd_cache: bool = True
) -> Iterator[None]:
    """Partitioner settings read at compile time.

    `activation_memory_budget`: 1.0 = save what min-cut saves (fastest), 0.0 = recompute all
    that can be. The AOTAutograd cache is turned off when graphs are dumped, because a cache hit
    skips the partitioner and there would be nothing to dump.
    """
    from torch._functorch import config as functorch_config  # when first used (see above)

    patch: dict[str, Any] = {}
    if memory_budget is not None:
        patch["activation_memory_budget"] = memory_budget
    if not autograd_cache:
        patch["enable_autograd_cache"] = False
    with functorch_config.patch(patch):
        yield


def compile_inductor(
    gm: torch.fx.GraphModule,
    example_inputs: list[Any],
    partitioner: CustomPartitionerFn,
    on_compiled: Callable[[str, Any, float], None],
) -> Callable:
    """Compile with Inductor, our partitioner in place of Inductor's.

    `on_compiled(kind, compiled, seconds)` is called for each forward/backward graph Inductor
    builds (kind "forward" | "backward"); `compiled.source_code` is the generated code.
    """
    from torch._inductor.compile_fx import compile_fx, compile_fx_inner  # when first used

    def inner(graph: torch.fx.GraphModule, inputs: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        out = compile_fx_inner(graph, inputs, **kwargs)
        on_compiled(
            "backward" if kwargs.get("is_backward") else "forward", out, time.perf_counter() - t0
        )
        return out

    # config_patches (not an outer config.patch): compile_fx re-applies them around the backward
    # compile, which may run later, outside this call.
    return compile_fx(
        gm,
        example_inputs,
        inner_compile=inner,
        config_patches={"custom_partitioner_fn": partitioner},
    )


def compile_no_codegen(
    gm: torch.fx.GraphModule, example_inputs: list[Any], partition_fn: Partition
) -> Callable:
    """The same joint graph and partition, run eagerly (aot_eager with our partitioner)."""
    from functorch.compile import make_boxed_func  # when first used (see min_cut_partition)
    from torch._dynamo.backends.common import aot_autograd

    def run_eagerly(graph: torch.fx.GraphModule, inputs: Any) -> Callable:
        return make_boxed_func(graph.forward)

    return aot_autograd(
        fw_compiler=run_eagerly,
        bw_compiler=run_eagerly,
        partition_fn=partition_fn,
        keep_inference_input_mutations=True,
    )(gm, example_inputs)


def fake_call(op: Any, *args: Any) -> Any:
    """Run `op` on the fake tensors among `args` (node.meta['val']) to get the result's metadata,
    for nodes a pass inserts into an AOT graph."""
    fake_mode = next(a.fake_mode for a in args if hasattr(a, "fake_mode"))
    with fake_mode:
        return op(*args)


def host_array(t: torch.Tensor) -> np.ndarray:
    """A real CPU tensor's values as numpy, also while a dispatch mode is active (the memory
    estimate's FakeTensorMode, whose step reads real batches): `numpy()` would otherwise pass
    through the mode and read a fake tensor's (absent) data."""
    with torch._C._DisableTorchDispatch():
        return t.numpy()


def real_ops() -> contextlib.AbstractContextManager:
    """Ops on real tensors stay real inside, also while a dispatch mode is active (the memory
    estimate's FakeTensorMode: a step on a real batch computes what its shapes follow from, a
    Gemma 4 image's kept tokens, from the batch's values)."""
    return torch._C._DisableTorchDispatch()


def host_tensor(a: np.ndarray) -> torch.Tensor:
    """A real CPU tensor of `a`'s values (sharing its memory), also while a dispatch mode is
    active: under the memory estimate's FakeTensorMode `torch.from_numpy` would give a fake one,
    whose values (an image grid the tower's shapes follow from) could not be read back."""
    with torch._C._DisableTorchDispatch():
        return torch.from_numpy(a)


def is_fake(t: torch.Tensor) -> bool:
    """Whether `t` is a FakeTensor (the memory estimate's), also inside a DTensor."""
    from torch._subclasses.fake_tensor import is_fake as _is_fake

    return _is_fake(t)


def fsdp_completes_partial_groups() -> bool:
    """Whether FSDP2 finishes a multi-module unit some of whose modules never run forward
    (torch 2.13 does; 2.11 leaves it half-open, which breaks after an eval plus a state_dict)."""
    from torch.distributed.fsdp._fully_shard._fsdp_state import FSDPState

    return hasattr(FSDPState, "_force_complete_incomplete_states")


class _FsdpNN:
    """torch.nn as FSDP2's `_fsdp_param` module sees it, except that `nn.Parameter(x)` of an
    integer tensor does not ask for gradients (which raises)."""

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.nn, name)

    @staticmethod
    def Parameter(data: torch.Tensor | None = None, requires_grad: bool = True):  # noqa: N802
        if data is not None and not (data.is_floating_point() or data.is_complex()):
            requires_grad = False
        return torch.nn.Parameter(data, requires_grad)


def fsdp_allow_integer_params() -> bool:
    """Let FSDP2 shard frozen integer parameters (QLoRA's NF4 codes). torch 2.11 builds each
    sharded parameter as `nn.Parameter(shard)` (requires_grad=True) and only then copies the
    original's flag, which fails for uint8; later versions pass the flag in. Where the old
    construction is found, its module's `nn` is replaced by a view of torch.nn whose Parameter
    passes requires_grad=False for integer data (the only call it changes). Returns whether
    the patch was needed."""
    import inspect

    from torch.distributed.fsdp._fully_shard import _fsdp_param

    if isinstance(_fsdp_param.nn, _FsdpNN):
        return True
    source = inspect.getsource(_fsdp_param.FSDPParam._init_sharded_param)
    if "nn.Parameter(self.to_sharded_dtensor(sharded_param))" not in source:
        return False
    _fsdp_param.nn = _FsdpNN()
    return True


# torch._grouped_mm: rows grouped by offsets times a stack of weights, one kernel (bf16 on
# Hopper+ GPUs); present since torch 2.8. None where this torch lacks it (ops/grouped_mm.py
# then uses its exact fallback).
native_grouped_mm: Callable[..., torch.Tensor] | None = getattr(torch, "_grouped_mm", None)
