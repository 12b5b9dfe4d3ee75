"""Marlin int4 tile layout: the exact bits a Marlin GPU kernel holds for one lattice matrix, and the way back.

Facts (IST-DASLab/marlin ``Layer.pack``; vLLM ``marlin_utils_test.marlin_weights``/``get_weight_perm`` and
``marlin_utils.marlin_permute_scales``/``get_scale_perms``):

- The weight is taken as K x N (inputs x outputs, i.e. the Linear weight transposed) and each code c in [-8, 7] is
  stored as u = c + 8 ("uint4b8"); the kernel computes (u - 8) * s.
- u is cut into 16 x 16 tiles, tiles laid out row of tiles by row of tiles: ``u.reshape(K/16, 16, N/16, 16)
  .permute(0, 2, 1, 3).reshape(K/16, 16 N)``.
- Every run of 1024 values is permuted by ``WEIGHT_PERM`` (the tensor-core fragment order, see ``weight_perm()``)
  and 8 consecutive values go into one int32, the first in the low nibble. Result ``B``: int32 [K/16, 2N].
- Scales are taken as [K/g, N] (groups x outputs). Several groups: each run of 64 is permuted by ``SCALE_PERM``;
  one group (per-channel, or g == K): each run of 32 by ``SCALE_PERM_SINGLE``.

Shape rules enforced here (``check_marlin_shape``) are vLLM gptq_marlin's, which is what serves GPTQ and
compressed-tensors checkpoints today: N % 64 == 0, K % 128 == 0, group size in {-1, 32, 64, 128}. The legacy
pre-packed checkpoint (``write_marlin_checkpoint``) follows the original Marlin rules instead: N % 256 == 0,
K % 128 == 0, group size in {-1, 128}. Every Voxtral-Mini-3B decoder Linear meets both.

Nothing here rounds anything: packing and unpacking are exact inverses of each other on every lattice matrix.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch

from tarq_deploy.checkpoint import LatticeCheckpoint
from tarq_deploy.quant.lattice import CODE_DTYPE, SCALE_DTYPE, LatticeSpec

from .int4_checkpoint import (CODE_OFFSET, NIBBLES_PER_WORD, ExportError, check_int4_spec, check_output_path,
                              checked_layers, module_name, pack_int4_last_dim, prepare_model_files,
                              resolve_serve_dtype, unpack_int4_last_dim, untouched_tensors, write_hf_directory)

__all__ = ["SCALE_PERM", "SCALE_PERM_SINGLE", "WEIGHT_PERM", "check_marlin_shape", "check_runtime_shapes",
           "marlin_pack", "marlin_unpack", "write_marlin_checkpoint"]

TILE = 16  # Marlin tile edge (values)
PERM_CHUNK = 1024  # values permuted together: 4 tiles of 16 x 16
INTERLEAVE = (0, 2, 4, 6, 1, 3, 5, 7)  # order of the 8 nibbles of one word in the fragment

# vLLM gptq_marlin (GPTQ_MARLIN_MIN_THREAD_N / _K) and its group sizes.
MIN_N = 64
MIN_K = 128
RUNTIME_GROUP_SIZES = (-1, 32, 64, 128)
# Original IST-DASLab Marlin / legacy pre-packed checkpoints (AutoGPTQ checkpoint_format "marlin").
LEGACY_MIN_N = 256
LEGACY_MIN_K = 128
LEGACY_GROUP_SIZES = (-1, 128)
LEGACY_CHECKPOINT_FORMAT = "marlin"
LEGACY_WEIGHTS_FILE = "model.safetensors"


# ------------------------------------------------------------------------------------------------------ permutations
def weight_perm() -> torch.Tensor:
    """The 1024-entry permutation ``_perm``: lane i (0..31) of a warp takes column i // 4 and rows
    2(i%4), 2(i%4)+1, 2(i%4)+8, 2(i%4)+9 of each 16 x 16 tile, for the left (b=0) and right (b=1) 8-column half,
    in 4 tiles (+256 j); each 8 of them is then reordered by ``INTERLEAVE`` so that a word's nibbles match the
    order in which the kernel's dequantization unpacks them."""
    lane = np.arange(32)[:, None, None, None]
    tile = np.arange(4)[None, :, None, None]
    half = np.arange(2)[None, None, :, None]
    row_offsets = np.array([0, 1, 8, 9])[None, None, None, :]
    rows = 2 * (lane % 4) + row_offsets
    perm = 16 * rows + lane // 4 + 8 * half + 256 * tile  # [lane, tile, half, row] = the published loop order
    perm = perm.reshape(-1, NIBBLES_PER_WORD)[:, list(INTERLEAVE)].reshape(-1)
    return torch.from_numpy(perm.astype(np.int64))


