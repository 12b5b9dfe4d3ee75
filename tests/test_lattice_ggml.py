"""The lattice's scale rules against ggml's own quantizers: RTN is ggml's rounding byte for byte, the imatrix method
is ggml's importance-weighted Q4_0 byte for byte (the library pywhispercpp ships), and the scale search never loses
to the max rule under its own weighted error."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import quants
from gguf.constants import GGMLQuantizationType

from tarq_deploy.formats.ggml_blocks import pack_q4_0, pack_q8_0
from tarq_deploy.quant.ggml_quants import ggml_q4_0_bytes, q4_0_lattice, quantize_q4_0_imatrix
from tarq_deploy.quant.gptq import gptq_quantize
from tarq_deploy.quant.lattice import LatticeSpec, codes_for, max_rule_scales, scales_for, search_scales
from tarq_deploy.quant.lattice_fit import quantize_rtn


def _weights(seed: int = 0, m: int = 48, n: int = 256) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    W = torch.randn(m, n, generator=g) * torch.logspace(-3, 0, n)  # columns of very different size
    W[0, :32] = 0.0  # an all-zero block
    W[1, 40] = 3.0  # a lone outlier
    return W


@pytest.mark.parametrize("bits, ggml_type", [(4, GGMLQuantizationType.Q4_0), (5, GGMLQuantizationType.Q5_0),
                                             (8, GGMLQuantizationType.Q8_0)])
def test_rtn_is_ggml_rounding(bits: int, ggml_type: GGMLQuantizationType) -> None:
    W = _weights()
    q = quantize_rtn(W, LatticeSpec(bits, 32))
    reference = quants.dequantize(quants.quantize(W.numpy(), ggml_type), ggml_type)
    assert np.array_equal(q.dequantize().numpy(), reference)


def test_rtn_q4_0_and_q8_0_bytes_equal_ggml() -> None:
    W = _weights(1)
    q4 = quantize_rtn(W, LatticeSpec(4, 32))
    q8 = quantize_rtn(W, LatticeSpec(8, 32))
    assert np.array_equal(pack_q4_0(q4.codes, q4.scales).reshape(-1),
                          quants.quantize(W.numpy(), GGMLQuantizationType.Q4_0).reshape(-1))
    assert np.array_equal(pack_q8_0(q8.codes, q8.scales).reshape(-1),
                          quants.quantize(W.numpy(), GGMLQuantizationType.Q8_0).reshape(-1))


def test_max_rule_spends_the_lowest_code() -> None:
    W = _weights(2)
    q = quantize_rtn(W, LatticeSpec(4, 32))
    groups = q.codes.reshape(48, 8, 32)
    live = q.scales.float() != 0
    assert (groups.amin(dim=2)[live] == -8).all()  # the value of largest magnitude sits on code -8
    assert (max_rule_scales(W, LatticeSpec(4, 32))[1, 1] == -3.0 / 8).item()


def test_imatrix_method_is_ggml_bytes() -> None:
    W = _weights(3)
    importance = torch.rand(256, generator=torch.Generator().manual_seed(4)) ** 2
    lattice = quantize_q4_0_imatrix(W, importance, LatticeSpec(4, 32))
    ggml = ggml_q4_0_bytes(W, importance)
    assert np.array_equal(pack_q4_0(lattice.codes, lattice.scales).reshape(-1), ggml.reshape(-1))
    plain = q4_0_lattice(ggml_q4_0_bytes(W, None))  # no importance: ggml's reference rounding = our RTN
    rtn = quantize_rtn(W, LatticeSpec(4, 32))
    assert torch.equal(plain.codes, rtn.codes) and torch.equal(plain.scales.view(torch.int16),
                                                               rtn.scales.view(torch.int16))
    assert not torch.equal(lattice.codes, rtn.codes)  # the importance changed the choice
    with pytest.raises(ValueError, match="group-size 32"):
        quantize_q4_0_imatrix(W, importance, LatticeSpec(4, 128))


def _weighted_error(W: torch.Tensor, scales: torch.Tensor, spec: LatticeSpec, h: torch.Tensor) -> torch.Tensor:
    values = codes_for(W, scales, spec).float() * scales.float().repeat_interleave(32, dim=1)
    return (((W - values) ** 2) * h).reshape(W.shape[0], -1, 32).sum(dim=2)


def test_scale_search_never_loses_to_the_max_rule() -> None:
    spec = LatticeSpec(4, 32)
    W = _weights(5)
    h = torch.rand(256, generator=torch.Generator().manual_seed(6)) + 0.01
    searched, plain = search_scales(W, spec, h), scales_for(W, spec)
    # fp16 rounding of the refitted scale may cost a hair; the search must not lose beyond that, and must win overall
    assert (_weighted_error(W, searched, spec, h) <= _weighted_error(W, plain, spec, h) * 1.002 + 1e-12).all()
    assert _weighted_error(W, searched, spec, h).sum() < 0.95 * _weighted_error(W, plain, spec, h).sum()
    zero_h = search_scales(W, spec, torch.zeros(256))
    assert torch.equal(zero_h, plain)  # no importance: keep the max rule


def test_act_order_keeps_contiguous_groups_and_static_scales() -> None:
    spec = LatticeSpec(4, 32)
    W = _weights(7)
    X = torch.randn(512, 256, generator=torch.Generator().manual_seed(8)) * torch.linspace(0.1, 3.0, 256)
    H = X.T @ X
    ordered = gptq_quantize(W, H, spec, act_order=True)
    assert torch.equal(ordered.scales, scales_for(W, spec))  # fixed up front from the original weights
    identity = gptq_quantize(W, torch.eye(256), spec, act_order=True)
    assert torch.equal(identity.codes, codes_for(W, scales_for(W, spec), spec))  # no feedback: plain rounding

    def loss(q) -> float:
        d = (W - q.dequantize()).double()
        return float(torch.einsum("ij,jk,ik->", d, H.double(), d))

    assert loss(ordered) < loss(quantize_rtn(W, spec))


@pytest.mark.parametrize("spec", [LatticeSpec(4, 32), LatticeSpec(8, 32), LatticeSpec(3, 16, "k-symmetric"),
                                  LatticeSpec(4, 32, "nonlinear")], ids=lambda s: f"{s.scheme}{s.bits}")
def test_the_scale_search_gives_the_same_scales_in_any_row_chunks(spec, monkeypatch) -> None:
    """The search runs over row chunks in reused buffers (the output head's 51,865 rows); chunks of 1, 7 or all
    rows must give the very same float32 scales, with per-column and per-weight importance."""
    from tarq_deploy.quant import lattice

    W = _weights(11, m=37, n=256)
    for h in (torch.rand(256, generator=torch.Generator().manual_seed(12)), torch.rand(37, 256) ** 3):
        whole = lattice.searched_scales(W, spec, h)
        for rows in (1, 7):
            monkeypatch.setattr(lattice, "SEARCH_CHUNK_VALUES", rows * 256)
            assert torch.equal(lattice.searched_scales(W, spec, h), whole), rows
        monkeypatch.undo()


def test_scale_search_matches_a_plain_loop_over_the_whole_grid() -> None:
    """Every divisor 8 + 0.1 k, k = -9..9 (the sign of the max rule's), rounding, least-squares refit, smallest
    weighted error first: written out as plain loops for a few groups."""
    spec = LatticeSpec(4, 32)
    W = _weights(9, m=6, n=64).double()
    h = (torch.rand(64, generator=torch.Generator().manual_seed(10)) + 0.05).double()
    searched = search_scales(W.float(), spec, h.float())
    for row in range(6):
        for group in range(2):
            x, w = W[row, 32 * group: 32 * (group + 1)], h[32 * group: 32 * (group + 1)]
            peak = x[x.abs().argmax()].item()
            best = (-1.0, peak / -8)
            for k in range(-9, 10):
                q = torch.round(x / (peak / -(8 + 0.1 * k))).clamp(-8, 7)
                sxq, sqq = float((w * x * q).sum()), float((w * q * q).sum())
                if sqq > 0 and sxq * sxq / sqq > best[0] * (1 + 1e-9):
                    best = (sxq * sxq / sqq, sxq / sqq)
            assert searched[row, group].item() == pytest.approx(float(torch.tensor(best[1]).half()), rel=2e-3)
