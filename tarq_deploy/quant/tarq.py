"""TARQ for one Linear layer (paper Algorithm 1) and the ablations it is compared with.

Methods (paper, "Component analysis"):
  rtn       round-to-nearest, no data
  gptq      GPTQ under the plain, frequency-weighted metric H = H_common + H_tail
  rarebal   GPTQ under the rareBAL metric H_rB = H_common + lam * H_tail          (metric only)
  residual  propagation-aware residual target, projected under the plain metric  (solver only)
  tarq      both: residual target projected under H_rB                            (Algorithm 1)
  imatrix   ggml's importance-weighted rounding of the lattice's type (llama.cpp's imatrix, CrispASR's --imatrix):
            per-column importance = mean x^2 over the calibration positions of the *full-precision* model, no error
            feedback
  ggml      ggml's own quantizer of the lattice's type without data (for Q4_0..Q8_0 the same bytes as rtn; for the
            K-quants and IQ4_NL ggml's scale search, which rtn does not do)

Reweighting source (Appendix "Reweighting source and cost-ratio ablations"): which positions form the re-weighted
slice: ``rare`` (the rarity tags), ``random`` (as many positions drawn uniformly) or ``common`` (as many drawn from
the common positions). ``c`` is the cost ratio: lam = c * tr(H_common) / (tr(H_tail) + eps).

The residual step, which is which (``alpha_rule``):
  closed-form  Algorithm 1 as the paper writes it: a pilot GPTQ sweep of W, the residual direction D, and the step
               alpha* = <E, D>_H / <D, D>_H that the pilot's error E picks along it; then the sweep of W + alpha* D.
  one          what quantize ships by default: alpha = 1 without a pilot, i.e. the target W + W H_delta,w H_w^-1,
               the exact least-squares minimiser of the propagated error with H_delta weighted like the metric. It
               is not Algorithm 1's step (results/rarewords: on the dev split the closed-form alpha* came out near 0
               on every layer, and alpha = 1 gave the lower KLD).

The solvers are pure: they return the quantized weight and a ``SolveInfo`` of the figures they computed (lam, alpha,
the group sizes and traces, why a step was skipped). quant/layer_solve.py checks the inputs, times the
solver and writes the per-layer log record; the calibration driver (calibration/driver.py) calls it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .choices import (ALPHA_RULES, DATA_FREE_METHODS, METHODS, REFIT_SCALES_BY_DEFAULT, SCALE_RULES,  # torch-free
                      SOURCES)
from .ggml_quants import ggml_quantize
from .gptq import PERCDAMP, BLOCKSIZE, PreparedMetric, gptq_sweep, prepare_metric, sweep_run
from .lattice import LatticeSpec, QuantizedWeight
from .lattice_fit import quantize_rtn
from .scale_refit import refit_sub_codes
from .stats import LayerStats, symmetrize_from_upper_, upper_gram_

__all__ = ["MetricCache", "SolveInfo", "TarqConfig", "group_losses", "importance_sums", "optimal_alpha",
           "quantize_weight", "rarebal_metric", "residual_direction", "reweighting_mask", "rounding_losses",
           "tarq_solve"]

EPS = 1e-12


@dataclass(frozen=True)
class TarqConfig:
    """Solver choice and knobs, named as in the paper."""

    method: str = "tarq"
    source: str = "rare"
    c: float = 1.0
    percdamp: float = PERCDAMP
    blocksize: int = BLOCKSIZE
    record_losses: bool = True  # read by the driver: log the group losses before and after (costs two products)
    scale_rule: str = "search"  # group scales: the search weighted by the metric's diagonal, or lattice.py's max rule
    act_order: bool = True  # sweep columns by decreasing diag(H), group scales fixed up front
    alpha_rule: str = "one"  # residual step: "one" (the exact target; measured), or the paper's closed-form alpha*
    # two-level lattices (K-quants, IQ4_XS, grid types): refit the sub-block scale codes against the metric once the
    # codes are chosen (scale_refit.py)
    refit_scales: bool = REFIT_SCALES_BY_DEFAULT

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"method must be one of {METHODS}, got {self.method!r}")
        if self.source not in SOURCES:
            raise ValueError(f"reweighting source must be one of {SOURCES}, got {self.source!r}")
        if not self.c > 0:
            raise ValueError(f"cost ratio c must be positive, got {self.c}")
        if self.alpha_rule not in ALPHA_RULES:
            raise ValueError(f"alpha rule must be one of {ALPHA_RULES}, got {self.alpha_rule!r}")
        if self.scale_rule not in SCALE_RULES:
            raise ValueError(f"scale rule must be one of {SCALE_RULES}, got {self.scale_rule!r}")

    @property
    def uses_rarebal(self) -> bool:
        return self.method in ("rarebal", "tarq")

    @property
    def uses_residual(self) -> bool:
        return self.method in ("residual", "tarq")

    @property
    def needs_data(self) -> bool:
        return self.method not in DATA_FREE_METHODS

    @property
    def sequential(self) -> bool:
        """Whether later layers see this layer's quantized weights. imatrix, like llama.cpp's, gathers its
        importance on the full-precision model."""
        return self.method != "imatrix"


@dataclass
class SolveInfo:
    """The figures a solver reports about one Linear; the driver copies them into the per-layer log record."""

    lam: float | None = None  # rareBAL weight of the tail slice (None: the plain metric was used)
    alpha: float | None = None  # residual step size (None: no residual step)
    p: float | None = None  # tail share N_tail / N
    n_common: int = 0
    n_tail: int = 0
    tr_common: float | None = None
    tr_tail: float | None = None
    fallback: str | None = None  # why a step of the configured method was skipped
    # the refit of the sub-block scale codes (scale_refit.py): the metric's loss before and after, codes moved
    scale_refit: dict | None = None


def rarebal_metric(H_common: torch.Tensor, H_tail: torch.Tensor, c: float = 1.0) -> tuple[torch.Tensor, float]:
    """The rareBAL metric: lam = c tr(H_common) / (tr(H_tail) + eps) and H_rB = H_common + lam H_tail."""
    lam = c * float(torch.trace(H_common)) / (float(torch.trace(H_tail)) + EPS)
    return H_common + lam * H_tail, lam


def residual_direction(W: torch.Tensor, H_delta: torch.Tensor, metric: PreparedMetric) -> tuple[torch.Tensor, torch.Tensor]:
    """The propagation-aware direction D = W H_delta G with G = (H + delta I)^-1 (the damped inverse the sweep
    already holds), and D H (see ``direction_of``)."""
    return direction_of(W.float() @ H_delta.to(W.device, torch.float32), metric)


def direction_of(W_H_delta: torch.Tensor, metric: PreparedMetric) -> tuple[torch.Tensor, torch.Tensor]:
    """D = (W H_delta) G, and D H, needed by the closed-form alpha, without another m x n x n product: since
    G (H + delta I) = I, D H = W H_delta - delta D (dead columns carry D = 0, so the unit diagonal planted for them
    does not matter). float32 products: alpha from them agrees with a float64 brute-force search
    (tests/test_solvers.py)."""
    D = W_H_delta @ metric.H_inv.to(W_H_delta.device, torch.float32)
    return D, W_H_delta - metric.damp * D


def optimal_alpha(E: torch.Tensor, D: torch.Tensor, DH: torch.Tensor) -> float:
    """The closed-form step alpha* = <E, D>_H / <D, D>_H (0 when D = 0), with <A, B>_H = tr(A H B^T) and
    DH = D H."""
    numerator = float((DH.double() * E.double()).sum())
    denominator = float((DH.double() * D.double()).sum())
    # The paper's eps only guards D = 0; an absolute eps shifts alpha when D is small (it moved alpha by 2% with
    # <D, D>_H ~ 5e-11), so the guard is exact instead.
    return numerator / denominator if denominator > 0 else 0.0


MetricCache = dict  # (id of a LayerStats, mu) -> (prepared metric, lam, fallback); see tarq_solve


def quantize_weight(
    W: torch.Tensor, stats: LayerStats | None, spec: LatticeSpec, config: TarqConfig, identity_weight: float = 0.0,
    metrics: MetricCache | None = None,
) -> tuple[QuantizedWeight, SolveInfo]:
    """Quantize one Linear weight W [m, n] with the configured method; ``stats`` may be None only for rtn. The
    inputs are taken as checked (finite weights, usable statistics): calibrate.solve_layer checks them.

    ``identity_weight`` mu adds mu * tr(H_common)/n * I to the final metric (after lam is computed, so it does not
    inflate lam): the tied head's second role as a token lookup, which sees every row alike."""
    if config.method == "ggml":
        return ggml_quantize(W.float(), None, spec), SolveInfo()
    if not config.needs_data:
        return quantize_rtn(W, spec), SolveInfo()
    if stats is None:
        raise ValueError(f"method {config.method!r} needs calibration statistics")
    if config.method == "imatrix":
        sums, count = importance_sums(stats)
        return ggml_quantize(W.float(), sums / count, spec), SolveInfo()
    return tarq_solve(W.float(), stats, spec, config, identity_weight, metrics)


