"""`compiletune eval`: a checkpoint's held-out loss against transformers and against the run's own
eval_loss, its bad input, lm-evaluation-harness tasks (`--tasks`) against a direct computation,
and `train --eval-tasks` on the saved checkpoints."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
import transformers
from tiny_hf import save_tiny_llama
from tiny_run import tiny_run

from compiletune.cli import main
from compiletune.data.tokenizer import byte_tokenizer
from compiletune.metrics import read_metrics

TEXTS = [
    f"Note {i}: the {['red', 'blue'][i % 2]} fox counts {i * 7 % 13} hens." * (i % 3 + 1)
    for i in range(10)
]
CHATS = [
    [
        *([{"role": "system", "content": "Be brief."}] if i % 2 else []),
        {"role": "user", "content": f"How many hens does fox {i} count?"},
        {"role": "assistant", "content": f"It counts {i * 7 % 13}."},
    ]
    for i in range(8)
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    """A tiny Llama saved by transformers, with the byte tokenizer (and its chat template)."""
    path = tmp_path_factory.mktemp("eval") / "model"
    sizes = {"vocab_size": 320, "hidden_size": 64, "intermediate_size": 128}
    return save_tiny_llama(path, **sizes, max_position_embeddings=256)


def write_jsonl(path: Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def eval_json(capsys, *argv: str) -> dict:
    capsys.readouterr()  # what came before
    assert main(["eval", *map(str, argv), "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def reference_loss(model_dir: Path, examples: list[tuple[list[int], int]]) -> tuple[float, int]:
    """transformers in fp32: the sum of token cross-entropies over each example's targets (the
    tokens from `first` on) over their count. (ids, first) per example, each run alone."""
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    total, count = 0.0, 0
    with torch.no_grad():
        for ids, first in examples:
            logp = model(torch.tensor([ids])).logits[0].double().log_softmax(-1)
            for j in range(first, len(ids)):
                total -= float(logp[j - 1, ids[j]])
                count += 1
    return total / count, count


def test_eval_loss_equals_transformers_on_text_and_chat(tmp_path, model_dir, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    tok = byte_tokenizer()
    bos, eos = tok.bos_token_id, tok.eos_token_id
    text = write_jsonl(tmp_path / "text.jsonl", [{"text": t} for t in TEXTS])
    got = eval_json(capsys, model_dir, "--data", text, "--seq-len", 256)
    # text: bos, the text's bytes, eos; every token after bos is a target
    examples = [([bos, *tok(t, add_special_tokens=False)["input_ids"], eos], 1) for t in TEXTS]
    want, count = reference_loss(model_dir, examples)
    assert got["targets"] == count and got["examples"] == len(TEXTS) and got["doc_mask"]
    assert got["loss"] == pytest.approx(want, rel=1e-5)

    chat = write_jsonl(tmp_path / "chat.jsonl", [{"messages": m} for m in CHATS])
    got = eval_json(capsys, model_dir, "--data", chat, "--batch-size", 3)
    # chat: the template's rendering; the targets are the reply and the end of turn after it
    examples = []
    for messages in CHATS:
        full = tok.apply_chat_template(messages, tokenize=False)
        prompt = tok.apply_chat_template(messages[:-1], tokenize=False, add_generation_prompt=True)
        ids = tok(full, add_special_tokens=False)["input_ids"]
        first = len(tok(prompt, add_special_tokens=False)["input_ids"])
        assert ids[-1] == eos and ids[:first] == tok(prompt, add_special_tokens=False)["input_ids"]
        examples.append((ids, first))
    want, count = reference_loss(model_dir, examples)
    assert got["targets"] == count
    assert got["loss"] == pytest.approx(want, rel=1e-5)
    # --max-examples: the first N; nothing was written without --output
    assert eval_json(capsys, model_dir, "--data", chat, "--max-examples", 2)["examples"] == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["chat.jsonl", "text.jsonl"]
    assert main(["eval", str(model_dir), "--data", chat, "--output", "out"]) == 0
    line = capsys.readouterr().out.strip()
    assert line.startswith(f"{model_dir} on {chat}: loss ") and "ppl" in line, line
    assert json.loads((tmp_path / "out" / "loss.json").read_text())["loss"] == got["loss"]


def test_eval_of_a_lora_step_equals_the_runs_final_eval_loss(tmp_path, capsys):
    rows = [
        {"prompt": f"Q{i}: hens of fox {i}?", "completion": f" {i * 7 % 13} hens."}
        for i in range(40)
    ]
    data = write_jsonl(tmp_path / "train.jsonl", rows)
    held = write_jsonl(tmp_path / "held.jsonl", rows[:9])
    tiny_run(tmp_path, data, lora_rank=4, lr=1e-2, eval_data=held, max_steps=2)
    final = read_metrics(tmp_path / "run" / "metrics.jsonl")[-1]
    got = eval_json(capsys, tmp_path / "run" / "step_2", "--data", held)
    assert got["targets"] == final["eval_targets"]
    assert got["loss"] == pytest.approx(final["eval_loss"], rel=1e-5, abs=0)


@pytest.mark.parametrize(
    "case, argv, says",
    [
        ("missing", ["{tmp}/nope/step_3", "--data", "{data}"], "does not exist"),
        ("empty", ["{tmp}/empty", "--data", "{data}"], "neither config.json nor a LoRA adapter"),
        ("no data", ["{model}", "--data", "{tmp}/missing.jsonl"], "missing.jsonl"),
        ("nothing", ["{model}"], "pass --data SOURCE"),
        ("limit", ["{model}", "--data", "{data}", "--limit", "3"], "--limit apply to --tasks"),
    ],
)
def test_bad_eval_input_is_one_line(tmp_path, model_dir, capsys, case, argv, says):
    (tmp_path / "empty").mkdir()
    data = write_jsonl(tmp_path / "d.jsonl", [{"text": t} for t in TEXTS])
    argv = [a.format(tmp=tmp_path, data=data, model=model_dir) for a in argv]
    assert main(["eval", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len([e for e in err if e.startswith("compiletune: error:")]) == 1, err
    assert says in err[-1] and "Traceback" not in "\n".join(err), err


def test_tasks_without_lm_eval_are_refused_before_anything(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "lm_eval", None)  # as if not installed
    data = write_jsonl(tmp_path / "d.jsonl", [{"text": t} for t in TEXTS])
    out = tmp_path / "run"
    argv = ["train", "--data", data, "--eval-tasks", "piqa", "--output-dir", str(out)]
    assert main(argv) == 2
    assert 'pip install "compiletune[eval]"' in capsys.readouterr().err
    assert not out.exists()
    assert main(["eval", str(tmp_path), "--tasks", "piqa"]) == 2
    assert 'pip install "compiletune[eval]"' in capsys.readouterr().err


@pytest.mark.parametrize(
    "flags, says",
    [
        (["--eval-tasks-every", "2"], "--eval-tasks-every applies to --eval-tasks"),
        (["--eval-tasks", "x", "--eval-tasks-every", "3", "--save-every", "2"], "multiple of"),
        (["--eval-tasks", "x", "--eval-tasks-every", "2"], "multiple of --save-every"),
        (["--eval-tasks", "x", "--no-save"], "drop --no-save"),
        (["--eval-tasks", "x", "--lora-rank", "4"], "random-init preset"),
    ],
)
def test_eval_tasks_rules(tmp_path, capsys, flags, says):
    argv = ["train", "--output-dir", str(tmp_path / "run"), *flags]
    assert main(argv) == 2
    assert says in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


# --- lm-evaluation-harness ----------------------------------------------------------------------


def write_task(folder: Path, rows: list[dict], cache: Path, name: str = "tiny_mc") -> Path:
    """A multiple-choice task on a local jsonl (no download), as a task YAML in `folder`."""
    folder.mkdir(exist_ok=True)
    data = write_jsonl(folder / f"{name}.jsonl", rows)
    (folder / f"{name}.yaml").write_text(
        f"task: {name}\n"
        "dataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {data}\n  cache_dir: {cache}\n"
        "test_split: test\n"
        "output_type: multiple_choice\n"
        'doc_to_text: "{{question}}"\n'
        'doc_to_choice: "{{choices}}"\n'
        "doc_to_target: gold\n"
        "metric_list:\n  - metric: acc\n    aggregation: mean\n    higher_is_better: true\n"
    )
    return folder


QUESTIONS = [
    ("Two and two make", ["four", "five", "twenty-two"]),
    ("The sky is", ["blue", "green"]),
    ("Cats say", ["meow", "woof", "moo"]),
    ("Fire is", ["hot", "cold"]),
    ("Ice is", ["cold", "warm", "sticky"]),
    ("A fox counts", ["hens", "stars"]),
]


def best_choices(model_dir: Path) -> list[int]:
    """The choice of each question with the highest log-likelihood, by transformers: the
    question as lm-eval encodes it (bos first), the choice after a space."""
    tok = byte_tokenizer()
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    best = []
    with torch.no_grad():
        for question, choices in QUESTIONS:
            n = len(tok(question)["input_ids"])
            scores = []
            for choice in choices:
                ids = tok(f"{question} {choice}")["input_ids"]
                logp = model(torch.tensor([ids])).logits[0].double().log_softmax(-1)
                scores.append(sum(float(logp[j - 1, ids[j]]) for j in range(n, len(ids))))
            best.append(max(range(len(choices)), key=scores.__getitem__))
    return best


def test_lm_eval_tasks_match_a_direct_computation(tmp_path, model_dir, capsys, monkeypatch):
    pytest.importorskip("lm_eval")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(tmp_path)
    best = best_choices(model_dir)
    # the model's pick is the gold answer for the first four questions only: acc = 4/6
    rows = [
        {"question": q, "choices": c, "gold": b if i < 4 else (b + 1) % len(c)}
        for i, ((q, c), b) in enumerate(zip(QUESTIONS, best, strict=True))
    ]
    tasks = write_task(tmp_path / "tasks", rows, tmp_path / "hf-datasets")
    argv = [model_dir, "--tasks", "tiny_mc", "--include-path", tasks, "--batch-size", 4]
    got = eval_json(capsys, *argv)
    assert got["tasks"]["tiny_mc"]["acc"] == pytest.approx(4 / 6)
    path = tmp_path / "eval" / "model" / "tiny_mc.json"  # not a run's folder: under the cwd
    assert Path(got["tasks_file"]).resolve() == path.resolve()
    saved = json.loads(path.read_text())
    assert saved["results"]["tiny_mc"]["acc,none"] == pytest.approx(4 / 6)
    assert "samples" not in saved and saved["compiletune"]["tasks"] == ["tiny_mc"]
    assert main(["eval", str(model_dir), "--tasks", "tiny_mcq", "--include-path", str(tasks)]) == 2
    assert "no lm-eval task 'tiny_mcq'" in capsys.readouterr().err


@pytest.mark.slow
def test_train_eval_tasks_on_saved_checkpoints(tmp_path, monkeypatch):
    pytest.importorskip("lm_eval")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    rows = [{"question": q, "choices": c, "gold": 0} for q, c in QUESTIONS]
    tasks = write_task(tmp_path / "tasks", rows, tmp_path / "hf-datasets")
    data = write_jsonl(tmp_path / "d.jsonl", [{"text": t} for t in TEXTS * 4])
    flags = dict(eval_tasks="tiny_mc", eval_tasks_include=str(tasks), eval_tasks_limit=4)
    tiny_run(tmp_path, data, max_steps=4, save_every=2, eval_tasks_every=2, **flags)
    out = tmp_path / "run" / "eval"
    for step in (2, 4):
        saved = json.loads((out / f"step_{step}" / "tiny_mc.json").read_text())
        assert (
            saved["compiletune"]["step"] == step and saved["n-samples"]["tiny_mc"]["effective"] == 4
        )
    lines = [json.loads(line) for line in (out / "lm_eval.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == [2, 4]
    assert all(0 <= r["lm_eval/tiny_mc/acc"] <= 1 for r in lines)
    assert "lm_eval/tiny_mc/acc" not in read_metrics(tmp_path / "run" / "metrics.jsonl")[-1]


def test_a_sharded_step_folder_is_named_with_the_convert_command(tmp_path, model_dir, capsys):
    """An --fsdp run's step_N (config.json, tokenizer, sharded/, no safetensors) is whole: eval
    says what it is and the `compiletune convert` command, not that the save was interrupted."""
    import shutil

    step = tmp_path / "run" / "step_2"
    (step / "sharded").mkdir(parents=True)
    (step / "sharded" / ".metadata").write_bytes(b"dcp")
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        if (model_dir / name).is_file():
            shutil.copy(model_dir / name, step / name)
    data = write_jsonl(tmp_path / "d.jsonl", [{"text": t} for t in TEXTS])
    assert main(["eval", str(step), "--data", data]) == 2
    err = [e for e in capsys.readouterr().err.splitlines() if e.startswith("compiletune: error")]
    assert len(err) == 1 and "interrupted" not in err[0], err
    assert "a sharded (--fsdp) checkpoint" in err[0]
    assert f"compiletune convert {step} {step.parent / 'step_2_hf'}" in err[0]
