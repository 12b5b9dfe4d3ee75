"""ggml's own quantizers, called in the ggml library that the whisper.cpp runtime ships: the baselines.

whisper.cpp's ``quantize`` tool, llama.cpp's imatrix and CrispASR's ``crispasr-quantize --imatrix`` all end in
``ggml_quantize_chunk``: with no importance it is ggml's plain rounding (for the K-quants already a scale search),
with one importance per input column (the mean of x^2 over calibration positions) ggml picks each block's
parameters by the weighted error (``make_qx_quants`` / ``make_qkx3_quants``). To be those baselines exactly, not
re-implementations of them, this module calls ``ggml_quantize_chunk`` in the ``libggml-base`` beside pywhispercpp
(the runtime whisper.cpp files are evaluated in) and reads the blocks back as a lattice (ggml_types.unpack), so the
exporters write ggml's bytes unchanged.
"""
from __future__ import annotations

import ctypes
import functools
import importlib.util
import multiprocessing
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Callable

import numpy as np
import torch
from gguf.constants import GGML_QUANT_SIZES

from .choices import GGML_NEEDS_IMPORTANCE
from .ggml_types import GRID_TYPES, GGMLType, spec_for_type, type_by_name, type_for_spec, unpack
from .lattice import LatticeSpec, QuantizedWeight

__all__ = ["NEEDS_IMPORTANCE", "ggml_bytes", "ggml_q4_0_bytes", "ggml_quantize", "q4_0_lattice",
           "quantize_q4_0_imatrix"]


class GgmlUnavailable(RuntimeError):
    """The ggml library could not be found or loaded."""


LM_ID_NEWLM, RTLD_NOW = -1, 2
NEEDS_IMPORTANCE = tuple(type_by_name(name) for name in GGML_NEEDS_IMPORTANCE)  # ggml_quantize_requires_imatrix
# Types whose quantizer runs in a process of its own: their first call builds ggml's grid tables (megabytes, malloc'd
# by the C library of the link namespace dlmopen made), and a process that went on after such a call crashed later
# in unrelated code (a segfault in numba's cache, OpenSSL's "malloc failure": tests/test_ggml_types.py ran into both)
ISOLATED_TYPES = GRID_TYPES
_CHUNK_SIGNATURE = ctypes.CFUNCTYPE(ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                                    ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p)


@functools.lru_cache(maxsize=1)
def ggml_quantize_chunk() -> Callable:
    """ggml_quantize_chunk of the libggml-base beside pywhispercpp (pip install tarq-deploy[dev]).

    The library is opened with dlmopen in a link namespace of its own: another ggml in this process (the crispasr
    wheel ships a newer libggml-base.so.0 with the same soname) would otherwise bind to whichever was loaded first
    and fail on missing symbols."""
    spec = importlib.util.find_spec("_pywhispercpp")
    if spec is None or spec.origin is None:
        raise GgmlUnavailable("ggml's quantizers are called from pywhispercpp 1.5.1, which is not installed "
                              "(pip install 'tarq-deploy[dev]')")
    candidates = sorted(Path(spec.origin).parent.glob("libggml-base.so*"))
    if not candidates:
        raise GgmlUnavailable(f"no libggml-base.so beside {spec.origin}")
    libc = ctypes.CDLL(None)
    libc.dlmopen.restype, libc.dlmopen.argtypes = ctypes.c_void_p, [ctypes.c_long, ctypes.c_char_p, ctypes.c_int]
    libc.dlsym.restype, libc.dlsym.argtypes = ctypes.c_void_p, [ctypes.c_void_p, ctypes.c_char_p]
    handle = libc.dlmopen(LM_ID_NEWLM, str(candidates[0]).encode(), RTLD_NOW)
    address = libc.dlsym(handle, b"ggml_quantize_chunk") if handle else None
    if not address:
        raise GgmlUnavailable(f"cannot load ggml_quantize_chunk from {candidates[0]}")
    return _CHUNK_SIGNATURE(address)


