"""The Triton W4A16 layer (tarq_deploy/runtimes/triton_w4a16.py) against the lattice's dequantized matmul.

The weights are held exactly (codes times activations are exact products in fp32, the fp16 group scale applied in
fp32 afterwards), so the only differences from ``x @ (s * c).T + b`` computed in float64 on the CPU are fp32
summation and the final rounding of y to the activation dtype: each output must lie within one ulp of the exact
value in that dtype, plus 2^-18 * sum_k |x_k w_k| for the fp32 sums (tensor-core accumulation, split-K atomics).

- Packing, launch choices and refusals: plain torch, everywhere.
- The kernel on CUDA at Voxtral-Mini-3B's decoder shapes (3072x3072, 1024x3072, 8192x3072, 3072x8192), M = 1, 4,
  16 (decode, split-K) and 40 (the prefill tiles), bias, bf16 activations, groups 32 / 64, a CUDA graph replay;
  skipped with the reason without CUDA or triton.
- The same kernel under Triton's CPU interpreter (``TRITON_INTERPRET=1 pytest tests/test_triton_w4a16.py`` with
  triton installed) at small shapes, fp16 only; skipped otherwise.
"""
from __future__ import annotations

import os

import pytest
import torch

from tarq_deploy.quant.lattice import LatticeSpec, QuantizedWeight
from tarq_deploy.runtimes import triton_w4a16 as tw
from tarq_deploy.runtimes.triton_w4a16 import (TritonInt4Linear, block_k_for, choose_split_k, pack_codes,
                                              triton_unavailable_reason, unpack_codes)

VOXTRAL_SHAPES = [(3072, 3072), (1024, 3072), (8192, 3072), (3072, 8192)]  # (N out, K in) of the Llama decoder
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
CUDA_REASON = triton_unavailable_reason("cuda")
needs_cuda = pytest.mark.skipif(CUDA_REASON is not None, reason=f"Triton W4A16 on CUDA: {CUDA_REASON}")
needs_interpreter = pytest.mark.skipif(
    tw.triton is None or not INTERPRETED,
    reason="Triton's CPU interpreter: " + ("triton is not installed" if tw.triton is None else
                                          "run with TRITON_INTERPRET=1 to check the kernel on the CPU"))


def random_lattice(n: int, k: int, group_size: int, seed: int = 0) -> QuantizedWeight:
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(-8, 8, (n, k), generator=gen, dtype=torch.int8)
    groups = 1 if group_size == -1 else k // group_size  # -1: one scale per row
    scales = (torch.rand(n, groups, generator=gen) * 0.02 + 1e-3).to(torch.float16)  # any fp16 scale
    return QuantizedWeight(codes, scales, LatticeSpec(4, group_size))


