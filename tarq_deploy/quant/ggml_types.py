"""ggml's quantized types as exact codecs between their blocks and lattices (lattice.py's schemes).

One type, one lattice: ``LATTICE_OF_TYPE`` says which (scheme, bits, group size) each type's dequantizer spans, and
``pack`` / ``unpack`` move between a ``QuantizedWeight`` and the type's bytes without any arithmetic on values, so
pack(unpack(b)) == b and gguf-py's dequantizer of pack(q) equals q.dequantize() bit for bit (tests/test_ggml_types.py).
Layouts (ggml-common.h; u = code - qmin, the unsigned code):

* Q4_0 / Q4_1 (18 / 20 bytes per 32): fp16 d (, fp16 m), 16 bytes: byte j = u_j | u_{j+16} << 4.
* Q5_0 / Q5_1 (22 / 24 bytes per 32): fp16 d (, fp16 m), 4 bytes qh (bit j = bit 4 of u_j, little-endian), then the
  low nibbles as in Q4_0.
* Q8_0 (34 bytes per 32): fp16 d, 32 int8 codes.
* IQ4_NL (18 bytes per 32): as Q4_0, but each nibble is an index u into the 16-value table (lattice.CODEBOOKS) and
  the code is the table's value there.
* Q4_K (144 bytes per 256): fp16 d, fp16 dmin, 12 bytes of 6-bit (sc, mn) for 8 groups of 32, 128 bytes: for each
  64 values c, byte 32 c + l = u_{64c+l} | u_{64c+32+l} << 4.
* Q5_K (176 bytes per 256): as Q4_K with 32 bytes qh between the scales and the nibbles: bit j of qh[l] is bit 4 of
  u_{32j+l}.
* Q6_K (210 bytes per 256): 128 bytes ql, 64 bytes qh, 16 int8 group scales, fp16 d at the end. Per half of 128
  values: ql[l] = low nibbles of u_l | u_{l+64} << 4 (l < 64), qh[l] = bits 4-5 of u_l, u_{l+32}, u_{l+64}, u_{l+96}
  at bit pairs 0, 2, 4, 6 (l < 32).
* Q3_K (110 bytes per 256): 32 bytes hmask, 64 bytes qs, 12 bytes of 6-bit group scales, fp16 d at the end; codes
  q = u - 4 in -4..3, u = low 2 bits | high bit << 2. Bit j of hmask[l] is the high bit of u_{32j+l}; per half of 128
  values, qs[32 h + l] holds the low 2 bits of u_{128h+l}, u_{128h+32+l}, u_{128h+64+l}, u_{128h+96+l} at bit pairs
  0, 2, 4, 6. Group scale sc in -32..31 is kept as e = sc + 32: its low nibble in byte g % 8 (low nibble for g < 8,
  high for g >= 8), its top 2 bits in byte 8 + g % 4 at bit pair g // 4. (ggml's dequantizer: an hmask bit of 0
  subtracts 4.)
* Q2_K (84 bytes per 256): 16 bytes, one per group of 16: scale code | min code << 4 (4-bit each); 64 bytes qs with
  the 2-bit codes as Q3_K's qs; fp16 d, fp16 dmin at the end.
* IQ4_XS (136 bytes per 256): fp16 d, uint16 scales_h, 4 bytes scales_l, 128 bytes qs. Group g's scale sc in
  -32..31 is kept as e = sc + 32: its low nibble in scales_l[g // 2] (low nibble for even g), its top 2 bits at bit
  pair g of scales_h (little-endian). Each group of 32 has 16 bytes of table indices laid out as IQ4_NL's.
"""
from __future__ import annotations

import functools
from typing import Any

import numpy as np
import torch
from gguf.constants import GGML_QUANT_SIZES
from gguf.constants import GGMLQuantizationType as GGMLType

from .grid import SIGN_RUN, grid_indices
from .lattice import CODEBOOKS, K_SUPER_BLOCK, LatticeSpec, QuantizedWeight, check_on_lattice

__all__ = ["FP16_FIELDS", "GGMLType", "GRID_TYPES", "K_TYPES", "LATTICE_TYPES", "LatticeNotRepresentable", "QK",
           "block_matrix_shape", "check_block_scales", "native_type", "pack", "pack_one_level", "spec_for_type",
           "type_by_name", "type_for_spec", "unpack"]

