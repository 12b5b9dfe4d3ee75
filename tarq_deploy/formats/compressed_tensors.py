"""compressed-tensors ``pack-quantized`` checkpoints from a lattice checkpoint, bit for bit.

Per quantized Linear ``P`` (weight [N out, K in], symmetric int4, group g):

- ``P.weight_packed`` int32 [N, K/8]: u = c + 8 packed along K, column 8 i + j in bits 4 j .. 4 j + 3 (= GPTQ
  ``qweight`` transposed; compressed-tensors ``pack_to_int32`` adds the same offset 2^(bits-1) before packing).
- ``P.weight_scale`` [N, K/g] ([N, 1] per-channel), in the serving dtype (checked exact, never rounded).
- ``P.weight_shape`` int64 [2] = [N, K].
- no ``weight_zero_point``: symmetric schemes drop it.

The loader (compressed-tensors ``PackedQuantizationCompressor.decompress``, vLLM ``CompressedTensorsWNA16``)
computes (u - 8) * s = c * s from the lattice's own code and scale (in the scale's dtype: compressed-tensors and
the GPU kernels round the product to fp16/bf16, as for any weight held in that dtype). ``config.json`` gets the
``quantization_config`` that llm-compressor writes for a W4A16 scheme: one config group targeting ``Linear`` with
weights {num_bits 4, type int, symmetric true, strategy group|channel, group_size}, and every Linear kept in 16 bits
listed in ``ignore``.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from tarq_deploy.checkpoint import LatticeCheckpoint
from tarq_deploy.quant.lattice import CODE_DTYPE, LatticeSpec, QuantizedWeight

from .int4_checkpoint import (CODE_OFFSET, INT4_BITS, NIBBLES_PER_WORD, SERVE_DTYPES, ExportError, Int4Layout,
                              pack_int4_last_dim, unpack_int4_last_dim, write_int4_checkpoint)
from .marlin import check_runtime_shapes

__all__ = ["compressed_tensors_dequantize", "compressed_tensors_layer", "compressed_tensors_to_lattice",
           "write_compressed_tensors_checkpoint"]

QUANT_METHOD = "compressed-tensors"
PACK_FORMAT = "pack-quantized"
# The compressed-tensors release whose config schema and unpacking rule this module follows (tests load with it).
SCHEMA_VERSION = "0.20.0"
GROUP_NAME = "group_0"
TARGETS = ["Linear"]


# ------------------------------------------------------------------------------------------------------- tensors
def compressed_tensors_layer(codes: torch.Tensor, scales: torch.Tensor,
                             scale_dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """One layer's lattice (codes int8 [N, K], scales fp16 [N, K/g]) -> weight_packed, weight_scale, weight_shape."""
    n, k = codes.shape
    return {
        "weight_packed": pack_int4_last_dim(codes + CODE_OFFSET),  # int8 c + 8 is 0..15
        "weight_scale": scales.to(scale_dtype).contiguous(),
        "weight_shape": torch.tensor([n, k], dtype=torch.int64),
    }


