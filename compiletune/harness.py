"""lm-evaluation-harness on checkpoint folders: `compiletune eval --tasks` and `train --eval-tasks`.

lm-eval (`pip install "compiletune[eval]"`) loads the checkpoint with its own HF model class,
`lm_eval.models.huggingface.HFLM`: a full folder (a run's `step_N/`, `merged/`, any HF folder)
as `pretrained=FOLDER`; a LoRA step folder as `pretrained=BASE, peft=FOLDER` (its base from
adapter_config.json). It runs `lm_eval.simple_evaluate` on the tasks, and the results (lm-eval's
JSON less the per-sample records) go to `<tasks>.json`:

    RUN/eval/step_N/<tasks>.json     a run's step folder (`compiletune eval`, `--eval-tasks`)
    RUN/eval/lm_eval.jsonl           `--eval-tasks`: one line per evaluated step, its numbers
    DIR/<tasks>.json                 `compiletune eval ... --output DIR`
    ./eval/<folder>/<tasks>.json     any other folder (a base model): under the current folder

`<tasks>` is the task names joined by "+". Nothing here imports torch or lm-eval at module level:
the config checks ask `missing()` before the trainer's imports.
"""

from __future__ import annotations

import contextlib
import gc
import hashlib
import importlib.util
import json
import os
import random
import re
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from compiletune.errors import UserError

INSTALL = 'pip install "compiletune[eval]"'
EVAL_DIR = "eval"  # RUN/eval: lm-eval results of the run's checkpoints
RESULTS_LOG = "lm_eval.jsonl"  # RUN/eval/lm_eval.jsonl: one line of numbers per evaluated step
_HF_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "bf16-mixed": "float32"}


def missing(flag: str = "--tasks") -> str | None:
    """The one line to print when lm-eval is not installed (None when it is)."""
    if importlib.util.find_spec("lm_eval") is None:
        return f"{flag} runs lm-evaluation-harness, which is not installed: {INSTALL}"
    return None


def parse_tasks(text: str, flag: str = "--tasks") -> list[str]:
    """`t1,t2` -> ["t1", "t2"], each name once, none empty."""
    names = [t.strip() for t in text.split(",")]
    if not text.strip() or not all(names):
        raise UserError(f"{flag} {text!r}: pass task names separated by commas, e.g. arc_easy,piqa")
    return list(dict.fromkeys(names))


def file_name(names: list[str]) -> str:
    """`<tasks>.json` for these task names (shortened with a hash when very long)."""
    stem = re.sub(r"[^A-Za-z0-9_.+-]", "_", "+".join(names))
    if len(stem) > 100:
        stem = stem[:80] + "-" + hashlib.sha1(stem.encode()).hexdigest()[:8]
    return stem + ".json"


def run_folder(checkpoint: Path) -> Path | None:
    """The run folder that holds `checkpoint` as one of its step folders (None otherwise)."""
    parent = checkpoint.resolve().parent
    is_step = re.fullmatch(r"step_\d+|merged", checkpoint.resolve().name)
    return parent if is_step and (parent / "config.yaml").is_file() else None


def results_folder(checkpoint: Path, output: str | None = None) -> Path:
    """Where `<tasks>.json` of `checkpoint` goes (see the module docstring)."""
    if output is not None:
        return Path(output)
    run = run_folder(checkpoint)
    if run is not None:
        return run / EVAL_DIR / checkpoint.resolve().name
    folder = checkpoint.resolve()
    if folder.parent.name == "snapshots":  # a Hub model in the HF cache: named by its repo
        return Path(EVAL_DIR) / folder.parent.parent.name.removeprefix("models--")
    return Path(EVAL_DIR) / folder.name


