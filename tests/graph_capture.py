"""The dynamo graph a compiled function produces: what a backend's pre-grad passes see."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


def capture(fn: Callable[..., Any], *inputs: Any) -> torch.fx.GraphModule:
    """The one dynamo graph of `fn` on `inputs` (fullgraph)."""
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch.compile(fn, backend=backend, fullgraph=True)(*inputs)
    (gm,) = graphs
    return gm
