"""Compiled loops behind f16_values.py (numba; compiled on first use and cached on disk): float32 values, or ggml
blocks decoded in the dequantizer's arithmetic, rounded to fp16, with the values that rounding changed counted.

Rounding is the processor's own conversion (LLVM's fptrunc to half: F16C's vcvtps2ph on x86, fcvt on ARM): round
to nearest even, NaN made quiet with the top of its payload kept -- what torch's conversion gives, bit for bit
(tests/test_f16_values.py). Numba has no fp16 type on the CPU, so two intrinsics reach the instruction directly.

Each ``decode_*`` kernel takes one type's blocks ``raw`` uint8 [blocks, type size] (decode_blocks_of_32 and
decode_k_affine: of the types their flags name) and fills ``out`` uint16
[blocks * block size] with the fp16 bits of exactly what ``ggml_types.unpack(...).dequantize()`` gives: the unsigned
code u, the code q = u + qmin, then q * s (and + o) as two float32 roundings, with s = d * sc and o = -(dmin * mn)
for the K-quants (Q3_K: sc = e - 32 of its 6-bit e, and q = u - 4; IQ4_NL: q = table[u]; IQ4_XS both). Every
operand is made float32 before it meets another, so numba computes in float32 as the reference does. The byte layouts are those of
ggml_types.py's docstring.

numpy and torch do the same decoding as a dozen passes over whole-matrix temporaries; a kernel reads each block once
and keeps its values in registers, which is what keeps an F16 export of a checkpoint within reach of its I/O floor
(bench/export).
"""
from __future__ import annotations

import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.extending import intrinsic

__all__ = ["to_f16"]

_kernel = numba.njit(nogil=True, cache=True, boundscheck=False)


@intrinsic
def _fp16_bits(typingctx, value):  # noqa: ANN001, ANN202 - numba's intrinsic protocol
    """float32 -> the bits of the nearest fp16 (uint16)."""
    if value != types.float32:
        return None

    def codegen(context, builder, signature, args):  # noqa: ANN001, ANN202
        return builder.bitcast(builder.fptrunc(args[0], ir.HalfType()), ir.IntType(16))

    return types.uint16(types.float32), codegen


@intrinsic
def _fp16_value(typingctx, bits):  # noqa: ANN001, ANN202
    """fp16 bits (uint16) -> their value as float32 (exact)."""
    if bits != types.uint16:
        return None

    def codegen(context, builder, signature, args):  # noqa: ANN001, ANN202
        return builder.fpext(builder.bitcast(args[0], ir.HalfType()), ir.FloatType())

    return types.float32(types.uint16), codegen


@_kernel
def _store(out: np.ndarray, i: int, value: np.float32) -> int:
    """``value`` rounded into ``out[i]``; 1 if that changed it (NaN, which stays NaN, not counted)."""
    bits = _fp16_bits(value)
    out[i] = bits
    return (_fp16_value(bits) != value) & (value == value)


@_kernel
def to_f16(values: np.ndarray, out: np.ndarray) -> int:
    """float32 ``values`` rounded into fp16 bits ``out``; how many changed."""
    changed = 0
    for i in range(values.shape[0]):
        changed += _store(out, i, values[i])
    return changed


@_kernel
def _fp16_at(raw: np.ndarray, b: int, at: int) -> np.float32:
    """The fp16 field at byte ``at`` of block ``b`` (little-endian), as float32."""
    return _fp16_value(np.uint16(np.uint16(raw[b, at]) | (np.uint16(raw[b, at + 1]) << np.uint16(8))))


@_kernel
def _fifth_bits(raw: np.ndarray, b: int, at: int) -> np.int64:
    """Q5_0 / Q5_1's qh: bit j of this little-endian uint32 is bit 4 of value j."""
    return (np.int64(raw[b, at]) | (np.int64(raw[b, at + 1]) << 8) | (np.int64(raw[b, at + 2]) << 16)
            | (np.int64(raw[b, at + 3]) << 24))


