"""What a model source is, answered in one place.

Every command and runtime takes a model as text: ``packaged:NAME``, a Hugging Face Hub id, or the path of a
transformers folder, a CTranslate2 folder, a whisper.cpp ``.bin``, a GGUF file or a lattice checkpoint.
:func:`resolve_source` tells them apart by the same markers for every caller (a file's first bytes, a folder's marker
files, config.json's model_type, a GGUF's general.architecture) and records what it found in a :class:`ModelSource`.
Nothing else in the package tests those markers (tests/test_model_source.py reads the source to hold that); what a
caller does with a kind (load it, refuse it, claim it for a runtime) stays with the caller.

Stdlib only: the loaders, the runtimes' claims and the commands' argument checks ask it before anything heavy loads.
"""
from __future__ import annotations

import json
import mmap
import os
import struct
from dataclasses import dataclass
from enum import Enum
from pathlib import Path

from .errors import JSON_ERRORS

__all__ = ["CHECKPOINT_LATTICE", "CHECKPOINT_MANIFEST", "CHECKPOINT_MODEL_DIR", "CONFIG_JSON", "CT2_BINARY_VERSION",
           "CT2_MODEL_BIN", "ModelSource", "PACKAGED_PREFIX", "SourceKind", "packaged_name", "resolve_source"]

PACKAGED_PREFIX = "packaged:"
# Prefixes that can only mean a filesystem path (a Hub id is "name" or "owner/name").
LOCAL_PATH_PREFIXES = ("/", "./", "../", "~", ".\\", "..\\")
GGML_MAGIC = b"lmgg"  # 0x67676d6c little-endian: the legacy whisper.cpp file
GGUF_MAGIC = b"GGUF"
CONFIG_JSON = "config.json"
CHECKPOINT_MANIFEST = "manifest.json"
CHECKPOINT_LATTICE = "lattice.safetensors"
CHECKPOINT_MARKERS = (CHECKPOINT_MANIFEST, CHECKPOINT_LATTICE)
CHECKPOINT_MODEL_DIR = "model"  # a checkpoint's saved model files (config.json, tokenizer, ...)
CT2_MODEL_BIN = "model.bin"
CT2_BINARY_VERSION = 6  # the newest CTranslate2 model.bin layout we read
TRANSFORMERS_WEIGHT_PATTERNS = ("model.safetensors", "model.safetensors.index.json", "model-*.safetensors",
                                "pytorch_model.bin", "pytorch_model.bin.index.json")
GGUF_ARCHITECTURE_KEY = "general.architecture"


class SourceKind(str, Enum):
    PACKAGED = "packaged"  # packaged:NAME: real weights shipped in pip packages (models/packaged.py)
    HUB = "hub"  # not on this disk and not path-shaped: a name from_pretrained looks up on the Hub
    TRANSFORMERS = "transformers"  # a folder with config.json
    CT2 = "ct2"  # a folder whose model.bin starts with a CTranslate2 header
    WHISPER_CPP = "whisper_cpp"  # a file that starts with ggml's magic
    GGUF = "gguf"  # a file that starts with "GGUF"
    CHECKPOINT = "checkpoint"  # a folder with manifest.json and lattice.safetensors
    MISSING = "missing"  # path-shaped text (/, ./, ../, ~) that names nothing
    OTHER = "other"  # a file or folder on this disk that is none of the above


