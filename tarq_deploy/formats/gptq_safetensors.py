"""GPTQ v1 checkpoints from a lattice checkpoint, bit for bit (what the int4 targets share: int4_checkpoint.py).

GPTQ v1 per quantized Linear ``P`` (weight [N out, K in], group g; g = K for per-channel):

- ``P.qweight`` int32 [K/8, N]: u = c + 8 ("uint4b8") packed along K, row 8 i + j in bits 4 j .. 4 j + 3.
- ``P.qzeros``  int32 [K/g, N/8]: zero point minus one (the v1 off-by-one) packed along N, low nibble first; a
  symmetric int4 lattice has zero point 8, so every word is 0x77777777.
- ``P.scales``  fp16 [K/g, N].
- ``P.g_idx``   int32 [K] = k // g (no act-order).
- ``P.bias`` and every other tensor: copied from the lattice checkpoint in its own dtype.

A v1 runtime computes (u - (z + 1)) * s = c * s: the lattice's own code and scale (a kernel multiplying in fp16 or
bf16 then rounds c * s to that dtype, exactly as it would for the lattice dequantized to that dtype).
``config.json`` gets ``quantization_config`` {quant_method "gptq", bits 4, group_size, desc_act false, sym true,
checkpoint_format "gptq"} (vLLM needs all of bits / group_size / desc_act / sym to choose Marlin) and
``quantize_config.json`` holds the same for AutoGPTQ-era loaders.

Scales are checked against the serving dtype and refused, never rounded (``int4_checkpoint.check_scales_for``).
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from tarq_deploy.checkpoint import LatticeCheckpoint
from tarq_deploy.quant.lattice import CODE_DTYPE, SCALE_DTYPE, LatticeSpec, QuantizedWeight

from .int4_checkpoint import (CODE_OFFSET, INT4_BITS, NIBBLES_PER_WORD, ExportError, Int4Layout, pack_int4_last_dim,
                              unpack_int4_last_dim, write_int4_checkpoint)
from .marlin import check_runtime_shapes

__all__ = ["ExportError", "gptq_dequantize", "gptq_tensors", "gptq_to_lattice", "write_gptq_checkpoint"]

GPTQ_V1_ZERO_SHIFT = 1  # v1 stores zero point minus one


def group_width(spec: LatticeSpec, k: int) -> int:
    return k if spec.group_size == -1 else spec.group_size


# -------------------------------------------------------------------------------------------------- GPTQ tensors
def gptq_tensors(codes: torch.Tensor, scales: torch.Tensor, spec: LatticeSpec) -> dict[str, torch.Tensor]:
    """One layer's lattice (codes int8 [N, K], scales fp16 [N, K/g]) -> qweight, qzeros, scales, g_idx."""
    n, k = codes.shape
    # Packing along K is packing each output row [N, K] and transposing: word i of column n holds rows 8i..8i+7.
    qweight = pack_int4_last_dim(codes + CODE_OFFSET).T  # int8 c + 8 is 0..15: no overflow
    zeros = torch.full((scales.shape[1], n), CODE_OFFSET - GPTQ_V1_ZERO_SHIFT, dtype=torch.uint8)
    return {
        "qweight": qweight.contiguous(),
        "qzeros": pack_int4_last_dim(zeros).contiguous(),
        "scales": scales.to(SCALE_DTYPE).T.contiguous(),
        "g_idx": (torch.arange(k) // group_width(spec, k)).to(torch.int32),
    }


def gptq_unpack(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
                g_idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """GPTQ v1 tensors -> (u uint8 [K, N], zero points int16 [K/g, N], group index int64 [K]); shapes checked."""
    k, n = qweight.shape[0] * NIBBLES_PER_WORD, qweight.shape[1]
    if qweight.dtype != torch.int32 or qzeros.dtype != torch.int32:
        raise ExportError(f"qweight and qzeros must be int32, got {qweight.dtype} / {qzeros.dtype}")
    if tuple(qzeros.shape) != (scales.shape[0], n // NIBBLES_PER_WORD) or scales.shape[1] != n:
        raise ExportError(f"qzeros {list(qzeros.shape)} / scales {list(scales.shape)} do not fit qweight "
                          f"{list(qweight.shape)}")
    if tuple(g_idx.shape) != (k,):
        raise ExportError(f"g_idx has shape {list(g_idx.shape)}, expected [{k}]")
    u = unpack_int4_last_dim(qweight.T).T  # [K, N]
    zeros = unpack_int4_last_dim(qzeros).to(torch.int16) + GPTQ_V1_ZERO_SHIFT  # [K/g, N]
    return u, zeros, g_idx.to(torch.int64)


def gptq_dequantize(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
                    g_idx: torch.Tensor) -> torch.Tensor:
    """What a GPTQ v1 runtime computes: float32 weight [N out, K in] = (u - (qzero + 1)) * scale[g_idx]
    (u - z is a small integer and the scale an fp16 value: the float32 product is exact)."""
    u, zeros, group = gptq_unpack(qweight, qzeros, scales, g_idx)
    centred = u.float() - zeros.float()[group]
    return (centred * scales.float()[group]).T.contiguous()


def gptq_to_lattice(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
                    g_idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """GPTQ v1 tensors of a symmetric, in-order layer -> lattice (codes int8 [N, K], scales fp16 [N, K/g])."""
    u, zeros, group = gptq_unpack(qweight, qzeros, scales, g_idx)
    k = u.shape[0]
    if not torch.equal(group, torch.arange(k) // (k // scales.shape[0])):
        raise ExportError("g_idx is not k // group_size: act-order layers are not on a plain lattice")
    if not bool((zeros == CODE_OFFSET).all()):
        raise ExportError("zero points are not the symmetric 8: this GPTQ layer is not on a symmetric lattice")
    return (u.T.to(CODE_DTYPE) - CODE_OFFSET).contiguous(), scales.T.contiguous().to(SCALE_DTYPE)


def gptq_quantization_config(spec: LatticeSpec, quantized_modules: list[str]) -> dict:
    config = {"quant_method": "gptq", "bits": INT4_BITS, "group_size": spec.group_size, "desc_act": False,
              "sym": True, "checkpoint_format": "gptq", "lm_head": False}
    config.update(quantized_module_hints(quantized_modules))
    return config


def quantized_module_hints(quantized_modules: list[str]) -> dict:
    """Which Linears are int4, for loaders that would otherwise guess: ``modules_in_block_to_quantize`` as one list
    of full module names (optimum matches by suffix, vLLM by substring and flattens the list of lists) and
    ``block_name_to_quantize``, the module lists (``...layers``) that hold them."""
    blocks = sorted({_block_container(name) for name in quantized_modules} - {None})
    hints: dict = {"modules_in_block_to_quantize": [sorted(quantized_modules)]}
    if blocks:
        hints["block_name_to_quantize"] = blocks[0] if len(blocks) == 1 else blocks
    return hints


def _block_container(module: str) -> str | None:
    parts = module.split(".")
    for i, part in enumerate(parts):
        if part.isdigit():
            return ".".join(parts[:i]) or None
    return None


def _pack_layer(q: QuantizedWeight, spec: LatticeSpec, serve_dtype: str) -> dict[str, torch.Tensor]:
    return gptq_tensors(q.codes, q.scales, spec)  # GPTQ scales are fp16 whatever the serving dtype


def _quantization_config(spec: LatticeSpec, untouched: dict[str, torch.Tensor], quantized: list[str]) -> dict:
    return gptq_quantization_config(spec, quantized)


GPTQ_LAYOUT = Int4Layout("GPTQ", _pack_layer, _quantization_config, check_runtime_shapes, quantize_config_json=True)


def write_gptq_checkpoint(ckpt: LatticeCheckpoint, out_dir: str | os.PathLike, serve_dtype: str | None = None,
                          require_marlin_shapes: bool = True, overwrite: bool = False) -> Path:
    """Write ``ckpt`` as a GPTQ v1 safetensors checkpoint in ``out_dir`` (atomically); returns the path.

    ``serve_dtype`` ('float16' | 'bfloat16' | 'float32', default: the model config's dtype) is the dtype the runtime
    will run in, written into config.json; bf16 is refused unless every scale is exact in bf16.
    ``require_marlin_shapes`` refuses layers vLLM's Marlin kernel cannot serve (N % 64, K % 128). Everything is
    checked before anything is written."""
    return write_int4_checkpoint(GPTQ_LAYOUT, ckpt, out_dir, serve_dtype, require_marlin_shapes, overwrite)