def scale_perm() -> torch.Tensor:
    """Grouped scales: within each 64, position 8 i + j takes entry i + 8 j."""
    i, j = np.meshgrid(np.arange(8), np.arange(8), indexing="ij")
    return torch.from_numpy((i + 8 * j).reshape(-1).astype(np.int64))


def scale_perm_single() -> torch.Tensor:
    """One group per column: within each 32, entries 2 i + j for i in 0..3, j in (0, 1, 8, 9, 16, 17, 24, 25)."""
    j = np.array([0, 1, 8, 9, 16, 17, 24, 25])
    return torch.from_numpy((2 * np.arange(4)[:, None] + j[None, :]).reshape(-1).astype(np.int64))


WEIGHT_PERM = weight_perm()
SCALE_PERM = scale_perm()
SCALE_PERM_SINGLE = scale_perm_single()
INVERSE_WEIGHT_PERM = torch.argsort(WEIGHT_PERM)  # x[:, P][:, argsort(P)] == x


# ------------------------------------------------------------------------------------------------------------ checks
def check_marlin_shape(k: int, n: int, group_size: int, name: str = "weight", legacy: bool = False) -> None:
    """Raise ExportError unless a K x N matrix (in x out) with ``group_size`` fits the Marlin kernel."""
    min_n, min_k = (LEGACY_MIN_N, LEGACY_MIN_K) if legacy else (MIN_N, MIN_K)
    groups = LEGACY_GROUP_SIZES if legacy else RUNTIME_GROUP_SIZES
    rule = "original Marlin (legacy checkpoint)" if legacy else "vLLM gptq_marlin"
    if n % min_n != 0:
        raise ExportError(f"{name}: {n} outputs (N) are not a multiple of {min_n}, which {rule} requires")
    if k % min_k != 0:
        raise ExportError(f"{name}: {k} inputs (K) are not a multiple of {min_k}, which {rule} requires")
    if group_size not in groups:
        raise ExportError(f"{name}: group size {group_size} is not one of {groups}, which {rule} supports")
    if group_size != -1 and k % group_size != 0:
        raise ExportError(f"{name}: {k} inputs (K) are not a multiple of group size {group_size}")


def check_runtime_shapes(ckpt: LatticeCheckpoint, layers: dict[str, tuple[int, int]]) -> None:
    """Every quantized Linear ({weight name: (K, N)}) must fit vLLM gptq_marlin, the kernel that serves GPTQ and
    compressed-tensors checkpoints."""
    for name, (k, n) in layers.items():
        check_marlin_shape(k, n, ckpt.spec.group_size, name)


def _n_groups(k: int, group_size: int) -> int:
    return 1 if group_size == -1 else k // group_size


