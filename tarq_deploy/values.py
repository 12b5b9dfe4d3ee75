"""Option values written as text, parsed the same way by every command line and by the sweep's tables: thread
counts, thread ladders and memory sizes. Each parser raises argparse.ArgumentTypeError (argparse shows its message
as it is; the sweep names the key beside it)."""

from __future__ import annotations

import argparse

__all__ = ["thread_list", "thread_count", "memory_size"]


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
