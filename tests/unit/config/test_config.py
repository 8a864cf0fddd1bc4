"""Config resolution: defaults < YAML < flags, and every bad value gets one clear error."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from compiletune.cli import build_parser, main
from compiletune.config import load_yaml, resolve
from compiletune.errors import UserError


def flags(*argv: str) -> dict:
    ns = build_parser().parse_args(["train", *argv])
    return {k: v for k, v in vars(ns).items() if k not in ("command", "config")}


def test_flags_override_yaml_which_overrides_defaults(tmp_path):
    run = tmp_path / "run.yaml"
    run.write_text("seq-len: 64\nbatch_size: 3\nlr: 0.01\n")
    cfg = resolve(load_yaml(str(run)), flags("--batch-size", "5"))
    assert (cfg.data.seq_len, cfg.data.batch_size, cfg.optim.lr) == (64, 5, 0.01)
    assert cfg.data.grad_accum == 1  # untouched default


def test_derived_defaults():
    cfg = resolve({}, {"max_steps": 100})
    assert cfg.optim.lr == 1e-3 and cfg.optim.warmup_steps == 5
    assert cfg.run.output_dir.startswith("runs/debug-")
    assert resolve({}, {"model_dir": "/x/Llama"}).optim.lr == 2e-5


@pytest.mark.parametrize(
    "values, needle",
    [
        ({"seq_len": 0}, "--seq-len must be at least 1"),
        ({"lr": -1.0}, "--lr must be positive"),
        ({"resume": True, "overwrite": True, "output_dir": "x"}, "contradict"),
        ({"resume": True}, "--resume needs the --output-dir"),
        ({"dtype": "fp16"}, "--dtype must be one of"),
        ({"batch_size": "8"}, "batch_size: in a --config file\\) must be int"),
        ({"save_every": -2}, "--save-every"),
    ],
)
def test_bad_values(values, needle):
    with pytest.raises(UserError, match=needle):
        resolve(values, {})


def test_yaml_errors(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("sequence_length: 12\n")
    with pytest.raises(UserError, match="unknown option 'sequence_length'"):
        load_yaml(str(bad))
    with pytest.raises(UserError, match="no such file"):
        load_yaml(str(tmp_path / "missing.yaml"))
    bad.write_text("- a list\n")
    with pytest.raises(UserError, match="mapping"):
        load_yaml(str(bad))


def test_cli_bad_flag_is_one_line_and_exit_2(capsys):
    with pytest.raises(SystemExit) as e:
        main(["train", "--batch-size", "many"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--batch-size" in err


@pytest.mark.parametrize(
    "argv",
    [
        ["train", "--max-step", "3"],
        ["train", "--seq", "64"],
        ["estimate-memory", "--device-mem", "80"],
        ["generate", "--model-dir", "x", "--max-new", "5"],
    ],
)
def test_abbreviated_flags_are_refused(argv, capsys):
    """argparse would take a prefix of a flag as the flag (`--max-step 3` as `--max-steps 3`);
    a typo that happens to be a prefix must not change the run silently."""
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "unrecognized arguments" in err and argv[-2] in err, err


@pytest.mark.parametrize(
    "argv",
    [
        ["train", "--seq-len", "0"],
        ["train", "--lr", "-1"],
        ["train", "--data", "a.jsonl:x,b.jsonl:1"],
        ["estimate-memory", "--gpus", "0"],
        ["estimate-memory", "--batch-size", "0"],
    ],
)
def test_a_bad_value_is_reported_before_torch_is_imported(argv):
    """The flag and config checks run before the trainer's imports (seconds of torch,
    dynamo and transformers): a typo is answered at once."""
    code = f"import sys; from compiletune.cli import main; print(main({argv!r}), 'torch' in sys.modules)"
    got = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert got.stdout.split() == ["2", "False"], got.stdout + got.stderr
    assert got.stderr.startswith("compiletune: error: "), got.stderr


def test_cli_user_error_exit_2(capsys):
    assert main(["train", "--seq-len", "0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["compiletune: error: --seq-len must be at least 1, got 0"]


_HUGE_PAGE_PROBE = """
import contextlib, io, sys
from compiletune.cli import main
with contextlib.redirect_stdout(io.StringIO()):
    main(["models"])  # the CLI entry, in a process that has not imported torch