@dataclass(frozen=True)
class ModelSource:
    """One model source, told apart once: its kind, the text as given (messages and records name it so), the local
    path, and what the deciding look found."""

    kind: SourceKind
    text: str
    path: Path | None = None  # on disk and MISSING: the path, ~ expanded, not made absolute (messages show it as given)
    model_type: str | None = None  # transformers / ct2: config.json's model_type; checkpoint: its saved config's
    architecture: str | None = None  # gguf: general.architecture (None where the header does not say)
    has_weights: bool = False  # transformers: weight files beside config.json
    config_error: str | None = None  # a config.json that is no JSON object: the message for commands that need it
    quantized: bool = False  # transformers: config.json carries a quantization_config (a GPU export, GPTQ & co.)

    @property
    def packaged_name(self) -> str:
        """NAME of ``packaged:NAME``."""
        return packaged_name(self.text)

    @property
    def on_disk(self) -> bool:
        return self.kind not in (SourceKind.PACKAGED, SourceKind.HUB, SourceKind.MISSING)

    @property
    def assumed_model_type(self) -> str:
        """The model type a backbone is picked by: what the source's config says (Whisper where a model folder's
        config.json names none: CTranslate2's never does), else what the name suggests (a hub id naming Voxtral is
        Voxtral; everything else Whisper, as every packaged model is)."""
        if self.model_type is not None:
            return self.model_type
        if self.kind in (SourceKind.TRANSFORMERS, SourceKind.CT2):
            return "whisper"
        return "voxtral" if "voxtral" in self.text.lower() else "whisper"


def packaged_name(text: str) -> str:
    """NAME of ``packaged:NAME``; a bare NAME as it is (the packaged models' own lookup takes either)."""
    return text.removeprefix(PACKAGED_PREFIX)


def resolve_source(source: str | os.PathLike | ModelSource) -> ModelSource:
    """What ``source`` is. Never raises: a path that names nothing is MISSING, an unreadable or unknown one OTHER,
    and each caller says in its own words why it cannot take that kind. A ModelSource is returned as it is, so a
    command can resolve once and hand the result down."""
    if isinstance(source, ModelSource):
        return source
    return _resolved_text(os.fspath(source))


def _resolved_text(text: str) -> ModelSource:
    """The one look at a source given as text (tests count these calls: a command resolves its source once)."""
    if text.startswith(PACKAGED_PREFIX):
        return ModelSource(SourceKind.PACKAGED, text)
    path = _expanded(text)
    if _exists(path):
        return _local_source(text, path)
    if text.startswith(LOCAL_PATH_PREFIXES):
        return ModelSource(SourceKind.MISSING, text, path)
    return ModelSource(SourceKind.HUB, text)


def _expanded(text: str) -> Path:
    try:
        return Path(text).expanduser()
    except RuntimeError:  # ~user of an unknown user: the path as written (it names nothing)
        return Path(text)


def _exists(path: Path) -> bool:
    try:
        return path.exists()
    except (OSError, ValueError):  # a name the OS cannot look up (too long, a NUL byte) names nothing here
        return False


def _local_source(text: str, path: Path) -> ModelSource:
    if path.is_file():
        return _file_source(text, path)
    if not path.is_dir():
        return ModelSource(SourceKind.OTHER, text, path)
    if all((path / marker).is_file() for marker in CHECKPOINT_MARKERS):
        saved_type, _, _ = _config_model_type(path / CHECKPOINT_MODEL_DIR / CONFIG_JSON)
        return ModelSource(SourceKind.CHECKPOINT, text, path, model_type=saved_type)
    config = path / CONFIG_JSON
    model_type, config_error, quantized = _config_model_type(config)
    if _is_ct2_model_bin(path / CT2_MODEL_BIN):  # before config.json: a CTranslate2 folder has one too
        return ModelSource(SourceKind.CT2, text, path, model_type, config_error=config_error)
    if config.is_file():
        has_weights = any(any(path.glob(pattern)) for pattern in TRANSFORMERS_WEIGHT_PATTERNS)
        return ModelSource(SourceKind.TRANSFORMERS, text, path, model_type, has_weights=has_weights,
                           config_error=config_error, quantized=quantized)
    return ModelSource(SourceKind.OTHER, text, path)


