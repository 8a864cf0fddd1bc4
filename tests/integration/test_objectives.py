"""--objective dpo|ipo|simpo|kd through the trainer: pairs data, learning, resume, errors."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest
import torch
from pair_data import WORDS, write_pairs
from tiny_run import tiny_run

from compiletune.cli import main
from compiletune.data.pairs import PairRows, batch_sequence_ids, read_pairs, truncate
from compiletune.data.tokenizer import byte_tokenizer
from compiletune.errors import UserError
from compiletune.loss.objectives import sequence_sums
from compiletune.metrics import read_metrics
from compiletune.models import build_model, from_hf, from_name, save_hf
from compiletune.ops.fused_logprobs import token_divergence, token_logprobs

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
DEBUG = {"model": "debug", "n_layers": 2, "seq_len": 128, "batch_size": 4, "lr": 1e-3}


@pytest.fixture()
def pairs_file(tmp_path: Path) -> str:
    return write_pairs(tmp_path / "pairs.jsonl")


def test_messages_pairs_render_the_prompt_once_and_responses_apart(tmp_path):
    tok = byte_tokenizer()
    tok.chat_template = CHATML
    rows = [
        {  # explicit prompt as text
            "prompt": "hi",
            "chosen": [{"role": "assistant", "content": "hello"}],
            "rejected": [{"role": "assistant", "content": "go away"}],
        },
        {  # TRL's implicit prompt: the shared turns
            "chosen": [
                {"role": "user", "content": "hi"},
                {"role": "assistant", "content": "hello"},
            ],
            "rejected": [
                {"role": "user", "content": "hi"},
                {"role": "assistant", "content": "go away"},
            ],
        },
    ]
    path = tmp_path / "chat.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows))
    a, b = read_pairs(str(path), tok)
    assert a == b  # both spellings give the same pair
    assert tok.decode(a.prompt).endswith("<|im_start|>assistant\n")
    assert tok.decode(a.chosen).startswith("hello<|im_end|>")
    assert tok.decode(a.rejected).startswith("go away<|im_end|>")
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": "x", "chosen": "y"}))
    with pytest.raises(Exception, match='"rejected"'):
        read_pairs(str(bad), tok)


def test_packed_pairs_score_as_if_alone(pairs_file):
    """Pairs packed in one row get the same response log-probabilities as each alone."""
    tok = byte_tokenizer()
    pairs = read_pairs(pairs_file, tok)[:5]
    model = build_model(from_name("debug"), seed=0).eval()

    def scores(rows: PairRows) -> torch.Tensor:
        batch = rows.take(list(range(rows.rows)))
        with torch.no_grad():
            h = model.hidden_states(batch["inputs"], batch["positions"], batch["doc_ids"])
            lp = token_logprobs(h.flatten(0, 1), model.output.weight, batch["targets"].flatten())
        ids = batch_sequence_ids(batch["seq_ids"], batch["pairs"]).flatten()
        return sequence_sums(lp, ids, 2 * int(batch["pairs"].sum()))

    packed = PairRows(pairs, 256)
    assert packed.rows < len(pairs)  # several pairs share a row
    # a run's token count: prompt + chosen and prompt + rejected inputs of each pair, no padding
    inputs = sum(2 * len(p.prompt) + len(p.chosen) + len(p.rejected) - 2 for p in pairs)
    assert packed.real_inputs(np.arange(packed.rows)) == inputs < packed.rows * 256
    alone = torch.cat([scores(PairRows([p], 256)) for p in pairs])
    assert torch.allclose(scores(packed), alone, rtol=1e-5, atol=1e-5)


def test_truncation_keeps_the_prompt_end_and_fits_a_row():
    from compiletune.data.pairs import Pair

    pair = Pair(list(range(100)), list(range(200, 260)), list(range(300, 340)))
    cut = truncate(pair, 64)
    assert 2 * len(cut.prompt) + len(cut.chosen) + len(cut.rejected) - 2 <= 64
    assert cut.prompt == pair.prompt[-len(cut.prompt) :] and len(cut.prompt) >= 8
    assert cut.chosen == pair.chosen[: len(cut.chosen)] and cut.rejected


@pytest.mark.slow
def test_dpo_raises_held_out_reward_accuracy_well_above_chance(tmp_path, pairs_file):
    tiny_run(
        tmp_path,
        pairs_file,
        **DEBUG,
        objective="dpo",
        max_steps=50,
        val_split=0.1,
        eval_every=25,
    )
    records = [r for r in read_metrics(tmp_path / "run" / "metrics.jsonl") if "eval_loss" in r]
    first, last = records[0], records[-1]
    assert last["eval_pairs"] == 30
    assert last["eval_reward_accuracy"] >= 0.9, records
    assert last["eval_loss"] < first["eval_loss"] < 0.6932  # below -log sigmoid(0)
    assert last["eval_reward_margin"] > 0


@pytest.mark.parametrize(
    "flags",
    [
        {"objective": "ipo"},
        {"objective": "simpo", "simpo_gamma": 0.2},
        {"objective": "dpo", "label_smoothing": 0.1},
        {"objective": "dpo", "ac": "full"},
        {"objective": "dpo", "lora_rank": 8, "lr": 3e-3},
        {"objective": "dpo", "lora_rank": 8, "quantize_base": "nf4", "lr": 3e-3},
        {
            "objective": "dpo",
            "lora_rank": 4,
            "compile": True,
            "compile_backend": "aot_eager",
            "ac": "selective",
        },
    ],
    ids=["ipo", "simpo", "cdpo", "dpo-ac-full", "dpo-lora", "dpo-qlora", "dpo-lora-compiled"],
)
def test_preference_objectives_train(tmp_path, pairs_file, flags):
    summary = tiny_run(tmp_path, pairs_file, **{**DEBUG, "max_steps": 12, **flags})
    records = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert records[-1]["loss"] < records[0]["loss"]
    assert records[-1]["reward_margin"] > records[0]["reward_margin"]
    assert all(r["tokens"] + r["padding"] == 4 * 128 for r in records)  # padding apart
    assert summary["tokens"] == sum(r["tokens"] for r in records)
    assert {"chosen_reward", "rejected_reward", "reward_accuracy"} <= set(records[-1])
    if flags.get("compile"):
        assert summary["compile"]["recompiles"] == 0  # the reference pass runs eagerly


def test_dpo_resume_is_exact(tmp_path, pairs_file):
    # a constant lr: the first leg's schedule (3 steps) equals the whole run's
    run = {**DEBUG, "objective": "dpo", "max_steps": 6, "schedule": "constant"}
    tiny_run(tmp_path, pairs_file, "whole", **run)
    tiny_run(tmp_path, pairs_file, "split", **{**run, "max_steps": 3})
    tiny_run(tmp_path, pairs_file, "split", **run, resume=True)
    losses = [
        [r["loss"] for r in read_metrics(tmp_path / n / "metrics.jsonl")]
        for n in ("whole", "split")
    ]
    assert losses[0] == losses[1]


def test_kd_lora_student_resumes_exactly_and_generates(tmp_path, capsys):
    """A LoRA student of a full-weight teacher: --resume equals the uninterrupted run, and
    `compiletune generate` runs on the checkpoint it leaves."""
    teacher_args = from_name("debug")
    teacher_args.n_layers = 3
    save_hf(build_model(teacher_args, seed=7), tmp_path / "teacher", tokenizer=byte_tokenizer())
    (tmp_path / "t.txt").write_text(
        "\n\n\n".join(f"line {i}: " + " ".join(WORDS) for i in range(99))
    )
    run = {**DEBUG, "seq_len": 64, "objective": "kd", "teacher_dir": str(tmp_path / "teacher")}
    run |= {"lora_rank": 4, "lr": 3e-3, "max_steps": 4, "schedule": "constant"}
    data = str(tmp_path / "t.txt")
    tiny_run(tmp_path, data, "whole", **run)
    tiny_run(tmp_path, data, "split", **{**run, "max_steps": 2})
    tiny_run(tmp_path, data, "split", **run, resume=True)
    records = [read_metrics(tmp_path / n / "metrics.jsonl") for n in ("whole", "split")]
    for key in ("loss", "kd_divergence"):
        assert [r[key] for r in records[0]] == [r[key] for r in records[1]], key
    capsys.readouterr()
    argv = ["generate", "--model-dir", str(tmp_path / "split" / "step_4"), "--prompt", "line"]
    assert main([*argv, "--max-new-tokens", "8"]) == 0
    out = capsys.readouterr()
    assert out.out and "8 tokens" in out.err


def _held_out_kl(student_dir: Path, teacher, rows) -> float:
    student = from_hf(student_dir).eval()
    with torch.no_grad():
        hs = student.hidden_states(rows["inputs"], rows["positions"], rows["doc_ids"])
        ht = teacher.hidden_states(rows["inputs"], rows["positions"], rows["doc_ids"])
        mask = rows["targets"].flatten() != -100
        div = token_divergence(
            hs.flatten(0, 1), student.output.weight, ht.flatten(0, 1), teacher.output.weight, mask
        )
    return float(div.sum() / mask.sum())


@pytest.mark.slow
def test_kd_lowers_the_students_kl_to_the_teacher_on_held_out_text(tmp_path):
    from compiletune.data.layouts import RawExample
    from compiletune.data.rows import encode, pack

    teacher_args = from_name("debug")
    teacher_args.n_layers = 3
    teacher = build_model(teacher_args, seed=7).eval()
    save_hf(teacher, tmp_path / "teacher", tokenizer=byte_tokenizer())
    r = random.Random(1)
    text = [" ".join(r.choice(WORDS) for _ in range(40)) for _ in range(200)]
    (tmp_path / "train.txt").write_text("\n\n\n".join(text[:180]))
    held = pack(encode([RawExample([(t, True)], True) for t in text[180:]], byte_tokenizer()), 64)
    rows = held.take(list(range(held.rows)))
    kd = {**DEBUG, "seq_len": 64, "objective": "kd", "teacher_dir": str(tmp_path / "teacher")}
    kd |= {"kd_ratio": 1.0, "kd_temperature": 2.0, "lr": 3e-3, "doc_mask": True}
    tiny_run(tmp_path, str(tmp_path / "train.txt"), "start", **kd, max_steps=1)
    tiny_run(tmp_path, str(tmp_path / "train.txt"), "end", **kd, max_steps=30)
    before = _held_out_kl(tmp_path / "start" / "step_1", teacher, rows)
    after = _held_out_kl(tmp_path / "end" / "step_30", teacher, rows)
    assert after < 0.5 * before, (before, after)
    records = read_metrics(tmp_path / "end" / "metrics.jsonl")
    assert records[-1]["kd_divergence"] < records[0]["kd_divergence"]


def test_kd_teacher_vocabulary_must_match(tmp_path, capsys):
    teacher_args = from_name("debug_128k")
    teacher_args.n_layers = 1
    save_hf(build_model(teacher_args, seed=0), tmp_path / "teacher")
    (tmp_path / "t.txt").write_text("some text " * 200)
    argv = ["train", "--model", "debug", "--n-layers", "1", "--data", str(tmp_path / "t.txt")]
    argv += ["--objective", "kd", "--teacher-dir", str(tmp_path / "teacher"), "--max-steps", "1"]
    argv += ["--output-dir", str(tmp_path / "out")]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "128256" in err[0] and "512" in err[0], err
    # a teacher folder that is not there, or a file: named as the teacher, not the model
    for teacher, says in [
        (tmp_path / "none", f"model folder {tmp_path / 'none'} does not exist; pass --teacher-dir"),
        (
            tmp_path / "t.txt",
            f"--teacher-dir {tmp_path / 't.txt'} is a file; pass the model folder",
        ),
    ]:
        argv[argv.index("--teacher-dir") + 1] = str(teacher)
        assert main(argv) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and says in err[0], err


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--objective", "kd"], "--teacher-dir"),
        (["--teacher-dir", "x"], "--objective kd"),
        (["--objective", "dpo", "--beta", "0"], "--beta"),
        (["--objective", "simpo", "--precompute-ref"], "--precompute-ref"),
    ],
)
def test_objective_flag_errors(tmp_path, capsys, flags, message):
    assert main(["train", "--output-dir", str(tmp_path / "o"), *flags]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("lora", [0, 4])
def test_precomputed_reference_gives_the_same_run(tmp_path, pairs_file, lora):
    run = {**DEBUG, "objective": "dpo", "max_steps": 5, "lora_rank": lora, "val_split": 0.1}
    tiny_run(tmp_path, pairs_file, "live", **run)
    tiny_run(tmp_path, pairs_file, "pre", **run, precompute_ref=True)
    live, pre = (read_metrics(tmp_path / n / "metrics.jsonl") for n in ("live", "pre"))
    assert [r["loss"] for r in pre] == pytest.approx([r["loss"] for r in live], rel=1e-6)
    assert pre[-1]["eval_loss"] == pytest.approx(live[-1]["eval_loss"], rel=1e-6)


@pytest.mark.parametrize("loss, softcap", [("fused", 0.0), ("fused", 5.0), ("chunked", 0.0)])
def test_compiled_head_logprobs_are_fused_and_equal_the_op(tmp_path, loss, softcap):
    """--compile: the policy's log-probabilities are plain code in the loss head, which the
    fuse_linear_logprobs pass turns into the chunked op (--loss chunked: the op itself); no
    [tokens, vocab] tensor either way; values and gradients equal the eager op's."""
    from compiletune.compiler.graph_dump import write_dump
    from compiletune.compiler.regions import CompileOptions, compile_regions
    from compiletune.loss.head import IGNORE_INDEX, LossHead, head_kind

    args = from_name("debug")
    args.n_layers = 1
    model = build_model(args, seed=0)
    head = LossHead(model.output, head_kind(loss, True), softcap)
    g = torch.Generator().manual_seed(0)
    h = torch.randn(2, 33, args.dim, generator=g, requires_grad=True)
    targets = torch.randint(0, args.vocab_size, (2, 33), generator=g)
    targets[:, :7] = IGNORE_INDEX

    def run() -> list[torch.Tensor]:
        out = head(h, targets, logprobs=True)
        return [out.detach(), *torch.autograd.grad(out.sum(), (h, model.output.weight))]

    eager = run()
    opts = CompileOptions(backend="aot_eager", loss=loss, dump=True)
    regions = compile_regions(model, head, opts)
    got = run()
    for a, b in zip(got, eager, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert (eager[0][targets.flatten() == IGNORE_INDEX] == 0).all()
    records = regions.backends["head"].records
    assert write_dump(records, tmp_path)["head"]["full_logits_exist"] is False
    fuse = [p for p in records[0].passes if p["pass"] == "fuse_linear_logprobs"]
    assert [p["matched"] for p in fuse] == ([1] if loss == "fused" else [])


def test_pairs_with_nothing_to_teach_are_left_out_or_refused(tmp_path):
    tok = byte_tokenizer()
    tok.chat_template = CHATML
    good = [{"prompt": f"q{i}", "chosen": f" yes {i}", "rejected": f" no {i}"} for i in range(8)]
    bad = [
        {"prompt": "q", "chosen": " same", "rejected": " same"},
        {"prompt": "q", "chosen": " ", "rejected": " no"},
        {"prompt": "q", "chosen": "", "rejected": ""},
    ]
    path = tmp_path / "pairs.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in good + bad))
    said: list[str] = []
    assert len(read_pairs(str(path), tok, say=said.append)) == 8
    assert said == [
        f"{path}: left out 3 of 11 pairs (1 chosen equals rejected, 1 an empty response, "
        "1 both responses empty)"
    ]
    same = [{**r, "rejected": r["chosen"]} for r in good]  # every pair degenerate
    path.write_text("\n".join(json.dumps(r) for r in same))
    with pytest.raises(UserError, match="8 of 8 pairs have nothing to teach"):
        read_pairs(str(path), tok)
    user = {"role": "user", "content": "hi"}
    rows = [
        {"chosen": [user, {"role": "assistant", "content": "a"}], "rejected": [user, user]},
    ]
    path.write_text("\n".join(json.dumps(r) for r in rows))
    with pytest.raises(UserError, match='"rejected" messages must end with the assistant'):
        read_pairs(str(path), tok)
    empty = {"role": "assistant", "content": " "}
    rows = [
        {"chosen": [user, {"role": "assistant", "content": f"a{i}"}], "rejected": [user, empty]}
        for i in range(3)
    ]
    path.write_text("\n".join(json.dumps(r) for r in rows))
    with pytest.raises(UserError, match="3 an empty response"):
        read_pairs(str(path), tok)


def test_pair_roles_are_checked_against_the_template_and_mapped(tmp_path):
    tok = byte_tokenizer()
    tok.chat_template = CHATML
    human = {"role": "human", "content": "hi"}
    rows = [
        {
            "chosen": [human, {"role": "bot", "content": f"good {i}"}],
            "rejected": [human, {"role": "bot", "content": f"bad {i}"}],
        }
        for i in range(2)
    ]
    path = tmp_path / "pairs.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows))
    with pytest.raises(UserError, match=r"pairs\.jsonl:1: prompt\[0\] has role 'human'"):
        read_pairs(str(path), tok)
    mapped = read_pairs(str(path), tok, roles="human=user,bot=assistant")
    plain = [
        {
            k: [{**m, "role": {"human": "user", "bot": "assistant"}[m["role"]]} for m in r[k]]
            for k in r
        }
        for r in rows
    ]
    path.write_text("\n".join(json.dumps(r) for r in plain))
    assert mapped == read_pairs(str(path), tok)
