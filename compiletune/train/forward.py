"""The model's forward to hidden states, as the step, the evaluation and the objectives call it."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import Tensor

from compiletune.models.attention import cu_seqlens
from compiletune.models.seq_parallel import SeqShards
from compiletune.torch_internals import host_array, host_tensor, is_fake

Batch = dict[str, Any]  # tensors, and `documents` (cu_seqlens, max_seqlen)
# what a --cp rank keeps only its piece of; the rest (documents, pairs, sequence ids) stays
# whole: attention and the pairs' sums need the whole row
PER_TOKEN = ("inputs", "targets", "positions")
# a vision batch's images (`ImageInputs`) and the row of each (compiletune/data/image_batch.py)
IMAGE_KEYS = ("images", "image_rows")


def local_batch(batch: Batch, rows: slice, seq: SeqShards | None, device: torch.device) -> Batch:
    """This rank's part of a global batch on `device`: its rows, and under --cp its piece of
    each row's tokens."""
    out = {}
    ids = batch.get("doc_ids")
    if ids is not None and ids.device.type == "cpu" and not is_fake(ids):
        # the documents' cumulative lengths, from the host's copy of the rows: the step then
        # never reads the device to find them (varlen attention, models/attention.py)
        cu, max_seqlen = cu_seqlens(host_array(ids)[rows])
        out["documents"] = (cu.to(device, non_blocking=True), max_seqlen)
    for k, v in batch.items():
        if k in IMAGE_KEYS:
            continue
        v = v[rows]
        if seq is not None and k in PER_TOKEN:
            v = seq.piece(v)
        out[k] = v.to(device, non_blocking=True)
    images = batch.get("images")
    if images is not None:  # the images of this part's rows (models/vision/inputs.py)
        # on the host's copy (also under the estimate's fake mode, where nonzero has no shape)
        mine = np.arange(batch["inputs"].shape[0])[rows]
        picked = host_tensor(np.isin(host_array(batch["image_rows"]), mine).nonzero()[0])
        images = images.select(picked)
        if images is not None:
            out["images"] = images.to(device)
    return out


def forward_hidden(
    model: torch.nn.Module,
    batch: Batch,
    doc_mask: bool,
    router_stats: list[Tensor] | None = None,
) -> Tensor:
    """Hidden states [b, s, d] of a batch; with `doc_mask` every packed example attends only to
    itself, with its positions restarting at 0 (as if it were alone in the row). MoE layers'
    router statistics go to `router_stats` when given. A vision batch's `images` go to the
    model's tower."""
    # only when there are images: a text model's hidden_states may be a wrapper's without them
    images = {"images": batch["images"]} if batch.get("images") is not None else {}
    if doc_mask:
        return model.hidden_states(
            batch["inputs"],
            batch["positions"],
            batch["doc_ids"],
            router_stats=router_stats,
            documents=batch.get("documents"),
            **images,
        )
    return model.hidden_states(batch["inputs"], router_stats=router_stats, **images)
