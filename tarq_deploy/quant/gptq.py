"""GPTQ: the column sweep that projects W onto the lattice under a PSD metric H (paper, Appendix "Background: GPTQ").

Columns are quantized left to right; each column's rounding error, normalised by the diagonal of the upper Cholesky
factor U of H^-1, is pushed onto the columns not yet quantized (W[:, j+1:] -= e_j U[j, j+1:]). Updates inside a block of
``blocksize`` columns are applied eagerly, the rest lazily once per block (one matmul). Any metric works: the plain
second moment (GPTQ), the rareBAL metric (TARQ) or the identity (which reduces to round-to-nearest).

Group parameters are fixed the moment the sweep enters a group (a K-quant super-block: all its groups at once), from
its current, error-updated columns (as the reference implementation does), already in the form the format stores
them; per-channel scales come from the whole matrix before the sweep. The rule is the lattice's max rule or its
search weighted by the metric's diagonal (``scale_rule``, see lattice_fit.py). Each column is then rounded to the
nearest code under its group's fixed scale s and offset o, so every scheme (symmetric, affine, K-quant) is swept
alike.

Activation order (``act_order``): columns are swept by decreasing diagonal of H, so the inputs that matter most are
rounded first, while the most columns are left to absorb their error. The stored groups must stay contiguous column
ranges (ggml blocks, GPTQ v1 without g_idx), so with act order every group's scale is fixed up front, from the
original weights ("static groups"), and each column is rounded against its own group's scale.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch
from scipy.linalg.lapack import dpotri
from threadpoolctl import threadpool_limits

from ..errors import all_finite
from .lattice import CODE_DTYPE, LatticeSpec, QuantizedWeight, effective_scale_offset, round_codes
from .grid import nearest_points
from .lattice_fit import fit_params
from .choices import PERCDAMP
from .stats import symmetrize_from_upper_

__all__ = ["BLOCKSIZE", "PERCDAMP", "PreparedMetric", "gptq_quantize", "gptq_sweep", "prepare_metric", "sweep_run",
           "weighted_loss", "column_sweep", "ColumnSteps", "CompiledColumns", "TorchColumns"]

BLOCKSIZE = 128
ROW_CHUNK = 8192


@dataclass
class PreparedMetric:
    """A damped metric ready for sweeps: reused by TARQ's pilot and final sweeps and its residual solve."""

    H_inv: torch.Tensor  # float64 (H + damp I)^-1 with dead columns neutralised, in the original column order
    U: torch.Tensor  # float32 upper Cholesky factor of H_inv, rows and columns in sweep order (``perm``)
    dead: torch.Tensor  # bool [n]: columns whose input is always zero
    damp: float
    importance: torch.Tensor  # float32 [n]: diag(H) (0 for dead columns), the weights of the scale search
    perm: torch.Tensor | None = None  # sweep order (act order), None = left to right
    H: torch.Tensor | None = None  # float32 damped metric H + damp I, kept only when asked (scale_refit.py)


def sweep_run(spec: LatticeSpec) -> int:
    """Columns the sweep keeps together: a grid type's run (its codes are chosen jointly), else 1."""
    return spec.grid.unit if spec.grid is not None else 1


def prepare_metric(H: torch.Tensor, percdamp: float = PERCDAMP, act_order: bool = False,
                   run: int = 1, keep_metric: bool = False) -> PreparedMetric:
    """Damp H by ``percdamp`` of its mean diagonal, invert it in float64 and factor the inverse (in sweep order).
    With act order and ``run`` > 1 (a grid type, :func:`sweep_run`), whole runs of neighbouring columns are ordered
    by their summed diagonal, each kept in its own order."""
    if not all_finite(H):
        raise ValueError("metric contains inf or nan (non-finite calibration activations)")
    H = H.to(torch.float64).clone()
    importance = torch.diag(H).clamp(min=0).to(torch.float32)
    dead = torch.diag(H) == 0
    H[dead, dead] = 1.0
    diag_mean = torch.diag(H).mean().item()
    damp = percdamp * diag_mean if diag_mean > 0 else 1.0
    H.diagonal().add_(damp)
    kept = H.to(torch.float32) if keep_metric else None
    L = _cholesky(H)
    del H  # n x n float64 each (fc2 of large-v3: 210 MB): each is let go as soon as the next is made
    H_inv = _inverse_from_cholesky(L)
    del L
    perm = _act_order(importance, run) if act_order else None
    swept = H_inv if perm is None else H_inv[perm.unsqueeze(1), perm]  # one gather: the same values
    U = _cholesky(swept, upper=True)
    del swept
    U = U.to(torch.float32)
    return PreparedMetric(H_inv=H_inv, U=U, dead=dead, damp=damp, importance=importance, perm=perm, H=kept)