@dataclass
class Tasks:
    """Which tasks to run and how: the names, a folder of task YAMLs of one's own, at most
    `limit` examples per task, the model's batch size."""

    names: list[str]
    include: str | None = None
    limit: int | None = None
    batch_size: int = 8
    _manager: Any = field(default=None, repr=False)

    def manager(self) -> Any:
        """lm-eval's TaskManager that knows every task named (built once; an unknown name is
        refused). The --include-path folder alone when it has them all: indexing lm-eval's own
        thousands of task files takes seconds."""
        if self._manager is not None:
            return self._manager
        if line := missing():
            raise UserError(line)
        if self.include is not None and not Path(self.include).is_dir():
            raise UserError(f"--include-path {self.include} is not a folder of task YAML files")
        if self.limit is not None and self.limit < 1:
            raise UserError(f"--limit must be at least 1, got {self.limit}")
        from lm_eval.tasks import TaskManager  # lazy: an optional dependency

        manager = None
        if self.include is not None:
            manager = TaskManager(include_path=self.include, include_defaults=False)
            if _unknown(manager, self.names):
                manager = None
        manager = manager or TaskManager(include_path=self.include)
        unknown = _unknown(manager, self.names)
        if unknown:
            where = f" or in --include-path {self.include}" if self.include else ""
            raise UserError(
                f"no lm-eval task {unknown[0]!r} among lm-eval's own{where}; see `lm-eval ls "
                "tasks`, or pass --include-path DIR with the task's YAML file"
            )
        self._manager = manager
        return manager

    def run(self, model_args: dict[str, Any], device: str) -> dict[str, Any]:
        """lm-eval's results for a checkpoint (HFLM arguments `model_args`), samples left out.
        Python's, numpy's and torch's random states are as they were before."""
        manager = self.manager()
        import lm_eval  # lazy: an optional dependency
        from lm_eval.models.huggingface import HFLM  # lazy: an optional dependency

        lm = None
        try:
            with _kept_random_state():
                lm = HFLM(**model_args, device=device, batch_size=self.batch_size)
                results = lm_eval.simple_evaluate(
                    model=lm,
                    tasks=self.names,
                    task_manager=manager,
                    limit=self.limit,
                    log_samples=False,
                )
        except (UserError, KeyboardInterrupt):
            raise
        except Exception as e:  # a dataset that cannot be read, a model lm-eval cannot load
            why = " ".join(str(e).split())[:300] or type(e).__name__
            raise UserError(
                f"lm-eval failed on {','.join(self.names)} ({type(e).__name__}: {why})"
            ) from e
        finally:
            del lm
            _free_memory(device)
        results = dict(results or {})
        results.pop("samples", None)
        return results


def _unknown(manager: Any, names: list[str]) -> list[str]:
    known = set(manager.all_tasks)
    return [n for n in names if n not in known and not manager.match_tasks([n])]


@contextlib.contextmanager
def _kept_random_state() -> Iterator[None]:
    """lm-eval seeds Python's, numpy's and torch's generators; a training run's stream (data
    order, dropout) goes on as if it had not run."""
    import numpy as np
    import torch

    state = (random.getstate(), np.random.get_state(), torch.random.get_rng_state())
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    try:
        yield
    finally:
        random.setstate(state[0])
        np.random.set_state(state[1])
        torch.random.set_rng_state(state[2])
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)


def _free_memory(device: str) -> None:
    gc.collect()
    if device.startswith("cuda"):
        import torch

        torch.cuda.empty_cache()


def model_args(checkpoint: Path, dtype: str) -> dict[str, Any]:
    """HFLM's arguments for a checkpoint folder: a full HF folder, or a LoRA adapter folder on
    the base its adapter_config.json names. `dtype`: fp32 | bf16 (compiletune's names)."""
    args: dict[str, Any] = {"dtype": _HF_DTYPES.get(dtype, dtype)}
    if (checkpoint / "config.json").is_file():
        return {"pretrained": str(checkpoint), **args}
    config = checkpoint / "adapter_config.json"
    if not config.is_file():
        raise UserError(
            f"{checkpoint} holds neither config.json nor a LoRA adapter (adapter_config.json); "
            "pass a checkpoint folder (e.g. OUTPUT_DIR/step_N) or an HF model folder"
        )
    try:
        base = json.loads(config.read_text()).get("base_model_name_or_path")
    except (ValueError, AttributeError) as e:
        raise UserError(f"{config} is not a JSON object; restore the adapter's config") from e
    if not isinstance(base, str) or not base or not Path(base).is_dir():
        raise UserError(
            f"{checkpoint} adapts {base!r}, which is not a model folder here (a preset drawn "
            "from a run's seed has none): run lm-eval on the run's --merge export "
            "(OUTPUT_DIR/merged), or set base_model_name_or_path in adapter_config.json to the "
            "base model folder"
        )
    tokenizer_here = any((checkpoint / n).is_file() for n in ("tokenizer.json", "tokenizer.model"))
    args.update(pretrained=base, peft=str(checkpoint))
    if tokenizer_here:
        args["tokenizer"] = str(checkpoint)
    return args


