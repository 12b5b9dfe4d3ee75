"""ggml's vector-codebook types (IQ3_S, IQ3_XXS, IQ2_S, IQ2_XS) as lattices: the grids, and the nearest grid point.

These types do not round weights one by one. A super-block of 256 weights has an fp16 scale d and a 4-bit code sc per
group (32 weights; IQ2: 16); each run of ``dim`` consecutive weights (4; IQ2: 8) takes one point of a fixed grid of
magnitudes, and every weight a sign. The value of weight j is

    d * (2 sc + 1) * factor * g_j * sign_j       (factor: IQ3_S 1, IQ3_XXS 1/4, IQ2_XS / IQ2_S 1/8)

which is how gguf-py's dequantizers compute it (``d * (1 + 2 sc)``, ``d * (0.5 + sc) * 0.5``, ``... * 0.25``): each
product is exact in float32 (an fp16 times an integer of at most 5 bits, times a grid value of at most 6 bits), so a
lattice holds the signed grid value g_j * sign_j as the weight's code and the group scale s = d * (2 sc + 1) * factor,
and dequantizes to s * q bit for bit. Only some runs of magnitudes are grid points (IQ3_S: 512 of the 8^4; IQ2_XS:
512 of the 3^8), and IQ3_XXS and IQ2_XS store 7 sign bits per 8 weights: the eighth makes the count of negatives even.
A lattice of these types is codes on the grid with those sign parities (``check_codes``).

The grids are gguf-py's (its dequantizers' tables), read once.

Choosing a grid point is a joint choice over the run's weights: :func:`nearest_points` minimises the weighted error
sum_j h_j (x_j - s q_j)^2 over the NEIGHBOURS grid points nearest to the run's element-wise rounding (a list made
once per grid: the run's true nearest point under any weights is almost always among them), takes each sign from its
weight, and where the parity is odd flips the sign that costs least, as ggml's quantizers do. The solvers call it a
run of columns at a time with h_j = 1 / U_jj^2 (the weight GPTQ's sweep gives column j's error), then push the run's
errors on as usual.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch
from gguf import quants as gguf_quants

__all__ = ["GRIDS", "GridCodebook", "SCALE_CODE_MAX", "SIGN_RUN", "check_codes", "grid_indices", "grid_sweep_tables",
           "nearest_points", "scale_multipliers", "searched_grid_scales", "sweep_run_codes"]

NEIGHBOURS = 32  # grid points searched per run: those nearest to its element-wise rounding
SIGN_RUN = 8  # values per sign byte


@dataclass(frozen=True)
class GridCodebook:
    """One vector-codebook type: its grid, its scale code's meaning, its sign storage (module docstring)."""

    type_name: str  # ggml's name, lower case
    dim: int  # values per grid point
    group_size: int  # values under one 4-bit scale code
    factor: float  # s = d * (2 sc + 1) * factor
    implied_sign: bool  # 7 stored signs per 8 values; the eighth gives an even count of negatives

    @property
    def unit(self) -> int:
        """Columns chosen together: a grid point, or the 8 values whose signs share a parity."""
        return max(self.dim, SIGN_RUN) if self.implied_sign else self.dim

    @property
    def points(self) -> np.ndarray:
        """int8 [K, dim]: the grid's magnitudes, in the order of their stored indices."""
        return _grid_points(self.type_name)

    @property
    def magnitudes(self) -> tuple[int, ...]:
        return tuple(int(v) for v in np.unique(self.points))

    @property
    def codes(self) -> tuple[int, ...]:
        """Every value a code can take (ascending): the signed magnitudes."""
        return tuple(sorted({s * v for v in self.magnitudes for s in (-1, 1)}))


GRIDS = {grid.type_name: grid for grid in (
    GridCodebook("iq3_s", dim=4, group_size=32, factor=1.0, implied_sign=False),
    GridCodebook("iq3_xxs", dim=4, group_size=32, factor=0.25, implied_sign=True),
    GridCodebook("iq2_s", dim=8, group_size=16, factor=0.125, implied_sign=False),
    GridCodebook("iq2_xs", dim=8, group_size=16, factor=0.125, implied_sign=True),
)}
SCALE_CODE_MAX = 15  # the 4-bit scale code


