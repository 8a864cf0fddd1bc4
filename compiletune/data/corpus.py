"""The embedded default corpus: docstrings of the Python standard library.

`compiletune train` with no `--data` must run with nothing downloaded and no data file shipped.
Python's own docstrings are several hundred KB of edited English (with some code) that every
installation already has, so they serve as the default `pydocs` source.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import warnings

# Fixed order, so the corpus (and therefore a default run) is the same on every run of a given
# Python version. Pure-Python modules with well-written docstrings; nothing whose import has side
# effects (this, antigravity, turtle) and nothing deprecated for removal (cgi, imghdr, ...).
MODULES = (
    "abc",
    "argparse",
    "ast",
    "asyncio.events",
    "asyncio.locks",
    "asyncio.queues",
    "asyncio.streams",
    "asyncio.tasks",
    "base64",
    "bdb",
    "bz2",
    "calendar",
    "cmd",
    "code",
    "codecs",
    "collections",
    "configparser",
    "contextlib",
    "copy",
    "csv",
    "dataclasses",
    "datetime",
    "decimal",
    "difflib",
    "dis",
    "doctest",
    "email.charset",
    "email.header",
    "email.message",
    "email.parser",
    "email.utils",
    "enum",
    "filecmp",
    "fileinput",
    "fnmatch",
    "fractions",
    "ftplib",
    "functools",
    "getopt",
    "graphlib",
    "gzip",
    "hashlib",
    "heapq",
    "hmac",
    "html.parser",
    "http.client",
    "http.cookiejar",
    "http.server",
    "importlib.abc",
    "inspect",
    "ipaddress",
    "json",
    "json.decoder",
    "json.encoder",
    "linecache",
    "logging",
    "logging.handlers",
    "lzma",
    "mailbox",
    "numbers",
    "operator",
    "optparse",
    "pathlib",
    "pdb",
    "pickle",
    "plistlib",
    "pprint",
    "profile",
    "pstats",
    "queue",
    "random",
    "re",
    "sched",
    "secrets",
    "shelve",
    "shutil",
    "smtplib",
    "socketserver",
    "statistics",
    "string",
    "subprocess",
    "tarfile",
    "tempfile",
    "textwrap",
    "threading",
    "timeit",
    "tokenize",
    "trace",
    "traceback",
    "typing",
    "unittest.case",
    "unittest.mock",
    "urllib.parse",
    "urllib.request",
    "uuid",
    "warnings",
    "weakref",
    "xml.dom.minidom",
    "xml.etree.ElementTree",
    "zipfile",
)

# About 4 KB per module keeps the corpus near 300 KB and spreads it over all 100 modules.
MAX_CHARS_PER_MODULE = 4000


def _member_docs(owner: object, prefix: str) -> list[tuple[str, str]]:
    """(qualified name, raw docstring) of the public functions and classes directly in `owner`."""
    out = []
    for name, value in sorted(vars(owner).items()):
        if name.startswith("_"):
            continue
        if isinstance(value, (staticmethod, classmethod)):
            value = value.__func__
        elif isinstance(value, property):
            value = value.fget
        if inspect.isroutine(value) or inspect.isclass(value):
            out.append((f"{prefix}.{name}", getattr(value, "__doc__", None)))
    return out


def _module_document(module_name: str, seen: set[str]) -> str:
    """One document: the module docstring, then each public class/function/method docstring."""
    module = importlib.import_module(module_name)
    entries = [(module_name, module.__doc__)]
    for qualname, doc in _member_docs(module, module_name):
        obj = getattr(module, qualname.rsplit(".", 1)[1])
        # Only what the module defines itself: re-exported names would repeat other modules.
        if getattr(obj, "__module__", None) != module_name:
            continue
        entries.append((qualname, doc))
        if inspect.isclass(obj):
            entries.extend(_member_docs(obj, qualname))
    parts = []
    size = 0
    for qualname, doc in entries:
        if not isinstance(doc, str):
            continue
        text = inspect.cleandoc(doc)
        # Dedupe across the whole corpus: inherited or copied docstrings would be learnt twice.
        if len(text) < 20 or text in seen:
            continue
        part = f"{qualname}\n\n{text}"
        # Whole entries up to the cap (the module docstring always), so no module dominates.
        if parts and size + len(part) > MAX_CHARS_PER_MODULE:
            break
        seen.add(text)
        parts.append(part)
        size += len(part) + 3
    return "\n\n\n".join(parts)


@functools.cache
def _corpus() -> tuple[str, ...]:
    seen: set[str] = set()
    docs = []
    for name in MODULES:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                doc = _module_document(name, seen)
        except Exception:  # a module missing on this platform (sqlite3, curses...) is skipped
            continue
        if doc:
            docs.append(doc)
    return tuple(docs)


def pydoc_corpus() -> list[str]:
    """The `pydocs` corpus: one document per standard-library module in `MODULES`.

    Deterministic for a given Python version. Empty under `python -OO`, which strips docstrings.
    """
    return list(_corpus())
