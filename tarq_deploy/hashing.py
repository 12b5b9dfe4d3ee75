"""Every digest the package computes, in one place: of bytes, of a stream of chunks, of a file, of files and folders,
and of a JSON value. Stdlib only, so any layer may use it.

The digests are keys that outlive a run (sweep keys, evaluation caches, checkpoint manifests, calibration work
folders), so each function's bytes are fixed: a change here would orphan every stored cache and checkpoint digest.
"""
from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import mmap

    Buffer = bytes | bytearray | memoryview | mmap.mmap  # what hashlib reads

__all__ = ["chunks_sha256", "code_version", "file_chunks", "file_sha256", "file_sha256_and", "files_sha256",
           "json_fingerprint", "sha1_hex", "sha256_hex"]

CHUNK_BYTES = 1 << 20  # the size of a read: the digest does not depend on it, memory does


def sha256_hex(data: Buffer) -> str:
    return hashlib.sha256(data).hexdigest()


def sha1_hex(data: Buffer) -> str:
    """The evaluation cache's short keys (audio samples, reference texts): sha1, as they were first written."""
    return hashlib.sha1(data).hexdigest()


def chunks_sha256(chunks: Iterable[Buffer]) -> str:
    """sha256 of the chunks one after another: for data that is streamed (a download, a copy, a model's tensors)
    and never held whole."""
    digest = hashlib.sha256()
    for chunk in chunks:
        digest.update(chunk)
    return digest.hexdigest()


def file_chunks(path: str | os.PathLike, size: int = CHUNK_BYTES) -> Iterator[bytes]:
    with open(path, "rb") as f:
        yield from iter(lambda: f.read(size), b"")


def file_sha256(path: str | os.PathLike) -> str:
    """sha256 of a file's bytes, read in chunks (model files run to gigabytes)."""
    return chunks_sha256(file_chunks(path))


def file_sha256_and(path: str | os.PathLike, other: Any) -> tuple[str, str]:
    """(sha256, ``other``'s hexdigest) of a file read once in chunks; ``other`` is a fresh streaming hasher (an
    object with update and hexdigest, such as xxhash's)."""
    digest = hashlib.sha256()
    for chunk in file_chunks(path):
        digest.update(chunk)
        other.update(chunk)
    return digest.hexdigest(), other.hexdigest()


def files_sha256(paths: Iterable[Path]) -> str:
    """sha256 over the names and bytes of files (a directory: every file under it, in sorted order): each file adds
    its name, a NUL, then its bytes. The sweep's model and corpus keys are this digest."""
    return chunks_sha256(_named_file_chunks(paths))


def _named_file_chunks(paths: Iterable[Path]) -> Iterator[bytes]:
    for path in paths:
        files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
        for file in files:
            yield file.name.encode() + b"\0"
            yield from file_chunks(file)


def json_fingerprint(obj: Any, *, ensure_ascii: bool = False, separators: tuple[str, str] | None = None,
                     default: Callable[[Any], Any] | None = None) -> str:
    """sha256 of ``obj`` as JSON with sorted keys. The defaults are the sweep's keys; the checkpoint manifest's own
    digest (compact separators, ASCII) and the calibration fingerprint (ASCII, ``str`` of anything else) pass the
    json.dumps options their stored digests were made with."""
    text = json.dumps(obj, sort_keys=True, ensure_ascii=ensure_ascii, separators=separators, default=default)
    return sha256_hex(text.encode())


def code_version() -> str:
    """The package version and the sha256 of its Python sources: any change to the code is a new key (sweep steps,
    the calibration benchmark's records)."""
    from . import __version__

    package = Path(__file__).resolve().parent
    sources = sorted(package.rglob("*.py"))
    digest = chunks_sha256(str(path.relative_to(package)).encode() + b"\0" + path.read_bytes() for path in sources)
    return f"{__version__}+{digest[:16]}"