QK = 32  # values per block of the one-level types
# the lattice each type's dequantizer spans: (scheme, bits, group size); symmetric types also hold wider groups
LATTICE_OF_TYPE: dict[GGMLType, tuple[str, int, int]] = {
    GGMLType.Q4_0: ("symmetric", 4, 32), GGMLType.Q5_0: ("symmetric", 5, 32), GGMLType.Q8_0: ("symmetric", 8, 32),
    GGMLType.Q4_1: ("affine", 4, 32), GGMLType.Q5_1: ("affine", 5, 32),
    GGMLType.Q4_K: ("k-affine", 4, 32), GGMLType.Q5_K: ("k-affine", 5, 32), GGMLType.Q6_K: ("k-symmetric", 6, 16),
    GGMLType.Q3_K: ("k-symmetric", 3, 16), GGMLType.Q2_K: ("k-affine", 2, 16),
    GGMLType.IQ4_NL: ("nonlinear", 4, 32), GGMLType.IQ4_XS: ("k-nonlinear", 4, 32),
    GGMLType.IQ3_S: ("grid-iq3_s", 3, 32), GGMLType.IQ3_XXS: ("grid-iq3_xxs", 3, 32),
    GGMLType.IQ2_S: ("grid-iq2_s", 2, 16), GGMLType.IQ2_XS: ("grid-iq2_xs", 2, 16),
}
GRID_TYPES = (GGMLType.IQ3_S, GGMLType.IQ3_XXS, GGMLType.IQ2_S, GGMLType.IQ2_XS)
LATTICE_TYPES = tuple(LATTICE_OF_TYPE)
# the types of 256-value super-blocks (rows of a multiple of 256): the K-quants, IQ4_XS and the grid types
K_TYPES = (GGMLType.Q4_K, GGMLType.Q5_K, GGMLType.Q6_K, GGMLType.Q3_K, GGMLType.Q2_K, GGMLType.IQ4_XS,
           GGMLType.IQ3_S, GGMLType.IQ3_XXS, GGMLType.IQ2_S, GGMLType.IQ2_XS)
Q3_K_SCALE_BIAS = 32  # Q3_K and IQ4_XS keep their signed 6-bit group scales as sc + 32
K_SCALES_BYTES = 12


class LatticeNotRepresentable(ValueError):
    """The lattice cannot be stored bit-exactly in the requested ggml type."""


def type_by_name(name: str) -> GGMLType:
    """The ggml type of a lower-case name ("q5_1"); ValueError naming the known ones otherwise."""
    for t in LATTICE_TYPES:
        if t.name.lower() == name.lower():
            return t
    raise ValueError(f"unknown type {name!r}; known: {', '.join(t.name.lower() for t in LATTICE_TYPES)}")


def spec_for_type(ggml_type: GGMLType) -> LatticeSpec:
    scheme, bits, group = LATTICE_OF_TYPE[ggml_type]
    return LatticeSpec(bits, group, scheme)


def type_for_spec(spec: LatticeSpec) -> GGMLType | None:
    """The ggml type a lattice is stored in exactly (a symmetric lattice of any group that fills whole blocks: the
    caller checks the row), or None."""
    for t, (scheme, bits, _group) in LATTICE_OF_TYPE.items():
        if (scheme, bits) == (spec.scheme, spec.bits):
            return t
    return None


# ------------------------------------------------------------------------------------------------------ packing
def pack(q: QuantizedWeight, ggml_type: GGMLType) -> np.ndarray:
    """The blocks of ``q`` as ``ggml_type``: uint8 [m, row bytes]. LatticeNotRepresentable when the lattice is not
    the type's (another scheme or bit width, groups that split a block, codes out of range)."""
    if ggml_type not in LATTICE_OF_TYPE:
        raise LatticeNotRepresentable(f"{ggml_type.name} is not a lattice type; known: "
                                      f"{', '.join(t.name for t in LATTICE_TYPES)}")
    if type_for_spec(q.spec) != ggml_type:
        raise LatticeNotRepresentable(f"a {q.spec.bits}-bit {q.spec.scheme} lattice is not what {ggml_type.name} "
                                      f"stores (it stores the {spec_for_type(ggml_type).bits}-bit "
                                      f"{spec_for_type(ggml_type).scheme} lattice)")
    try:
        check_on_lattice(q)
    except ValueError as e:
        raise LatticeNotRepresentable(str(e)) from None
    codes = _numpy(q.codes)
    if ggml_type in GRID_TYPES:
        return _pack_grid(codes, _numpy(q.scales), _numpy(q.sub_scales), ggml_type)
    if ggml_type in K_TYPES:
        u = codes - q.spec.qmin if q.spec.codebook is None else _table_indices(codes, (q.spec.scheme, q.spec.bits))
        return _pack_k(u, {k: _numpy(v) for k, v in q.params().items()}, ggml_type)
    return pack_one_level(codes, _numpy(q.scales), ggml_type, None if q.mins is None else _numpy(q.mins))


