"""`compiletune eval CHECKPOINT`: a checkpoint's held-out loss, and lm-evaluation-harness tasks.

    --data SOURCE   the mean loss per target token (and its perplexity) over SOURCE, read,
                    masked and packed as training reads --eval-data (`train/inputs.py`), through
                    the training loop's own `evaluate` (`train/step.py`). When CHECKPOINT is a
                    step folder of a run, the run's config.yaml gives the choices that shape
                    the rows (seq-len, packing, document masking, layout, ...) unless flags
                    say otherwise, so the number is the run's `eval_loss` on that data.
    --tasks T1,T2   lm-eval on the folder (`harness.py`), results in `<tasks>.json`.

CHECKPOINT is an HF model folder (a base model, a run's `step_N/` or `merged/`) or a LoRA step
folder (adapter_config.json + adapter weights; its base loaded as `compiletune generate` loads
it). Nothing is written except lm-eval's results and, with --output DIR, `DIR/loss.json`.
"""

from __future__ import annotations

import json
import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from compiletune import harness
from compiletune.checkpoint import adapter_io
from compiletune.checkpoint.steps import is_sharded
from compiletune.config import RunFacts, fill_defaults, read_saved_config, resolve
from compiletune.data.tokenizer import load_tokenizer
from compiletune.errors import UserError
from compiletune.generate import adapter_base, load_lora_checkpoint
from compiletune.models import from_hf, resolve_model_path
from compiletune.progress import Progress
from compiletune.train.device import pick_device, pick_dtype
from compiletune.train.inputs import build_eval_set
from compiletune.train.step import evaluate

# The choices of a run (its config.yaml) that shape its held-out rows: `eval` on one of its
# step folders takes them unless a flag says otherwise.
FROM_RUN = (
    "data_format",
    "data_columns",
    "data_roles",
    "doc_mask",
    "packing",
    "truncation",
    "seq_len",
    "batch_size",
    "loss",
)
LOSS_FILE = "loss.json"


@dataclass
class Checkpoint:
    """A folder to evaluate: full weights or a LoRA adapter, and the run it came from."""

    folder: Path
    lora: bool
    saved: dict[str, Any] = field(default_factory=dict)  # the run's config ({}: not a run's)
    base: Path | None = None  # a LoRA adapter's base folder (None: a preset, redrawn)


def open_checkpoint(name: str) -> Checkpoint:
    """CHECKPOINT checked: a folder with config.json or a LoRA adapter, else one line."""
    folder = resolve_model_path(name, "CHECKPOINT")
    if not folder.is_dir():
        raise UserError(f"CHECKPOINT {name} is a file; pass the checkpoint's folder")
    lora = adapter_io.is_adapter_folder(folder) and not (folder / "config.json").is_file()
    if not lora and not (folder / "config.json").is_file():
        hint = ""
        if (folder / "config.yaml").is_file():
            hint = " (it is a run folder: pass one of its step_N folders)"
        elif is_sharded(folder):
            hint = f" (a sharded --fsdp checkpoint: `compiletune convert {name} NEW_DIR` first)"
        raise UserError(
            f"CHECKPOINT {name} holds neither config.json nor a LoRA adapter "
            f"(adapter_config.json){hint}; pass a checkpoint folder (e.g. OUTPUT_DIR/step_N) or "
            "an HF model folder"
        )
    if not lora and is_sharded(folder) and not any(folder.glob("model*.safetensors")):
        # a whole --fsdp checkpoint (the export is written at the run's end only): its weights
        # are in torch.distributed.checkpoint's files, which `convert` turns into an HF folder
        hf = folder.parent / f"{folder.name}_hf"
        raise UserError(
            f"CHECKPOINT {name} is a sharded (--fsdp) checkpoint: its weights are in "
            f"{folder / 'sharded'}, which eval does not read; turn it into an HF folder with "
            f"`compiletune convert {folder} {hf}` and evaluate {hf}"
        )
    run = harness.run_folder(folder)
    saved = (read_saved_config(run) or {}) if run is not None else {}
    if not lora:
        return Checkpoint(folder, False, saved)
    base, state_config = adapter_base(folder)
    return Checkpoint(folder, True, state_config or saved, base)


def _dtype_name(dtype: torch.dtype) -> str:
    return {torch.float32: "fp32", torch.bfloat16: "bf16"}.get(dtype, str(dtype))


