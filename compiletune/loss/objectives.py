"""Preference and distillation objectives on top of the chunked head ops (ops/fused_logprobs.py).

Preference pairs (a shared prompt, a chosen and a rejected response) are scored by the summed
log-probability of each response's tokens under the policy (pi) and, for DPO and IPO, under a
frozen reference (ref). With h = (pi_c - ref_c) - (pi_r - ref_r):

    dpo    -(1 - eps) log sigmoid(beta h) - eps log sigmoid(-beta h)
           (Rafailov et al. 2023; eps > 0 is conservative DPO's label smoothing)
    ipo    (h - 1 / (2 beta))^2                                  (Azar et al. 2023)
    simpo  -log sigmoid(beta (pi_c / |c| - pi_r / |r|) - gamma)  (Meng et al. 2024: average
           log-probability per response token, a target margin gamma, no reference)

Rewards (what metrics report): beta (pi - ref) per response (SimPO: beta pi / |response|);
accuracy is the fraction of pairs whose chosen reward is higher, margin the mean difference.

Distillation: per target token, (1 - ratio) CE + ratio T^2 D(teacher || student at T), D the
forward KL or the Jensen-Shannon divergence (`token_divergence`); T^2 keeps the gradient's size
independent of the temperature (Hinton et al. 2015).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

PREFERENCE = ("dpo", "ipo", "simpo")


@dataclass(frozen=True)
class PreferenceOptions:
    kind: str = "dpo"
    beta: float = 0.1
    label_smoothing: float = 0.0  # dpo only: conservative DPO's eps
    simpo_gamma: float = 0.5  # simpo only: the target reward margin


def sequence_sums(token_values: Tensor, seq_ids: Tensor, n_seqs: int) -> Tensor:
    """Sum of per-token values [N] over each sequence: seq_ids [N] in 0..n_seqs-1, or -1 for
    tokens of no sequence (prompts, padding) -> [n_seqs] fp32."""
    keep = seq_ids >= 0
    out = torch.zeros(n_seqs, dtype=torch.float32, device=token_values.device)
    return out.index_add(0, torch.where(keep, seq_ids, 0), torch.where(keep, token_values, 0.0))


def preference_loss(
    policy_chosen: Tensor,
    policy_rejected: Tensor,
    ref_chosen: Tensor | None,
    ref_rejected: Tensor | None,
    opts: PreferenceOptions,
    chosen_len: Tensor | None = None,
    rejected_len: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Per-pair losses [P] and their rewards, from summed response log-probabilities [P] (the
    reference's are None for SimPO; SimPO needs the response lengths)."""
    beta = opts.beta
    if opts.kind == "simpo":
        if chosen_len is None or rejected_len is None:
            raise ValueError("simpo needs the response lengths")
        chosen = beta * policy_chosen / chosen_len
        rejected = beta * policy_rejected / rejected_len
        loss = -F.logsigmoid(chosen - rejected - opts.simpo_gamma)
    else:
        if ref_chosen is None or ref_rejected is None:
            raise ValueError(f"{opts.kind} needs the reference model's log-probabilities")
        chosen = beta * (policy_chosen - ref_chosen)
        rejected = beta * (policy_rejected - ref_rejected)
        h = (policy_chosen - ref_chosen) - (policy_rejected - ref_rejected)
        if opts.kind == "dpo":
            eps = opts.label_smoothing
            loss = -(1 - eps) * F.logsigmoid(beta * h) - eps * F.logsigmoid(-beta * h)
        elif opts.kind == "ipo":
            loss = (h - 1 / (2 * beta)) ** 2
        else:
            raise ValueError(f"unknown preference objective {opts.kind!r}; one of {PREFERENCE}")
    rewards = {
        "chosen_reward": chosen.detach(),
        "rejected_reward": rejected.detach(),
        "reward_accuracy": (chosen > rejected).float().detach(),
        "reward_margin": (chosen - rejected).detach(),
    }
    return loss, rewards


def distillation_loss(ce: Tensor, divergence: Tensor, ratio: float, temperature: float) -> Tensor:
    """Per-token mix of the cross-entropy [N] and the divergence [N] (both 0 on ignored
    tokens): (1 - ratio) CE + ratio T^2 D."""
    return (1 - ratio) * ce + ratio * temperature**2 * divergence
