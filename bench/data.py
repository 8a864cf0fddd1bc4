"""Data at scale: peak memory flat in the corpus size, and tokenisation throughput.

For each corpus size (synthetic jsonl text, --sizes in MiB) a fresh process builds the token
cache (`token_cache.cached_store`, worker processes) and then reads --steps training batches of
--batch-size rows of --seq-len tokens from it, as the trainer does; the process's peak resident
set size is recorded after the build and after the reads. A flat peak against the corpus size is
what lets a corpus larger than the machine's memory train.

Throughput: the same sample of the corpus (--sample MiB) tokenised by transformers' own batched
call in one process (`tokenizer(texts)`, the usual way), against the cache build (our readers,
masks and writing included, --workers processes), side by side in one run.

The tokenizer is a byte-level BPE trained here on the synthetic text (8k vocabulary), so tokens
are a few bytes each as with a real model's tokenizer; nothing is downloaded.

    python bench/data.py                       # sizes 64 256 1024 MiB
    python bench/data.py --sizes 32 64 --sample 8
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import device_name, result_header, work_dir, write_result  # noqa: E402

WORDS = [
    "the", "model", "data", "train", "token", "memory", "graph", "compile", "layer", "weight",
    "gradient", "batch", "optimizer", "state", "cache", "row", "epoch", "loss", "value", "of",
    "and", "in", "to", "a", "is", "for", "with", "on", "that", "by", "attention", "kernel",
]  # fmt: skip


def write_corpus(path: Path, mib: int, seed: int = 0) -> int:
    """A jsonl of {"text": ...} documents of 200-4000 characters, about `mib` MiB."""
    rng = random.Random(seed)
    target, written = mib << 20, 0
    with path.open("w") as f:
        while written < target:
            n = rng.randint(40, 800)
            text = " ".join(rng.choice(WORDS) for _ in range(n)) + f" {rng.randint(0, 10**6)}."
            line = json.dumps({"text": text}) + "\n"
            f.write(line)
            written += len(line)
    return written


def make_tokenizer(sample: Path, folder: Path) -> None:
    """A byte-level BPE with 8k tokens trained on the first MiB of the corpus, saved as an HF
    fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=8192, special_tokens=["<s>", "</s>"])
    with sample.open() as f:  # the first MiB only: this process's peak is its children's start
        lines = f.read(1 << 20).splitlines()[:-1]  # the last one is cut
    tok.train_from_iterator((json.loads(x)["text"] for x in lines), trainer)
    PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>"
    ).save_pretrained(folder)


def peak_rss_mib() -> float:
    """This process's peak resident set (VmHWM: unlike ru_maxrss it starts afresh at exec, so
    the parent's own peak does not leak into a child's)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def child(a: argparse.Namespace) -> None:
    """One corpus: build the cache, then read batches; print a JSON line."""
    import numpy as np
    from transformers import AutoTokenizer

    from compiletune.data.rows import Batches
    from compiletune.data.token_cache import cached_store
    from compiletune.data.token_store import PackedData

    tok = AutoTokenizer.from_pretrained(a.tokenizer)
    before = peak_rss_mib()
    t0 = time.perf_counter()
    store = cached_store(a.corpus, tok, cache_dir=a.cache, workers=a.workers, say=lambda s: None)
    build_s = time.perf_counter() - t0
    after_build = peak_rss_mib()
    data = PackedData(store, a.seq_len)
    batches = Batches(data, a.batch_size, 0)
    t0 = time.perf_counter()
    targets = 0
    for _ in range(a.steps):
        targets += int((batches.next()["targets"] >= 0).sum())
    read_s = time.perf_counter() - t0
    print(
        json.dumps(
            {
                "tokens": store.n_tokens,
                "documents": store.n_docs,
                "rows": data.rows,
                "build_s": round(build_s, 2),
                "build_tokens_per_s": round(store.n_tokens / build_s),
                "read_ms_per_batch": round(1000 * read_s / a.steps, 3),
                "rss_start_mib": round(before, 1),
                "rss_after_build_mib": round(after_build, 1),
                "rss_peak_mib": round(peak_rss_mib(), 1),
                "cache_mib": round(
                    sum(f.stat().st_size for f in Path(store.folder).iterdir()) / 2**20, 1
                ),
                "targets_read": targets,
                "ok": bool(np.isfinite(read_s)),
            }
        )
    )


def hf_throughput(corpus: Path, tokenizer: str, mib: int) -> dict:
    """transformers' batched call on the first `mib` MiB, one process (after reading it)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer)
    texts, size = [], 0
    with corpus.open() as f:
        for line in f:
            texts.append(json.loads(line)["text"])
            size += len(line)
            if size >= mib << 20:
                break
    t0 = time.perf_counter()
    ids = tok(texts, add_special_tokens=False)["input_ids"]
    s = time.perf_counter() - t0
    n = sum(len(x) for x in ids)
    return {"tokens": n, "seconds": round(s, 2), "tokens_per_s": round(n / s)}