@_kernel
def decode_blocks_of_32(raw: np.ndarray, out: np.ndarray, with_min: bool, with_fifth_bit: bool) -> int:
    """Q4_0 / Q4_1 / Q5_0 / Q5_1: d (and m), then Q5's 32 fifth bits, then 16 bytes of nibbles, value j in the low
    nibble of byte j and value 16 + j in its high one. Symmetric types: q * d with q = u - 2^(bits-1); with a min:
    u * d + m (two roundings). The symmetric product gets no "+ 0": that would turn a -0.0 into +0.0."""
    qmin = 0 if with_min else (-16 if with_fifth_bit else -8)
    high_at = 4 if with_min else 2
    nibbles_at = high_at + (4 if with_fifth_bit else 0)
    changed = 0
    for b in range(raw.shape[0]):
        d = _fp16_at(raw, b, 0)
        m = _fp16_at(raw, b, 2) if with_min else np.float32(0)
        high = _fifth_bits(raw, b, high_at) if with_fifth_bit else np.int64(0)
        for j in range(16):
            x = np.int64(raw[b, nibbles_at + j])
            low = np.float32(((x & 15) | (((high >> j) & 1) << 4)) + qmin) * d
            up = np.float32(((x >> 4) | (((high >> (j + 16)) & 1) << 4)) + qmin) * d
            changed += _store(out, 32 * b + j, low + m if with_min else low)
            changed += _store(out, 32 * b + 16 + j, up + m if with_min else up)
    return changed


@_kernel
def decode_q8_0(raw: np.ndarray, out: np.ndarray) -> int:
    changed = 0
    for b in range(raw.shape[0]):
        d = _fp16_at(raw, b, 0)
        for j in range(32):
            changed += _store(out, 32 * b + j, np.float32(np.int8(raw[b, 2 + j])) * d)
    return changed


@_kernel
def _k_scale_min(raw: np.ndarray, b: int, g: int) -> tuple[np.float32, np.float32]:
    """The 6-bit (sc, mn) of group g of a Q4_K / Q5_K block (ggml's get_scale_min_k4), as float32."""
    if g < 4:
        sc = np.int64(raw[b, 4 + g]) & 63
        mn = np.int64(raw[b, 8 + g]) & 63
    else:
        sc = (np.int64(raw[b, 8 + g]) & 15) | ((np.int64(raw[b, g]) >> 6) << 4)
        mn = (np.int64(raw[b, 8 + g]) >> 4) | ((np.int64(raw[b, 4 + g]) >> 6) << 4)
    return np.float32(sc), np.float32(mn)


@_kernel
def decode_k_affine(raw: np.ndarray, out: np.ndarray, with_fifth_bit: bool) -> int:
    nibbles = 48 if with_fifth_bit else 16  # Q5_K keeps 32 bytes of fifth bits between the scales and the nibbles
    changed = 0
    for b in range(raw.shape[0]):
        d, dmin = _fp16_at(raw, b, 0), _fp16_at(raw, b, 2)
        for g in range(8):  # groups of 32; two groups share the bytes of a 64-value chunk, low and high nibbles
            sc, mn = _k_scale_min(raw, b, g)
            s = d * sc
            o = -(dmin * mn)
            chunk, upper = g // 2, g % 2
            for j in range(32):
                u = (np.int64(raw[b, nibbles + 32 * chunk + j]) >> (4 * upper)) & 15
                if with_fifth_bit:
                    u |= ((np.int64(raw[b, 16 + j]) >> g) & 1) << 4
                changed += _store(out, 256 * b + 32 * g + j, np.float32(u) * s + o)
    return changed


