"""ggml types and block packing: the one place the formats layer learns how ggml lays out quantized rows.

Type ids and sizes are gguf-py's (``GGMLQuantizationType``, ``GGML_QUANT_SIZES``); ``BLOCKS`` holds, for every type
this package reads or writes, its block size, bytes per block and name. Each quantized type holds exactly one
lattice (quant/ggml_types.py, where the per-type codecs live): Q4_0 / Q5_0 / Q8_0 the symmetric 4-, 5- and 8-bit
lattices, Q4_1 / Q5_1 the affine ones, Q2_K ... Q6_K the two-level K-quant lattices, IQ4_NL a non-uniform one and
IQ4_XS the same table under K-quant scales.
``pack_lattice`` copies a lattice weight into its type's blocks and refuses any other pairing rather than re-quantize.

``ggml_rtn_q4_0`` / ``ggml_rtn_q8_0`` are ggml's *own* rounding of float weights (what whisper.cpp's quantize tool
produces), byte-identical with ``gguf.quants.quantize``: the baseline a lattice is compared against;
``ggml_rtn`` gives it for every lattice type (gguf-py's reference quantizers for the one-level types, ggml's own
library for the K-quants, whose reference quantizer gguf-py does not carry).
"""
from __future__ import annotations

import math
from typing import Any, NamedTuple

import numpy as np
from gguf.constants import GGML_QUANT_SIZES
from gguf.constants import GGMLQuantizationType as GGMLType

from tarq_deploy.quant.ggml_types import (K_TYPES, LATTICE_TYPES, QK, LatticeNotRepresentable, pack, pack_one_level,
                                          spec_for_type, type_for_spec)
from tarq_deploy.quant.lattice import QuantizedWeight


class BlockLayout(NamedTuple):
    """How ggml stores one type: ``block_size`` values in ``type_size`` bytes (ggml_blck_size / ggml_type_size)."""

    block_size: int
    type_size: int
    name: str


# The types this package reads and writes; a new lattice type is one more entry in quant/ggml_types.py.
KNOWN_TYPES = (GGMLType.F32, GGMLType.F16, *LATTICE_TYPES)
BLOCKS: dict[int, BlockLayout] = {t: BlockLayout(*GGML_QUANT_SIZES[t], t.name) for t in KNOWN_TYPES}
GGML_TYPE_NAMES: dict[int, str] = {t: layout.name for t, layout in BLOCKS.items()}
QUANTIZED_TYPES = tuple(t for t, layout in BLOCKS.items() if layout.block_size > 1)
# lower-case names, as the command line and whisper.cpp's quantize tool spell them
TYPE_BY_NAME: dict[str, GGMLType] = {t.name.lower(): t for t in KNOWN_TYPES}

__all__ = ["K_TYPES", "LATTICE_TYPES", "LatticeNotRepresentable", "QK", "spec_for_type", "type_for_spec", "BLOCKS",
           "GGMLType", "GGML_TYPE_NAMES", "QUANTIZED_TYPES", "ggml_rtn", "ggml_rtn_q4_0", "ggml_rtn_q8_0",
           "pack_lattice", "pack_q4_0", "pack_q8_0", "tensor_nbytes"]


# ------------------------------------------------------------------------------------------------------- sizes
def row_nbytes(ggml_type: int, n_cols: int) -> int:
    """Bytes of one row of ``n_cols`` values (ggml_row_size); raises ValueError for an unknown type or a row that
    does not fill whole blocks."""
    if ggml_type not in BLOCKS:
        raise ValueError(f"unknown ggml type id {ggml_type}")
    layout = BLOCKS[ggml_type]
    if n_cols % layout.block_size:
        raise ValueError(f"a {layout.name} row needs a multiple of {layout.block_size} values, got {n_cols}")
    return n_cols // layout.block_size * layout.type_size


def tensor_nbytes(ggml_type: int, shape: tuple[int, ...]) -> int:
    """Bytes of a tensor; ``shape`` in numpy order (last axis = row = ggml ne[0])."""
    return math.prod(shape[:-1]) * row_nbytes(ggml_type, shape[-1])  # Python ints: no overflow, and no numpy call


# ----------------------------------------------------------------------------------------------- lattice packing
def pack_lattice(q: QuantizedWeight, ggml_type: int) -> np.ndarray:
    """Pack a lattice weight as ``ggml_type`` blocks; uint8 [m, row_bytes]. Refuses (LatticeNotRepresentable) a
    lattice that is not the one the type stores."""
    if ggml_type not in LATTICE_TYPES:
        raise LatticeNotRepresentable(f"ggml type {GGML_TYPE_NAMES.get(ggml_type, ggml_type)} does not hold a "
                                      f"lattice; use one of {', '.join(t.name for t in LATTICE_TYPES)}")
    return pack(q, GGMLType(ggml_type))


def pack_q4_0(codes: Any, scales: Any) -> np.ndarray:
    """Q4_0 blocks of a 4-bit lattice: codes int [m, n] in [-8, 7], fp16 scales [m, n_groups]; uint8 [m, n/32*18]."""
    return pack_one_level(codes, scales, GGMLType.Q4_0)


def pack_q8_0(codes: Any, scales: Any) -> np.ndarray:
    """Q8_0 blocks of an 8-bit lattice: codes int [m, n] in [-128, 127], fp16 scales [m, n_groups]; uint8 [m, n/32*34].
    Code -128 is stored as is: ggml dequantizes it exactly (its own quantizer only ever writes [-127, 127])."""
    return pack_one_level(codes, scales, GGMLType.Q8_0)


