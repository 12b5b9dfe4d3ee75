"""Choosing a lattice's group parameters from weights, for every scheme (lattice.py names them).

``fit_params(w, spec, rule, importance)`` returns the parameters of the groups of ``w`` already in the form the
format stores (fp16 d and m, 6-bit or int8 sub-block codes), so the codes the solvers then choose are rounded
against exactly the values the runtime decodes. The rules:

* symmetric and nonlinear (IQ4_NL): lattice.py's max rule or its importance-weighted search (make_qx_quants'
  grid; for a codebook, divisors around its lowest code as ggml's quantize_iq4_nl tries them).
* affine (Q4_1 / Q5_1) and the K-quants' sub-blocks (Q2_K / Q4_K / Q5_K): max rule d = (max - min) / (2^b - 1), m = min;
  or a search in the manner of ggml's make_qkx2_quants: 21 candidate inverse scales (2^b - 1 + 0.1 k, k = -10..10)
  over the group's range, each giving codes whose importance-weighted least-squares (s, m) is the candidate, the
  smallest weighted error winning. K-quant offsets are -dmin * mn with mn >= 0, so their m is kept <= 0.
* K-quant super-blocks: the 8 (Q4_K / Q5_K, IQ4_XS) or 16 (Q2_K, Q3_K, Q6_K) group scales become codes under one
  fp16 super-block scale d = (largest group scale) / (top code: 63, Q2_K 15), likewise the mins under dmin; the
  signed ones (Q3_K, Q6_K, IQ4_XS) take d = (signed largest) / (lowest code: -32, -128), so the largest takes the
  lowest code as in ggml's quantize_row_q3_K / q6_K / iq4_xs. IQ4_XS's group scales are IQ4_NL's (its table's
  search), then coded so. The code ranges are ``LatticeSpec.sub_code_range``.
* Grid types (grid.py): each group's scale is the max rule (largest magnitude onto the largest grid value) or a
  search over divisors of that largest magnitude, each candidate scored by the importance-weighted error of the
  group's nearest grid points and refitted by least squares (the grid is what the codes will be, so it is what the
  candidates are scored on); the group scales then become 4-bit codes sc of s = d * (2 sc + 1) * factor under
  d = (largest group scale) / (31 * factor), so the largest takes sc = 15 as ggml's quantizers do.
"""

from __future__ import annotations

import torch

from .choices import SCALE_RULES
from .grid import SCALE_CODE_MAX, searched_grid_scales
from .lattice import (CODE_DTYPE, FP16_MAX, K_SUPER_BLOCK, SCALE_DTYPE, LatticeSpec, QuantizedWeight, signed_max,
                      choose_scales, codes_for, effective_scale_offset, max_rule_scales, searched_scales)

__all__ = ["fit_params", "quantize_nearest", "quantize_rtn"]

AFFINE_SEARCH_STEPS = tuple(0.1 * k for k in range(-10, 11))
EPS = 1e-30


def fit_params(w: torch.Tensor, spec: LatticeSpec, rule: str,
               importance: torch.Tensor | None) -> dict[str, torch.Tensor]:
    """The stored group parameters for ``w`` [m, n] (n whole groups, or for K-quants whole super-blocks) by
    ``rule`` ("max" or "search"); ``importance`` h weighs the search ([n] or [m, n]; None: all alike)."""
    if rule not in SCALE_RULES:
        raise ValueError(f"scale rule must be one of {SCALE_RULES}, got {rule!r}")
    spec.check_columns(w.shape[1])
    if spec.scheme in ("symmetric", "nonlinear"):
        return {"scales": choose_scales(w, spec, rule, importance)}
    h = (importance if importance is not None else torch.ones(w.shape[1])).float().to(w.device).expand(w.shape)
    if spec.grid is not None:
        return _grid_codes(_grid_scales(_grouped(w, spec), _grouped(h, spec), spec, rule), spec)
    if spec.scheme in ("k-symmetric", "k-nonlinear"):
        scale = max_rule_scales(w, spec) if rule == "max" else searched_scales(w, spec, h)
        return _k_symmetric_codes(scale, spec)
    scale, offset = _affine_fit(_grouped(w, spec), _grouped(h, spec), spec.qmax, rule, spec.two_level)
    if spec.scheme == "affine":
        return {"scales": _fp16(scale), "mins": _fp16(offset)}
    return _k_affine_codes(scale, -offset, spec)


def quantize_nearest(w: torch.Tensor, spec: LatticeSpec, rule: str = "max",
                     importance: torch.Tensor | None = None) -> QuantizedWeight:
    """Group parameters by ``rule``, then the nearest code for every weight: the data-free baseline of any scheme."""
    params = fit_params(w.float(), spec, rule, importance)
    s, o = effective_scale_offset(spec, params)
    return QuantizedWeight(codes_for(w, s, spec, o, importance), spec=spec, **params)


