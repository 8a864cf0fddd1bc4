"""GRPO's rollout: G sampled completions of each of P prompts, compiletune's sampler
(rl/rollout.py, the model's own static KV cache) against transformers' `generate` on the same
weights, side by side.

    python bench/rollout.py                          # CPU: fp32, a 8-layer 512-wide Llama
    python bench/rollout.py --dim 2048 --layers 16 --prompts 4   # GPU: bf16 by default

Both sample `--group` completions of each of `--prompts` prompts for exactly `--new` tokens (no
stop token: the same work on both sides), at temperature 1. With several prompts their lengths
spread evenly from half of `--prompt` to `--prompt` tokens: compiletune decodes them as one batch
(each row at its own position), transformers as one left-padded batch with its attention mask.
On CUDA a further variant replays the compiled decode step as a CUDA graph
(--rollout-cuda-graphs). Time: median of --iters rounds after one warm-up (which compiles), the
variants taking turns. tokens/s = prompts x group x new / time.
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
from compiletune.rl.rollout import sample_prompts  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--dim", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--prompts", type=int, default=1, help="prompts decoded together")
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
    lengths = [
        a.prompt - (a.prompt // 2) * (a.prompts - 1 - i) // max(1, a.prompts - 1)
        for i in range(a.prompts)
    ]
    draw = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, a.vocab, (n,), generator=draw).tolist() for n in lengths]
    # transformers: one left-padded batch and its mask
    padded = torch.zeros(a.prompts, a.prompt, dtype=torch.long)
    mask = torch.zeros(a.prompts, a.prompt, dtype=torch.long)
    for i, ids in enumerate(prompts):
        padded[i, a.prompt - len(ids) :], mask[i, a.prompt - len(ids) :] = torch.tensor(ids), 1

    def run_ours(backend: str | None = None, graphs: bool = False) -> None:
        streams = [torch.Generator(device=device).manual_seed(i) for i in range(a.prompts)]
        out = sample_prompts(
            ours, prompts, a.group, a.new, 1.0, 1.0, set(), streams,
            compile_backend=backend, cuda_graphs=graphs,
        )  # fmt: skip
        assert all(len(c) == a.new for c in out)

    def run_hf() -> None:
        with torch.no_grad():
            out = hf.generate(
                padded.to(device),
                attention_mask=mask.to(device),
                do_sample=True,
                temperature=1.0,
                top_p=1.0,
                top_k=0,
                num_return_sequences=a.group,
                max_new_tokens=a.new,
                min_new_tokens=a.new,
                pad_token_id=0,
            )
        assert out.shape == (a.prompts * a.group, a.prompt + a.new)

    variants = {
        "compiletune": run_ours,
        "transformers generate": run_hf,
        f"compiletune, decode compiled ({a.backend})": lambda: run_ours(a.backend),
    }
    if device.type == "cuda":
        variants[f"compiletune, compiled ({a.backend}) + CUDA graphs"] = lambda: run_ours(
            a.backend, graphs=True
        )
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
        tokens = a.prompts * a.group * a.new
        rows.append({"variant": name, "s": round(t, 4), "tokens_per_s": round(tokens / t)})
    base = rows[1]["tokens_per_s"]
    print(
        f"rollout: {a.prompts} prompts ({min(lengths)}-{max(lengths)} tokens) x {a.group} "
        f"completions x {a.new} new tokens, "
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
    keys = ("dim", "layers", "vocab", "prompts", "group", "prompt", "new")
    shape = {k: getattr(a, k) for k in keys}
    write_result(out, {**result_header(), "dtype": str(dtype), "shape": shape, "rows": rows})


if __name__ == "__main__":
    main()
