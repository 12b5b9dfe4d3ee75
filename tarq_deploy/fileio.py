"""Atomic writes: every output goes to a temporary name beside its target and is renamed only when complete, so an
interrupted or failed run never leaves a half-written file or directory under the real name."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any


def write_bytes_atomic(path: str | os.PathLike, data: bytes) -> Path:
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return target


def write_text_atomic(path: str | os.PathLike, text: str) -> Path:
    return write_bytes_atomic(path, text.encode("utf-8"))


def write_json_atomic(path: str | os.PathLike, obj: Any, indent: int | None = 2) -> Path:
    return write_text_atomic(path, json.dumps(obj, indent=indent) + "\n")


def replace_directory(tmp: Path, out: Path) -> None:
    """Move the finished directory ``tmp`` to ``out``; an existing ``out`` is set aside first and removed only after
    the move (callers decide beforehand whether ``out`` may be replaced at all)."""
    if not out.exists():
        os.replace(tmp, out)
        return
    old = out.parent / f".{out.name}.old-{os.getpid()}"
    os.replace(out, old)
    os.replace(tmp, out)
    shutil.rmtree(old, ignore_errors=True)
