"""Command line: `compiletune train | generate | eval | estimate-memory | models | configs | convert | plot | export`.

Flags override `--config run.yaml`, which overrides the defaults in `config.TrainConfig`.
Bad input prints one line, `compiletune: error: ...`, and exits with code 2.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from compiletune import __version__
from compiletune.choices import BaseDtype, choices
from compiletune.config import TrainConfig, add_flags, check_inputs, check_model_folder
from compiletune.errors import UserError, closest, show
from compiletune.interrupt import EXIT_INTERRUPTED
from compiletune.sampling import (  # no torch: cheap at start-up
    Sampling,
    check_image_prompt,
    check_prompt,
)

if TYPE_CHECKING:  # annotations only: the estimator loads with its subcommand
    from compiletune.estimate.fit.capacity import Capacity

EXIT_BAD_INPUT = 2
_STARTED = time.perf_counter()  # as soon as the command's own code runs (the closing lines' time)


class _Parser(argparse.ArgumentParser):
    """argparse that reports a bad flag in one line instead of the whole usage block, and takes
    only whole flag names: `--max-step 3` is refused, not run as `--max-steps 3`."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]

    def error(self, message: str) -> None:  # type: ignore[override]
        choice = re.search(r"invalid choice: '([^']*)' \(choose from (.*)\)", message)
        if choice and (near := closest(choice[1], re.findall(r"'([^']*)'", choice[2]))):
            message += f"; did you mean '{near}'?"
        sys.stderr.write(f"compiletune: error: {message} (see `{self.prog} --help`)\n")
        raise SystemExit(EXIT_BAD_INPUT)

    def parse_args(self, args=None, namespace=None):  # type: ignore[override]
        """As argparse's, with the nearest flag of the command named for a mistyped one."""
        ns, extras = self.parse_known_args(args, namespace)
        if extras:
            self.error(f"unrecognized arguments: {' '.join(extras)}{_near_flag(self, ns, extras)}")
        return ns


# Other trainers' names for our flags (transformers' TrainingArguments, torchtune, axolotl):
# a user who types one is told ours.
_FLAG_SYNONYMS = {
    "--learning-rate": "--lr",
    "--num-epochs": "--epochs",
    "--num-train-epochs": "--epochs",
    "--max-length": "--seq-len",
    "--max-seq-length": "--seq-len",
    "--sequence-len": "--seq-len",
    "--gradient-accumulation-steps": "--grad-accum",
    "--per-device-train-batch-size": "--batch-size",
    "--micro-batch-size": "--batch-size",
    "--model-name-or-path": "--model-dir",
    "--dataset": "--data",
    "--warmup": "--warmup-steps",
    "--lr-scheduler-type": "--schedule",
    "--gradient-checkpointing": "--ac",
    "--lora-r": "--lora-rank",
}


def _near_flag(parser: argparse.ArgumentParser, ns: argparse.Namespace, extras: list[str]) -> str:
    """ "; did you mean '--lr'?" for the first unknown flag of `extras` near one of the command's
    flags (or another trainer's name for one), else ""."""
    command = getattr(ns, "command", None)
    sub = parser._subparsers._group_actions[0].choices.get(command) if parser._subparsers else None
    flags = {s for a in (sub or parser)._actions for s in a.option_strings if s.startswith("--")}
    known = {**{f: f for f in flags}, **{k: v for k, v in _FLAG_SYNONYMS.items() if v in flags}}
    for extra in extras:
        typed = extra.split("=", 1)[0]
        if typed.startswith("--") and (near := closest(typed, known)):
            return f"; did you mean {known[near]}?"
    return ""


