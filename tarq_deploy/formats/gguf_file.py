"""The GGUF container, whatever model it holds: metadata and tensors to write, an atomic writer, a strict fast reader
and the metadata check of ``verify``.

A GGUF file (v3, little-endian): "GGUF", uint32 version, uint64 tensor count, uint64 key/value count; key/values
(string key, uint32 value type, value; arrays: uint32 element type, uint64 count, elements; strings: uint64 length,
bytes); tensor infos (name, uint32 n_dims, uint64 ne[n_dims] with ne[0] the row length, uint32 ggml type, uint64
offset into the data section); padding to ``general.alignment`` (default 32); the data section. Writing goes through
gguf-py's GGUFWriter; reading uses our parser (gguf-py's GGUFReader needs ~10 s for a 151936-token vocabulary) and
gguf-py's reference decoders (gguf.quants.dequantize) for the tensor values.
"""
from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

import numpy as np
from gguf.constants import GGUF_DEFAULT_ALIGNMENT, GGUF_MAGIC, GGUF_VERSION, GGUFValueType, LlamaFileType

from tarq_deploy.fileio import atomic_path

from .ggml_blocks import BLOCKS, GGML_TYPE_NAMES, QUANTIZED_TYPES, GGMLType, tensor_nbytes
from .ggml_tensors import (ByteCursor, MappedTensors, PackedTensor, TensorFileError, TensorRecord, VerifyError,
                           map_file)
from .model_files import ModelFilesError

__all__ = ["FILE_TYPES", "GGUFExportError", "GGUFFile", "GGUFFileError", "GGUFModel", "GGUFVerifyError", "KV",
           "check_metadata", "file_kv", "file_type_name", "file_types", "most_weights_type", "read_gguf", "write_gguf"]

MAGIC_BYTES = struct.pack("<I", GGUF_MAGIC)  # b"GGUF"
# general.file_type (llama_ftype) of a file whose weight matrices are of the given type
# (a file of one K-quant type throughout is llama.cpp's "_S" mix, the one without bigger types for some tensors)
FILE_TYPES = {GGMLType.F32: LlamaFileType.ALL_F32, GGMLType.F16: LlamaFileType.MOSTLY_F16,
              GGMLType.Q4_0: LlamaFileType.MOSTLY_Q4_0, GGMLType.Q8_0: LlamaFileType.MOSTLY_Q8_0,
              GGMLType.Q4_1: LlamaFileType.MOSTLY_Q4_1, GGMLType.Q5_0: LlamaFileType.MOSTLY_Q5_0,
              GGMLType.Q5_1: LlamaFileType.MOSTLY_Q5_1, GGMLType.Q4_K: LlamaFileType.MOSTLY_Q4_K_S,
              GGMLType.Q5_K: LlamaFileType.MOSTLY_Q5_K_S, GGMLType.Q6_K: LlamaFileType.MOSTLY_Q6_K,
              GGMLType.Q3_K: LlamaFileType.MOSTLY_Q3_K_S, GGMLType.Q2_K: LlamaFileType.MOSTLY_Q2_K,
              GGMLType.IQ4_NL: LlamaFileType.MOSTLY_IQ4_NL, GGMLType.IQ4_XS: LlamaFileType.MOSTLY_IQ4_XS,
              GGMLType.IQ3_S: LlamaFileType.MOSTLY_IQ3_S, GGMLType.IQ3_XXS: LlamaFileType.MOSTLY_IQ3_XXS,
              GGMLType.IQ2_S: LlamaFileType.MOSTLY_IQ2_S, GGMLType.IQ2_XS: LlamaFileType.MOSTLY_IQ2_XS}
FILE_TYPE_NAMES = {int(file_type): GGML_TYPE_NAMES[t] for t, file_type in FILE_TYPES.items()}
QUANTIZATION_VERSION = 2
_SCALAR_FORMATS = {GGUFValueType.UINT8: "<B", GGUFValueType.INT8: "<b", GGUFValueType.UINT16: "<H",
                   GGUFValueType.INT16: "<h", GGUFValueType.UINT32: "<I", GGUFValueType.INT32: "<i",
                   GGUFValueType.FLOAT32: "<f", GGUFValueType.BOOL: "<?", GGUFValueType.UINT64: "<Q",
                   GGUFValueType.INT64: "<q", GGUFValueType.FLOAT64: "<d"}