def _act_order(importance: torch.Tensor, run: int) -> torch.Tensor:
    """The sweep order: columns (or runs of ``run`` columns) by decreasing diag(H), ties in column order."""
    if run == 1:
        return torch.argsort(importance, descending=True, stable=True)
    runs = torch.argsort(importance.reshape(-1, run).sum(dim=1), descending=True, stable=True)
    return (runs[:, None] * run + torch.arange(run)).reshape(-1)


def _inverse_from_cholesky(L: torch.Tensor) -> torch.Tensor:
    """(L L^T)^-1 from its lower Cholesky factor L (float64).

    On the CPU, LAPACK's dpotri through SciPy on one BLAS thread. torch's cholesky_inverse took 0.83 s at n = 2048
    on the idle 2-core EPYC where dpotri takes 0.11 s, and 18 s against 0.5 s with the cores oversubscribed; on two
    threads dpotri's spinning workers slowed the next matmuls and were no faster under load. One thread also keeps
    the bytes independent of the thread count."""
    if L.device.type != "cpu":
        return torch.cholesky_inverse(L)
    with threadpool_limits(limits=1, user_api="blas"):
        inverse, info = dpotri(L.numpy(), lower=1)
    if info != 0:
        raise torch.linalg.LinAlgError(f"dpotri failed (info {info}) on a factor that Cholesky accepted")
    # dpotri wrote the inverse's lower triangle; seen transposed that is an upper triangle, which
    # symmetrize_from_upper_ mirrors in place: the same values as the lower triangle plus its transpose, without three
    # n x n float64 temporaries (n = 5120, 0.37 -> 0.05 s). dpotri's array is column-major, so the view is row-major.
    inverse_t = torch.from_numpy(inverse).T
    symmetrize_from_upper_(inverse_t)
    return inverse_t


def _cholesky(A: torch.Tensor, upper: bool = False) -> torch.Tensor:
    """Cholesky that retries with growing jitter: near-singular metrics come from few calibration positions.

    Terminates on every input: a metric holding NaN or Inf is refused at once, and the jitter grows tenfold from
    1e-9 to 1e3 times the mean diagonal (1 for an all-zero diagonal), so at most 13 retries."""
    if not all_finite(A):
        raise torch.linalg.LinAlgError("metric holds NaN or Inf values (non-finite weights or activations)")
    L, info = torch.linalg.cholesky_ex(A, upper=upper)
    if info.item() == 0:
        return L
    scale = torch.diag(A).abs().mean().item()
    scale = scale if scale > 0 else 1.0
    eye = torch.eye(A.shape[0], dtype=A.dtype, device=A.device)
    for power in range(-9, 4):  # jitter 1e-9 ... 1e3 times the mean diagonal
        L, info = torch.linalg.cholesky_ex(A + (10.0**power * scale) * eye, upper=upper)
        if info.item() == 0:
            return L
    raise torch.linalg.LinAlgError("metric is not positive definite even after heavy jitter")


def gptq_quantize(W: torch.Tensor, H: torch.Tensor, spec: LatticeSpec, percdamp: float = PERCDAMP,
                  blocksize: int = BLOCKSIZE, scale_rule: str = "max", act_order: bool = False) -> QuantizedWeight:
    """Project W [m, n] onto the lattice under metric H [n, n]."""
    metric = prepare_metric(H.to(W.device), percdamp, act_order, sweep_run(spec))
    return gptq_sweep(W, metric, spec, blocksize, scale_rule=scale_rule)


def gptq_sweep(W: torch.Tensor, metric: PreparedMetric, spec: LatticeSpec, blocksize: int = BLOCKSIZE,
               row_chunk: int = ROW_CHUNK, scale_rule: str = "max") -> QuantizedWeight:
    """The column sweep of Algorithm 2 with lazy block updates; returns codes and group parameters.

    Rows are independent under a shared metric, so tall matrices (Whisper's 51865-row output head) are swept in
    chunks of ``row_chunk`` rows: the same arithmetic per row, with the working block staying in cache."""
    if W.shape[0] <= row_chunk:
        return _sweep_rows(W, metric, spec, blocksize, scale_rule)
    parts = [_sweep_rows(W[r : r + row_chunk], metric, spec, blocksize, scale_rule)
             for r in range(0, W.shape[0], row_chunk)]
    params = {k: torch.cat([p.params()[k] for p in parts]) for k in parts[0].params()}
    return QuantizedWeight(torch.cat([p.codes for p in parts]), spec=spec, **params)


