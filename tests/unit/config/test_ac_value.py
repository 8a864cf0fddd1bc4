"""`--ac` / `--ac-every` become one typed value (`ActivationPolicy`) where the config is resolved;
the build, the compiler options and the estimator read it, none parses the text again."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from compiletune.cli import main
from compiletune.compiler.ac_policy import ActivationPolicy
from compiletune.config import resolve, schema

ROOT = Path(__file__).resolve().parents[3]


def test_ac_is_parsed_once_where_the_config_is_resolved(monkeypatch):
    calls = []
    real = schema.parse_ac

    def counted(text, every=1):
        calls.append((text, every))
        return real(text, every)

    monkeypatch.setattr(schema, "parse_ac", counted)
    cfg = resolve({}, {"ac": "budget=0.25", "ac_every": 2, "compile": True})
    assert calls == [("budget=0.25", 2)]  # the config's checks read it: parsed then
    for _ in range(3):
        assert cfg.techniques.activation_policy == ActivationPolicy("budget", 0.25, 2)
    assert len(calls) == 1
    other = cfg.replace(ac="selective")  # a config made anew parses its own text
    assert other.techniques.activation_policy == ActivationPolicy("selective", None, 2)
    assert cfg.techniques.activation_policy.kind == "budget"


def test_no_module_but_the_config_parses_the_ac_text():
    """`parse_ac` is called in compiletune only by the config (tests may build policies)."""
    callers = []
    for top in ("compiletune", "models", "passes"):
        for path in (ROOT / top).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Call):
                    f = node.func
                    name = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", "")
                    if name == "parse_ac":
                        callers.append(str(path.relative_to(ROOT)))
    assert callers == ["compiletune/config/schema.py"], callers


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        (["--ac", "selectve"], "did you mean 'selective'?"),
        (["--ac", "budget=2"], "--ac budget=2: the budget must be a number in [0, 1]"),
        (["--ac", "budget=half"], "--ac budget=half: the budget must be a number in [0, 1]"),
        (["--ac", "full", "--ac-every", "0"], "--ac-every must be at least 1, got 0"),
        (["--ac", "budget=0.5"], "add --compile"),
    ],
)
def test_a_bad_ac_is_one_clear_line(flags, says, capsys):
    assert main(["estimate-memory", *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert says in err and "\n" not in err and "Traceback" not in err, err
