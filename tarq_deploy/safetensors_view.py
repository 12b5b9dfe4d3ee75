"""Zero-copy reading of a safetensors file: numpy arrays or torch tensors viewing one memory map.

The safetensors library copies every tensor it loads; an exporter that only moves a checkpoint's ggml blocks into a
model file would spend as long on that copy as on its whole output. The layout is small and fixed (an 8-byte
little-endian header length, a JSON header {name: {dtype, shape, data_offsets}, "__metadata__": {...}}, then the
data), so it is read here directly, every field checked. numpy views cover the dtypes numpy holds natively (what
lattice.safetensors and vocabulary.safetensors hold); torch views cover bfloat16 too (tensors.safetensors), and
need a writable map: a private one (map_private), whose pages a write copies, so the file never changes.
"""
from __future__ import annotations

import json
import math
import mmap
import os
from collections.abc import Callable

import numpy as np
import torch

from .errors import JSON_ERRORS

__all__ = ["SafetensorsViewError", "map_private", "map_readonly", "tensor_views", "torch_views", "write_safetensors"]

NUMPY_DTYPES = {"U8": np.uint8, "I8": np.int8, "I16": np.int16, "I32": np.int32, "I64": np.int64, "F16": np.float16,
                "F32": np.float32, "F64": np.float64, "BOOL": np.bool_}
LITTLE_ENDIAN = {name: np.dtype(t).newbyteorder("<") for name, t in NUMPY_DTYPES.items()}
TORCH_DTYPES = {"U8": torch.uint8, "I8": torch.int8, "I16": torch.int16, "I32": torch.int32, "I64": torch.int64,
                "F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32, "F64": torch.float64,
                "BOOL": torch.bool}
NUMPY_ITEM_BYTES = {name: t.itemsize for name, t in LITTLE_ENDIAN.items()}
TORCH_ITEM_BYTES = {name: t.itemsize for name, t in TORCH_DTYPES.items()}
HEADER_LENGTH_BYTES = 8
MAX_HEADER_BYTES = 100 * 1024 * 1024  # the library's own limit


class SafetensorsViewError(ValueError):
    """Not a safetensors file this reader can map; the message says what is wrong (the caller names the file)."""


def map_readonly(path: str | os.PathLike, populate: bool = False) -> mmap.mmap | bytes:
    """A read-only memory map of the whole file (an empty file, which cannot be mapped, as b""). ``populate`` maps
    every page at once (Linux MAP_POPULATE) for a caller that reads all of it: one call instead of a page fault per
    4 KiB."""
    return _map_whole(path, mmap.MAP_SHARED | (getattr(mmap, "MAP_POPULATE", 0) if populate else 0), mmap.PROT_READ)


def map_private(path: str | os.PathLike) -> mmap.mmap | bytes:
    """A writable private memory map of the whole file, for torch_views: a write to it copies the page it falls on,
    never reaching the file. Never populated: populating a writable private map copies every page ahead of time
    (the kernel breaks copy-on-write at once), while pages a reader only reads stay the file's own."""
    return _map_whole(path, mmap.MAP_PRIVATE, mmap.PROT_READ | mmap.PROT_WRITE)


def _map_whole(path: str | os.PathLike, flags: int, prot: int) -> mmap.mmap | bytes:
    with open(path, "rb") as f:
        if os.fstat(f.fileno()).st_size == 0:
            return b""
        return mmap.mmap(f.fileno(), 0, flags=flags, prot=prot)


def tensor_views(buffer: mmap.mmap | bytes) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """(name -> read-only array viewing ``buffer``, the header's __metadata__) of a safetensors file's bytes, every
    offset checked against the file and every size against dtype and shape."""
    entries, metadata, data_start = _entries(buffer)
    data_bytes = len(buffer) - data_start
    views = {name: _view(buffer, name, entry, data_start, data_bytes) for name, entry in entries}
    return views, metadata


