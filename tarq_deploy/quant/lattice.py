"""The symmetric b-bit weight lattice of the paper's weight-only uniform quantizer (Preliminaries).

A Linear weight W (m rows = outputs, n columns = inputs) is cut into row-wise groups of ``group_size`` contiguous
input columns (``group_size = -1``: one group per row, i.e. per-channel). Each (row, group) has one scale s and every
weight in it is stored as an integer code q in [-2^(b-1), 2^(b-1) - 1]; the value it stands for is exactly s * q.

Scale rules. The codes span [-2^(b-1), 2^(b-1) - 1]: one more level below zero than above. The paper's symmetric rule
s = 2 max|W| / (2^b - 1) never reaches the lowest code, wasting a level. ggml's rule (Q4_0, Q5_0) uses it: the value of
largest magnitude, with its sign, is mapped onto the lowest code, s = max / -2^(b-1) (s may be negative), so every
group spends all 2^b levels. This is :func:`scales_for` (``"max"``); for 8 bits it is Q8_0's s = max|W| / 127. It cut
every Whisper layer's H-weighted loss by ~19% against the symmetric rule, for RTN, GPTQ and TARQ alike.
:func:`search_scales` (``"search"``) goes further, as ggml's importance-weighted quantizers do (make_qx_quants): a
grid of candidate scales around the max rule, each with its own rounding and least-squares refit, scored by the
importance-weighted error sum_j h_j (w_j - s q_j)^2; the solvers pass the diagonal of their metric as h.

The scale is rounded to float16 *before* the solvers choose codes, so the stored scale is the one the codes were
rounded against and dequantization is exact: every target that holds an fp16 scale and integer codes reproduces
s * q bit for bit. :func:`quantize_rtn` alone follows ggml's reference arithmetic instead (codes rounded against the
float32 scale, halves rounded up), so that our RTN lattice is byte for byte ggml's own Q4_0 rounding.

Scale grid. ``scale_grid="bfloat16"`` (symmetric lattices) keeps every scale on the values exact in *both* bfloat16
and float16: the scale is rounded to bfloat16 first, then to float16 (which that value survives: a bfloat16 value
in float16's normal range has 8 significant bits of float16's 11, and one in its subnormal range lands on a value of
at most 8 significant bits). Runtimes that compute in bfloat16 (Voxtral's dtype; PyTorch's tinygemm INT4 kernel)
then hold the lattice exactly, where a plain fp16 scale would be rounded again. The scales are still stored as fp16.

Schemes. The lattice above is ``scheme="symmetric"`` (ggml Q4_0, Q5_0, Q8_0, and the GPU int4 formats). The other
ggml types are lattices too, each exactly the value set its dequantizer produces; a value is always s * q + o with a
per-group scale s and offset o, computed in float32 in the order gguf-py's dequantizers compute them:

* ``"affine"`` (Q4_1, Q5_1): groups of 32, codes 0..2^b-1, fp16 d and m per group; s = d, o = m.
* ``"k-affine"`` (Q4_K, Q5_K; Q2_K): super-blocks of 256 = 8 groups of 32 (Q2_K: 16 groups of 16), codes
  0..2^b-1, an fp16 d and dmin per super-block and a 6-bit (Q2_K: 4-bit) scale code sc and min code mn per group;
  s = d * sc, o = -(dmin * mn).
* ``"k-symmetric"`` (Q6_K; Q3_K): super-blocks of 256 = 16 groups of 16, codes -2^(b-1)..2^(b-1)-1 (Q6_K -32..31,
  Q3_K -4..3), an fp16 d per super-block and a signed scale code sc per group (Q6_K int8 -128..127, Q3_K 6-bit
  -32..31); s = d * sc, o = 0.
* ``"nonlinear"`` (IQ4_NL): groups of 32, an fp16 d per group and 4-bit indices into a fixed non-uniform table
  of 16 int8 values (ggml's kvalues_iq4nl, -127..113); the codes held are the table's values themselves, so the value
  is d * q exactly as for the symmetric scheme, but only the 16 table values are codes (``LatticeSpec.codebook``).
* ``"k-nonlinear"`` (IQ4_XS): IQ4_NL's table under K-quant scales: super-blocks of 256 = 8 groups of 32, an fp16 d
  per super-block and a signed 6-bit scale code sc (-32..31) per group; s = d * sc, the value s * q with q a table
  value. 4.25 bits per weight against IQ4_NL's 4.5.

* ``"grid-iq3_s"``, ``"grid-iq3_xxs"`` (groups of 32), ``"grid-iq2_s"``, ``"grid-iq2_xs"`` (groups of 16): ggml's
  vector-codebook types (grid.py): an fp16 d per super-block of 256, a 4-bit code sc per group, s = d * (2 sc + 1) *
  factor; the codes are signed grid values, and each run of 4 (IQ2: 8) codes must be a point of the type's grid.

``LatticeSpec.sub_code_range`` gives each K-quant's range of sc (and mn).

Every group parameter is held the way the format stores it (``QuantizedWeight.scales``, ``mins``, ``sub_scales``,
``sub_mins``), so packing copies bits; quant/lattice_fit.py chooses them, and the solvers choose codes against them.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np
import torch

from .choices import SCALE_DTYPES, SCALE_RULES
from .grid import GRIDS, SCALE_CODE_MAX, GridCodebook, check_codes, nearest_points, scale_multipliers

__all__ = ["CODEBOOKS", "CODE_DTYPE", "FP16_MAX", "K_SUPER_BLOCK", "LatticeSpec", "PARAM_FIELDS", "QuantizedWeight",
           "SCALE_DTYPE", "SUPPORTED_BITS", "SUPPORTED_GROUP_SIZES", "check_on_lattice", "choose_scales", "codes_for",
           "dequantize", "effective_scale_offset", "max_rule_scales", "on_scale_grid", "round_codes", "scales_for",
           "search_scales", "searched_scales", "signed_max", "stored_scales"]

SCALE_DTYPE = torch.float16
CODE_DTYPE = torch.int8
SUPPORTED_GROUP_SIZES = (-1, 32, 64, 128)
SUPPORTED_BITS = (2, 3, 4, 5, 6, 7, 8)
GRID_SCHEMES = {f"grid-{name}": grid for name, grid in GRIDS.items()}  # the vector-codebook types (grid.py)
SCHEMES = ("symmetric", "affine", "k-affine", "k-symmetric", "nonlinear", "k-nonlinear", *GRID_SCHEMES)
SCALE_GRIDS = SCALE_DTYPES  # the values a stored (fp16) scale may take (choices.py); see "Scale grid" above
K_SUPER_BLOCK = 256  # values per K-quant super-block (ggml's QK_K)
# (bits, group size) each non-symmetric scheme allows: the ggml types it stores
SCHEME_SHAPES = {"affine": ((4, 32), (5, 32)), "k-affine": ((2, 16), (4, 32), (5, 32)),
                 "k-symmetric": ((3, 16), (6, 16)), "nonlinear": ((4, 32),), "k-nonlinear": ((4, 32),),
                 "grid-iq3_s": ((3, 32),), "grid-iq3_xxs": ((3, 32),), "grid-iq2_s": ((2, 16),),
                 "grid-iq2_xs": ((2, 16),)}
# the codes of a non-uniform lattice, ascending: ggml's kvalues_iq4nl (ggml-common.h), IQ4_NL's 16 levels
IQ4NL_VALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)
CODEBOOKS = {("nonlinear", 4): IQ4NL_VALUES, ("k-nonlinear", 4): IQ4NL_VALUES}  # IQ4_XS: the same table
# make_qx_quants-like grid of a codebook's divisors: the lowest code + k, k = -7..7 (ggml's quantize_iq4_nl, ntry 7)
CODEBOOK_SEARCH_STEPS = tuple(float(k) for k in range(-7, 8))
K_SUB_CODE_MAX = 63  # Q4_K / Q5_K sub-block scale and min codes are 6-bit
# the range of a K-quant's per-group scale (and min) codes under its super-block d (and dmin), by (scheme, bits):
# Q2_K 4-bit, Q4_K / Q5_K 6-bit unsigned; Q3_K and IQ4_XS 6-bit signed (stored + 32), Q6_K int8
K_SUB_CODE_RANGE = {("k-affine", 2): (0, 15), ("k-affine", 4): (0, K_SUB_CODE_MAX),
                    ("k-affine", 5): (0, K_SUB_CODE_MAX), ("k-symmetric", 3): (-32, 31),
                    ("k-symmetric", 6): (-128, 127), ("k-nonlinear", 4): (-32, 31),
                    **{(scheme, bits): (0, SCALE_CODE_MAX) for scheme in GRID_SCHEMES
                       for bits, _ in SCHEME_SHAPES[scheme]}}
PARAM_FIELDS = ("scales", "mins", "sub_scales", "sub_mins")
FP16_MAX = 65504.0
BF16_FP16_MAX = 65280.0  # the largest value exact in both bfloat16 and float16
# make_qx_quants' grid: divisors 2^(b-1) + 0.1 k, k = -9..9, around the max rule (k = 0).
SEARCH_STEPS = tuple(0.1 * k for k in range(-9, 10))
SEARCH_CHUNK_VALUES = 1 << 20  # weights per row chunk of the scale search (three 4 MiB float32 buffers)


@dataclass(frozen=True)
class LatticeSpec:
    """Bit width, grouping and scheme of a lattice (see the module docstring for the schemes)."""

    bits: int = 4
    group_size: int = 128
    scheme: str = "symmetric"
    scale_grid: str = "float16"

    def __post_init__(self) -> None:
        if self.scheme not in SCHEMES:
            raise ValueError(f"lattice scheme must be one of {SCHEMES}, got {self.scheme!r}")
        if self.scale_grid not in SCALE_GRIDS:
            raise ValueError(f"scale grid must be one of {SCALE_GRIDS}, got {self.scale_grid!r}")
        if self.scale_grid != "float16" and self.scheme != "symmetric":
            raise ValueError(f"a {self.scale_grid} scale grid needs the symmetric scheme, not {self.scheme!r}")
        if self.scheme != "symmetric":
            if (self.bits, self.group_size) not in SCHEME_SHAPES[self.scheme]:
                raise ValueError(f"a {self.scheme} lattice has (bits, group size) one of "
                                 f"{SCHEME_SHAPES[self.scheme]}, got ({self.bits}, {self.group_size})")
            return
        if self.bits not in SUPPORTED_BITS:
            raise ValueError(f"bits must be one of {SUPPORTED_BITS}, got {self.bits}")
        if self.group_size not in SUPPORTED_GROUP_SIZES:
            raise ValueError(f"group_size must be one of {SUPPORTED_GROUP_SIZES}, got {self.group_size}")

    @property
    def affine(self) -> bool:
        """Codes are unsigned and every group carries an offset."""
        return self.scheme in ("affine", "k-affine")

    @property
    def two_level(self) -> bool:
        """Group scales are codes under a super-block scale (the K-quants and the grid types)."""
        return self.scheme.startswith("k-") or self.grid is not None

    @property
    def grid(self) -> GridCodebook | None:
        """The vector codebook whose points each run of codes must be (grid.py); None for the other schemes."""
        return GRID_SCHEMES.get(self.scheme)

    @property
    def codebook(self) -> tuple[int, ...] | None:
        """The codes of a non-uniform lattice, ascending; None for the uniform schemes (codes qmin..qmax). A grid
        type's codes are its signed grid values (which runs of them are allowed is the grid's business)."""
        if self.grid is not None:
            return self.grid.codes
        return CODEBOOKS.get((self.scheme, self.bits))

    @property
    def qmin(self) -> int:
        if self.codebook is not None:
            return self.codebook[0]
        return 0 if self.affine else -(2 ** (self.bits - 1))

    @property
    def qmax(self) -> int:
        if self.codebook is not None:
            return self.codebook[-1]
        return 2**self.bits - 1 if self.affine else 2 ** (self.bits - 1) - 1

    @property
    def levels(self) -> int:
        return 2**self.bits - 1

    @property
    def sub_code_range(self) -> tuple[int, int]:
        """(lowest, highest) per-group scale / min code of a K-quant lattice (module docstring)."""
        if not self.two_level:
            raise ValueError(f"a {self.scheme} lattice has no sub-block codes")
        return K_SUB_CODE_RANGE[(self.scheme, self.bits)]

    def group_width(self, n_cols: int) -> int:
        """Columns per group for a matrix with ``n_cols`` inputs."""
        return n_cols if self.group_size == -1 else self.group_size

    def param_width(self, n_cols: int) -> int:
        """Columns whose group parameters are chosen together: a group, or a K-quant super-block."""
        return K_SUPER_BLOCK if self.two_level else self.group_width(n_cols)

    def n_groups(self, n_cols: int) -> int:
        self.check_columns(n_cols)
        return n_cols // self.group_width(n_cols)

    def check_columns(self, n_cols: int) -> None:
        if self.two_level and n_cols % K_SUPER_BLOCK != 0:
            raise ValueError(f"{n_cols} input columns are not a multiple of {K_SUPER_BLOCK}, the K-quant "
                             f"super-block")
        if self.group_size != -1 and n_cols % self.group_size != 0:
            raise ValueError(f"{n_cols} input columns are not a multiple of group size {self.group_size}")


@dataclass
class QuantizedWeight:
    """Integer codes and group parameters of one matrix on a lattice, held as the format stores them;
    ``dequantize()`` gives s * q + o exactly (module docstring).

    ``scales`` are fp16: one per group, or for the K-quants the super-block d. ``mins`` (fp16) are the affine
    offsets m per group, or the K-quant super-block dmin. ``sub_scales`` / ``sub_mins`` are the K-quants' per-group
    codes (uint8 0..63 for Q4_K / Q5_K, 0..15 for Q2_K; ``sub_scales`` int8 for Q6_K, -32..31 for Q3_K and IQ4_XS,
    0..15 for the grid types)."""

    codes: torch.Tensor  # int8 [m, n]
    scales: torch.Tensor  # float16 [m, n_groups] or [m, n / 256]
    spec: LatticeSpec
    mins: torch.Tensor | None = None
    sub_scales: torch.Tensor | None = None
    sub_mins: torch.Tensor | None = None

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.codes.shape)  # type: ignore[return-value]

    def params(self) -> dict[str, torch.Tensor]:
        """The group parameters that are present, by field name."""
        return {k: getattr(self, k) for k in PARAM_FIELDS if getattr(self, k) is not None}

    def scale_offset(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """float32 per-group scale s and offset o ([m, n_groups]; o None for symmetric lattices)."""
        return effective_scale_offset(self.spec, self.params())

    def dequantize(self) -> torch.Tensor:
        s, o = self.scale_offset()
        return dequantize_codes(self.codes, s, o)

    def to(self, device: torch.device | str) -> "QuantizedWeight":
        return QuantizedWeight(self.codes.to(device), spec=self.spec,
                               **{k: v.to(device) for k, v in self.params().items()})


def effective_scale_offset(spec: LatticeSpec, params: dict[str, torch.Tensor]
                           ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-group float32 scale and offset from stored parameters, in the dequantizer's arithmetic: one-level
    schemes read d (and m) as they are; K-quants take s = d * sc and o = -(dmin * mn), one float32 product each
    (exact: an fp16 times a 6- or 8-bit integer needs at most 19 significant bits)."""
    d = params["scales"].float()
    if not spec.two_level:
        return d, (params["mins"].float() if spec.affine else None)
    per_super = params["sub_scales"].shape[1] // d.shape[1]
    if spec.grid is not None:  # d * (2 sc + 1) * factor, exact as gguf-py computes it (grid.py)
        return d.repeat_interleave(per_super, dim=1) * scale_multipliers(params["sub_scales"], spec.grid), None
    s = d.repeat_interleave(per_super, dim=1) * params["sub_scales"].float()
    if not spec.affine:
        return s, None
    o = -(params["mins"].float().repeat_interleave(per_super, dim=1) * params["sub_mins"].float())
    return s, o


