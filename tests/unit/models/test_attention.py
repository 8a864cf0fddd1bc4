"""The attention op against a brute-force masked reference: windows, documents, soft-caps, grads."""

from __future__ import annotations

import warnings

import pytest
import torch

from compiletune.models import attention as attn
from compiletune.models.attention import causal_attention


def reference(q, k, v, scale, doc_ids, window, softcap, sinks=None):
    """Dense [s, s] scores and mask: what the op must equal (with `sinks` [h], transformers'
    eager gpt-oss formula: the sink as one more logit per row, its share dropped)."""
    s = q.shape[2]
    i = torch.arange(s, device=q.device)[:, None]
    j = torch.arange(s, device=q.device)[None, :]
    mask = (j <= i)[None]  # [1, s, s]
    if window:
        mask = mask & (i - j < window)[None]
    if doc_ids is not None:
        mask = mask & (doc_ids[:, :, None] == doc_ids[:, None, :])  # [b, s, s]
    scores = (q.double() @ k.double().transpose(-1, -2)) * scale
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    scores = scores.masked_fill(~mask[:, None], float("-inf"))
    if sinks is not None:
        sink = sinks.double().reshape(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
        return (torch.cat([scores, sink], -1).softmax(-1)[..., :-1] @ v.double()).to(q.dtype)
    return (scores.softmax(-1) @ v.double()).to(q.dtype)


def doc_ids_for(lengths_per_row):
    return torch.stack(
        [
            torch.cat([torch.full((n,), d, dtype=torch.int32) for d, n in enumerate(lengths)])
            for lengths in lengths_per_row
        ]
    )


@pytest.mark.parametrize(
    "window, softcap, docs",
    [
        (40, 0.0, None),  # windowed, several query chunks
        (40, 0.0, [[300, 20, 280], [600]]),  # window within documents
        (0, 4.0, None),  # soft-capped, full causal
        (40, 4.0, [[50, 500, 50], [1, 599]]),  # all three
        (0, 0.0, [[100, 500], [600]]),  # documents alone
    ],
)
def test_matches_brute_force_with_grads(monkeypatch, window, softcap, docs):
    # small chunks and tiles so a 600-token row spans many of them
    monkeypatch.setattr(attn, "_CHUNK", 128)
    monkeypatch.setattr(attn, "_TILE", 64)
    g = torch.Generator().manual_seed(0)
    b, h, s, hd = 2, 3, 600, 16
    q, k, v = (torch.randn(b, h, s, hd, generator=g, requires_grad=True) for _ in range(3))
    doc_ids = doc_ids_for(docs) if docs else None
    grad = torch.randn(b, h, s, hd, generator=g)
    out = causal_attention(q, k, v, 0.3, doc_ids, window, softcap)
    got = [out, *torch.autograd.grad(out, (q, k, v), grad)]
    ref = reference(q, k, v, 0.3, doc_ids, window, softcap)
    want = [ref, *torch.autograd.grad(ref, (q, k, v), grad)]
    for a, w in zip(got, want, strict=True):
        torch.testing.assert_close(a, w, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(
    "window, softcap, docs",
    [
        (0, 0.0, None),  # sinks alone (plain causal otherwise)
        (40, 0.0, [[300, 20, 280], [600]]),  # gpt-oss: windows, and documents
        (40, 4.0, [[50, 500, 50], [1, 599]]),  # with a soft-cap too
    ],
)
def test_sinks_match_the_eager_formula_with_grads(monkeypatch, window, softcap, docs):
    """Attention sinks (gpt-oss): outputs and the gradients of q, k, v and the sinks."""
    monkeypatch.setattr(attn, "_TILE", 64)
    g = torch.Generator().manual_seed(0)
    b, h, s, hd = 2, 3, 600, 16
    q, k, v = (torch.randn(b, h, s, hd, generator=g, requires_grad=True) for _ in range(3))
    sinks = torch.randn(h, generator=g).requires_grad_()
    doc_ids = doc_ids_for(docs) if docs else None
    grad = torch.randn(b, h, s, hd, generator=g)
    out = causal_attention(q, k, v, 0.3, doc_ids, window, softcap, sinks=sinks)
    got = [out, *torch.autograd.grad(out, (q, k, v, sinks), grad)]
    ref = reference(q, k, v, 0.3, doc_ids, window, softcap, sinks)
    want = [ref, *torch.autograd.grad(ref, (q, k, v, sinks), grad)]
    for a, w in zip(got, want, strict=True):
        torch.testing.assert_close(a, w, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("window, docs", [(0, None), (40, [[300, 20, 280], [600]])])
def test_sinks_through_flexattention_forward(monkeypatch, window, docs):
    """The FlexAttention form of sinks (CUDA's: the block mask's output times
    sigmoid(lse - sink)) equals the eager formula. FlexAttention runs on a CPU only eagerly
    and without gradients; the gradients are tests/gpu's."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    monkeypatch.setattr(attn, "_flex_functions", lambda: (flex_attention, create_block_mask))
    g = torch.Generator().manual_seed(0)
    b, h, s, hd = 2, 3, 600, 16
    q, k, v = (torch.randn(b, h, s, hd, generator=g) for _ in range(3))
    sinks = torch.randn(h, generator=g)
    doc_ids = doc_ids_for(docs) if docs else None
    mask = attn.flex_block_mask(doc_ids, window, b, s, q.device)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # eager FlexAttention's "use torch.compile" warning
        out = causal_attention(q, k, v, 0.3, mask, window, sinks=sinks)
    ref = reference(q, k, v, 0.3, doc_ids, window, 0.0, sinks)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)


def test_values_of_another_width_than_keys(monkeypatch):
    """MLA's values are narrower than its queries and keys: every path keeps their width."""
    monkeypatch.setattr(attn, "_TILE", 64)
    g = torch.Generator().manual_seed(0)
    q, k = (torch.randn(2, 3, 300, 24, generator=g, requires_grad=True) for _ in range(2))
    v = torch.randn(2, 3, 300, 16, generator=g, requires_grad=True)
    doc_ids = doc_ids_for([[100, 200], [300]])
    for window, softcap in ((0, 0.0), (40, 0.0), (0, 4.0)):
        out = causal_attention(q, k, v, 0.3, doc_ids, window, softcap)
        ref = reference(q, k, v, 0.3, doc_ids, window, softcap)
        assert out.shape == (2, 3, 300, 16)
        grads = torch.autograd.grad(out.sum(), (q, k, v))
        want = torch.autograd.grad(ref.sum(), (q, k, v))
        for a, w in zip((out, *grads), (ref, *want), strict=True):
            torch.testing.assert_close(a, w, rtol=1e-4, atol=1e-5)


def test_softcap_never_holds_more_than_a_tile_of_scores(monkeypatch):
    """The soft-capped kernel's largest temporary is one [b, h, tile, tile] block, not [s, s]."""
    monkeypatch.setattr(attn, "_TILE", 32)
    seen: list[tuple[int, ...]] = []
    real = attn._tile_scores

    def spy(*a, **kw):
        scores, t = real(*a, **kw)
        seen.append(tuple(scores.shape))
        return scores, t

    monkeypatch.setattr(attn, "_tile_scores", spy)
    q, k, v = (torch.randn(1, 2, 256, 8, requires_grad=True) for _ in range(3))
    causal_attention(q, k, v, 0.5, None, 0, 3.0).sum().backward()
    assert seen and max(s[-1] * s[-2] for s in seen) == 32 * 32


@pytest.mark.parametrize("window, softcap", [(24, 0.0), (0, 3.0)])
def test_opcheck_with_transposed_inputs(window, softcap):
    """Fake and real kernels agree on shapes and strides (inductor asserts them), including for
    the [b, s, h, hd] -> [b, h, s, hd] views the model passes."""
    q, k, v = (torch.randn(2, 64, 3, 8).transpose(1, 2).requires_grad_() for _ in range(3))
    doc_ids = doc_ids_for([[20, 44], [64]])
    torch.library.opcheck(attn.attention_op, (q, k, v, doc_ids, 0.4, window, softcap))
    torch.library.opcheck(attn.attention_op, (q, k, v, doc_ids, 0.4, window, softcap, True))


def test_backend_choice(monkeypatch):
    """Segments on CPU, FlexAttention on CUDA; the environment forces either, and says what it
    accepts when it is wrong."""
    monkeypatch.delenv(attn.BACKEND_ENV, raising=False)
    assert attn.attention_backend(torch.device("cpu")) == "segments"
    assert attn.attention_backend(torch.device("cuda")) == (
        "flex" if attn._HAS_FLEX else "segments"
    )
    monkeypatch.setenv(attn.BACKEND_ENV, "flex")
    assert attn.attention_backend(torch.device("cpu")) == "flex"
    monkeypatch.setenv(attn.BACKEND_ENV, "sdpa")
    with pytest.raises(ValueError, match="flex or segments"):
        attn.attention_backend(torch.device("cpu"))


@pytest.mark.skipif(not attn._HAS_FLEX, reason="this torch has no FlexAttention")
@pytest.mark.parametrize(
    "window, softcap, docs",
    [(40, 4.0, [[50, 200, 50], [1, 299]]), (0, 0.0, [[100, 200], [300]])],
)
def test_flex_forward_matches_brute_force(monkeypatch, window, softcap, docs):
    """The GPU path's mask and score modifier, run where FlexAttention runs without a GPU
    (forward only: it has no CPU backward; the GPU check covers gradients)."""
    monkeypatch.setenv(attn.BACKEND_ENV, "flex")
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, 300, 16, generator=g) for _ in range(3))
    doc_ids = doc_ids_for(docs)
    got = causal_attention(q, k, v, 0.3, doc_ids, window, softcap)
    want = reference(q, k, v, 0.3, doc_ids, window, softcap)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


@pytest.mark.skipif(not attn._HAS_FLEX, reason="this torch has no FlexAttention")
def test_flex_stays_compiled_under_a_force_eager_stance(monkeypatch):
    """A reference or teacher pass runs under set_stance("force_eager"): FlexAttention must
    still run compiled there (eagerly it builds the whole [b, h, s, s] score matrix)."""
    monkeypatch.setenv(attn.BACKEND_ENV, "flex")
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 256, 16, generator=g) for _ in range(3))
    doc_ids = doc_ids_for([[100, 156]])
    with warnings.catch_warnings(), torch.compiler.set_stance("force_eager"):
        warnings.filterwarnings("error", message=".*without torch.compile.*")
        got = causal_attention(q, k, v, 0.25, doc_ids, 0, 0.0)
    torch.testing.assert_close(got, reference(q, k, v, 0.25, doc_ids, 0, 0.0), rtol=1e-4, atol=1e-5)
