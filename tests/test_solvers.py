"""The lattice, the GPTQ sweep, the streaming statistics and the TARQ layer solver on synthetic data."""

from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st
import torch

from tarq_deploy.quant.gptq import gptq_quantize, weighted_loss
from tarq_deploy.quant.lattice import (LatticeSpec, check_on_lattice, codes_for, dequantize, on_scale_grid, scales_for,
                                      stored_scales)
from tarq_deploy.quant.lattice_fit import quantize_rtn
from tarq_deploy.quant.stats import LayerStats, symmetrize_from_upper_
from tarq_deploy.quant.layer_solve import solve_layer
from tarq_deploy.quant.tarq import (
    TarqConfig, group_losses, optimal_alpha, rarebal_metric, residual_direction, reweighting_mask,
)
from tarq_deploy.quant.gptq import prepare_metric


def correlated_activations(n: int, tokens: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    mixing = torch.randn(n, n, generator=g) / n**0.5
    scales = torch.logspace(0, -2, n)  # a spread spectrum, as real activations have
    return (torch.randn(tokens, n, generator=g) * scales) @ mixing


def stats_for(x_q: torch.Tensor, tail: torch.Tensor, x_fp: torch.Tensor | None = None) -> LayerStats:
    stats = LayerStats(x_q.shape[1])
    stats.add(x_q, tail, x_fp)
    return stats


@pytest.mark.parametrize("bits", [3, 4, 8])
@pytest.mark.parametrize("group_size", [-1, 32, 64, 128])
def test_rtn_codes_in_range_and_scales_fp16_exact(bits: int, group_size: int) -> None:
    spec = LatticeSpec(bits, group_size)
    W = torch.randn(48, 256) * torch.logspace(-3, 1, 256)
    q = quantize_rtn(W, spec)
    check_on_lattice(q)
    assert q.codes.min() >= spec.qmin and q.codes.max() <= spec.qmax
    assert torch.equal(q.scales.float().half().float(), q.scales.float())
    # rounding to nearest (against the float32 scale, as ggml does): within half a step of the stored value, plus the
    # fp16 rounding of the scale (at most 2^-11 relative, or 2^-25 absolute among subnormals, times |q| <= 2^(b-1)),
    # or clamped at the top code
    err = (W - q.dequantize()).abs()
    step = q.scales.float().abs().repeat_interleave(spec.group_width(256), dim=1)
    slack = (step * 2.0 ** -11 + 2.0 ** -25) * (2 ** (bits - 1)) + 1e-6 * W.abs()
    assert (err <= step * 0.5 + slack + step * (q.codes == spec.qmax)).all()
    # every group spends its extreme level: the lowest code (ggml's max rule), or +-127 for 8 bits (Q8_0's rule)
    extreme = q.codes.abs().amax() == spec.qmax if bits == 8 else q.codes.min() == spec.qmin
    assert extreme


def test_dequantize_is_exact_product() -> None:
    spec = LatticeSpec(4, 32)
    q = quantize_rtn(torch.randn(8, 64), spec)
    expected = q.codes.double() * q.scales.double().repeat_interleave(32, dim=1)
    assert torch.equal(dequantize(q.codes, q.scales, spec).double(), expected)


def test_zero_group_gets_zero_scale_and_codes() -> None:
    W = torch.randn(4, 64)
    W[:, :32] = 0
    q = quantize_rtn(W, LatticeSpec(4, 32))
    assert (q.scales[:, 0] == 0).all() and (q.codes[:, :32] == 0).all()


def test_spec_rejects_bad_group_and_columns() -> None:
    with pytest.raises(ValueError, match="group_size"):
        LatticeSpec(4, 48)
    with pytest.raises(ValueError, match="multiple of group size"):
        quantize_rtn(torch.randn(4, 40), LatticeSpec(4, 32))


def test_bfloat16_scale_grid_holds_values_exact_in_both_dtypes() -> None:
    """The bf16 grid's stored fp16 scales survive a bf16 round trip, from fp16's subnormals to its largest values,
    and stay within bf16's half-step of the float32 scale."""
    magnitudes = torch.logspace(-28, 17, 20001, base=2.0)  # past fp16's largest value: clamped, never inf
    x = magnitudes * torch.where(torch.arange(20001) % 2 == 0, 1.0, -1.0)
    spec = LatticeSpec(4, 32, scale_grid="bfloat16")
    s = stored_scales(x, spec)
    assert s.dtype == torch.float16 and torch.equal(s.to(torch.bfloat16).to(torch.float16), s)
    normal = (magnitudes >= 2.0 ** -14) & (magnitudes <= 65280)
    assert s.float().abs().max() == 65280
    assert ((s.float() - x).abs()[normal] <= x.abs()[normal] * 2.0 ** -8).all()  # half of bf16's 2^-7 step
    assert not on_scale_grid(stored_scales(x, LatticeSpec(4, 32)), spec)  # the fp16 grid is finer


@pytest.mark.parametrize("method", ["rtn", "gptq"])
def test_solvers_keep_a_bfloat16_grid(method: str) -> None:
    spec = LatticeSpec(4, 128, scale_grid="bfloat16")
    W = torch.randn(64, 256) * torch.logspace(-3, 1, 256)
    X = correlated_activations(256, 1024, 0)
    q = quantize_rtn(W, spec) if method == "rtn" else gptq_quantize(W, X.T.double() @ X.double(), spec)
    check_on_lattice(q)
    assert on_scale_grid(q.scales, spec)
    q.scales[0, 0] = 1.0 + 2.0 ** -10  # exact in fp16, not in bf16
    with pytest.raises(ValueError, match="bfloat16 grid"):
        check_on_lattice(q)
    with pytest.raises(ValueError, match="symmetric"):
        LatticeSpec(4, 32, "affine", scale_grid="bfloat16")


@pytest.mark.parametrize("group_size", [-1, 32, 128])
def test_gptq_with_identity_metric_is_rounding(group_size: int) -> None:
    # Under the identity there is no error to feed back: GPTQ rounds each weight against the stored fp16 scale.
    spec = LatticeSpec(4, group_size)
    W = torch.randn(64, 256)
    scales = scales_for(W, spec)
    gptq = gptq_quantize(W, torch.eye(256), spec)
    assert torch.equal(gptq.scales, scales) and torch.equal(gptq.codes, codes_for(W, scales, spec))
    assert torch.equal(gptq.scales, quantize_rtn(W, spec).scales)


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("group_size", [-1, 32, 128])
def test_gptq_beats_rtn_under_its_metric(seed: int, group_size: int) -> None:
    spec = LatticeSpec(4, group_size)
    X = correlated_activations(256, 2048, seed)
    H = X.T.double() @ X.double()
    W = torch.randn(96, 256, generator=torch.Generator().manual_seed(100 + seed))
    rtn, gptq = quantize_rtn(W, spec), gptq_quantize(W, H, spec)
    check_on_lattice(gptq)
    assert weighted_loss(W - gptq.dequantize(), H) <= weighted_loss(W - rtn.dequantize(), H)


def test_gptq_handles_dead_columns() -> None:
    X = correlated_activations(128, 512, 0)
    X[:, [3, 77]] = 0
    W = torch.randn(32, 128)
    q = gptq_quantize(W, X.T @ X, LatticeSpec(4, 32))
    assert (q.codes[:, [3, 77]] == 0).all()
    assert torch.isfinite(q.dequantize()).all()


def test_streaming_stats_equal_one_shot_sums() -> None:
    X, Y = torch.randn(300, 32), torch.randn(300, 32)
    tail = torch.rand(300) < 0.2
    stream = LayerStats(32)
    for chunk in range(0, 300, 70):
        stream.add(X[chunk:chunk + 70], tail[chunk:chunk + 70], Y[chunk:chunk + 70])
    Xd, Yd = X.double(), Y.double()
    close = lambda a, b: torch.allclose(a, b, rtol=1e-5, atol=1e-4)  # noqa: E731  float32 products of 70 rows
    assert close(stream.H_tail, Xd[tail].T @ Xd[tail])
    assert close(stream.H_common, Xd[~tail].T @ Xd[~tail])
    assert close(stream.H_delta, (Yd - Xd).T @ Xd)
    assert (stream.n_tail, stream.n_common, stream.n_delta) == (int(tail.sum()), int((~tail).sum()), 300)
    restored = LayerStats.from_state_dict(stream.state_dict())
    assert torch.equal(restored.H_delta, stream.H_delta) and restored.n_tail == stream.n_tail


def test_gram_sums_folded_in_upper_blocks_read_back_symmetric_between_adds(monkeypatch) -> None:
    """n >= 512: each Gram is formed in upper row blocks and folded into float64 as formed; reading it (here between
    adds too, across several folds) gives the whole symmetric sum."""
    import tarq_deploy.quant.stats as stats_module

    monkeypatch.setattr(stats_module, "FOLD_POSITIONS", 150)  # a fold every second add
    generator = torch.Generator().manual_seed(5)
    X = torch.randn(600, 520, generator=generator)
    tail = torch.rand(600, generator=generator) < 0.3
    stream = LayerStats(520)
    for chunk in range(0, 600, 100):
        stream.add(X[chunk:chunk + 100], tail[chunk:chunk + 100])
        if chunk == 200:
            early = stream.H_common.clone()
            assert torch.equal(early, early.T)
    Xd = X.double()
    for got, rows in ((stream.H_common, ~tail), (stream.H_tail, tail)):
        assert torch.equal(got, got.T)
        assert torch.allclose(got, Xd[rows].T @ Xd[rows], rtol=1e-5, atol=1e-3)
    assert not torch.equal(early, stream.H_common)  # the later adds reached it after the read


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 70), block=st.integers(1, 80), seed=st.integers(0, 2**16))
def test_symmetrize_from_upper_copies_the_upper_triangle_onto_the_lower(n: int, block: int, seed: int) -> None:
    matrix = torch.randn(n, n, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    upper = torch.triu(matrix)
    expected = upper + torch.triu(upper, diagonal=1).T
    symmetrize_from_upper_(matrix, block)
    assert torch.equal(matrix, expected)


def test_projected_cross_moment_is_W_times_H_delta() -> None:
    """A lone narrow Linear (fc2) gathers W H_delta directly; it is W @ H_delta up to float32 rounding, and the
    residual step reads it through weighted_residual as it reads the full moment."""
    generator = torch.Generator().manual_seed(11)
    X, X_fp = torch.randn(400, 64, generator=generator), torch.randn(400, 64, generator=generator)
    tail = torch.rand(400, generator=generator) < 0.25
    W = torch.randn(16, 64, generator=generator)
    full, projected = LayerStats(64), LayerStats(64, projection=W)
    for chunk in range(0, 400, 90):
        for stats in (full, projected):
            stats.add(X[chunk:chunk + 90], tail[chunk:chunk + 90], X_fp[chunk:chunk + 90])
    assert projected.H_delta.shape == (16, 64) and projected.H_common.shape == (64, 64)
    assert torch.equal(projected.H_common, full.H_common) and torch.equal(projected.H_tail, full.H_tail)
    for lam in (1.0, 3.5):
        expected = W.double() @ (full.H_delta + (lam - 1.0) * full.H_delta_tail)
        got = projected.weighted_residual(W, lam).double()
        assert torch.allclose(got, expected, rtol=1e-4, atol=1e-4 * expected.abs().max().item())
        assert torch.allclose(full.weighted_residual(W, lam).double(), expected, rtol=1e-4,
                              atol=1e-4 * expected.abs().max().item())
    with pytest.raises(ValueError, match="another weight"):
        projected.weighted_residual(W + 1.0)


def test_rarebal_equalises_trace_mass() -> None:
    X = correlated_activations(64, 1000, 1)
    tail = torch.arange(1000) % 13 == 0
    stats = stats_for(X, tail)
    for c in (1.0, 0.25, 4.0):
        H_rB, lam = rarebal_metric(stats.H_common, stats.H_tail, c)
        assert torch.trace(lam * stats.H_tail).item() == pytest.approx(c * torch.trace(stats.H_common).item(), rel=1e-12)
        assert torch.allclose(H_rB, stats.H_common + lam * stats.H_tail)


def test_alpha_star_is_the_one_dimensional_minimiser() -> None:
    X = correlated_activations(128, 2000, 2)
    X_fp = X + 0.05 * correlated_activations(128, 2000, 3)
    stats = stats_for(X, torch.arange(2000) % 9 == 0, X_fp)
    H_rB, _ = rarebal_metric(stats.H_common, stats.H_tail)
    metric = prepare_metric(H_rB)
    W = torch.randn(64, 128, generator=torch.Generator().manual_seed(7))
    E = gptq_quantize(W, H_rB, LatticeSpec(4, 32)).dequantize() - W
    D, DH = residual_direction(W, stats.H_delta, metric)
    assert torch.allclose(DH.double(), D.double() @ H_rB, rtol=1e-3, atol=1e-3 * DH.abs().max().item())
    alpha = optimal_alpha(E, D, DH)
    E, D = E.double(), D.double()
    # Grid step h: a move whose effect a h^2 on the objective (a = <D, D>_H, the parabola's curvature) is 1e-10 of
    # its value c, still clear of float64 rounding (finer grids only sort rounding noise).
    a, c = weighted_loss(D, H_rB), weighted_loss(E, H_rB)
    h = (1e-10 * c / a) ** 0.5
    grid = alpha + h * torch.arange(-1000, 1001, dtype=torch.float64)
    objective = torch.tensor([weighted_loss(E - g * D, H_rB) for g in grid], dtype=torch.float64)
    best = grid[int(objective.argmin())].item()
    assert abs(alpha - best) <= h
    assert weighted_loss(E - alpha * D, H_rB) <= objective.min().item() * (1 + 1e-9)


@pytest.mark.parametrize("alpha_rule, alpha", [("closed-form", 0.0), ("one", 1.0)])
def test_tarq_without_propagation_error_is_rarebal(alpha_rule: str, alpha: float) -> None:
    X = correlated_activations(128, 1500, 4)
    stats = stats_for(X, torch.arange(1500) % 7 == 0, X.clone())
    W = torch.randn(64, 128)
    spec = LatticeSpec(4, 32)
    tarq, record = solve_layer("l", W, stats, spec, TarqConfig(method="tarq", alpha_rule=alpha_rule))
    rarebal, _ = solve_layer("l", W, stats, spec, TarqConfig(method="rarebal"))
    assert record.alpha == alpha  # H_delta = 0: D = 0 whatever the step
    assert torch.equal(tarq.codes, rarebal.codes) and torch.equal(tarq.scales, rarebal.scales)


def tail_subspace_stats(seed: int, n: int = 128, tokens: int = 4000, p: float = 0.07) -> LayerStats:
    """Common and tail positions with different correlation structure (their own principal subspaces)."""
    tail = torch.rand(tokens, generator=torch.Generator().manual_seed(seed)) < p
    x_common = correlated_activations(n, tokens, 1000 + seed)
    x_tail = correlated_activations(n, tokens, 2000 + seed)
    return stats_for(torch.where(tail[:, None], x_tail, x_common), tail)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("group_size", [-1, 32])
def test_rarebal_trades_common_loss_for_tail_loss(seed: int, group_size: int) -> None:
    stats = tail_subspace_stats(seed)
    W = torch.randn(64, 128, generator=torch.Generator().manual_seed(seed))
    spec = LatticeSpec(4, group_size)
    gptq, _ = solve_layer("l", W, stats, spec, TarqConfig(method="gptq"))
    rarebal, record = solve_layer("l", W, stats, spec, TarqConfig(method="rarebal"))
    _, tail_gptq = group_losses(W, gptq, stats)
    _, tail_rarebal = group_losses(W, rarebal, stats)
    assert record.lam > 5  # p = 0.07 with equal per-position mass gives lam near (1 - p) / p
    assert tail_rarebal < tail_gptq
    assert weighted_loss(W - gptq.dequantize(), stats.H) < weighted_loss(W - rarebal.dequantize(), stats.H)


def test_layer_without_tail_falls_back_and_records_it() -> None:
    X = correlated_activations(64, 500, 5)
    stats = stats_for(X, torch.zeros(500, dtype=torch.bool))
    W = torch.randn(32, 64)
    q, record = solve_layer("l", W, stats, LatticeSpec(4, 32), TarqConfig(method="rarebal"))
    plain, _ = solve_layer("l", W, stats, LatticeSpec(4, 32), TarqConfig(method="gptq"))
    assert record.fallback and record.lam is None
    assert torch.equal(q.codes, plain.codes)


def test_records_carry_the_per_layer_figures() -> None:
    X = correlated_activations(64, 800, 6)
    stats = stats_for(X, torch.arange(800) % 10 == 0, X * 1.01)
    _, record = solve_layer("enc.0.fc1", torch.randn(32, 64), stats, LatticeSpec(4, 32), TarqConfig())
    row = record.to_json()
    assert row["name"] == "enc.0.fc1" and row["method"] == "tarq"
    assert row["p"] == pytest.approx(0.1) and row["lam"] > 0 and row["alpha"] is not None
    assert row["loss_final"] <= row["loss_rtn"] * 1.5 and row["seconds"] > 0


@pytest.mark.parametrize("source", ["random", "common"])
def test_reweighting_sources_are_size_matched(source: str) -> None:
    rare = torch.arange(200) % 10 == 0
    mask = reweighting_mask(rare, source, torch.Generator().manual_seed(0))
    assert int(mask.sum()) == int(rare.sum())
    if source == "common":
        assert not (mask & rare).any()
    again = reweighting_mask(rare, source, torch.Generator().manual_seed(0))
    assert torch.equal(mask, again)


def test_config_rejects_unknown_method() -> None:
    with pytest.raises(ValueError, match="method"):
        TarqConfig(method="awq")
    with pytest.raises(ValueError, match="cost ratio"):
        TarqConfig(c=0)


def test_alpha_one_targets_the_weighted_least_squares_solution() -> None:
    """--alpha-rule one: W + W H_delta,w (H_w)^-1 is the V minimising sum_t w_t |W x_fp,t - V x_t|^2 with w = lam on
    tail positions (the residual target weighted like the rareBAL metric); checked against a weighted lstsq."""
    n, tokens = 32, 400
    g = torch.Generator().manual_seed(11)
    x_q = torch.randn(tokens, n, generator=g) * torch.linspace(0.5, 2.0, n)  # well conditioned: float32 moments suffice
    x_fp = x_q + 0.1 * torch.randn(tokens, n, generator=g)
    tail = torch.zeros(tokens, dtype=torch.bool)
    tail[::5] = True
    W = torch.randn(16, n, generator=torch.Generator().manual_seed(13))
    stats = stats_for(x_q, tail, x_fp)
    H_rB, lam = rarebal_metric(stats.H_common, stats.H_tail)
    metric = prepare_metric(H_rB, percdamp=1e-9)
    H_delta_w = stats.H_delta + (lam - 1.0) * stats.H_delta_tail
    D, _ = residual_direction(W, H_delta_w, metric)
    weights = torch.where(tail, lam, 1.0).double().sqrt()[:, None]
    solution = torch.linalg.lstsq(weights * x_q.double(), weights * (x_fp.double() @ W.double().T)).solution.T
    assert torch.allclose((W + D).double(), solution, atol=2e-3, rtol=1e-3)
    assert torch.allclose(stats.H_delta_tail, ((x_fp - x_q)[tail].T @ x_q[tail]).double(), atol=1e-4)
    config = TarqConfig(method="tarq", alpha_rule="one")
    q, record = solve_layer("layer", W, stats, LatticeSpec(4, 32), config)
    assert record.alpha == 1.0 and record.lam == pytest.approx(lam)
    with pytest.raises(ValueError, match="alpha rule"):
        TarqConfig(alpha_rule="half")


@pytest.mark.parametrize("type_name", ["q4_0", "q4_1", "q8_0", "q3_k", "q4_k", "q6_k", "iq4_nl", "iq4_xs"])
@pytest.mark.parametrize("act_order", [False, True])
def test_the_numpy_column_sweep_gives_the_torch_sweeps_codes_and_scales(type_name, act_order):
    """The CPU sweep's per-column steps run as a compiled loop over NumPy views (gptq.CompiledColumns,
    quant/sweep_kernel.py) for speed; the accelerator keeps the torch steps. Both must give the same codes and group
    parameters bit for bit, for every scheme (uniform, affine, K-quant two-level, codebook), with and without act
    order and a dead column."""
    from tarq_deploy.quant import gptq
    from tarq_deploy.quant.ggml_types import spec_for_type, type_by_name

    spec = spec_for_type(type_by_name(type_name))
    generator = torch.Generator().manual_seed(3)
    m, n = 24, 512
    W = torch.randn(m, n, generator=generator) * 0.05
    X = torch.randn(600, n, generator=generator) * torch.linspace(0.1, 3.0, n)
    H = (X.T @ X).double()
    H[:, 7] = H[7, :] = 0.0
    metric = gptq.prepare_metric(H, act_order=act_order)
    width, fit_width = spec.group_width(n), spec.param_width(n)
    blocksize = max(gptq.BLOCKSIZE, fit_width)
    for rule in ("max", "search"):
        a = gptq.column_sweep(W, metric, spec, blocksize, rule, width, fit_width, gptq.TorchColumns)
        b = gptq.column_sweep(W, metric, spec, blocksize, rule, width, fit_width, gptq.CompiledColumns)
        assert torch.equal(a.codes, b.codes), (rule, int((a.codes != b.codes).sum()))
        assert a.params().keys() == b.params().keys()
        assert all(torch.equal(v, b.params()[k]) for k, v in a.params().items()), rule


def test_float32_compute_widens_looked_up_rows_not_the_table() -> None:
    """Under float32_compute an embedding returns its rows in float32 (the values a widened table gives) while its
    float16 table stays as it is; a Linear is widened while it runs and narrowed after."""
    from torch import nn

    from tarq_deploy.quant.precision import float32_compute

    torch.manual_seed(0)
    embedding, linear = nn.Embedding(50, 8).half(), nn.Linear(8, 4).half()
    model = nn.Sequential(embedding, linear)
    seen: dict[str, torch.dtype] = {}
    embedding.register_forward_hook(lambda m, a, o: seen.update(table=m.weight.dtype))  # update: returns None
    linear.register_forward_hook(lambda m, a, o: seen.update(linear=m.weight.dtype))
    ids = torch.tensor([[3, 7, 49]])
    with float32_compute(model):
        out = model(ids)
        rows = embedding(ids)
    assert seen == {"table": torch.float16, "linear": torch.float32}
    assert rows.dtype == torch.float32 and torch.equal(rows, embedding.weight.float()[ids])
    assert out.dtype == torch.float32 and linear.weight.dtype == torch.float16
    expected = nn.functional.linear(embedding.weight.float()[ids], linear.weight.float(), linear.bias.float())
    assert torch.equal(out, expected)


@pytest.mark.parametrize("method, spec_name", [("tarq", "q4_0"), ("gptq", "q4_0"), ("tarq", "q3_k"), ("rtn", "q3_k")])
def test_a_tall_linear_is_solved_a_slice_of_rows_at_a_time_with_the_whole_answer(method, spec_name, monkeypatch):
    """Rows depend on the shared metric alone, so solving a head in row slices (to bound the solver's copies of W)
    gives the whole solve's codes and parameters; only a closed-form alpha, fitted over all rows, is not sliced."""
    from tarq_deploy.quant import layer_solve
    from tarq_deploy.quant.ggml_types import spec_for_type, type_by_name

    spec = spec_for_type(type_by_name(spec_name))
    g = torch.Generator().manual_seed(3)
    x_q = correlated_activations(256, 600, seed=1)
    x_fp = x_q + 0.05 * torch.randn(x_q.shape, generator=g)
    tail = torch.rand(600, generator=g) < 0.2
    W = torch.randn(200, 256, generator=g) * 0.05
    config = TarqConfig(method=method, record_losses=True)
    whole, whole_record = solve_layer("head", W, stats_for(x_q, tail, x_fp), spec, config)
    monkeypatch.setattr(layer_solve, "ROW_SLICE_BYTES", 64 * 256 * 4)  # 64-row slices: 4 of them, the last short
    assert len(layer_solve.row_slices(W, config)) == 4
    sliced, sliced_record = solve_layer("head", W, stats_for(x_q, tail, x_fp), spec, config)
    # Equal on the AMD EPYC this was written on (the logged loss, summed slice by slice, to float32 summation order).
    # A BLAS that sums a 64-row product in another order than a 200-row one (another processor) may flip a near-tie
    # code, which then carries along its row: then at most 1 % of codes may differ, at a loss within 1 %.
    if torch.equal(sliced.codes, whole.codes):
        assert all(torch.equal(v, whole.params()[k]) for k, v in sliced.params().items())
        assert sliced_record.loss_final == pytest.approx(whole_record.loss_final, rel=1e-5)
    else:
        assert (sliced.codes != whole.codes).float().mean() <= 0.01
        assert sliced_record.loss_final == pytest.approx(whole_record.loss_final, rel=1e-2)
    assert layer_solve.row_slices(W, TarqConfig(method="tarq", alpha_rule="closed-form")) == [slice(None)]
