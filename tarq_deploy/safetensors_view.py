"""Zero-copy reading of a safetensors file: numpy views into one read-only memory map.

The safetensors library copies every tensor it loads; an exporter that only moves a checkpoint's ggml blocks into a
model file would spend as long on that copy as on its whole output. The layout is small and fixed (an 8-byte
little-endian header length, a JSON header {name: {dtype, shape, data_offsets}, "__metadata__": {...}}, then the
data), so it is read here directly, every field checked. ``tensor_views`` maps the dtypes numpy holds natively;
``tensor_entries`` describes every dtype, for a caller that makes torch tensors (bfloat16 included).
"""
from __future__ import annotations

import json
import math
import mmap
import os
from pathlib import Path
from typing import NamedTuple

import numpy as np

NUMPY_DTYPES = {"U8": np.uint8, "I8": np.int8, "I16": np.int16, "I32": np.int32, "I64": np.int64, "F16": np.float16,
                "F32": np.float32, "F64": np.float64, "BOOL": np.bool_}
LITTLE_ENDIAN = {name: np.dtype(t).newbyteorder("<") for name, t in NUMPY_DTYPES.items()}
ITEM_BYTES = {**{name: t.itemsize for name, t in LITTLE_ENDIAN.items()}, "BF16": 2, "U16": 2, "U32": 4, "U64": 8,
              "F8_E4M3": 1, "F8_E5M2": 1}
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


class Entry(NamedTuple):
    """One tensor of a safetensors file: its dtype name as the file spells it, its shape, and where its bytes lie
    (absolute offsets into the file)."""

    dtype: str
    shape: tuple[int, ...]
    start: int
    end: int


def tensor_entries(buffer: mmap.mmap | bytes | bytearray) -> tuple[dict[str, Entry], dict[str, str]]:
    """(name -> Entry, the header's __metadata__) of a safetensors file's bytes, every offset checked against the
    file and every size against dtype and shape."""
    header, data_start = _header(buffer)
    metadata = header.pop("__metadata__", {}) or {}
    if not isinstance(metadata, dict):
        raise SafetensorsViewError("__metadata__ is not a JSON object")
    data_bytes = len(buffer) - data_start
    return {name: _entry(name, raw, data_start, data_bytes) for name, raw in header.items()}, metadata


def tensor_views(buffer: mmap.mmap | bytes | bytearray) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """(name -> array viewing ``buffer``, the header's __metadata__) of a safetensors file's bytes; read-only for a
    memory map or bytes."""
    entries, metadata = tensor_entries(buffer)
    views = {}
    for name, entry in entries.items():
        if entry.dtype not in LITTLE_ENDIAN:
            raise SafetensorsViewError(f"tensor {name!r}: dtype {entry.dtype!r} has no numpy view")
        views[name] = np.ndarray(entry.shape, dtype=LITTLE_ENDIAN[entry.dtype], buffer=buffer, offset=entry.start)
    return views, metadata


def read_tensor_views(path: Path) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    return tensor_views(map_readonly(path))


def _header(buffer: mmap.mmap | bytes | bytearray) -> tuple[dict, int]:
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


def _entry(name: str, raw: object, data_start: int, data_bytes: int) -> Entry:
    if not isinstance(raw, dict) or not {"dtype", "shape", "data_offsets"} <= raw.keys():
        raise SafetensorsViewError(f"tensor {name!r}: entry lacks dtype, shape or data_offsets")
    dtype, shape, offsets = raw["dtype"], raw["shape"], raw["data_offsets"]
    if dtype not in ITEM_BYTES:
        raise SafetensorsViewError(f"tensor {name!r}: unknown dtype {dtype!r}")
    if not (isinstance(shape, list) and all(isinstance(d, int) and d >= 0 for d in shape)):
        raise SafetensorsViewError(f"tensor {name!r}: shape {shape!r} is not a list of sizes")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(o, int) for o in offsets)
            and 0 <= offsets[0] <= offsets[1] <= data_bytes):
        raise SafetensorsViewError(f"tensor {name!r}: data_offsets {offsets!r} fall outside the {data_bytes} data "
                                   f"bytes (truncated file?)")
    if offsets[1] - offsets[0] != math.prod(shape) * ITEM_BYTES[dtype]:
        raise SafetensorsViewError(f"tensor {name!r}: {offsets[1] - offsets[0]} bytes do not hold {shape} {dtype}")
    return Entry(dtype, tuple(shape), data_start + offsets[0], data_start + offsets[1])
