"""The chunked log-probability and divergence ops, and the DPO / IPO / SimPO / KD objectives,
against plain fp64 implementations with full logits written here from the papers' formulas."""

from __future__ import annotations

import pytest
import torch

from compiletune.loss.objectives import (
    PreferenceOptions,
    distillation_loss,
    preference_loss,
    sequence_sums,
)
from compiletune.ops.fused_logprobs import token_divergence, token_logprobs

IGNORE = -100
V, D, DT = 37, 16, 24


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def pairs(seed: int = 0):
    """4 pairs packed in one row each for chosen and rejected: prompts of different lengths
    (ignored), responses of different lengths, and padding (ignored)."""
    g = torch.Generator().manual_seed(seed)
    prompt_lens, chosen_lens, rejected_lens = [3, 7, 1, 5], [4, 2, 6, 3], [5, 3, 2, 6]
    rows, targets, seq_ids = [], [], []
    for i, (p, c, r) in enumerate(zip(prompt_lens, chosen_lens, rejected_lens, strict=True)):
        for resp, offset in ((c, 0), (r, 4)):
            n = p + resp + 2  # two padding tokens
            t = torch.randint(0, V, (n,), generator=g)
            t[:p] = IGNORE
            t[p + resp :] = IGNORE
            ids = torch.full((n,), -1)
            ids[p : p + resp] = i + offset
            targets.append(t)
            seq_ids.append(ids)
            rows.append(n)
    n = sum(rows)
    h = torch.randn(n, D, generator=g, dtype=torch.float64)
    w = torch.randn(V, D, generator=g, dtype=torch.float64) * 0.5
    lens = torch.tensor(chosen_lens + rejected_lens, dtype=torch.float64)
    return h, w, torch.cat(targets), torch.cat(seq_ids), lens


def reference_logprobs(h, w, targets, softcap=0.0):
    logits = h @ w.t()
    if softcap:
        logits = softcap * torch.tanh(logits / softcap)
    logp = torch.log_softmax(logits, dim=-1)
    live = targets != IGNORE
    picked = logp.gather(1, torch.where(live, targets, 0)[:, None]).squeeze(1)
    return torch.where(live, picked, 0.0)


@pytest.mark.parametrize("softcap", [0.0, 3.0])
@pytest.mark.parametrize("chunk", [5, 0])
def test_token_logprobs_and_gradients_equal_full_logits(softcap, chunk):
    h, w, targets, _, _ = pairs()
    h32, w32 = h.float().requires_grad_(), w.float().requires_grad_()
    got = token_logprobs(h32, w32, targets, chunk_size=chunk, softcap=softcap)
    hr, wr = h.clone().requires_grad_(), w.clone().requires_grad_()
    want = reference_logprobs(hr, wr, targets, softcap)
    assert rel(got, want) <= 1e-5 and torch.all(got[targets == IGNORE] == 0)
    up = torch.randn(got.shape, dtype=torch.float64)
    (got * up.float()).sum().backward()
    (want * up).sum().backward()
    assert rel(h32.grad, hr.grad) <= 1e-5 and rel(w32.grad, wr.grad) <= 1e-5


def reference_preference(kind, pc, pr, rc, rr, beta, eps, gamma, lc, lr):
    """The papers' formulas, in fp64."""
    if kind == "dpo":
        z = beta * ((pc - rc) - (pr - rr))
        return -(1 - eps) * torch.log(torch.sigmoid(z)) - eps * torch.log(torch.sigmoid(-z))
    if kind == "ipo":
        return (((pc - rc) - (pr - rr)) - 1 / (2 * beta)) ** 2
    return -torch.log(torch.sigmoid(beta * pc / lc - beta * pr / lr - gamma))


