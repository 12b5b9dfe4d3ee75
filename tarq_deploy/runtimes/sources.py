"""What kind of model a source is, told from the file's first bytes or the directory's markers; the adapters' ``claims``
build on these, and ``checked_gguf`` gates every GGUF runtime (a runtime must never see a file our parser rejects)."""
from __future__ import annotations

from pathlib import Path

from ..errors import UserError
from .base import ModelSpec

GGML_MAGIC = b"lmgg"  # 0x67676d6c little-endian: the legacy whisper.cpp file
GGUF_MAGIC = b"GGUF"
CHECKPOINT_MARKERS = ("manifest.json", "lattice.safetensors")


def file_magic(source: str) -> bytes:
    path = Path(source).expanduser()
    if not path.is_file():
        return b""
    with open(path, "rb") as f:
        return f.read(4)


def is_whisper_cpp_file(source: str) -> bool:
    return file_magic(source) == GGML_MAGIC


def is_gguf_file(source: str) -> bool:
    return file_magic(source) == GGUF_MAGIC


def is_gguf_of_arch(source: str, arch: str) -> bool:
    """A GGUF file whose general.architecture is ``arch`` (a file our reader rejects is not claimed)."""
    if not is_gguf_file(source):
        return False
    from tarq_deploy.formats.gguf_file import GGUFFileError, read_gguf

    try:
        return read_gguf(Path(source).expanduser()).arch == arch
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


def is_lattice_checkpoint(source: str) -> bool:
    path = Path(source).expanduser()
    return path.is_dir() and all((path / marker).is_file() for marker in CHECKPOINT_MARKERS)