def _add_train_flags(p: argparse.ArgumentParser, *, estimate_only: bool = False) -> None:
    p.add_argument("--config", default=None, help="YAML run file; flags override it")
    add_flags(p, estimate_only=estimate_only)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="compiletune", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"compiletune {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    train = sub.add_parser("train", help="fine-tune or train a model")
    _add_train_flags(train)
    generate = sub.add_parser("generate", help="generate text from a checkpoint (KV cache)")
    _add_generate_flags(generate)
    evaluate = sub.add_parser(
        "eval",
        help="a checkpoint's held-out loss and perplexity (--data) and lm-eval tasks (--tasks)",
        description="Evaluate a checkpoint folder (an HF model folder, a run's step_N, or a LoRA "
        "step folder): with --data, the mean loss per target token and its perplexity, masked "
        "and packed as training does (a run's step folder takes the run's config.yaml choices "
        "unless flags say otherwise); with --tasks, lm-evaluation-harness tasks "
        '(pip install "compiletune[eval]"). See docs/eval.md.',
    )
    _add_eval_flags(evaluate)
    est = sub.add_parser(
        "estimate-memory",
        help="predict a training step's peak GPU memory (no GPU needed)",
        description="Run one training step on fake tensors (no memory) as rank 0 of --gpus "
        "ranks and report its peak GPU memory by part; takes the technique flags of `train`.",
    )
    _add_train_flags(est, estimate_only=True)
    g = est.add_argument_group("estimate")
    g.add_argument("--gpus", type=int, default=1, help="GPUs (FSDP2 ranks) to shard over")
    g.add_argument(
        "--device-memory",
        default=None,
        metavar="GIB|GPU",
        help="GPU memory to check against: GiB (80) or a name (h100, a100-40, h200, ...)",
    )
    g.add_argument(
        "--host-memory",
        type=float,
        default=None,
        metavar="GIB",
        help="host memory of one machine, for what --cpu-offload and offloading keep there "
        "(default: this machine's)",
    )
    g.add_argument("--ladder", action="store_true", help="print the technique ladder (markdown)")
    g.add_argument(
        "--max-seq-len",
        action="store_true",
        help="find the longest --seq-len that fits --device-memory (a search over the estimate)",
    )
    g.add_argument("--json", action="store_true", help="print JSON instead of text")
    sub.add_parser("models", help="list the model presets with parameter counts")
    configs = sub.add_parser(
        "configs",
        help="list the shipped recipes; `configs show NAME`, `configs copy NAME PATH`",
        description="Shipped recipes: YAML run files for common model x technique x GPU cases, "
        "each checked by estimate-memory to fit its GPUs. Run one with `compiletune train "
        "--config NAME` (flags override it) after setting its <placeholders>.",
    )
    configs.add_argument("action", nargs="?", choices=("list", "show", "copy"), default="list")
    configs.add_argument("name", nargs="?", help="a recipe name (show, copy)")
    configs.add_argument("path", nargs="?", help="where to copy it (copy)")
    _add_cache_parser(sub)
    convert = sub.add_parser("convert", help="turn a sharded (--fsdp) checkpoint into an HF folder")
    convert.add_argument("checkpoint", help="a step_N folder of an --fsdp run")
    convert.add_argument("output", help="new folder for the HF checkpoint")
    convert.add_argument(
        "--dtype", choices=choices(BaseDtype), default=None, help="default: as saved"
    )
    plot = sub.add_parser(
        "plot",
        help="chart runs' metrics.jsonl: a PNG and an HTML page (needs matplotlib)",
        description="Draw each run folder's metrics.jsonl (loss with eval points, lr, tokens/s, "
        "peak memory, gradient norm, the objective's metrics) into a PNG and an HTML page "
        "beside it; several runs share the panels. Needs matplotlib: "
        'pip install "compiletune[plot]".',
    )
    plot.add_argument("runs", nargs="+", metavar="RUN_DIR", help="a run's --output-dir")
    plot.add_argument(
        "-o",
        "--output",
        default=None,
        metavar="PATH.png",
        help="default: RUN_DIR/plot.png for one run (needed for several); the page is PATH.html",
    )
    export = sub.add_parser(
        "export",
        help="write a checkpoint as a GGUF file for llama.cpp / Ollama / LM Studio",
        description="Write a checkpoint folder (a run's step_N or merged/; a LoRA step is merged "
        "first) as one GGUF file: f16, or q8_0 (8-bit). Needs the gguf package: "
        "pip install 'compiletune[gguf]'. See docs/export.md.",
    )
    export.add_argument("checkpoint", metavar="STEP_DIR", help="a run's step_N or merged/ folder")
    export.add_argument("--gguf", required=True, choices=("f16", "q8_0"), help="tensor type")
    export.add_argument(
        "-o", "--output", default=None, metavar="OUT.gguf", help="default: STEP_DIR-KIND.gguf"
    )
    return parser