def pack_one_level(codes: Any, scales: Any, ggml_type: GGMLType, mins: Any = None) -> np.ndarray:
    """Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 blocks of codes [m, n] and fp16 scales (and mins) [m, n_groups]; a group of
    several blocks repeats its parameters in each, which decodes to the same values."""
    scheme, bits, _ = LATTICE_OF_TYPE[ggml_type]
    q, d = _block_codes_and_scales(_numpy(codes), _numpy(scales), ggml_type)
    m, n_blocks = d.shape
    lo = -(2 ** (bits - 1)) if scheme == "symmetric" else 0
    if (scheme, bits) in CODEBOOKS:
        q = _table_indices(q, (scheme, bits))
    codes8 = q.astype(np.int8, copy=False).view(np.uint8).reshape(m, n_blocks, QK)  # two's complement bytes
    out = np.empty((m, n_blocks, GGML_QUANT_SIZES[ggml_type][1]), dtype=np.uint8)  # filled field by field
    out[:, :, 0:2] = _fp16_bytes(d)
    pos = 2
    if scheme == "affine":
        if mins is None:
            raise LatticeNotRepresentable(f"{ggml_type.name} needs a min per block")
        block_mins = _numpy(mins)
        out[:, :, 2:4] = _fp16_bytes(np.repeat(block_mins, n_blocks // block_mins.shape[1], axis=1))
        pos = 4
    if bits == 8:
        out[:, :, pos:] = codes8
        return out.reshape(m, -1)
    if bits == 5:
        u = codes8 - np.uint8(lo % 256)  # the unsigned code, modulo 256
        out[:, :, pos:pos + 4] = _bit_plane(u, 4)
        pos += 4
        nibbles = u[:, :, QK // 2:] << np.uint8(4)  # the fifth bit shifts out of the byte: it went to the plane
        nibbles |= u[:, :, : QK // 2] & np.uint8(0x0F)
        out[:, :, pos:] = nibbles
        return out.reshape(m, -1)
    # 4 bits: byte = (low - lo) + 16 (high - lo) = low + 16 high - 17 lo; exact modulo 256, and the true byte is in
    # 0..255 (codes are range-checked), so uint8 wrap-around arithmetic gives it. Computed in a contiguous buffer
    # and copied into the blocks once: ufuncs on the 16-of-18-byte strided view ran twice as slow.
    payload = codes8[:, :, QK // 2:] << np.uint8(4)
    payload += codes8[:, :, : QK // 2]
    payload += np.uint8((-17 * lo) % 256)
    out[:, :, pos:] = payload
    return out.reshape(m, -1)


def _block_codes_and_scales(q: np.ndarray, s: np.ndarray, ggml_type: GGMLType) -> tuple[np.ndarray, np.ndarray]:
    """Validate a one-level lattice for ``ggml_type``; (codes [m, n], fp16 scale per 32-block [m, n/32])."""
    name = ggml_type.name
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
    scheme, bits, _ = LATTICE_OF_TYPE[ggml_type]
    lo, hi = (-(2 ** (bits - 1)), 2 ** (bits - 1) - 1) if scheme == "symmetric" else (0, 2**bits - 1)
    table = CODEBOOKS.get((scheme, bits))
    if table is not None:
        lo, hi = table[0], table[-1]
    if q.size and (int(q.min()) < lo or int(q.max()) > hi):
        raise LatticeNotRepresentable(f"codes span [{int(q.min())}, {int(q.max())}], outside {name}'s [{lo}, {hi}]")
    if table is not None and q.size and not np.isin(q, table).all():
        raise LatticeNotRepresentable(f"codes other than {name}'s table values {list(table)}")
    if not np.isfinite(s).all():
        raise LatticeNotRepresentable("scales contain inf or nan")
    return q, np.repeat(s, group // QK, axis=1)


def _index_of_code(table: tuple[int, ...]) -> np.ndarray:
    """uint8 [256]: code + 128 -> its index in ``table`` (0xFF where the code is none of its values)."""
    index = np.full(256, 0xFF, dtype=np.uint8)
    index[np.array(table) + 128] = np.arange(len(table), dtype=np.uint8)
    return index


_INDEX_OF_CODE = {key: _index_of_code(table) for key, table in CODEBOOKS.items()}


def _table_indices(codes: np.ndarray, key: tuple[str, int]) -> np.ndarray:
    """The table index of each code of a codebook lattice (the codes were checked to be table values): what its
    blocks store."""
    return _INDEX_OF_CODE[key][codes.astype(np.int16) + 128]


def _pack_k(u: np.ndarray, params: dict[str, np.ndarray], ggml_type: GGMLType) -> np.ndarray:
    m, n = u.shape
    supers = n // K_SUPER_BLOCK
    u = u.astype(np.uint8).reshape(m, supers, K_SUPER_BLOCK)
    d = _fp16_bytes(params["scales"])
    if ggml_type == GGMLType.IQ4_XS:
        e = (params["sub_scales"].astype(np.int16) + Q3_K_SCALE_BIAS).astype(np.uint8).reshape(m, supers, 8)
        scales_l = (e[..., 0::2] & np.uint8(0x0F)) | ((e[..., 1::2] & np.uint8(0x0F)) << np.uint8(4))
        top = (e >> np.uint8(4)).astype(np.uint16) << (2 * np.arange(8, dtype=np.uint16))
        scales_h = np.ascontiguousarray(np.bitwise_or.reduce(top, axis=2).astype("<u2")).view(np.uint8)
        halves = u.reshape(m, supers, 8, 2, 16)
        qs = (halves[:, :, :, 0] | (halves[:, :, :, 1] << np.uint8(4))).reshape(m, supers, 128)
        return np.concatenate([d, scales_h.reshape(m, supers, 2), scales_l, qs], axis=2).reshape(m, -1)
    if ggml_type in (GGMLType.Q3_K, GGMLType.Q2_K):
        qs = _two_bit_planes(u & np.uint8(3))
        if ggml_type == GGMLType.Q2_K:
            sc = (params["sub_scales"] | (params["sub_mins"] << np.uint8(4))).reshape(m, supers, 16)
            return np.concatenate([sc, qs, d, _fp16_bytes(params["mins"])], axis=2).reshape(m, -1)
        high = (u >> np.uint8(2)).reshape(m, supers, 8, 32)
        hmask = np.bitwise_or.reduce(high << np.arange(8, dtype=np.uint8)[None, None, :, None], axis=2)
        e = (params["sub_scales"].astype(np.int16) + Q3_K_SCALE_BIAS).astype(np.uint8).reshape(m, supers, 16)
        low = (e[..., :8] & np.uint8(0x0F)) | ((e[..., 8:] & np.uint8(0x0F)) << np.uint8(4))
        top = (e >> np.uint8(4)).reshape(m, supers, 4, 4)  # [.., pair k, byte i] = top bits of group 4 k + i
        top = np.bitwise_or.reduce(top << (2 * np.arange(4, dtype=np.uint8))[None, None, :, None], axis=2)
        return np.concatenate([hmask, qs, low, top, d], axis=2).reshape(m, -1)
    if ggml_type == GGMLType.Q6_K:
        half = u.reshape(m, supers, 2, 128)
        low = half & np.uint8(0x0F)
        ql = (low[..., :64] | (low[..., 64:] << np.uint8(4))).reshape(m, supers, 128)
        high = (half >> np.uint8(4)).reshape(m, supers, 2, 4, 32)
        qh = (high[:, :, :, 0] | high[:, :, :, 1] << np.uint8(2) | high[:, :, :, 2] << np.uint8(4)
              | high[:, :, :, 3] << np.uint8(6)).reshape(m, supers, 64)
        sc = params["sub_scales"].astype(np.int8).view(np.uint8).reshape(m, supers, 16)
        return np.concatenate([ql, qh, sc, d], axis=2).reshape(m, -1)
    scales = _k_scales_bytes(params["sub_scales"].reshape(m, supers, 8), params["sub_mins"].reshape(m, supers, 8))
    pairs = (u & np.uint8(0x0F)).reshape(m, supers, 4, 2, 32)
    qs = (pairs[:, :, :, 0] | (pairs[:, :, :, 1] << np.uint8(4))).reshape(m, supers, 128)
    fields = [d, _fp16_bytes(params["mins"]), scales]
    if ggml_type == GGMLType.Q5_K:
        bits = (u >> np.uint8(4)).reshape(m, supers, 8, 32)
        fields.append(np.bitwise_or.reduce(bits << np.arange(8, dtype=np.uint8)[None, None, :, None], axis=2))
    fields.append(qs)
    return np.concatenate(fields, axis=2).reshape(m, -1)


def _two_bit_planes(u: np.ndarray) -> np.ndarray:
    """2-bit values [m, S, 256] as Q2_K / Q3_K's 64 bytes qs per super-block: byte 32 h + l holds values
    128 h + 32 k + l at bit pair k."""
    m, supers, _ = u.shape
    parts = u.reshape(m, supers, 2, 4, 32)
    return (parts[:, :, :, 0] | parts[:, :, :, 1] << np.uint8(2) | parts[:, :, :, 2] << np.uint8(4)
            | parts[:, :, :, 3] << np.uint8(6)).reshape(m, supers, 64)


def _from_two_bit_planes(qs: np.ndarray) -> np.ndarray:
    """Q2_K / Q3_K's qs [m, S, 64] -> the 2-bit values [m, S, 256]."""
    m, supers, _ = qs.shape
    shifts = (2 * np.arange(4, dtype=np.uint8))[None, None, None, :, None]
    return ((qs.reshape(m, supers, 2, 1, 32) >> shifts) & np.uint8(3)).reshape(m, supers, 256)


def _k_scales_bytes(sc: np.ndarray, mn: np.ndarray) -> np.ndarray:
    """The 12 bytes holding eight 6-bit scale codes and eight 6-bit min codes (ggml's get_scale_min_k4, inverted)."""
    sc, mn = sc.astype(np.uint8), mn.astype(np.uint8)
    first = sc[..., :4] | ((sc[..., 4:] >> np.uint8(4)) << np.uint8(6))
    second = mn[..., :4] | ((mn[..., 4:] >> np.uint8(4)) << np.uint8(6))
    third = (sc[..., 4:] & np.uint8(0x0F)) | ((mn[..., 4:] & np.uint8(0x0F)) << np.uint8(4))
    return np.concatenate([first, second, third], axis=-1)


# ------------------------------------------------------------------------------------------------ grid types
def _pack_grid(codes: np.ndarray, d: np.ndarray, sc: np.ndarray, ggml_type: GGMLType) -> np.ndarray:
    """IQ3_S / IQ3_XXS / IQ2_S / IQ2_XS blocks of codes on the type's grid (checked), fp16 d [m, S] and 4-bit scale
    codes [m, G] (module docstring of grid.py; layouts in ggml-common.h)."""
    m, n = codes.shape
    supers = n // K_SUPER_BLOCK
    grid = spec_for_type(ggml_type).grid
    index = grid_indices(codes, grid).reshape(m, supers, -1)  # [m, S, runs]
    signs = np.packbits(codes.reshape(m, supers, -1, SIGN_RUN) < 0, axis=3, bitorder="little").reshape(m, supers, -1)
    sc = sc.astype(np.uint8).reshape(m, supers, -1)
    nibbles = sc[..., 0::2] | (sc[..., 1::2] << np.uint8(4))  # two scale codes per byte, the first low
    d = _fp16_bytes(d)
    if ggml_type == GGMLType.IQ3_S:  # d, 64 low index bytes, 8 bytes of ninth bits, 32 sign bytes, 4 scale bytes
        high = np.packbits((index >> 8).astype(np.uint8), axis=2, bitorder="little")
        fields = [d, (index & 0xFF).astype(np.uint8), high, signs, nibbles]
    elif ggml_type == GGMLType.IQ2_S:  # d, 32 low index bytes, 32 sign bytes, 8 bytes of 2-bit highs, 8 scale bytes
        high = ((index >> 8).astype(np.uint8).reshape(m, supers, 8, 4) << (2 * np.arange(4, dtype=np.uint8)))
        fields = [d, (index & 0xFF).astype(np.uint8), signs, np.bitwise_or.reduce(high, axis=3), nibbles]
    elif ggml_type == GGMLType.IQ2_XS:  # d, 32 uint16 (9-bit index | 7 signs << 9), 8 scale bytes
        words = (index.astype(np.uint16) | ((signs & np.uint8(0x7F)).astype(np.uint16) << 9)).astype("<u2")
        fields = [d, np.ascontiguousarray(words).view(np.uint8), nibbles]
    else:  # IQ3_XXS: d, 64 index bytes, 8 uint32 per group of 32 (four 7-bit sign runs | scale code << 28)
        runs = (signs & np.uint8(0x7F)).astype(np.uint32).reshape(m, supers, 8, 4) << (7 * np.arange(4, dtype=np.uint32))
        words = np.bitwise_or.reduce(runs, axis=3) | (sc.astype(np.uint32) << 28)
        fields = [d, index.astype(np.uint8), np.ascontiguousarray(words.astype("<u4")).view(np.uint8)]
    return np.concatenate([f.reshape(m, supers, -1) for f in fields], axis=2).reshape(m, -1)


def _unpack_grid(raw: np.ndarray, ggml_type: GGMLType) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """Signed grid codes [m, n] and {scales, sub_scales} of grid-type blocks raw [m, S, type size]."""
    m, supers, _ = raw.shape
    grid = spec_for_type(ggml_type).grid
    fields = raw[:, :, 2:]
    if ggml_type == GGMLType.IQ3_S:
        low, high, signs, nibbles = np.split(fields, [64, 72, 104], axis=2)
        index = low.astype(np.int64) | (np.unpackbits(high, axis=2, bitorder="little").astype(np.int64) << 8)
    elif ggml_type == GGMLType.IQ2_S:
        low, signs, high, nibbles = np.split(fields, [32, 64, 72], axis=2)
        high = (high[..., None] >> (2 * np.arange(4, dtype=np.uint8))) & np.uint8(3)
        index = low.astype(np.int64) | (high.reshape(m, supers, 32).astype(np.int64) << 8)
    elif ggml_type == GGMLType.IQ2_XS:
        words, nibbles = np.ascontiguousarray(fields[..., :64]).view("<u2"), fields[..., 64:]
        index, signs = (words & 511).astype(np.int64), _implied_parity((words >> 9).astype(np.uint8))
    else:
        low, words = fields[..., :64], np.ascontiguousarray(fields[..., 64:]).view("<u4")
        index = low.astype(np.int64)
        runs = ((words[..., None] >> (7 * np.arange(4, dtype=np.uint32))) & 0x7F).astype(np.uint8)
        signs = _implied_parity(runs.reshape(m, supers, 32))
        nibbles = None
        sc = (words >> 28).astype(np.int8)
    if nibbles is not None:
        sc = np.stack([nibbles & np.uint8(0x0F), nibbles >> np.uint8(4)], axis=3).reshape(m, supers, -1)
    magnitudes = grid.points[index].astype(np.int8).reshape(m, -1)
    negative = np.unpackbits(np.ascontiguousarray(signs), axis=2, bitorder="little").reshape(m, -1).astype(bool)
    codes = np.where(negative, -magnitudes, magnitudes).astype(np.int8)
    return codes, {"scales": _fp16_of(raw[:, :, 0:2]), "sub_scales": sc.astype(np.int8).reshape(m, -1)}


def _implied_parity(seven: np.ndarray) -> np.ndarray:
    """Sign bytes from 7 stored signs: the eighth bit set where the seven hold an odd count (ggml's ksigns_iq2xs)."""
    odd = np.unpackbits(seven[..., None], axis=-1).sum(axis=-1) % 2
    return seven | (odd.astype(np.uint8) << np.uint8(7))


# ---------------------------------------------------------------------------------------------------- unpacking
def unpack(blocks: np.ndarray, ggml_type: GGMLType) -> QuantizedWeight:
    """The lattice held by ``ggml_type`` blocks uint8 [m, row bytes] (one-level types at group 32)."""
    block_size, type_size = GGML_QUANT_SIZES[ggml_type]
    m = blocks.shape[0]
    raw = np.ascontiguousarray(blocks).reshape(m, -1, type_size)
    spec = spec_for_type(ggml_type)
    if ggml_type in GRID_TYPES:
        codes, params = _unpack_grid(raw, ggml_type)
        return QuantizedWeight(torch.from_numpy(codes).reshape(m, -1), spec=spec,
                               **{k: torch.from_numpy(v) for k, v in params.items()})
    if ggml_type in K_TYPES:
        codes, params = _unpack_k(raw, ggml_type)
    else:
        codes, params = _unpack_one_level(raw, ggml_type)
    if spec.codebook is not None:
        values = np.array(spec.codebook, dtype=np.int8)[codes]
    else:
        values = (codes.astype(np.int16) + spec.qmin).astype(np.int8)
    return QuantizedWeight(torch.from_numpy(values).reshape(m, -1), spec=spec,
                           **{k: torch.from_numpy(v) for k, v in params.items()})


def _unpack_one_level(raw: np.ndarray, ggml_type: GGMLType) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    scheme, bits, _ = LATTICE_OF_TYPE[ggml_type]
    m, n_blocks, _ = raw.shape
    params = {"scales": _fp16_of(raw[:, :, 0:2])}
    pos = 2
    if scheme == "affine":
        params["mins"], pos = _fp16_of(raw[:, :, 2:4]), 4
    if bits == 8:
        return raw[:, :, pos:].view(np.int8).astype(np.int16) + 128, params  # unsigned code = q - qmin
    high = None
    if bits == 5:
        high, pos = _from_bit_plane(raw[:, :, pos:pos + 4]), pos + 4
    qs = raw[:, :, pos:]
    u = np.concatenate([qs & np.uint8(0x0F), qs >> np.uint8(4)], axis=2)
    if high is not None:
        u = u | (high << np.uint8(4))
    return u, params


def _unpack_k(raw: np.ndarray, ggml_type: GGMLType) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    m, supers, _ = raw.shape
    if ggml_type == GGMLType.IQ4_XS:
        scales_h = np.ascontiguousarray(raw[:, :, 2:4]).view("<u2").astype(np.uint16)  # [m, S, 1]
        top = ((scales_h >> (2 * np.arange(8, dtype=np.uint16))) & np.uint16(3)).astype(np.uint8)  # [m, S, 8]
        scales_l = raw[:, :, 4:8]
        low = np.stack([scales_l & np.uint8(0x0F), scales_l >> np.uint8(4)], axis=3).reshape(m, supers, 8)
        e = low | (top << np.uint8(4))
        qs = raw[:, :, 8:136].reshape(m, supers, 8, 16)
        u = np.concatenate([qs & np.uint8(0x0F), qs >> np.uint8(4)], axis=3)
        params = {"scales": _fp16_of(raw[:, :, 0:2]),
                  "sub_scales": (e.astype(np.int8) - np.int8(Q3_K_SCALE_BIAS)).reshape(m, -1)}
        return u.reshape(m, -1), params
    if ggml_type == GGMLType.Q2_K:
        sc = raw[:, :, :16]
        u = _from_two_bit_planes(raw[:, :, 16:80])
        params = {"scales": _fp16_of(raw[:, :, 80:82]), "mins": _fp16_of(raw[:, :, 82:84]),
                  "sub_scales": (sc & np.uint8(0x0F)).reshape(m, -1), "sub_mins": (sc >> np.uint8(4)).reshape(m, -1)}
        return u.reshape(m, -1), params
    if ggml_type == GGMLType.Q3_K:
        hmask = raw[:, :, :32].reshape(m, supers, 1, 32)
        high = ((hmask >> np.arange(8, dtype=np.uint8)[None, None, :, None]) & np.uint8(1)).reshape(m, supers, 256)
        u = _from_two_bit_planes(raw[:, :, 32:96]) | (high << np.uint8(2))
        low = raw[:, :, 96:104]
        low = np.concatenate([low & np.uint8(0x0F), low >> np.uint8(4)], axis=2)  # groups 0..7, then 8..15
        top = (raw[:, :, 104:108].reshape(m, supers, 1, 4) >> (2 * np.arange(4, dtype=np.uint8))[None, None, :, None]
               ) & np.uint8(3)  # [.., pair k, byte i]: group 4 k + i
        e = low | (top.reshape(m, supers, 16) << np.uint8(4))
        params = {"scales": _fp16_of(raw[:, :, 108:110]),
                  "sub_scales": (e.astype(np.int8) - np.int8(Q3_K_SCALE_BIAS)).reshape(m, -1)}
        return u.reshape(m, -1), params
    if ggml_type == GGMLType.Q6_K:
        ql, qh = raw[:, :, :128].reshape(m, supers, 2, 64), raw[:, :, 128:192].reshape(m, supers, 2, 1, 32)
        low = np.concatenate([ql & np.uint8(0x0F), ql >> np.uint8(4)], axis=3)  # [.., 2, 128]
        high = ((qh >> (np.arange(4, dtype=np.uint8) * 2)[None, None, None, :, None]) & np.uint8(3)).reshape(
            m, supers, 2, 128)
        u = (low | (high << np.uint8(4))).reshape(m, -1)
        params = {"scales": _fp16_of(raw[:, :, 208:210]),
                  "sub_scales": raw[:, :, 192:208].view(np.int8).reshape(m, -1).copy()}
        return u, params
    b = raw[:, :, 4:16]
    sc = np.concatenate([b[..., :4] & 0x3F, (b[..., 8:] & 0x0F) | ((b[..., :4] >> 6) << 4)], axis=2)
    mn = np.concatenate([b[..., 4:8] & 0x3F, (b[..., 8:] >> 4) | ((b[..., 4:8] >> 6) << 4)], axis=2)
    pos = 16
    high = None
    if ggml_type == GGMLType.Q5_K:
        qh = raw[:, :, 16:48].reshape(m, supers, 1, 32)
        high = ((qh >> np.arange(8, dtype=np.uint8)[None, None, :, None]) & np.uint8(1)).reshape(m, supers, 256)
        pos = 48
    qs = raw[:, :, pos:pos + 128].reshape(m, supers, 4, 1, 32)
    u = np.concatenate([qs & np.uint8(0x0F), qs >> np.uint8(4)], axis=3).reshape(m, supers, 256)
    if high is not None:
        u = u | (high << np.uint8(4))
    params = {"scales": _fp16_of(raw[:, :, 0:2]), "mins": _fp16_of(raw[:, :, 2:4]),
              "sub_scales": sc.reshape(m, -1).astype(np.uint8), "sub_mins": mn.reshape(m, -1).astype(np.uint8)}
    return u.reshape(m, -1), params


# ------------------------------------------------------------------------------------------------------ helpers
def _numpy(a: Any) -> np.ndarray:
    """numpy view of a numpy array or a (CPU) torch tensor."""
    if isinstance(a, torch.Tensor):
        a = a.detach().cpu().numpy()
    return np.ascontiguousarray(a)


def _fp16_bytes(d: np.ndarray) -> np.ndarray:
    """fp16 values [m, B] -> their little-endian bytes [m, B, 2]."""
    return np.ascontiguousarray(d.astype("<f2")).view(np.uint8).reshape(*d.shape, 2)


def _fp16_of(b: np.ndarray) -> np.ndarray:
    """[m, B, 2] little-endian bytes -> fp16 [m, B]."""
    return np.ascontiguousarray(b).view("<f2").reshape(b.shape[:2]).astype(np.float16)


def _bit_plane(u: np.ndarray, bit: int) -> np.ndarray:
    """Bit ``bit`` of 32 values [m, B, 32] as one little-endian uint32 per block: [m, B, 4] bytes (value j is bit
    j % 8 of byte j // 8, which is packbits' little bit order)."""
    return np.packbits((u >> np.uint8(bit)) & np.uint8(1), axis=2, bitorder="little")


def _from_bit_plane(b: np.ndarray) -> np.ndarray:
    """[m, B, 4] bytes of a little-endian uint32 -> its 32 bits [m, B, 32] as uint8."""
    return np.unpackbits(np.ascontiguousarray(b), axis=2, bitorder="little")


# ------------------------------------------------------------------------------------------------ stored blocks
# the fp16 fields of each type's block (byte offsets): d, and dmin / m where the type has one
FP16_FIELDS: dict[GGMLType, tuple[int, ...]] = {
    GGMLType.Q4_0: (0,), GGMLType.Q5_0: (0,), GGMLType.Q8_0: (0,), GGMLType.Q4_1: (0, 2), GGMLType.Q5_1: (0, 2),
    GGMLType.Q4_K: (0, 2), GGMLType.Q5_K: (0, 2), GGMLType.Q6_K: (208,), GGMLType.Q3_K: (108,),
    GGMLType.Q2_K: (80, 82), GGMLType.IQ4_NL: (0,), GGMLType.IQ4_XS: (0,),
    **{t: (0,) for t in GRID_TYPES},
}
FP16_EXPONENT = 0x7C00  # all exponent bits set: inf or nan


@functools.lru_cache(maxsize=None)  # specs are frozen and few; asked once per tensor per export
def native_type(spec: LatticeSpec) -> GGMLType | None:
    """The ggml type whose blocks are this lattice exactly, group for group (a symmetric lattice of wider groups
    fits Q4_0 too, but only by repeating its scales: that one is not native), or None."""
    t = type_for_spec(spec)
    return t if t is not None and spec == spec_for_type(t) else None


def block_matrix_shape(ggml_type: GGMLType, shape: tuple[int, int]) -> tuple[int, int]:
    """[m, row bytes]: how a [m, n] matrix is stored as ``ggml_type`` blocks."""
    block_size, type_size = GGML_QUANT_SIZES[ggml_type]
    return shape[0], shape[1] // block_size * type_size


def check_block_scales(blocks: np.ndarray, ggml_type: GGMLType) -> None:
    """Raise ValueError unless every fp16 field of the blocks is finite. Every other bit pattern of a block is a code
    of the lattice, so with the shape this is the whole check. It reads every cache line of the blocks (a d every 18
    bytes): 3 ms for whisper base."""
    raw = blocks.reshape(-1, GGML_QUANT_SIZES[ggml_type][1])
    for offset in FP16_FIELDS[ggml_type]:
        bits = raw[:, offset:offset + 2].view("<u2")
        if bits.size and (bits & 0x7FFF).max() >= FP16_EXPONENT:  # exponent all ones, whatever the sign
            raise ValueError(f"{ggml_type.name} blocks hold an inf or nan scale")
