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