@functools.cache
def _grid_points(type_name: str) -> np.ndarray:
    quant = getattr(gguf_quants, type_name.upper())
    quant.init_grid()
    points = np.asarray(quant.grid).reshape(quant.grid_shape)
    return points.astype(np.int8)


@functools.cache
def _index_table(type_name: str) -> tuple[np.ndarray, np.ndarray]:
    """(position of each magnitude in the sorted magnitudes [128], grid index of each run of positions in base
    len(magnitudes) [B^dim], -1 where the run is no grid point)."""
    points = _grid_points(type_name)
    magnitudes = np.unique(points)
    position = np.full(128, -1, dtype=np.int64)
    position[magnitudes] = np.arange(len(magnitudes))
    base = len(magnitudes)
    keys = (position[points] * base ** np.arange(points.shape[1])).sum(axis=1)
    table = np.full(base ** points.shape[1], -1, dtype=np.int64)
    table[keys] = np.arange(len(points))
    return position, table


def grid_indices(codes: np.ndarray, grid: GridCodebook) -> np.ndarray:
    """The grid index of every run of ``grid.dim`` codes (int8 [..., n] -> int64 [..., n / dim]); -1 for a run of
    magnitudes that is no grid point (or holds a magnitude the grid never uses). One compiled pass
    (grid_kernels.point_indices): the NumPy form made int64 temporaries eight times the codes' size, seconds for
    Whisper's output head."""
    from .grid_kernels import point_indices

    position, table = _index_table(grid.type_name)
    if codes.dtype != np.int8:  # a magnitude past 127 is none of any grid's, as 127 is not
        codes = np.clip(codes, -128, 127).astype(np.int8)
    flat = np.ascontiguousarray(codes).reshape(-1, codes.shape[-1])
    out = np.empty((flat.shape[0], flat.shape[1] // grid.dim), dtype=np.int64)
    point_indices(flat, position, len(grid.magnitudes), table, out)
    return out.reshape(*codes.shape[:-1], -1)


def check_codes(codes: np.ndarray, grid: GridCodebook) -> None:
    """Raise ValueError unless every run of codes is a grid point and, where the type implies a sign, every 8 codes
    hold an even count of negatives."""
    indices = grid_indices(codes, grid)
    if (indices < 0).any():
        run = int(np.argwhere(indices.reshape(-1) < 0)[0, 0])
        values = codes.reshape(-1, grid.dim)[run].tolist()
        raise ValueError(f"codes {values} (run {run}) are not a point of the {grid.type_name.upper()} grid")
    if grid.implied_sign:
        odd = (codes.reshape(-1, SIGN_RUN) < 0).sum(axis=1) % 2 == 1
        if odd.any():
            raise ValueError(f"{grid.type_name.upper()} stores 7 signs per 8 values, so their negatives are an even "
                             f"count; run {int(np.argwhere(odd)[0, 0])} has an odd one")


def scale_multipliers(sub_codes: torch.Tensor, grid: GridCodebook) -> torch.Tensor:
    """float32 (2 sc + 1) * factor of each scale code: what multiplies d (exact)."""
    return (2.0 * sub_codes.float() + 1.0) * grid.factor


def nearest_points(x: torch.Tensor, s: torch.Tensor, h: torch.Tensor, grid: GridCodebook,
                   neighbours: int = NEIGHBOURS, compiled: bool | None = None) -> torch.Tensor:
    """Codes [R, u] for values x [R, u] (u a multiple of the grid's dim) under scales s [R] (> 0; 0 gives the
    smallest point), minimising sum_j h_j (x_j - s q_j)^2 per run of dim values with h [u] or [R, u] (module
    docstring). The search runs over the NEIGHBOURS grid points nearest to the run's element-wise rounding, in the
    compiled loop (``compiled``; default: on the CPU) or in torch operations (an accelerator's way)."""
    rows, width = x.shape
    safe = torch.where(s > 0, s, torch.ones_like(s))
    y = torch.where((s > 0)[:, None], x.abs() / safe[:, None], torch.zeros_like(x))
    weights = h.float().expand(rows, width)
    if x.device.type == "cpu" if compiled is None else compiled:  # one compiled loop over the runs (grid_kernels.py)
        magnitude = _nearest_runs_compiled(y, weights, grid, neighbours)
    else:
        magnitude = torch.empty_like(x)
        for start in range(0, width, grid.dim):
            part = slice(start, start + grid.dim)
            magnitude[:, part] = _nearest_run(y[:, part].contiguous(), weights[:, part], grid, neighbours)
    negative = x < 0
    if grid.implied_sign:
        negative = _even_negatives(negative, weights * y * magnitude)
    return torch.where(negative, -magnitude, magnitude)


def _nearest_runs_compiled(y: torch.Tensor, h: torch.Tensor, grid: GridCodebook, neighbours: int) -> torch.Tensor:
    from .grid_kernels import nearest_runs  # numba: compiled on first use

    out = np.empty(tuple(y.shape), dtype=np.float32)
    nearest_runs(np.ascontiguousarray(y.numpy()), np.ascontiguousarray(h.numpy()), _boundaries(grid.type_name),
                 _candidate_columns(grid.type_name, neighbours), out)
    return torch.from_numpy(out)


def sweep_run_codes(x: np.ndarray, s: np.ndarray, h: np.ndarray, grid: GridCodebook) -> np.ndarray:
    """float32 codes [u, m] of a CPU sweep's run: x [u, m] (rows of the working W^T), scales s [m], column weights
    h [u]; the same choice as ``nearest_points(x.T, s, h, grid).T`` (one compiled call, grid_kernels.py)."""
    from .grid_kernels import run_codes

    out = np.empty(x.shape, dtype=np.float32)
    run_codes(np.ascontiguousarray(x, dtype=np.float32), np.ascontiguousarray(s, dtype=np.float32),
              np.ascontiguousarray(h, dtype=np.float32), _boundaries(grid.type_name),
              _candidate_columns(grid.type_name, NEIGHBOURS), grid.implied_sign, out)
    return out


def grid_sweep_tables(grid: GridCodebook) -> tuple[np.ndarray, np.ndarray]:
    """(boundaries, candidates) as the compiled sweep takes them (grid_kernels.sweep_grid_columns)."""
    return _boundaries(grid.type_name), _candidate_columns(grid.type_name, NEIGHBOURS)


def searched_grid_scales(x: torch.Tensor, h: torch.Tensor, divisors: tuple[float, ...], grid: GridCodebook,
                         neighbours: int, compiled: bool | None = None) -> torch.Tensor:
    """float32 scale of each group x [R, g] (weights h [R, g]): the least-squares refit of the best of the candidates
    max|x| / divisor, each scored by the weighted error of the group's nearest grid points (grid_kernels.py; the
    CPU's compiled loop, else the same search in torch operations; ``compiled`` chooses)."""
    if x.device.type == "cpu" if compiled is None else compiled:
        from .grid_kernels import scale_search

        out = np.empty(x.shape[0], dtype=np.float32)
        scale_search(np.ascontiguousarray(x.float().numpy()), np.ascontiguousarray(h.float().numpy()),
                     np.asarray(divisors, dtype=np.float32), _boundaries(grid.type_name),
                     _candidate_columns(grid.type_name, neighbours), grid.implied_sign, out)
        return torch.from_numpy(out)
    peak = x.abs().amax(dim=1)
    best_error, best_scale = torch.full_like(peak, float("inf")), peak / divisors[0]
    for divisor in divisors:
        candidate = peak / divisor
        q = nearest_points(x, candidate, h, grid, neighbours, compiled=False)
        hq = h * q
        sum_hxg, sum_hgg = (hq * x).sum(1), (hq * q).sum(1)
        refit = torch.where(sum_hgg > 0, sum_hxg / sum_hgg.clamp(min=1e-30), torch.zeros_like(peak))
        refit = torch.where(refit > 0, refit, candidate)
        error = (h * (x - refit[:, None] * q) ** 2).sum(1)
        better = error < best_error
        best_error, best_scale = torch.where(better, error, best_error), torch.where(better, refit, best_scale)
    return best_scale


@functools.cache
def _boundaries(type_name: str) -> np.ndarray:
    """float32 midpoints between the grid's magnitudes: where a value's nearest magnitude changes."""
    levels = np.unique(_grid_points(type_name)).astype(np.float32)
    return (levels[1:] + levels[:-1]) / np.float32(2)


def _nearest_run(y: torch.Tensor, h: torch.Tensor, grid: GridCodebook, neighbours: int) -> torch.Tensor:
    """The grid point (magnitudes [R, dim]) minimising sum_j h_j (y_j - g_j)^2 among the candidates of each run."""
    levels = torch.tensor(grid.magnitudes, dtype=torch.float32, device=y.device)
    places = torch.bucketize(y, (levels[1:] + levels[:-1]) / 2)  # each value's nearest magnitude, by position
    keys = (places * torch.tensor([len(levels) ** j for j in range(grid.dim)], device=y.device)).sum(dim=1)
    candidates = _candidate_tensor(grid.type_name, neighbours, str(y.device))[keys]  # [R, N, dim]
    errors = (h[:, None, :] * (candidates - y[:, None, :]).square()).sum(dim=2)  # [R, N]
    return candidates.gather(1, errors.argmin(dim=1)[:, None, None].expand(-1, 1, grid.dim)).squeeze(1)


@functools.cache
def _candidate_tensor(type_name: str, neighbours: int, device: str) -> torch.Tensor:
    return torch.from_numpy(_candidate_array(type_name, neighbours)).to(device)


@functools.cache
def _candidate_array(type_name: str, neighbours: int) -> np.ndarray:
    """float32 [B^dim, neighbours, dim]: for every run of magnitudes (by position key, as grid_indices), the values
    of the ``neighbours`` grid points nearest to it (Euclidean, ties by grid index; the run itself first where it
    is one)."""
    points = _grid_points(type_name).astype(np.float32)
    magnitudes = np.unique(points)
    dim = points.shape[1]
    keys = np.arange(len(magnitudes) ** dim)
    runs = magnitudes[(keys[:, None] // len(magnitudes) ** np.arange(dim)) % len(magnitudes)]  # [B^dim, dim]
    distances = ((runs[:, None, :] - points[None, :, :]) ** 2).sum(axis=2)
    nearest = np.argsort(distances, axis=1, kind="stable")[:, :neighbours]
    return np.ascontiguousarray(points[nearest])


@functools.cache
def _candidate_columns(type_name: str, neighbours: int) -> np.ndarray:
    """_candidate_array coordinate by coordinate, float32 [B^dim, dim, neighbours]: the compiled loops' layout, in
    which a run's candidates are scored side by side (grid_kernels._best_candidate)."""
    return np.ascontiguousarray(_candidate_array(type_name, neighbours).transpose(0, 2, 1))


def _even_negatives(negative: torch.Tensor, flip_cost: torch.Tensor) -> torch.Tensor:
    """Flip, in every run of 8 with an odd count of negatives, the sign whose flip costs least (cost of flipping j:
    4 s^2 h_j y_j g_j, here without the common 4 s^2)."""
    rows, width = negative.shape
    runs = negative.reshape(rows, width // SIGN_RUN, SIGN_RUN)
    odd = runs.sum(dim=2) % 2 == 1
    cheapest = flip_cost.reshape(rows, width // SIGN_RUN, SIGN_RUN).argmin(dim=2)
    flip = torch.zeros_like(runs).scatter_(2, cheapest.unsqueeze(2), odd.unsqueeze(2))
    return (runs ^ flip).reshape(rows, width)