def _add_cache_parser(sub: argparse._SubParsersAction) -> None:
    """`compiletune cache [list|verify|clear] [KEY ...]`: alone, it lists."""
    cache = sub.add_parser(
        "cache",
        help="the token cache: `cache [list]`, `cache verify [KEY ...]`, `cache clear [KEY ...]`",
        description="Entries of the token cache (tokenised data sources, see --cache-dir). "
        "verify re-hashes every file of each entry against its recorded checksums and exits 1 "
        "when one is damaged (training rebuilds a damaged entry by itself); clear removes "
        "entries (all of them without KEY).",
    )
    cache.add_argument(
        "action",
        nargs="?",
        choices=("list", "verify", "clear"),
        default="list",
        help="default: list",
    )
    cache.add_argument("keys", nargs="*", metavar="KEY", help="entries (default: every one)")
    cache.add_argument("--cache-dir", default=None, help="default: as `train` finds it")


def _add_generate_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model-dir", required=True, help="checkpoint (OUTPUT_DIR/step_N) or HF folder")
    p.add_argument("--prompt", default=None, help="text to continue (with --chat: one user turn)")
    p.add_argument(
        "--chat", action="store_true", help="apply the chat template; without --prompt, read stdin"
    )
    p.add_argument(
        "--image",
        default=None,
        metavar="FILE",
        help="an image the --prompt asks about (vision-language checkpoints; chat template)",
    )
    p.add_argument("--max-new-tokens", type=int, default=128, help="default 128")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling (with --temperature)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")
    p.add_argument("--tokenizer", default=None, help="tokenizer folder (default: --model-dir)")
    p.add_argument("--dtype", choices=choices(BaseDtype), default=None, help="default: bf16 on GPU")


# The config fields `eval` takes as flags: how --data is read, masked and packed.
_EVAL_DATA_KEYS = (
    "data_format",
    "data_columns",
    "data_roles",
    "data_split",
    "cache_dir",
    "data_workers",
    "doc_mask",
    "packing",
    "truncation",
    "seq_len",
    "batch_size",
)
_EVAL_OWN = ("command", "checkpoint", "tasks", "include_path", "limit", "max_examples", "dtype")
_EVAL_OWN += ("tokenizer", "output", "json")


def _add_eval_flags(p: argparse.ArgumentParser) -> None:
    S = argparse.SUPPRESS
    p.add_argument("checkpoint", metavar="CHECKPOINT", help="HF model folder or a run's step_N")
    p.add_argument("--data", default=S, metavar="SOURCE", help="held-out data (as train's --data)")
    p.add_argument("--max-examples", type=int, metavar="N", help="the first N examples of --data")
    p.add_argument("--tasks", default=None, metavar="T1,T2", help="lm-evaluation-harness tasks")
    p.add_argument("--include-path", default=None, metavar="DIR", help="lm-eval task YAMLs here")
    p.add_argument("--limit", type=int, metavar="N", help="--tasks: at most N examples per task")
    p.add_argument("--tokenizer", metavar="DIR", help="tokenizer folder (default: CHECKPOINT)")
    p.add_argument("--dtype", choices=choices(BaseDtype), default=None, help="default: as trained")
    p.add_argument("--output", default=None, metavar="DIR", help="write loss.json / <tasks>.json")
    p.add_argument("--json", action="store_true", help="print JSON instead of text")
    add_flags(p, only=_EVAL_DATA_KEYS)


def _cmd_eval(ns: argparse.Namespace) -> int:
    flags = {k: v for k, v in vars(ns).items() if k not in _EVAL_OWN}
    check_model_folder(ns.checkpoint, "CHECKPOINT")  # before the evaluator's imports
    from compiletune.evaluation import run_eval  # lazy: a subcommand's cost

    run_eval(
        ns.checkpoint,
        flags,
        tasks=ns.tasks,
        include_path=ns.include_path,
        limit=ns.limit,
        max_examples=ns.max_examples,
        dtype=ns.dtype,
        tokenizer=ns.tokenizer,
        output=ns.output,
        as_json=ns.json,
    )
    return 0


