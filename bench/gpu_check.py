"""Everything a GPU session must measure, as prepared commands.

The next session's plan (issue 63; 15 minutes of device time): two `run` calls of at most 6.5
minutes each, set-up included, `timeout_s` 390 and `carry: [".whl"]` each, prepared as
docs/development.md says (`.whl/` holds the peers' wheels and COMMIT):

    python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl &&
    export PYTHONPATH=/tmp/site && python3 -m pip install -q --no-deps --no-build-isolation -e . &&
    BENCH_COMMIT=$(cat .whl/COMMIT) python3 bench/gpu_check.py --part 7 --deadline 320 --copy-to "$OUT"

and the same with `--part 8`. Part 7: the CUDA tests of every path never run on a GPU, then
the 1B compiled baseline and the ladder, then the offload a 16 GiB target needs. Part 8: the
loss head beside its peers, FP8, the 8B rows and the 24 GB recipe, the MoE blocks, the
rollout, fla (what the deadline skips is recorded as skipped).

Earlier parts:

    python bench/gpu_check.py --part 1          # correctness: the CUDA tests (pytest -m cuda)
    python bench/gpu_check.py --part 2          # speed: attention, loss head (and its profile),
                                                #   one MoE block (bf16: torch._grouped_mm),
                                                #   a DPO and a KD step (chunked heads),
                                                #   the technique ladder on a 1B model
    python bench/gpu_check.py --steps env speed-1b   # named steps only (speed-1b: 1B eager vs
                                                #   compiled, the ladder's first two rows)
    python bench/gpu_check.py --part 3          # memory: estimate-memory against measured peaks
    python bench/gpu_check.py --all --deadline 540 --copy-to "$OUT"
    python bench/gpu_check.py --dry-run --all   # CPU: every step's plumbing at toy sizes (CI:
                                                #   --all --part 4 6 7 8; a toy run that an earlier
                                                #   step made is not made again)

On a bare GPU machine: `pip install --no-deps -e .` first (torch, triton, transformers and peft
are already there). Each step runs in its own process with a time limit; a step that fails or
times out is recorded (exit code, seconds, the end of its output) and the next one runs.
`--deadline` bounds the whole invocation: a step is started only with its `min_s` left, and its
limit is cut to what remains. After every step the part's result and the report are rewritten, so a
run killed from outside still leaves what it measured:

    bench/results/gpu-check-part<N>-<device>.json   the steps, plus each bench's own JSON
    bench/results/<bench>-cuda-<device>.json        what the benches write
    bench/reports/<date>-gpu-check-<device>.md      this run's sections after earlier runs':
                                                    one table per part, each step's output tail

`--copy-to DIR` also writes DIR/gpu-check-<device>.tar (the result JSONs) after each step, and
the report at the end (for the device tool's $OUT, which brings back few files).
`--dry-run` writes to a temporary folder unless --results/--reports say otherwise.
Where the tree's .git is not the commit being measured (the device tool's copy), set
BENCH_COMMIT=<hash> so that every result names the right one.

The speed set of issue 35 (part 4; 2026-11-27), with the peers' wheels carried in .whl:

    python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl &&
    export PYTHONPATH=/tmp/site && python3 -m pip install -q --no-deps --no-build-isolation -e . &&
    BENCH_COMMIT=<hash> python3 bench/gpu_check.py --part 4 --deadline 540 --copy-to "$OUT"

What that first call left (part 5; the same set-up, `--part 5 --deadline 560`, timeout_s 590).
GRPO's rollout (issue 40): `--steps rollout-tests rollout-1b --deadline 420` (no peers'
wheels needed; `--part 6` is the bench alone).

The device call used on 2026-11-26 (H200; 15 minutes of device time in all):

    python3 -m pip install -q --no-deps --no-build-isolation -e . &&
    BENCH_COMMIT=<hash> python3 bench/gpu_check.py --steps env cuda-tests attention loss \
        speed-1b estimate ladder --deadline 525 --copy-to "$OUT"          # timeout_s 560
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import contextlib

from common import SHARED_CACHE_ENV, device_name, result_header  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
PY = sys.executable

ENV_SNIPPET = """
import json, platform, time, torch
info = {"python": platform.python_version(), "torch": torch.__version__,
        "cuda": torch.version.cuda, "cuda_available": torch.cuda.is_available()}
for mod in ("triton", "transformers", "peft"):
    try:
        info[mod] = __import__(mod).__version__
    except ImportError:
        info[mod] = None
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    info.update(name=p.name, capability=f"{p.major}.{p.minor}", memory_gib=p.total_memory / 2**30,
                sms=p.multi_processor_count, bf16=torch.cuda.is_bf16_supported())
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ a
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(10):
        a @ a
    torch.cuda.synchronize()
    info["bf16_matmul_tflops"] = round(10 * 2 * 8192**3 / (time.perf_counter() - t) / 1e12, 1)
