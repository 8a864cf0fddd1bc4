"""One DPO step and one KD step on a 128k-vocabulary model: the chunked head ops against a
plain head with full logits, side by side in one run.

    python bench/objectives.py                  # CPU: debug_128k (4 layers, d 256), fp32
    python bench/objectives.py --tokens 4096    # GPU: bf16 by default

    dpo  fused   policy and reference response log-probabilities through
                 compiletune::token_logprobs (chunks of tokens; no [tokens, vocab] tensor)
    dpo  plain   log_softmax(h W^T) in fp32, gather: the [tokens, vocab] logits and their fp32
                 log-softmax exist for the policy (kept for backward) and the reference
    kd   fused   compiletune::token_divergence + token_logprobs: student and teacher logits a
                 chunk at a time
    kd   plain   both models' full logits, log_softmax, KL(teacher || student) and CE

Both steps run forward + backward of the policy / student (the blocks the same in both
variants; only the head differs), with a frozen reference (the same model, adapters-off
stand-in: a second copy here) or a frozen 2x deeper teacher. Time: median of --iters steps
after a warm-up; peak: what one step allocates above the weights (GPU: max_memory_allocated;
CPU: torch.profiler allocator events). Results: bench/results/objectives-<device>.json.
"""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # noqa: E402
    device_name,
    median_ms,
    peak_bytes,
    result_header,
    write_result,
)

from compiletune.loss.objectives import (  # noqa: E402
    PreferenceOptions,
    distillation_loss,
    preference_loss,
    sequence_sums,
)
from compiletune.models import build_model, from_name  # noqa: E402
from compiletune.ops.fused_logprobs import token_divergence, token_logprobs  # noqa: E402

IGNORE = -100


def plain_logprobs(h, w, targets):
    logp = torch.log_softmax((h @ w.t()).float(), dim=-1)
    live = targets != IGNORE
    return torch.where(live, logp.gather(1, torch.where(live, targets, 0)[:, None])[:, 0], 0.0)


def plain_divergence(hs, ws, ht, wt, mask, t):
    log_s = torch.log_softmax((hs @ ws.t()).float() / t, -1)
    log_t = torch.log_softmax((ht @ wt.t()).float() / t, -1)
    return torch.where(mask, (log_t.exp() * (log_t - log_s)).sum(-1), 0.0)


def batch(rows: int, seq: int, vocab: int, device) -> dict[str, torch.Tensor]:
    """Rows of 8 sequences (4 pairs) each: the first 3/8 of a sequence is prompt (no targets),
    the rest response; sequence ids 2k (chosen) and 2k + 1 (rejected)."""
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, vocab, (rows, seq), generator=g)
    length = seq // 8
    prompt = length * 3 // 8
    seq_ids = torch.full((rows, seq), -1)
    targets = tokens.clone()
    for r in range(rows):
        for s in range(8):
            a = s * length
            targets[r, a : a + prompt] = IGNORE
            seq_ids[r, a + prompt : a + length] = r * 8 + s
    out = {"inputs": tokens, "targets": targets, "seq_ids": seq_ids}
    return {k: v.to(device) for k, v in out.items()}


def dpo_step(policy, reference, b, fused: bool) -> None:
    n_seq = int(b["seq_ids"].max()) + 1
    ids, targets = b["seq_ids"].flatten(), b["targets"].flatten()

    def sums(model, h):
        w = model.output.weight
        lp = token_logprobs(h, w, targets) if fused else plain_logprobs(h, w, targets)
        return sequence_sums(lp, ids, n_seq)

    with torch.no_grad():
        ref = sums(reference, reference.hidden_states(b["inputs"]).flatten(0, 1))
    pol = sums(policy, policy.hidden_states(b["inputs"]).flatten(0, 1))
    loss, _ = preference_loss(pol[0::2], pol[1::2], ref[0::2], ref[1::2], PreferenceOptions())
    loss.sum().backward()


def kd_step(student, teacher, b, fused: bool) -> None:
    targets = b["targets"].flatten()
    mask = targets != IGNORE
    with torch.no_grad():
        ht = teacher.hidden_states(b["inputs"]).flatten(0, 1)
    hs = student.hidden_states(b["inputs"]).flatten(0, 1)
    ws, wt = student.output.weight, teacher.output.weight
    if fused:
        div = token_divergence(hs, ws, ht, wt, mask, temperature=2.0)
        ce = -token_logprobs(hs, ws, targets)
    else:
        div = plain_divergence(hs, ws, ht, wt, mask, 2.0)
        ce = -plain_logprobs(hs, ws, targets)
    (distillation_loss(ce, div, 0.5, 2.0).sum() / mask.sum()).backward()


def measure(name: str, step, device, iters: int) -> dict[str, Any]:
    return {
        "variant": name,
        "ms": median_ms(step, device, iters),
        "peak_mib": round(peak_bytes(step, device) / 2**20, 1),
    }


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", default="debug_128k")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=None, help="per step (rows of --seq)")
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    tokens = a.tokens or (1024 if device.type == "cpu" else 8192)
    args = from_name(a.model)
    args.n_layers = a.layers
    policy = build_model(args, device=device, dtype=dtype, seed=0)
    reference = copy.deepcopy(policy).requires_grad_(False)
    teacher_args = from_name(a.model)
    teacher_args.n_layers = 2 * a.layers
    teacher = build_model(teacher_args, device=device, dtype=dtype, seed=1).requires_grad_(False)
    b = batch(max(1, tokens // a.seq), a.seq, args.vocab_size, device)

    def run(step, model, other, fused):
        def one() -> None:
            step(model, other, b, fused)
            model.zero_grad(set_to_none=True)

        return one

    rows = [
        measure("dpo fused", run(dpo_step, policy, reference, True), device, a.iters),
        measure("dpo plain", run(dpo_step, policy, reference, False), device, a.iters),
        measure("kd fused", run(kd_step, policy, teacher, True), device, a.iters),
        measure("kd plain", run(kd_step, policy, teacher, False), device, a.iters),
    ]
    print(f"{a.model} ({a.layers} layers; teacher {2 * a.layers}), {tokens} tokens, {dtype}")
    print("| step | head | ms | vs plain | peak MiB | vs plain |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        base = next(x for x in rows if x["variant"] == r["variant"].split()[0] + " plain")
        kind, head = r["variant"].split()
        print(
            f"| {kind} | {head} | {r['ms']} | {r['ms'] / base['ms']:.2f}x | {r['peak_mib']} | "
            f"{r['peak_mib'] / base['peak_mib']:.2f}x |"
        )
    out = (
        Path(a.out)
        if a.out
        else Path(__file__).parent / "results" / f"objectives-{device_name()}.json"
    )
    shape = {"model": a.model, "layers": a.layers, "tokens": tokens, "seq": a.seq}
    write_result(out, {**result_header(), "dtype": str(dtype), "shape": shape, "rows": rows})


if __name__ == "__main__":
    main()
