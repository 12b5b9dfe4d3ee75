"""Int4Linear runs the lattice through PyTorch's int4 kernels (CPU here; the same module runs tinygemm on CUDA).

On CPU in float32 the kernel's weight must be the lattice value s * c exactly: the layer applied to the identity
returns W^T bit for bit. A CUDA run (tarq_deploy/bench/gpu_voxtral.py) checks the bfloat16 path against the dequantized model.
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

from tarq_deploy.checkpoint import LatticeCheckpoint
from tarq_deploy.quant.lattice import LatticeSpec, QuantizedWeight
from tarq_deploy.quant.lattice_fit import quantize_rtn
from tarq_deploy.runtimes.int4_linear import (Int4Linear, cuda_nibbles, replace_linears, swap_in_int4_linears,
                                             symmetric_scales_and_zeros)


def random_lattice(n: int, k: int, group_size: int, seed: int = 0, bf16_exact: bool = False) -> QuantizedWeight:
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(-8, 8, (n, k), generator=gen, dtype=torch.int8)
    scales = (torch.rand(n, k // group_size, generator=gen) * 0.02 + 1e-3).to(torch.float16)
    if bf16_exact:
        scales = scales.to(torch.bfloat16).to(torch.float16)
    return QuantizedWeight(codes, scales, LatticeSpec(4, group_size))


@pytest.mark.parametrize("group_size", [32, 64, 128])
@pytest.mark.parametrize("inner_k_tiles", [2, 8])
def test_float32_kernel_holds_the_lattice_exactly(group_size, inner_k_tiles):
    q = random_lattice(192, 256, group_size, seed=group_size)
    layer = Int4Linear.from_lattice(q, inner_k_tiles=inner_k_tiles)
    assert torch.equal(layer(torch.eye(256)), q.dequantize().T)


def test_matches_the_dequantized_matmul_with_bias_and_batch_dims():
    q = random_lattice(128, 384, 128, seed=1)
    bias = torch.randn(128)
    layer = Int4Linear.from_lattice(q, bias)
    x = torch.randn(2, 5, 384)
    expected = x @ q.dequantize().T + bias
    y = layer(x)
    assert y.shape == (2, 5, 128) and y.dtype == torch.float32
    assert torch.allclose(y, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16_bit_kernels_use_the_lattice_rounded_to_their_dtype(dtype):
    q = random_lattice(64, 256, 128, seed=2, bf16_exact=True)
    layer = Int4Linear.from_lattice(q, compute_dtype=dtype)
    weight = layer(torch.eye(256, dtype=dtype)).T
    assert weight.dtype == dtype and torch.equal(weight, q.dequantize().to(dtype))


def test_scales_and_zeros_layout_and_cuda_nibble_order():
    scales = torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]], dtype=torch.float16)  # [N=3, groups=2]
    pairs = symmetric_scales_and_zeros(scales, torch.float32)
    assert pairs.shape == (2, 3, 2)
    assert pairs[1, 2].tolist() == [6.0, 0.0] and not pairs[..., 1].any()
    u = torch.tensor([[1, 2, 3, 4], [15, 0, 7, 8]], dtype=torch.int32)
    assert cuda_nibbles(u).tolist() == [[0x12, 0x34], [0xF0, 0x78]]  # input 2j high nibble, 2j+1 low


def test_refuses_what_the_kernels_cannot_hold_exactly():
    with pytest.raises(ValueError, match="not exactly representable in torch.bfloat16"):
        Int4Linear.from_lattice(random_lattice(64, 256, 128, seed=3), compute_dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="groups of"):
        Int4Linear.from_lattice(quantize_rtn(torch.randn(64, 512), LatticeSpec(4, -1)))
    with pytest.raises(ValueError, match="4-bit codes"):
        Int4Linear.from_lattice(quantize_rtn(torch.randn(64, 256), LatticeSpec(8, 128)))
    with pytest.raises(ValueError, match="K % 128"):
        Int4Linear.from_lattice(random_lattice(64, 192, 64))


def test_outputs_not_a_multiple_of_8_are_padded_and_sliced():
    q = random_lattice(61, 256, 128, seed=4)
    bias = torch.randn(61, dtype=torch.float16)
    layer = Int4Linear.from_lattice(q, bias)
    assert layer.scales_and_zeros.shape == (2, 64, 2)
    x = torch.eye(256, dtype=torch.float16)
    assert torch.equal(layer(x), (x.float() @ q.dequantize().T).half() + bias)  # bias added in the input dtype


def test_swap_in_int4_linears_from_a_checkpoint():
    model = nn.Sequential(nn.Linear(256, 64))
    ckpt = LatticeCheckpoint(LatticeSpec(4, 128), {"0.weight": random_lattice(64, 256, 128)}, {"0.bias": model[0].bias})
    assert swap_in_int4_linears(model, ckpt) == ["0"] and isinstance(model[0], Int4Linear)
    with pytest.raises(ValueError, match="Marlin runs in vLLM"):
        swap_in_int4_linears(model, ckpt, kernel="marlin")


def test_replace_linears_in_a_model():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 128), nn.GELU(), nn.Linear(128, 64, bias=False))
    spec = LatticeSpec(4, 128)
    lattice = {f"{i}.weight": quantize_rtn(model[i].weight.detach(), spec) for i in (0, 2)}
    with torch.no_grad():
        for name, q in lattice.items():
            model.get_submodule(name.removesuffix(".weight")).weight.copy_(q.dequantize())
    x = torch.randn(7, 256)
    expected = model(x)
    assert replace_linears(model, lattice) == ["0", "2"]
    assert isinstance(model[0], Int4Linear) and isinstance(model[2], Int4Linear)
    assert torch.allclose(model(x), expected, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="not an nn.Linear"):
        replace_linears(model, {"1.weight": lattice["0.weight"]})


# ---------------------------------------------------------------------------------------------- CUDA (tinygemm)
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="tinygemm needs a CUDA GPU (sm80+)")


@needs_cuda
@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_cuda_kernel_holds_the_lattice_rounded_to_bfloat16(group_size):
    """tinygemm forms s * c in bfloat16 (one rounding) and accumulates in float32: applied to the identity it must
    return the lattice rounded to bfloat16, bit for bit."""
    q = random_lattice(192, 256, group_size, seed=group_size, bf16_exact=True)
    layer = Int4Linear.from_lattice(q, device="cuda")
    assert layer.compute_dtype == torch.bfloat16 and layer.packed.dtype == torch.int32
    weight = layer(torch.eye(256, device="cuda", dtype=torch.bfloat16)).T.cpu()
    assert torch.equal(weight, q.dequantize().to(torch.bfloat16))
    x = torch.randn(3, 256, device="cuda", dtype=torch.float16)
    expected = x.float() @ q.dequantize().to(torch.bfloat16).float().T.cuda()
    assert torch.allclose(layer(x).float(), expected, rtol=2e-2, atol=2e-2)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA path of the GPU benchmark")
def test_gpu_benchmark_exits_cleanly_without_cuda(capsys, tmp_path):
    from tarq_deploy.bench.gpu_voxtral import main

    assert main(["--out", str(tmp_path / "gpu.json")]) == 0
    assert capsys.readouterr().out.strip() == "CUDA not available: nothing measured"
    assert not (tmp_path / "gpu.json").exists()