print(json.dumps(info, indent=1))
"""


@dataclass
class Step:
    part: int
    name: str
    argv: list[str]  # on the GPU; {results} {work} {dev} are filled in
    dry_argv: list[str]  # --dry-run on CPU: the same plumbing at toy sizes
    timeout: int  # seconds
    min_s: int = 30  # not started with less than this left
    result: str | None = None  # the JSON the step writes, under {results}
    junit: bool = False  # a pytest step: count its outcomes from {work}/junit-<name>.xml
    in_part: bool = True  # run by --part / --all (else only when --steps names it)
    data: dict[str, Any] = field(default_factory=dict)


def _pytest(name: str, *targets: str) -> list[str]:
    return [PY, "-m", "pytest", "-q", "-m", "cuda", *targets, "-p", "no:cacheprovider"] + [
        "--junitxml",
        "{work}/junit-" + name + ".xml",
    ]


def _xdist(workers: int = 4) -> list[str]:
    """Several pytest workers where pytest-xdist is installed (compiles are CPU-bound)."""
    try:
        import xdist  # noqa: F401
    except ImportError:
        return []
    return ["-n", str(workers)]


LADDER_1B = ["--models", "llama3_2_1b", "--seq-len", "2048", "--no-plot"]
LADDER_DRY = ["--models", "debug", "--n-layers", "2", "--seq-len", "64", "--steps", "2"]
LADDER_DRY += ["--dtype", "fp32", "--no-plot", "--compile-backend", "aot_eager"]

STEPS: list[Step] = [
    Step(1, "env", [PY, "-c", ENV_SNIPPET], [PY, "-c", ENV_SNIPPET], 120, 10),
    Step(
        1,
        "cuda-tests",
        [*_pytest("cuda-tests", "tests/gpu", "tests/unit/ops/test_fused_loss.py"), *_xdist()],
        _pytest("cuda-tests", "tests/gpu", "tests/unit/ops/test_fused_loss.py"),
        420,
        60,
        junit=True,
    ),
    Step(
        2,
        "attention",
        [PY, "bench/attention.py", "--seq", "4096", "16384", "--iters", "5"]
        + ["--out", "{results}/attention-cuda-{dev}.json"],
        [PY, "bench/attention.py", "--seq", "128", "--iters", "1", "--variants", "sdpa", "docs"]
        + ["--out", "{results}/attention-cuda-{dev}.json"],
        180,
        40,
        result="attention-cuda-{dev}.json",
    ),
    Step(
        2,
        "loss",
        [PY, "bench/loss.py", "--out", "{results}/loss-cuda-{dev}.json"],
        [PY, "bench/loss.py", "--tokens", "128", "--hidden", "32", "--vocab", "500"]
        + ["--iters", "1", "--out", "{results}/loss-cuda-{dev}.json"],
        180,
        40,
        result="loss-cuda-{dev}.json",
    ),
    Step(
        2,
        "moe",
        # one Qwen3-30B-A3B block: d 2048, F 768, 128 experts, top-8
        [PY, "bench/moe.py", "--tokens", "8192", "--dim", "2048", "--ffn", "768"]
        + ["--experts", "128", "--top-k", "8", "--iters", "10"]
        + ["--out", "{results}/moe-cuda-{dev}.json"],
        [PY, "bench/moe.py", "--tokens", "64", "--dim", "32", "--ffn", "64", "--iters", "1"]
        + ["--warmup", "1", "--compile-backend", "aot_eager"]
        + ["--out", "{results}/moe-cuda-{dev}.json"],
        180,
        40,
        result="moe-cuda-{dev}.json",
    ),
    Step(
        2,
        "moe-gpt-oss",
        # one gpt-oss-20b block: d 2880, F 2880, 32 experts, top-4, biases, clamped SwiGLU
        [PY, "bench/moe.py", "--block", "gpt_oss", "--tokens", "8192", "--dim", "2880"]
        + ["--ffn", "2880", "--experts", "32", "--top-k", "4", "--iters", "10"]
        + ["--out", "{results}/moe-gpt-oss-cuda-{dev}.json"],
        [PY, "bench/moe.py", "--block", "gpt_oss", "--tokens", "64", "--dim", "32"]
        + ["--ffn", "64", "--iters", "1", "--warmup", "1", "--compile-backend", "aot_eager"]
        + ["--out", "{results}/moe-gpt-oss-cuda-{dev}.json"],
        180,
        40,
        result="moe-gpt-oss-cuda-{dev}.json",
    ),
    Step(
        2,
        "moe-deepseek-v3",
        # a GLM-4.5-Air-sized block of DeepSeek-V3's kind: d 4096, F 1408, 128 experts, top-8
        [PY, "bench/moe.py", "--block", "deepseek_v3", "--tokens", "8192", "--dim", "4096"]
        + ["--ffn", "1408", "--experts", "128", "--top-k", "8", "--iters", "10"]
        + ["--out", "{results}/moe-deepseek-v3-cuda-{dev}.json"],
        [PY, "bench/moe.py", "--block", "deepseek_v3", "--tokens", "64", "--dim", "32"]
        + ["--ffn", "64", "--iters", "1", "--warmup", "1", "--compile-backend", "aot_eager"]
        + ["--out", "{results}/moe-deepseek-v3-cuda-{dev}.json"],
        180,
        40,
        result="moe-deepseek-v3-cuda-{dev}.json",
    ),
    Step(
        2,
        "linear-attention",
        # Qwen3-Next's Gated DeltaNet heads: ours, transformers' torch path, fla (if carried)
        [PY, "bench/linear_attention.py", "--tokens", "4096", "16384", "65536"]
        + ["--out", "{results}/linear-attention-cuda-{dev}.json"],
        [PY, "bench/linear_attention.py", "--tokens", "128", "--heads", "2", "--dk", "16"]
        + ["--dv", "16", "--iters", "1", "--out", "{results}/linear-attention-cuda-{dev}.json"],
        180,
        40,
        result="linear-attention-cuda-{dev}.json",
    ),
    Step(
        2,
        "objectives",
        [PY, "bench/objectives.py", "--iters", "3"]
        + ["--out", "{results}/objectives-cuda-{dev}.json"],
        [PY, "bench/objectives.py", "--model", "debug", "--layers", "1", "--tokens", "256"]
        + ["--seq", "128", "--iters", "1", "--out", "{results}/objectives-cuda-{dev}.json"],
        180,
        40,
        result="objectives-cuda-{dev}.json",
    ),
    Step(
        2,
        "loss-profile",
        [PY, "bench/loss.py", "--profile", "--tokens", "16384", "--variants", "fused", "plain"],
        [PY, "bench/loss.py", "--profile", "--tokens", "128", "--hidden", "32", "--vocab", "500"]
        + ["--variants", "fused"],
        120,
        30,
    ),
    Step(
        2,
        "speed-1b",
        [PY, "bench/ladder.py", *LADDER_1B, "--steps", "12", "--rungs", "eager", "+ compile"]
        + ["--out", "{results}/speed-1b-cuda-{dev}.json"],
        [PY, "bench/ladder.py", *LADDER_DRY, "--rungs", "eager"]
        + ["--out", "{results}/speed-1b-cuda-{dev}.json"],
        300,
        90,
        result="speed-1b-cuda-{dev}.json",
        in_part=False,  # the ladder's first two rows; for a short call
    ),
    Step(
        2,
        "ladder",
        [PY, "bench/ladder.py", *LADDER_1B, "--steps", "6"]
        + ["--out", "{results}/ladder-cuda-{dev}.json"],
        [PY, "bench/ladder.py", *LADDER_DRY, "--rungs", "eager"]
        + ["--out", "{results}/ladder-cuda-{dev}.json"],
        460,
        120,
        result="ladder-cuda-{dev}.json",
    ),
    Step(
        3,
        "estimate",
        [PY, "bench/estimate.py", "--gpu-only", "--model", "llama3_2_1b", "--n-layers", "16"]
        + ["--seq-len", "2048", "--batch-size", "1"]
        + ["--out", "{results}/estimate-cuda-{dev}.json"],
        [PY, "bench/estimate.py", "--model", "debug", "--n-layers", "2", "--seq-len", "64"]
        + ["--only", "plain loss", "--out", "{results}/estimate-cuda-{dev}.json"],
        300,
        60,
        result="estimate-cuda-{dev}.json",
    ),
]


# Part 4: the speed set of issue 35, one call of <= 9 minutes (no eager rung; the compiled
# baseline in the same call; every row on disk as it completes), ordered by what it proves:
# FlexAttention under checkpointing and offload and the fused head's CUDA tests (correctness
# first), the loss head beside its peers, the 1B ladder with its side rows, then the 8B rows
# with their estimates (a second call where the first runs out).
_LADDER_1B_ROWS = ["+ compile", "+ fused loss", "+ selective AC", "full AC"]
_LADDER_1B_ROWS += ["+ optimizer in backward", "+ 8-bit AdamW", "+ offload activations"]
_LADDER_1B_ROWS += ["LoRA r16", "QLoRA r16 (nf4)", "+ fp8 rowwise", "+ fp8 tensorwise"]
_LADDER_1B_ROWS += ["LoRA r16 + fp8 rowwise"]
STEPS += [
    Step(
        4,
        "flex-tests",
        [*_pytest("flex-tests", "tests/gpu/test_cuda.py", "tests/unit/ops/test_fused_loss.py")]
        + [*_xdist(), "-k", "flex or compiled_run_follows_eager or test_cuda_"],
        _pytest("flex-tests", "tests/gpu/test_cuda.py") + ["-k", "flex"],
        120,
        60,
        junit=True,
    ),
    Step(
        4,
        "loss-peers",
        [PY, "bench/loss.py", "--tokens", "4096", "16384", "--iters", "5"]
        + ["--out", "{results}/loss-cuda-{dev}.json"],
        [PY, "bench/loss.py", "--tokens", "128", "--hidden", "32", "--vocab", "500"]
        + ["--iters", "1", "--out", "{results}/loss-cuda-{dev}.json"],
        150,
        60,
        result="loss-cuda-{dev}.json",
    ),
    Step(
        4,
        "ladder-1b",
        [PY, "bench/ladder.py", *LADDER_1B, "--batch-size", "4", "--steps", "9"]
        + ["--rungs", *_LADDER_1B_ROWS, "--out", "{results}/ladder-cuda-{dev}.json"],
        [PY, "bench/ladder.py", *LADDER_DRY, "--rungs", "eager"]
        + ["--out", "{results}/ladder-cuda-{dev}.json"],
        330,
        120,
        result="ladder-cuda-{dev}.json",
    ),
    Step(
        4,
        "ladder-8b",
        [PY, "bench/ladder.py", "--models", "llama3_1_8b", "--rows", "8b", "--estimate"]
        + ["--seq-len", "2048", "--batch-size", "2", "--steps", "9", "--no-plot"]
        + ["--out", "{results}/ladder-8b-cuda-{dev}.json"],
        [PY, "bench/ladder.py", *LADDER_DRY, "--rows", "8b", "--rungs", "8B LoRA r16"]
        + ["--out", "{results}/ladder-8b-cuda-{dev}.json"],
        420,
        90,
        result="ladder-8b-cuda-{dev}.json",
    ),
]


# Part 5: what part 4's first call left (2026-11-27, the second GPU session), in one call of
# <= 9.5 minutes: the 1B rows whose ratios need a quiet machine, run first and alone (the
# compiled baseline, fused head, selective and full AC, LoRA and QLoRA; the rows measured
# cleanly last time are not repeated); the FlexAttention tests with more workers and time; the
# 24 GB 8B recipe's peak beside its pre-flight estimate (3 steps: its optimizer runs on the host).
_LADDER_CLEAN = ["+ compile", "+ fused loss", "+ selective AC", "full AC"]
_LADDER_CLEAN += ["LoRA r16", "QLoRA r16 (nf4)"]
STEPS += [
    Step(
        5,
        "ladder-1b-clean",
        [PY, "bench/ladder.py", *LADDER_1B, "--batch-size", "4", "--steps", "9"]
        + ["--rungs", *_LADDER_CLEAN, "--out", "{results}/ladder-clean-cuda-{dev}.json"],
        [PY, "bench/ladder.py", *LADDER_DRY, "--rungs", "+ compile"]
        + ["--out", "{results}/ladder-clean-cuda-{dev}.json"],
        270,
        150,
        result="ladder-clean-cuda-{dev}.json",
    ),
    Step(
        5,
        "flex-tests-5",
        [*_pytest("flex-tests-5", "tests/gpu/test_cuda.py", "tests/unit/ops/test_fused_loss.py")]
        + ["-n", "8", "-k", "flex or compiled_run_follows_eager or test_cuda_"],
        _pytest("flex-tests-5", "tests/gpu/test_cuda.py") + ["-k", "flex"],
        170,
        60,
        junit=True,
    ),
    Step(
        5,
        "recipe-8b",
        [PY, "bench/ladder.py", "--models", "llama3_1_8b", "--rows", "8b", "--estimate"]
        + ["--rungs", "8B recipe llama3_1_8b_full_24gb", "--steps", "3", "--no-plot"]
        + ["--memory-cap-gib", "24", "--out", "{results}/recipe-8b-cuda-{dev}.json"],
        [PY, "bench/ladder.py", *LADDER_DRY, "--rows", "8b", "--rungs", "8B LoRA r16"]
        + ["--out", "{results}/recipe-8b-cuda-{dev}.json"],
        300,
        90,
        result="recipe-8b-cuda-{dev}.json",
    ),
]


# Part 6: GRPO's rollout (issue 40; 2026-11-28): the CUDA-graph decode against plain decoding
# (tests; by name, as part 1 runs them too), then the sampler against transformers' `generate`
# at a 1B shape (Llama 3.2 1B's widths and vocabulary), 8 prompts of 128-256 tokens x 8
# completions x 256 new tokens, bf16: eager, compiled, and compiled + CUDA graphs (target:
# >= 2x transformers).
STEPS += [
    Step(
        6,
        "rollout-tests",
        _pytest("rollout-tests", "tests/gpu/test_cuda.py") + ["-k", "rollout"],
        _pytest("rollout-tests", "tests/gpu/test_cuda.py") + ["-k", "rollout"],
        150,
        60,
        junit=True,
        in_part=False,  # part 1's cuda-tests hold them; by name for a short call
    ),
    Step(
        6,
        "rollout-1b",
        [PY, "bench/rollout.py", "--dim", "2048", "--layers", "16", "--vocab", "128256"]
        + ["--prompts", "8", "--group", "8", "--prompt", "256", "--new", "256", "--iters", "2"]
        + ["--out", "{results}/rollout-cuda-{dev}.json"],
        [PY, "bench/rollout.py", "--dim", "64", "--layers", "2", "--vocab", "500"]
        + ["--prompts", "3", "--group", "2", "--prompt", "8", "--new", "4", "--iters", "1"]
        + ["--backend", "aot_eager", "--out", "{results}/rollout-cuda-{dev}.json"],
        300,
        120,
        result="rollout-cuda-{dev}.json",
    ),
]


# Parts 7 and 8: the plan for 15 minutes of device time (issue 63), two calls of at most 6.5
# minutes each, set-up included (the commands: the module's docstring). Call 1 (part 7) runs
# first the CUDA tests of every path that has never run on a GPU, then the 1B compiled baseline
# with the ladder's rungs; call 2 (part 8) the speed rows in this order: the loss head beside
# Liger and cut-cross-entropy, FP8 (at 8B shapes, beside the bf16 row), the 8B LoRA / QLoRA rows
# and the 24 GB recipe, the MoE blocks, the rollout, flash-linear-attention. Each step's limit
# and `min_s` come from the seconds the 2026-11-26/27 H200 calls took (bench/results/
# gpu-check-part*-h200.json); `--deadline` skips (and records) what does not fit, and a step
# cut at its limit keeps the rows its bench wrote.
FIRST_GPU_TESTS = [
    "tests/gpu/test_cuda_varlen.py",  # varlen flash attention (documents-only masks)
    "tests/unit/ops/test_gated_delta.py",  # fla's kernels on packed rows
    "tests/gpu/test_cuda.py",  # sinks through FlexAttention; the CUDA-graph rollout
    "tests/unit/test_fp8.py",  # FP8 training (torchao's float8 linears)
    "tests/unit/models/test_quantized.py",  # MXFP4 / fp8 checkpoints loaded on the device
    "tests/unit/ops/test_head_accumulator.py",  # the loss head's bf16 / fp32 dW sum (cuBLAS)
]
# -k: the never-run tests of those files (the FP8 and checkpoint files run whole: on a GPU
# their device cases run for the first time)
FIRST_GPU_K = "varlen or fla or sinks or rollout or fp8 or mxfp4 or quantized or dequantize"
FIRST_GPU_K += " or cuda_weight_sum"
_LADDER_PLAN = ["+ compile", "+ fused loss", "+ selective AC", "full AC"]
# Offload as a memory target needs it (bench/offload_plan.py: --offload-activations auto in a
# process held to 16 GiB, beside the copy time the measured host link implies), in place of the
# ladder's every-block rung
_OFFLOAD_1B = ["bench/offload_plan.py", "--model", "llama3_2_1b", "--device-memory", "16"]
_OFFLOAD_DRY = ["bench/offload_plan.py", "--model", "debug", "--n-layers", "2", "--seq-len", "64"]
_OFFLOAD_DRY += ["--steps", "2", "--dtype", "fp32", "--compile-backend", "aot_eager"]
# The loss head with each weight-gradient sum (bf16, fp32, bf16 at about Liger's memory) and its
# two-op form beside Liger and cut-cross-entropy (each skipped, and recorded so, where its
# package is missing). `fused` (auto) is left out: at hidden 4096, vocab 128256 it is
# fused_bf16acc (1 and 4 chunks).
_LOSS_PLAN = ["--variants", "fused_bf16acc", "fused_fp32acc", "fused_bf16_128m", "liger", "cce"]
_LOSS_PLAN += ["fused_two_op", "plain"]
_8B = ["bench/ladder.py", "--models", "llama3_1_8b", "--rows", "8b", "--estimate", "--no-plot"]
_8B += ["--seq-len", "2048", "--batch-size", "2"]
_8B_DRY = ["bench/ladder.py", *LADDER_DRY, "--rows", "8b", "--rungs", "8B LoRA r16"]


def _first_gpu_tests(name: str) -> list[str]:
    """pytest over FIRST_GPU_TESTS, -k FIRST_GPU_K, without the `-m cuda` filter (the FP8 and
    checkpoint tests are not marked: they run on every device)."""
    return [PY, "-m", "pytest", "-q", *FIRST_GPU_TESTS, "-k", FIRST_GPU_K] + [
        "-p",
        "no:cacheprovider",
        "--junitxml",
        "{work}/junit-" + name + ".xml",
    ]


STEPS += [
    Step(7, "env-7", [PY, "-c", ENV_SNIPPET], [PY, "-c", ENV_SNIPPET], 60, 10),
    Step(
        7,
        "first-gpu-tests",
        [*_first_gpu_tests("first-gpu-tests"), *_xdist(8)],
        [*_first_gpu_tests("first-gpu-tests"), "-m", "cuda"],  # CPU: collected, skipped
        125,
        60,
        junit=True,
    ),
    Step(
        7,
        "ladder-1b-plan",
        # the compiled baseline and the rungs whose ratios it sets, in one process each, one call
        [PY, "bench/ladder.py", *LADDER_1B, "--batch-size", "4", "--steps", "6"]
        + ["--rungs", *_LADDER_PLAN, "--out", "{results}/ladder-plan-cuda-{dev}.json"],
        [PY, "bench/ladder.py", *LADDER_DRY, "--rungs", "+ compile"]
        + ["--out", "{results}/ladder-plan-cuda-{dev}.json"],
        240,
        120,
        result="ladder-plan-cuda-{dev}.json",
    ),
    Step(
        7,
        "offload-1b-plan",
        [PY, *_OFFLOAD_1B, "--out", "{results}/offload-plan-cuda-{dev}.json"],
        [PY, *_OFFLOAD_DRY, "--device-memory", "3"]
        + ["--out", "{results}/offload-plan-cuda-{dev}.json"],
        200,
        120,
        result="offload-plan-cuda-{dev}.json",
    ),
    Step(8, "env-8", [PY, "-c", ENV_SNIPPET], [PY, "-c", ENV_SNIPPET], 60, 10),
    Step(
        8,
        "loss-peers-plan",
        [PY, "bench/loss.py", "--tokens", "4096", "16384", "--iters", "3", *_LOSS_PLAN]
        + ["--out", "{results}/loss-plan-cuda-{dev}.json"],
        [PY, "bench/loss.py", "--tokens", "128", "--hidden", "32", "--vocab", "500"]
        + ["--iters", "1", *_LOSS_PLAN, "--out", "{results}/loss-plan-cuda-{dev}.json"],
        90,
        45,
        result="loss-plan-cuda-{dev}.json",
    ),
    Step(
        8,
        "fp8-8b",
        [PY, *_8B, "--steps", "5", "--out", "{results}/fp8-8b-cuda-{dev}.json", "--rungs"]
        + ["8B full: fused + selective AC + 8-bit AdamW in backward", "8B full + fp8 rowwise"],
        [PY, *_8B_DRY, "--out", "{results}/fp8-8b-cuda-{dev}.json"],
        130,
        90,
        result="fp8-8b-cuda-{dev}.json",
    ),
    Step(
        8,
        "lora-8b",
        [PY, *_8B, "--steps", "5", "--out", "{results}/lora-8b-cuda-{dev}.json", "--rungs"]
        + ["8B LoRA r16", "8B QLoRA r16 (nf4)"],
        [PY, *_8B_DRY, "--out", "{results}/lora-8b-cuda-{dev}.json"],
        110,
        80,
        result="lora-8b-cuda-{dev}.json",
    ),
    Step(
        8,
        "recipe-8b-plan",
        [PY, *_8B, "--steps", "3", "--rungs", "8B recipe llama3_1_8b_full_24gb"]
        + ["--memory-cap-gib", "24", "--out", "{results}/recipe-8b-plan-cuda-{dev}.json"],
        # (the capped launch runs here too: the cap itself is a no-op without CUDA)
        [PY, *_8B_DRY, "--memory-cap-gib", "24"]
        + ["--out", "{results}/recipe-8b-plan-cuda-{dev}.json"],
        300,
        150,
        result="recipe-8b-plan-cuda-{dev}.json",
    ),
    *(
        Step(8, f"{s.name}-plan", s.argv, s.dry_argv, 60, 40, s.result)
        for s in STEPS
        if s.name in ("moe-gpt-oss", "moe-deepseek-v3")
    ),
    *(
        Step(8, f"{s.name}-plan", s.argv, s.dry_argv, t, m, s.result)
        for name, t, m in (("rollout-1b", 120, 60), ("linear-attention", 60, 40))
        for s in STEPS
        if s.name == name
    ),
]
PLAN_PARTS = (7, 8)


def junit_counts(path: Path) -> dict[str, Any]:
    """passed / failed / errors / skipped of a pytest junit file, and the failures' messages."""
    if not path.exists():
        return {"junit": "missing"}
    root = ET.parse(path).getroot()
    counts = {"passed": 0, "failed": 0, "errors": 0, "skipped": 0, "failures": []}
    for case in root.iter("testcase"):
        name = f"{case.get('classname')}::{case.get('name')}"
        bad = case.find("failure") if case.find("failure") is not None else case.find("error")
        if bad is not None:
            counts["failed" if bad.tag == "failure" else "errors"] += 1
            text = (bad.get("message") or "") + "\n" + (bad.text or "")
            counts["failures"].append({"test": name, "message": text[-1500:]})
        elif case.find("skipped") is not None:
            counts["skipped"] += 1
        else:
            counts["passed"] += 1
    return counts


