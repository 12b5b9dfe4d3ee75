"""llama.cpp's importance-matrix file (the GGUF that `llama-imatrix -o imatrix.gguf` writes and `llama-quantize
--imatrix` reads), so an importance matrix saved by `tarq-deploy quantize --save-imatrix` is reused here and by the
ggml tools, and one from those tools is read here.

The layout, as llama.cpp's tools/imatrix writes it:
- ``general.type`` = "imatrix"; ``imatrix.datasets`` (strings), ``imatrix.chunk_count`` and ``imatrix.chunk_size``
  (uint32);
- per weight matrix NAME: ``NAME.in_sum2``, F32 [n_in] (per expert: [n_mat, n_in]), the sum over the positions
  seen of each input column's squared activation, and ``NAME.counts``, F32 [1] ([n_mat, 1]), how many positions.
The importance of column j is in_sum2[j] / counts, divided in float32 as llama.cpp does (a count of 0 gives 1s), so
reading a file back gives the importance the run that wrote it used, bit for bit.

NAME is the lattice checkpoint's weight name (``model.encoder.layers.0.fc1.weight``): the name a tarq-deploy model
gives its Linears, not the runtime file's.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from gguf.constants import GGUFValueType

from .ggml_blocks import GGMLType
from .ggml_tensors import PackedTensor
from .gguf_file import KV, GGUFFileError, GGUFModel, read_gguf, write_gguf

__all__ = ["Imatrix", "ImatrixFileError", "read_imatrix", "write_imatrix"]

SUMS, COUNTS = ".in_sum2", ".counts"
DATASETS, CHUNK_COUNT, CHUNK_SIZE = "imatrix.datasets", "imatrix.chunk_count", "imatrix.chunk_size"
FILE_TYPE = "imatrix"


class ImatrixFileError(GGUFFileError):
    """An imatrix file that cannot be read as one; the message names the file and the problem."""


@dataclass
class Imatrix:
    """Per weight matrix: the summed squared input activations and the number of positions they sum over."""

    sums: dict[str, np.ndarray] = field(default_factory=dict)  # float32 [n_in]
    counts: dict[str, float] = field(default_factory=dict)
    datasets: list[str] = field(default_factory=list)
    chunk_count: int = 0  # llama.cpp: chunks of text; here: calibration windows
    chunk_size: int = 0  # llama.cpp: tokens per chunk; here: 0 (windows differ in length)

    def add(self, name: str, sums: np.ndarray, count: float) -> None:
        self.sums[name] = np.ascontiguousarray(sums, dtype=np.float32)
        self.counts[name] = float(np.float32(count))

    def importance(self, name: str) -> np.ndarray | None:
        """in_sum2 / counts in float32 (llama.cpp's arithmetic); None for a matrix the file does not cover."""
        if name not in self.sums:
            return None
        count = np.float32(self.counts[name])
        if count <= 0:
            return np.ones_like(self.sums[name])
        return self.sums[name] / count


def write_imatrix(imatrix: Imatrix, out_path: str | os.PathLike) -> Path:
    """The file llama.cpp writes, through a temporary name renamed when complete."""
    kv = [KV("general.type", FILE_TYPE, GGUFValueType.STRING),
          KV(DATASETS, list(imatrix.datasets), GGUFValueType.STRING, is_array=True),
          KV(CHUNK_COUNT, imatrix.chunk_count, GGUFValueType.UINT32),
          KV(CHUNK_SIZE, imatrix.chunk_size, GGUFValueType.UINT32)]
    tensors = []
    for name in sorted(imatrix.sums):
        sums = imatrix.sums[name]
        tensors.append(PackedTensor(name + SUMS, GGMLType.F32, tuple(sums.shape), sums))
        tensors.append(PackedTensor(name + COUNTS, GGMLType.F32, (1,),
                                    np.array([imatrix.counts[name]], dtype=np.float32)))
    return write_gguf(GGUFModel(FILE_TYPE, kv, tensors), out_path)


def read_imatrix(path: str | os.PathLike) -> Imatrix:
    """Parse an imatrix GGUF strictly: every NAME.in_sum2 has its NAME.counts, both F32, one matrix each (no
    experts), finite and not negative; ImatrixFileError naming the file and the tensor otherwise."""
    path = Path(path)
    try:
        file = read_gguf(path)
    except GGUFFileError as e:
        raise ImatrixFileError(path, str(e).removeprefix(f"{path}: ")) from None
    imatrix = Imatrix(datasets=_datasets(file, path), chunk_count=_uint(file, CHUNK_COUNT, path),
                      chunk_size=_uint(file, CHUNK_SIZE, path))
    names = sorted(n.removesuffix(SUMS) for n in file.tensors if n.endswith(SUMS))
    if not names:
        raise ImatrixFileError(path, f"holds no {SUMS} tensor: not an importance matrix")
    for name in names:
        sums, count = _values(file, name + SUMS, path), _values(file, name + COUNTS, path)
        if sums.ndim != 1 or count.shape != (1,):
            raise ImatrixFileError(path, f"{name}: shapes {sums.shape} and {count.shape}; expected [n_in] and [1] "
                                         f"(per-expert matrices are not read)")
        if not (np.isfinite(sums).all() and np.isfinite(count).all()) or (sums < 0).any() or count[0] < 0:
            raise ImatrixFileError(path, f"{name}: sums or count negative or not finite")
        imatrix.add(name, sums, float(count[0]))
    return imatrix


def _values(file, tensor: str, path: Path) -> np.ndarray:
    record = file.tensors.get(tensor)
    if record is None:
        raise ImatrixFileError(path, f"tensor {tensor} missing")
    if record.ggml_type != GGMLType.F32:
        raise ImatrixFileError(path, f"tensor {tensor} is not F32")
    return np.array(file.raw(tensor).view(np.float32)).reshape(record.shape)


def _datasets(file, path: Path) -> list[str]:
    value = file.kv.get(DATASETS, [])
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ImatrixFileError(path, f"metadata key {DATASETS} is not a list of strings")
    return value


def _uint(file, key: str, path: Path) -> int:
    value = file.kv.get(key, 0)
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ImatrixFileError(path, f"metadata key {key} is {value!r}, not a count")
    return value
