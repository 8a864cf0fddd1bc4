"""The one exception type a user should ever see.

A `UserError` is bad input: the CLI prints its message as one line and exits with code 2.
The message names the input that is wrong and the fix.
"""

import sys


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