def _sweep_rows(W: torch.Tensor, metric: PreparedMetric, spec: LatticeSpec, blocksize: int,
                scale_rule: str) -> QuantizedWeight:
    m, n = W.shape
    spec.check_columns(n)
    width, fit_width = spec.group_width(n), spec.param_width(n)
    blocksize = max(blocksize, fit_width) if spec.group_size != -1 else blocksize  # a super-block fits in one block
    if spec.group_size != -1 and blocksize % fit_width != 0:
        raise ValueError(f"blocksize {blocksize} must be a multiple of group size {fit_width}")
    columns = CompiledColumns if W.device.type == "cpu" else TorchColumns
    return column_sweep(W, metric, spec, blocksize, scale_rule, width, fit_width, columns)


def column_sweep(W: torch.Tensor, metric: PreparedMetric, spec: LatticeSpec, blocksize: int, scale_rule: str,
                 width: int, fit_width: int, columns: type[ColumnSteps]) -> QuantizedWeight:
    """The sweep, the one place its loop is written: blocks of ``blocksize`` columns, left to right; entering each
    group (a K-quant super-block: all its groups) its parameters are fixed from its current, error-updated columns;
    the block's columns are then rounded one by one, each error pushed on the block's later columns (``columns``:
    the same float32 steps compiled on the CPU, as torch operations on an accelerator); last, the block's errors
    are pushed on every column right of it in one matmul. It works on W^T, so that a column of W is a contiguous
    row in memory."""
    m, n = W.shape
    Wt, order, group_of, importance, fitted = _sweep_setup(W, metric, spec, scale_rule, width)
    static = bool(fitted)  # every group's parameters fixed up front
    U = metric.U.to(W.device)
    steps = columns(spec, Wt, U, group_of, n // width)
    if static:
        steps.set_group_params(0, *effective_scale_offset(spec, fitted[0]))
    for i1 in range(0, n, blocksize):
        i2 = min(i1 + blocksize, n)
        steps.begin_block(i1, i2)
        run = i2 - i1 if static else fit_width  # columns between two group entries
        for start in range(0, i2 - i1, run):
            if not static:  # entering a group: fix its parameters from its current columns
                params = fit_params(steps.block_columns(start, fit_width), spec, scale_rule,
                                    importance[i1 + start : i1 + start + fit_width])
                fitted.append(params)
                steps.set_group_params(group_of[i1 + start], *effective_scale_offset(spec, params))
            steps.sweep(start, start + run)
        Wt[i2:] -= U[i1:i2, i2:].T @ steps.block_errors()
    return _assembled(steps.codes(), order, fitted, spec)


def _sweep_setup(W: torch.Tensor, metric: PreparedMetric, spec: LatticeSpec, scale_rule: str, width: int):
    """What the sweep starts from: the working W^T in sweep order, the sweep order's group of each column, and
    the group parameters fixed up front (static groups) or None (fixed as the sweep enters each group)."""
    m, n = W.shape
    importance = metric.importance.to(W.device)
    W = W.to(torch.float32).clone()
    W[:, metric.dead] = 0.0
    run = sweep_run(spec)
    if run > 1 and metric.perm is not None and not _keeps_runs(metric.perm, run):
        raise ValueError(f"a {spec.scheme} lattice chooses runs of {run} neighbouring columns together, but the "
                         f"metric's act order splits them: prepare it with run={run}")
    static = spec.group_size == -1 or metric.perm is not None
    order = metric.perm.to(W.device) if metric.perm is not None else torch.arange(n, device=W.device)
    fitted = [fit_params(W, spec, scale_rule, importance)] if static else []
    return W.T[order].contiguous(), order, (order // width).tolist(), importance, fitted


def _keeps_runs(perm: torch.Tensor, run: int) -> bool:
    """True when ``perm`` moves whole aligned runs of ``run`` columns, each in its own order."""
    runs = perm.reshape(-1, run)
    return bool((runs[:, 0] % run == 0).all() and (runs - runs[:, :1] == torch.arange(run)).all())


class ColumnSteps(Protocol):
    """The per-column steps of one block of the sweep, over the working W^T [n, m] and the factor U [n, n]: each
    group's scale and offset kept per row (``set_group_params``), the block's working copy (``begin_block``), and
    ``sweep``: for each column i of start..stop-1, its codes q = round((w - o) / s), err = (w - q s - o) / U[i, i],
    and W[k] -= U[i, k] err for the block's columns k >= i. A grid type's codes are chosen a run at a time."""

    def __init__(self, spec: LatticeSpec, Wt: torch.Tensor, U: torch.Tensor, group_of: list[int],
                 n_groups: int) -> None: ...

    def set_group_params(self, group: int, s: torch.Tensor, o: torch.Tensor | None) -> None:
        """Groups group.. group + s.shape[1] - 1 take scales s [m, k] and offsets o [m, k] (None: none)."""

    def begin_block(self, i1: int, i2: int) -> None: ...

    def block_columns(self, start: int, width: int) -> torch.Tensor:
        """The block's current columns start.. start + width - 1, as W [m, width] (what a group is fitted to)."""

    def sweep(self, start: int, stop: int) -> None: ...

    def block_errors(self) -> torch.Tensor:
        """The block's normalised errors [b, m], as torch: what the matmul pushes on the columns right of it."""

    def codes(self) -> torch.Tensor:
        """The codes [n, m] (one row per column, in sweep order)."""


class CompiledColumns:
    """The steps on the CPU: a compiled loop over NumPy views of the same float32 buffers (sweep_kernel.py; a grid
    type's runs as NumPy steps). The same IEEE float32 operations in the same order as TorchColumns, so the same
    codes (tests/test_solvers.py)."""

    def __init__(self, spec: LatticeSpec, Wt: torch.Tensor, U: torch.Tensor, group_of: list[int],
                 n_groups: int) -> None:
        m = Wt.shape[1]
        self.spec, self.Wt, self.U = spec, Wt.numpy(), U.numpy()
        self.sT = np.zeros((n_groups, m), dtype=np.float32)  # scale (and offset) of each group, one row per group
        self.oT = np.zeros((n_groups if spec.affine else 0, m), dtype=np.float32)  # no rows: no offsets
        self.codes_t = np.zeros((Wt.shape[0], m), dtype=np.int8)
        self.groups = np.asarray(group_of, dtype=np.int64)
        self.steps = _grid_steps(spec) if sweep_run(spec) > 1 else _compiled_steps(spec)

    def set_group_params(self, group: int, s: torch.Tensor, o: torch.Tensor | None) -> None:
        self.sT[group : group + s.shape[1]] = s.T.numpy()
        if self.spec.affine:
            self.oT[group : group + s.shape[1]] = o.T.numpy()

    def begin_block(self, i1: int, i2: int) -> None:
        self.i1, self.i2 = i1, i2
        self.W_block = self.Wt[i1:i2].copy()
        self.Err_block = np.zeros_like(self.W_block)
        self.U_block = np.ascontiguousarray(self.U[i1:i2, i1:i2])

    def block_columns(self, start: int, width: int) -> torch.Tensor:
        return torch.from_numpy(self.W_block[start : start + width]).T

    def sweep(self, start: int, stop: int) -> None:
        i1, i2 = self.i1, self.i2
        self.steps(self.W_block, self.Err_block, self.U_block, self.codes_t[i1:i2], self.sT, self.oT,
                   self.groups[i1:i2], start, stop)

    def block_errors(self) -> torch.Tensor:
        return torch.from_numpy(self.Err_block)

    def codes(self) -> torch.Tensor:
        return torch.from_numpy(self.codes_t).to(CODE_DTYPE)


def _compiled_steps(spec: LatticeSpec):
    """sweep_kernel.sweep_block_columns with the lattice's code range, or its codebook, bound in (float32)."""
    from .sweep_kernel import sweep_block_columns  # numba: compiled on first use, then read from its cache

    empty = np.zeros(0, dtype=np.float32)
    if spec.codebook is None:
        lo, hi, zero, table, bounds = np.float32(spec.qmin), np.float32(spec.qmax), np.float32(0.0), empty, empty
    else:
        table = np.asarray(spec.codebook, dtype=np.float32)
        bounds = (table[1:] + table[:-1]) / np.float32(2)
        lo = hi = np.float32(0.0)
        zero = np.float32(min(spec.codebook, key=abs))

    def steps(W_block, Err_block, U_block, codes, sT, oT, groups, start, stop) -> None:  # noqa: ANN001
        sweep_block_columns(W_block, Err_block, U_block, codes, sT, oT, groups, start, stop, lo, hi, zero, table,
                            bounds)

    return steps


def _grid_steps(spec: LatticeSpec):
    """grid_kernels.sweep_grid_columns with the type's grid bound in: entering each run of ``sweep_run`` columns,
    their codes are chosen together (the grid points nearest under the weights 1 / U_jj^2 the sweep gives each
    column's error); the columns are then swept one by one as any other, each error pushed on the columns after it."""
    from .grid import grid_sweep_tables
    from .grid_kernels import sweep_grid_columns  # numba: compiled on first use, then read from its cache

    if spec.affine:
        raise ValueError(f"{spec.scheme}: a grid type has no offsets")
    unit, (boundaries, candidates) = sweep_run(spec), grid_sweep_tables(spec.grid)

    def steps(W_block, Err_block, U_block, codes, sT, oT, groups, start, stop) -> None:  # noqa: ANN001
        sweep_grid_columns(W_block, Err_block, U_block, codes, sT, groups, start, stop, unit, boundaries, candidates,
                           spec.grid.implied_sign)

    return steps


class TorchColumns:
    """The steps on an accelerator: every one a torch operation on the device."""

    def __init__(self, spec: LatticeSpec, Wt: torch.Tensor, U: torch.Tensor, group_of: list[int],
                 n_groups: int) -> None:
        m = Wt.shape[1]
        self.spec, self.Wt, self.U, self.group_of = spec, Wt, U, group_of
        self.sT = torch.zeros((n_groups, m), device=Wt.device)  # scale (and offset) of each group, one row per group
        self.oT = torch.zeros_like(self.sT) if spec.affine else None
        self.codes_t = torch.zeros((Wt.shape[0], m), dtype=CODE_DTYPE, device=Wt.device)
        self.unit = sweep_run(spec)

    def set_group_params(self, group: int, s: torch.Tensor, o: torch.Tensor | None) -> None:
        self.sT[group : group + s.shape[1]] = s.T
        if self.oT is not None:
            self.oT[group : group + s.shape[1]] = o.T

    def begin_block(self, i1: int, i2: int) -> None:
        self.i1 = i1
        self.W_block = self.Wt[i1:i2].clone()
        self.Err_block = torch.zeros_like(self.W_block)
        self.U_block = self.U[i1:i2, i1:i2]

    def block_columns(self, start: int, width: int) -> torch.Tensor:
        return self.W_block[start : start + width].T

    def sweep(self, start: int, stop: int) -> None:
        W_block, U_block, unit = self.W_block, self.U_block, self.unit
        for i in range(start, stop):
            group = self.group_of[self.i1 + i]
            s = self.sT[group]
            o = None if self.oT is None else self.oT[group]
            w = W_block[i]
            if unit > 1 and i % unit == 0:  # entering a run of a grid type: its codes are chosen together
                run_codes = _grid_run(W_block[i : i + unit], s, U_block[i : i + unit, i : i + unit], self.spec)
            q = run_codes[i % unit] if unit > 1 else round_codes(w, s, o, self.spec)
            self.codes_t[self.i1 + i] = q.to(CODE_DTYPE)
            value = q * s if o is None else q * s + o
            err = (w - value) / U_block[i, i]
            W_block[i:] -= U_block[i, i:].unsqueeze(1) * err.unsqueeze(0)
            self.Err_block[i] = err

    def block_errors(self) -> torch.Tensor:
        return self.Err_block

    def codes(self) -> torch.Tensor:
        return self.codes_t


def _grid_run(W_run: torch.Tensor, s: torch.Tensor, U_run: torch.Tensor, spec: LatticeSpec) -> torch.Tensor:
    """float32 codes [u, m] of a grid type's run of u columns (rows W_run [u, m] of the working W^T): the grid points
    nearest under the weights 1 / U_jj^2 that the sweep gives each column's error (grid.py). The codes are fixed
    for the run; its columns are then swept one by one as any other, each error pushed on the columns after it."""
    weights = 1.0 / torch.diagonal(U_run).float().square()
    return nearest_points(W_run.T.float(), s.float(), weights, spec.grid).T.float()


def _assembled(codes_t: torch.Tensor, order: torch.Tensor, fitted: list[dict], spec: LatticeSpec) -> QuantizedWeight:
    """The sweep's codes (one row per column, in sweep order) back in column order, with the group parameters."""
    codes = torch.empty_like(codes_t)
    codes[order.to(codes_t.device)] = codes_t
    params = {k: torch.cat([f[k] for f in fitted], dim=1) for k in fitted[0]}
    return QuantizedWeight(codes.T.contiguous(), spec=spec, **params)


def weighted_loss(delta_W: torch.Tensor, H: torch.Tensor) -> float:
    """tr(dW H dW^T): the H-weighted reconstruction loss (the paper's group loss, with H for H_g)."""
    dW = delta_W.to(torch.float64)
    return float(torch.einsum("ij,jk,ik->", dW, H.to(dW.device, torch.float64), dW))
