"""Checks of what a command was given, run before any slow work starts: output paths, devices.

Each raises UserError naming the option, the path and the problem, so the CLI reports it in one line (exit 2)
instead of failing after minutes of calibration or measurement."""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

from .errors import UserError

__all__ = ["Output", "check_device", "check_output_dir", "check_output_file", "check_outputs_apart", "probe_writable"]


def _existing_ancestor(path: Path) -> Path:
    """The nearest ancestor of ``path`` (itself excluded) that exists."""
    parent = path.absolute().parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    return parent


def probe_writable(option: str, path: Path) -> None:
    """UserError unless a file can be created where ``path`` would go (its nearest existing ancestor directory).

    A real probe (a temporary file created and removed), not os.access: that answers for root as if every directory
    were writable, and says nothing about a full disk's inode table."""
    where = _existing_ancestor(path)
    if not where.is_dir():
        raise UserError(f"{option} {path}: {where} is not a directory")
    try:
        with tempfile.TemporaryFile(dir=where, prefix=".tarq-deploy-probe-"):
            pass
    except OSError as e:
        raise UserError(f"{option} {path}: cannot write in {where} ({os.strerror(e.errno) if e.errno else e})") from None


def check_output_file(option: str, path: str | os.PathLike) -> Path:
    """An output file about to be written (replaced atomically): not a directory, and its folder writable."""
    target = Path(path)
    if target.is_dir():
        raise UserError(f"{option} {target}: is a directory; give the file name to write")
    probe_writable(option, target)
    return target


def check_output_dir(option: str, path: str | os.PathLike, replaceable: str | None = None) -> Path:
    """An output directory about to be written (built beside it, then renamed into place).

    An existing ``path`` must be a directory that is empty or holds the file ``replaceable`` (what this command
    writes, e.g. a checkpoint's manifest.json): anything else is the user's and is not replaced."""
    target = Path(path)
    if target.exists():
        if not target.is_dir():
            raise UserError(f"{option} {target}: exists and is not a directory")
        if any(target.iterdir()) and (replaceable is None or not (target / replaceable).is_file()):
            what = f"has no {replaceable}" if replaceable else "is not empty"
            raise UserError(f"{option} {target}: exists and {what}; refusing to replace it (choose a new path or "
                            f"remove it)")
    probe_writable(option, target)
    return target


class OutputOverInput(UserError):
    """An output path is one of the command's inputs, lies inside one, or would replace a folder holding one."""


@dataclass(frozen=True)
class Output:
    """A path a command writes. ``whole``: everything at and under ``path`` is written or replaced (a file, a
    checkpoint or staging folder built beside it and renamed over it); False: a folder the command writes named
    files into (given as Outputs of their own), where inputs may lie beside them."""

    option: str
    path: str | os.PathLike
    whole: bool = True


def check_outputs_apart(outputs: Iterable[Output], inputs: Iterable[tuple[str, str | os.PathLike | None]]) -> None:
    """OutputOverInput, naming both paths, when an output is an input, lies inside one (a file written into a
    checkpoint folder), or is a whole output whose folder holds an input. ``inputs`` are (option, path) pairs;
    those that are not paths on this disk (None, packaged:NAME, a hub id) cannot be written over and are skipped.

    Called before any work starts, so a refused command has read nothing slowly and written nothing."""
    present = [(option, Path(path)) for option, path in inputs if path is not None and os.path.exists(path)]
    for output in outputs:
        for option, path in present:
            relation = _overlap(Path(output.path), path, output.whole)
            if relation is not None:
                raise OutputOverInput(f"{output.option} {output.path}: {relation} {option} {path}; refusing to "
                                      f"write over an input (choose an output path outside it)")


def _overlap(output: Path, source: Path, whole: bool) -> str | None:
    """How writing ``output`` would touch the input ``source``, or None when it would not."""
    if _within(output, source):
        return "is the input" if _within(source, output) else "lies inside the input"
    if whole and _within(source, output):
        return "would replace the folder holding the input"
    return None


def _within(child: Path, parent: Path) -> bool:
    """``child`` is ``parent`` or lies under it, symlinks resolved. Each existing ancestor of ``child`` is also
    compared with ``parent`` by identity (os.path.samefile), so a hard link or a second mount of the same folder
    counts too; a path that does not exist yet is compared by its resolved name."""
    target = os.path.realpath(parent)
    target_exists = os.path.exists(target)
    node = os.path.realpath(child)
    while True:
        if node == target or (target_exists and os.path.exists(node) and os.path.samefile(node, target)):
            return True
        up = os.path.dirname(node)
        if up == node:
            return False
        node = up


def check_device(device: str, option: str = "--device") -> str:
    """UserError unless torch can run on ``device`` here (cpu, cuda, cuda:N, mps)."""
    import torch

    try:
        parsed = torch.device(device)
    except (RuntimeError, ValueError):
        raise UserError(f"{option} {device}: not a device name (cpu, cuda, cuda:N)") from None
    if parsed.type == "cpu":
        return device
    if parsed.type == "cuda":
        if not torch.cuda.is_available():
            build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
            raise UserError(f"{option} {device}: no CUDA device is available (torch {torch.__version__}, {build})")
        if parsed.index is not None and parsed.index >= torch.cuda.device_count():
            raise UserError(f"{option} {device}: only {torch.cuda.device_count()} CUDA device(s) present")
        return device
    if parsed.type == "mps" and torch.backends.mps.is_available():
        return device
    raise UserError(f"{option} {device}: not available here (use cpu or cuda)")