def _assemble_blocks(d: np.ndarray, payload: np.ndarray) -> np.ndarray:
    """Blocks = fp16 d (2 bytes, little-endian) followed by the payload bytes; uint8 [m, n_blocks * block_bytes]."""
    m, n_blocks, payload_bytes = payload.shape
    out = np.empty((m, n_blocks, 2 + payload_bytes), dtype=np.uint8)
    out[:, :, :2] = d.astype("<f2").view(np.uint8).reshape(m, n_blocks, 2)
    out[:, :, 2:] = payload
    return out.reshape(m, n_blocks * (2 + payload_bytes))


def _as_numpy(a: Any) -> np.ndarray:
    """numpy view of a numpy array or a (CPU) torch tensor, without importing torch here."""
    if hasattr(a, "detach"):
        a = a.detach().cpu().numpy()
    return np.ascontiguousarray(a)


# ---------------------------------------------------------------------------------------- ggml's own rounding
def ggml_rtn_q4_0(w: Any) -> np.ndarray:
    """ggml's quantize_row_q4_0_ref on float rows [..., n]: per block d = (signed value of largest magnitude) / -8,
    nibble = min(15, trunc(x / d + 8.5)) with 1/d taken from the float32 d, d stored as fp16. uint8 [..., n/32*18].
    All arithmetic is float32, as in the C code, so the bytes equal gguf.quants.quantize(w, Q4_0)."""
    blocks, out_shape = _float_blocks(w, GGMLType.Q4_0)
    pick = np.abs(blocks).argmax(axis=1)[:, None]  # first index of the largest magnitude, like the C loop
    signed_max = np.take_along_axis(blocks, pick, axis=1)
    d = signed_max / np.float32(-8)
    with np.errstate(divide="ignore"):
        inv_d = np.where(d == 0, np.float32(0), np.float32(1) / d).astype(np.float32)
    # x / d >= -8 for every x of the block, so x / d + 8.5 > 0 and the uint8 cast sees no negatives
    nib = np.minimum(np.trunc(blocks * inv_d + np.float32(8.5)).astype(np.uint8), np.uint8(15))
    nib = nib.reshape(-1, 2, QK // 2)
    packed = nib[:, 0, :] | (nib[:, 1, :] << np.uint8(4))
    out = _assemble_blocks(d.reshape(1, -1), packed.reshape(1, -1, QK // 2))
    return out.reshape(out_shape)


def ggml_rtn_q8_0(w: Any) -> np.ndarray:
    """ggml's quantize_row_q8_0_ref: d = amax / 127, q = roundf(x / d) (half away from zero); uint8 [..., n/32*34].
    Byte-identical with gguf.quants.quantize(w, Q8_0)."""
    blocks, out_shape = _float_blocks(w, GGMLType.Q8_0)
    d = np.abs(blocks).max(axis=1, keepdims=True) / np.float32(127)
    with np.errstate(divide="ignore"):
        inv_d = np.where(d == 0, np.float32(0), np.float32(1) / d).astype(np.float32)
    x = blocks * inv_d
    # C roundf (half away from zero) without adding 0.5 first: a + 0.5 can itself round up in float32
    a = np.abs(x)
    whole = np.floor(a)
    q = (np.sign(x) * (whole + np.floor(2 * (a - whole)))).astype(np.int8)
    out = _assemble_blocks(d.reshape(1, -1), q.view(np.uint8).reshape(1, -1, QK))
    return out.reshape(out_shape)


def _float_blocks(w: Any, ggml_type: int) -> tuple[np.ndarray, tuple[int, ...]]:
    x = _as_numpy(w).astype(np.float32, copy=False)
    if x.ndim == 0 or x.shape[-1] % QK:
        raise ValueError(f"{GGML_TYPE_NAMES[ggml_type]} needs rows of a multiple of {QK} values, got shape {x.shape}")
    return x.reshape(-1, QK), (*x.shape[:-1], row_nbytes(ggml_type, x.shape[-1]))


def ggml_rtn(w: Any, ggml_type: int) -> np.ndarray:
    """ggml's own rounding of float rows [..., n] as ``ggml_type`` (what its quantize tool writes without an
    importance matrix); uint8 [..., row bytes]."""
    if ggml_type == GGMLType.Q4_0:
        return ggml_rtn_q4_0(w)
    if ggml_type == GGMLType.Q8_0:
        return ggml_rtn_q8_0(w)
    x = _as_numpy(w).astype(np.float32, copy=False)
    out_shape = (*x.shape[:-1], row_nbytes(ggml_type, x.shape[-1]))
    rows = x.reshape(-1, x.shape[-1])
    if ggml_type in (GGMLType.Q4_1, GGMLType.Q5_0, GGMLType.Q5_1):
        from gguf.quants import quantize

        return quantize(rows, GGMLType(ggml_type)).reshape(out_shape)
    if ggml_type not in LATTICE_TYPES:
        raise ValueError(f"no ggml rounding for type {GGML_TYPE_NAMES.get(ggml_type, ggml_type)}")
    import torch

    from tarq_deploy.quant.ggml_quants import ggml_bytes

    return ggml_bytes(torch.from_numpy(np.ascontiguousarray(rows)), GGMLType(ggml_type), None).reshape(out_shape)