MAX_DIMS = 4
MAX_STRING_BYTES = 1 << 24
# the fewest bytes one entry can take: a count that needs more than the file holds is refused before any loop
MIN_KV_BYTES = 8 + 4 + 1  # key length, value type, a one-byte value
MIN_TENSOR_INFO_BYTES = 8 + 4 + 8 + 4 + 8  # name length, dimension count, one dimension, type, offset
MIN_STRING_BYTES = 8  # its length


class GGUFExportError(ModelFilesError):
    """The source cannot be exported as asked; the message says what and why."""


class GGUFFileError(TensorFileError):
    """A file that is not the GGUF it should be; the message names the file and the problem."""


class GGUFVerifyError(VerifyError):
    """The GGUF file does not belong to the checkpoint it is verified against (metadata, vocabulary or layout)."""


def file_type_name(file_type: int) -> str:
    """``general.file_type`` by name: the type of a one-type file ("Q4_K"), llama.cpp's name of a preset mix
    ("Q4_K_M": transcribe.cpp's presets write it), else the number ("file_type 99")."""
    if file_type in FILE_TYPE_NAMES:
        return FILE_TYPE_NAMES[file_type]
    try:
        return LlamaFileType(file_type).name.removeprefix("MOSTLY_")
    except ValueError:
        return f"file_type {file_type}"


def file_types(model: Any) -> tuple[str, dict[str, int]]:
    """A read GGUF's ``general.file_type`` by name (file_type_name) and how many of its tensors hold each ggml
    type ({"Q4_K": 120, "F32": 88, ...}): what a describe function reports about a file's types."""
    counts: dict[str, int] = {}
    for record in model.tensors.values():
        name = GGML_TYPE_NAMES[record.ggml_type]
        counts[name] = counts.get(name, 0) + 1
    return file_type_name(model.integer("general.file_type", default=-1)), counts


# ------------------------------------------------------------------------------------------------------ writing
@dataclass(frozen=True)
class KV:
    key: str
    value: Any
    value_type: int  # a GGUFValueType (for arrays: the element type)
    is_array: bool = False


@dataclass
class GGUFModel:
    """Everything a GGUF file holds, computed and validated, nothing written yet."""

    arch: str
    kv: list[KV]
    tensors: list[PackedTensor]


def file_kv(name: str, weight_type: int) -> list[KV]:
    """The general.* keys of a model file whose weight matrices are ``weight_type``."""
    return [KV("general.name", name, GGUFValueType.STRING), KV("general.type", "model", GGUFValueType.STRING),
            KV("general.file_type", int(FILE_TYPES[weight_type]), GGUFValueType.UINT32),
            KV("general.quantization_version", QUANTIZATION_VERSION, GGUFValueType.UINT32)]


def most_weights_type(weights: dict[int, int]) -> int:
    """The ggml type holding the most weight values (``weights``: type -> values), the lower type id on a tie: the
    type a mix's general.file_type names."""
    return max(weights, key=lambda t: (weights[t], -int(t)))


def write_gguf(model: GGUFModel, out_path: str | os.PathLike) -> Path:
    """Write ``model`` through a temporary file in the same directory, renamed when complete; nothing is left
    behind on error."""
    import gguf

    out = Path(out_path)
    with atomic_path(out) as tmp:
        writer = gguf.GGUFWriter(tmp, arch=model.arch)
        try:
            for kv in model.kv:
                _add_kv(writer, kv)
            for t in model.tensors:
                writer.add_tensor(t.name, np.ascontiguousarray(t.data), raw_dtype=GGMLType(t.ggml_type),
                                  raw_shape=None if t.ggml_type in QUANTIZED_TYPES else t.shape)
            writer.write_header_to_file()
            writer.write_kv_data_to_file()
            writer.write_tensors_to_file()
        finally:
            writer.close()
    return out


def _add_kv(writer: Any, kv: KV) -> None:
    value_type = GGUFValueType(kv.value_type)
    if kv.is_array:
        writer.add_key_value(kv.key, list(kv.value), GGUFValueType.ARRAY, sub_type=value_type)
    else:
        writer.add_key_value(kv.key, kv.value, value_type)


