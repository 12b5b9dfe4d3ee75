"""The options every command spells the same way, defined once.

- ``-o/--out``: where a command writes (a folder or a file, as its help says). Older spellings stay as aliases.
- ``--checkpoint DIR``: the lattice checkpoint a command reads. Commands that took it as a positional argument
  (export, inspect) or as ``--against`` (verify) still do; :func:`merge_spellings` folds the positional form into
  ``args.checkpoint`` (and publish's positional staging folder into ``args.out``) before a command runs.
- ``--threads N``: CPU threads of a command that computes (a ladder ``N,N,...`` where a command measures over one).
- ``--decode greedy|cli``: the decode profile of every Whisper decoding a command runs (runtimes/decoding.py); the
  default is whisper-cli's (``cli``), what users run.
- Exit statuses, the same for every command (tarq_deploy/cli.py returns them).
"""

from __future__ import annotations

import argparse

from ..errors import UserError

__all__ = ["EXIT_BUG", "EXIT_CHECK_FAILED", "EXIT_INTERRUPTED", "EXIT_USER_ERROR", "add_checkpoint", "add_decode", "add_out",
           "add_positional_out", "merge_spellings", "require"]

EXIT_OK = 0
EXIT_CHECK_FAILED = 1  # the command ran and a check it exists for failed: verify mismatch, a failed bench row or cell
EXIT_USER_ERROR = 2  # bad input: the message names the file or option; nothing was written
EXIT_BUG = 3  # an internal error: a traceback, saved to a file whose path is printed
EXIT_INTERRUPTED = 130

# Positional spellings kept beside the option: (dest of the positional, dest of the option, option's flag).
_POSITIONAL_SPELLINGS = (("checkpoint_arg", "checkpoint", "--checkpoint"), ("out_arg", "out", "-o/--out"))


def add_decode(parser: argparse.ArgumentParser) -> None:
    """--decode PROFILE, the same choices and default in every command that decodes."""
    from ..runtimes.decoding import DECODE_PROFILES, DEFAULT_DECODE_PROFILE

    parser.add_argument("--decode", choices=DECODE_PROFILES, default=DEFAULT_DECODE_PROFILE,
                        help="decode profile: cli = whisper-cli's defaults (beam search 5, temperature fallback, "
                             "timestamps; what users run), greedy = temperature 0 without fallback, no timestamps "
                             f"(the research protocol); default {DEFAULT_DECODE_PROFILE}")


def add_out(parser: argparse.ArgumentParser, help: str, *, required: bool = False, default: str | None = None,
            aliases: tuple[str, ...] = (), dest: str = "out", metavar: str = "PATH") -> None:
    """``-o/--out`` (plus older ``aliases`` such as ``--output``)."""
    parser.add_argument("-o", "--out", *aliases, dest=dest, required=required, default=default, metavar=metavar,
                        help=help)


def add_checkpoint(parser: argparse.ArgumentParser, help: str, *, positional: bool = False,
                   aliases: tuple[str, ...] = (), required: bool = False) -> None:
    """``--checkpoint DIR`` (plus ``aliases``); ``positional``: the older bare CHECKPOINT_DIR argument too."""
    if positional:
        parser.add_argument("checkpoint_arg", nargs="?", metavar="CHECKPOINT_DIR",
                            help=f"{help} (the same as --checkpoint)")
    parser.add_argument("--checkpoint", *aliases, dest="checkpoint", metavar="DIR", help=help,
                        required=required and not positional)


def add_positional_out(parser: argparse.ArgumentParser, metavar: str, help: str) -> None:
    """An older positional output argument, kept beside ``-o/--out``."""
    parser.add_argument("out_arg", nargs="?", metavar=metavar, help=f"{help} (the same as -o/--out)")


def merge_spellings(args: argparse.Namespace) -> None:
    """Fold a positional spelling into its option; the same value given both ways is fine, two different ones are
    refused by name."""
    for positional, option, flag in _POSITIONAL_SPELLINGS:
        if not hasattr(args, positional):
            continue
        given, named = getattr(args, positional), getattr(args, option, None)
        if given is not None and named is not None and given != named:
            raise UserError(f"{flag}: given twice with different values ({named!r} and {given!r})")
        setattr(args, option, named if named is not None else given)
        delattr(args, positional)


def require(args: argparse.Namespace, dest: str, flag: str) -> str:
    """The value of an option that one of its spellings must give."""
    value = getattr(args, dest, None)
    if value is None:
        raise UserError(f"{flag} is required")
    return value