def importance_sums(stats: LayerStats) -> tuple[torch.Tensor, torch.Tensor]:
    """llama.cpp's importance matrix of one Linear: each input column's summed squared activation and the number of
    positions, both float32, so that sums / count here and in.sum2 / counts read back from an imatrix file (the same
    float32 division llama.cpp does) are the same numbers."""
    count = torch.tensor(float(max(stats.n_common + stats.n_tail, 1)), dtype=torch.float32)
    return torch.diag(stats.H).to(torch.float32), count


def tarq_solve(
    W: torch.Tensor, stats: LayerStats, spec: LatticeSpec, config: TarqConfig, identity_weight: float = 0.0,
    metrics: MetricCache | None = None,
) -> tuple[QuantizedWeight, SolveInfo]:
    """Algorithm 1, with the metric and the residual step switched by the method. ``metrics``: prepared metrics of
    statistics already solved with (q, k and v share one LayerStats, so their metric is damped, inverted and factored
    once; the same arithmetic, so the same codes)."""
    info = SolveInfo(p=stats.tail_share, n_common=stats.n_common, n_tail=stats.n_tail,
                     tr_common=float(torch.trace(stats.H_common)), tr_tail=float(torch.trace(stats.H_tail)))
    run = sweep_run(spec)
    refit = config.refit_scales and spec.two_level
    key = (id(stats), identity_weight, run, refit)  # a refit needs the metric itself kept
    cached = metrics.get(key) if metrics is not None else None
    metric, lam, info.fallback = cached or rebalanced_metric(stats, config, identity_weight, info.tr_common,
                                                             info.tr_tail, W.device, run, keep_metric=refit)
    if metrics is not None:
        metrics[key] = (metric, lam, info.fallback)
    info.lam = lam

    def GPTQ(target: torch.Tensor) -> QuantizedWeight:  # the in-lattice projection under H_rB
        q = gptq_sweep(target, metric, spec, config.blocksize, scale_rule=config.scale_rule)
        if not refit:
            return q
        q, done = refit_sub_codes(target, q, metric.H)  # then its scale codes, against the same (damped) metric
        info.scale_refit = {"loss_before": done.loss_before, "loss_after": done.loss_after,
                            "scale_codes_moved": done.scale_codes_moved, "min_codes_moved": done.min_codes_moved}
        return q

    if not config.uses_residual:
        return GPTQ(W), info
    if stats.n_delta == 0:
        info.fallback = "no paired full-precision stream: residual step skipped"
        return GPTQ(W), info
    if config.alpha_rule == "one":  # no pilot sweep needed: the step size does not depend on it
        # The exact minimiser of sum_t w_t |W x_fp,t - V x_t|^2 (w_t = lam on tail positions, 1 elsewhere) is
        # V = W + W H_delta,w (H_w)^-1: the full residual direction, with H_delta weighted like the metric.
        D, _ = direction_of(stats.weighted_residual(W, lam or 1.0), metric)
        alpha = 1.0
    else:
        W_hat0 = GPTQ(W)  # pilot (the whole answer without the residual step)
        D, DH = direction_of(stats.weighted_residual(W), metric)
        E = W_hat0.dequantize() - W
        alpha = optimal_alpha(E, D, DH)
    info.alpha = alpha
    W_tar = W + alpha * D.float()  # alpha = 1 multiplies exactly: the same target as W + D
    return GPTQ(W_tar), info


