"""What a caller outside the trainer chooses about a build, and how it watches it.

`build_run` builds the trainer's run. Another caller (the memory estimate, estimate/estimator.py)
builds the same run differently in a few ways it chooses as plain data, `BuildOptions`: where the
tensors live and in what dtype, whether anything is read from disk, fake tensors, a shorter
model, an eager step. And it watches the build and the step through one small observer,
`BuildObserver`: a scope entered around everything that allocates, and a call as each part
begins. The trainer builds with the defaults: `BuildOptions()` and `NO_OBSERVER`, which does
nothing. train/ knows no estimator: whoever observes implements the protocol.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

# The parts of a build and its step, in the order they begin (`BuildObserver.observe`).
PHASES = ("params", "optimizer", "forward", "backward", "step")


class BuildObserver(Protocol):
    """Watches a build and its step from outside."""

    def scope(self) -> contextlib.AbstractContextManager[object]:
        """Entered around everything the build allocates (materialising the model and its
        frozen ones, building the optimizer); the caller enters it again around each step it
        runs, which tells `observe` its own phases (step.py)."""
        ...

    def observe(self, phase: str, params: list[nn.Parameter]) -> None:
        """`phase` (one of PHASES) begins; `params`: the run's trainable parameters (filled in
        by the time "optimizer" begins)."""
        ...


class _NoObserver:
    """The trainer's observer: no scope, nothing observed."""

    def scope(self) -> contextlib.AbstractContextManager[object]:
        return contextlib.nullcontext()

    def observe(self, phase: str, params: list[nn.Parameter]) -> None:
        return None


NO_OBSERVER: BuildObserver = _NoObserver()


@dataclass(frozen=True)
class BuildOptions:
    """What the caller chooses about a build beyond its TrainConfig. The defaults are the
    trainer's; the memory estimate passes its own (estimator.run_step).

    device        where the tensors live (None: the GPU if there is one, else the CPU; under
                  FSDP the process's device, as its DistEnv says)
    dtype         the parameters' dtype (None: --dtype on `device`, and a warning for bf16 on a
                  CPU); the estimate passes the dtype of the GPU it is for
    read_inputs   False: nothing is read from disk (no tokenizer, data or checkpoint; the
                  defaults --data would decide come from the model's shapes), the weights are
                  drawn from the seed, and no reference is built that --precompute-ref would
                  drop before the first step
    fake          the tensors are fake (the observer's scope makes them): no storage is ever
                  filled, and --cp splits rows as rank 0 of its group without a process group
    depth         build the model's first `depth` blocks only (a shorter model; None: all)
    compile       False: the blocks, the head and the optimizer's step run eagerly whatever
                  --compile says (the estimate models compiled blocks by the same policies)
    emulate_fp8   --fp8's float8 matmuls emulated whatever the device (the estimate's)
    images        the run's data holds images, as the estimate found without reading it
                  (estimate/images.py): the vision tower is built as for image data
    """

    device: torch.device | None = None
    dtype: torch.dtype | None = None
    read_inputs: bool = True
    fake: bool = False
    depth: int | None = None
    compile: bool = True
    emulate_fp8: bool = False
    images: bool = False

    def __post_init__(self) -> None:
        if self.fake and self.read_inputs:
            raise ValueError("a fake build has no storage to read into: pass read_inputs=False")