def eval_loss(
    ckpt: Checkpoint,
    flags: dict[str, Any],
    dtype_name: str | None = None,
    tokenizer_dir: str | None = None,
    max_examples: int | None = None,
    say: Callable[[str], None] = print,
) -> dict[str, Any]:
    """The held-out loss of `ckpt` on `flags["data"]` (with the data flags given)."""
    if max_examples is not None and max_examples < 1:
        raise UserError(f"--max-examples must be at least 1, got {max_examples}")
    t0 = time.perf_counter()
    values = {k: ckpt.saved[k] for k in FROM_RUN if ckpt.saved.get(k) is not None}
    split = ckpt.saved.get("eval_split") or ckpt.saved.get("data_split")
    if split is not None:  # the split the run read its held-out data from
        values["data_split"] = split
    cfg = resolve({}, {**values, **flags})
    device = pick_device()
    dtype = pick_dtype(dtype_name or ckpt.saved.get("dtype"), device)
    # said at once: loading, tokenising and the forwards can take minutes, none of it shown yet
    say(
        f"eval: {ckpt.folder} on {cfg.data.source} ({_dtype_name(dtype)} on {device.type}): "
        "loading the model and reading the data"
    )
    if tokenizer_dir is None:
        has = any((ckpt.folder / n).is_file() for n in ("tokenizer.json", "tokenizer_config.json"))
        tokenizer_dir = str(ckpt.folder if has or ckpt.base is None else ckpt.base)
    tokenizer = load_tokenizer(tokenizer_dir, "--tokenizer")
    if ckpt.lora:
        model = load_lora_checkpoint(ckpt.folder, dtype, device, (ckpt.base, ckpt.saved))
    else:
        model = from_hf(ckpt.folder, dtype=dtype, device=device)
    args = model.args
    if cfg.data.seq_len > args.max_seq_len:
        raise UserError(
            f"--seq-len {cfg.data.seq_len} is beyond the model's {args.max_seq_len} positions; "
            f"pass --seq-len {args.max_seq_len} or less"
        )
    data, examples = build_eval_set(cfg, tokenizer, say, args.vocab_size, max_examples)
    packs = getattr(data, "packs_documents", lambda: False)()
    fill_defaults(cfg, RunFacts(args.vocab_size, packs_documents=packs))
    d = cfg.data
    batches = -(-data.rows // d.batch_size)
    say(
        f"eval: {examples:,} examples in {data.rows:,} rows of {d.seq_len} tokens, "
        f"{batches:,} batches of {d.batch_size}"
    )
    with Progress("eval", batches, "batches", say) as bar:
        result = evaluate(
            model,
            data,
            cfg.techniques.loss,
            d.batch_size,
            device,
            bool(d.doc_mask),
            on_batch=bar.update,
        )
    return {
        "checkpoint": str(ckpt.folder),
        "data": d.source,
        "loss": result["eval_loss"],
        "ppl": result["eval_ppl"],
        "targets": result["eval_targets"],
        "examples": examples,
        "rows": data.rows,
        "seq_len": d.seq_len,
        "packing": d.packing,
        "doc_mask": bool(d.doc_mask),
        "loss_head": cfg.techniques.loss,
        "dtype": _dtype_name(dtype),
        "seconds": round(time.perf_counter() - t0, 2),
    }


def loss_line(r: dict[str, Any]) -> str:
    """The one summary line of a held-out loss."""
    ppl = f"{r['ppl']:.4g}" if math.isfinite(r["ppl"]) else "inf"
    return (
        f"{r['checkpoint']} on {r['data']}: loss {r['loss']:.4f}, ppl {ppl} over "
        f"{r['targets']:,} target tokens ({r['examples']:,} examples in {r['rows']:,} rows of "
        f"{r['seq_len']} tokens{', document-masked' if r['doc_mask'] else ''}; {r['dtype']}), "
        f"{r['seconds']:.1f}s"
    )


def _to_stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def run_eval(
    checkpoint: str,
    flags: dict[str, Any],
    *,
    tasks: str | None = None,
    include_path: str | None = None,
    limit: int | None = None,
    max_examples: int | None = None,
    dtype: str | None = None,
    tokenizer: str | None = None,
    output: str | None = None,
    as_json: bool = False,
    out: Callable[[str], None] = print,
) -> dict[str, Any]:
    """The `compiletune eval` command; returns what it printed as JSON (for tests)."""
    if "data" not in flags and tasks is None:
        raise UserError(
            "compiletune eval: pass --data SOURCE (held-out loss and perplexity) and/or "
            "--tasks T1,T2 (lm-evaluation-harness)"
        )
    task_set = None
    if tasks is not None:  # checked before any model loads
        names = harness.parse_tasks(tasks)
        batch = flags.get("batch_size", 8)
        task_set = harness.Tasks(names, include_path, limit, batch)
        task_set.manager()
    elif include_path is not None or limit is not None:
        raise UserError("--include-path and --limit apply to --tasks; add --tasks or drop them")
    ckpt = open_checkpoint(checkpoint)
    report: dict[str, Any] = {}
    if "data" in flags:
        report = eval_loss(ckpt, flags, dtype, tokenizer, max_examples, _to_stderr)
        if output is not None:
            _write(Path(output) / LOSS_FILE, report)
        if not as_json:
            out(loss_line(report))
    elif max_examples is not None:
        raise UserError("--max-examples limits --data; add --data or drop it")
    if task_set is not None:
        device = str(pick_device())
        dtype_name = dtype or _dtype_name(pick_dtype(ckpt.saved.get("dtype"), pick_device()))
        folder = harness.results_folder(ckpt.folder, output)
        results, path = harness.evaluate_checkpoint(
            task_set, ckpt.folder, dtype_name, device, folder
        )
        report.update(
            checkpoint=str(ckpt.folder), tasks=harness.metrics_of(results), tasks_file=str(path)
        )
        if not as_json:
            for line in harness.summary_lines(results):
                out(line)
            out(f"wrote {path}")
    if as_json:
        out(json.dumps(report, indent=2))
    return report


def _write(path: Path, obj: dict[str, Any]) -> None:
    """`obj` as JSON at `path`, whole (a temporary file renamed over it)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(obj, indent=2) + "\n")
    tmp.replace(path)
