"""What the ggml-family files (whisper.cpp's .bin, GGUF) share: tensor slots and records, tensors ready to write, a
strict byte cursor over a memory-mapped file, and the exact comparison of decoded tensors with a lattice checkpoint.

Shapes are numpy order (row-major, last axis = ggml ne[0]); the file formats reverse them at their boundary.
"""
from __future__ import annotations

import mmap
import os
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from tarq_deploy.checkpoint import LatticeCheckpoint, LatticeWeights, load_checkpoint
from tarq_deploy.errors import UserError
from tarq_deploy.quant.lattice import QuantizedWeight

from .f16_rounding import F16Values
from .f16_values import blocks_to_f16, float_to_f16
from .ggml_blocks import GGML_TYPE_NAMES, GGMLType, LatticeNotRepresentable, pack_lattice
from .model_files import ModelTensors

__all__ = ["ByteCursor", "CheckpointValues", "MappedTensors", "PackedTensor", "ROLE_CONV", "ROLE_F32", "ROLE_MATRIX",
           "TensorFileError", "TensorRecord", "TensorSlot", "VerifyError", "as_checkpoint", "compare_tensors",
           "map_file", "max_abs_diff", "pack_float", "stored_blocks_as_f16", "stored_or_packed"]

# tensor roles: which ggml type a runtime stores the tensor in (TensorSlot.ggml_type)
ROLE_MATRIX = "matrix"  # the file's weight type (lattice blocks, or F16 / F32 in a float file)
ROLE_CONV = "conv"  # convolution kernels: F16 (F32 in an all-F32 file), what ggml convolutions take
ROLE_F32 = "f32"  # always F32: norms, biases, positional embeddings, front-end tables


class TensorFileError(UserError, ValueError):
    """A model file that is not what its runtime would load; the message names the file and the problem. A UserError:
    wherever a reader's error surfaces (the .bin and GGUF readers share it), the CLI prints it and exits 2."""

    def __init__(self, path: str | os.PathLike, problem: str) -> None:
        super().__init__(f"{path}: {problem}")
        self.path = str(path)
        self.problem = problem


class VerifyError(ValueError):
    """The model file does not belong to the checkpoint it is verified against (header, metadata, vocabulary or
    layout differ)."""


# ------------------------------------------------------------------------------------------------------ tensors
@dataclass(frozen=True)
class TensorSlot:
    """One tensor of a runtime file: its name there, the transformers state-dict name its values come from, its role
    and its shape."""

    name: str
    hf_name: str
    role: str
    shape: tuple[int, ...]

    def ggml_type(self, weight_type: int) -> int:
        """The type this tensor is stored in, in a file whose weight matrices are ``weight_type``."""
        if self.role == ROLE_MATRIX:
            return weight_type
        if self.role == ROLE_CONV:
            return GGMLType.F32 if weight_type == GGMLType.F32 else GGMLType.F16
        return GGMLType.F32


@dataclass(frozen=True)
class TensorRecord:
    """Where one tensor's data lies in a file."""

    name: str
    ggml_type: int
    shape: tuple[int, ...]
    offset: int  # absolute, in the file
    nbytes: int


@dataclass
class PackedTensor:
    """One tensor ready to write: ``data`` holds exactly its bytes (float32 / float16 values or uint8 blocks), or
    is the recipe of an F16 tensor's values, made when the file is written (f16_rounding.MadeAhead)."""

    name: str
    ggml_type: int
    shape: tuple[int, ...]
    data: np.ndarray | F16Values

    @property
    def nbytes(self) -> int:
        return self.data.nbytes


def n_rows(shape: tuple[int, ...]) -> int:
    return int(np.prod(shape[:-1], dtype=np.int64)) if len(shape) > 1 else 1


class MappedTensors:
    """Tensor access of a parsed file (a dataclass that holds the attributes annotated here; this class is not a
    dataclass, so they add no fields): raw bytes and values decoded by gguf-py, the reference decoder."""

    path: Path
    tensors: dict[str, TensorRecord]
    data: np.ndarray  # uint8 view of the whole file (read-only memory map)

    def raw(self, name: str) -> np.ndarray:
        """The tensor's bytes: uint8 [rows, row_bytes] (row = last axis)."""
        rec = self.tensors[name]
        return self.data[rec.offset:rec.offset + rec.nbytes].reshape(n_rows(rec.shape), -1)

    def dequantize(self, name: str) -> np.ndarray:
        """float32 values in the tensor's shape."""
        from gguf.quants import dequantize

        rec = self.tensors[name]
        values = dequantize(self.raw(name), GGMLType(rec.ggml_type))
        return values.astype(np.float32, copy=False).reshape(rec.shape)


