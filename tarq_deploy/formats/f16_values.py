"""fp16 tensors for F16 runtime files: float32 values rounded to fp16, and a lattice's ggml blocks decoded straight
from the checkpoint and rounded, by compiled kernels (f16_kernels.py) that count the values fp16 changed on the way
for the exporters' rounding warning (F16Rounding). A large tensor is cut into one part per core.

Whole-tensor numpy / torch arithmetic made the F16 export of a tiny.en checkpoint 13x its I/O floor: a dozen
full-size temporaries per matrix, each written once and read once, and a separate comparison for the count.
"""
from __future__ import annotations

import functools
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

import numpy as np
import torch
from gguf.constants import GGML_QUANT_SIZES
from gguf.constants import GGMLQuantizationType as GGMLType

from tarq_deploy.quant.ggml_types import GRID_TYPES, unpack
from tarq_deploy.quant.lattice import CODEBOOKS

__all__ = ["blocks_to_f16", "float_to_f16", "threads"]

MIN_PART_VALUES = 1 << 20  # a tensor is shared among the cores from two parts of this size on


_POOLS: dict[tuple[int, str], ThreadPoolExecutor] = {}


def threads(purpose: str) -> ThreadPoolExecutor:
    """One thread per core for ``purpose``, made once per process: a process forked from one that had made them
    has none of their threads, and work handed to the parent's pool there would wait forever."""
    key = (os.getpid(), purpose)
    if key not in _POOLS:
        _POOLS[key] = ThreadPoolExecutor(max_workers=os.cpu_count() or 1, thread_name_prefix=purpose)
    return _POOLS[key]


@functools.cache
def _decoder(ggml_type: GGMLType) -> Callable[[np.ndarray, np.ndarray], int]:
    from . import f16_kernels  # numba: imported (and its kernels compiled or read from the cache) by F16 exports only

    blocks_of_32, k_affine = f16_kernels.decode_blocks_of_32, f16_kernels.decode_k_affine
    decoders = {GGMLType.Q4_0: lambda raw, out: blocks_of_32(raw, out, False, False),  # flags: with_min, fifth bit
                GGMLType.Q4_1: lambda raw, out: blocks_of_32(raw, out, True, False),
                GGMLType.Q5_0: lambda raw, out: blocks_of_32(raw, out, False, True),
                GGMLType.Q5_1: lambda raw, out: blocks_of_32(raw, out, True, True),
                GGMLType.Q8_0: f16_kernels.decode_q8_0,
                GGMLType.Q4_K: lambda raw, out: k_affine(raw, out, False),  # flag: fifth bit
                GGMLType.Q5_K: lambda raw, out: k_affine(raw, out, True),
                GGMLType.Q6_K: f16_kernels.decode_q6_k,
                GGMLType.Q3_K: f16_kernels.decode_q3_k,
                GGMLType.Q2_K: f16_kernels.decode_q2_k,
                GGMLType.IQ4_NL: lambda raw, out: f16_kernels.decode_iq4_nl(raw, out, _IQ4_NL_TABLE),
                GGMLType.IQ4_XS: lambda raw, out: f16_kernels.decode_iq4_xs(raw, out, _IQ4_NL_TABLE)}
    if ggml_type in GRID_TYPES:  # vector codebooks: decoded by the codec itself (numpy), then rounded by the kernel
        return functools.partial(_decode_by_unpacking, ggml_type=ggml_type)
    if ggml_type not in decoders:
        raise ValueError(f"no decoder for {GGMLType(ggml_type).name} blocks")
    return decoders[ggml_type]


def _decode_by_unpacking(raw: np.ndarray, out: np.ndarray, ggml_type: GGMLType) -> int:
    """A decoder for blocks raw [blocks, type size] through ggml_types.unpack (each block a row of one super-block):
    exactly the lattice's values, rounded to fp16 in ``out``; how many fp16 changed."""
    from . import f16_kernels

    values = unpack(raw, ggml_type).dequantize().numpy().reshape(-1)
    return f16_kernels.to_f16(values, out)


_IQ4_NL_TABLE = np.array(CODEBOOKS[("nonlinear", 4)], dtype=np.int8)


def float_to_f16(values: torch.Tensor, out: np.ndarray | None = None) -> tuple[np.ndarray, int]:
    """(``values`` as fp16, in their shape; how many of them fp16 changed, NaN not counted). ``out``: where to put
    them (fp16 or uint16, as many values), else a new array."""
    from .f16_kernels import to_f16

    flat = values.detach().cpu().float().contiguous().numpy().reshape(-1)
    bits = _output(out, flat.size)
    changed = _in_parts(flat.size, 1, lambda a, b: to_f16(flat[a:b], bits[a:b]))
    return bits.view(np.float16).reshape(tuple(values.shape)), changed


def blocks_to_f16(blocks: np.ndarray, ggml_type: GGMLType, out: np.ndarray | None = None) -> tuple[np.ndarray, int]:
    """(the values of a matrix stored as ``ggml_type`` blocks uint8 [rows, row bytes], fp16 [rows, columns]; how
    many of them fp16 changed). Exactly ``unpack(blocks, ggml_type).dequantize()`` rounded to fp16. ``out`` as for
    float_to_f16."""
    block_size, type_size = GGML_QUANT_SIZES[ggml_type]
    raw = np.ascontiguousarray(blocks).reshape(-1, type_size)
    decode = _decoder(ggml_type)
    bits = _output(out, raw.shape[0] * block_size)
    changed = _in_parts(raw.shape[0], block_size,
                        lambda a, b: decode(raw[a:b], bits[a * block_size:b * block_size]))
    return bits.view(np.float16).reshape(blocks.shape[0], -1), changed


def _output(out: np.ndarray | None, count: int) -> np.ndarray:
    """uint16 view of ``out`` (checked to hold ``count`` values), or a new array."""
    if out is None:
        return np.empty(count, dtype=np.uint16)
    if out.size != count or out.dtype.itemsize != 2:
        raise ValueError(f"output for {count} fp16 values is {out.dtype} {list(out.shape)}")
    return out.reshape(-1).view(np.uint16)


def _in_parts(n: int, values_per_item: int, job: Callable[[int, int], int]) -> int:
    """The sum of ``job(start, stop)`` over [0, n) cut into one part per core (one part for a small tensor), run
    on the worker threads: one compiled call per part, so the threads hardly ever need the GIL."""
    parts = min(os.cpu_count() or 1, max(n * values_per_item // MIN_PART_VALUES, 1))
    if parts == 1:
        return int(job(0, n))
    bounds = [n * i // parts for i in range(parts + 1)]
    return sum(int(c) for c in threads("f16-parts").map(job, bounds[:-1], bounds[1:]))