import torch
x = torch.ones(64 << 20, dtype=torch.uint8)  # a 64 MiB tensor
start = x.data_ptr()
advised = False
for line in open("/proc/self/smaps"):
    fields = line.split()
    if "-" in fields[0] and ":" not in fields[0]:  # a mapping's header: lo-hi perms ...
        lo, hi = (int(v, 16) for v in fields[0].split("-"))
        inside = lo <= start < hi
    elif fields[0] == "VmFlags:" and inside:
        advised = "hg" in fields[1:]  # madvise(MADV_HUGEPAGE) on the tensor's mapping
print(advised)
"""


@pytest.mark.skipif(
    not Path("/proc/self/smaps").exists()
    or not Path("/sys/kernel/mm/transparent_hugepage").exists(),
    reason="needs Linux with transparent huge pages",
)
@pytest.mark.parametrize(("env", "advised"), [(None, "True"), ("0", "False")])
def test_cli_backs_large_cpu_tensors_with_huge_pages(env, advised):
    """The CLI turns on torch's huge-page switch (a user's explicit 0 wins), and torch then
    advises a large tensor's memory as huge pages: the switch's name is torch's, read by it."""
    environ = {k: v for k, v in os.environ.items() if k != "THP_MEM_ALLOC_ENABLE"}
    if env is not None:
        environ["THP_MEM_ALLOC_ENABLE"] = env
    out = subprocess.run(
        [sys.executable, "-c", _HUGE_PAGE_PROBE], env=environ, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == advised


def test_every_field_is_one_flag_and_one_yaml_key_and_round_trips(tmp_path):
    """A field is declared once: its flag, its YAML key and config.yaml come from it."""
    from compiletune.config import FIELD_NAMES, TrainConfig, save_yaml

    parser = build_parser()
    sub = parser._subparsers._group_actions[0].choices["train"]
    dests = {a.dest for a in sub._actions} - {"help", "config"}
    assert dests == FIELD_NAMES
    cfg = resolve({}, {"lora_rank": 4, "seq_len": 64, "model": "debug"})
    save_yaml(cfg, tmp_path / "config.yaml")
    again = resolve(load_yaml(str(tmp_path / "config.yaml")), {})
    assert again == cfg and TrainConfig.from_flat(cfg.to_dict()) == cfg
    assert (cfg.lora.rank, cfg.lora.alpha, cfg.model.preset) == (4, 8.0, "debug")


def test_help_shows_the_real_defaults(capsys):
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "see README" not in text
    for needle in (
        "--lr F peak learning rate (default: 1e-3 from random init; 2e-5 fine-tuning --model-dir, "
        "2e-4 with LoRA)",
        "(default: bf16 on a GPU that supports it, else fp32)",
        "--loss {fused,chunked,plain}",
        "--seq-len N tokens per row (default: 256)",
        "--epochs N",
        "--no-preflight",
    ):
        assert needle in text, needle


def test_estimate_help_lists_only_flags_that_change_the_estimate(capsys):
    with pytest.raises(SystemExit):
        main(["estimate-memory", "--help"])
    text = capsys.readouterr().out
    for flag in ("--seq-len", "--ac", "--lora-rank", "--quantize-base", "--gpus", "--cpu-offload"):
        assert flag in text
    for flag in ("--lr", "--data", "--output-dir", "--max-steps", "--save-every", "--merge"):
        assert flag not in text
    with pytest.raises(SystemExit) as e:
        main(["estimate-memory", "--lr", "1e-4"])  # not a flag of the estimate
    assert e.value.code == 2


def test_version(capsys):
    from compiletune import __version__

    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0
    assert capsys.readouterr().out.strip() == f"compiletune {__version__}"
    assert __version__[0].isdigit()


def test_epochs_set_the_steps_once_the_data_is_known():
    from compiletune.config import RunFacts, fill_defaults

    with pytest.raises(UserError, match="--max-steps and --epochs both"):
        resolve({}, {"max_steps": 10, "epochs": 1})
    with pytest.raises(UserError, match="--epochs must be at least 1"):
        resolve({}, {"epochs": 0})
    cfg = resolve({}, {"epochs": 2, "batch_size": 8, "grad_accum": 2})
    assert cfg.run.max_steps is None and cfg.optim.warmup_steps is None
    fill_defaults(cfg, RunFacts(vocab_size=512, rows=100, world=1))
    assert cfg.run.max_steps == 2 * 7  # ceil(100 rows / 16 per step) per epoch
    assert cfg.optim.warmup_steps == 1
    two = fill_defaults(resolve({}, {"epochs": 1}), RunFacts(rows=100, world=2))
    assert two.run.max_steps == 7  # ceil(100 / (8 x 2 processes))
    assert resolve({}, {}).run.max_steps == 100  # neither given


def test_derived_loss_and_doc_mask_need_their_facts():
    from compiletune.config import RunFacts, fill_defaults

    cfg = resolve({}, {})
    assert cfg.techniques.loss is None and cfg.data.doc_mask is None
    fill_defaults(cfg, RunFacts(vocab_size=128256, packs_documents=True))
    assert (cfg.techniques.loss, cfg.data.doc_mask) == ("fused", True)
    small = fill_defaults(resolve({}, {"doc_mask": False}), RunFacts(vocab_size=512))
    assert (small.techniques.loss, small.data.doc_mask) == ("plain", False)
    compiled = fill_defaults(resolve({}, {"compile": True}), RunFacts(vocab_size=512))
    assert compiled.techniques.loss == "fused"


@pytest.mark.parametrize(
    "values, needle",
    [
        ({"loss": "fast"}, "--loss must be one of fused, chunked, plain, got 'fast'"),
        ({"sharding": "zero3", "fsdp": True}, "--sharding must be one of"),
        ({"compile": "yes"}, "--compile \\(compile: in a --config file\\) must be true or false"),
        ({"lr": "0.1"}, "--lr \\(lr: in a --config file\\) must be float"),
    ],
)
def test_yaml_values_are_checked_against_the_field_types(values, needle):
    with pytest.raises(UserError, match=needle):
        resolve(values, {})


def test_yaml_exponent_numbers_are_floats(tmp_path):
    """`lr: 1e-3` as users write it: YAML 1.1 reads it as a string, and a float field takes
    it as the number (a word, an int field's "8" and 1e999 stay refused)."""
    run = tmp_path / "run.yaml"
    run.write_text("lr: 1e-3\nweight_decay: 5E-2\nmin_lr_ratio: 2.5e-1\nmax_grad_norm: 1e0\n")
    values = load_yaml(str(run))
    assert values["lr"] == "1e-3"  # the YAML 1.1 reading this guards against
    cfg = resolve(values, {})
    assert (cfg.optim.lr, cfg.optim.weight_decay) == (1e-3, 5e-2)
    assert (cfg.optim.min_lr_ratio, cfg.optim.max_grad_norm) == (0.25, 1.0)
    assert isinstance(cfg.optim.lr, float)
    with pytest.raises(UserError, match="--lr must be a finite number"):
        resolve({"lr": "1e999"}, {})
    with pytest.raises(UserError, match="must be float, got 'e-3'"):
        resolve({"lr": "e-3"}, {})


@pytest.mark.parametrize("objective", ["dpo", "ipo", "simpo", "grpo"])
def test_packing_stream_is_refused_where_the_objective_reads_examples_whole(objective):
    """Pairs (dpo family) and prompts (grpo) are never cut from a stream: --packing stream
    would be accepted and ignored. sft and kd pack their rows, so they take it."""
    values = {"objective": objective, "data": "pairs.jsonl", "packing": "stream"}
    with pytest.raises(UserError, match=f"--packing stream .*--objective {objective} reads"):
        resolve({}, values)
    assert resolve({}, {**values, "packing": "whole"}).data.packing == "whole"
    for streamed in ({"objective": "sft"}, {"objective": "kd", "teacher_dir": "t"}):
        cfg = resolve({}, {"data": "corpus.txt", "packing": "stream", **streamed})
        assert cfg.data.packing == "stream"


def test_non_utf8_config_file_is_one_line(tmp_path, capsys):
    run = tmp_path / "run.yaml"
    run.write_bytes(b"seq_len: 64\n# caf\xe9\n")
    with pytest.raises(UserError, match=f"--config {run}: not UTF-8 text \\(byte 0xe9"):
        load_yaml(str(run))
    capsys.readouterr()
    assert main(["train", "--config", str(run), "--output-dir", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and str(run) in err[0] and "UTF-8" in err[0], err


def test_one_option_twice_and_non_finite_numbers_are_refused(tmp_path):
    twice = tmp_path / "twice.yaml"
    twice.write_text("seq_len: 64\nseq-len: 128\n")
    with pytest.raises(UserError, match="'seq_len' and 'seq-len' are the same option"):
        load_yaml(str(twice))
    for value in (float("inf"), float("nan")):
        with pytest.raises(UserError, match="--min-lr-ratio must be"):
            resolve({"min_lr_ratio": value}, {})
    with pytest.raises(UserError, match="--lr must be a finite number, got inf"):
        resolve({}, {"lr": float("inf")})


def test_unknown_keys_name_the_nearest_option(tmp_path):
    bad = tmp_path / "typo.yaml"
    bad.write_text("seq_lenn: 12\n")
    with pytest.raises(UserError, match="unknown option 'seq_lenn'; did you mean 'seq_len'"):
        load_yaml(str(bad))
    with pytest.raises(UserError, match="did you mean 'max_steps'"):
        resolve({"max_step": 3}, {})


@pytest.mark.parametrize(
    "yaml_values, flags, needle",
    [
        ({"seq_len": "thirty"}, {"seq_len": 64}, "--seq-len \\(seq_len: in a --config file\\)"),
        ({"max_steps": True}, {"max_steps": 5}, "--max-steps \\(max_steps: in a --config"),
    ],
)
def test_a_wrong_yaml_value_is_refused_even_where_a_flag_replaces_it(yaml_values, flags, needle):
    with pytest.raises(UserError, match=needle):
        resolve(yaml_values, flags)


def test_a_flag_sets_the_run_length_over_the_file():
    cfg = resolve({"max_steps": 100}, {"epochs": 1})
    assert cfg.run.epochs == 1 and cfg.run.max_steps is None
    assert resolve({"epochs": 3}, {"max_steps": 7}).run.max_steps == 7
    with pytest.raises(UserError, match="both set the run's length"):
        resolve({}, {"max_steps": 7, "epochs": 1})  # two flags do conflict
    with pytest.raises(UserError, match="both set the run's length"):
        resolve({"max_steps": 7, "epochs": 1}, {})  # and so does one file with both


def test_resume_needs_the_runs_saved_config(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    flags = {"resume": True, "output_dir": str(run)}
    with pytest.raises(UserError, match="config.yaml is missing.*--accept-changes"):
        resolve({}, flags)
    assert resolve({}, {**flags, "accept_changes": True, "seq_len": 128}).data.seq_len == 128
    (run / "config.yaml").write_text("seq_len: 128\nbatch_sise: 4\n")
    with pytest.raises(UserError, match="config.yaml: unknown option 'batch_sise'; did you mean"):
        resolve({}, flags)
    (run / "config.yaml").write_text("seq_len: 128\nbatch_size: 4\n")
    cfg = resolve({}, flags)
    assert (cfg.data.seq_len, cfg.data.batch_size) == (128, 4)