# ------------------------------------------------------------------------------------------------------ reading
FileErrorType = Callable[[Path, str], TensorFileError]


def map_file(path: Path, error: FileErrorType) -> mmap.mmap:
    """A read-only memory map of the whole of ``path``; a missing or empty file raises ``error``."""
    if not path.is_file():
        raise error(path, "no such file")
    with open(path, "rb") as f:
        if os.fstat(f.fileno()).st_size == 0:
            raise error(path, "empty file")
        return mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)


class ByteCursor:
    """Sequential little-endian reads with truncation errors that say what was being read."""

    def __init__(self, buffer: mmap.mmap, path: Path, error: FileErrorType) -> None:
        self.buffer, self.path, self.error, self.pos = buffer, path, error, 0

    @property
    def remaining(self) -> int:
        return len(self.buffer) - self.pos

    def skip(self, n: int, what: str) -> int:
        """Advance past ``n`` bytes; returns where they start."""
        if n < 0 or n > self.remaining:
            raise self.error(self.path, f"truncated: {what} needs {n} bytes at offset {self.pos}, "
                                        f"only {self.remaining} left (file has {len(self.buffer)} bytes)")
        start = self.pos
        self.pos += n
        return start

    def take(self, n: int, what: str) -> bytes:
        start = self.skip(n, what)
        return self.buffer[start:start + n]

    def unpack(self, fmt: str, what: str) -> tuple:
        """The values of struct format ``fmt`` (with its byte order, e.g. "<3i") at the cursor."""
        return struct.unpack_from(fmt, self.buffer, self.skip(struct.calcsize(fmt), what))

    def array(self, dtype: np.dtype, count: int, what: str) -> np.ndarray:
        """``count`` values of ``dtype`` at the cursor, as a view of the file."""
        start = self.skip(dtype.itemsize * count, what)
        return np.frombuffer(self.buffer, dtype=dtype, count=count, offset=start)


# ------------------------------------------------------------------------------------------------- comparison
def as_checkpoint(checkpoint: str | os.PathLike | LatticeCheckpoint) -> tuple[LatticeCheckpoint, str]:
    """(checkpoint, its name for messages) from a checkpoint directory or an in-memory LatticeCheckpoint."""
    if isinstance(checkpoint, LatticeCheckpoint):
        return checkpoint, "the checkpoint"
    return load_checkpoint(checkpoint, sha256=True), str(checkpoint)  # verify is the thorough check: both digests


@dataclass(frozen=True)
class CheckpointValues:
    """The checkpoint's exact float32 values, one tensor at a time: s * q for lattice weights, aliases resolved."""

    ckpt: LatticeCheckpoint

    def resolve(self, name: str) -> str:
        return self.ckpt.aliases.get(name, name)

    def __call__(self, name: str) -> torch.Tensor:
        key = self.resolve(name)
        if key in self.ckpt.quantized:
            return lattice_values(self.ckpt.quantized[key])
        if key in self.ckpt.tensors:
            return self.ckpt.tensors[key].float()
        raise KeyError(name)


def lattice_values(q: QuantizedWeight) -> torch.Tensor:
    """s * q + o in float32, group by group (QuantizedWeight.dequantize: the dequantizers' arithmetic)."""
    return q.dequantize()