def _cmd_generate(ns: argparse.Namespace) -> int:
    # what the user typed, checked before the heavy imports
    sampling = Sampling(ns.temperature, ns.top_p, ns.seed)
    sampling.check(ns.max_new_tokens)
    check_prompt(ns.prompt, ns.chat)
    check_model_folder(ns.model_dir, "--model-dir")
    if ns.tokenizer is not None:
        check_model_folder(ns.tokenizer, "--tokenizer")
    if ns.image is not None:
        check_image_prompt(ns.image, ns.prompt)
    from compiletune.generate import run_generate  # lazy: a subcommand's cost

    run_generate(
        ns.model_dir,
        ns.prompt,
        ns.chat,
        ns.max_new_tokens,
        sampling,
        tokenizer_dir=ns.tokenizer,
        dtype_name=ns.dtype,
        image=ns.image,
    )
    return 0


def _resolve(ns: argparse.Namespace, flags: dict) -> TrainConfig:
    """--config (a YAML file, or the name of a shipped recipe) under the flags typed."""
    from compiletune.config import load_yaml, resolve  # lazy: a subcommand's cost

    return resolve(load_yaml(ns.config) if ns.config else {}, flags)


def _cmd_train(ns: argparse.Namespace) -> int:
    flags = {k: v for k, v in vars(ns).items() if k not in ("command", "config")}
    cfg = _resolve(ns, flags)  # a wrong value is reported before the trainer's imports
    check_inputs(cfg)  # and a missing file or folder
    from compiletune import before_train  # lazy: a subcommand's cost (seconds of imports)
    from compiletune.train.loop import train  # lazy: as above

    cfg, estimate_gib = before_train.prepare(cfg)  # on a GPU: the plan and the pre-flight
    summary = train(cfg, estimate_gib)
    return EXIT_INTERRUPTED if summary["interrupted"] else 0


def _to_stderr(line: str) -> None:
    """Progress of a long search: on stderr, so --json's stdout stays one document."""
    print(line, file=sys.stderr, flush=True)


def _longest_seq_len(ns: argparse.Namespace, cfg: TrainConfig, capacity: Capacity) -> int:
    """`estimate-memory --max-seq-len [--ladder]`: the longest --seq-len that fits, searched over
    the estimate (each search bounded in its number of estimates)."""
    import json

    from compiletune.estimate.fit import ladder, printing  # lazy: a subcommand's cost

    gib = f"{capacity.device_bytes / 2**30:g} GiB"
    if ns.ladder:
        _to_stderr(
            f"searching the longest --seq-len that fits {gib} as configured and with each "
            f"rung (at most {ladder.LADDER_ESTIMATES} estimates)..."
        )
        rows = ladder.length_ladder(cfg, ns.gpus, capacity, _to_stderr)
        if ns.json:
            out = [
                {"rung": r.name, "flags": r.flags, "max_seq_len": r.longest}
                | ({"why": r.why} if r.why else {})
                for r in rows
            ]
            print(json.dumps(out, indent=2))
        else:
            print(printing.format_length_ladder(rows, ladder.positions(cfg)))
        return 0
    bound = ladder.Bound(ladder.SEARCH_ESTIMATES)
    _to_stderr(
        f"searching the longest --seq-len that fits {gib} (at most {bound.limit} estimates)..."
    )
    longest, est = ladder.longest_seq_len(
        cfg, ns.gpus, capacity, _to_stderr, ladder.MEMORY_LIMIT, bound=bound
    )
    positions = ladder.positions(cfg)
    cut = f"the search stopped at its bound of {bound.limit} estimates: a longer --seq-len may fit"
    if ns.json:
        out = {"max_seq_len": min(longest, positions), "memory_max_seq_len": longest}
        out |= {"search_cut": cut} if bound.cut else {}
        print(json.dumps({**out, **(est.to_dict() if est is not None else {})}, indent=2))
    elif est is None:
        print(printing.no_length_line(capacity))
    else:
        print(printing.longest_line(longest, est, positions, capacity))
    if bound.cut and not ns.json:
        print(cut)
    return 0


