"""One Linear's solve as the calibration driver calls it: the inputs checked, the solver (tarq.quantize_weight) run
on the weight -- a slice of rows at a time where the weight is large and the rows' answers are independent -- and
the per-layer log record of what it did. Pure: weights and statistics in, lattice and record out."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

import torch

from ..errors import require_finite
from .lattice import LatticeSpec, QuantizedWeight
from .stats import LayerStats
from .tarq import MetricCache, SolveInfo, TarqConfig, quantize_weight, rounding_losses

__all__ = ["LayerRecord", "solve_layer", "ROW_SLICE_BYTES", "row_slices", "rows_per_slice", "rows_of", "joined_rows",
           "joined_info"]


@dataclass
class LayerRecord:
    """What the solver did to one Linear, for the per-layer JSON log (the field order is the log's key order)."""

    name: str
    shape: tuple[int, int]
    method: str
    lam: float | None = None
    alpha: float | None = None
    p: float | None = None
    n_common: int = 0
    n_tail: int = 0
    tr_common: float | None = None
    tr_tail: float | None = None
    fallback: str | None = None
    scale_refit: dict | None = None
    loss_rtn: float | None = None
    loss_final: float | None = None
    tail_loss_rtn: float | None = None
    tail_loss_final: float | None = None
    common_loss_rtn: float | None = None
    common_loss_final: float | None = None
    seconds: float = 0.0

    def to_json(self) -> dict:
        record = asdict(self)
        if record["scale_refit"] is None:  # no refit asked: the record keeps the keys it always had
            del record["scale_refit"]
        return record


def solve_layer(
    name: str, W: torch.Tensor, stats: LayerStats | None, spec: LatticeSpec, config: TarqConfig,
    identity_weight: float = 0.0, metrics: MetricCache | None = None,
) -> tuple[QuantizedWeight, LayerRecord]:
    """Quantize one Linear weight W [m, n] (tarq.quantize_weight) after checking its inputs, and write its log
    record: the solver's figures, the seconds it took and, with ``config.record_losses``, the group losses of plain
    rounding and of the answer."""
    require_finite(f"{name}.weight", W, "; refusing to quantize non-finite weights")
    if config.needs_data:
        if stats is None:
            raise ValueError(f"{name}: method {config.method!r} needs calibration statistics")
        stats.check_usable(name)  # positions reached it, and its statistics are finite
    start = time.perf_counter()
    metrics = {} if metrics is None else metrics  # the row slices of one Linear share its prepared metric
    slices = row_slices(W, config)
    answers = [quantize_weight(W[rows], stats, spec, config, identity_weight, metrics) for rows in slices]
    W_hat, info = joined_rows([q for q, _ in answers]), joined_info([i for _, i in answers])
    seconds = time.perf_counter() - start
    losses = {}
    if config.record_losses and stats is not None:  # sums over rows: added up slice by slice
        for rows in slices:
            for key, value in rounding_losses(W[rows], rows_of(W_hat, rows), stats).items():
                losses[key] = losses.get(key, 0.0) + value
    record = LayerRecord(name=name, shape=tuple(W.shape), method=config.method,  # type: ignore[arg-type]
                         **asdict(info), **losses, seconds=seconds)
    return W_hat, record


# A Linear this large in float32 is solved a slice of rows at a time: the solver holds several copies of the rows it
# is given (its sweep's working copy, the residual target, the losses' error), and Qwen3-ASR-1.7B's tied
# 151,936 x 2,048 head (1.2 GB) took the calibration from 4.8 to 9.4 GB whole. No Whisper head is this large.
ROW_SLICE_BYTES = 256 << 20


def row_slices(W: torch.Tensor, config: TarqConfig) -> list[slice]:
    """The row slices W is solved in: one, unless W is over ROW_SLICE_BYTES and every row's answer depends on the
    shared metric alone (GPTQ's sweep, RTN, imatrix, TARQ's exact target W + D with alpha = 1; not a closed-form
    alpha, which is fitted over all rows at once)."""
    rows = rows_per_slice(W.shape[1])
    separable = not config.uses_residual or config.alpha_rule == "one"
    if W.shape[0] <= rows or not separable:
        return [slice(None)]
    return [slice(start, start + rows) for start in range(0, W.shape[0], rows)]


def rows_per_slice(n_columns: int) -> int:
    """How many float32 rows of ``n_columns`` fit in ROW_SLICE_BYTES (at least one)."""
    return max(1, ROW_SLICE_BYTES // (4 * n_columns))


def rows_of(q: QuantizedWeight, rows: slice) -> QuantizedWeight:
    return QuantizedWeight(q.codes[rows], spec=q.spec, **{k: v[rows] for k, v in q.params().items()})


def joined_rows(parts: list[QuantizedWeight]) -> QuantizedWeight:
    if len(parts) == 1:
        return parts[0]
    fields = parts[0].params().keys()
    return QuantizedWeight(torch.cat([q.codes for q in parts]), spec=parts[0].spec,
                           **{k: torch.cat([q.params()[k] for q in parts]) for k in fields})


def joined_info(parts: list[SolveInfo]) -> SolveInfo:
    """One Linear's figures from its row slices: the metric's (lam, traces, fallback) are the same in every slice;
    the scale refit's losses and moved codes add up."""
    info = parts[0]
    refits = [p.scale_refit for p in parts if p.scale_refit]
    if len(parts) > 1 and refits:
        info.scale_refit = {key: sum(r[key] for r in refits) for key in refits[0]}
    return info


