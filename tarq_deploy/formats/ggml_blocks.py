"""ggml types and block packing: the one place that knows how ggml lays out quantized rows.

Type ids and sizes are gguf-py's (``GGMLQuantizationType``, ``GGML_QUANT_SIZES``); ``BLOCKS`` holds, for every type
this package reads or writes, its block size, bytes per block and name.

A lattice (integer codes q, one fp16 scale s per row per group of input columns, value s * q) is written into ggml
blocks of 32 consecutive values of a row, each block carrying its own fp16 scale d:

* Q4_0 (18 bytes): d, then 16 bytes; byte j holds element j in its low nibble and element j + 16 in its high
  nibble; nibble = q + 8; value = (nibble - 8) * d.
* Q8_0 (34 bytes): d, then 32 int8 codes; value = q * d.

A lattice group that spans several blocks (group 64 / 128 / a whole row) repeats its scale in each of them, which
is exact: every block decodes to the same s * q. A group narrower than a block, or one that straddles block
boundaries (e.g. 48), cannot be held, and we refuse rather than re-quantize.

``ggml_rtn_q4_0`` / ``ggml_rtn_q8_0`` are ggml's *own* rounding of float weights (what whisper.cpp's quantize tool
produces), byte-identical with ``gguf.quants.quantize``: the baseline a lattice is compared against.
"""
from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np
from gguf.constants import GGML_QUANT_SIZES
from gguf.constants import GGMLQuantizationType as GGMLType


class BlockLayout(NamedTuple):
    """How ggml stores one type: ``block_size`` values in ``type_size`` bytes (ggml_blck_size / ggml_type_size)."""

    block_size: int
    type_size: int
    name: str


# The types this package reads and writes; a new lattice type is one more entry here (its sizes come from gguf-py).
KNOWN_TYPES = (GGMLType.F32, GGMLType.F16, GGMLType.Q4_0, GGMLType.Q4_1, GGMLType.Q8_0)
BLOCKS: dict[int, BlockLayout] = {t: BlockLayout(*GGML_QUANT_SIZES[t], t.name) for t in KNOWN_TYPES}
GGML_TYPE_NAMES: dict[int, str] = {t: layout.name for t, layout in BLOCKS.items()}
QUANTIZED_TYPES = tuple(t for t, layout in BLOCKS.items() if layout.block_size > 1)

QK = BLOCKS[GGMLType.Q4_0].block_size  # values per block of Q4_0 and Q8_0, the types a lattice is packed into

# the lattice bit width each quantized type holds exactly, and its code range
LATTICE_BITS = {GGMLType.Q4_0: 4, GGMLType.Q8_0: 8}
CODE_RANGE = {GGMLType.Q4_0: (-8, 7), GGMLType.Q8_0: (-128, 127)}
Q4_0_NIBBLE_OFFSET = 8


class LatticeNotRepresentable(ValueError):
    """The lattice cannot be stored bit-exactly in the requested ggml type."""


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
    n_rows = int(np.prod(shape[:-1], dtype=np.int64)) if len(shape) > 1 else 1
    return n_rows * row_nbytes(ggml_type, shape[-1])


# ----------------------------------------------------------------------------------------------- lattice packing
def pack_lattice(codes: Any, scales: Any, bits: int, ggml_type: int) -> np.ndarray:
    """Pack a lattice weight (codes [m, n], fp16 scales [m, n_groups]) as ``ggml_type`` blocks; uint8 [m, row_bytes].
    Refuses (LatticeNotRepresentable) a lattice whose bit width is not the one the type stores."""
    if ggml_type not in LATTICE_BITS:
        raise LatticeNotRepresentable(f"ggml type {GGML_TYPE_NAMES.get(ggml_type, ggml_type)} does not hold a "
                                      f"symmetric integer lattice; use Q4_0 or Q8_0")
    if bits != LATTICE_BITS[ggml_type]:
        raise LatticeNotRepresentable(f"a {bits}-bit lattice is not what {GGML_TYPE_NAMES[ggml_type]} stores "
                                      f"(it stores {LATTICE_BITS[ggml_type]}-bit codes)")
    return pack_q4_0(codes, scales) if ggml_type == GGMLType.Q4_0 else pack_q8_0(codes, scales)


def pack_q4_0(codes: Any, scales: Any) -> np.ndarray:
    """Q4_0 blocks of a 4-bit lattice: codes int [m, n] in [-8, 7], fp16 scales [m, n_groups]; uint8 [m, n/32*18]."""
    q, d = _block_codes_and_scales(codes, scales, GGMLType.Q4_0)
    m, n_blocks = d.shape
    # codes are checked to lie in [-8, 7], so code + 8 fits int8 and reads as the unsigned nibble
    nibbles = (q.astype(np.int8, copy=False) + np.int8(Q4_0_NIBBLE_OFFSET)).view(np.uint8)
    nibbles = nibbles.reshape(m, n_blocks, 2, QK // 2)
    packed = nibbles[:, :, 0, :] | (nibbles[:, :, 1, :] << np.uint8(4))  # element j low, element j + 16 high
    return _assemble_blocks(d, packed)


def pack_q8_0(codes: Any, scales: Any) -> np.ndarray:
    """Q8_0 blocks of an 8-bit lattice: codes int [m, n] in [-128, 127], fp16 scales [m, n_groups]; uint8 [m, n/32*34].
    Code -128 is stored as is: ggml dequantizes it exactly (its own quantizer only ever writes [-127, 127])."""
    q, d = _block_codes_and_scales(codes, scales, GGMLType.Q8_0)
    m, n_blocks = d.shape
    return _assemble_blocks(d, q.astype(np.int8).view(np.uint8).reshape(m, n_blocks, QK))


def _block_codes_and_scales(codes: Any, scales: Any, ggml_type: int) -> tuple[np.ndarray, np.ndarray]:
    """Validate a lattice for ``ggml_type`` and return (codes [m, n], fp16 scale per 32-block [m, n/32])."""
    q = _as_numpy(codes)
    s = _as_numpy(scales)
    name = GGML_TYPE_NAMES[ggml_type]
    if q.ndim != 2 or s.ndim != 2 or s.shape[0] != q.shape[0]:
        raise LatticeNotRepresentable(f"codes {q.shape} and scales {s.shape} are not a [m, n] / [m, n_groups] pair")
    if not np.issubdtype(q.dtype, np.integer):
        raise LatticeNotRepresentable(f"codes must be integers, got {q.dtype}")
    if s.dtype != np.float16:
        raise LatticeNotRepresentable(f"scales must be float16 (the scale {name} stores), got {s.dtype}")
    m, n = q.shape
    n_groups = s.shape[1]
    if n_groups == 0 or n % n_groups:
        raise LatticeNotRepresentable(f"{n} columns do not split into {n_groups} equal groups")
    group = n // n_groups
    if group % QK:
        raise LatticeNotRepresentable(
            f"group size {group} (row length {n}, {n_groups} group(s) per row) is not a multiple of the {QK}-value "
            f"{name} block, so one block would need two scales; {name} holds groups of 32, 64, 128, ... only")
    lo, hi = CODE_RANGE[ggml_type]
    if q.size and (int(q.min()) < lo or int(q.max()) > hi):
        raise LatticeNotRepresentable(f"codes span [{int(q.min())}, {int(q.max())}], outside {name}'s [{lo}, {hi}]")
    if not np.isfinite(s).all():
        raise LatticeNotRepresentable("scales contain inf or nan")
    block_scales = np.repeat(s, group // QK, axis=1)  # a group's scale, once per block it spans
    return q, block_scales


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
