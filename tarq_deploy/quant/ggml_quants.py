"""ggml's own importance-weighted Q4_0 quantizer, called in the ggml library that the whisper.cpp runtime ships.

llama.cpp's imatrix and CrispASR's ``crispasr-quantize --imatrix`` hand ggml one importance per input column (the
mean of x^2 over calibration positions); ggml then picks each 32-block's scale from a grid of candidates by the
weighted error (``make_qx_quants``, weights qw_j * sqrt(sigma^2 + w_j^2)). To be that baseline exactly, not a
re-implementation of it, this module calls ``ggml_quantize_chunk`` in the ``libggml-base`` beside pywhispercpp
(the runtime whisper.cpp files are evaluated in) and reads the blocks back as lattice codes and fp16 scales, so the
whisper.cpp export writes ggml's bytes unchanged.
"""
from __future__ import annotations

import ctypes
import functools
import importlib.util
from pathlib import Path
from typing import Callable

import numpy as np
import torch
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

from .lattice import CODE_DTYPE, SCALE_DTYPE, LatticeSpec, QuantizedWeight

GGML_TYPE_Q4_0 = int(GGMLQuantizationType.Q4_0)
Q4_0_BLOCK, Q4_0_BYTES = GGML_QUANT_SIZES[GGMLQuantizationType.Q4_0]  # values per block; bytes (fp16 d + 16 nibble bytes)


class GgmlUnavailable(RuntimeError):
    """The ggml library could not be found or loaded."""


LM_ID_NEWLM, RTLD_NOW = -1, 2
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
        raise GgmlUnavailable("the imatrix method calls ggml's quantizer from pywhispercpp 1.5.1, which is not "
                              "installed (pip install 'tarq-deploy[dev]')")
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


def ggml_q4_0_bytes(W: torch.Tensor, importance: torch.Tensor | None) -> np.ndarray:
    """ggml's Q4_0 blocks of W [m, n] (uint8 [m, n/32, 18]); importance [n] or None for ggml's plain rounding."""
    m, n = W.shape
    if n % Q4_0_BLOCK:
        raise ValueError(f"Q4_0 needs rows of a multiple of {Q4_0_BLOCK} values, got {n}")
    src = np.ascontiguousarray(W.detach().cpu().numpy(), dtype=np.float32)
    dst = np.zeros((m, n // Q4_0_BLOCK, Q4_0_BYTES), dtype=np.uint8)
    weights = None
    if importance is not None:
        weights = np.ascontiguousarray(importance.detach().cpu().numpy(), dtype=np.float32)
        if weights.shape != (n,) or not np.isfinite(weights).all() or (weights < 0).any():
            raise ValueError(f"importance must be {n} finite non-negative values")
    written = ggml_quantize_chunk()(GGML_TYPE_Q4_0, src.ctypes.data, dst.ctypes.data, 0, m, n,
                                                 None if weights is None else weights.ctypes.data)
    if written != dst.nbytes:
        raise RuntimeError(f"ggml_quantize_chunk wrote {written} bytes, expected {dst.nbytes}")
    return dst


def q4_0_lattice(blocks: np.ndarray) -> QuantizedWeight:
    """Codes and scales of Q4_0 blocks [m, n/32, 18]: d = fp16 bytes 0-1; byte 2+j holds element j (low nibble)
    and j+16 (high nibble); value = (nibble - 8) d."""
    m, n_blocks, _ = blocks.shape
    scales = torch.from_numpy(blocks[:, :, :2].copy().view(np.float16).reshape(m, n_blocks))
    packed = blocks[:, :, 2:]
    nibbles = np.concatenate([packed & 0x0F, packed >> 4], axis=2).astype(np.int8) - 8
    codes = torch.from_numpy(nibbles.reshape(m, n_blocks * Q4_0_BLOCK))
    return QuantizedWeight(codes.to(CODE_DTYPE), scales.to(SCALE_DTYPE), LatticeSpec(4, Q4_0_BLOCK))


def quantize_q4_0_imatrix(W: torch.Tensor, importance: torch.Tensor, spec: LatticeSpec) -> QuantizedWeight:
    """ggml's importance-weighted Q4_0 of W on the 4-bit, group-32 lattice (the only lattice Q4_0 blocks are)."""
    if (spec.bits, spec.group_size) != (4, Q4_0_BLOCK):
        raise ValueError(f"the imatrix method writes ggml Q4_0 blocks: it needs --bits 4 --group-size 32, "
                         f"got {spec.bits} / {spec.group_size}")
    return q4_0_lattice(ggml_q4_0_bytes(W, importance))
