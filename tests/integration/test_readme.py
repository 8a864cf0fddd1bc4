"""The README's shell commands run as written (issue 62: its `generate` line failed as printed).

Every command of README.md's ```bash blocks is either run here or listed in SKIPPED with the
reason it cannot run on a CPU-only machine without a network (a GPU, several of them, a Hub
download, an install); a new command must be put in one or the other, so none goes unchecked.

Each command runs in a scratch folder that holds what the README assumes the user has: its data
files (chat.jsonl, pairs.jsonl, text.jsonl, held.jsonl) and, under a scratch $HOME, the
`~/models/...` folders, all one tiny Llama. Only the sizes are cut (`--max-steps 2`, rows of at
most 128 tokens, batches of 2), so a command trains for a few seconds; every other flag is the
README's. The commands run in one process through `compiletune.cli.main`, the console script's
own entry point, so torch is imported once.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import sys
import time
from pathlib import Path

import pytest
from pair_data import WORDS, write_pairs
from tiny_hf import save_tiny_llama

from compiletune.cli import main

ROOT = Path(__file__).resolve().parents[2]

# command (as shlex.join writes it, continuation lines joined) -> why it is not run here
SKIPPED = {
    "pip install torch==2.13.0": "installs from the network (CI's .ci/run does, on a clean machine)",
    "pip install -e .": "installs from the network (CI's .ci/run does, on a clean machine)",
    "python -m pytest -q -n auto": "the test suite itself",
    "torchrun --nproc-per-node 8 -m compiletune train --fsdp --cp 8 --seq-len 262144 --ac full ...": (
        "8 GPUs under torchrun, and elided; --cp on CPU processes is "
        "tests/integration/test_context_parallel.py"
    ),
    "torchrun --nproc-per-node 8 -m compiletune train --fsdp --model-dir ./Llama-3.1-8B --data "
    "chat.jsonl --compile --ac selective --batch-size 2 --seq-len 4096": (
        "8 GPUs under torchrun; the same command on gloo CPU processes is tests/integration/test_fsdp.py"
    ),
    "torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint node0:29500 -m "
    "compiletune train --fsdp --sharding hybrid ...": "two nodes of 8 GPUs, and elided",
    "compiletune eval runs/a/step_500 --tasks arc_easy,hellaswag --limit 200": (
        "lm-evaluation-harness downloads the tasks' datasets from the Hub"
    ),
    "compiletune train ... --save-every 500 --eval-tasks arc_easy --eval-tasks-every 1000": (
        "elided, and lm-eval downloads its tasks; --eval-tasks runs are tests/integration/test_eval.py"
    ),
}
# Folders the README's commands name that a user has made before: runs of earlier commands.
RUN_ALIASES = {"runs/a": "runs/llama1b-chat", "runs/b": "runs/llama1b-lora"}
STEPS = 2  # optimizer steps of every run (the README's `--max-steps 800` continues to 3)


def _crash(folder: str) -> None:
    """What the README's `--resume` follows: a run stopped after its step 1 checkpoint."""
    shutil.rmtree(Path(folder) / f"step_{STEPS}")


# command -> what happened before it, in the README's story
BEFORE = {
    "compiletune train --output-dir runs/llama1b-chat --resume": lambda: _crash(
        "runs/llama1b-chat"
    ),
}


def readme_commands() -> list[str]:
    """Each command of README.md's ```bash blocks: continuation lines joined, comments
    dropped, `a && b` as two commands; each as `shlex.join` writes it."""
    text = (ROOT / "README.md").read_text()
    out = []
    for body in re.findall(r"^```bash\n(.*?)^```", text, re.S | re.M):
        for line in re.sub(r"\\\n", " ", body).splitlines():
            words = shlex.split(line, comments=True)
            while words:
                cut = words.index("&&") if "&&" in words else len(words)
                out.append(shlex.join(words[:cut]))
                words = words[cut + 1 :]
    return out


def _newest_step(word: str) -> str:
    """RUN/step_N of the README is RUN's newest checkpoint here: the runs are cut short."""
    match = re.fullmatch(r"(runs/[^/]+)/step_\d+", word)
    if match is None:
        return word
    steps = sorted(Path(match[1]).glob("step_*"), key=lambda p: int(p.name.split("_")[1]))
    return str(steps[-1]) if steps else word