@pytest.mark.parametrize("kind, eps", [("dpo", 0.0), ("dpo", 0.1), ("ipo", 0.0), ("simpo", 0.0)])
def test_preference_losses_and_gradients_equal_the_formulas(kind, eps):
    h, w, targets, seq_ids, lens = pairs(1)
    ref_w = w + 0.1 * torch.randn(
        w.shape, generator=torch.Generator().manual_seed(9), dtype=w.dtype
    )
    opts = PreferenceOptions(kind, beta=0.7, label_smoothing=eps, simpo_gamma=0.3)
    # ours: chunked op in fp32
    h32, w32 = h.float().requires_grad_(), w.float().requires_grad_()
    seqs = sequence_sums(token_logprobs(h32, w32, targets, chunk_size=7), seq_ids, 8)
    with torch.no_grad():
        ref = sequence_sums(token_logprobs(h.float(), ref_w.float(), targets), seq_ids, 8)
    refs = (None, None) if kind == "simpo" else (ref[:4], ref[4:])
    loss, rewards = preference_loss(
        seqs[:4], seqs[4:], *refs, opts, lens[:4].float(), lens[4:].float()
    )
    loss.sum().backward()
    # reference: full logits, fp64
    hr, wr = h.clone().requires_grad_(), w.clone().requires_grad_()
    lp = reference_logprobs(hr, wr, targets)
    pol = torch.stack([lp[seq_ids == i].sum() for i in range(8)])
    rlp = reference_logprobs(h, ref_w, targets)
    rf = torch.stack([rlp[seq_ids == i].sum() for i in range(8)])
    want = reference_preference(
        kind, pol[:4], pol[4:], rf[:4], rf[4:], 0.7, eps, 0.3, lens[:4], lens[4:]
    )
    want.sum().backward()
    assert rel(loss, want) <= 1e-5, (loss, want)
    assert rel(h32.grad, hr.grad) <= 1e-5 and rel(w32.grad, wr.grad) <= 1e-5
    chosen = 0.7 * (pol[:4] / lens[:4] if kind == "simpo" else pol[:4] - rf[:4])
    assert rel(rewards["chosen_reward"], chosen) <= 1e-5
    rejected = 0.7 * (pol[4:] / lens[4:] if kind == "simpo" else pol[4:] - rf[4:])
    assert torch.equal(rewards["reward_accuracy"], (chosen > rejected).float())


def reference_divergence(hs, ws, ht, wt, mask, temperature, kind):
    log_s = torch.log_softmax(hs @ ws.t() / temperature, -1)
    log_t = torch.log_softmax(ht @ wt.t() / temperature, -1)
    if kind == "forward_kl":
        div = (log_t.exp() * (log_t - log_s)).sum(-1)
    else:
        m = 0.5 * (log_s.exp() + log_t.exp())
        div = 0.5 * (log_t.exp() * (log_t - m.log())).sum(-1) + 0.5 * (
            log_s.exp() * (log_s - m.log())
        ).sum(-1)
    return torch.where(mask, div, 0.0)


@pytest.mark.parametrize("kind", ["forward_kl", "jsd"])
@pytest.mark.parametrize("temperature", [1.0, 2.5])
def test_token_divergence_and_kd_loss_equal_full_logits(kind, temperature):
    h, w, targets, _, _ = pairs(2)
    g = torch.Generator().manual_seed(4)
    ht = torch.randn(h.shape[0], DT, generator=g, dtype=torch.float64)  # a wider teacher
    wt = torch.randn(V, DT, generator=g, dtype=torch.float64) * 0.5
    mask = targets != IGNORE
    h32, w32 = h.float().requires_grad_(), w.float().requires_grad_()
    div = token_divergence(
        h32, w32, ht.float(), wt.float(), mask, temperature=temperature, kind=kind, chunk_size=6
    )
    ce = -token_logprobs(h32, w32, targets, chunk_size=6)
    loss = distillation_loss(ce, div, 0.6, temperature).sum() / mask.sum()
    loss.backward()
    hr, wr = h.clone().requires_grad_(), w.clone().requires_grad_()
    want_div = reference_divergence(hr, wr, ht, wt, mask, temperature, kind)
    want_ce = -reference_logprobs(hr, wr, targets)
    want = (0.4 * want_ce + 0.6 * temperature**2 * want_div).sum() / mask.sum()
    want.backward()
    assert rel(div, want_div) <= 1e-5 and rel(loss, want) <= 1e-5
    assert rel(h32.grad, hr.grad) <= 1e-5 and rel(w32.grad, wr.grad) <= 1e-5
    assert torch.all(div[~mask] == 0) and torch.all(div[mask] > 0)


def test_divergence_refuses_a_vocabulary_mismatch():
    h, w = torch.randn(3, D), torch.randn(V, D)
    with pytest.raises(ValueError, match=f"teacher vocabulary {V + 1} != student vocabulary {V}"):
        token_divergence(
            h, w, torch.randn(3, DT), torch.randn(V + 1, DT), torch.ones(3, dtype=torch.bool)
        )


def test_ops_pass_opcheck():
    h, w, targets, _, _ = pairs(3)
    h, w = h.float(), w.float()
    torch.library.opcheck(
        torch.ops.compiletune.token_logprobs.default, (h, w, targets, IGNORE, 4, 0.0)
    )
    mask = targets != IGNORE
    args = (h, w, torch.randn(h.shape[0], DT), torch.randn(V, DT), mask, 2.0, "jsd", 4, 0.0)
    torch.library.opcheck(torch.ops.compiletune.token_divergence.default, args)
