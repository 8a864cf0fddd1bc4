"""The one exception type a user should ever see.

A `UserError` is bad input: the CLI prints its message as one line and exits with code 2.
The message names the input that is wrong and the fix.
"""


class UserError(Exception):
    """Bad input from the user (flags, config, data, model files). Exit code 2."""
