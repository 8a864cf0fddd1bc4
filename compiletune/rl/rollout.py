"""Sampling a group of completions per prompt with the model being trained (GRPO's rollout).

A batch of prompts, whatever their lengths, decodes as one batch (`sample_prompts`): each
prompt runs through the model once (prefill into its first row of a `models/cache.py`
`KVCache` of longest prompt + --max-new-tokens positions), its keys and values copied to the
G rows of its group; then every step feeds each row's newest token at that row's own position
(`KVCache.lengths`), attending over the whole static cache under a mask. Each prompt's rows
sample from that prompt's own stream, so its completions do not depend on the batch it is in.
With a compile backend (the run's, under --compile) the decode step is one compiled graph
with the rows and the cache's positions as symbolic sizes: compiled once for the run, not
once per batch or length. Dynamo keeps the graphs with the step's code, shared by every model
of the process; past its cache limit (8) a new model's decode runs eagerly. With
`cuda_graphs` the step is captured once per batch as a CUDA graph over that static cache and
replayed (`_GraphedStep`). A row stops at a stop id (kept as its last token); the batch stops
when every row has. The weights are the trained ones as they are (LoRA adapters live, no merged
copy). Under FSDP (the weights gathered whole for the rollout, train/grpo.py) every rank
takes the same number of decode steps: the ranks agree each step whether any row anywhere is
still going.
"""

from __future__ import annotations

import functools
import sys
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from compiletune.models.cache import KVCache
from compiletune.models.decoder import Transformer
from compiletune.torch_internals import dynamic_dims


def sample_rows(
    logits: Tensor,
    temperature: float,
    top_p: float,
    generators: torch.Generator | list[torch.Generator],
) -> Tensor:
    """logits [n, v] -> one token per row [n] (greedy at temperature 0; else softmax at the
    temperature, restricted to the top-p nucleus, sampled with `generators`: one, or one per
    equal run of consecutive rows, each drawing for its own rows only)."""
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
    if isinstance(generators, torch.Generator):
        generators = [generators]
    per, left = divmod(probs.shape[0], len(generators))
    if left:
        raise ValueError(f"{probs.shape[0]} rows do not split over {len(generators)} generators")
    u = (
        torch.cat([torch.rand(per, 1, generator=g, device=probs.device) for g in generators])
        * cdf[:, -1:]
    )
    return torch.searchsorted(cdf, u, right=True).squeeze(-1).clamp_max(probs.shape[-1] - 1)


# model -> {backend: its compiled decode step}; entries go with their model
_DECODE: weakref.WeakKeyDictionary[Transformer, dict[Any, Callable[..., Tensor]]] = (
    weakref.WeakKeyDictionary()
)


def decode_step(model: Transformer, backend: Any) -> Callable[[Tensor, KVCache], Tensor]:
    """(tokens [b, 1], cache) -> the hidden state [b, d] of each row's new token, its key and
    value written into `cache`: `model.hidden_states_cached` compiled with `backend` (a name or
    a dynamo backend) once per model, the rows and the cache's positions symbolic sizes from
    the first call, so new batches and cache sizes reuse the graph (heads and widths stay
    static; if the first batch's rows equal its positions, dynamo assumes they always do and
    compiles once more when they differ)."""
    steps = _DECODE.setdefault(model, {})
    if backend not in steps:
        ref = weakref.ref(model)  # the compiled function must not keep the model alive

        def step(tokens: Tensor, cache: KVCache) -> Tensor:
            return _eager_step(ref(), tokens, cache)

        compiled = torch.compile(step, backend=backend)

        def marked(tokens: Tensor, cache: KVCache) -> Tensor:
            dynamic_dims(tokens, (0,))
            for t, dims in cache.sized():
                dynamic_dims(t, dims)
            return compiled(tokens, cache)

        steps[backend] = marked
    return steps[backend]


class _GraphedStep:
    """The decode step as one CUDA graph over a rollout's static cache: captured once (after
    `WARM_STEPS` ordinary steps on a side stream), then replayed with each step's tokens copied
    into its input buffer. Everything it reads and writes (the cache's buffers, the per-row
    lengths, the tokens) keeps its storage between steps, which is what a replay needs. The
    output is the graph's own buffer, overwritten by the next replay: the caller reads it (the
    logits, the sampled tokens brought to the host) before the next call. A step that cannot be
    captured (one that copies from the host or waits on the GPU inside it: an uncompiled step's
    YaRN or longrope frequencies or QLoRA code table, a MoE's exact grouped-matmul fallback) is
    said once on stderr and run as it is for the rest of the process (`FAILED`)."""

    WARM_STEPS = 2
    FAILED: str | None = None  # why capture failed, once it has

    def __init__(self, step: Callable[[Tensor, KVCache], Tensor], cache: KVCache) -> None:
        self.step, self.cache, self.calls = step, cache, 0
        self.graph: Any = None
        self.tokens: Tensor | None = None
        self.out: Tensor | None = None

    def __call__(self, tokens: Tensor) -> Tensor:
        self.calls += 1
        if _GraphedStep.FAILED is not None:
            return self.step(tokens, self.cache)
        if self.calls <= self.WARM_STEPS:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                out = self.step(tokens, self.cache)
            torch.cuda.current_stream().wait_stream(side)
            return out
        if self.graph is None and not self._capture(tokens):
            return self.step(tokens, self.cache)
        assert self.tokens is not None and self.out is not None
        self.tokens.copy_(tokens)
        self.graph.replay()
        return self.out

    def _capture(self, tokens: Tensor) -> bool:
        """Record the step (capture runs nothing: the cache is as it was); False if it could
        not be captured."""
        self.tokens = tokens.clone()
        graph = torch.cuda.CUDAGraph()
        stream = torch.cuda.current_stream()
        try:
            with torch.cuda.graph(graph):
                self.out = self.step(self.tokens, self.cache)
        except Exception as e:  # noqa: BLE001 - any failure to capture: decode without graphs
            # a failed capture's exit raises before it gives the stream back: take it back, and
            # name the error that broke the capture, not the capture's end
            torch.cuda.set_stream(stream)
            cause = e.__context__ or e
            reason = (str(cause).strip().splitlines() or [type(cause).__name__])[0]
            _GraphedStep.FAILED = reason
            print(
                f"compiletune: --rollout-cuda-graphs: the decode step could not be captured "
                f"({reason}); decoding without CUDA graphs",
                file=sys.stderr,
            )
            return False
        self.graph = graph
        return True


