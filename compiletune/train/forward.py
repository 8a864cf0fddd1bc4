"""The model's forward to hidden states, as the step, the evaluation and the objectives call it."""

from __future__ import annotations

import torch
from torch import Tensor

Batch = dict[str, Tensor]


def forward_hidden(
    model: torch.nn.Module,
    batch: Batch,
    doc_mask: bool,
    router_stats: list[Tensor] | None = None,
) -> Tensor:
    """Hidden states [b, s, d] of a batch; with `doc_mask` every packed example attends only to
    itself, with its positions restarting at 0 (as if it were alone in the row). MoE layers'
    router statistics go to `router_stats` when given."""
    if doc_mask:
        return model.hidden_states(
            batch["inputs"], batch["positions"], batch["doc_ids"], router_stats=router_stats
        )
    return model.hidden_states(batch["inputs"], router_stats=router_stats)