def compare_tensors(model: MappedTensors, slots: list[TensorSlot], exact: CheckpointValues, checkpoint: str,
                    error: type[VerifyError] = VerifyError) -> dict[str, float]:
    """max |diff| between every slot's decoded values and the checkpoint's exact values, in slot order; a missing
    or misshapen tensor raises ``error``."""
    missing = [s.name for s in slots if s.name not in model.tensors]
    if missing:
        raise error(f"{model.path}: tensors missing: {', '.join(missing[:5])}")
    diffs: dict[str, float] = {}
    decoded: dict[str, str] = {}  # checkpoint tensor -> the slot already compared with it (tied embedding / output)
    for slot in slots:
        record = model.tensors[slot.name]
        if record.shape != slot.shape:
            raise error(f"{model.path}: tensor {slot.name} has shape {list(record.shape)}, the checkpoint gives "
                        f"{list(slot.shape)}")
        twin = decoded.get(exact.resolve(slot.hf_name))
        if twin is not None and np.array_equal(model.raw(twin), model.raw(slot.name)):
            diffs[slot.name] = diffs[twin]  # the same bytes decode to the same values
            continue
        try:
            expected = exact(slot.hf_name)
        except KeyError:
            raise error(f"{checkpoint}: the checkpoint has no tensor {slot.hf_name} (for {slot.name})") from None
        diffs[slot.name] = max_abs_diff(model.dequantize(slot.name), expected)
        decoded[exact.resolve(slot.hf_name)] = slot.name
    return diffs


def max_abs_diff(actual: np.ndarray, expected: np.ndarray | torch.Tensor) -> float:
    """max |actual - expected| in float32, ``expected`` taken in ``actual``'s shape (both sides are exact float32
    values, so 0.0 means identical values); equal infinities and NaN against NaN count as equal, any other NaN as
    an infinite difference."""
    if isinstance(expected, torch.Tensor):
        decoded = torch.from_numpy(np.require(actual, dtype=np.float32, requirements="W"))  # mmap views are read-only
        if torch.equal(decoded, expected.float().reshape(decoded.shape)):
            return 0.0
        expected = expected.float().numpy()
    a = np.asarray(actual, dtype=np.float32)
    e = np.asarray(expected, dtype=np.float32).reshape(a.shape)
    same = (a == e) | (np.isnan(a) & np.isnan(e))
    if same.all():
        return 0.0
    diff = np.abs(a[~same] - e[~same])
    return float("inf") if np.isnan(diff).any() else float(diff.max())


# ----------------------------------------------------------------------------------------- packing, both files
def pack_float(name: str, values: torch.Tensor, ggml_type: int) -> np.ndarray | F16Values:
    """Float32 ``values`` stored as ``ggml_type``: F32 at once, F16 as the recipe of its fp16 values (made when the
    file is written, the values fp16 rounded counted for the warning)."""
    if ggml_type == GGMLType.F32:
        return values.to(torch.float32).contiguous().numpy()
    if ggml_type != GGMLType.F16:
        raise ValueError(f"{name}: {GGML_TYPE_NAMES.get(ggml_type, ggml_type)} is not a float type")
    return F16Values(name, tuple(values.shape), lambda out: float_to_f16(values, out))


def stored_blocks_as_f16(source: ModelTensors, slot: TensorSlot) -> F16Values | None:
    """An F16 ``slot`` whose lattice weight the checkpoint holds as ggml blocks: its values decoded straight from
    the blocks when the file is written (the same values as s * q rounded to fp16, without making codes, scales and
    s * q first); None when the weight is not held as stored blocks."""
    key = source.resolve(slot.hf_name)
    if not isinstance(source.lattice, LatticeWeights) or key not in source.lattice:
        return None
    stored = source.lattice.stored(key)
    if stored is None:
        return None
    source.check_lattice_shape(slot)
    return F16Values(slot.name, stored.shape, lambda out: blocks_to_f16(stored.blocks, stored.ggml_type, out))


def pack_exact(q: QuantizedWeight, ggml_type: int, hf_name: str, origin: str) -> np.ndarray:
    """A lattice weight as ``ggml_type`` blocks, exactly; LatticeNotRepresentable names the tensor otherwise."""
    try:
        return pack_lattice(q, ggml_type)
    except LatticeNotRepresentable as e:
        raise LatticeNotRepresentable(f"{origin}: {hf_name} cannot be stored exactly as {GGML_TYPE_NAMES[ggml_type]}: "
                                      f"{e}") from None


def stored_or_packed(lattice: Mapping[str, QuantizedWeight], name: str, ggml_type: int, hf_name: str,
                     origin: str) -> np.ndarray:
    """The blocks of lattice weight ``name`` as ``ggml_type``: the checkpoint's own bytes when it stores them as that
    type (LatticeWeights.blocks: a copy, nothing decoded), else packed from its codes."""
    stored = lattice.blocks(name, ggml_type) if isinstance(lattice, LatticeWeights) else None
    return stored if stored is not None else pack_exact(lattice[name], ggml_type, hf_name, origin)
