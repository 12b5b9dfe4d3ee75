"""Streaming second moments per Linear: H_common, H_tail (the paper's per-group second moments, which the rareBAL
metric weighs) and the input-error cross-moment H_delta (of the propagation-aware direction D).

Memory is O(n^2) per layer whatever the number of calibration positions: each batch of activations is folded into
the running sums and dropped.

Arithmetic (the Hessian products are a third of a CPU calibration's time, so each is done once and no wider than
needed):
- each position enters one Gram product only: the common positions' x^T x and the tail positions' (the rows split by
  the tail tags), never a Gram of all positions and a tail Gram to subtract from it, which formed the tail rows'
  products twice (~17 % of them here) and left H_common as a difference. Each Gram forms only its upper block
  triangle (``upper_gram_``), accumulated in place. The cross-moments split the same way: H_delta is the sum of its
  common and tail parts, and each position's product is formed once.
- a Linear that alone reads its input and has fewer outputs than inputs (an MLP's down projection, fc2: m = n / 4)
  gets W H_delta instead of H_delta (``projection``): the residual step needs nothing else, and
  sum (W delta)^T x_q costs 2 m n per position where delta^T x_q costs n^2 (fc2: half);
- products are formed and summed in float32 (the paper keeps its second moments in fp32) for up to
  ``FOLD_POSITIONS`` positions, then folded into float64 running sums: long sums keep float64's rounding, and the
  n x n float32-to-float64 pass (as slow as the product itself for the decoder's short windows) runs once per fold
  instead of once per window. A fold adds the pending Gram as formed (its upper block triangle) to the float64 sum;
  the sum is made symmetric from its upper triangle once, when it is read (n = 5120, large-v3's fc2: 71 ms a fold
  where symmetrising every fold took 287 ms). The values are the same either way: the upper triangle holds the same
  float64 sums, and the lower one is a copy of it.
"""

from __future__ import annotations

import torch

from ..errors import CalibrationDataError, require_finite
from .precision import full_precision

__all__ = ["LayerStats", "symmetrize_from_upper_", "upper_gram_"]

PRODUCT_DTYPE = torch.float32
FOLD_POSITIONS = 16384  # positions summed in float32 before a fold into the float64 sums
GRAM_PARTS = 4  # row blocks of the upper-triangular Gram product: 10 of 16 blocks formed instead of 16


def upper_gram_(buffer: torch.Tensor, x: torch.Tensor, parts: int = GRAM_PARTS) -> None:
    """buffer += x^T x on the blocks on and above the diagonal only (x [N, n]); the rest of buffer is left as it was.

    torch has no symmetric rank-k update (BLAS syrk). Cutting the rows of x^T x into ``parts`` blocks and forming
    each block from the diagonal rightwards skips (parts - 1) / (2 parts) of the flops in GEMMs still large enough to
    run at full speed (n = 2048: 50 ms against 75 ms for the whole product, 2 cores). BLAS's own syrk through SciPy
    was as fast alone but slowed the model's next matmuls by a third: its idle threads spin on the cores torch needs."""
    n = x.shape[1]
    bounds = [round(i * n / parts) for i in range(parts + 1)] if n >= 512 else [0, n]
    for start, stop in zip(bounds[:-1], bounds[1:]):
        buffer[start:stop, start:].addmm_(x[:, start:stop].T, x[:, start:])


def symmetrize_from_upper_(matrix: torch.Tensor, block: int = 512) -> None:
    """Overwrite the strict lower triangle of the square ``matrix`` with its upper triangle's transpose, in place, a
    block of rows at a time (no n x n temporary: 200 MB each for large-v3's fc2 in float64)."""
    n = matrix.shape[0]
    for start in range(0, n, block):
        stop = min(start + block, n)
        matrix[start:stop, :start] = matrix[:start, start:stop].T
        diagonal = matrix[start:stop, start:stop]
        diagonal.copy_(torch.triu(diagonal) + torch.triu(diagonal, diagonal=1).T)


