"""Every ggml type a lattice (issue 16): the codecs are exact both ways against ggml's own library and gguf-py's
dequantizers, our RTN is ggml's own bytes for the round-to-nearest types, and GPTQ / TARQ land on each type's
lattice exactly and beat plain rounding there."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from gguf.constants import GGMLQuantizationType as T
from gguf.quants import dequantize, quantize

from tarq_deploy.checkpoint import LatticeCheckpoint, load_checkpoint, save_checkpoint
from tarq_deploy.quant.ggml_quants import NEEDS_IMPORTANCE, ggml_bytes, ggml_quantize
from tarq_deploy.quant.ggml_types import LATTICE_TYPES, LatticeNotRepresentable, pack, spec_for_type, unpack
from tarq_deploy.quant.gptq import gptq_quantize
from tarq_deploy.quant.lattice import LatticeSpec, check_on_lattice
from tarq_deploy.quant.lattice_fit import fit_params, quantize_nearest, quantize_rtn
from tarq_deploy.quant.stats import LayerStats
from tarq_deploy.quant.tarq import TarqConfig, quantize_weight

ROUND_TO_NEAREST_TYPES = (T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0)  # ggml's reference rounding is plain rounding
M, N = 24, 512
pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _weights(seed: int, m: int = M, n: int = N) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(m, n, generator=g) * 0.04
    w[:, ::37] *= 6  # outliers, as real weight rows have
    return w


def _metric(seed: int, n: int = N) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(4 * n, n, generator=g) * torch.linspace(0.2, 2.0, n) + 0.3 * torch.randn(4 * n, 1, generator=g)
    return x.T @ x


def _values(blocks: np.ndarray, t: T, shape: tuple[int, int]) -> np.ndarray:
    return dequantize(blocks, t).reshape(shape)


def _loss(W: torch.Tensor, q, H: torch.Tensor) -> float:
    d = (W - q.dequantize()).double()
    return float(torch.einsum("ij,jk,ik->", d, H.double(), d))


@pytest.mark.parametrize("t", LATTICE_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("weighted", [False, True], ids=["plain", "imatrix"])
def test_ggml_blocks_unpack_and_repack_byte_for_byte(t: T, weighted: bool) -> None:
    W = _weights(int(t))
    importance = torch.rand(N, generator=torch.Generator().manual_seed(1)) if weighted else None
    if importance is None and t in NEEDS_IMPORTANCE:  # ggml would abort the process: refused before the call
        with pytest.raises(ValueError, match=f"{t.name} quantizer needs an importance"):
            ggml_bytes(W, t, importance)
        return
    blocks = ggml_bytes(W, t, importance)
    q = unpack(blocks, t)
    check_on_lattice(q)
    assert q.spec == spec_for_type(t)
    assert np.array_equal(pack(q, t), blocks)
    assert np.array_equal(q.dequantize().numpy(), _values(blocks, t, W.shape))  # gguf-py's dequantizer is the reference


@pytest.mark.parametrize("t", ROUND_TO_NEAREST_TYPES, ids=lambda t: t.name)
def test_rtn_is_ggml_own_rounding_byte_for_byte(t: T) -> None:
    W = _weights(100 + int(t))
    blocks = pack(quantize_rtn(W, spec_for_type(t)), t)
    assert np.array_equal(blocks, quantize(W.numpy(), t).reshape(blocks.shape))  # gguf-py's reference quantizer
    assert np.array_equal(blocks, ggml_bytes(W, t, None))  # ggml's library, as whisper.cpp's quantize tool calls it


@pytest.mark.parametrize("t", LATTICE_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("act_order", [False, True], ids=["in-order", "act-order"])
def test_gptq_lands_on_each_type_exactly_and_beats_rounding(t: T, act_order: bool) -> None:
    spec = spec_for_type(t)
    W, H = _weights(200 + int(t)), _metric(7)
    q = gptq_quantize(W, H, spec, scale_rule="search", act_order=act_order)
    check_on_lattice(q)
    assert np.array_equal(q.dequantize().numpy(), _values(pack(q, t), t, W.shape))
    assert _loss(W, q, H) < _loss(W, quantize_rtn(W, spec), H)
    assert _loss(W, q, H) < _loss(W, ggml_quantize(W, torch.diag(H) / len(H), spec), H)  # imatrix, no feedback


@pytest.mark.parametrize("t", [T.Q5_1, T.Q4_K, T.Q6_K, T.Q3_K, T.Q2_K], ids=lambda t: t.name)
def test_tarq_solver_on_each_scheme(t: T) -> None:
    spec = spec_for_type(t)
    W, H = _weights(300 + int(t)), _metric(8)
    tail = _metric(9) * 0.05
    stats = LayerStats(N)
    stats.H_common, stats.H_tail, stats.H_delta, stats.H_delta_tail = H, tail, 0.01 * H, 0.0 * H
    stats.n_common, stats.n_tail, stats.n_delta = 2000, 100, 2100
    q, info = quantize_weight(W, stats, spec, TarqConfig(method="tarq"))
    check_on_lattice(q)
    assert info.lam is not None and info.alpha == 1.0
    assert np.array_equal(q.dequantize().numpy(), _values(pack(q, t), t, W.shape))


@pytest.mark.parametrize("t", LATTICE_TYPES, ids=lambda t: t.name)
def test_checkpoint_keeps_every_group_parameter(tmp_path, t: T) -> None:
    spec = spec_for_type(t)
    q = quantize_nearest(_weights(400 + int(t), 8, 256), spec, "search", torch.rand(256))
    ckpt = LatticeCheckpoint(spec, {"fc.weight": q}, {"fc.bias": torch.zeros(8)})
    back = load_checkpoint(save_checkpoint(ckpt, tmp_path / t.name)).quantized["fc.weight"]
    assert back.spec == spec and torch.equal(back.codes, q.codes)
    assert sorted(back.params()) == sorted(q.params())
    assert all(torch.equal(back.params()[k].view(torch.uint8), v.view(torch.uint8)) for k, v in q.params().items())
    lattice = json.loads((tmp_path / t.name / "manifest.json").read_text())["lattice"]
    assert (lattice["scheme"], lattice["ggml_type"]) == (spec.scheme, t.name.lower())


def test_k_quant_parameters_are_codes_under_the_super_block_scale() -> None:
    W = _weights(5, 4, 512)
    params = fit_params(W, spec_for_type(T.Q4_K), "max", None)
    assert params["scales"].shape == (4, 2) and params["sub_scales"].shape == (4, 16)
    assert int(params["sub_scales"].max()) == 63  # the largest group scale takes the top code
    q6 = fit_params(W, spec_for_type(T.Q6_K), "max", None)
    assert q6["sub_scales"].dtype == torch.int8 and q6["sub_scales"].shape == (4, 32)
    assert (q6["sub_scales"].amin(dim=1) == -128).all()  # the signed largest over -128, as ggml's Q6_K


@pytest.mark.parametrize("bad, match", [
    (lambda: LatticeSpec(6, 32, "k-affine"), "k-affine"),
    (lambda: LatticeSpec(4, 64, "affine"), "affine"),
    (lambda: LatticeSpec(4, 32, "nf4"), "scheme"),
    (lambda: LatticeSpec(4, 32, "k-affine").check_columns(384), "multiple of 256"),
])
def test_specs_refuse_what_no_type_stores(bad, match) -> None:
    with pytest.raises(ValueError, match=match):
        bad()


def test_pack_refuses_another_types_lattice() -> None:
    q = quantize_rtn(_weights(6, 4, 256), spec_for_type(T.Q5_1))
    with pytest.raises(LatticeNotRepresentable, match="affine lattice is not what Q5_0 stores"):
        pack(q, T.Q5_0)
    with pytest.raises(LatticeNotRepresentable, match="not a lattice type"):
        pack(q, T.IQ2_XXS)