def _file_source(text: str, path: Path) -> ModelSource:
    magic = _head(path, 4)
    if magic == GGML_MAGIC:
        return ModelSource(SourceKind.WHISPER_CPP, text, path)
    if magic == GGUF_MAGIC:
        return ModelSource(SourceKind.GGUF, text, path, architecture=_gguf_architecture(path))
    return ModelSource(SourceKind.OTHER, text, path)


def _head(path: Path, size: int) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read(size)
    except OSError:  # unreadable: no kind; the reader the caller picks names the problem
        return b""


def _config_model_type(config: Path) -> tuple[str | None, str | None, bool]:
    """(model_type, problem, has a quantization_config) of a config.json: (None, None, False) when there is none."""
    if not config.is_file():
        return None, None, False
    try:
        value = json.loads(config.read_text(encoding="utf-8"))
    except OSError as error:
        return None, f"{config}: unreadable ({error.strerror or error})", False
    except JSON_ERRORS:
        return None, f"{config}: not valid JSON", False
    if not isinstance(value, dict):
        return None, f"{config}: not a JSON object", False
    found = value.get("model_type")
    return (None if found is None else str(found)), None, isinstance(value.get("quantization_config"), dict)


def _is_ct2_model_bin(model_bin: Path) -> bool:
    """A CTranslate2 model.bin header: a binary version we know, then a spec name of more than one byte."""
    if not model_bin.is_file():
        return False
    header = _head(model_bin, 6)
    if len(header) < 6:
        return False
    version, name_length = struct.unpack("<IH", header)
    return 1 <= version <= CT2_BINARY_VERSION and name_length > 1


# ----------------------------------------------------------------------------------- GGUF general.architecture
# Only as far as the key: value sizes by gguf-py's GGUFValueType ids (8 string, 9 array). The strict reader
# (formats/gguf_file.py) stays the gate before any runtime sees a file; this only says which runtime to ask.
_GGUF_SCALAR_BYTES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_GGUF_STRING, _GGUF_ARRAY = 8, 9


def _gguf_architecture(path: Path) -> str | None:
    """general.architecture of a GGUF file; None where its header does not say (broken, or no such key)."""
    try:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buffer:
            return _find_architecture(buffer)
    except (OSError, ValueError, KeyError, OverflowError, struct.error):  # any damage: it does not say
        return None


def _find_architecture(buffer: mmap.mmap) -> str | None:
    version, _, kv_count = struct.unpack_from("<IQQ", buffer, 4)
    if version < 2:  # v1 counted in 32 bits; nothing writes it any more
        return None
    at = 24
    for _ in range(kv_count):  # every entry takes bytes: a count past the file ends in struct.error
        key_end = _string_end(buffer, at)
        (value_type,) = struct.unpack_from("<I", buffer, key_end)
        if bytes(buffer[at + 8:key_end]) == GGUF_ARCHITECTURE_KEY.encode():
            if value_type != _GGUF_STRING:
                return None
            return bytes(buffer[key_end + 12:_string_end(buffer, key_end + 4)]).decode()
        at = _value_end(buffer, key_end + 4, value_type)
    return None


def _string_end(buffer: mmap.mmap, at: int) -> int:
    (length,) = struct.unpack_from("<Q", buffer, at)
    end = at + 8 + length
    if end > len(buffer):
        raise ValueError("string past the end of the file")
    return end


def _value_end(buffer: mmap.mmap, at: int, value_type: int) -> int:
    if value_type == _GGUF_STRING:
        return _string_end(buffer, at)
    if value_type != _GGUF_ARRAY:
        return at + _GGUF_SCALAR_BYTES[value_type]
    element_type, count = struct.unpack_from("<IQ", buffer, at)
    at += 12
    if element_type != _GGUF_STRING:
        return at + count * _GGUF_SCALAR_BYTES[element_type]  # nested arrays: KeyError, the header does not say
    for _ in range(count):  # each string takes 8 bytes at least: a false count ends in struct.error
        at = _string_end(buffer, at)
    return at
