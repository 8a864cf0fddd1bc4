"""The wheel holds every module of the source tree under its import name.

`pip install -e .` and the tests import from the source tree, so a package left out of the wheel
(`compiletune.rl` once was: `compiletune train` from a wheel ended in ModuleNotFoundError) is
seen only by a user who installs the wheel. This builds one from a copy of the tree and compares
its modules with the source files; `.ci/wheel` also installs it into a fresh environment and
trains from it.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# folder -> import name, as setup.py maps them
FOLDERS = {
    "compiletune": "compiletune",
    "models": "compiletune/models",
    "passes": "compiletune/passes",
    "configs": "compiletune/configs",
}


def _source_files() -> set[str]:
    """Every tracked module and recipe of the package folders, as its path inside the wheel."""
    tracked = subprocess.run(
        ["git", "ls-files", *FOLDERS], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split()
    wanted = set()
    for path in tracked:
        folder, _, rest = path.partition("/")
        if path.endswith((".py", ".yaml")):
            wanted.add(f"{FOLDERS[folder]}/{rest}")
    return wanted


@pytest.mark.slow
def test_the_wheel_holds_every_module(tmp_path: Path) -> None:
    tree = tmp_path / "tree"
    tree.mkdir()
    for name in ("pyproject.toml", "setup.py", "README.md"):
        shutil.copy(ROOT / name, tree / name)
    for folder in FOLDERS:
        shutil.copytree(ROOT / folder, tree / folder, ignore=shutil.ignore_patterns("__pycache__"))
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q"]
        + ["-w", str(tmp_path / "dist"), str(tree)],
        check=True,
        capture_output=True,
    )
    (wheel,) = (tmp_path / "dist").glob("compiletune-*.whl")
    held = set(zipfile.ZipFile(wheel).namelist())
    missing = _source_files() - held
    assert not missing, f"the wheel lacks {sorted(missing)}"
    assert not any(name.startswith(("models/", "passes/")) for name in held)  # no top-level names


# Declared dependencies that our code does not import itself, each with the reason it is needed.
USED_THROUGH_OTHERS = {
    "jinja2": "transformers renders chat templates with it but does not require it",
}
IMPORT_NAMES = {"pyyaml": "yaml", "huggingface_hub": "huggingface_hub"}


def test_every_declared_dependency_is_used() -> None:
    """A core dependency nothing imports (einops was one) is a download for every user."""
    import ast
    import re

    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    names = {re.split(r"[<>=!~ \[;]", spec, maxsplit=1)[0].lower() for spec in declared}
    imported: set[str] = set()
    for folder in FOLDERS:
        for path in (ROOT / folder).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Import):
                    imported |= {alias.name.split(".")[0] for alias in node.names}
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    imported.add(node.module.split(".")[0])
    unused = {
        name
        for name in names
        if IMPORT_NAMES.get(name, name.replace("-", "_")) not in imported
        and name not in USED_THROUGH_OTHERS
    }
    assert not unused, f"declared in pyproject.toml but imported nowhere: {sorted(unused)}"