# ------------------------------------------------------------------------------------------------------------ weights
def pack_marlin_weights(codes: torch.Tensor, group_size: int = 128) -> torch.Tensor:
    """Lattice codes int8 [N, K] (out x in) -> Marlin ``B`` int32 [K/16, 2N]."""
    n, k = codes.shape
    check_marlin_shape(k, n, group_size)
    u = (codes + CODE_OFFSET).T  # [K, N] int8 0..15 (c + 8 cannot overflow int8)
    tiles = u.reshape(k // TILE, TILE, n // TILE, TILE).permute(0, 2, 1, 3).reshape(k // TILE, n * TILE)
    permuted = tiles.reshape(-1, PERM_CHUNK)[:, WEIGHT_PERM].reshape(k // TILE, n * TILE)
    return pack_int4_last_dim(permuted)


def unpack_marlin_weights(packed: torch.Tensor, k: int, n: int) -> torch.Tensor:
    """Marlin ``B`` int32 [K/16, 2N] -> lattice codes int8 [N, K]; the exact inverse of ``pack_marlin_weights``."""
    expected = (k // TILE, n * TILE // NIBBLES_PER_WORD)
    if packed.dtype != torch.int32 or tuple(packed.shape) != expected:
        raise ExportError(f"Marlin B must be int32 {list(expected)} for K={k}, N={n}; got "
                          f"{packed.dtype} {list(packed.shape)}")
    permuted = unpack_int4_last_dim(packed)  # [K/16, 16 N]
    tiles = permuted.reshape(-1, PERM_CHUNK)[:, INVERSE_WEIGHT_PERM]
    u = tiles.reshape(k // TILE, n // TILE, TILE, TILE).permute(0, 2, 1, 3).reshape(k, n)
    return (u.to(CODE_DTYPE) - CODE_OFFSET).T.contiguous()


# ------------------------------------------------------------------------------------------------------------- scales
def permute_marlin_scales(scales: torch.Tensor) -> torch.Tensor:
    """Lattice scales [N, K/g] (out x groups) -> Marlin ``s`` [K/g, N], same dtype, values untouched. The grouped
    permutation applies whenever there is more than one group (vLLM: group_size < K), the single one otherwise."""
    if scales.shape[0] % MIN_N != 0:
        raise ExportError(f"{scales.shape[0]} outputs (N) are not a multiple of {MIN_N}, which Marlin requires")
    s = scales.T.contiguous()
    perm = SCALE_PERM if s.shape[0] > 1 else SCALE_PERM_SINGLE
    return s.reshape(-1, perm.numel())[:, perm].reshape(s.shape).contiguous()


def unpermute_marlin_scales(marlin_scales: torch.Tensor) -> torch.Tensor:
    """Marlin ``s`` [K/g, N] -> lattice scales [N, K/g]; the exact inverse of ``permute_marlin_scales``."""
    perm = SCALE_PERM if marlin_scales.shape[0] > 1 else SCALE_PERM_SINGLE
    s = marlin_scales.reshape(-1, perm.numel())[:, torch.argsort(perm)]
    return s.reshape(marlin_scales.shape).T.contiguous()


# -------------------------------------------------------------------------------------------------------- whole layer
def marlin_pack(codes: torch.Tensor, scales: torch.Tensor, group_size: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """Lattice (codes int8 [N, K], scales fp16 [N, K/g]) -> Marlin (B int32 [K/16, 2N], s [K/g, N])."""
    n, k = codes.shape
    if tuple(scales.shape) != (n, _n_groups(k, group_size)):
        raise ExportError(f"scales {list(scales.shape)} do not fit codes {n}x{k} with group size {group_size}")
    return pack_marlin_weights(codes, group_size), permute_marlin_scales(scales)


def marlin_unpack(packed: torch.Tensor, marlin_scales: torch.Tensor, k: int,
                  n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Marlin (B, s) -> lattice (codes int8 [N, K], scales [N, K/g]); exact inverse of ``marlin_pack``."""
    if marlin_scales.shape[1] != n or k % marlin_scales.shape[0] != 0:
        raise ExportError(f"Marlin s {list(marlin_scales.shape)} does not fit K={k}, N={n}")
    return unpack_marlin_weights(packed, k, n), unpermute_marlin_scales(marlin_scales)


# --------------------------------------------------------------------------------------------- legacy checkpoint
def legacy_quantization_config(spec: LatticeSpec) -> dict:
    """``quantization_config`` of a pre-packed Marlin checkpoint (AutoGPTQ >= 0.8 reads ``checkpoint_format``,
    AutoGPTQ <= 0.7.1 and old vLLM/SGLang read ``is_marlin_format``)."""
    return {"quant_method": "gptq", "bits": 4, "group_size": spec.group_size, "desc_act": False, "sym": True,
            "checkpoint_format": LEGACY_CHECKPOINT_FORMAT, "is_marlin_format": True, "lm_head": False}


def write_marlin_checkpoint(ckpt: LatticeCheckpoint, out_dir: str | os.PathLike, serve_dtype: str | None = None,
                            overwrite: bool = False) -> Path:
    """Legacy pre-packed Marlin checkpoint: per quantized Linear ``B`` int32 [K/16, 2N] and ``s`` fp16 [K/g, N]
    (permuted), every other tensor untouched, config.json with checkpoint_format "marlin". Current vLLM no longer
    loads this (it repacks GPTQ / compressed-tensors at load instead); SGLang and legacy AutoGPTQ do."""
    check_output_path(out_dir, overwrite)
    check_int4_spec(ckpt.spec, "marlin")
    for name, (k, n) in checked_layers(ckpt).items():
        check_marlin_shape(k, n, ckpt.spec.group_size, name, legacy=True)
    serve = resolve_serve_dtype(ckpt, serve_dtype)
    tensors = untouched_tensors(ckpt)
    for name, q in sorted(ckpt.quantized.items()):
        prefix = module_name(name)
        tensors[f"{prefix}.B"], tensors[f"{prefix}.s"] = marlin_pack(q.codes, q.scales.to(SCALE_DTYPE),
                                                                   ckpt.spec.group_size)
    files = prepare_model_files(ckpt, legacy_quantization_config(ckpt.spec), serve, quantize_config_json=True)
    return write_hf_directory(out_dir, tensors, files, LEGACY_WEIGHTS_FILE, overwrite=overwrite)
