"""The options every command spells the same way, defined once.

- ``-o/--out``: where a command writes (a folder or a file, as its help says). Older spellings stay as aliases.
- ``--checkpoint DIR``: the lattice checkpoint a command reads. Commands that took it as a positional argument
  (export, inspect) or as ``--against`` (verify) still do; :func:`merge_spellings` folds the positional form into
  ``args.checkpoint`` (and publish's positional staging folder into ``args.out``) before a command runs.
- ``--threads N``: CPU threads of a command that computes (a ladder ``N,N,...`` where a command measures over one).
- Exit statuses, the same for every command (tarq_deploy/cli.py returns them).
"""

from __future__ import annotations

import argparse

from ..errors import UserError

EXIT_OK = 0
EXIT_CHECK_FAILED = 1  # the command ran and a check it exists for failed: verify mismatch, a failed bench row or cell
EXIT_USER_ERROR = 2  # bad input: the message names the file or option; nothing was written
EXIT_BUG = 3  # an internal error: a traceback, saved to a file whose path is printed
EXIT_INTERRUPTED = 130

# Positional spellings kept beside the option: (dest of the positional, dest of the option, option's flag).
_POSITIONAL_SPELLINGS = (("checkpoint_arg", "checkpoint", "--checkpoint"), ("out_arg", "out", "-o/--out"))


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


def thread_list(text: str) -> list[int]:
    """``--threads N,N,...``: the ladder a measuring command runs over (one N is a ladder of one)."""
    try:
        threads = [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not threads or min(threads) < 1:
        raise argparse.ArgumentTypeError(f"thread counts must be >= 1, got {text!r}")
    return threads


def thread_count(text: str) -> int:
    """``--threads N``: a positive whole number."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, not {value}")
    return value


_SIZE_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
               "KIB": 1 << 10, "MIB": 1 << 20, "GIB": 1 << 30, "TIB": 1 << 40}


def memory_size(text: str) -> int:
    """``--max-memory SIZE``: bytes, written as a number and an optional unit (8GB, 6.5GiB, 512MB; none: bytes)."""
    number = text.strip().rstrip("bBiIkKmMgGtT")
    unit = text.strip()[len(number):].upper()
    try:
        value = float(number) * _SIZE_UNITS[unit]
    except (ValueError, KeyError):
        raise argparse.ArgumentTypeError(f"expected a size such as 8GB, 6GiB or 512MB, got {text!r}") from None
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a size of at least 0, not {text!r}")
    return int(value)