def metrics_of(results: dict[str, Any]) -> dict[str, dict[str, float]]:
    """{task: {metric: value}} from lm-eval's results: the numbers, standard errors left out;
    a metric under a filter other than lm-eval's "none" keeps it (`exact_match,strict-match`)."""
    out: dict[str, dict[str, float]] = {}
    for task, values in (results.get("results") or {}).items():
        numbers = {}
        for key, value in values.items():
            metric, _, filt = key.partition(",")
            if not filt or "_stderr" in metric or isinstance(value, bool):
                continue
            if isinstance(value, int | float):
                numbers[metric if filt == "none" else key] = float(value)
        out[task] = numbers
    return out


def summary_lines(results: dict[str, Any]) -> list[str]:
    """One line per task: its metrics, and how many examples were scored."""
    counts = results.get("n-samples") or {}
    lines = []
    for task, numbers in metrics_of(results).items():
        shown = ", ".join(f"{k} {v:.4f}" for k, v in numbers.items()) or "no metrics"
        n = (counts.get(task) or {}).get("effective")
        lines.append(f"lm-eval {task}: {shown}" + (f" ({n} examples)" if n is not None else ""))
    return lines


def write_json(path: Path, obj: Any) -> None:
    """Write `obj` as JSON to `path` whole (a temporary file renamed over it)."""
    from lm_eval.utils import handle_non_serializable  # lazy: an optional dependency

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(obj, indent=2, default=handle_non_serializable) + "\n")
    os.replace(tmp, path)


def evaluate_checkpoint(
    tasks: Tasks, checkpoint: Path, dtype: str, device: str, folder: Path, step: int | None = None
) -> tuple[dict[str, Any], Path]:
    """Run the tasks on `checkpoint` and write `folder/<tasks>.json`; returns (the results,
    the file)."""
    results = tasks.run(model_args(checkpoint, dtype), device)
    results["compiletune"] = {
        "checkpoint": str(checkpoint),
        "step": step,
        "tasks": tasks.names,
        "limit": tasks.limit,
        "dtype": dtype,
    }
    path = folder / file_name(tasks.names)
    write_json(path, results)
    return results, path


class TrainingTasks:
    """`train --eval-tasks`: lm-eval on the checkpoints saved at multiples of
    --eval-tasks-every (a multiple of --save-every) and on the final one, into OUTPUT_DIR/eval/.
    The task names are checked when this is made, before the run writes anything."""

    def __init__(self, cfg: Any, out: Path, say: Callable[[str], None]) -> None:
        r = cfg.run
        names = parse_tasks(r.eval_tasks, "--eval-tasks")
        self.tasks = Tasks(names, r.eval_tasks_include, r.eval_tasks_limit, cfg.data.batch_size)
        self.tasks.manager()
        self.every, self.out, self.say = r.eval_tasks_every, out, say
        self.done: set[int] = set()

    def due(self, step: int, final: bool) -> bool:
        return step not in self.done and (final or bool(self.every and step % self.every == 0))

    def run(self, checkpoint: Path, step: int, dtype: str, device: str) -> float:
        """Evaluate one saved checkpoint; returns the seconds it took. A failure of lm-eval is
        a warning line: the run goes on."""
        t0 = time.perf_counter()
        self.done.add(step)
        folder = self.out / EVAL_DIR / checkpoint.name
        try:
            results, path = evaluate_checkpoint(self.tasks, checkpoint, dtype, device, folder, step)
        except UserError as e:
            self.say(f"warning: step {step}: {e}; training goes on")
            return time.perf_counter() - t0
        numbers = {
            f"lm_eval/{task}/{metric}": value
            for task, values in metrics_of(results).items()
            for metric, value in values.items()
        }
        self._append({"step": step, "checkpoint": checkpoint.name, **numbers})
        for line in summary_lines(results):
            self.say(f"step {step}: {line}")
        self.say(f"step {step}: lm-eval results in {path}")
        return time.perf_counter() - t0

    def _append(self, record: dict[str, Any]) -> None:
        """Add `record` to OUTPUT_DIR/eval/lm_eval.jsonl, in place of the lines of this step and
        later ones (a resumed run evaluates those steps again)."""
        path = self.out / EVAL_DIR / RESULTS_LOG
        kept = []
        if path.is_file():
            for line in path.read_text().splitlines():
                with contextlib.suppress(ValueError):
                    if json.loads(line).get("step", 0) < record["step"]:
                        kept.append(line)
        kept.append(json.dumps(record))
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text("\n".join(kept) + "\n")
        os.replace(tmp, path)