RowSplit = tuple[torch.Tensor, torch.Tensor] | None  # (untagged row indices, tagged ones); None: no row tagged


def _row_split(tail: torch.Tensor) -> RowSplit:
    """The row indices of the tail tags, found once for every tensor split by them (x_q, then delta)."""
    if not bool(tail.any()):
        return None
    return (~tail).nonzero().squeeze(1), tail.nonzero().squeeze(1)


def _split_rows(x: torch.Tensor, split: RowSplit) -> tuple[torch.Tensor, torch.Tensor]:
    """(the rows of x not tagged tail, the tagged ones), each in row order; x itself, uncopied, when no row is
    tagged. Gathered by index (index_select), which copies a 1500 x 2048 float32 window's rows in a third of the time
    boolean-mask indexing took, the same rows in the same order."""
    if split is None:
        return x, x[:0]
    common, tail = split
    return x.index_select(0, common), x.index_select(0, tail)


def _tail_root_weights(tail_mask: torch.Tensor, split: RowSplit, device: torch.device) -> torch.Tensor | None:
    """sqrt of the tagged rows' tail weights, as a column, where the tags are weights (a term list's: a weight-2
    term's positions count twice in H_tail); None for boolean tags or weights all 1 -- the rows then go in as they
    are, so unweighted runs keep their bytes."""
    if split is None or not tail_mask.is_floating_point():
        return None
    weights = tail_mask.reshape(-1).to(device, PRODUCT_DTYPE).index_select(0, split[1])
    return None if bool((weights == 1).all()) else weights.sqrt()[:, None]