def torch_views(buffer: mmap.mmap | bytes) -> dict[str, torch.Tensor] | None:
    """name -> tensor viewing ``buffer`` (a map_private map, or bytes: then the tensors are copies), checked as in
    tensor_views; None when a dtype has no view here (float8: the caller asks the safetensors library)."""
    entries, _, data_start = _entries(buffer)
    # a dtype name torch has no view of (float8): the caller asks the library; any other entry is checked below
    if any(isinstance(entry, dict) and isinstance(entry.get("dtype"), str) and entry["dtype"] not in TORCH_DTYPES
           for _, entry in entries):
        return None
    if not isinstance(buffer, mmap.mmap):
        buffer = bytearray(buffer)  # torch views only writable memory
    data_bytes = len(buffer) - data_start
    return {name: _tensor(buffer, name, entry, data_start, data_bytes) for name, entry in entries}


def _entries(buffer: mmap.mmap | bytes) -> tuple[list[tuple[str, object]], dict[str, str], int]:
    header, data_start = _header(buffer)
    metadata = header.pop("__metadata__", {}) or {}
    if not isinstance(metadata, dict):
        raise SafetensorsViewError("__metadata__ is not a JSON object")
    return list(header.items()), metadata, data_start


def _header(buffer: mmap.mmap | bytes) -> tuple[dict, int]:
    if len(buffer) < HEADER_LENGTH_BYTES:
        raise SafetensorsViewError(f"{len(buffer)} bytes, shorter than the {HEADER_LENGTH_BYTES}-byte header length")
    n = int.from_bytes(buffer[:HEADER_LENGTH_BYTES], "little")
    if n > min(MAX_HEADER_BYTES, len(buffer) - HEADER_LENGTH_BYTES):
        raise SafetensorsViewError(f"header length {n} exceeds the file ({len(buffer)} bytes)")
    try:
        header = json.loads(bytes(buffer[HEADER_LENGTH_BYTES:HEADER_LENGTH_BYTES + n]))
    except JSON_ERRORS as e:
        raise SafetensorsViewError(f"header is not valid JSON ({e})") from None
    if not isinstance(header, dict):
        raise SafetensorsViewError("header is not a JSON object")
    return header, HEADER_LENGTH_BYTES + n


def _view(buffer: mmap.mmap | bytes, name: str, entry: object, data_start: int, data_bytes: int) -> np.ndarray:
    shape, start = _checked_entry(name, entry, data_start, data_bytes, NUMPY_ITEM_BYTES)
    return np.ndarray(shape, dtype=LITTLE_ENDIAN[entry["dtype"]], buffer=buffer, offset=start)


def _tensor(buffer: mmap.mmap | bytearray, name: str, entry: object, data_start: int, data_bytes: int
            ) -> torch.Tensor:
    shape, start = _checked_entry(name, entry, data_start, data_bytes, TORCH_ITEM_BYTES)
    dtype = TORCH_DTYPES[entry["dtype"]]
    count = math.prod(shape)
    if count == 0:
        return torch.empty(shape, dtype=dtype)  # frombuffer refuses an empty range
    return torch.frombuffer(buffer, dtype=dtype, count=count, offset=start).reshape(shape)


def _checked_entry(name: str, entry: object, data_start: int, data_bytes: int, itemsizes: dict[str, int]
                   ) -> tuple[list[int], int]:
    """(shape, absolute start) of a header entry, every field checked against the file (little-endian data)."""
    if not isinstance(entry, dict) or not {"dtype", "shape", "data_offsets"} <= entry.keys():
        raise SafetensorsViewError(f"tensor {name!r}: entry lacks dtype, shape or data_offsets")
    dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
    if not isinstance(dtype, str) or dtype not in itemsizes:
        raise SafetensorsViewError(f"tensor {name!r}: dtype {dtype!r} has no view here")
    if not (isinstance(shape, list) and all(isinstance(d, int) and d >= 0 for d in shape)):
        raise SafetensorsViewError(f"tensor {name!r}: shape {shape!r} is not a list of sizes")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(o, int) for o in offsets)
            and 0 <= offsets[0] <= offsets[1] <= data_bytes):
        raise SafetensorsViewError(f"tensor {name!r}: data_offsets {offsets!r} fall outside the {data_bytes} data "
                                   f"bytes (truncated file?)")
    if offsets[1] - offsets[0] != math.prod(shape) * itemsizes[dtype]:
        raise SafetensorsViewError(f"tensor {name!r}: {offsets[1] - offsets[0]} bytes do not hold {shape} {dtype}")
    return shape, data_start + offsets[0]