@torch.no_grad()
def sample_prompts(
    model: Transformer,
    prompts: list[list[int]],
    group: int,
    max_new_tokens: int,
    temperature: float,
    top_p: float,
    stop_ids: set[int],
    generators: list[torch.Generator],
    any_going: Callable[[bool], bool] | None = None,
    compile_backend: Any = None,
    cuda_graphs: bool = False,
) -> list[list[int]]:
    """`group` completions of each of `prompts` (token ids; prompt-major order, each ending at
    its first stop id or after `max_new_tokens`), all decoded as one batch whatever their
    lengths. Each prompt is prefilled once, its cache copied to its group's rows; each decode
    step then writes every row's token at that row's own position in one static cache of
    (longest prompt + `max_new_tokens`) positions (`KVCache.lengths`). Prompt i's rows sample
    from `generators[i]` alone (one uniform number per row per step), so a prompt's
    completions do not depend on the prompts decoded beside it. `any_going(mine)`: under
    FSDP, whether any rank still has a row going. `compile_backend`: decode through
    `decode_step` compiled with it; None: eagerly. `cuda_graphs`: replay the decode step as
    a CUDA graph (`_GraphedStep`; a CUDA device)."""
    if len(generators) != len(prompts):
        raise ValueError(f"{len(prompts)} prompts need as many generators, not {len(generators)}")
    device = model.tok_embeddings.weight.device
    dtype = model.norm.weight.dtype
    n = len(prompts) * group
    cache = KVCache(model.args, n, max(map(len, prompts)) + max_new_tokens, dtype, device)
    out: list[list[int]] = [[] for _ in range(n)]
    done = [False] * n
    if compile_backend is None:
        decode = functools.partial(_eager_step, model)
    else:
        decode = decode_step(model, compile_backend)
    stance = "force_eager" if compile_backend is None else "default"
    with torch.compiler.set_stance("force_eager"):  # the training graphs stay out of it
        hidden = torch.empty(n, model.args.dim, dtype=dtype, device=device)
        for i, prompt in enumerate(prompts):  # each prompt once, then copied to its rows
            first = i * group
            ids = torch.tensor([prompt], device=device)
            hidden[first : first + group] = model.hidden_states_cached(
                ids, cache.rows(first, first + 1)
            )[:, -1]
            cache.spread(first, group)
        lengths = [len(p) for p in prompts for _ in range(group)]
        cache.lengths = torch.tensor(lengths, device=device)
        step_fn: Callable[[Tensor], Tensor] = (
            _GraphedStep(decode, cache) if cuda_graphs else functools.partial(decode, cache=cache)
        )
        for step in range(max_new_tokens):
            chosen = sample_rows(model.logits(hidden), temperature, top_p, generators)
            for i, t in enumerate(chosen.tolist()):
                if not done[i]:
                    out[i].append(t)
                    done[i] = t in stop_ids
            going = not all(done) and step + 1 < max_new_tokens
            if any_going is not None:
                going = any_going(going)
            if not going:
                break
            with torch.compiler.set_stance(stance):  # the decode step's own graph, if any
                hidden = step_fn(chosen[:, None])
    return out


def _eager_step(model: Transformer, tokens: Tensor, cache: KVCache) -> Tensor:
    """The decode step, uncompiled."""
    return model.hidden_states_cached(tokens, cache)[:, -1]


def sample_group(
    model: Transformer,
    prompt: list[int],
    group: int,
    max_new_tokens: int,
    temperature: float,
    top_p: float,
    stop_ids: set[int],
    generator: torch.Generator,
    compile_backend: Any = None,
) -> list[list[int]]:
    """`group` completions of one prompt: `sample_prompts` of [prompt]."""
    return sample_prompts(
        model, [prompt], group, max_new_tokens, temperature, top_p, stop_ids, [generator],
        compile_backend=compile_backend,
    )  # fmt: skip
