"""The nearest grid point of every run, as compiled loops (numba; compiled on first use, cached on disk): what
grid.py's torch search does on an accelerator, without its [rows, candidates, dim] temporaries (which made the
search of Whisper's 51,865-row output head take most of a minute on the CPU) or the per-call overhead of a dozen
small torch operations per run of a sweep.

Same candidates, objective and sign rule as the torch search (grid.py's module docstring); each run's error is
summed over its values in order, so a near tie can go the other way than in torch's reduction: the CPU and an
accelerator may differ on such runs (as their matrix products already do), a given processor never. Rows are
independent, so the thread count changes no result; small calls run on one thread (a parallel launch costs more
than a few hundred rows of work).

Two more loops serve the CPU sweep and the checks: ``sweep_grid_columns``, a grid type's column steps inside one block
(the NumPy steps it replaced, bit for bit), and ``point_indices``, the grid index of every run of codes (what
check_codes and the packer need; NumPy's int64 temporaries took seconds on an output head).
"""
from __future__ import annotations

import numba
import numpy as np

from .sweep_kernel import push_column_error

__all__ = ["nearest_runs", "point_indices", "run_codes", "scale_search", "sweep_grid_columns"]

PARALLEL_FROM = 1 << 16  # values per call from which the rows are shared among the cores


def _nearest_runs(y: np.ndarray, h: np.ndarray, boundaries: np.ndarray, candidates: np.ndarray,
                  out: np.ndarray) -> None:
    """For y, h float32 [R, u] (u a multiple of dim), fill out [R, u] with, for each run of dim values, the candidate
    of its key (``candidates``: see _best_candidate) of least sum_j h_j (c_j - y_j)^2 (the first of equals). A value's
    place is the count of ``boundaries`` (the midpoints between the B magnitudes) below it, as torch.bucketize."""
    rows, width = y.shape
    dim = candidates.shape[1]
    for r in numba.prange(rows):
        errors = np.empty(candidates.shape[2], dtype=np.float32)
        for start in range(0, width, dim):
            chosen, key = _best_candidate(y[r, start:start + dim], h[r, start:start + dim], boundaries, candidates,
                                          errors)
            for j in range(dim):
                out[r, start + j] = candidates[key, j, chosen]


def _run_codes(x: np.ndarray, s: np.ndarray, h: np.ndarray, boundaries: np.ndarray, candidates: np.ndarray,
               implied_sign: bool, out: np.ndarray) -> None:
    """A sweep's run: x float32 [u, m] (u columns of the working W^T), scales s [m], column weights h [u]; fill
    out [u, m] with the signed codes: per row and run of dim columns the best candidate for |x| / s, signs from x,
    and where the type implies a sign, in each 8 with an odd count of negatives the cheapest sign flipped."""
    u, rows = x.shape
    dim = candidates.shape[1]
    for r in numba.prange(rows):
        y = np.empty(u, dtype=np.float32)
        errors = np.empty(candidates.shape[2], dtype=np.float32)
        for j in range(u):
            y[j] = abs(x[j, r]) / s[r] if s[r] > 0 else np.float32(0.0)
        for start in range(0, u, dim):
            chosen, key = _best_candidate(y[start:start + dim], h[start:start + dim], boundaries, candidates, errors)
            for j in range(dim):
                g = candidates[key, j, chosen]
                out[start + j, r] = -g if x[start + j, r] < 0 else g
        if implied_sign:
            for start in range(0, u, 8):
                negatives, cheapest, least = 0, start, np.inf
                for j in range(start, start + 8):
                    negatives += out[j, r] < 0
                    cost = h[j] * y[j] * abs(out[j, r])
                    if cost < least:
                        least, cheapest = cost, j
                if negatives % 2 == 1:
                    out[cheapest, r] = -out[cheapest, r]


