"""The loss head: output projection + next-token cross-entropy, summed over target tokens.

`LossHead(output, kind, softcap)(h [b, s, d], targets [b, s]) -> fp32 []` (sum over targets; the
trainer divides by the target count of the whole accumulated batch). `softcap` > 0 (Gemma 2's
final_logit_softcapping): logits -> softcap * tanh(logits / softcap) before the softmax, in every
kind (the fused op applies it per chunk, so full logits still never exist).

kind:
    plain    linear -> fp32 upcast -> cross_entropy: [b*s, V] logits and their fp32 copy exist.
    chunked  the usual chunked-logits baseline: logits per chunk of tokens, upcast per chunk.
    fused    compiletune::linear_cross_entropy: full logits never exist.

Under `--compile` a fused head is written as `plain` and the `fuse_linear_cross_entropy` pass
rewrites it in the graph (that is the point of the pass); without compile the op is called here.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from compiletune.choices import Loss, choices
from compiletune.ops.fused_logprobs import token_logprobs
from compiletune.ops.fused_loss import chunked_cross_entropy, linear_cross_entropy

IGNORE_INDEX = -100
LOSS_KINDS = choices(Loss)


def head_kind(loss: str, compiled: bool) -> str:
    """Under compile the fused head is traced as `plain` and the pass fuses it in the graph."""
    return "plain" if compiled and loss == "fused" else loss


class LossHead(nn.Module):
    def __init__(
        self, output: nn.Linear, kind: str = "plain", softcap: float | None = None
    ) -> None:
        super().__init__()
        if kind not in LOSS_KINDS:
            raise ValueError(f"unknown loss kind {kind!r}")
        self.output = output  # shared with the model: the same weight, tied or not
        self.kind = kind
        self.softcap = float(softcap or 0.0)

    def forward(
        self, h: torch.Tensor, targets: torch.Tensor, logprobs: bool = False
    ) -> torch.Tensor:
        """The summed cross-entropy []; with `logprobs`, the targets' log-probabilities
        [b * s] fp32 instead (0 where ignored), for --objective."""
        w, b = self.output.weight, self.output.bias
        if logprobs:
            return self._logprobs(h, w, b, targets)
        if self.kind == "fused":
            return linear_cross_entropy(
                h,
                w,
                targets,
                bias=b,
                ignore_index=IGNORE_INDEX,
                reduction="sum",
                softcap=self.softcap,
            )
        if self.kind == "chunked":
            return chunked_cross_entropy(
                h,
                w,
                targets,
                bias=b,
                ignore_index=IGNORE_INDEX,
                reduction="sum",
                softcap=self.softcap,
            )
        # F.linear, not self.output(h): under FSDP the output projection's unit has hooks that
        # must not run inside the compiled head (its weight is gathered by the norm's hook).
        logits = F.linear(h, w, b)  # [b, s, V]
        if self.softcap:  # the fuse pass recognises this form: tanh(x / c) * c
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return F.cross_entropy(
            logits.flatten(0, 1).float(),
            targets.flatten(),
            ignore_index=IGNORE_INDEX,
            reduction="sum",
        )

    def _logprobs(
        self, h: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, targets: torch.Tensor
    ) -> torch.Tensor:
        if b is not None:
            raise ValueError("--objective heads take an output projection without a bias")
        if self.kind != "plain" or not torch.compiler.is_compiling():  # the chunked op
            return token_logprobs(
                h.flatten(0, 1),
                w,
                targets.flatten(),
                ignore_index=IGNORE_INDEX,
                softcap=self.softcap,
            )
        # Compiled: plain code, which the fuse_linear_logprobs pass turns into the same op
        # under --loss fused (with --loss plain the logits exist, as asked).
        logits = F.linear(h, w)
        if self.softcap:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        live = targets != IGNORE_INDEX
        logp = torch.log_softmax(logits.float(), dim=-1)
        picked = logp.gather(-1, torch.where(live, targets, 0).unsqueeze(-1)).squeeze(-1)
        return torch.where(live, picked, 0.0).flatten()
