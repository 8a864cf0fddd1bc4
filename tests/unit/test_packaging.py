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