# ------------------------------------------------------------------------------------------------------ reading
@dataclass
class GGUFFile(MappedTensors):
    """A parsed GGUF file; tensor data stays in a read-only memory map."""

    path: Path
    kv: dict[str, Any]
    tensors: dict[str, TensorRecord]
    data: np.ndarray  # uint8 view of the whole file

    @property
    def arch(self) -> str:
        return str(self.kv.get("general.architecture", ""))

    def require(self, key: str) -> Any:
        if key not in self.kv:
            raise GGUFFileError(self.path, f"metadata key {key} missing")
        return self.kv[key]

    def integer(self, key: str, default: int | None = None) -> int:
        """The integer value of ``key`` (``default`` when absent and given); GGUFFileError when it is no integer."""
        value = self.kv.get(key, default) if default is not None else self.require(key)
        if not isinstance(value, int) or isinstance(value, bool):
            raise GGUFFileError(self.path, f"metadata key {key} is {value!r}, not an integer")
        return value


def read_gguf(path: str | os.PathLike) -> GGUFFile:
    """Parse ``path`` strictly (any truncation, unknown type or misplaced tensor raises GGUFFileError)."""
    path = Path(path)
    buffer = map_file(path, GGUFFileError)
    cur = GGUFCursor(buffer, path, GGUFFileError)
    if cur.take(4, "the magic") != MAGIC_BYTES:
        raise GGUFFileError(path, "bad magic: not a GGUF file")
    version = cur.scalar(GGUFValueType.UINT32, "the version")
    if version != GGUF_VERSION:
        raise GGUFFileError(path, f"GGUF version {version}; this reader knows version {GGUF_VERSION}")
    n_tensors = cur.scalar(GGUFValueType.UINT64, "the tensor count")
    n_kv = cur.scalar(GGUFValueType.UINT64, "the key count")
    cur.check_count(n_kv, MIN_KV_BYTES, "the key count")
    kv = dict(_read_kv(cur) for _ in range(n_kv))
    cur.check_count(n_tensors, MIN_TENSOR_INFO_BYTES, "the tensor count")
    infos = [_read_tensor_info(cur) for _ in range(n_tensors)]
    alignment = _alignment(path, kv)
    data_start = -(-cur.pos // alignment) * alignment
    tensors = _place_tensors(path, infos, data_start, alignment, len(buffer))
    return GGUFFile(path, kv, tensors, np.frombuffer(buffer, dtype=np.uint8))


def _alignment(path: Path, kv: dict[str, Any]) -> int:
    """general.alignment: a power of two, as ggml's reader demands (0 would divide by zero placing the data)."""
    alignment = kv.get("general.alignment", GGUF_DEFAULT_ALIGNMENT)
    if not isinstance(alignment, int) or isinstance(alignment, bool) or alignment < 1 or alignment & (alignment - 1):
        raise GGUFFileError(path, f"general.alignment {alignment!r} is not a power of two")
    return alignment


class GGUFCursor(ByteCursor):
    """ByteCursor plus GGUF's typed values: scalars, strings and arrays."""

    def check_count(self, count: int, min_bytes: int, what: str) -> None:
        """A count of entries of at least ``min_bytes`` each must fit in what is left of the file."""
        if count > self.remaining // min_bytes:
            raise GGUFFileError(self.path, f"{what} {count} claims more entries than the {self.remaining} bytes left "
                                           f"can hold (truncated or corrupt)")

    def scalar(self, value_type: int, what: str) -> Any:
        return self.unpack(_SCALAR_FORMATS[value_type], what)[0]

    def string(self, what: str) -> str:
        n = self.scalar(GGUFValueType.UINT64, f"the length of {what}")
        if n > MAX_STRING_BYTES:
            raise GGUFFileError(self.path, f"{what} claims {n} bytes")
        raw = self.take(n, what)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise GGUFFileError(self.path, f"{what} is not UTF-8") from None

    def value(self, value_type: int, what: str) -> Any:
        if value_type == GGUFValueType.STRING:
            return self.string(what)
        if value_type == GGUFValueType.ARRAY:
            element_type = self.scalar(GGUFValueType.UINT32, f"the element type of {what}")
            count = self.scalar(GGUFValueType.UINT64, f"the length of {what}")
            if element_type == GGUFValueType.ARRAY:  # ggml's reader refuses them too; and each level would recurse
                raise GGUFFileError(self.path, f"{what} is an array of arrays")
            return self.array_value(element_type, count, what)
        if value_type not in _SCALAR_FORMATS:
            raise GGUFFileError(self.path, f"{what} has unknown value type {value_type}")
        return self.scalar(value_type, what)

    def array_value(self, element_type: int, count: int, what: str) -> list:
        if element_type in _SCALAR_FORMATS and element_type != GGUFValueType.BOOL:
            return self.array(np.dtype(_SCALAR_FORMATS[element_type]), count, what).tolist()
        smallest = MIN_STRING_BYTES if element_type == GGUFValueType.STRING else 1
        self.check_count(count, smallest, f"the length of {what}")
        return [self.value(element_type, what) for _ in range(count)]


def _read_kv(cur: GGUFCursor) -> tuple[str, Any]:
    key = cur.string(f"a metadata key at offset {cur.pos}")
    value_type = cur.scalar(GGUFValueType.UINT32, f"the type of {key}")
    return key, cur.value(value_type, key)


def _read_tensor_info(cur: GGUFCursor) -> tuple[str, int, tuple[int, ...], int]:
    name = cur.string(f"a tensor name at offset {cur.pos}")
    n_dims = cur.scalar(GGUFValueType.UINT32, f"the dimension count of {name}")
    if not 1 <= n_dims <= MAX_DIMS:
        raise GGUFFileError(cur.path, f"tensor {name}: {n_dims} dimensions")
    ne = [cur.scalar(GGUFValueType.UINT64, f"the dimensions of {name}") for _ in range(n_dims)]
    ggml_type = cur.scalar(GGUFValueType.UINT32, f"the type of {name}")
    offset = cur.scalar(GGUFValueType.UINT64, f"the data offset of {name}")
    if ggml_type not in BLOCKS:
        raise GGUFFileError(cur.path, f"tensor {name}: ggml type {ggml_type} (this reader knows "
                                      f"{', '.join(GGML_TYPE_NAMES.values())})")
    return name, ggml_type, tuple(reversed(ne)), offset


def _place_tensors(path: Path, infos: list, data_start: int, alignment: int, size: int) -> dict[str, TensorRecord]:
    tensors: dict[str, TensorRecord] = {}
    for name, ggml_type, shape, offset in infos:
        if name in tensors:
            raise GGUFFileError(path, f"tensor {name} appears twice")
        try:
            nbytes = tensor_nbytes(ggml_type, shape)
        except ValueError as e:
            raise GGUFFileError(path, f"tensor {name}: {e}") from None
        start = data_start + offset
        if offset % alignment or start + nbytes > size:
            raise GGUFFileError(path, f"tensor {name}: data at offset {offset} (+{nbytes} bytes) is misaligned or "
                                      f"past the end of the file (truncated?)")
        tensors[name] = TensorRecord(name, ggml_type, shape, start, nbytes)
    return tensors


# ------------------------------------------------------------------------------------------------------- verify
def check_metadata(model: GGUFFile, expected: list[KV], keys: Iterable[str], checkpoint: str) -> None:
    """Every key of ``keys`` holds what the exporter writes for ``checkpoint`` (else GGUFVerifyError)."""
    wanted = {kv.key: kv.value for kv in expected}
    for key in keys:
        actual = model.require(key)
        want = wanted[key]
        same = actual == want if not isinstance(want, float) else _same_float32(actual, want)
        if not same:
            shown = (f"{len(actual)} entries" if isinstance(actual, list) else repr(actual),
                     f"{len(want)} entries" if isinstance(want, list) else repr(want))
            raise GGUFVerifyError(f"{model.path}: {key} is {shown[0]}, the checkpoint {checkpoint} gives {shown[1]}")


def _same_float32(actual: Any, want: float) -> bool:
    """A float key compared as the float32 GGUF stores; a value of another type (a string, a list) is simply not it."""
    return isinstance(actual, (int, float)) and not isinstance(actual, bool) and np.float32(actual) == np.float32(want)
