"""Every closed set of choices a run can name, each declared once as a `Literal`.

The config's fields are typed with these (so `--help` and the YAML checks take their choices from
here), and the modules that act on a choice check against the same tuple (`choices(Loss)`).
This module imports nothing of compiletune's, so any module may use it.
"""

from __future__ import annotations

from typing import Literal, get_args

Dtype = Literal["fp32", "bf16", "bf16-mixed"]
BaseDtype = Literal["bf16", "fp32"]
Schedule = Literal["cosine", "linear", "constant"]
CompileBackend = Literal["inductor", "aot_eager"]
Loss = Literal["fused", "chunked", "plain"]
OptimizerKind = Literal["adamw", "adamw8bit"]
Bf16Compensation = Literal["none", "kahan", "stochastic"]
Sharding = Literal["full", "grad-op", "hybrid", "none"]
Quantize = Literal["nf4"]
Fp8Recipe = Literal["rowwise", "tensorwise"]
Objective = Literal["sft", "dpo", "ipo", "simpo", "kd", "grpo"]
GrpoLoss = Literal["grpo", "dr_grpo", "dapo"]
KdLoss = Literal["forward_kl", "jsd"]
DataFormat = Literal["auto", "text", "prompt-completion", "messages", "sharegpt", "alpaca"]
Packing = Literal["whole", "stream"]
Truncation = Literal["right", "left"]
# the named --ac policies (besides budget=F); full and selective are graph passes
AcKind = Literal["none", "full", "selective"]


def choices(literal: object) -> tuple[str, ...]:
    """The values of a `Literal` alias above, in declaration order."""
    return tuple(get_args(literal))