def _fill(text: str, fill: dict[str, str]) -> str:
    for key, value in fill.items():
        text = text.replace("{" + key + "}", value)
    return text


def run_step(step: Step, fill: dict[str, str], dry: bool, limit: float) -> dict[str, Any]:
    argv = [_fill(a, fill) for a in (step.dry_argv if dry else step.argv)]
    record: dict[str, Any] = {"name": step.name, "part": step.part, "argv": argv}
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if dry:  # the plumbing: every bench run shares one Inductor cache (bench/common.py), and
        # the fused head's chunks run eagerly (the same numbers; the compiled chunks are the unit
        # tests' business, and compiling them costs each toy step seconds)
        env[SHARED_CACHE_ENV] = str(Path(tempfile.gettempdir()) / "compiletune-dry-run-inductor")
        env["COMPILETUNE_LCE_EAGER"] = "1"
    t0 = time.perf_counter()
    # Its own process group: at the time limit every process of the step goes (pytest-xdist's
    # workers and the ladder's training runs too, which would go on using the GPU and skew the
    # steps after it).
    proc = subprocess.Popen(
        argv,
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=max(1, limit))
        rc = proc.returncode
        record["status"] = "passed" if rc == 0 else "failed"
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        rc = None
        record["status"] = f"timeout after {int(limit)} s"
    record.update(rc=rc, seconds=round(time.perf_counter() - t0, 1))
    record["stdout_tail"] = (out or "")[-6000:]
    record["stderr_tail"] = (err or "")[-4000:]
    if step.junit:
        record["tests"] = junit_counts(Path(fill["work"]) / f"junit-{step.name}.xml")
    if step.result:
        path = Path(fill["results"]) / _fill(step.result, fill)
        if path.exists():
            record["result"] = json.loads(path.read_text())
    if step.name == "env" and rc == 0:
        with contextlib.suppress(json.JSONDecodeError):
            record["result"] = json.loads(out)
    return record


