"""The sub-block scale codes of a two-level lattice refitted against the metric once the codes are chosen (issue 38,
item 3: what the K-quant fit leaves on the table).

The sweep fixes a group's parameters before it rounds the group's columns -- with act order, from the original
weights before any column is rounded -- and never comes back to them. Once every code q is fixed, a group's values
s_g q_g + o_g are linear in its scale (and offset), so the metric's loss

    f = tr((T - V) H (T - V)^T),   V the lattice values, T the target (W, or TARQ's W + D)

is, row by row, a quadratic in each group's scale code sc_g: moving sc_g by k moves s_g by k * step_g (step = d for
the K-quants and IQ4_XS, 2 d factor for the grid types, whose s = d (2 sc + 1) factor) and f by

    -2 k step b_g + (k step)^2 a_g,   b_g = q_g . (E H)_g,   a_g = q_g^T H_gg q_g,   E = T - V.

The best integer k is the rounded k* = b_g / (a_g step), clamped to the code range; it is taken when it lowers f.
Groups are visited in order, E H updated after each (one rank-w update), and the pass repeated. K-quant mins (Q4_K,
Q5_K, Q2_K: o_g = -dmin mn_g) are refitted the same way with q_g replaced by ones. The super-block scales d and the
codes stay as they are, so the result is on the same lattice and f never rises.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .lattice import QuantizedWeight

__all__ = ["refit_sub_codes"]

PASSES = 2
ROW_CHUNK = 2048  # rows refitted together: E and E H of a chunk (4 MB each at 512 inputs) stay in cache
# The product that updates E H runs on the moved rows alone (a tenth of them, typically) from this many: the rows that
# did not move add an exact zero, and each row of a product of two or more rows came out bit for bit as in the product
# over all rows on the Intel Xeon measured (a single row takes BLAS's vector product, which rounds otherwise, so one
# moved row updates every row as before). A processor whose BLAS rounds otherwise still gives the same bytes each run.
MIN_MOVED_ROWS = 2


@dataclass
class RefitInfo:
    """What a refit changed: the loss f before and after (float64 sums), and how many codes moved."""

    loss_before: float
    loss_after: float
    scale_codes_moved: int
    min_codes_moved: int


def refit_sub_codes(target: torch.Tensor, q: QuantizedWeight, H: torch.Tensor,
                    passes: int = PASSES) -> tuple[QuantizedWeight, RefitInfo | None]:
    """``q`` with its sub-block scale (and min) codes refitted to lower tr((T - V) H (T - V)^T), T = ``target``
    [m, n], H [n, n] positive definite; ``q`` itself for a one-level lattice (None for the info)."""
    spec = q.spec
    if not spec.two_level:
        return q, None
    H = H.to(target.device, torch.float32)
    per_super = q.sub_scales.shape[1] // q.scales.shape[1]
    scale_step = q.scales.float().repeat_interleave(per_super, dim=1).to(target.device)
    if spec.grid is not None:
        scale_step = scale_step * (2.0 * spec.grid.factor)
    sub_scales = q.sub_scales.to(target.device, torch.int32).clone()
    sub_mins = q.sub_mins.to(target.device, torch.int32).clone() if q.sub_mins is not None else None
    min_step = -q.mins.float().repeat_interleave(per_super, dim=1).to(target.device) if sub_mins is not None else None
    values = q.dequantize().to(target.device)
    before, moved = 0.0, [0, 0]
    for start in range(0, target.shape[0], ROW_CHUNK):  # rows are independent under one H; a chunk stays in cache
        rows = slice(start, start + ROW_CHUNK)
        before += _refit_rows(target[rows].float() - values[rows], q.codes[rows].to(target.device).float(), H,
                              passes, (scale_step[rows], sub_scales[rows]),
                              (min_step[rows], sub_mins[rows]) if sub_mins is not None else None,
                              spec.sub_code_range, moved)
    refitted = QuantizedWeight(q.codes, spec=spec, scales=q.scales, mins=q.mins,
                               sub_scales=sub_scales.to(q.sub_scales.device, q.sub_scales.dtype),
                               sub_mins=None if sub_mins is None else sub_mins.to(q.sub_mins.device, q.sub_mins.dtype))
    E = target.float() - refitted.dequantize().to(target.device)  # the values the dequantizer makes
    return refitted, RefitInfo(before, _loss(E, E @ H), *moved)


def _loss(E: torch.Tensor, R: torch.Tensor) -> float:
    """f = tr(E H E^T) from E and R = E H, summed in float64."""
    return float((E.double() * R.double()).sum())


def _refit_rows(E: torch.Tensor, codes: torch.Tensor, H: torch.Tensor, passes: int,
                scales: tuple[torch.Tensor, torch.Tensor], mins: tuple[torch.Tensor, torch.Tensor] | None,
                code_range: tuple[int, int], moved: list[int]) -> float:
    """Refit the scale (and min) codes of a chunk of rows in place: ``scales`` = (change of s per code [r, groups],
    the codes [r, groups], a view into the whole matrix's), ``mins`` likewise; E [r, n] = T - V for these rows.
    Returns the chunk's loss f before the refit (E H is formed here anyway)."""
    R = E @ H
    before = _loss(E, R)
    width = codes.shape[1] // scales[1].shape[1]
    ones = torch.ones_like(codes[:, :width])
    for _ in range(passes):
        for g in range(scales[1].shape[1]):
            cols = slice(g * width, (g + 1) * width)
            moved[0] += _refit_group(codes[:, cols], scales[0][:, g], scales[1][:, g], cols, E, R, H, *code_range)
            if mins is not None:
                moved[1] += _refit_group(ones, mins[0][:, g], mins[1][:, g], cols, E, R, H, *code_range)
    return before


def _refit_group(A: torch.Tensor, step: torch.Tensor, sub_codes: torch.Tensor, cols: slice, E: torch.Tensor,
                 R: torch.Tensor, H: torch.Tensor, low: int, high: int) -> int:
    """Move one group's code by the integer k that lowers f most (in place: ``sub_codes``, E and R = E H); the
    number of rows whose code moved. ``A`` [m, w] is what one unit of the parameter multiplies (the codes for a scale,
    ones for an offset), ``step`` [m] the parameter's change per code."""
    b = (A * R[:, cols]).sum(dim=1)
    a = ((A @ H[cols, cols]) * A).sum(dim=1)
    usable = (a > 0) & (step != 0)
    k = torch.where(usable, torch.round(b / torch.where(usable, a * step, torch.ones_like(a))), torch.zeros_like(a))
    k = torch.minimum(torch.maximum(k, (low - sub_codes).float()), (high - sub_codes).float())
    change = k * step
    take = 2.0 * change * b - change * change * a > 0  # f falls by this much
    if not bool(take.any()):
        return 0
    change = torch.where(take, change, torch.zeros_like(change))
    sub_codes += torch.where(take, k, torch.zeros_like(k)).to(sub_codes.dtype)
    delta = change[:, None] * A
    E[:, cols] -= delta
    rows = take.nonzero().squeeze(1)
    if rows.numel() >= MIN_MOVED_ROWS:  # only the moved rows' R changes: a tenth of the rows, typically
        R[rows] -= delta[rows] @ H[cols, :]
    else:
        R -= delta @ H[cols, :]
    return int(rows.numel())
