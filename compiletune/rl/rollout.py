"""Sampling a group of completions per prompt with the model being trained (GRPO's rollout).

The G completions of one prompt are one batch: the prompt runs through the model once per row
(prefill into a KV cache of prompt + --max-new-tokens positions, `models/decoder.py` `KVCache`),
then every step feeds each row's newest token. With a compile backend (the run's, under
--compile) that decode step is one compiled graph with the cache length, the group and the
cache size as symbolic sizes: compiled once for the run, not once per length (a size of 1, as
after a 1-token prompt, specialises once more). Dynamo keeps the graphs with the step's code,
shared by every model of the process; past its cache limit (8) a new model's decode runs
eagerly. A row stops at a stop id (kept as its last token); the group stops when every row has. The weights are the trained ones as they are
(LoRA adapters live, no merged copy). Under FSDP every rank takes the same number of decode
steps (the ranks agree each step whether any row anywhere is still going), since each step's
forward gathers the sharded weights collectively.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

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


# model -> {backend: its compiled decode step}; entries go with their model
_DECODE: weakref.WeakKeyDictionary[Transformer, dict[Any, Callable[..., Tensor]]] = (
    weakref.WeakKeyDictionary()
)


def decode_step(model: Transformer, backend: Any) -> Callable[[Tensor, KVCache], Tensor]:
    """(tokens [b, 1], cache) -> the hidden state [b, d] of each row's new token, its key and
    value appended to `cache`: `model.hidden_states_cached` compiled with `backend` (a name or a
    dynamo backend) once per model, every size symbolic (dynamic=True), so new lengths, groups
    and cache sizes reuse the graph."""
    steps = _DECODE.setdefault(model, {})
    if backend not in steps:
        ref = weakref.ref(model)  # the compiled function must not keep the model alive

        def step(tokens: Tensor, cache: KVCache) -> Tensor:
            return ref().hidden_states_cached(tokens, cache)[:, -1]

        steps[backend] = torch.compile(step, backend=backend, dynamic=True)
    return steps[backend]


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
    compile_backend: Any = None,
) -> list[list[int]]:
    """`group` completions of `prompt` (token ids, each ending at its first stop id or after
    `max_new_tokens`). `any_going(mine)`: under FSDP, whether any rank still has a row going.
    `compile_backend`: decode through `decode_step` compiled with it; None: eagerly."""
    device = model.tok_embeddings.weight.device
    dtype = model.norm.weight.dtype
    cache = KVCache(model.args, group, len(prompt) + max_new_tokens, dtype, device)
    tokens = torch.tensor([prompt] * group, device=device)
    out: list[list[int]] = [[] for _ in range(group)]
    done = [False] * group
    decode = None if compile_backend is None else decode_step(model, compile_backend)
    with torch.compiler.set_stance("force_eager"):  # the training graphs stay out of it
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
            if decode is None:
                hidden = model.hidden_states_cached(chosen[:, None], cache)[:, -1]
                continue
            with torch.compiler.set_stance("default"):  # the decode step's own graph
                hidden = decode(chosen[:, None], cache)
    return out
