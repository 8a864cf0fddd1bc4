"""GRPO's rollout: G sampled completions of one prompt, compiletune's sampler (rl/rollout.py, the
model's own KV cache) against transformers' `generate` on the same weights, side by side.

    python bench/rollout.py                          # CPU: fp32, a 8-layer 512-wide Llama
    python bench/rollout.py --dim 2048 --layers 16   # GPU: bf16 by default

Both sample `--group` completions of a `--prompt`-token prompt for exactly `--new` tokens (no
stop token: the same work on both sides), at temperature 1. Time: median of --iters rounds after
one warm-up (which compiles), the variants taking turns. tokens/s = group x new / time.
Results: bench/results/rollout-<device>.json and a markdown table.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import device_name, result_header, write_result  # noqa: E402

from compiletune.models import ModelArgs, build_model, save_hf  # noqa: E402
from compiletune.rl.rollout import sample_group  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--dim", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument(
        "--backend",
        default="inductor",
        help="the compiled decode step's backend (what --compile gives a GRPO run)",
    )
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    import transformers

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    args = ModelArgs(
        dim=a.dim,
        n_layers=a.layers,
        n_heads=a.dim // 64,
        n_kv_heads=max(1, a.dim // 256),
        vocab_size=a.vocab,
        ffn_dim=a.dim * 3,
        max_seq_len=a.prompt + a.new + 8,
    )
    ours = build_model(args, device=device, dtype=dtype, seed=0).eval()
    with tempfile.TemporaryDirectory() as tmp:
        save_hf(ours, tmp)
        hf = transformers.AutoModelForCausalLM.from_pretrained(tmp, dtype=dtype).to(device).eval()
    prompt = torch.randint(0, a.vocab, (a.prompt,), generator=torch.Generator().manual_seed(1))

    def run_ours(backend: str | None = None) -> None:
        g = torch.Generator(device=device).manual_seed(0)
        out = sample_group(
            ours, prompt.tolist(), a.group, a.new, 1.0, 1.0, set(), g, compile_backend=backend
        )
        assert all(len(c) == a.new for c in out)

    def run_hf() -> None:
        with torch.no_grad():
            out = hf.generate(
                prompt[None].to(device),
                attention_mask=torch.ones(1, a.prompt, dtype=torch.long, device=device),
                do_sample=True,
                temperature=1.0,
                top_p=1.0,
                top_k=0,
                num_return_sequences=a.group,
                max_new_tokens=a.new,
                min_new_tokens=a.new,
                pad_token_id=0,
            )
        assert out.shape == (a.group, a.prompt + a.new)

    variants = {
        "compiletune": run_ours,
        "transformers generate": run_hf,
        f"compiletune, decode compiled ({a.backend})": lambda: run_ours(a.backend),
    }
    times: dict[str, list[float]] = {k: [] for k in variants}
    for i in range(a.iters + 1):
        for name, fn in variants.items():
            if device.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            fn()
            if device.type == "cuda":
                torch.cuda.synchronize()
            if i:  # the first round warms up
                times[name].append(time.perf_counter() - t0)
    rows = []
    for name, ts in times.items():
        t = statistics.median(ts)
        rows.append({"variant": name, "s": round(t, 4), "tokens_per_s": round(a.group * a.new / t)})
    base = rows[1]["tokens_per_s"]
    print(
        f"rollout: {a.group} completions x {a.new} new tokens after a {a.prompt}-token prompt, "
        f"d {a.dim}, {a.layers} layers, vocab {a.vocab}, {dtype}, {device_name()}"
    )
    print("| variant | s | tokens/s | vs transformers |")
    print("|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['variant']} | {r['s']} | {r['tokens_per_s']} | {r['tokens_per_s'] / base:.2f}x |"
        )
    out = (
        Path(a.out)
        if a.out
        else Path(__file__).parent / "results" / f"rollout-{device_name()}.json"
    )
    shape = {k: getattr(a, k) for k in ("dim", "layers", "vocab", "group", "prompt", "new")}
    write_result(out, {**result_header(), "dtype": str(dtype), "shape": shape, "rows": rows})


if __name__ == "__main__":
    main()