def dequantize_codes(codes: torch.Tensor, s: torch.Tensor, o: torch.Tensor | None) -> torch.Tensor:
    """s * q (+ o) per group in float32, as two separate roundings, like gguf-py's numpy dequantizers."""
    m, n = codes.shape
    groups = s.shape[1]
    values = codes.float().reshape(m, groups, n // groups) * s[:, :, None]
    if o is not None:
        values = values + o[:, :, None]
    return values.reshape(m, n)


def _grouped(w: torch.Tensor, spec: LatticeSpec) -> torch.Tensor:
    m, n = w.shape
    width = spec.group_width(n)
    return w.float().reshape(m, n // width, width)


def signed_max(x: torch.Tensor) -> torch.Tensor:
    """The value of largest magnitude in each group of x [m, G, g], with its sign: [m, G]."""
    return x.gather(2, x.abs().argmax(dim=2, keepdim=True)).squeeze(2)


def _max_rule(x: torch.Tensor, spec: LatticeSpec) -> tuple[torch.Tensor, int]:
    """(peak [m, G], top) of the max rule for groups x [m, G, g], whose scale is peak / top: the signed value of
    largest magnitude over the lowest code (ggml Q4_0 / Q5_0), or for 8 bits max|w| over 127 (Q8_0)."""
    if spec.bits == 8:
        return x.abs().amax(dim=2), spec.qmax
    return signed_max(x), spec.qmin


def max_rule_scales(w: torch.Tensor, spec: LatticeSpec) -> torch.Tensor:
    """float32 scales of the max rule for the groups of ``w`` [m, n]: max / -2^(b-1) (8 bits: Q8_0's max|w| / 127)."""
    peak, top = _max_rule(_grouped(w, spec), spec)
    return peak / top


def stored_scales(scales: torch.Tensor, spec: LatticeSpec) -> torch.Tensor:
    """float32 scales as the format stores them: fp16, on the spec's scale grid (module docstring)."""
    if spec.scale_grid == "bfloat16":  # clamped to the largest value of both (65504 would round up to 65536)
        return scales.clamp(-BF16_FP16_MAX, BF16_FP16_MAX).to(torch.bfloat16).to(SCALE_DTYPE)
    return scales.clamp(-FP16_MAX, FP16_MAX).to(SCALE_DTYPE)


def on_scale_grid(scales: torch.Tensor, spec: LatticeSpec) -> bool:
    """True when every stored (fp16) scale is a value of the spec's scale grid."""
    if spec.scale_grid == "float16":
        return True
    return bool(torch.equal(scales.to(torch.bfloat16).to(scales.dtype), scales))


def scales_for(w: torch.Tensor, spec: LatticeSpec) -> torch.Tensor:
    """fp16 max-rule scales for the groups of ``w`` ([m, n] or a single group [m, g]); shape [m, n_groups]."""
    return stored_scales(max_rule_scales(w, spec), spec)


def search_scales(w: torch.Tensor, spec: LatticeSpec, importance: torch.Tensor) -> torch.Tensor:
    """fp16 scales minimising sum_j h_j (w_j - s q_j)^2 per group over make_qx_quants' candidate grid.

    ``importance`` h holds one non-negative weight per column ([n]) or per weight ([m, n]). Each candidate divisor
    gives codes q by rounding; the least-squares scale for those codes, sum h w q / sum h q^2, is the candidate's
    scale, and the one with the smallest error wins (ties: the first, so the max rule's own codes win among equals).
    A group with no importance keeps the max rule."""
    return stored_scales(searched_scales(w, spec, importance), spec)


def searched_scales(w: torch.Tensor, spec: LatticeSpec, importance: torch.Tensor) -> torch.Tensor:
    """:func:`search_scales` before the fp16 rounding (float32 [m, n_groups]): what Q6_K's sub-block scales start
    from before they become codes under the super-block scale.

    Rows are searched in chunks of about SEARCH_CHUNK_VALUES weights into buffers reused across the candidates:
    the same element-wise operations and per-group sums as over the whole matrix at once (so the same scales), but
    the working set stays in cache; for the 51,865-row output head this is ~5x faster than whole-matrix passes."""
    x = _grouped(w, spec)
    h = importance.float().expand(w.shape).reshape(x.shape)
    peak, top = _max_rule(x, spec)
    m, n_groups, width = x.shape
    rows = max(1, SEARCH_CHUNK_VALUES // (n_groups * width))
    buffers = _SearchBuffers(min(rows, m), n_groups, width, x.device)
    return torch.cat([_search_rows(x[r : r + rows], h[r : r + rows], peak[r : r + rows], top, spec, buffers)
                      for r in range(0, m, rows)])


class _SearchBuffers:
    """Three [rows, G, g] float32 work buffers for :func:`_search_rows` (codes, h q, and a product)."""

    def __init__(self, rows: int, n_groups: int, width: int, device: torch.device) -> None:
        self.codes, self.hq, self.product = (torch.empty((rows, n_groups, width), device=device) for _ in range(3))

    def views(self, rows: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.codes[:rows], self.hq[:rows], self.product[:rows]


def _search_rows(x: torch.Tensor, h: torch.Tensor, peak: torch.Tensor, top: int, spec: LatticeSpec,
                 buffers: _SearchBuffers) -> torch.Tensor:
    """The candidate search of :func:`searched_scales` for the groups x [r, G, g] of a chunk of rows."""
    codes, hq, product = buffers.views(x.shape[0])
    best_scale = peak / top
    best_gain = torch.full_like(best_scale, -1.0)
    for step in (SEARCH_STEPS if spec.codebook is None else CODEBOOK_SEARCH_STEPS):
        d = (peak / (top + step * math.copysign(1.0, top))).unsqueeze(2)  # step > 0: the divisor moves outward
        torch.div(x, torch.where(d == 0, torch.ones_like(d), d), out=codes)
        q = _nearest_codes_(codes, spec)
        torch.mul(h, q, out=hq)
        sum_xq = torch.mul(hq, x, out=product).sum(dim=2)
        sum_qq = torch.mul(hq, q, out=product).sum(dim=2)
        gain = torch.where(sum_qq > 0, sum_xq * sum_xq / sum_qq.clamp(min=1e-30), torch.zeros_like(sum_qq))
        better = gain > best_gain
        best_gain = torch.where(better, gain, best_gain)
        best_scale = torch.where(better & (sum_qq > 0), sum_xq / sum_qq.clamp(min=1e-30), best_scale)
    return best_scale


def _nearest_codes_(y: torch.Tensor, spec: LatticeSpec) -> torch.Tensor:
    """:func:`nearest_codes`, in place where the lattice is integer (a codebook's lookup makes a new tensor)."""
    if spec.codebook is None:
        return torch.round(y, out=y).clamp_(spec.qmin, spec.qmax)
    return nearest_codes(y, spec)


def choose_scales(w: torch.Tensor, spec: LatticeSpec, rule: str, importance: torch.Tensor | None) -> torch.Tensor:
    """fp16 scales by ``rule`` ("max" or "search"; search without importance weighs every column alike)."""
    if rule == "max":
        return scales_for(w, spec)
    if rule == "search":
        return search_scales(w, spec, importance if importance is not None else torch.ones(w.shape[1]))
    raise ValueError(f"scale rule must be one of {SCALE_RULES}, got {rule!r}")


def nearest_codes(x: torch.Tensor, spec: LatticeSpec) -> torch.Tensor:
    """The code nearest to each x (float32): round and clamp to the code range, or for a codebook its nearest
    entry (a tie between two entries goes to the lower one)."""
    if spec.codebook is None:
        return torch.round(x).clamp_(spec.qmin, spec.qmax)
    table = torch.tensor(spec.codebook, dtype=torch.float32, device=x.device)
    return table[torch.bucketize(x.contiguous(), (table[1:] + table[:-1]) / 2)]


def round_codes(w: torch.Tensor, s: torch.Tensor, o: torch.Tensor | None, spec: LatticeSpec) -> torch.Tensor:
    """Codes q = round((w - o) / s) clamped to the code range (a codebook's nearest entry), for w and per-weight
    s, o of one shape (float32); a zero scale gives code 0, or the codebook entry nearest 0 (every code then has
    the value o)."""
    safe = torch.where(s == 0, torch.ones_like(s), s)
    q = nearest_codes((w if o is None else w - o) / safe, spec)
    return q.masked_fill_(s == 0, 0.0 if spec.codebook is None else float(min(spec.codebook, key=abs)))


def codes_for(w: torch.Tensor, scales: torch.Tensor, spec: LatticeSpec,
              offsets: torch.Tensor | None = None, importance: torch.Tensor | None = None) -> torch.Tensor:
    """Round ``w`` [m, n] to codes under fixed per-group ``scales`` (fp16, or a float32 effective scale) and
    ``offsets`` [m, n_groups]; a zero scale gives code 0. A grid type takes the nearest grid point of each run,
    weighing its columns by ``importance`` ([n]; None: alike)."""
    width = w.shape[1] // scales.shape[1]
    if spec.grid is not None:
        m, n = w.shape
        h = torch.ones(n) if importance is None else importance.float()
        runs = w.float().reshape(-1, width)  # one row per (row, group)
        h_runs = h.to(w.device).reshape(1, -1, width).expand(m, -1, -1).reshape(-1, width)
        return nearest_points(runs, scales.float().reshape(-1), h_runs, spec.grid).reshape(m, n).to(CODE_DTYPE)
    s = scales.float().repeat_interleave(width, dim=1)
    o = None if offsets is None else offsets.float().repeat_interleave(width, dim=1)
    return round_codes(w.float(), s, o, spec).to(CODE_DTYPE)


def dequantize(codes: torch.Tensor, scales: torch.Tensor, spec: LatticeSpec) -> torch.Tensor:
    """Exact float32 values s * q of a symmetric lattice. Both factors are exact in float32 and so is their
    product."""
    width = codes.shape[1] // scales.shape[1]
    return codes.float() * scales.float().repeat_interleave(width, dim=1)


# the dtype and width (relative to the groups) of each parameter field, by scheme
def _param_layout(spec: LatticeSpec, m: int, n: int) -> dict[str, tuple[torch.dtype, tuple[int, int]]]:
    groups = spec.n_groups(n)
    if not spec.two_level:
        layout = {"scales": (SCALE_DTYPE, (m, groups))}
        if spec.affine:
            layout["mins"] = (SCALE_DTYPE, (m, groups))
        return layout
    supers = (m, n // K_SUPER_BLOCK)
    if not spec.affine:
        return {"scales": (SCALE_DTYPE, supers), "sub_scales": (torch.int8, (m, groups))}
    return {"scales": (SCALE_DTYPE, supers), "mins": (SCALE_DTYPE, supers), "sub_scales": (torch.uint8, (m, groups)),
            "sub_mins": (torch.uint8, (m, groups))}


def check_on_lattice(q: QuantizedWeight) -> None:
    """Raise ValueError unless codes are in range and every group parameter has the dtype and shape the spec's
    format stores (finite fp16 values; 6-bit K-quant sub-block codes)."""
    m, n = q.codes.shape
    if q.codes.dtype != CODE_DTYPE:
        raise ValueError(f"codes must be int8, got {q.codes.dtype}")
    layout = _param_layout(q.spec, m, n)
    present = q.params()
    if sorted(present) != sorted(layout):
        raise ValueError(f"a {q.spec.scheme} lattice holds {sorted(layout)}, got {sorted(present)}")
    for name, (dtype, shape) in layout.items():
        t = present[name]
        if t.dtype != dtype:
            raise ValueError(f"{name} must be {dtype}, got {t.dtype}")
        if tuple(t.shape) != shape:
            raise ValueError(f"{name} shape {tuple(t.shape)} does not fit codes {m}x{n} with {q.spec}")
        if dtype == SCALE_DTYPE and not _all_finite(t):
            raise ValueError(f"{name} contain inf or nan")
        if name == "scales" and not on_scale_grid(t, q.spec):
            raise ValueError(f"scales are not all on the {q.spec.scale_grid} grid the lattice declares")
        if name.startswith("sub_"):
            (lo, hi), (t_lo, t_hi) = q.spec.sub_code_range, _code_span(t)
            if t_lo < lo or t_hi > hi:
                raise ValueError(f"{name} span [{t_lo}, {t_hi}], outside the {q.spec.bits}-bit {q.spec.scheme} "
                                 f"lattice's codes [{lo}, {hi}]")
    lo, hi = _code_span(q.codes)
    if lo < q.spec.qmin or hi > q.spec.qmax:
        raise ValueError(f"codes span [{lo}, {hi}], outside [{q.spec.qmin}, {q.spec.qmax}]")
    if q.spec.grid is not None:
        check_codes(q.codes.cpu().numpy(), q.spec.grid)
    if q.spec.codebook is not None:
        values = q.codes.cpu().numpy()
        strays = values[~_codebook_members(tuple(q.spec.codebook))[values.astype(np.int16) + 128]]
        if strays.size:
            raise ValueError(f"code {int(strays[0])} is not one of the {q.spec.scheme} lattice's codes "
                             f"{list(q.spec.codebook)}")


@functools.cache
def _codebook_members(codebook: tuple[int, ...]) -> np.ndarray:
    """bool [256]: entry c + 128 says whether the int8 code c is one of ``codebook``'s (a table lookup per code, where
    np.isin sorted the codes: a second of every verify of a large codebook-typed checkpoint)."""
    members = np.zeros(256, dtype=bool)
    for code in codebook:
        if -128 <= code <= 127:
            members[code + 128] = True
    return members


def _code_span(codes: torch.Tensor) -> tuple[int, int]:
    """(min, max) of integer codes; numpy on CPU, where torch's multi-threaded reductions over int8 were 10x slower
    on a busy 2-core machine."""
    if codes.numel() == 0:
        return 0, 0
    if codes.device.type == "cpu":
        values = codes.numpy()
        return int(values.min()), int(values.max())
    return int(codes.min()), int(codes.max())


def _all_finite(t: torch.Tensor) -> bool:
    return bool(np.isfinite(t.numpy()).all()) if t.device.type == "cpu" else bool(torch.isfinite(t.float()).all())
