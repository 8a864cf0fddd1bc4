"""The shape of the code: imports run one way, and the few deferred ones say why."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("compiletune", "models", "passes")  # models/ and passes/ install as compiletune.*


def _modules() -> dict[str, Path]:
    out = {}
    for top in PACKAGES:
        for path in (ROOT / top).rglob("*.py"):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[0] != "compiletune":
                parts.insert(0, "compiletune")
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


def _imports(
    name: str, path: Path, modules: dict[str, Path], tree: ast.Module | None = None
) -> list[tuple[str, ast.stmt]]:
    """(our module it imports, the statement) for every import in the file, at any depth.
    `tree`: the file already parsed, for a caller that compares these statements with other
    nodes of it (nodes of two parses are different objects)."""

    def ours(dotted: str) -> str | None:
        while dotted and dotted not in modules:
            dotted = dotted.rpartition(".")[0]
        return dotted or None

    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []
    for node in ast.walk(tree if tree is not None else ast.parse(path.read_text())):
        targets = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                stem = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*stem, base] if base else stem)
            targets = [
                f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names
            ]
        for t in targets:
            dep = ours(t)
            if dep and dep != name:
                found.append((dep, node))
    return found


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The circles a depth-first walk of `graph` (node -> the nodes it imports) meets, each as
    the path from a node back to itself."""
    circles, state = [], {}

    def visit(m: str, trail: list[str]) -> None:
        state[m] = "open"
        for d in sorted(graph.get(m, ())):
            if state.get(d) == "open":
                circles.append(trail[trail.index(d) :] + [d])
            elif d not in state:
                visit(d, [*trail, d])
        state[m] = "done"

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    return circles


def _module_graph() -> dict[str, set[str]]:
    """Each of our modules -> ours it imports, at any depth: the top, inside functions, under
    `if TYPE_CHECKING:`."""
    modules = _modules()
    return {m: {d for d, _ in _imports(m, p, modules)} for m, p in modules.items()}


def _package(module: str) -> str:
    """The package a module belongs to for the package-level check: its first level under
    compiletune (compiletune.train.run_dir.lock -> compiletune.train; models/ installs as
    compiletune.models). A module directly under compiletune (cli.py, distributed.py) is one of
    its own, as is the root package."""
    return ".".join(module.split(".")[:2])


def _package_graph(modules: dict[str, set[str]]) -> dict[str, set[str]]:
    """Package -> the other packages its modules import (`modules` as `_module_graph`)."""
    graph: dict[str, set[str]] = {}
    for m, deps in modules.items():
        mine = _package(m)
        graph.setdefault(mine, set()).update(_package(d) for d in deps if _package(d) != mine)
    return graph


def test_the_import_graph_has_no_circles():
    circles = _circles(_module_graph())
    assert not circles, "import circles:\n" + "\n".join(" -> ".join(c) for c in circles)


def test_packages_import_one_way():
    """No circle between packages either: train/ and estimate/, say, may not import each other
    even through modules that do not import each other (estimate.estimator -> train.build and
    train.loop -> estimate.fit is a circle of packages, and none of modules). Every import
    counts, the deferred ones and the annotation-only ones (`if TYPE_CHECKING:`) too: a
    function-level import still needs the other package at run time, and an annotation still
    ties a package to the other's types; deferring an import does not make the layers one-way."""
    circles = _circles(_package_graph(_module_graph()))
    assert not circles, "package circles:\n" + "\n".join(" -> ".join(c) for c in circles)


def test_the_package_check_finds_a_circle_the_module_check_misses():
    """The check itself: two packages whose modules import each other's other modules make a
    circle of packages but none of modules; a package's own modules importing one another, and
    a subpackage importing its parent, make none."""
    graph = {
        "compiletune.train.loop": {"compiletune.estimate.fit", "compiletune.train.build"},
        "compiletune.train.build": {"compiletune.models.decoder"},
        "compiletune.train.run_dir.lock": {"compiletune.train.build"},
        "compiletune.estimate.fit": {"compiletune.estimate.estimator"},
        "compiletune.estimate.estimator": {"compiletune.train.build", "compiletune.errors"},
        "compiletune.models.decoder": {"compiletune.errors"},
        "compiletune.errors": set(),
    }
    assert _circles(graph) == []
    packages = _package_graph(graph)
    assert packages["compiletune.train"] == {"compiletune.estimate", "compiletune.models"}
    assert _circles(packages) == [
        ["compiletune.estimate", "compiletune.train", "compiletune.estimate"]
    ]
    graph["compiletune.train.loop"].discard("compiletune.estimate.fit")
    assert _circles(_package_graph(graph)) == []


def _silent_deferred_imports(
    name: str, path: Path, source: str, modules: dict[str, Path]
) -> list[int]:
    """Lines of the imports of our modules inside a function of `source` (module `name`, file
    `path`) with no reason: a comment on the statement, or a comment line above it or above
    the group of import statements it belongs to (a blank line ends a group). One parse:
    the statements `_imports` returns are compared by identity with the nodes under each
    function of the same tree."""
    lines = source.splitlines()
    tree = ast.parse(source)
    inner = {
        id(s)
        for f in ast.walk(tree)
        if isinstance(f, ast.FunctionDef | ast.AsyncFunctionDef)
        for s in ast.walk(f)
    }
    import_lines = {
        i
        for n in ast.walk(tree)
        if isinstance(n, ast.Import | ast.ImportFrom)
        for i in range(n.lineno, n.end_lineno + 1)
    }

    def says_why(node: ast.stmt) -> bool:
        text = lines[node.lineno - 1 : node.end_lineno]
        above = node.lineno - 1  # 1-based: the line above, while it is in the group
        while above >= 1 and (above in import_lines or lines[above - 1].strip().startswith("#")):
            if above not in import_lines:  # a comment line, not another import's own comment
                text.append(lines[above - 1])
            above -= 1
        return "#" in " ".join(text)

    return sorted(
        {
            node.lineno  # one line per statement, however many of our modules it names
            for _, node in _imports(name, path, modules, tree)
            if id(node) in inner and not says_why(node)
        }
    )