def _plan_offload(cfg: TrainConfig, gpus: int, capacity: Capacity) -> TrainConfig:
    """--offload-activations auto as the number of blocks that fits `capacity` (the plan's
    estimates on stderr; the estimate printed after is the plan's)."""
    from compiletune.estimate.offload_plan import plan_offload  # lazy: a subcommand's cost

    return plan_offload(cfg, gpus, capacity, _to_stderr)[0]


def _cmd_estimate(ns: argparse.Namespace) -> int:
    import json

    own = ("command", "config", "gpus", "device_memory", "host_memory", "ladder", "json")
    own += ("max_seq_len",)
    flags = {k: v for k, v in vars(ns).items() if k not in own}
    if ns.gpus < 1:
        raise UserError(f"--gpus must be at least 1, got {ns.gpus}")
    if ns.host_memory is not None and not 0 < ns.host_memory < float("inf"):
        raise UserError(f"--host-memory {ns.host_memory}: pass this machine's GiB (e.g. 512)")
    if ns.host_memory is not None and not ns.device_memory:
        raise UserError("--host-memory is judged with --device-memory; pass both")
    if ns.max_seq_len and not ns.device_memory:
        raise UserError(
            "--max-seq-len searches for the longest --seq-len that fits --device-memory; "
            "pass --device-memory GIB|GPU (e.g. 80 or h100)"
        )
    if ns.gpus > 1:
        flags["fsdp"] = True  # several GPUs train under torchrun with --fsdp
    cfg = _resolve(ns, flags)  # a wrong value is reported before the estimator's imports
    if cfg.techniques.offload_activations.auto and not ns.device_memory:
        raise UserError(
            "--offload-activations auto picks the fewest blocks that fit --device-memory; pass "
            "--device-memory GIB|GPU (e.g. 24 or h100), or a number of blocks"
        )
    check_inputs(cfg, estimate=True)  # and a missing model or teacher folder
    from compiletune.estimate import estimator as est_  # lazy: a subcommand's cost
    from compiletune.estimate import expert_parallel as ep_  # lazy: a subcommand's cost
    from compiletune.estimate.fit import advice, ladder, printing  # lazy: a subcommand's cost
    from compiletune.estimate.fit.capacity import (  # lazy: a subcommand's cost
        Capacity,
        fits,
        parse_device_memory,
    )
    from compiletune.hardware import machine_host_bytes  # lazy: a subcommand's cost
    from compiletune.train.build_model import resolve_model_args  # lazy: a subcommand's cost

    # config.json's own errors are the one line, before any progress line
    n_layers = resolve_model_args(est_.shapes_only(cfg)).n_layers
    if not cfg.techniques.offload_activations.auto:  # and a count past the model's blocks
        cfg.techniques.offload_activations.count(n_layers)
    capacity = None
    if ns.device_memory:
        host = ns.host_memory * 2**30 if ns.host_memory else machine_host_bytes()
        capacity = Capacity(parse_device_memory(ns.device_memory), int(host))
        cfg = _plan_offload(cfg, ns.gpus, capacity)
    if ns.max_seq_len and capacity is not None:
        return _longest_seq_len(ns, cfg, capacity)
    if ns.ladder:
        rows = ladder.ladder(cfg, ns.gpus, _to_stderr)
        if ns.json:
            out = [
                {"rung": r.name, "flags": r.flags, **(r.est.to_dict() if r.est else {"why": r.why})}
                for r in rows
            ]
            print(json.dumps(out, indent=2))
        else:
            print(printing.format_ladder(rows, capacity))
        return 0
    # With a capacity the advice may follow: its first rungs come from this step.
    also = ladder.search_optimizers(cfg) if capacity is not None else ()
    _to_stderr("estimating one training step on fake tensors...")  # seconds for a large model
    est = est_.estimate_memory(cfg, ns.gpus, also=also)
    if (flat := ep_.uniform_config(cfg)) is not None:  # --ep: uniform routing beside
        uniform = est_.estimate_memory(flat, ns.gpus).peak_bytes
        est.notes.append(ep_.uniform_line(cfg, est.peak_bytes, uniform))
    fix = None
    if capacity is not None and not fits(est, capacity):
        print(
            "does not fit; estimating the ladder's rungs for the cheapest fix...", file=sys.stderr
        )
        fix = advice.advice(cfg, ns.gpus, capacity, _to_stderr)
    if ns.json:
        out = est.to_dict()
        if capacity is not None:
            out.update(fits=fix is None, to_fit=fix)
        out["total_seconds"] = round(time.perf_counter() - _STARTED, 2)
        print(json.dumps(out, indent=2))
    else:
        print(printing.format_estimate(est, capacity, fix, time.perf_counter() - _STARTED))
    return 0