def ggml_bytes(W: torch.Tensor, ggml_type: GGMLType, importance: torch.Tensor | None) -> np.ndarray:
    """ggml's ``ggml_type`` blocks of W [m, n] (uint8 [m, row bytes]); importance [n] or None for ggml's own
    rounding without data."""
    m, n = W.shape
    block_size, type_size = GGML_QUANT_SIZES[ggml_type]
    if importance is None and ggml_type in NEEDS_IMPORTANCE:  # ggml asserts (aborts the process) without one
        raise ValueError(f"ggml's {ggml_type.name} quantizer needs an importance per column: use --method imatrix")
    if n % block_size:
        raise ValueError(f"{ggml_type.name} needs rows of a multiple of {block_size} values, got {n}")
    src = np.ascontiguousarray(W.detach().cpu().numpy(), dtype=np.float32)
    dst = np.zeros((m, n // block_size * type_size), dtype=np.uint8)
    weights = None
    if importance is not None:
        weights = np.ascontiguousarray(importance.detach().cpu().numpy(), dtype=np.float32)
        if weights.shape != (n,) or not np.isfinite(weights).all() or (weights < 0).any():
            raise ValueError(f"importance must be {n} finite non-negative values")
    if ggml_type in ISOLATED_TYPES:
        return _isolated_quantizer().submit(_quantize_chunk, int(ggml_type), src, dst, weights).result()
    return _quantize_chunk(int(ggml_type), src, dst, weights)


def _quantize_chunk(ggml_type: int, src: np.ndarray, dst: np.ndarray, weights: np.ndarray | None) -> np.ndarray:
    written = ggml_quantize_chunk()(ggml_type, src.ctypes.data, dst.ctypes.data, 0, src.shape[0], src.shape[1],
                                    None if weights is None else weights.ctypes.data)
    if written != dst.nbytes:
        raise RuntimeError(f"ggml_quantize_chunk wrote {written} bytes, expected {dst.nbytes}")
    return dst


@functools.lru_cache(maxsize=1)
def _isolated_quantizer() -> ProcessPoolExecutor:
    """One spawned process of its own for the quantizers of ISOLATED_TYPES, made on first use."""
    return ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn"))


def ggml_quantize(W: torch.Tensor, importance: torch.Tensor | None, spec: LatticeSpec) -> QuantizedWeight:
    """ggml's own quantizer of the type that stores ``spec``, as that lattice (imatrix when ``importance`` is
    given). One-level types come back at group 32, the only grouping ggml writes: other group sizes are refused."""
    ggml_type = type_for_spec(spec)
    if ggml_type is None:
        raise ValueError(f"no ggml type stores a {spec.bits}-bit {spec.scheme} lattice")
    native = spec_for_type(ggml_type)
    if spec.group_size != native.group_size:
        raise ValueError(f"ggml's {ggml_type.name} quantizer writes groups of {native.group_size}: it needs "
                         f"--group-size {native.group_size}, got {spec.group_size}")
    return unpack(ggml_bytes(W.float(), ggml_type, importance), ggml_type)


def ggml_q4_0_bytes(W: torch.Tensor, importance: torch.Tensor | None) -> np.ndarray:
    """ggml's Q4_0 blocks of W [m, n] (uint8 [m, n/32, 18])."""
    return ggml_bytes(W, GGMLType.Q4_0, importance).reshape(W.shape[0], -1, GGML_QUANT_SIZES[GGMLType.Q4_0][1])


def q4_0_lattice(blocks: np.ndarray) -> QuantizedWeight:
    """Codes and scales of Q4_0 blocks [m, n/32, 18]."""
    return unpack(blocks.reshape(blocks.shape[0], -1), GGMLType.Q4_0)


def quantize_q4_0_imatrix(W: torch.Tensor, importance: torch.Tensor, spec: LatticeSpec) -> QuantizedWeight:
    """ggml's importance-weighted Q4_0 of W on the 4-bit, group-32 lattice (the only lattice Q4_0 blocks are)."""
    if (spec.scheme, spec.bits, spec.group_size) != ("symmetric", 4, 32):
        raise ValueError(f"the imatrix method writes ggml Q4_0 blocks: it needs --bits 4 --group-size 32, "
                         f"got {spec.bits} / {spec.group_size}")
    return ggml_quantize(W, importance, spec)
