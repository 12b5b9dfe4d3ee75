"""The symmetric b-bit weight lattice of the paper's eq. (1).

A Linear weight W (m rows = outputs, n columns = inputs) is cut into row-wise groups of ``group_size`` contiguous
input columns (``group_size = -1``: one group per row, i.e. per-channel). Each (row, group) has one scale s and every
weight in it is stored as an integer code q in [-2^(b-1), 2^(b-1) - 1]; the value it stands for is exactly s * q.

Scale rule (eq. 1 with the symmetric range [-max|W|, max|W|]): s = 2 * max|W_group| / (2^b - 1). The scale is rounded
to float16 *before* the codes are chosen, so the stored scale is the one the codes were rounded against and
dequantization is exact: every target that holds an fp16 scale and integer codes reproduces s * q bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

SCALE_DTYPE = torch.float16
CODE_DTYPE = torch.int8
SUPPORTED_GROUP_SIZES = (-1, 32, 64, 128)
SUPPORTED_BITS = (2, 3, 4, 5, 6, 7, 8)
FP16_MAX = 65504.0


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


def scales_for(w: torch.Tensor, spec: LatticeSpec) -> torch.Tensor:
    """fp16 scales of eq. (1) for the groups of ``w`` ([m, n] or a single group [m, g]); shape [m, n_groups]."""
    m, n = w.shape
    width = spec.group_width(n)
    grouped = w.reshape(m, n // width, width)
    absmax = grouped.abs().amax(dim=2).float()
    scale = (2.0 * absmax / spec.levels).clamp(max=FP16_MAX)
    return scale.to(SCALE_DTYPE)


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
    """Round-to-nearest onto the lattice: the data-free baseline."""
    spec.check_columns(w.shape[1])
    scales = scales_for(w.float(), spec)
    return QuantizedWeight(codes_for(w, scales, spec), scales, spec)


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
