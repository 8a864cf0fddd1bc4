"""Config resolution: defaults < YAML < flags, and every bad value gets one clear error."""

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
    assert (cfg.seq_len, cfg.batch_size, cfg.lr) == (64, 5, 0.01)
    assert cfg.grad_accum == 1  # untouched default


def test_derived_defaults():
    cfg = resolve({}, {"max_steps": 100})
    assert cfg.lr == 1e-3 and cfg.warmup_steps == 5
    assert cfg.output_dir.startswith("runs/debug-")
    assert resolve({}, {"model_dir": "/x/Llama"}).lr == 2e-5


@pytest.mark.parametrize(
    "values, needle",
    [
        ({"seq_len": 0}, "--seq-len must be at least 1"),
        ({"lr": -1.0}, "--lr must be positive"),
        ({"resume": True, "overwrite": True, "output_dir": "x"}, "contradict"),
        ({"resume": True}, "--resume needs the --output-dir"),
        ({"dtype": "fp16"}, "--dtype must be one of"),
        ({"batch_size": "8"}, "batch_size must be int"),
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


def test_cli_user_error_exit_2(capsys):
    assert main(["train", "--seq-len", "0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["compiletune: error: --seq-len must be at least 1, got 0"]
