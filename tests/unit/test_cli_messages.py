"""What the CLI says at its edges: checks that need no model answer before torch loads, with
"did you mean" for a typo, and the estimate's lines explain themselves (issue 62)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from compiletune.cli import main

# Each case: argv, and what the one error line must say (the fix it names).
_EARLY = [
    (["train", "--model", "llama3_2_1"], "did you mean 'llama3_2_1b'?"),
    (["estimate-memory", "--model", "qwen3_8"], "did you mean 'qwen3_8b'?"),
    (["train", "--data", "missing.jsonl"], "data source missing.jsonl does not exist"),
    (["train", "--data", "a.jsonl:0.5,missing.jsonl:0.5"], "data source a.jsonl does not exist"),
    (["train", "--eval-data", "held.jsonl"], "data source held.jsonl does not exist"),
    (["train", "--data", "notes.docx"], "unsupported data file type .docx"),
    (["train", "--model-dir", "~/models/none"], "pass --model-dir with a local HF model folder"),
    (["train", "--tokenizer", "./no/tok"], "pass --tokenizer with a local HF model folder"),
    (["estimate-memory", "--max-seq-len"], "pass --device-memory GIB|GPU"),
    (
        ["estimate-memory", "--model", "llama3_1_8b", "--objective", "kd", "--teacher-dir", "~/t"],
        "pass --teacher-dir with a local HF model folder",
    ),
    (["generate", "--model-dir", "runs/a/step_5"], "pass --prompt TEXT, or --chat"),
    (["generate", "--model-dir", "./runs/a/step_5", "--prompt", "hi"], "pass --model-dir with"),
    (["eval", "./runs/a/step_5", "--data", "held.jsonl"], "pass CHECKPOINT with a local HF"),
    (["train", "--offload-activations"], "add --compile"),
    (["train", "--ac", "budget=0.5"], "add --compile"),
    (["train", "--optimizer-in-backward", "--grad-accum", "2"], "pass --grad-accum 1"),
    (["train", "--sharding", "hybrid"], "add --fsdp"),
    (["train", "--lora-rank", "4", "--lora-targets", "q,qq"], "unknown LoRA target 'qq'"),
    (["train", "--max-steps", "2", "--epochs", "1"], "pass one of them"),
    (["train", "--lerning-rate", "1e-4"], "did you mean --lr?"),
    (["train", "--learning-rate", "1e-4"], "did you mean --lr?"),
    (["train", "--max-step", "3"], "did you mean --max-steps?"),
    (["estimate-memory", "--device-memroy", "80"], "did you mean --device-memory?"),
    (["trian"], "did you mean 'train'?"),
    (["train", "--optimizer", "adamw_8bit"], "did you mean 'adamw8bit'?"),
    (["train", "--ac", "selectve"], "did you mean 'selective'?"),
]


@pytest.mark.parametrize(("argv", "says"), _EARLY, ids=[" ".join(a) for a, _ in _EARLY])
def test_a_check_that_needs_no_model_answers_before_torch_loads(argv, says, tmp_path):
    """Each of these used to wait for the trainer's imports and the build (8-13 s) or gave no
    hint; now it is one line naming the fix, from a process that never imported torch."""
    (tmp_path / "notes.docx").write_text("a file that is not data")
    code = (
        "import sys\nfrom compiletune.cli import main\n"
        f"try:\n    rc = main({argv!r})\nexcept SystemExit as e:\n    rc = e.code\n"
        "print(rc, 'torch' in sys.modules)"
    )
    got = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, timeout=120
    )
    assert got.stdout.split() == ["2", "False"], got.stdout + got.stderr
    lines = got.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("compiletune: error: "), got.stderr
    assert says in lines[0], lines[0]


def test_an_unknown_flag_far_from_every_flag_gets_no_guess(capsys):
    with pytest.raises(SystemExit) as e:
        main(["train", "--zzzzqqq", "1"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "unrecognized arguments: --zzzzqqq" in err and "did you mean" not in err, err


@pytest.mark.parametrize(
    ("n", "text"),
    [(3_300_000, "3.3M"), (1_235_814_400, "1.24B"), (8_030_261_248, "8.03B"), (52_000, "52.0K")],
)
def test_parameter_counts_read_in_a_unit_that_fits(n, text):
    from compiletune.models.params import params_text

    assert params_text(n) == text


def test_the_default_model_estimate_shows_its_millions(capsys):
    """The estimate of the default (3.3M) model printed "0.00B parameters"."""
    assert main(["estimate-memory"]) == 0
    out = capsys.readouterr().out
    assert "debug (3.3M parameters)" in out, out


def test_max_seq_len_says_the_reserve_that_decides_it(capsys):
    """With --device-memory 1 no length fits because 2 GiB are kept back: the search's lines and
    its answer say so (it printed "--seq-len 256: 0.13 GiB, does not")."""
    assert main(["estimate-memory", "--max-seq-len", "--device-memory", "1"]) == 0
    captured = capsys.readouterr()
    tried = [line for line in captured.err.splitlines() if line.strip().startswith("--seq-len")]
    assert tried and all("2 GiB reserve" in line for line in tried), captured.err
    assert "2 GiB" in captured.out and "reserve" in captured.out, captured.out


def test_max_seq_len_json_is_unchanged_by_the_reserve_lines(capsys):
    assert main(["estimate-memory", "--max-seq-len", "--device-memory", "1", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["max_seq_len"] == 0


def test_cache_alone_lists_the_entries(tmp_path, capsys):
    """`compiletune cache` demanded an action; alone it now lists (as `cache list`)."""
    assert main(["cache", "--cache-dir", str(tmp_path)]) == 0
    assert capsys.readouterr().out.strip() == f"no entries in {tmp_path}"
