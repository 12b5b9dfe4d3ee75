"""A strict reader of the JSONL files this package writes beside its manifests (non-speech clips, long-recording
spans): one JSON object a line, each field checked for its type, every problem one line naming the file and line.

Lines are split on ``\\n`` alone (a ``\\r`` before it is dropped): ``str.splitlines`` would also split inside a JSON
string holding U+2028 or U+0085, which ``json.dumps(ensure_ascii=False)`` writes as they are.
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Iterator, Mapping

from ..errors import JSON_ERRORS

__all__ = ["FieldReader", "jsonl_objects"]


def jsonl_objects(path: Path, error: type[ValueError]) -> Iterator[tuple[int, dict[str, Any]]]:
    """(line number, object) for every non-blank line of ``path``; ``error`` (a ValueError subclass) for a file that
    cannot be read, is not UTF-8, or holds a line that is not one JSON object."""
    for line_number, line in enumerate(_utf8_text(path, error).split("\n"), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except JSON_ERRORS as problem:
            raise error(f"{path}:{line_number}: not JSON ({type(problem).__name__}: {problem})") from None
        if not isinstance(record, dict):
            raise error(f"{path}:{line_number}: not a JSON object (a {type(record).__name__})")
        yield line_number, record


def _utf8_text(path: Path, error: type[ValueError]) -> str:
    try:
        data = path.read_bytes()
    except (OSError, ValueError) as problem:  # ValueError: a NUL byte in the name
        raise error(f"{path}: cannot be read ({problem})") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as problem:
        line_number = data[: problem.start].count(b"\n") + 1
        raise error(f"{path}:{line_number}: not UTF-8 text ({problem.reason} at byte {problem.start})") from None


class FieldReader:
    """Typed fields of one JSON object; each wrong field raises ``error`` with ``where`` ("file:line") and its name."""

    def __init__(self, record: Mapping[str, Any], where: str, error: type[ValueError]) -> None:
        self.record, self.where, self.error = record, where, error

    def fail(self, problem: str) -> ValueError:
        return self.error(f"{self.where}: {problem}")

    def only_keys(self, allowed: tuple[str, ...]) -> None:
        unknown = sorted(str(key) for key in self.record if key not in allowed)
        if unknown:
            raise self.fail(f"unknown field(s) {', '.join(map(repr, unknown))} (allowed: {', '.join(allowed)})")

    def present(self, key: str) -> Any:
        if key not in self.record:
            raise self.fail(f"field {key!r} is missing")
        return self.record[key]

    def string(self, key: str, *, empty: bool = False) -> str:
        value = self.present(key)
        if not isinstance(value, str) or (not empty and not value):
            raise self.fail(f"field {key!r} must be a{'' if empty else ' non-empty'} string, not {value!r:.40}")
        return value

    def optional_string(self, key: str) -> str | None:
        return None if self.present(key) is None else self.string(key)

    def number(self, key: str) -> float:
        value = self.present(key)
        # bool is an int to Python; a JSON true is no number of seconds
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise self.fail(f"field {key!r} must be a finite number, not {value!r:.40}")
        return float(value)

    def optional_number(self, key: str) -> float | None:
        return None if self.present(key) is None else self.number(key)

    def integer(self, key: str, minimum: int = 0) -> int:
        value = self.present(key)
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise self.fail(f"field {key!r} must be an integer of at least {minimum}, not {value!r:.40}")
        return value

    def array(self, key: str) -> list[Any]:
        value = self.present(key)
        if not isinstance(value, list):
            raise self.fail(f"field {key!r} must be a list, not {type(value).__name__}")
        return value