# ------------------------------------------------------------------------------------------------------------ writing
# The order the safetensors library lays tensors out in (and lists them in its header): by its dtype enum, highest
# first, then by name. Kept so that a streamed file is the library's file, byte for byte.
WRITE_ORDER = ("U64", "I64", "F64", "F32", "U32", "I32", "BF16", "F16", "U16", "I16", "I8", "U8", "BOOL")
_TORCH_NAMES = {dtype: name for name, dtype in TORCH_DTYPES.items()}
_NUMPY_NAMES = {np.dtype(dtype): name for name, dtype in NUMPY_DTYPES.items()}
_WRITE_CHUNK_BYTES = 64 << 20


def write_safetensors(path: str | os.PathLike, tensors: dict[str, torch.Tensor | np.ndarray],
                      metadata: dict[str, str] | None = None,
                      written: Callable[[torch.Tensor | np.ndarray], None] | None = None) -> None:
    """Write ``tensors`` as the safetensors library's save_file does, one tensor at a time and 64 MB at a time: the
    library first makes a bytes copy of every tensor, which for a 3-billion-parameter model's checkpoint doubles
    the memory it takes. ``written(tensor)`` runs after each tensor is on disk (to let its pages go)."""
    dtypes = {name: _dtype_name(tensor) for name, tensor in tensors.items()}
    order = sorted(tensors, key=lambda name: (WRITE_ORDER.index(dtypes[name]), name))
    header: dict[str, object] = {"__metadata__": metadata} if metadata else {}
    offset = 0
    for name in order:
        size = _nbytes(tensors[name])
        header[name] = {"dtype": dtypes[name], "shape": list(tensors[name].shape),
                        "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    text += b" " * (-len(text) % 8)  # the library pads its header to a multiple of 8 bytes with spaces
    with open(path, "wb") as out:
        out.write(len(text).to_bytes(HEADER_LENGTH_BYTES, "little"))
        out.write(text)
        for name in order:
            _write_data(out, tensors[name])
            if written is not None:
                written(tensors[name])


def _dtype_name(tensor: torch.Tensor | np.ndarray) -> str:
    names = _TORCH_NAMES if isinstance(tensor, torch.Tensor) else _NUMPY_NAMES
    key = tensor.dtype if isinstance(tensor, torch.Tensor) else np.dtype(tensor.dtype)
    if key not in names:
        raise ValueError(f"dtype {tensor.dtype} has no safetensors name here")
    return names[key]


def _nbytes(tensor: torch.Tensor | np.ndarray) -> int:
    return tensor.numel() * tensor.element_size() if isinstance(tensor, torch.Tensor) else tensor.nbytes


def _write_data(out, tensor: torch.Tensor | np.ndarray) -> None:
    """The tensor's bytes, little-endian and row-major, in slices of the flattened tensor."""
    flat = (tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
            if isinstance(tensor, torch.Tensor) else
            np.ascontiguousarray(tensor, dtype=np.dtype(tensor.dtype).newbyteorder("<")).reshape(-1).view(np.uint8))
    for start in range(0, flat.size, _WRITE_CHUNK_BYTES):
        out.write(flat[start:start + _WRITE_CHUNK_BYTES].data)
