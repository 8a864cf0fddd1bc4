"""The command-line flags of `train` and `estimate-memory`: one per config field, from its
declaration (name, type, choices, help with the default as it is decided)."""

from __future__ import annotations

import argparse
from collections.abc import Collection
from dataclasses import fields
from typing import Any, Literal, get_args, get_origin

from compiletune.config.schema import SECTIONS, flag_of, hints_of, key_of, unwrap

_METAVARS = {int: "N", float: "F", str: "VALUE"}


def add_flags(
    parser: argparse.ArgumentParser,
    *,
    estimate_only: bool = False,
    only: Collection[str] | None = None,
) -> None:
    """One flag per config field, grouped by section. Every flag defaults to SUPPRESS, so only
    flags the user typed reach the config and YAML values survive. `estimate_only`: just the
    flags that change a memory estimate; `only`: just the fields of these keys (`eval`)."""
    S = argparse.SUPPRESS
    for cls in SECTIONS.values():
        group = parser.add_argument_group(cls.TITLE)
        hints = hints_of(cls)
        for f in fields(cls):
            meta = f.metadata
            if estimate_only and not meta["estimate"]:
                continue
            if only is not None and key_of(f) not in only:
                continue
            typ, _ = unwrap(hints[f.name])
            help_text = meta["help"]
            shown = meta["shows"] if meta["shows"] is not None else f.default
            kw: dict[str, Any] = {"default": S, "dest": key_of(f)}
            if typ is bool and meta["negate"]:
                group.add_argument(
                    "--no-" + key_of(f).replace("_", "-"),
                    action="store_false",
                    help=help_text,
                    **kw,
                )
                continue
            if typ is bool:
                if f.default is None:
                    kw["action"] = argparse.BooleanOptionalAction
                    help_text += f" (default: {shown})"
                else:
                    kw["action"] = "store_true"
            elif hasattr(typ, "parse"):
                # A parsed value (`--offload-activations [N|all|auto]`): the flag alone is
                # `true`, as in YAML; the text reaches `typ.parse` through the config.
                kw.update(nargs="?", const=True, metavar=meta["metavar"])
                help_text += f" (default: {shown})"
            elif get_origin(typ) is Literal:
                kw["choices"] = get_args(typ)
                if shown is not None:
                    help_text += f" (default: {shown})"
            else:
                kw["type"] = typ
                kw["metavar"] = meta["metavar"] or _METAVARS.get(typ, "VALUE")
                if shown is not None:
                    help_text += f" (default: {shown})"
            group.add_argument(flag_of(f), help=help_text.replace("%", "%%"), **kw)