def run_child(corpus: Path, tokenizer: Path, cache: Path, a: argparse.Namespace) -> dict:
    cmd = [sys.executable, __file__, "--child", "--corpus", str(corpus), "--tokenizer"]
    cmd += [str(tokenizer), "--cache", str(cache), "--workers", str(a.workers)]
    cmd += ["--seq-len", str(a.seq_len), "--batch-size", str(a.batch_size)]
    cmd += ["--steps", str(a.steps)]
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    if done.returncode != 0:
        raise SystemExit(f"child failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--sizes", type=int, nargs="+", default=[64, 256, 1024], help="MiB")
    ap.add_argument("--sample", type=int, default=32, help="MiB for the throughput rows")
    ap.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--steps", type=int, default=500)
    ap.add_argument("--out", default=None)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--corpus", help=argparse.SUPPRESS)
    ap.add_argument("--tokenizer", help=argparse.SUPPRESS)
    ap.add_argument("--cache", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        child(a)
        return
    work = work_dir("bench-data-")
    largest = work / f"corpus-{max(a.sizes)}.jsonl"
    print(f"writing a {max(a.sizes)} MiB corpus ...", file=sys.stderr)
    write_corpus(largest, max(a.sizes))
    tokenizer = work / "tokenizer"
    make_tokenizer(largest, tokenizer)
    rows = []
    for mib in sorted(a.sizes):
        corpus = work / f"corpus-{mib}.jsonl"
        if corpus != largest:
            write_corpus(corpus, mib)
        print(f"{mib} MiB: building the cache and reading {a.steps} batches ...", file=sys.stderr)
        rows.append({"corpus_mib": mib, **run_child(corpus, tokenizer, work / "cache", a)})
    sample = work / "sample.jsonl"
    write_corpus(sample, a.sample, seed=1)
    hf = hf_throughput(sample, str(tokenizer), a.sample)
    ours = run_child(sample, tokenizer, work / "cache-sample", a)
    print("| corpus MiB | tokens | cache build tok/s | read ms/batch | peak RSS MiB (build) | "
          "peak RSS MiB (build + reads) |")  # fmt: skip
    print("|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['corpus_mib']} | {r['tokens']:,} | {r['build_tokens_per_s']:,} | "
            f"{r['read_ms_per_batch']} | {r['rss_after_build_mib']} | {r['rss_peak_mib']} |"
        )
    ratio = ours["build_tokens_per_s"] / hf["tokens_per_s"]
    print(
        f"\nthroughput on {a.sample} MiB: transformers batched call (1 process) "
        f"{hf['tokens_per_s']:,} tok/s; cache build ({a.workers} processes, reading, masks "
        f"and writing included) {ours['build_tokens_per_s']:,} tok/s: {ratio:.2f}x"
    )
    out = Path(a.out) if a.out else Path(__file__).parent / "results" / f"data-{device_name()}.json"
    write_result(
        out,
        {
            **result_header(),
            "workers": a.workers,
            "seq_len": a.seq_len,
            "batch_size": a.batch_size,
            "steps": a.steps,
            "rows": rows,
            "throughput": {
                "sample_mib": a.sample,
                "transformers": hf,
                "cache_build": ours,
                "ratio": round(ratio, 3),
            },  # fmt: skip
        },
    )


if __name__ == "__main__":
    main()
