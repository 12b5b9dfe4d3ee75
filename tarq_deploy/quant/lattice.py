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
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .choices import SCALE_RULES

SCALE_DTYPE = torch.float16
CODE_DTYPE = torch.int8
SUPPORTED_GROUP_SIZES = (-1, 32, 64, 128)
SUPPORTED_BITS = (2, 3, 4, 5, 6, 7, 8)
FP16_MAX = 65504.0
# make_qx_quants' grid: divisors 2^(b-1) + 0.1 k, k = -9..9, around the max rule (k = 0).
SEARCH_STEPS = tuple(0.1 * k for k in range(-9, 10))


@dataclass(frozen=True)
class LatticeSpec:
    """Bit width and grouping of a symmetric lattice."""

    bits: int = 4
    group_size: int = 128

    def __post_init__(self) -> None:
        if self.bits not in SUPPORTED_BITS:
            raise ValueError(f"bits must be one of {SUPPORTED_BITS}, got {self.bits}")
        if self.group_size not in SUPPORTED_GROUP_SIZES:
            raise ValueError(f"group_size must be one of {SUPPORTED_GROUP_SIZES}, got {self.group_size}")

    @property
    def qmin(self) -> int:
        return -(2 ** (self.bits - 1))

    @property
    def qmax(self) -> int:
        return 2 ** (self.bits - 1) - 1

    @property
    def levels(self) -> int:
        return 2**self.bits - 1

    def group_width(self, n_cols: int) -> int:
        """Columns per group for a matrix with ``n_cols`` inputs."""
        return n_cols if self.group_size == -1 else self.group_size

    def n_groups(self, n_cols: int) -> int:
        self.check_columns(n_cols)
        return n_cols // self.group_width(n_cols)

    def check_columns(self, n_cols: int) -> None:
        if self.group_size != -1 and n_cols % self.group_size != 0:
            raise ValueError(f"{n_cols} input columns are not a multiple of group size {self.group_size}")


@dataclass
class QuantizedWeight:
    """Integer codes and fp16 scales of one matrix on a lattice; ``dequantize()`` gives s * q exactly."""

    codes: torch.Tensor  # int8 [m, n]
    scales: torch.Tensor  # float16 [m, n_groups]
    spec: LatticeSpec

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.codes.shape)  # type: ignore[return-value]

    def dequantize(self) -> torch.Tensor:
        return dequantize(self.codes, self.scales, self.spec)

    def to(self, device: torch.device | str) -> "QuantizedWeight":
        return QuantizedWeight(self.codes.to(device), self.scales.to(device), self.spec)