def quantize_rtn(w: torch.Tensor, spec: LatticeSpec) -> QuantizedWeight:
    """Round-to-nearest onto the lattice, the data-free baseline, in ggml's reference arithmetic.

    Codes come from the float32 max-rule scale d and its float32 inverse: q = min(qmax, trunc(w * (1/d) + 2^(b-1) +
    0.5) - 2^(b-1)) (ggml's ``(int8_t)(x * id + 8.5f)``, the float32 additions included; 8 bits: Q8_0's roundf,
    halves away from zero), and the stored scale is fp16(d). So for Q4_0 / Q5_0 / Q8_0 blocks these are ggml's own
    bytes (tests/test_lattice_ggml.py); likewise Q4_1 / Q5_1 (:func:`_rtn_affine`). The K-quants have no plain
    rounding in ggml (its reference quantizer searches); theirs is the max rule of lattice_fit.py and nearest
    codes, and so is IQ4_NL's (max rule: the value of largest magnitude onto the lowest table value)."""
    spec.check_columns(w.shape[1])
    if spec.two_level or spec.codebook is not None or spec.scale_grid != "float16":  # no ggml reference arithmetic
        # to follow: nearest codes
        return quantize_nearest(w, spec)
    if spec.affine:
        return _rtn_affine(w, spec)
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


def _rtn_affine(w: torch.Tensor, spec: LatticeSpec) -> QuantizedWeight:
    """ggml's Q4_1 / Q5_1 reference rounding: d = (max - min) / (2^b - 1) and m = min in float32, codes
    min(2^b - 1, trunc((w - min) * (1/d) + 0.5)), then d and m stored as fp16."""
    x = _grouped(w, spec)
    lo, hi = x.amin(dim=2), x.amax(dim=2)
    d = (hi - lo) / float(spec.qmax)
    inverse = torch.where(d == 0, torch.zeros_like(d), 1.0 / d)
    q = torch.trunc((x - lo[:, :, None]) * inverse[:, :, None] + 0.5).clamp(spec.qmin, spec.qmax)
    m, n = w.shape
    to_fp16 = lambda t: t.clamp(-FP16_MAX, FP16_MAX).to(SCALE_DTYPE)  # noqa: E731
    return QuantizedWeight(q.reshape(m, n).to(CODE_DTYPE), to_fp16(d), spec, mins=to_fp16(lo))