def ulp(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """One unit in the last place of |values| in ``dtype`` (float64 in, float64 out)."""
    info = torch.finfo(dtype)
    a = values.abs().clamp_min(info.tiny)
    mantissa_bits = {torch.float16: 10, torch.bfloat16: 7}[dtype]
    return torch.exp2(torch.floor(torch.log2(a)) - mantissa_bits).clamp_min(info.tiny * 2.0**-mantissa_bits)


def check_against_lattice(y: torch.Tensor, x: torch.Tensor, q: QuantizedWeight, bias: torch.Tensor | None = None):
    """|y - x W^T - b| <= ulp(exact) + 2^-18 sum |x w| everywhere, the exact value in float64 on the CPU."""
    w = q.dequantize().double()
    x64 = x.detach().cpu().double().reshape(-1, w.shape[1])
    exact = x64 @ w.T
    magnitude = x64.abs() @ w.abs().T
    if bias is not None:
        exact = exact + bias.detach().cpu().double()
        magnitude = magnitude + bias.detach().cpu().double().abs()
    got = y.detach().cpu().double().reshape(exact.shape)
    allowed = ulp(exact, y.dtype) + 2.0**-18 * magnitude
    excess = (got - exact).abs() - allowed
    assert y.dtype == x.dtype
    assert excess.max() <= 0, (f"{int((excess > 0).sum())} of {excess.numel()} outputs off by more than allowed; "
                               f"worst |diff| {(got - exact).abs().max():.3e}")


def assert_same_bytes_again(layer, x: torch.Tensor, y: torch.Tensor) -> None:
    """A second call gives the same bytes: the split-K slices are summed in a fixed order, and the shared workspace
    holds nothing from one call that the next one reads."""
    assert torch.equal(layer(x).view(torch.int16), y.view(torch.int16))


# ------------------------------------------------------------------------------------------------ CPU, no triton
def test_packing_round_trips_and_puts_input_8i_plus_j_in_bits_4j():
    q = random_lattice(24, 64, 32)
    packed = pack_codes(q.codes)
    assert packed.shape == (8, 24) and packed.dtype == torch.int32
    assert torch.equal(unpack_codes(packed), q.codes)
    one = torch.full((1, 8), -8, dtype=torch.int8)
    one[0, 7] = 7  # u = 15 in the top nibble: the sign bit of the int32
    assert pack_codes(one).item() == -(2**32) + (15 << 28)


def test_launch_choices():
    assert [block_k_for(g, 3072) for g in (32, 64, 128, 256, 3072)] == [32, 64, 128, 128, 128]
    with pytest.raises(ValueError, match="multiples of 128"):
        block_k_for(384 + 64, 448)
    # about two programs per SM on an H100 (132): 3072 x 3072 with 48 column blocks of 64 splits K 6 ways
    assert choose_split_k(48, 24, 264) == 6
    assert choose_split_k(16, 24, 264) == 24  # 1024 x 3072: one tile per program, as far as K goes
    assert choose_split_k(128, 24, 264) == 3
    assert choose_split_k(48, 64, 264) == 8  # down_proj, K = 8192


def test_refusals():
    with pytest.raises(ValueError, match="symmetric 4-bit"):
        TritonInt4Linear.from_lattice(QuantizedWeight(torch.zeros(8, 128, dtype=torch.int8),
                                                      torch.ones(8, 1, dtype=torch.float16), LatticeSpec(8, 128)),
                                      device="cpu")
    with pytest.raises(ValueError, match="\\[-8, 7\\]"):
        pack_codes(torch.full((2, 8), 9, dtype=torch.int8))


# ------------------------------------------------------------------------------------------------------------ CUDA
@needs_cuda
@pytest.mark.parametrize("n,k", VOXTRAL_SHAPES)
@pytest.mark.parametrize("m", [1, 4, 16])
@pytest.mark.parametrize("split_k", [None, 1])
def test_decode_shapes_hold_the_lattice(n, k, m, split_k):
    q = random_lattice(n, k, 128, seed=n + k + m)
    layer = TritonInt4Linear.from_lattice(q, device="cuda", split_k=split_k)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m), dtype=torch.float32).half()
    y = layer(x.cuda())
    check_against_lattice(y, x, q)
    assert_same_bytes_again(layer, x.cuda(), y)


@needs_cuda
@pytest.mark.parametrize("group_size", [32, 64, 128])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("m", [3, 40])
def test_bias_dtypes_groups_and_prefill_tiles(group_size, dtype, m):
    q = random_lattice(200, 512, group_size, seed=group_size)  # N not a multiple of the column block
    bias = torch.randn(200, dtype=dtype)
    layer = TritonInt4Linear.from_lattice(q, bias, device="cuda")
    x = torch.randn(2, m, 512, dtype=torch.float32).to(dtype)
    y = layer(x.cuda())
    assert y.shape == (2, m, 200)
    check_against_lattice(y, x, q, bias)


@needs_cuda
def test_replays_in_a_cuda_graph():
    q = random_lattice(3072, 3072, 128, seed=7)
    layer = TritonInt4Linear.from_lattice(q, device="cuda")
    x = torch.zeros(1, 3072, device="cuda", dtype=torch.float16)
    layer(x)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = layer(x)
    for seed in range(3):
        xs = torch.randn(1, 3072, generator=torch.Generator().manual_seed(seed)).half()
        x.copy_(xs)
        graph.replay()
        torch.cuda.synchronize()
        check_against_lattice(y, xs, q)


# ----------------------------------------------------------------------------------------------- the interpreter
@needs_interpreter
@pytest.mark.parametrize("m", [1, 4, 16, 20])
@pytest.mark.parametrize("split_k", [None, 1])
def test_interpreted_kernel_holds_the_lattice(m, split_k):
    q = random_lattice(80, 512, 128, seed=m)
    bias = torch.randn(80, dtype=torch.float16)
    layer = TritonInt4Linear.from_lattice(q, bias, device="cpu", split_k=split_k)
    assert layer.split_k == (split_k or 4)
    x = torch.randn(m, 512, generator=torch.Generator().manual_seed(m)).half()
    y = layer(x)
    check_against_lattice(y, x, q, bias)
    assert_same_bytes_again(layer, x, y)


@needs_interpreter
@pytest.mark.parametrize("group_size", [32, 64, -1])
def test_interpreted_groups(group_size):
    """(bfloat16 is checked on CUDA only: triton 3.6's interpreter computes bf16 dots wrongly.)"""
    q = random_lattice(48, 512, group_size, seed=3)
    layer = TritonInt4Linear.from_lattice(q, device="cpu")
    x = torch.randn(2, 3, 512).half()
    y = layer(x)
    assert y.shape == (2, 3, 48)
    check_against_lattice(y, x, q)