def _toy_command(step: Step, fill: dict[str, str]) -> tuple[str, ...]:
    """A step's --dry-run command less the path of the JSON it writes (`--out`)."""
    argv = [_fill(x, fill) for x in step.dry_argv]
    return tuple("{out}" if i and argv[i - 1] == "--out" else x for i, x in enumerate(argv))


def _reuse(step: Step, done: Step, record: dict[str, Any], fill: dict[str, str]) -> dict[str, Any]:
    """--dry-run: a step whose toy command an earlier step ran takes that run's record. The
    plan's steps repeat earlier parts' benches (and the 8B rows one another) at GPU sizes that
    differ, but at toy sizes their commands are the same but for the JSON's path: one run checks
    that plumbing; its JSON is copied to this step's path, as this step's run would write it."""
    if step.result and done.result:
        src = Path(fill["results"]) / _fill(done.result, fill)
        dst = Path(fill["results"]) / _fill(step.result, fill)
        if src.exists() and src != dst:
            shutil.copy(src, dst)
    return {**record, "name": step.name, "part": step.part, "same_as": record["name"]}


def report_section(part: int, records: list[dict[str, Any]], header: dict[str, Any]) -> str:
    lines = [
        f"\n## Part {part} — {header['date']} — {header['device_detail']}, torch {header['torch']}"
        f", commit {header['commit']}\n",
        "| step | status | seconds | tests |",
        "|---|---|---:|---|",
    ]
    for r in records:
        t = r.get("tests", {})
        tests = (
            f"{t['passed']} passed, {t['failed']} failed, {t['errors']} errors, "
            f"{t['skipped']} skipped"
            if "passed" in t
            else ""
        )
        seconds = f"(the run of {r['same_as']})" if "same_as" in r else r.get("seconds", "")
        lines.append(f"| {r['name']} | {r['status']} | {seconds} | {tests} |")
    for r in records:
        if r["status"] == "skipped" or "same_as" in r:  # a reused run's output is shown once
            continue
        lines.append(f"\n### {r['name']}\n\n```\n{r['stdout_tail'][-2500:].strip()}\n```")
        if r["status"] != "passed" and r["stderr_tail"].strip():
            lines.append(f"stderr:\n```\n{r['stderr_tail'][-2000:].strip()}\n```")
        for f in r.get("tests", {}).get("failures", [])[:12]:
            lines.append(f"\nFAILED {f['test']}:\n```\n{f['message'][-800:].strip()}\n```")
    return "\n".join(lines) + "\n"