def rounding_losses(W: torch.Tensor, W_hat: QuantizedWeight, stats: LayerStats) -> dict[str, float]:
    """The group losses tr(dW H_g dW^T) / N_g (the paper's group-wise reconstruction loss) of plain rounding
    ("rtn") and of the solver's answer ("final"), and their position-weighted sums, keyed as in the per-layer log."""
    losses: dict[str, float] = {}
    for label, candidate in (("rtn", quantize_rtn(W, W_hat.spec)), ("final", W_hat)):
        common, tail = group_losses(W, candidate, stats)
        losses[f"common_loss_{label}"] = common
        losses[f"tail_loss_{label}"] = tail
        losses[f"loss_{label}"] = common * stats.n_common + tail * stats.n_tail
    return losses


def group_losses(W: torch.Tensor, W_hat: QuantizedWeight, stats: LayerStats) -> tuple[float, float]:
    """Per-position common and tail losses L^C and L^T (the group-wise reconstruction loss); 0 for an empty
    group."""
    # tr(dW H dW^T) = sum(H * dW^T dW): one n x n Gram of the error (its upper block triangle, float32) serves both
    # groups, where a product dW @ H per group cost m n^2 each (the 51,865-row head: 4 such products per layer).
    dW = W.float() - W_hat.dequantize().to(W.device)
    error_gram = torch.zeros((dW.shape[1], dW.shape[1]), dtype=torch.float32, device=dW.device)
    upper_gram_(error_gram, dW)
    symmetrize_from_upper_(error_gram)
    error_gram = error_gram.to(torch.float64)

    def loss(H: torch.Tensor, count: int) -> float:  # an empty group (no tail frames untagged) costs nothing
        return float((H.to(dW.device, torch.float64) * error_gram).sum()) / count if count else 0.0

    return loss(stats.H_common, stats.n_common), loss(stats.H_tail, stats.n_tail)


