"""Custom ops that move a saved activation to host memory and back (`--offload-activations`).

`passes/offload_activations.py` puts `offload_to_host` on each activation a block's forward saves
and `reload_from_host` at the start of its backward. The ops are opaque to the compiler, so they
survive Inductor as calls.

On a GPU: the device-to-host copy goes to pinned memory on a side stream, so it overlaps the
forward compute that follows; the source tensor is `record_stream`-ed on the side stream so its
memory is not reused before the copy ends. The reload waits for the side stream, then copies
back (non-blocking, from pinned memory) on the compute stream at the start of the block's
backward. On CPU "host" is the same memory: the ops copy, which keeps the graph shape and the
numerics of the GPU path testable on a machine without one.
"""

from __future__ import annotations

import torch

from compiletune.ops.op_memory import declare_memory, holds_nothing

_SIDE_STREAMS: dict[int, torch.cuda.Stream] = {}


def _side_stream(device: torch.device) -> torch.cuda.Stream:
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SIDE_STREAMS:
        _SIDE_STREAMS[index] = torch.cuda.Stream(device=index)
    return _SIDE_STREAMS[index]


def _empty_like(x: torch.Tensor, device: torch.device | str, pin: bool = False) -> torch.Tensor:
    # The same strides as x: the compiled backward was built for the layout the forward saved.
    return torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device=device, pin_memory=pin)


@torch.library.custom_op("compiletune::offload_to_host", mutates_args=())
def offload_to_host(x: torch.Tensor) -> torch.Tensor:
    """A host copy of `x` (pinned, asynchronous on a side stream when `x` is on a GPU)."""
    host = _empty_like(x, "cpu", pin=x.is_cuda)
    if not x.is_cuda:
        return host.copy_(x)
    stream = _side_stream(x.device)
    stream.wait_stream(torch.cuda.current_stream(x.device))  # x must be fully computed first
    with torch.cuda.stream(stream):
        host.copy_(x, non_blocking=True)
    x.record_stream(stream)
    return host


@offload_to_host.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return _empty_like(x, "cpu")


@torch.library.custom_op("compiletune::reload_from_host", mutates_args=())
def reload_from_host(x: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`x` (from `offload_to_host`) back on `device`."""
    out = _empty_like(x, device)
    if device.type != "cuda":
        return out.copy_(x)
    torch.cuda.current_stream(device).wait_stream(_side_stream(device))  # the offload copy ended
    return out.copy_(x, non_blocking=True)


@reload_from_host.register_fake
def _(x: torch.Tensor, device: torch.device) -> torch.Tensor:
    return _empty_like(x, device)


# What these ops hold beyond their outputs (the memory estimate reads it): nothing; a copy is its output.
declare_memory("compiletune::offload_to_host")(holds_nothing)
declare_memory("compiletune::reload_from_host")(holds_nothing)
