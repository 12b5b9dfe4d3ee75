"""Streaming second moments per Linear: H_common, H_tail (the paper's per-group second moments, which the rareBAL
metric weighs) and the input-error cross-moment H_delta (of the propagation-aware direction D).

Memory is O(n^2) per layer whatever the number of calibration positions: each batch of activations is folded into
the running sums and dropped. Each batch's product is formed in float32 (the paper stores its second moments in fp32;
a float64 product costs 2-3x more on a CPU and far more on a GPU) and added to float64 running sums, so the rounding
error of long sums stays at the per-batch level.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..errors import CalibrationDataError, require_finite

PRODUCT_DTYPE = torch.float32


@dataclass
class LayerStats:
    """Running H_common, H_tail and H_delta of one Linear with n inputs."""

    n: int
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    H_common: torch.Tensor = field(init=False)
    H_tail: torch.Tensor = field(init=False)
    H_delta: torch.Tensor = field(init=False)
    H_delta_tail: torch.Tensor = field(init=False)  # the tail positions' share of H_delta (rareBAL-weighted target)
    n_common: int = 0
    n_tail: int = 0
    n_delta: int = 0

    def __post_init__(self) -> None:
        self.device = torch.device(self.device)
        self.H_common, self.H_tail = self._zeros(), self._zeros()
        # H_delta and H_delta_tail stay empty placeholders until a full-precision stream arrives: methods without
        # the residual step never fill them (fc2 of large-v3: 2 x 210 MB in float64 not held).
        self.H_delta = self.H_delta_tail = torch.zeros((1, 1), dtype=torch.float64,
                                                       device=self.device).expand(self.n, self.n)

    def _zeros(self) -> torch.Tensor:
        return torch.zeros((self.n, self.n), dtype=torch.float64, device=self.device)

    def add(self, x_q: torch.Tensor, tail_mask: torch.Tensor, x_fp: torch.Tensor | None = None) -> None:
        """Fold in activations x_q [..., n] entering the partially quantized layer, their tail tags [...] and,
        when the full-precision stream is tracked, the matching x_fp [..., n]."""
        x_q = x_q.reshape(-1, self.n)
        mask = tail_mask.reshape(-1).to(torch.bool)
        if mask.shape[0] != x_q.shape[0]:
            raise ValueError(f"tail mask has {mask.shape[0]} positions, activations have {x_q.shape[0]}")
        work = PRODUCT_DTYPE
        x_q = x_q.to(self.device, work)
        mask = mask.to(self.device)
        x_tail, x_common = x_q[mask], x_q[~mask]
        self.H_tail += (x_tail.T @ x_tail).to(torch.float64)
        self.H_common += (x_common.T @ x_common).to(torch.float64)
        self.n_tail += int(x_tail.shape[0])
        self.n_common += int(x_common.shape[0])
        if x_fp is not None:
            x_fp = x_fp.reshape(-1, self.n).to(self.device, work)
            if x_fp.shape != x_q.shape:
                raise ValueError(f"x_fp has shape {tuple(x_fp.shape)}, x_q has {tuple(x_q.shape)}")
            delta = x_fp - x_q
            if self.n_delta == 0:
                self.H_delta, self.H_delta_tail = self._zeros(), self._zeros()
            self.H_delta += (delta.T @ x_q).to(torch.float64)
            self.H_delta_tail += (delta[mask].T @ x_tail).to(torch.float64)
            self.n_delta += int(x_q.shape[0])

    def check_usable(self, name: str) -> None:
        """CalibrationDataError when no calibration position reached the layer ``name`` (a layer with no *tail*
        positions is fine: the solver records its fallback); NonFiniteError when a moment holds NaN or Inf."""
        if self.n_common + self.n_tail == 0:
            raise CalibrationDataError(f"{name}: no calibration positions reached this layer, so it cannot be "
                                       f"calibrated (give more or longer utterances, or use --method rtn)")
        for label in ("H_common", "H_tail", "H_delta", "H_delta_tail"):
            require_finite(f"{name}: calibration statistic {label}", getattr(self, label),
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
