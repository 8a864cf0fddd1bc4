"""The one exception type a user should ever see.

A `UserError` is bad input: the CLI prints its message as one line and exits with code 2.
The message names the input that is wrong and the fix.
"""

import difflib
import sys
from collections.abc import Iterable


class UserError(Exception):
    """Bad input from the user (flags, config, data, model files). Exit code 2."""

    shown = False  # already printed (by a rank of an FSDP job, before its group closed)


def show(error: UserError) -> None:
    """Print `error` as the one line the CLI ends with (once)."""
    if not error.shown:
        message = " ".join(str(error).split())  # one line, whatever a message quotes
        sys.stderr.write(f"compiletune: error: {message}\n")
        sys.stderr.flush()
        error.shown = True


def closest(word: str, known: Iterable[str]) -> str | None:
    """The known name nearest to a mistyped `word` (for "did you mean ...?"), or None when none
    is near: the one matcher of flags, YAML keys and preset names."""
    near = difflib.get_close_matches(word, list(known), n=1, cutoff=0.6)
    return near[0] if near else None
