"""The runtimes' questions about a model source: what it is comes from tarq_deploy.model_source (resolve_source), and the
gates here parse a file strictly before a runtime may see it (``checked_gguf`` for every GGUF runtime,
``checked_whisper_cpp`` for every .bin runtime): a runtime must never see a file our parser rejects."""
from __future__ import annotations

import os
from pathlib import Path

from ..errors import UserError
from ..model_source import ModelSource, SourceKind, resolve_source
from .base import ModelSpec

__all__ = ["checked_gguf", "checked_whisper_cpp", "is_gguf_of_arch", "is_whisper_cpp_file"]


def is_whisper_cpp_file(source: str | os.PathLike | ModelSource) -> bool:
    return resolve_source(source).kind is SourceKind.WHISPER_CPP


def is_gguf_of_arch(source: str | os.PathLike | ModelSource, arch: str) -> bool:
    """A GGUF file whose general.architecture is ``arch`` and which our strict reader accepts (a file it rejects is
    claimed by no runtime)."""
    found = resolve_source(source)
    if found.kind is not SourceKind.GGUF or found.architecture != arch:
        return False
    from tarq_deploy.formats.gguf_file import GGUFFileError, read_gguf

    try:
        return read_gguf(found.path).arch == arch
    except GGUFFileError:
        return False


def checked_gguf(spec: ModelSpec, arch: str, runtime: str, export_target: str) -> Path:
    """The resolved path of ``spec``'s GGUF once our strict reader accepts it and its architecture is ``arch``; a
    UserError naming the model and file otherwise."""
    from tarq_deploy.formats.gguf_file import GGUFFileError, read_gguf

    path = Path(spec.source).expanduser()
    try:
        found = read_gguf(path).arch
    except GGUFFileError as error:
        raise UserError(f"model {spec.label!r}: {error}") from None
    if found != arch:
        raise UserError(f"model {spec.label!r}: {path} is a {found!r} GGUF; {runtime} runs architecture {arch!r} "
                        f"(tarq-deploy export --target {export_target})")
    return path.resolve()


def checked_whisper_cpp(spec: ModelSpec) -> Path:
    """The resolved path of ``spec``'s whisper.cpp .bin once our strict parser accepts it (no runtime may see a file
    it rejects: pywhispercpp crashes on one); a UserError naming the model and file otherwise."""
    from tarq_deploy.formats.ggml_file import GGMLFileError, read_whisper_cpp

    path = Path(spec.source).expanduser()
    try:
        read_whisper_cpp(path)
    except GGMLFileError as error:
        raise UserError(f"model {spec.label!r}: {error}") from None
    return path.resolve()
