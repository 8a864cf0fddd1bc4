"""Which packages the wheel holds, found by setuptools rather than listed by hand.

Everything else is declared in pyproject.toml. The import package `compiletune` is spread over
four top-level folders (DESIGN.md, "Layout"): `compiletune/` itself, and `models/`, `passes/` and
`configs/`, which install as its subpackages so that no generic top-level `models` or `passes`
name is created. setuptools' `packages.find` cannot rename a folder, so each folder is searched
here with `find_packages` and its subpackages are named under their import name: a new
subpackage (with an `__init__.py`) is in the next wheel without an edit to any list.
"""

from setuptools import find_packages, setup

# import name -> folder; subpackages follow their parent's folder
FOLDERS = {
    "compiletune": "compiletune",
    "compiletune.models": "models",
    "compiletune.passes": "passes",
    "compiletune.configs": "configs",
}

packages = []
for name, folder in FOLDERS.items():
    packages.append(name)
    packages += [f"{name}.{sub}" for sub in find_packages(folder)]

setup(packages=packages, package_dir=FOLDERS)