def _grouped(w: torch.Tensor, spec: LatticeSpec) -> torch.Tensor:
    m, n = w.shape
    width = spec.group_width(n)
    return w.float().reshape(m, n // width, width)


def _signed_max(x: torch.Tensor) -> torch.Tensor:
    """The value of largest magnitude in each group of x [m, G, g], with its sign: [m, G]."""
    return x.gather(2, x.abs().argmax(dim=2, keepdim=True)).squeeze(2)


def _max_rule(x: torch.Tensor, spec: LatticeSpec) -> tuple[torch.Tensor, int]:
    """(peak [m, G], top) of the max rule for groups x [m, G, g], whose scale is peak / top: the signed value of
    largest magnitude over the lowest code (ggml Q4_0 / Q5_0), or for 8 bits max|w| over 127 (Q8_0)."""
    if spec.bits == 8:
        return x.abs().amax(dim=2), spec.qmax
    return _signed_max(x), spec.qmin


def max_rule_scales(w: torch.Tensor, spec: LatticeSpec) -> torch.Tensor:
    """float32 scales of the max rule for the groups of ``w`` [m, n]: max / -2^(b-1) (8 bits: Q8_0's max|w| / 127)."""
    peak, top = _max_rule(_grouped(w, spec), spec)
    return peak / top


def scales_for(w: torch.Tensor, spec: LatticeSpec) -> torch.Tensor:
    """fp16 max-rule scales for the groups of ``w`` ([m, n] or a single group [m, g]); shape [m, n_groups]."""
    return max_rule_scales(w, spec).clamp(-FP16_MAX, FP16_MAX).to(SCALE_DTYPE)


def search_scales(w: torch.Tensor, spec: LatticeSpec, importance: torch.Tensor) -> torch.Tensor:
    """fp16 scales minimising sum_j h_j (w_j - s q_j)^2 per group over make_qx_quants' candidate grid.

    ``importance`` h holds one non-negative weight per column ([n]) or per weight ([m, n]). Each candidate divisor
    gives codes q by rounding; the least-squares scale for those codes, sum h w q / sum h q^2, is the candidate's
    scale, and the one with the smallest error wins (ties: the first, so the max rule's own codes win among equals).
    A group with no importance keeps the max rule."""
    x = _grouped(w, spec)
    h = importance.float().expand(w.shape).reshape(x.shape)
    peak, top = _max_rule(x, spec)
    best_scale = peak / top
    best_gain = torch.full_like(best_scale, -1.0)
    for step in SEARCH_STEPS:
        d = (peak / (top + step * math.copysign(1.0, top))).unsqueeze(2)  # step > 0: the divisor moves outward
        q = torch.round(x / torch.where(d == 0, torch.ones_like(d), d)).clamp_(spec.qmin, spec.qmax)
        hq = h * q
        sum_xq, sum_qq = (hq * x).sum(dim=2), (hq * q).sum(dim=2)
        gain = torch.where(sum_qq > 0, sum_xq * sum_xq / sum_qq.clamp(min=1e-30), torch.zeros_like(sum_qq))
        better = gain > best_gain
        best_gain = torch.where(better, gain, best_gain)
        best_scale = torch.where(better & (sum_qq > 0), sum_xq / sum_qq.clamp(min=1e-30), best_scale)
    return best_scale.clamp(-FP16_MAX, FP16_MAX).to(SCALE_DTYPE)


def choose_scales(w: torch.Tensor, spec: LatticeSpec, rule: str, importance: torch.Tensor | None) -> torch.Tensor:
    """fp16 scales by ``rule`` ("max" or "search"; search without importance weighs every column alike)."""
    if rule == "max":
        return scales_for(w, spec)
    if rule == "search":
        return search_scales(w, spec, importance if importance is not None else torch.ones(w.shape[1]))
    raise ValueError(f"scale rule must be one of {SCALE_RULES}, got {rule!r}")


def codes_for(w: torch.Tensor, scales: torch.Tensor, spec: LatticeSpec) -> torch.Tensor:
    """Round ``w`` [m, n] to codes under fixed fp16 ``scales`` [m, n_groups]; a zero scale gives code 0."""
    m, n = w.shape
    width = n // scales.shape[1]
    s = scales.float().repeat_interleave(width, dim=1)
    safe = torch.where(s == 0, torch.ones_like(s), s)
    q = torch.round(w.float() / safe).clamp(spec.qmin, spec.qmax)
    q = torch.where(s == 0, torch.zeros_like(q), q)
    return q.to(CODE_DTYPE)


def dequantize(codes: torch.Tensor, scales: torch.Tensor, spec: LatticeSpec) -> torch.Tensor:
    """Exact float32 values s * q. Both factors are exact in float32 and so is their product."""
    width = codes.shape[1] // scales.shape[1]
    return codes.float() * scales.float().repeat_interleave(width, dim=1)


def quantize_rtn(w: torch.Tensor, spec: LatticeSpec) -> QuantizedWeight:
    """Round-to-nearest onto the lattice, the data-free baseline, in ggml's reference arithmetic.

    Codes come from the float32 max-rule scale d and its float32 inverse: q = min(qmax, trunc(w * (1/d) + 2^(b-1) +
    0.5) - 2^(b-1)) (ggml's ``(int8_t)(x * id + 8.5f)``, the float32 additions included; 8 bits: Q8_0's roundf,
    halves away from zero), and the stored scale is fp16(d). So for Q4_0 / Q5_0 / Q8_0 blocks these are ggml's own
    bytes (tests/test_lattice_ggml.py)."""
    spec.check_columns(w.shape[1])
    d = max_rule_scales(w, spec)
    inverse = torch.where(d == 0, torch.zeros_like(d), 1.0 / d).repeat_interleave(spec.group_width(w.shape[1]), dim=1)
    scaled = w.float() * inverse
    if spec.bits == 8:
        whole = torch.trunc(scaled)
        q = whole + torch.sign(scaled) * ((scaled - whole).abs() >= 0.5).float()
    else:
        offset = float(-spec.qmin)
        q = torch.trunc(scaled + (offset + 0.5)) - offset
    codes = q.clamp(spec.qmin, spec.qmax).to(CODE_DTYPE)
    return QuantizedWeight(codes, d.clamp(-FP16_MAX, FP16_MAX).to(SCALE_DTYPE), spec)


def check_on_lattice(q: QuantizedWeight) -> None:
    """Raise ValueError unless codes are in range and the scale grid matches the spec."""
    m, n = q.codes.shape
    if q.codes.dtype != CODE_DTYPE or q.scales.dtype != SCALE_DTYPE:
        raise ValueError(f"codes must be int8 and scales float16, got {q.codes.dtype} / {q.scales.dtype}")
    if q.scales.shape != (m, q.spec.n_groups(n)):
        raise ValueError(f"scales shape {tuple(q.scales.shape)} does not fit codes {m}x{n} with {q.spec}")
    lo, hi = int(q.codes.min()), int(q.codes.max())
    if lo < q.spec.qmin or hi > q.spec.qmax:
        raise ValueError(f"codes span [{lo}, {hi}], outside [{q.spec.qmin}, {q.spec.qmax}]")
    if not torch.isfinite(q.scales.float()).all():
        raise ValueError("scales contain inf or nan")