def rebalanced_metric(stats: LayerStats, config: TarqConfig, identity_weight: float, tr_common: float,
                      tr_tail: float, device: torch.device, run: int = 1,
                      keep_metric: bool = False) -> tuple[PreparedMetric, float | None, str | None]:
    """(the prepared metric G = (H_rB + delta I)^-1, lam, why rareBAL fell back): the rareBAL metric H_rB when the
    method re-weights and tail positions reached the layer, else the plain H; plus mu * tr(H_common)/n * I for the
    tied head's lookup role (after lam, so it does not inflate lam)."""
    H_common, H_tail = stats.H_common.to(device), stats.H_tail.to(device)
    lam: float | None = None
    fallback = None
    if config.uses_rarebal and stats.n_tail > 0 and tr_tail > 0:
        H_rB, lam = rarebal_metric(H_common, H_tail, config.c)
    else:
        if config.uses_rarebal:
            fallback = "no tail positions reached this layer: plain metric"
        H_rB = H_common + H_tail
    if identity_weight > 0:
        H_rB = H_rB + identity_weight * tr_common / H_rB.shape[0] * torch.eye(
            H_rB.shape[0], dtype=H_rB.dtype, device=H_rB.device)
    return prepare_metric(H_rB, config.percdamp, config.act_order, run, keep_metric), lam, fallback


def reweighting_mask(rare_mask: torch.Tensor, source: str, generator: torch.Generator) -> torch.Tensor:
    """The positions re-weighted as 'tail' for a reweighting source, size-matched to the rare positions."""
    if source == "rare":  # as tagged: booleans, or a term list's tail weights (quant/stats.py)
        return rare_mask.reshape(-1) if rare_mask.is_floating_point() else rare_mask.reshape(-1).to(torch.bool)
    rare_mask = rare_mask.reshape(-1).to(torch.bool)
    pool = torch.arange(rare_mask.numel()) if source == "random" else torch.nonzero(~rare_mask.cpu()).reshape(-1)
    k = min(int(rare_mask.sum()), pool.numel())
    chosen = pool[torch.randperm(pool.numel(), generator=generator)[:k]]
    mask = torch.zeros_like(rare_mask, device="cpu")
    mask[chosen] = True
    return mask.to(rare_mask.device)