def _bundle(results: Path, dev: str, to: Path) -> None:
    """One tar of every result JSON for this device, replaced whole (a fetch sees a complete
    file): the device tool brings back few files."""
    to.mkdir(parents=True, exist_ok=True)
    tmp = to / f".gpu-check-{dev}.tar.partial"
    with tarfile.open(tmp, "w") as tar:
        for f in sorted(results.glob(f"*-{dev}.json")):
            tar.add(f, arcname=f.name)
    tmp.replace(to / f"gpu-check-{dev}.tar")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--part", type=int, nargs="+", choices=range(1, 9), default=[])
    ap.add_argument(
        "--all", action="store_true", help="parts 1, 2, 3 in turn (then --part's, if named)"
    )
    ap.add_argument("--steps", nargs="+", help="these steps, in this order (names: see STEPS)")
    ap.add_argument("--dry-run", action="store_true", help="toy sizes on CPU: the plumbing")
    ap.add_argument("--deadline", type=float, default=None, help="seconds for the whole run")
    ap.add_argument("--results", default=None, help="default bench/results")
    ap.add_argument("--reports", default=None, help="default bench/reports")
    ap.add_argument("--copy-to", default=None, help="also copy the results here after each step")
    a = ap.parse_args(argv)

    by_name = {s.name: s for s in STEPS}
    if a.steps:
        unknown = [n for n in a.steps if n not in by_name]
        if unknown:
            ap.error(f"unknown steps {unknown}; known: {list(by_name)}")
        steps = [by_name[n] for n in a.steps]
    else:
        parts = [*([1, 2, 3] if a.all else []), *(p for p in a.part if not a.all or p > 3)]
        if not parts:
            ap.error("name --part N, --all or --steps")
        steps = [s for p in parts for s in STEPS if s.part == p and s.in_part]

    import torch

    if not a.dry_run and not torch.cuda.is_available():
        print("no CUDA GPU here: run with --dry-run to check the plumbing", file=sys.stderr)
        return 2
    scratch = Path(tempfile.mkdtemp(prefix="gpu-check-"))
    results = Path(a.results or (scratch / "results" if a.dry_run else ROOT / "bench/results"))
    reports = Path(a.reports or (scratch / "reports" if a.dry_run else ROOT / "bench/reports"))
    work = scratch / "work"
    for d in (results, reports, work):
        d.mkdir(parents=True, exist_ok=True)
    dev = device_name()
    fill = {"results": str(results), "work": str(work), "dev": dev}
    header = result_header()
    report = reports / f"{time.strftime('%Y-%m-%d')}-gpu-check-{dev}.md"
    if not report.exists():
        report.write_text(
            f"# GPU check on {dev}\n\nWritten by `python bench/gpu_check.py` "
            "(see its docstring); one section per part and run.\n"
        )
    before = report.read_text()  # earlier runs' sections; this run's are rewritten per step
    start = time.perf_counter()
    done: dict[int, list[dict[str, Any]]] = {}
    ran: dict[tuple[str, ...], tuple[Step, dict[str, Any]]] = {}  # --dry-run: each toy run
    failed = 0
    for step in steps:
        left = (a.deadline - (time.perf_counter() - start)) if a.deadline else float("inf")
        key = _toy_command(step, fill)
        same = ran.get(key) if a.dry_run else None
        if left < step.min_s:
            record = {"name": step.name, "part": step.part, "status": "skipped"}
            record["reason"] = f"{left:.0f} s left of --deadline, needs {step.min_s}"
        elif same is not None:
            record = _reuse(step, *same, fill)
            print(f"== part {step.part}: {step.name}: the toy run of {record['same_as']}, above")
            failed += record["status"] != "passed"
        else:
            print(f"== part {step.part}: {step.name} (limit {min(step.timeout, left):.0f} s)")
            record = run_step(step, fill, a.dry_run, min(step.timeout, left - 5))
            ran[key] = (step, record)
            print(f"   {record['status']} in {record['seconds']} s", flush=True)
            if record["status"] != "passed":
                failed += 1
                print(record["stdout_tail"][-1500:], record["stderr_tail"][-1500:], sep="\n")
        done.setdefault(step.part, []).append(record)
        path = results / f"gpu-check-part{step.part}-{dev}.json"
        path.write_text(
            json.dumps({**header, "dry_run": a.dry_run, "steps": done[step.part]}, indent=1) + "\n"
        )
        # the report too after every step: a call cut short from outside keeps its rows
        sections = [report_section(part, records, header) for part, records in done.items()]
        report.write_text(before + "".join(sections))
        if a.copy_to:
            Path(a.copy_to).mkdir(parents=True, exist_ok=True)  # a folder, not a copy's name
            shutil.copy(report, a.copy_to)
            _bundle(results, dev, Path(a.copy_to))
    print(f"\n{len(steps) - failed}/{len(steps)} steps passed; report: {report}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