def _weighted(parts: tuple[torch.Tensor, torch.Tensor], root_weights: torch.Tensor | None
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """(common rows, tail rows scaled by the root weights): each Gram or cross product of two scaled rows carries
    the row's weight once."""
    return parts if root_weights is None else (parts[0], parts[1] * root_weights)


class _Folded:
    """A moment of LayerStats, stored as ``_<name>``: reading it folds the pending float32 sums first; assigning it
    (a test planting a metric) replaces it after the fold."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.slot = f"_{name}"

    def __get__(self, stats: "LayerStats", owner: type | None = None) -> torch.Tensor:
        stats._fold()
        if self.slot in stats._upper_only:  # a Gram sum folded since it was last read: its lower triangle is stale
            symmetrize_from_upper_(getattr(stats, self.slot))
            stats._upper_only.discard(self.slot)
        return getattr(stats, self.slot)

    def __set__(self, stats: "LayerStats", value: torch.Tensor) -> None:
        stats._fold()
        stats._upper_only.discard(self.slot)
        setattr(stats, self.slot, value)


class LayerStats:
    """Running H_common, H_tail, H_delta and H_delta_tail of one Linear with n inputs; reading any of them folds
    what is pending. With ``projection`` (the Linear's weight W [m, n]) the cross-moments H_delta and H_delta_tail
    hold W H_delta and W H_delta_tail [m, n] instead (read them through ``weighted_residual``)."""

    def __init__(self, n: int, device: torch.device | str = "cpu", projection: torch.Tensor | None = None) -> None:
        self.n = n
        self.device = torch.device(device)
        # a copy: the Linear's own weight takes its lattice values once solved
        self.projection = projection.to(self.device, PRODUCT_DTYPE, copy=True) if projection is not None else None
        self._H_common, self._H_tail = self._zeros(), self._zeros()
        # H_delta and H_delta_tail stay empty placeholders until a full-precision stream arrives: methods without
        # the residual step never fill them (fc2 of large-v3: 2 x 210 MB in float64 not held).
        rows = self.projection.shape[0] if self.projection is not None else n
        self._H_delta = self._H_delta_tail = torch.zeros((1, 1), dtype=torch.float64,
                                                         device=self.device).expand(rows, n)
        self.n_common = self.n_tail = self.n_delta = 0
        self._pending: dict[str, torch.Tensor] = {}  # float32 sums not yet folded (keys: _fold)
        self._upper_only: set[str] = set()  # Gram sums ("_H_common", "_H_tail") whose lower triangle is stale
        self._pending_positions = 0

    def _zeros(self) -> torch.Tensor:
        return torch.zeros((self.n, self.n), dtype=torch.float64, device=self.device)

    def add(self, x_q: torch.Tensor, tail_mask: torch.Tensor, x_fp: torch.Tensor | None = None) -> None:
        """Fold in activations x_q [..., n] entering the partially quantized layer, their tail tags [...] and,
        when the full-precision stream is tracked, the matching x_fp [..., n]."""
        # In float32 whatever autocast the forward passes run under (precision.compute_in): bfloat16 products
        # round each window's sum to 8 bits, which left encoder fc2's H indefinite (bench/results/precision).
        with full_precision(self.device):
            self._add(x_q, tail_mask, x_fp)

    def _add(self, x_q: torch.Tensor, tail_mask: torch.Tensor, x_fp: torch.Tensor | None) -> None:
        x_q = x_q.reshape(-1, self.n)
        mask = tail_mask.reshape(-1).to(torch.bool)
        if mask.shape[0] != x_q.shape[0]:
            raise ValueError(f"tail mask has {mask.shape[0]} positions, activations have {x_q.shape[0]}")
        x_q = x_q.to(self.device, PRODUCT_DTYPE).contiguous()
        mask = mask.to(self.device)
        split = _row_split(mask)
        root_weights = _tail_root_weights(tail_mask, split, self.device)
        parts = _weighted(_split_rows(x_q, split), root_weights)
        for key, rows in zip(("gram_common", "gram_tail"), parts):
            if rows.shape[0]:
                self._accumulate_gram(key, rows)
        self.n_common += int(parts[0].shape[0])
        self.n_tail += int(parts[1].shape[0])
        if x_fp is not None:
            x_fp = x_fp.reshape(-1, self.n).to(self.device, PRODUCT_DTYPE)
            if x_fp.shape != x_q.shape:
                raise ValueError(f"x_fp has shape {tuple(x_fp.shape)}, x_q has {tuple(x_q.shape)}")
            delta = x_fp - x_q  # formed first: H_delta is small beside x_fp^T x_q, a difference of those would cancel
            if self.projection is not None:
                delta = delta @ self.projection.T  # W delta: only W H_delta = sum (W delta)^T x_q is needed
            for key, delta_rows, rows in zip(("cross_common", "cross_tail"),
                                             _weighted(_split_rows(delta, split), root_weights), parts):
                if rows.shape[0]:
                    self._accumulate_product(key, delta_rows, rows)
            self.n_delta += int(x_q.shape[0])
        self._pending_positions += int(x_q.shape[0])
        if self._pending_positions >= FOLD_POSITIONS:
            self._fold()

    def _accumulate_gram(self, key: str, x: torch.Tensor) -> None:
        """pending[key] += x^T x, its upper triangle (see upper_gram_)."""
        if key not in self._pending:
            self._pending[key] = torch.zeros((self.n, self.n), dtype=PRODUCT_DTYPE, device=self.device)
        upper_gram_(self._pending[key], x)

    def _accumulate_product(self, key: str, a: torch.Tensor, b: torch.Tensor) -> None:
        """pending[key] += a^T b."""
        if key not in self._pending:
            self._pending[key] = torch.zeros((a.shape[1], b.shape[1]), dtype=PRODUCT_DTYPE, device=self.device)
        self._pending[key].addmm_(a.T, b)

    def _fold(self) -> None:
        """Add the pending float32 sums to the float64 ones: H_common += the common positions' Gram, H_tail += the
        tail's; H_delta += both cross parts, H_delta_tail += the tail's."""
        if not self._pending:
            return
        pending, self._pending, self._pending_positions = self._pending, {}, 0
        for key, slot in (("gram_common", "_H_common"), ("gram_tail", "_H_tail")):
            if key in pending:  # its upper block triangle, as upper_gram_ formed it; symmetric once read (_Folded)
                getattr(self, slot).add_(pending[key])
                self._upper_only.add(slot)
        if "cross_common" in pending or "cross_tail" in pending:
            self._widen_delta()
        if "cross_common" in pending:
            self._H_delta.add_(pending["cross_common"])
        if "cross_tail" in pending:
            self._H_delta.add_(pending["cross_tail"])
            self._H_delta_tail.add_(pending["cross_tail"])

    def _widen_delta(self) -> None:
        if self._H_delta.stride() == (0, 0):  # still the placeholder
            self._H_delta, self._H_delta_tail = (torch.zeros(self._H_delta.shape, dtype=torch.float64,
                                                             device=self.device) for _ in range(2))

    # The moments, folded on reading (see _Folded). With a projection, H_delta and H_delta_tail hold W H_delta and
    # W H_delta_tail: read them through weighted_residual.
    H_common = _Folded()
    H_tail = _Folded()
    H_delta = _Folded()
    H_delta_tail = _Folded()

    def weighted_residual(self, W: torch.Tensor, tail_weight: float = 1.0) -> torch.Tensor:
        """W H_delta,w in float32: W (H_delta + (tail_weight - 1) H_delta_tail), the cross-moment weighted as the
        metric weighs positions (tail_weight = lam; 1: plain H_delta). ``W`` [m, n] must be the projection when
        there is one (its product is already formed)."""
        H_delta = self.H_delta if tail_weight == 1.0 else self.H_delta + (tail_weight - 1.0) * self.H_delta_tail
        if self.projection is not None:
            if not torch.equal(W.to(self.device, PRODUCT_DTYPE), self.projection):
                raise ValueError("these statistics hold W H_delta for another weight")
            return H_delta.to(W.device, torch.float32)
        return W.float() @ H_delta.to(W.device, torch.float32)

    def check_usable(self, name: str) -> None:
        """CalibrationDataError when no calibration position reached the layer ``name`` (a layer with no *tail*
        positions is fine: the solver records its fallback); NonFiniteError when a moment holds NaN or Inf."""
        if self.n_common + self.n_tail == 0:
            raise CalibrationDataError(f"{name}: no calibration positions reached this layer, so it cannot be "
                                       f"calibrated (give more or longer utterances, or use --method rtn)")
        for label in ("H_common", "H_tail", "H_delta", "H_delta_tail"):
            moment = getattr(self, label)
            if moment.stride() == (0, 0):  # a placeholder: one value stands for all
                moment = moment[:1, :1]
            require_finite(f"{name}: calibration statistic {label}", moment,
                           " (its inputs hold NaN or Inf: a non-finite weight or audio sample upstream of it)")

    @property
    def H(self) -> torch.Tensor:
        """The plain, frequency-weighted second moment H = H_common + H_tail."""
        return self.H_common + self.H_tail

    @property
    def tail_share(self) -> float:
        """The tail share p = N_tail / N (the paper's frequency-weighted reconstruction mixture)."""
        total = self.n_common + self.n_tail
        return self.n_tail / total if total else 0.0

    def state_dict(self) -> dict[str, torch.Tensor]:
        counts = torch.tensor([self.n_common, self.n_tail, self.n_delta], dtype=torch.int64)
        return {"H_common": self.H_common.cpu(), "H_tail": self.H_tail.cpu(),
                "H_delta": self.H_delta.cpu().contiguous(), "H_delta_tail": self.H_delta_tail.cpu().contiguous(),
                "counts": counts}

    @classmethod
    def from_state_dict(cls, state: dict[str, torch.Tensor], device: torch.device | str = "cpu") -> "LayerStats":
        stats = cls(n=state["H_common"].shape[0], device=torch.device(device))
        stats.H_common.copy_(state["H_common"])
        stats.H_tail.copy_(state["H_tail"])
        stats.H_delta = state["H_delta"].to(stats.device, torch.float64).clone()
        stats.H_delta_tail = state["H_delta_tail"].to(stats.device, torch.float64).clone() if "H_delta_tail" in state \
            else torch.zeros_like(stats.H_delta)
        stats.n_common, stats.n_tail, stats.n_delta = (int(v) for v in state["counts"])
        return stats