# ------------------------------------------------------------------------------------------------ one level
def _grouped(t: torch.Tensor, spec: LatticeSpec) -> torch.Tensor:
    m, n = t.shape
    return t.float().reshape(m, n // spec.group_size, spec.group_size)


def _fp16(t: torch.Tensor) -> torch.Tensor:
    return t.clamp(-FP16_MAX, FP16_MAX).to(SCALE_DTYPE)


def _affine_fit(x: torch.Tensor, h: torch.Tensor, nmax: int, rule: str,
                nonpositive_offset: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale, offset) float32 [m, G] of groups x [m, G, g] under weights h, values s * q + o with q in 0..nmax."""
    lo, hi = x.amin(dim=2), x.amax(dim=2)
    if nonpositive_offset:
        lo = lo.clamp(max=0.0)
    span = hi - lo
    scale, offset = span / nmax, lo
    if rule == "max":
        return scale, offset
    best_err = _weighted_error(x, h, _codes(x, lo, span / nmax, nmax), scale, offset)
    for step in AFFINE_SEARCH_STEPS:
        inverse = torch.where(span > 0, (nmax + step) / span.clamp(min=EPS), torch.zeros_like(span))
        q = (torch.round((x - lo[:, :, None]) * inverse[:, :, None])).clamp_(0, nmax)
        s, o = _least_squares(x, h, q, nonpositive_offset)
        err = _weighted_error(x, h, q, s, o)
        better = (err < best_err) & (s >= 0)
        best_err = torch.where(better, err, best_err)
        scale, offset = torch.where(better, s, scale), torch.where(better, o, offset)
    return scale, offset


def _codes(x: torch.Tensor, offset: torch.Tensor, scale: torch.Tensor, nmax: int) -> torch.Tensor:
    safe = torch.where(scale == 0, torch.ones_like(scale), scale)
    return torch.round((x - offset[:, :, None]) / safe[:, :, None]).clamp_(0, nmax)


def _least_squares(x: torch.Tensor, h: torch.Tensor, q: torch.Tensor,
                   nonpositive_offset: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The (s, o) minimising sum h (x - s q - o)^2 per group, o clamped to <= 0 when asked (then s refits alone)."""
    sw, sq, sx = h.sum(2), (h * q).sum(2), (h * x).sum(2)
    sqq, sxq = (h * q * q).sum(2), (h * x * q).sum(2)
    det = sw * sqq - sq * sq
    ok = det > 0
    s = torch.where(ok, (sw * sxq - sx * sq) / det.clamp(min=EPS), torch.zeros_like(det))
    o = torch.where(ok, (sqq * sx - sq * sxq) / det.clamp(min=EPS), torch.zeros_like(det))
    if nonpositive_offset:
        alone = o > 0
        s = torch.where(alone, sxq / sqq.clamp(min=EPS), s)
        o = torch.where(alone, torch.zeros_like(o), o)
    return s, o


def _weighted_error(x: torch.Tensor, h: torch.Tensor, q: torch.Tensor, s: torch.Tensor,
                    o: torch.Tensor) -> torch.Tensor:
    return (h * (s[:, :, None] * q + o[:, :, None] - x) ** 2).sum(2)


# ------------------------------------------------------------------------------------------------ K-quants
def _code_under(values: torch.Tensor, d16: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    """round(values / d) clamped to [lo, hi] for group values [m, S, k] under the stored super-block d [m, S]."""
    d = d16.float()[:, :, None]
    return torch.where(d == 0, torch.zeros_like(values), torch.round(values / torch.where(d == 0, 1.0, d))).clamp_(lo, hi)


def _k_affine_codes(scale: torch.Tensor, neg_offset: torch.Tensor, spec: LatticeSpec) -> dict[str, torch.Tensor]:
    """Q2_K / Q4_K / Q5_K: group scales and -offsets [m, G] as codes 0..top (6-bit; Q2_K 4-bit) under fp16 d and
    dmin = (largest of the super-block's groups) / top."""
    m, groups = scale.shape
    per_super, (_, top) = K_SUPER_BLOCK // spec.group_size, spec.sub_code_range
    sc = scale.clamp(min=0.0).reshape(m, groups // per_super, per_super)
    mn = neg_offset.clamp(min=0.0).reshape(m, groups // per_super, per_super)
    d, dmin = _fp16(sc.amax(dim=2) / top), _fp16(mn.amax(dim=2) / top)
    return {"scales": d, "mins": dmin,
            "sub_scales": _code_under(sc, d, 0, top).reshape(m, groups).to(torch.uint8),
            "sub_mins": _code_under(mn, dmin, 0, top).reshape(m, groups).to(torch.uint8)}


def _k_symmetric_codes(scale: torch.Tensor, spec: LatticeSpec) -> dict[str, torch.Tensor]:
    """Q3_K / Q6_K / IQ4_XS: the 16 (IQ4_XS 8) group scales of a super-block as signed codes lo..hi (Q3_K and
    IQ4_XS -32..31, Q6_K -128..127) under d = (signed largest) / lo, so the largest takes code lo as ggml's
    quantize_row_q3_K / q6_K / iq4_xs do."""
    m, groups = scale.shape
    lo, hi = spec.sub_code_range
    sc = scale.reshape(m, groups // (K_SUPER_BLOCK // spec.group_size), K_SUPER_BLOCK // spec.group_size)
    d = _fp16(signed_max(sc) / lo)
    return {"scales": d, "sub_scales": _code_under(sc, d, lo, hi).reshape(m, groups).to(torch.int8)}


# ------------------------------------------------------------------------------------------------ grid types
GRID_SEARCH_STEPS = tuple(0.05 * k for k in range(-8, 5))  # divisors gmax * (1 + step): 0.6 .. 1.2
# grid points tried per run while scoring a candidate scale: 8 cost 0.1 % of the GPTQ loss against 32 (1024 x 512,
# IQ3_S / IQ2_S / IQ2_XS) at a quarter of the time
SEARCH_NEIGHBOURS = 8


def _grid_scales(x: torch.Tensor, h: torch.Tensor, spec: LatticeSpec, rule: str) -> torch.Tensor:
    """float32 scale >= 0 of each group x [m, G, g] of a grid type (module docstring)."""
    top = float(max(spec.grid.magnitudes))
    if rule == "max":
        return x.abs().amax(dim=2) / top
    m, groups, width = x.shape
    divisors = tuple(top * (1.0 + step) for step in GRID_SEARCH_STEPS)
    return searched_grid_scales(x.reshape(-1, width), h.reshape(-1, width), divisors, spec.grid,
                                SEARCH_NEIGHBOURS).reshape(m, groups)


def _grid_codes(scale: torch.Tensor, spec: LatticeSpec) -> dict[str, torch.Tensor]:
    """Group scales [m, G] as 4-bit codes sc under an fp16 d per super-block: s = d * (2 sc + 1) * factor."""
    m, groups = scale.shape
    factor = spec.grid.factor
    per_super = K_SUPER_BLOCK // spec.group_size
    sc = scale.reshape(m, groups // per_super, per_super)
    d = _fp16(sc.amax(dim=2) / ((2 * SCALE_CODE_MAX + 1) * factor))
    step = d.float()[:, :, None] * factor
    ratio = torch.where(step > 0, sc / step.clamp(min=EPS), torch.zeros_like(sc))
    codes = torch.round((ratio - 1.0) / 2.0).clamp_(0, SCALE_CODE_MAX)  # 2 sc + 1: the odd multiple nearest ratio
    return {"scales": d, "sub_scales": codes.reshape(m, groups).to(torch.int8)}
