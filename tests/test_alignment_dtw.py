"""The rare-word frame alignment's DTW (models/whisper.py): computed an anti-diagonal at a time, it must give the path
of the cell-by-cell recurrence exactly — ties included, since the frame tags, and so the calibration bytes, follow it."""
from __future__ import annotations

import numpy as np
from hypothesis import given, settings, strategies as st

import torch

from tarq_deploy.models.whisper import _median_filter, dtw_path, dtw_paths, token_start_frames


def reference_path(cost: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The textbook recurrence, one cell at a time (steps diagonal, down, right; the first of equal costs wins)."""
    n, m = cost.shape
    acc = np.full((n + 1, m + 1), np.inf)
    acc[0, 0] = 0.0
    step = np.zeros((n + 1, m + 1), dtype=np.int8)
    for i in range(1, n + 1):
        for j in range(1, m + 1):
            choices = (acc[i - 1, j - 1], acc[i - 1, j], acc[i, j - 1])
            k = int(np.argmin(choices))
            acc[i, j] = cost[i - 1, j - 1] + choices[k]
            step[i, j] = k
    i, j, path = n, m, []
    while i > 0 and j > 0:
        path.append((i - 1, j - 1))
        k = step[i, j]
        i, j = (i - 1, j - 1) if k == 0 else (i - 1, j) if k == 1 else (i, j - 1)
    path.reverse()
    return np.array([p[0] for p in path]), np.array([p[1] for p in path])


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 12), st.integers(1, 40), st.integers(0, 2**32 - 1), st.sampled_from([None, 0, 1]))
def test_the_vectorised_path_is_the_cell_by_cell_path(n, m, seed, decimals):
    cost = np.random.default_rng(seed).standard_normal((n, m))
    if decimals is not None:
        cost = np.round(cost, decimals)  # many equal costs: the tie-breaking order decides
    expected, got = reference_path(cost), dtw_path(cost)
    assert all(np.array_equal(a, b) for a, b in zip(expected, got))


def test_a_window_sized_alignment_matches_and_starts_are_monotonic():
    cost = np.random.default_rng(7).standard_normal((60, 700))
    expected, got = reference_path(cost), dtw_path(cost)
    assert all(np.array_equal(a, b) for a, b in zip(expected, got))
    (starts,) = token_start_frames([-cost])
    assert starts == sorted(starts) and starts[0] == 0


@settings(max_examples=20, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 10), st.integers(1, 30)), min_size=1, max_size=5), st.integers(0, 2**32 - 1))
def test_matrices_aligned_together_take_their_own_paths(shapes, seed):
    """Padded to the largest and run in one recurrence, each matrix keeps the path it has alone (ties included)."""
    rng = np.random.default_rng(seed)
    costs = [np.round(rng.standard_normal(shape), 1) for shape in shapes]
    for cost, got in zip(costs, dtw_paths(costs)):
        assert all(np.array_equal(a, b) for a, b in zip(reference_path(cost), got))


@settings(max_examples=30, deadline=None)
@given(st.integers(1, 30), st.integers(0, 2**32 - 1), st.sampled_from([1, 3, 7]))
def test_the_median_filter_is_the_median_of_each_window(frames, seed, width):
    """The sorting network's middle value is torch's median of each reflected window, value for value."""
    x = torch.round(torch.randn(3, 4, frames, generator=torch.Generator().manual_seed(seed)), decimals=1)
    pad = width // 2
    expected = x if frames <= pad else \
        torch.nn.functional.pad(x, (pad, pad), mode="reflect").unfold(-1, width, 1).median(dim=-1).values
    assert torch.equal(_median_filter(x, width), expected)
