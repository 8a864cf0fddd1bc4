"""Sampling a group of completions per prompt with the model being trained (GRPO's rollout).

The G completions of one prompt are one batch: the prompt runs through the model once per row
(prefill into a KV cache of prompt + --max-new-tokens positions, `models/decoder.py` `KVCache`),
then every step feeds each row's newest token. A row stops at a stop id (kept as its last
token); the group stops when every row has. The weights are the trained ones as they are
(LoRA adapters live, no merged copy). Under FSDP every rank takes the same number of decode
steps (the ranks agree each step whether any row anywhere is still going), since each step's
forward gathers the sharded weights collectively.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from compiletune.models.cache import KVCache
from compiletune.models.decoder import Transformer


def sample_rows(
    logits: Tensor, temperature: float, top_p: float, generator: torch.Generator
) -> Tensor:
    """logits [n, v] -> one token per row [n] (greedy at temperature 0; else softmax at the
    temperature, restricted to the top-p nucleus, sampled with `generator`)."""
    if temperature == 0:
        return logits.argmax(dim=-1)
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    if top_p < 1.0:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        before = sorted_probs.cumsum(dim=-1) - sorted_probs
        sorted_probs = sorted_probs.masked_fill(before >= top_p, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
    # inverse-CDF sampling: one uniform number per row (drawing one per vocabulary entry, as
    # torch.multinomial's and the exponential race's CPU kernels do, is most of a decode step)
    cdf = probs.cumsum(dim=-1)
    u = torch.rand(probs.shape[0], 1, generator=generator, device=probs.device) * cdf[:, -1:]
    return torch.searchsorted(cdf, u, right=True).squeeze(-1).clamp_max(probs.shape[-1] - 1)


@torch.no_grad()
def sample_group(
    model: Transformer,
    prompt: list[int],
    group: int,
    max_new_tokens: int,
    temperature: float,
    top_p: float,
    stop_ids: set[int],
    generator: torch.Generator,
    any_going: Callable[[bool], bool] | None = None,
) -> list[list[int]]:
    """`group` completions of `prompt` (token ids, each ending at its first stop id or after
    `max_new_tokens`). `any_going(mine)`: under FSDP, whether any rank still has a row going."""
    device = model.tok_embeddings.weight.device
    dtype = model.norm.weight.dtype
    cache = KVCache(model.args, group, len(prompt) + max_new_tokens, dtype, device)
    tokens = torch.tensor([prompt] * group, device=device)
    out: list[list[int]] = [[] for _ in range(group)]
    done = [False] * group
    with torch.compiler.set_stance("force_eager"):
        hidden = model.hidden_states_cached(tokens, cache)[:, -1]
        for step in range(max_new_tokens):
            chosen = sample_rows(model.logits(hidden), temperature, top_p, generator)
            for i, t in enumerate(chosen.tolist()):
                if not done[i]:
                    out[i].append(t)
                    done[i] = t in stop_ids
            going = not all(done) and step + 1 < max_new_tokens
            if any_going is not None:
                going = any_going(going)
            if not going:
                break
            hidden = model.hidden_states_cached(chosen[:, None], cache)[:, -1]
    return out