def _scale_search(x: np.ndarray, h: np.ndarray, divisors: np.ndarray, boundaries: np.ndarray,
                  candidates: np.ndarray, implied_sign: bool, out: np.ndarray) -> None:
    """For groups x, h float32 [R, g]: out[r] = the least-squares scale, over the candidate scales max|x| / divisor,
    of least error sum_j h_j (x_j - s q_j)^2, q the nearest grid points for |x| / candidate with x's signs (where
    the type implies a sign, the cheapest flip in each 8 with an odd count of negatives, as the sweep does). A group
    of zeros, or one whose refit is not positive, keeps the candidate itself."""
    rows, width = x.shape
    dim = candidates.shape[1]
    for r in numba.prange(rows):
        errors = np.empty(candidates.shape[2], dtype=np.float32)
        peak = np.float32(0.0)
        for j in range(width):
            peak = max(peak, abs(x[r, j]))
        best_error, best_scale = np.inf, peak / divisors[0]
        y = np.empty(dim, dtype=np.float32)
        for k in range(divisors.shape[0]):
            scale = peak / divisors[k]
            sum_hxg, sum_hgg, sum_hxx = np.float32(0.0), np.float32(0.0), np.float32(0.0)
            negatives, cheapest = 0, np.float32(np.inf)
            for start in range(0, width, dim):
                for j in range(dim):
                    y[j] = abs(x[r, start + j]) / scale if scale > 0 else np.float32(0.0)
                chosen, key = _best_candidate(y, h[r, start:start + dim], boundaries, candidates, errors)
                for j in range(dim):
                    g, a, w = candidates[key, j, chosen], abs(x[r, start + j]), h[r, start + j]
                    sum_hxg += w * a * g
                    sum_hgg += w * g * g
                    sum_hxx += w * a * a
                    negatives += x[r, start + j] < 0
                    cheapest = min(cheapest, w * a * g)
                if implied_sign and (start + dim) % 8 == 0:  # a sign run ends: flipping one sign costs 2 h |x| g
                    if negatives % 2 == 1:
                        sum_hxg -= 2 * cheapest
                    negatives, cheapest = 0, np.float32(np.inf)
            refit = sum_hxg / sum_hgg if sum_hgg > 0 else np.float32(0.0)
            if not refit > 0:
                refit = scale
            error = sum_hxx - 2 * refit * sum_hxg + refit * refit * sum_hgg
            if error < best_error:
                best_error, best_scale = error, refit
        out[r] = best_scale


def _point_indices(codes: np.ndarray, position: np.ndarray, base: int, table: np.ndarray, out: np.ndarray) -> None:
    """For int8 codes [R, u], out [R, u / dim] int64 = the grid index of each run of dim codes' magnitudes: the key
    sum_j position[|c_j|] base^j looked up in ``table`` (base: the count of magnitudes), -1 where a magnitude is none
    of the grid's (position -1) or the run is no grid point (table -1). |-128| counts as 127, as no grid has either."""
    runs = out.shape[1]
    dim = codes.shape[1] // runs
    for r in numba.prange(codes.shape[0]):
        for k in range(runs):
            key, power = np.int64(0), np.int64(1)
            for j in range(dim):
                place = position[min(abs(np.int64(codes[r, k * dim + j])), 127)]
                if place < 0:
                    key = -1
                    break
                key += place * power
                power *= base
            out[r, k] = table[key] if key >= 0 else -1


@numba.njit(nogil=True, cache=True, boundscheck=False, inline="always")
def _best_candidate(y: np.ndarray, h: np.ndarray, boundaries: np.ndarray, candidates: np.ndarray,
                    errors: np.ndarray) -> tuple[int, int]:
    """(index among its key's candidates, key) of the run y [dim] under weights h [dim]. ``candidates`` float32
    [B^dim, dim, N] holds each key's N candidates coordinate by coordinate (grid.py's _candidate_columns), so that the
    N errors (scratch ``errors`` [N]) grow side by side, one coordinate at a time, each still summed over j in
    order as a loop over the candidates one by one sums it; the key and the least error are found without
    data-dependent branches. The same choices as the candidate-by-candidate loop this replaced, bit for bit; the
    scale search 20-25 % faster (IQ2_XS 0.161 -> 0.129 s, IQ3_S 0.383 -> 0.301 s for 100,000 groups, one thread,
    Intel Xeon)."""
    levels = boundaries.shape[0] + 1
    dim, count = candidates.shape[1], candidates.shape[2]
    key, power = 0, 1
    for j in range(dim):
        place = 0  # the count of boundaries below y_j (they ascend), without a data-dependent branch
        for b in range(levels - 1):
            place += boundaries[b] < y[j]
        key += place * power
        power *= levels
    for c in range(count):
        errors[c] = np.float32(0.0)
    for j in range(dim):
        value, weight = y[j], h[j]
        for c in range(count):
            gap = candidates[key, j, c] - value
            errors[c] += weight * gap * gap
    best, chosen = np.inf, 0
    for c in range(count):
        better = errors[c] < best  # the first of equals, as a select rather than a branch
        chosen = c if better else chosen
        best = errors[c] if better else best
    return chosen, key


