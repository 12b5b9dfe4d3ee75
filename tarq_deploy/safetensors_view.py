"""Zero-copy reading of a safetensors file: numpy views into one read-only memory map.

The safetensors library copies every tensor it loads; an exporter that only moves a checkpoint's ggml blocks into a
model file would spend as long on that copy as on its whole output. The layout is small and fixed (an 8-byte
little-endian header length, a JSON header {name: {dtype, shape, data_offsets}, "__metadata__": {...}}, then the
data), so it is read here directly, every field checked. Only dtypes numpy holds natively are mapped (what
lattice.safetensors and vocabulary.safetensors hold); tensors.safetensors, which may hold bfloat16, goes through the
safetensors library.
"""
from __future__ import annotations

import json
import math
import mmap
import os

import numpy as np

NUMPY_DTYPES = {"U8": np.uint8, "I8": np.int8, "I16": np.int16, "I32": np.int32, "I64": np.int64, "F16": np.float16,
                "F32": np.float32, "F64": np.float64, "BOOL": np.bool_}
LITTLE_ENDIAN = {name: np.dtype(t).newbyteorder("<") for name, t in NUMPY_DTYPES.items()}
HEADER_LENGTH_BYTES = 8
MAX_HEADER_BYTES = 100 * 1024 * 1024  # the library's own limit


class SafetensorsViewError(ValueError):
    """Not a safetensors file this reader can map; the message says what is wrong (the caller names the file)."""


def map_readonly(path: str | os.PathLike, populate: bool = False) -> mmap.mmap | bytes:
    """A read-only memory map of the whole file (an empty file, which cannot be mapped, as b""). ``populate`` maps
    every page at once (Linux MAP_POPULATE) for a caller that reads all of it: one call instead of a page fault per
    4 KiB."""
    with open(path, "rb") as f:
        if os.fstat(f.fileno()).st_size == 0:
            return b""
        flags = mmap.MAP_SHARED | (getattr(mmap, "MAP_POPULATE", 0) if populate else 0)
        return mmap.mmap(f.fileno(), 0, flags=flags, prot=mmap.PROT_READ)


def tensor_views(buffer: mmap.mmap | bytes) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """(name -> read-only array viewing ``buffer``, the header's __metadata__) of a safetensors file's bytes, every
    offset checked against the file and every size against dtype and shape."""
    header, data_start = _header(buffer)
    metadata = header.pop("__metadata__", {}) or {}
    if not isinstance(metadata, dict):
        raise SafetensorsViewError("__metadata__ is not a JSON object")
    data_bytes = len(buffer) - data_start
    return {name: _view(buffer, name, entry, data_start, data_bytes) for name, entry in header.items()}, metadata


def _header(buffer: mmap.mmap | bytes) -> tuple[dict, int]:
    if len(buffer) < HEADER_LENGTH_BYTES:
        raise SafetensorsViewError(f"{len(buffer)} bytes, shorter than the {HEADER_LENGTH_BYTES}-byte header length")
    n = int.from_bytes(buffer[:HEADER_LENGTH_BYTES], "little")
    if n > min(MAX_HEADER_BYTES, len(buffer) - HEADER_LENGTH_BYTES):
        raise SafetensorsViewError(f"header length {n} exceeds the file ({len(buffer)} bytes)")
    try:
        header = json.loads(bytes(buffer[HEADER_LENGTH_BYTES:HEADER_LENGTH_BYTES + n]))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise SafetensorsViewError(f"header is not valid JSON ({e})") from None
    if not isinstance(header, dict):
        raise SafetensorsViewError("header is not a JSON object")
    return header, HEADER_LENGTH_BYTES + n


def _view(buffer: mmap.mmap | bytes, name: str, entry: object, data_start: int, data_bytes: int) -> np.ndarray:
    if not isinstance(entry, dict) or not {"dtype", "shape", "data_offsets"} <= entry.keys():
        raise SafetensorsViewError(f"tensor {name!r}: entry lacks dtype, shape or data_offsets")
    dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
    if dtype not in LITTLE_ENDIAN:
        raise SafetensorsViewError(f"tensor {name!r}: dtype {dtype!r} has no numpy view")
    if not (isinstance(shape, list) and all(isinstance(d, int) and d >= 0 for d in shape)):
        raise SafetensorsViewError(f"tensor {name!r}: shape {shape!r} is not a list of sizes")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(o, int) for o in offsets)
            and 0 <= offsets[0] <= offsets[1] <= data_bytes):
        raise SafetensorsViewError(f"tensor {name!r}: data_offsets {offsets!r} fall outside the {data_bytes} data "
                                   f"bytes (truncated file?)")
    item = LITTLE_ENDIAN[dtype]
    if offsets[1] - offsets[0] != math.prod(shape) * item.itemsize:
        raise SafetensorsViewError(f"tensor {name!r}: {offsets[1] - offsets[0]} bytes do not hold {shape} {dtype}")
    return np.ndarray(shape, dtype=item, buffer=buffer, offset=data_start + offsets[0])