@_kernel
def decode_q6_k(raw: np.ndarray, out: np.ndarray) -> int:
    changed = 0
    for b in range(raw.shape[0]):
        d = _fp16_at(raw, b, 208)
        for i in range(256):
            half, k = i // 128, i % 128  # k: the position within the half
            low = (np.int64(raw[b, 64 * half + k % 64]) >> (4 * (k // 64))) & 15
            high = (np.int64(raw[b, 128 + 32 * half + k % 32]) >> (2 * (k // 32))) & 3
            s = d * np.float32(np.int8(raw[b, 192 + i // 16]))
            changed += _store(out, 256 * b + i, np.float32((low | (high << 4)) - 32) * s)
    return changed


@_kernel
def _two_bit_code(raw: np.ndarray, b: int, at: int, i: int) -> np.int64:
    """The 2-bit code of value i of a Q2_K / Q3_K block whose 64 bytes qs start at byte ``at``: per half of 128
    values, byte 32 half + l holds values l, 32 + l, 64 + l, 96 + l at bit pairs 0, 2, 4, 6."""
    half, k = i // 128, i % 128
    return (np.int64(raw[b, at + 32 * half + k % 32]) >> (2 * (k // 32))) & 3


@_kernel
def decode_q2_k(raw: np.ndarray, out: np.ndarray) -> int:
    changed = 0
    for b in range(raw.shape[0]):
        d, dmin = _fp16_at(raw, b, 80), _fp16_at(raw, b, 82)
        for g in range(16):  # groups of 16; byte g: scale code | min code << 4
            s = d * np.float32(np.int64(raw[b, g]) & 15)
            o = -(dmin * np.float32(np.int64(raw[b, g]) >> 4))
            for j in range(16):
                i = 16 * g + j
                changed += _store(out, 256 * b + i, np.float32(_two_bit_code(raw, b, 16, i)) * s + o)
    return changed


@_kernel
def decode_q3_k(raw: np.ndarray, out: np.ndarray) -> int:
    changed = 0
    for b in range(raw.shape[0]):
        d = _fp16_at(raw, b, 108)
        for g in range(16):  # the 6-bit scale code e = sc + 32: low nibble in bytes 96..103, top bits in 104..107
            low = (np.int64(raw[b, 96 + g % 8]) >> (4 * (g // 8))) & 15
            top = (np.int64(raw[b, 104 + g % 4]) >> (2 * (g // 4))) & 3
            s = d * np.float32((low | (top << 4)) - 32)
            for j in range(16):
                i = 16 * g + j
                high = (np.int64(raw[b, i % 32]) >> (i // 32)) & 1  # hmask: bit i // 32 of byte i % 32
                changed += _store(out, 256 * b + i, np.float32(_two_bit_code(raw, b, 32, i) + 4 * high - 4) * s)
    return changed


@_kernel
def decode_iq4_nl(raw: np.ndarray, out: np.ndarray, table: np.ndarray) -> int:
    """IQ4_NL: d, then 16 bytes of nibbles laid out as Q4_0's; each nibble indexes ``table`` (int8 [16], the
    lattice's codebook) and the value is table[u] * d."""
    changed = 0
    for b in range(raw.shape[0]):
        d = _fp16_at(raw, b, 0)
        for j in range(16):
            x = np.int64(raw[b, 2 + j])
            changed += _store(out, 32 * b + j, np.float32(table[x & 15]) * d)
            changed += _store(out, 32 * b + 16 + j, np.float32(table[x >> 4]) * d)
    return changed


@_kernel
def decode_iq4_xs(raw: np.ndarray, out: np.ndarray, table: np.ndarray) -> int:
    """IQ4_XS: d, scales_h, scales_l, then 8 groups of 16 bytes of nibbles laid out as IQ4_NL's; group g's scale is
    d * (e - 32) with e = its nibble of scales_l | its bit pair of scales_h << 4."""
    changed = 0
    for b in range(raw.shape[0]):
        d = _fp16_at(raw, b, 0)
        scales_h = np.int64(raw[b, 2]) | (np.int64(raw[b, 3]) << 8)
        for g in range(8):
            low = (np.int64(raw[b, 4 + g // 2]) >> (4 * (g % 2))) & 15
            top = (scales_h >> (2 * g)) & 3
            s = d * np.float32((low | (top << 4)) - 32)
            for j in range(16):
                x = np.int64(raw[b, 8 + 16 * g + j])
                changed += _store(out, 256 * b + 32 * g + j, np.float32(table[x & 15]) * s)
                changed += _store(out, 256 * b + 32 * g + 16 + j, np.float32(table[x >> 4]) * s)
    return changed