def _cmd_models(ns: argparse.Namespace) -> int:
    from compiletune.models import PRESETS, num_params, params_text  # lazy: a subcommand's cost

    print(
        f"{'preset':<16} {'params':>10}  {'layers':>6} {'dim':>6} {'heads':>5} {'kv':>3} {'vocab':>7}"
    )
    for name, a in PRESETS.items():
        size = params_text(num_params(a))
        print(
            f"{name:<16} {size:>10}  {a.n_layers:>6} {a.dim:>6} {a.n_heads:>5} "
            f"{a.n_kv_heads:>3} {a.vocab_size:>7}"
        )
    return 0


def _cmd_configs(ns: argparse.Namespace) -> int:
    from compiletune import recipes  # lazy: a subcommand's cost

    if ns.action == "list":
        if ns.name:
            raise UserError(
                f"configs: unexpected '{ns.name}'; did you mean `configs show {ns.name}`?"
            )
        print(recipes.format_table(recipes.all_recipes()))
        return 0
    if not ns.name:
        raise UserError(f"configs {ns.action}: name a recipe (see `compiletune configs`)")
    recipe = recipes.get(ns.name)
    if ns.action == "show":
        print(recipe.path.read_text(), end="")
        return 0
    if not ns.path:
        raise UserError("configs copy: give the path to copy to, e.g. run.yaml")
    dest = Path(ns.path)
    if dest.is_dir():
        dest = dest / recipe.path.name
    if dest.exists():
        raise UserError(f"configs copy: {dest} exists; pick another path or remove it first")
    try:
        dest.write_text(recipe.path.read_text())
    except OSError as e:
        raise UserError(f"configs copy: cannot write {dest} ({e.strerror})") from e
    print(f"wrote {dest}; set its <placeholders>, then `compiletune train --config {dest}`")
    return 0


def _cmd_cache(ns: argparse.Namespace) -> int:
    import json

    from compiletune.data import token_cache  # lazy: a subcommand's cost

    root = token_cache.cache_root(ns.cache_dir)
    others = token_cache.foreign(ns.cache_dir)  # a user's folders: shown, never deleted
    if ns.action == "clear":
        removed = token_cache.clear(ns.cache_dir, ns.keys)
        print(f"removed {len(removed)} entr{'y' if len(removed) == 1 else 'ies'} from {root}")
        if others and not ns.keys:
            names = ", ".join(p.name for p in others[:5]) + (", ..." if len(others) > 5 else "")
            print(
                f"left {len(others)} folder{'s' if len(others) > 1 else ''} that "
                f"{'are' if len(others) > 1 else 'is'} not token cache entries: {names}"
            )
        return 0
    found = token_cache.entries(ns.cache_dir)
    if ns.keys:
        names = {p.name for p in found + others}
        missing = [k for k in ns.keys if k not in names]
        if missing:
            raise UserError(f"no token cache entry {missing[0]} in {root}; see `cache list`")
        found = [p for p in found if p.name in ns.keys]
        others = [p for p in others if p.name in ns.keys]
    if not found and not others:
        print(f"no entries in {root}")
        return 0
    damaged = 0
    for entry in found:
        try:
            meta = json.loads((entry / "meta.json").read_text())
        except (OSError, ValueError):
            meta = {}
        size = sum(f.stat().st_size for f in entry.iterdir() if f.is_file()) / 2**20
        line = (
            f"{entry.name}  {meta.get('source', '?')}  {meta.get('documents', '?')} documents, "
            f"{meta.get('tokens', '?')} tokens, {size:.1f} MiB, {meta.get('created', '?')}"
        )
        if ns.action == "verify":
            problem = token_cache.damage(entry, rehash=True)
            damaged += problem is not None
            line += f"  {'ok' if problem is None else 'DAMAGED: ' + problem}"
        print(line)
    for folder in others:
        print(f"{folder.name}  not a cache entry (compiletune did not write it; left alone)")
    if damaged:
        print(
            f"{damaged} damaged: a training run rebuilds an entry from its source; "
            "`compiletune cache clear KEY` removes one whose source is gone"
        )
    return 1 if damaged else 0