def _cut(argv: list[str]) -> list[str]:
    """The README's run sizes cut to a few seconds of CPU; the flags themselves kept."""
    caps = {"--seq-len": 128, "--batch-size": 2, "--grad-accum": 1, "--save-every": 1}
    out, i = [], 0
    while i < len(argv):
        flag = argv[i]
        if flag in caps:
            out += [flag, str(min(int(argv[i + 1]), caps[flag]))]
            i += 2
            continue
        if flag == "--max-steps":  # a longer run than the one before stays longer
            out += [flag, str(STEPS + (int(argv[i + 1]) > 500))]
            i += 2
            continue
        out.append(_newest_step(RUN_ALIASES.get(flag.rstrip("/"), flag)))
        i += 1
    if "--compile" in out:  # the same passes and partition, without minutes of code generation
        out += ["--compile-backend", "aot_eager"]
    if out[0] == "train" and "--max-steps" not in out and "--resume" not in out:
        out += ["--max-steps", str(STEPS)]
    if out[0] == "train" and "--seq-len" not in out and "--resume" not in out:
        out += ["--seq-len", "128"]
    return out


def test_every_readme_command_is_run_or_skipped_with_a_reason():
    commands = readme_commands()
    assert len(commands) >= 15, commands  # the blocks were found
    stale = sorted(set(SKIPPED) - set(commands))
    assert not stale, f"SKIPPED names commands the README no longer has: {stale}"
    for command in commands:
        if command not in SKIPPED:
            assert command.startswith("compiletune "), (
                f"{command!r} is neither a compiletune command nor in SKIPPED (with its reason)"
            )


@pytest.fixture
def user_folder(tmp_path, monkeypatch) -> Path:
    """What the README's commands assume: data files here, models under ~/models."""
    home = tmp_path / "home"
    # hidden 64: a multiple of the NF4 block (QLoRA); 512 positions: eval's default rows of 256
    model = save_tiny_llama(
        home / "models" / "tiny", hidden_size=64, intermediate_size=128, max_position_embeddings=512
    )
    for name in ("Llama-3.2-1B", "Qwen3-1.7B", "Qwen3-0.6B", "Qwen3-4B"):
        (home / "models" / name).symlink_to(model)
    work = tmp_path / "work"
    work.mkdir()
    chat = [
        {"messages": [{"role": "user", "content": f"say {w}"}, {"role": "assistant", "content": w}]}
        for w in WORDS * 4
    ]
    (work / "chat.jsonl").write_text("".join(json.dumps(r) + "\n" for r in chat))
    (work / "held.jsonl").write_text("".join(json.dumps(r) + "\n" for r in chat[:8]))
    text = [{"text": f"the {w} is on the {w}; a {w} again."} for w in WORDS * 4]
    (work / "text.jsonl").write_text("".join(json.dumps(r) + "\n" for r in text))
    write_pairs(work / "pairs.jsonl", n=40)
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("COMPILETUNE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # a command that would download fails instead
    monkeypatch.chdir(work)
    return work


@pytest.mark.slow
def test_the_readme_commands_run_as_written(user_folder, capsys):
    """In README order (a resume follows its run, the plot the runs it draws), each command
    that needs no GPU and no network exits 0."""
    ran = []
    for command in readme_commands():
        if command in SKIPPED:
            continue
        argv = [os.path.expanduser(w) for w in shlex.split(command)[1:]]
        argv = _cut(argv)
        if command in BEFORE:
            BEFORE[command]()
        t0 = time.perf_counter()
        try:
            code = main(argv)
        except SystemExit as e:  # argparse's exits
            code = e.code
        captured = capsys.readouterr()
        assert code == 0, f"`{command}` (run as {argv}) exited {code}:\n{captured.err[-2000:]}"
        ran.append(command)
        print(f"{time.perf_counter() - t0:5.1f}s {command}", file=sys.__stderr__)  # (with -s)
    assert len(ran) >= 9, ran
