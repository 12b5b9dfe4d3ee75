"""A Linear layer whose weight is a symmetric int4 lattice, run by PyTorch's own int4 kernels (tinygemm).

Kernels (``torch.ops.aten``): on CUDA ``_convert_weight_to_int4pack`` + ``_weight_int4pack_mm``; on CPU
``_convert_weight_to_int4pack_for_cpu`` + ``_weight_int4pack_mm_for_cpu``. Their contract (PyTorch's own tests,
``_group_quantize_tensor``; checked here on CPU against the lattice):

- weight codes are unsigned u in [0, 15] per (output n, input k); a value is ``(u - 8) * scale + zero`` with one
  (scale, zero) pair per output and per group of ``group_size`` inputs, stored as ``scales_and_zeros`` [K/g, N, 2]
  (the [N, K/g, 2] pairs transposed), in the activation dtype;
- CPU takes u as int32 [N, K]; CUDA takes uint8 [N, K/2] with input 2j in the HIGH nibble and 2j+1 in the low one;
  the packed result is device-specific (pack on the device that will run it);
- CUDA needs bfloat16 activations and scales, group size in {32, 64, 128, 256}, K a multiple of 16 * inner_k_tiles
  (inner_k_tiles in {2, 4, 8}); CPU accepts float32, float16 and bfloat16.

The lattice (code c in [-8, 7], fp16 scale s, value s * c) maps with u = c + 8, scale = s and zero = 0: the
kernel's value is then s * c. Outputs are padded to a multiple of 8 with code-0 rows (value 0) where N is not (e.g.
Whisper base's 51865-token head) and the padding is sliced off the result; a bias is added after the kernel, in the
input's dtype, as the float model adds it. Exactness: the kernel forms s * c in the activation dtype. In float32 (CPU) that is
exact and the layer equals ``x @ (s * c).T`` up to summation order. In bfloat16 (CUDA) the scale itself must be
exact in bfloat16 (checked: a scale that would round is refused, as the converters do) and s * c is rounded to
bfloat16, i.e. the layer computes with the lattice dequantized to bfloat16.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from ..quant.lattice import QuantizedWeight

if TYPE_CHECKING:  # a type only: the GPU benches import this module where gguf (checkpoint's formats) is absent
    from ..checkpoint import LatticeCheckpoint

__all__ = ["Int4Linear", "cuda_nibbles", "replace_linears", "swap_in_int4_linears", "symmetric_scales_and_zeros"]

CODE_OFFSET = 8  # u = c + 8
KERNEL_GROUP_SIZES = (32, 64, 128, 256)
INNER_K_TILES = (2, 4, 8)
CUDA_DTYPE = torch.bfloat16  # tinygemm's only activation dtype on CUDA
CPU_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
K_TILE = 16
N_TILE = 16  # outputs per tile: the CUDA packer takes multiples of 8, the CPU packer of 16


class Int4Linear(nn.Module):
    """y = x W^T (+ b) with W = s * c on the lattice; holds only the packed codes and (scale, zero) pairs."""

    def __init__(self, packed: torch.Tensor, scales_and_zeros: torch.Tensor, in_features: int, out_features: int,
                 group_size: int, bias: torch.Tensor | None = None) -> None:
        """``packed`` / ``scales_and_zeros`` as the kernel takes them, possibly for more outputs than
        ``out_features`` (padding rows, sliced off); ``bias`` [out_features] in any float dtype."""
        super().__init__()
        self.in_features, self.out_features, self.group_size = in_features, out_features, group_size
        self.register_buffer("packed", packed)
        self.register_buffer("scales_and_zeros", scales_and_zeros)
        self.register_buffer("bias", bias)

    @property
    def compute_dtype(self) -> torch.dtype:
        return self.scales_and_zeros.dtype

    @classmethod
    def from_lattice(cls, q: QuantizedWeight, bias: torch.Tensor | None = None, device: str | torch.device = "cpu",
                     compute_dtype: torch.dtype | None = None, inner_k_tiles: int = 8) -> "Int4Linear":
        """Pack a lattice matrix (codes [N, K], scales [N, K/g]) for the kernel of ``device``.

        ``compute_dtype``: the kernel's activation dtype (default bfloat16 on CUDA, float32 on CPU). Raises
        ValueError when the lattice cannot run there exactly (bit width, group size, shapes, inexact scales)."""
        device = torch.device(device)
        dtype = compute_dtype or (CUDA_DTYPE if device.type == "cuda" else torch.float32)
        n, k = q.codes.shape
        group = _check_lattice(q, device, dtype, inner_k_tiles)
        codes, scales = _pad_outputs(q.codes, q.scales)
        u = (codes.to(torch.int32) + CODE_OFFSET).to(device)
        packed = _pack_cuda(u, inner_k_tiles) if device.type == "cuda" else _pack_cpu(u, inner_k_tiles)
        scales_and_zeros = symmetric_scales_and_zeros(scales.to(device), dtype)
        bias = None if bias is None else bias.detach().to(device).clone()
        return cls(packed, scales_and_zeros, k, n, group, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features).to(self.compute_dtype).contiguous()
        if self.packed.device.type == "cuda":
            y = torch.ops.aten._weight_int4pack_mm(flat, self.packed, self.group_size, self.scales_and_zeros)
        else:
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(flat, self.packed, self.group_size,
                                                           self.scales_and_zeros)
        y = y[:, : self.out_features].to(x.dtype)
        if self.bias is not None:
            y = y + self.bias.to(x.dtype)
        return y.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, group_size={self.group_size}, "
                f"compute_dtype={self.compute_dtype}, bias={self.bias is not None}")


# ------------------------------------------------------------------------------------------------------- packing
def symmetric_scales_and_zeros(scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Lattice scales [N, K/g] -> the kernel's [K/g, N, 2] (scale, zero) pairs with zero = 0."""
    pairs = torch.stack([scales.to(dtype), torch.zeros_like(scales, dtype=dtype)], dim=-1)  # [N, K/g, 2]
    return pairs.transpose(0, 1).contiguous()


