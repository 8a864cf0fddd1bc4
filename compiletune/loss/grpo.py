"""GRPO's formulas (DeepSeekMath; Dr. GRPO; DAPO): group-normalised advantages, and the clipped
policy-ratio loss over completion tokens with an optional KL penalty to a reference.

For completion i of a group of G (one prompt), with reward r_i:

    A_i     = r_i - mean(r)                     divided by std(r) + 1e-4 when `scale` (GRPO, DAPO;
                                                Dr. GRPO leaves it out)
    ratio_t = exp(logp_t - old_logp_t)          per completion token t
    term_t  = -min(ratio_t A_i, clip(ratio_t, 1 - eps_low, 1 + eps_high) A_i)
              + beta (exp(ref_t - logp_t) - (ref_t - logp_t) - 1)   (the k3 KL estimator)

and the loss over a batch of completions, by `kind`:

    grpo     mean over completions of (each completion's mean over its tokens)
    dr_grpo  sum over every token / (completions x max_new_tokens): a constant normaliser
    dapo     sum over every token / the number of tokens: a token-level mean

std is the sample standard deviation (n - 1), as TRL and the papers compute it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

GRPO_LOSSES = ("grpo", "dr_grpo", "dapo")


@dataclass(frozen=True)
class GrpoOptions:
    kind: str = "grpo"  # one of GRPO_LOSSES
    eps_low: float = 0.2
    eps_high: float = 0.2
    beta: float = 0.0  # KL penalty to the reference (0: none, no reference is built)
    max_new_tokens: int = 256  # dr_grpo's normaliser


def advantages(rewards: Tensor, group: int, scale: bool = True) -> Tensor:
    """rewards [n] (groups of `group` consecutive completions of one prompt) -> advantages [n]
    (fp32): each reward less its group's mean, divided by the group's std + 1e-4 when
    `scale`."""
    r = rewards.float().view(-1, group)
    a = r - r.mean(dim=1, keepdim=True)
    if scale:
        std = r.std(dim=1, keepdim=True) if group > 1 else torch.zeros_like(r[:, :1])
        a = a / (std + 1e-4)
    return a.flatten()


def grpo_loss(
    logp: Tensor,
    old_logp: Tensor,
    ref_logp: Tensor | None,
    adv: Tensor,
    completion: Tensor,
    opts: GrpoOptions,
    denominator: float | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """The loss of a batch of completions.

    logp, old_logp, ref_logp [n, t]: per-token log-probabilities of the completions' tokens
    under the policy (with gradients), the policy that sampled them and the reference (None
    without a KL penalty); adv [n]; completion [n, t] bool: which positions are completion
    tokens. `denominator`: the normaliser of the whole step when this is one micro-batch of it
    (completions, completions x max_new_tokens, or completion tokens, by kind; None: this
    batch's). Returns (loss [], sums): sums are summed over completion tokens (fp32,
    detached): "clipped" (tokens whose ratio was clipped), "kl" (the k3 estimate, with a
    reference).
    """
    mask = completion.float()
    ratio = torch.exp(logp - old_logp)
    a = adv[:, None]
    clipped = torch.clamp(ratio, 1 - opts.eps_low, 1 + opts.eps_high)
    term = -torch.minimum(ratio * a, clipped * a)
    sums: dict[str, Tensor] = {}
    with torch.no_grad():
        cut = (ratio < 1 - opts.eps_low) & (a < 0) | (ratio > 1 + opts.eps_high) & (a > 0)
        sums["clipped"] = (cut.float() * mask).sum()
    if ref_logp is not None and opts.beta:
        diff = ref_logp - logp
        kl = torch.exp(diff) - diff - 1
        term = term + opts.beta * kl
        sums["kl"] = (kl.detach() * mask).sum()
    term = term * mask
    if opts.kind == "grpo":
        total = (term.sum(dim=1) / mask.sum(dim=1).clamp_min(1)).sum()
        own = float(term.shape[0])
    elif opts.kind == "dr_grpo":
        total, own = term.sum(), float(term.shape[0] * opts.max_new_tokens)
    elif opts.kind == "dapo":
        total, own = term.sum(), mask.sum().clamp_min(1)
    else:
        raise ValueError(f"unknown GRPO loss {opts.kind!r}; expected one of {GRPO_LOSSES}")
    return total / (own if denominator is None else denominator), sums