_compile = numba.njit(nogil=True, cache=True, boundscheck=False)
_compile_parallel = numba.njit(nogil=True, cache=True, boundscheck=False, parallel=True)
_KERNELS = {name: (_compile(f), _compile_parallel(f)) for name, f in
            (("nearest_runs", _nearest_runs), ("run_codes", _run_codes), ("scale_search", _scale_search),
             ("point_indices", _point_indices))}
_run_codes_serial = _KERNELS["run_codes"][0]  # called from the sweep below: a run's rows are too few to share out


@_compile
def sweep_grid_columns(W_block: np.ndarray, Err_block: np.ndarray, U_block: np.ndarray, codes: np.ndarray,
                       sT: np.ndarray, groups: np.ndarray, start: int, stop: int, unit: int, boundaries: np.ndarray,
                       candidates: np.ndarray, implied_sign: bool) -> None:
    """A grid type's sweep of columns start..stop-1 of a block, in place (the arrays as sweep_kernel's, no offsets:
    the grid types have none). Entering each run of ``unit`` columns their codes are chosen together under the
    weights 1 / U_jj^2 (``_run_codes``); each column is then swept as any other: err = (w - q s) / U[i, i], and
    W[k] -= U[i, k] err for the block's columns k >= i. The same float32 operations in the same order as the NumPy
    steps this loop replaced (a Python call per column cost more than its arithmetic at IQ2's runs of 8)."""
    m = W_block.shape[1]
    run = np.empty((unit, m), dtype=np.float32)
    weights = np.empty(unit, dtype=np.float32)
    for i in range(start, stop):
        g = groups[i]
        if i % unit == 0:
            for j in range(unit):
                d = U_block[i + j, i + j]
                weights[j] = np.float32(1.0) / (d * d)
            _run_codes_serial(W_block[i:i + unit], sT[g], weights, boundaries, candidates, implied_sign, run)
        d = U_block[i, i]
        for r in range(m):
            q = run[i % unit, r]
            codes[i, r] = np.int8(q)
            Err_block[i, r] = (W_block[i, r] - q * sT[g, r]) / d
        push_column_error(W_block, Err_block, U_block, i)


def nearest_runs(y: np.ndarray, h: np.ndarray, boundaries: np.ndarray, candidates: np.ndarray,
                 out: np.ndarray) -> None:
    serial, parallel = _KERNELS["nearest_runs"]
    (parallel if y.size >= PARALLEL_FROM else serial)(y, h, boundaries, candidates, out)


def run_codes(x: np.ndarray, s: np.ndarray, h: np.ndarray, boundaries: np.ndarray, candidates: np.ndarray,
              implied_sign: bool, out: np.ndarray) -> None:
    serial, parallel = _KERNELS["run_codes"]
    (parallel if x.size >= PARALLEL_FROM else serial)(x, s, h, boundaries, candidates, implied_sign, out)


def point_indices(codes: np.ndarray, position: np.ndarray, base: int, table: np.ndarray, out: np.ndarray) -> None:
    serial, parallel = _KERNELS["point_indices"]
    (parallel if codes.size >= PARALLEL_FROM else serial)(codes, position, base, table, out)


def scale_search(x: np.ndarray, h: np.ndarray, divisors: np.ndarray, boundaries: np.ndarray, candidates: np.ndarray,
                 implied_sign: bool, out: np.ndarray) -> None:
    serial, parallel = _KERNELS["scale_search"]
    (parallel if x.size >= PARALLEL_FROM else serial)(x, h, divisors, boundaries, candidates, implied_sign, out)
