"""Errors that describe bad user input; the CLI prints them without a traceback and exits non-zero."""


class UserError(Exception):
    """An error caused by the user's input (the message names the file or option and the problem)."""