def test_deferred_imports_of_our_modules_say_why():
    """An import of our own module inside a function is for an optional dependency, a
    subcommand's start-up cost or an import circle (named), written on its line; any other
    belongs at the top."""
    modules = _modules()
    silent = [
        f"{path.relative_to(ROOT)}:{line}"
        for name, path in modules.items()
        for line in _silent_deferred_imports(name, path, path.read_text(), modules)
    ]
    assert not silent, "function-level imports without a reason: " + ", ".join(silent)


def test_the_deferred_import_check_flags_a_silent_one():
    """The check itself: in a synthetic module, a silent function-level import of our module is
    flagged (absolute and relative); one with a reason on it or above its group, one at the
    top and one of another package are not."""
    modules = _modules()
    source = "\n".join(
        [
            "from compiletune import errors",  # 1: top level
            "def f():",
            "    from compiletune import metrics",  # 3: silent
            "    from compiletune import loggers  # lazy: optional",  # 4: says why
            "    from . import step",  # 5: silent, relative
            "    import json",  # 6: not ours
            "    x = 1  # a comment on code is no reason",
            "    from compiletune import fp8",  # 8: silent
            "",
            "    # lazy: an optional dependency",
            "    from compiletune import plot",  # 11: the comment above says why
            "    from compiletune.train import (",  # 12: and for the group
            "        loop,",
            "    )",
            "",
            "    from compiletune import hub",  # 16: silent, a blank line ends the group
        ]
    )
    path = ROOT / "compiletune" / "train" / "synthetic.py"
    silent = _silent_deferred_imports("compiletune.train.synthetic", path, source, modules)
    assert silent == [3, 5, 8, 16]


# Modules over 800 lines, each with why it is still one module. A module that grows past the
# limit fails here until it is split or listed with its reason.
# None is, today.
LONG_MODULES: dict[str, str] = {}


def test_long_modules_are_known():
    long = {
        str(p.relative_to(ROOT))
        for p in _modules().values()
        if len(p.read_text().splitlines()) > 800
    }
    assert long <= set(LONG_MODULES), f"over 800 lines: {sorted(long - set(LONG_MODULES))}"


def test_long_functions_say_why():
    """A function over 100 lines carries a comment saying why, on the lines just above it
    (decorators included): "# Over 100 lines, on purpose: ..."."""
    silent = []
    for path in _modules().values():
        lines = path.read_text().splitlines()
        for node in ast.walk(ast.parse("\n".join(lines))):
            if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            if node.end_lineno - node.lineno + 1 <= 100:
                continue
            top = min([node.lineno, *(d.lineno for d in node.decorator_list)])
            above = " ".join(lines[max(0, top - 4) : top - 1])
            if "over 100 lines" not in above.lower():
                silent.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}")
    assert not silent, "functions over 100 lines without a reason: " + ", ".join(silent)


# --- a family in one place ------------------------------------------------------------------

FAMILY_DIR = ROOT / "models" / "families"
# Where a family's model_type may also be written, with why.
FAMILY_NAME_ELSEWHERE = {
    # ModelArgs' default family: args.py sits below the family modules (they build ModelArgs),
    # so it cannot read the registry's DEFAULT_FAMILY
    ("models/args.py", "llama"),
    # llama.cpp's own names (tokenizer.ggml.model "llama", pre-tokenizer "qwen2"), not families
    ("compiletune/gguf_vocab.py", "llama"),
    ("compiletune/gguf_vocab.py", "qwen2"),
}


def _family_homes() -> dict[str, Path]:
    """model_type -> the family module whose `Family(...)` entry names it."""
    homes = {}
    for path in FAMILY_DIR.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "Family":
                homes[node.args[0].value] = path
    return homes


def _family_literals(source: str, names: set[str]) -> set[str]:
    """The family names `source` writes as a string: the whole string, or quoted inside one."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            text = node.value
            found |= {n for n in names if text == n or f"'{n}'" in text or f'"{n}"' in text}
    return found


def test_a_family_name_is_written_only_in_its_own_module():
    """Each family's model_type appears, as a string, in its own module under models/families/
    and the registry (models/families/__init__.py), in no other source module: what is
    specific to a family is data of its module, and shared code reads that data."""
    homes = _family_homes()
    assert {"llama", "gpt_oss", "qwen3_5_moe_text"} <= set(homes) and len(homes) >= 18
    registry = FAMILY_DIR / "__init__.py"
    stray = sorted(
        f"{path.relative_to(ROOT)}: {name!r}"
        for path in _modules().values()
        for name in _family_literals(path.read_text(), set(homes))
        if path not in (homes[name], registry)
        and (str(path.relative_to(ROOT)), name) not in FAMILY_NAME_ELSEWHERE
    )
    assert not stray, "family names outside their family module:\n" + "\n".join(stray)


def test_the_family_name_check_finds_them():
    source = 'a = "gpt_oss"\nb = f"family {x!r} is not \'mixtral\'"\nc = "gpt_oss_20b"\n# "qwen2"\n'
    assert _family_literals(source, {"gpt_oss", "mixtral", "qwen2"}) == {"gpt_oss", "mixtral"}