def _cmd_convert(ns: argparse.Namespace) -> int:
    import time

    from compiletune.checkpoint.steps import convert_to_hf  # lazy: a subcommand's cost

    t0 = time.perf_counter()
    out = convert_to_hf(ns.checkpoint, ns.output, ns.dtype)
    size = sum(f.stat().st_size for f in out.glob("*.safetensors")) / 2**30
    print(f"wrote {out} ({size:.2f} GiB of safetensors) in {time.perf_counter() - t0:.1f}s")
    return 0


def _cmd_plot(ns: argparse.Namespace) -> int:
    from compiletune.plot import plot_runs  # lazy: a subcommand's cost

    png, page = plot_runs(ns.runs, ns.output)
    print(f"wrote {png} and {page}")
    return 0


def huge_page_tensors() -> None:
    """Back large CPU tensors with transparent huge pages, unless the user chose otherwise.

    Sets PyTorch's own switch, THP_MEM_ALLOC_ENABLE=1: its CPU allocator then madvises every
    allocation of 2 MiB or more as huge pages, and the kernel backs the 2 MiB-aligned spans
    of each with 2 MiB pages. A training step allocates and frees hundreds of MiB (logits,
    activations, gradients) and, with 4 KiB pages, pays a page fault per 4 KiB on each fresh
    allocation: on this project's 2-core virtual machine that was a fifth of a bf16 step of a
    150M-parameter model. GPU memory is not affected. torch reads the variable once, so it is
    set only while torch is not yet imported (the `compiletune` command); a process that
    imported torch first (a library caller, a test) keeps its environment as it is. An
    explicit THP_MEM_ALLOC_ENABLE=0 keeps 4 KiB pages.
    """
    if "torch" not in sys.modules:
        os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")


def main(argv: Sequence[str] | None = None) -> int:
    if argv is None:  # the program itself (not a caller in Python): Ctrl-C ends start-up at once
        from compiletune.interrupt import exit_on_interrupt  # lazy: before any heavy import

        exit_on_interrupt()
    huge_page_tensors()
    try:
        ns = build_parser().parse_args(argv)
        if ns.command == "train":
            return _cmd_train(ns)
        if ns.command == "convert":
            return _cmd_convert(ns)
        if ns.command == "generate":
            return _cmd_generate(ns)
        if ns.command == "eval":
            return _cmd_eval(ns)
        if ns.command == "estimate-memory":
            return _cmd_estimate(ns)
        if ns.command == "configs":
            return _cmd_configs(ns)
        if ns.command == "cache":
            return _cmd_cache(ns)
        if ns.command == "plot":
            return _cmd_plot(ns)
        if ns.command == "export":
            from compiletune.export_gguf import export_gguf  # lazy: a subcommand's cost

            export_gguf(ns.checkpoint, ns.gguf, ns.output)
            return 0
        return _cmd_models(ns)
    except UserError as e:
        show(e)
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:
        # Ctrl-C before the training loop takes over signals, or a second one during it:
        # whatever was being written is only ever published whole (checkpoint/atomic.py).
        sys.stderr.write("compiletune: interrupted\n")
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        # stdout piped into a reader that stopped (`| head`): not an error of ours
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except OSError as e:
        # A path given by the user (or derived from one) that cannot be read or written: the
        # system's reason and the path, in one line.
        where = f"{e.filename}: " if e.filename else ""
        sys.stderr.write(f"compiletune: error: {where}{e.strerror or e}\n")
        return EXIT_BAD_INPUT