def compressed_tensors_to_lattice(weight_packed: torch.Tensor, weight_scale: torch.Tensor,
                                  weight_shape: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight_packed / weight_scale / weight_shape -> lattice (codes int8 [N, K], scales as stored [N, K/g])."""
    n, k = (int(v) for v in weight_shape.tolist())
    if weight_packed.dtype != torch.int32 or tuple(weight_packed.shape) != (n, k // NIBBLES_PER_WORD):
        raise ExportError(f"weight_packed must be int32 [{n}, {k // NIBBLES_PER_WORD}] for weight_shape "
                          f"[{n}, {k}]; got {weight_packed.dtype} {list(weight_packed.shape)}")
    if weight_scale.shape[0] != n or k % weight_scale.shape[1] != 0:
        raise ExportError(f"weight_scale {list(weight_scale.shape)} does not fit weight_shape [{n}, {k}]")
    codes = unpack_int4_last_dim(weight_packed).to(CODE_DTYPE) - CODE_OFFSET
    return codes, weight_scale


def compressed_tensors_dequantize(weight_packed: torch.Tensor, weight_scale: torch.Tensor,
                                  weight_shape: torch.Tensor) -> torch.Tensor:
    """What the loader computes: float32 weight [N, K] = (u - 8) * weight_scale per group."""
    codes, scales = compressed_tensors_to_lattice(weight_packed, weight_scale, weight_shape)
    width = codes.shape[1] // scales.shape[1]
    return codes.float() * scales.float().repeat_interleave(width, dim=1)


# -------------------------------------------------------------------------------------------------------- config
def weights_scheme(spec: LatticeSpec) -> dict:
    """The ``weights`` QuantizationArgs of the lattice: symmetric int4, per group or per output channel."""
    per_channel = spec.group_size == -1
    return {"num_bits": INT4_BITS, "type": "int", "symmetric": True, "dynamic": False, "actorder": None,
            "strategy": "channel" if per_channel else "group", "group_size": None if per_channel else spec.group_size,
            "block_structure": None}  # observers are calibration-time settings: left to the loader's default


def compressed_tensors_config(spec: LatticeSpec, ignore: list[str]) -> dict:
    """``quantization_config`` of a pack-quantized W4A16 checkpoint."""
    return {
        "quant_method": QUANT_METHOD,
        "format": PACK_FORMAT,
        "quantization_status": "compressed",
        "version": SCHEMA_VERSION,
        "config_groups": {GROUP_NAME: {"targets": list(TARGETS), "weights": weights_scheme(spec),
                                       "input_activations": None, "output_activations": None,
                                       "format": PACK_FORMAT}},
        "ignore": sorted(ignore),
        "kv_cache_scheme": None,
        "global_compression_ratio": None,
        "sparsity_config": {},
        "transform_config": {},
    }


def modules_kept_in_16_bit(tensors: dict[str, torch.Tensor]) -> list[str]:
    """Modules whose 2-D float ``.weight`` stays untouched: every Linear kept in 16 bits (and embeddings, which a
    ``Linear`` target never matches, so listing them is harmless). A loader must skip all of them."""
    return sorted(name[: -len(".weight")] for name, t in tensors.items()
                  if name.endswith(".weight") and t.dim() == 2 and t.is_floating_point())


# ------------------------------------------------------------------------------------------------------- writing
def _pack_layer(q: QuantizedWeight, spec: LatticeSpec, serve_dtype: str) -> dict[str, torch.Tensor]:
    return compressed_tensors_layer(q.codes, q.scales, SERVE_DTYPES[serve_dtype])


def _quantization_config(spec: LatticeSpec, untouched: dict[str, torch.Tensor], quantized: list[str]) -> dict:
    return compressed_tensors_config(spec, modules_kept_in_16_bit(untouched))


COMPRESSED_TENSORS_LAYOUT = Int4Layout("compressed-tensors pack-quantized", _pack_layer, _quantization_config,
                                       check_runtime_shapes)


def write_compressed_tensors_checkpoint(ckpt: LatticeCheckpoint, out_dir: str | os.PathLike,
                                        serve_dtype: str | None = None, require_marlin_shapes: bool = True,
                                        overwrite: bool = False) -> Path:
    """Write ``ckpt`` as a compressed-tensors pack-quantized safetensors checkpoint in ``out_dir`` (atomically).

    ``serve_dtype`` ('float16' | 'bfloat16' | 'float32', default: the model config's dtype) is the dtype of
    ``weight_scale`` and of the runtime (written into config.json); bf16 is refused unless every scale is exact in
    bf16. ``require_marlin_shapes`` refuses layers vLLM's Marlin kernel cannot serve (N % 64, K % 128). Everything
    is checked before anything is written."""
    return write_int4_checkpoint(COMPRESSED_TENSORS_LAYOUT, ckpt, out_dir, serve_dtype, require_marlin_shapes,
                                 overwrite)