def _pad_outputs(codes: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Append code-0 rows (value 0 whatever the scale) up to a multiple of the kernel's N tile."""
    missing = -codes.shape[0] % N_TILE
    if not missing:
        return codes, scales
    return (torch.cat([codes, codes.new_zeros(missing, codes.shape[1])]),
            torch.cat([scales, scales.new_ones(missing, scales.shape[1])]))


def cuda_nibbles(u: torch.Tensor) -> torch.Tensor:
    """u int [N, K] (0..15) -> uint8 [N, K/2] as the CUDA packer reads it: input 2j high nibble, 2j+1 low."""
    return ((u[:, 0::2] << 4) | u[:, 1::2]).to(torch.uint8).contiguous()


def _pack_cuda(u: torch.Tensor, inner_k_tiles: int) -> torch.Tensor:
    return torch.ops.aten._convert_weight_to_int4pack(cuda_nibbles(u), inner_k_tiles)


def _pack_cpu(u: torch.Tensor, inner_k_tiles: int) -> torch.Tensor:
    return torch.ops.aten._convert_weight_to_int4pack_for_cpu(u.contiguous(), inner_k_tiles)


def _check_lattice(q: QuantizedWeight, device: torch.device, dtype: torch.dtype, inner_k_tiles: int) -> int:
    """The kernel's group size for this lattice; ValueError if the kernel cannot hold it exactly."""
    n, k = q.codes.shape
    if q.spec.bits != 4:
        raise ValueError(f"int4 kernels hold 4-bit codes; this lattice has {q.spec.bits} bits")
    group = q.spec.group_width(k)
    if group not in KERNEL_GROUP_SIZES:
        raise ValueError(f"group of {group} inputs: the int4 kernels take groups of {KERNEL_GROUP_SIZES}")
    if inner_k_tiles not in INNER_K_TILES or k % (K_TILE * inner_k_tiles):
        raise ValueError(f"shape {n}x{k}: the int4 kernels need K % {K_TILE * inner_k_tiles} == 0 "
                         f"(inner_k_tiles {inner_k_tiles} of {INNER_K_TILES})")
    allowed = (CUDA_DTYPE,) if device.type == "cuda" else CPU_DTYPES
    if dtype not in allowed:
        raise ValueError(f"compute dtype {dtype} is not supported on {device.type}; use one of {allowed}")
    if not torch.equal(q.scales.to(dtype).float(), q.scales.float()):
        raise ValueError(f"some scales are not exactly representable in {dtype}: the kernel would round them and "
                         f"leave the lattice; quantize with scales exact in {dtype} or compute in float32 (CPU)")
    return group


# -------------------------------------------------------------------------------------------------- model surgery
def replace_linears(model: nn.Module, lattice: dict[str, QuantizedWeight], device: str | torch.device | None = None,
                    compute_dtype: torch.dtype | None = None, inner_k_tiles: int = 8) -> list[str]:
    """Swap every nn.Linear named in ``lattice`` ("<module>.weight") for an Int4Linear of its lattice (bias kept);
    returns the module names replaced. The float weights are released with the old modules."""
    replaced = []
    for weight_name, q in lattice.items():
        module_name = weight_name.removesuffix(".weight")
        linear = model.get_submodule(module_name)
        if not isinstance(linear, nn.Linear) or tuple(linear.weight.shape) != tuple(q.codes.shape):
            raise ValueError(f"{module_name}: not an nn.Linear of shape {tuple(q.codes.shape)}")
        target = device if device is not None else linear.weight.device
        new = Int4Linear.from_lattice(q, linear.bias, target, compute_dtype, inner_k_tiles)
        parent_name, _, child = module_name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, child, new)
        replaced.append(module_name)
    return replaced


def swap_in_int4_linears(model: nn.Module, checkpoint: LatticeCheckpoint, kernel: str = "tinygemm",
                         device: str | torch.device | None = None,
                         compute_dtype: torch.dtype | None = None) -> list[str]:
    """Replace every Linear whose weight is a lattice matrix of ``checkpoint`` by an INT4 layer
    (tarq_deploy/bench/gpu.py's INT4 variant): ``kernel="tinygemm"`` an Int4Linear (PyTorch's own int4 kernels),
    ``kernel="triton"`` a TritonInt4Linear (runtimes/triton_w4a16.py; activations in the model's fp16/bf16,
    ``compute_dtype`` unused).
    Marlin is served by vLLM or GPTQModel from the GPTQ / compressed-tensors exports."""
    if kernel == "triton":
        from .triton_w4a16 import replace_linears_triton

        return replace_linears_triton(model, checkpoint.quantized, device)
    if kernel != "tinygemm":
        raise ValueError(f"kernel {kernel!r}: the INT4 layers here run PyTorch's tinygemm or our Triton kernel; "
                         f"Marlin runs in vLLM / GPTQModel from a GPTQ or compressed-tensors export")
    return replace_linears(model, checkpoint.quantized, device, compute_dtype)
