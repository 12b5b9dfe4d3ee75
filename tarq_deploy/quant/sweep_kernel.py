"""The GPTQ column sweep's steps inside one block as a compiled loop (numba; compiled on first use, cached on disk).

The CPU sweep (gptq.CompiledColumns) spent most of its time in the per-column steps: a column is a few vector
operations on m values, and at base's widths NumPy's call overhead cost more than the arithmetic (~70,000 column
steps for Whisper base: ~4.6 s of GPTQ's 49 s base/128 process under py-spy). This loop does the very same IEEE
float32 operations in the same order as the torch sweep (gptq.TorchColumns) and the NumPy steps it replaced,
one column after another:

    x = w - o (affine lattices),  q = clamp(rint(x / s)) or the codebook entry nearest x / s (code 0's value for a zero
    scale),  value = q * s (+ o),  err = (w - value) / U[i, i],  W[k] -= U[i, k] * err for every k >= i in the block

as two roundings wherever those round twice (LLVM fuses no multiply-add without fast-math flags, which are off), so
the codes and group parameters are the torch sweep's bit for bit (tests/test_solvers.py). Rows are
independent, so the kernel runs them in one thread: the result does not depend on a thread count.
"""

from __future__ import annotations

import numba
import numpy as np

__all__ = ["push_column_error", "sweep_block_columns"]

_compile = numba.njit(nogil=True, cache=True, boundscheck=False)


@_compile
def _code(x: np.float32, s: np.float32, lo: np.float32, hi: np.float32, zero: np.float32, table: np.ndarray,
          bounds: np.ndarray) -> np.float32:
    """The code of x under scale s: rint(x / s) clamped to [lo, hi] (round half to even), or with a codebook
    (``table`` non-empty) its entry nearest x / s, ties to the lower one; ``zero`` for a zero scale."""
    if s == 0:
        return zero
    y = x / s
    if table.shape[0] > 0:
        return table[np.searchsorted(bounds, y)]  # side "left": a value on a bound takes the lower entry
    q = np.rint(y)
    if q < lo:
        return lo
    if q > hi:
        return hi
    return q


@_compile
def sweep_block_columns(W_block: np.ndarray, Err_block: np.ndarray, U_block: np.ndarray, codes: np.ndarray,
                        sT: np.ndarray, oT: np.ndarray, groups: np.ndarray, start: int, stop: int,
                        lo: np.float32, hi: np.float32, zero: np.float32, table: np.ndarray,
                        bounds: np.ndarray) -> None:
    """Sweep columns start..stop-1 of a block in place: W_block [b, m] (the working columns of W^T, updated),
    Err_block [b, m] and codes [b, m] (int8, filled), U_block [b, b] (the factor's block, float32), sT / oT
    [groups, m] (each group's scale and offset per row; oT with no rows: no offsets), groups [b] (each column's
    group)."""
    m = W_block.shape[1]
    affine = oT.shape[0] > 0
    for i in range(start, stop):
        g = groups[i]
        d = U_block[i, i]
        for r in range(m):
            s = sT[g, r]
            w = W_block[i, r]
            x = w - oT[g, r] if affine else w
            q = _code(x, s, lo, hi, zero, table, bounds)
            codes[i, r] = np.int8(q)
            value = q * s + oT[g, r] if affine else q * s
            Err_block[i, r] = (w - value) / d
        push_column_error(W_block, Err_block, U_block, i)


@_compile
def push_column_error(W_block: np.ndarray, Err_block: np.ndarray, U_block: np.ndarray, i: int) -> None:
    """W[k] -= U[i, k] err_i for the block's columns k >= i: column i's normalised error pushed on the columns after
    it (the grid types' sweep, grid_kernels.sweep_grid_columns, shares it)."""
    for k in range(i, W_block.shape[0]):
        u = U_block[i, k]
        for r in range(W_block.shape[1]):
            W_block[k, r] -= u * Err_block[i, r]
