"""What the transformers-style int4 targets (GPTQ, compressed-tensors, Marlin) share: int4 nibble packing, the
checks of scales against the serving dtype and of the quantized layers, and the checkpoint directory they write
(one safetensors file plus the model files, config.json carrying ``quantization_config``).

Scales and the serving dtype: runtimes cast scales to the model's dtype (bf16 for Voxtral). fp16 scales are exact in
fp16 by construction; serving in bf16 is exact only if every scale is also representable in bf16. The converters
check that and refuse, never round (see ``check_scales_for``).
"""

from __future__ import annotations

import json
import logging
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from safetensors.torch import save_file

from tarq_deploy.checkpoint import LatticeCheckpoint
from tarq_deploy.fileio import atomic_directory
from tarq_deploy.quant.lattice import LatticeSpec, QuantizedWeight

__all__ = ["CODE_OFFSET", "ExportError", "INT4_BITS", "Int4Layout", "NIBBLES_PER_WORD", "SERVE_DTYPES",
           "check_int4_spec", "check_output_path", "checked_layers", "module_name", "pack_int4_last_dim",
           "prepare_model_files", "resolve_serve_dtype", "scales_exact_in_bf16", "unpack_int4_last_dim",
           "untouched_tensors", "write_hf_directory", "write_int4_checkpoint"]

log = logging.getLogger(__name__)

INT4_BITS = 4
NIBBLES_PER_WORD = 8
CODE_OFFSET = 8  # u = c + 8; also the symmetric zero point
WEIGHT_SUFFIX = ".weight"
WEIGHTS_FILE = "model.safetensors"
CONFIG_FILE = "config.json"
QUANTIZE_CONFIG_FILE = "quantize_config.json"
SAFETENSORS_METADATA = {"format": "pt"}  # transformers refuses safetensors files without it
# Marlin kernels run in float16 or bfloat16; float32 (CPU loaders) holds every fp16 scale exactly too.
SERVE_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
CONFIG_DTYPE_KEYS = ("torch_dtype", "dtype")
SUB_CONFIG_KEYS = ("text_config", "audio_config")
# Files of the source model that describe weights we replace; never copied into an exported checkpoint.
STALE_WEIGHT_INDEX_SUFFIXES = (".safetensors", ".safetensors.index.json", ".bin", ".bin.index.json")


class ExportError(ValueError):
    """The lattice cannot be written exactly in the requested target; the message says which tensor and why."""


# ----------------------------------------------------------------------------------------------- nibble packing
def pack_int4_last_dim(values: torch.Tensor) -> torch.Tensor:
    """Values 0..15 [..., 8 W] -> int32 [..., W]: value 8 w + j in bits 4 j .. 4 j + 3 (low nibble first).

    Two values make a byte (even one low) and four bytes a little-endian word, which is exactly that order."""
    _require_little_endian()
    v = values.to(torch.uint8)
    pairs = v[..., 0::2] | (v[..., 1::2] << 4)
    return pairs.contiguous().view(torch.int32)


def unpack_int4_last_dim(words: torch.Tensor) -> torch.Tensor:
    """int32 [..., W] -> uint8 values 0..15 [..., 8 W]; the exact inverse of ``pack_int4_last_dim``."""
    _require_little_endian()
    pairs = words.contiguous().view(torch.uint8)
    return torch.stack((pairs & 0xF, pairs >> 4), dim=-1).flatten(-2)


def _require_little_endian() -> None:
    # The byte views above read words in the host's byte order; every platform these runtimes serve on is
    # little-endian, and a big-endian host would silently scramble the nibbles.
    if sys.byteorder != "little":
        raise ExportError("int4 packing here assumes a little-endian host")


# -------------------------------------------------------------------------------------------------- scale dtypes
def scales_exact_in(scales: torch.Tensor, dtype: torch.dtype) -> bool:
    """True when every scale survives a cast to ``dtype`` unchanged (what a runtime does at load)."""
    return bool(torch.equal(scales.to(dtype).to(torch.float32), scales.to(torch.float32)))


def scales_exact_in_bf16(scales: torch.Tensor) -> bool:
    """True when every (fp16) scale is exactly representable in bfloat16: then serving in bf16 is bit-exact."""
    return scales_exact_in(scales, torch.bfloat16)


def inexact_scale_counts(ckpt: LatticeCheckpoint, dtype: torch.dtype) -> dict[str, int]:
    """Per quantized weight, how many scales would change when cast to ``dtype`` (only the non-zero counts)."""
    counts = {}
    for name, q in sorted(ckpt.quantized.items()):
        changed = int((q.scales.to(dtype).float() != q.scales.float()).sum())
        if changed:
            counts[name] = changed
    return counts


def check_scales_for(ckpt: LatticeCheckpoint, serve_dtype: str) -> None:
    """Refuse (ExportError) when serving in ``serve_dtype`` would change any scale; never rounds anything."""
    dtype = SERVE_DTYPES[serve_dtype]
    counts = inexact_scale_counts(ckpt, dtype)
    if counts:
        total = sum(q.scales.numel() for q in ckpt.quantized.values())
        first = next(iter(counts))
        raise ExportError(
            f"{sum(counts.values())} of {total} scales in {len(counts)} layers (first: {first}) are not exactly "
            f"representable in {serve_dtype}; a runtime serving in {serve_dtype} would round them and break the "
            f"lattice. Quantize with --scale-dtype bfloat16 (scales exact in both float16 and bfloat16), or export "
            f"and serve with dtype float16.")


def resolve_serve_dtype(ckpt: LatticeCheckpoint, serve_dtype: str | None) -> str:
    """The dtype the runtime will run in: as asked, else the model config's, else float16; scales checked for it."""
    chosen = serve_dtype or config_dtype(ckpt) or "float16"
    if chosen not in SERVE_DTYPES:
        raise ExportError(f"serving dtype must be one of {sorted(SERVE_DTYPES)}, got {chosen!r}")
    check_scales_for(ckpt, chosen)
    return chosen


def config_dtype(ckpt: LatticeCheckpoint) -> str | None:
    config = _model_config(ckpt)
    for section in (config, *(config.get(key) or {} for key in SUB_CONFIG_KEYS)):
        for key in CONFIG_DTYPE_KEYS:
            if isinstance(section.get(key), str):
                return section[key]
    return None


# ------------------------------------------------------------------------------------------------- layer checks
def check_int4_spec(spec: LatticeSpec, target: str) -> None:
    if spec.bits != INT4_BITS:
        raise ExportError(f"{target} holds 4-bit codes; this lattice has {spec.bits} bits")


def module_name(weight_name: str) -> str:
    """State-dict weight name -> module name ('a.b.q_proj.weight' -> 'a.b.q_proj')."""
    if not weight_name.endswith(WEIGHT_SUFFIX):
        raise ExportError(f"{weight_name}: quantized tensors must be Linear weights named '*{WEIGHT_SUFFIX}'")
    return weight_name[: -len(WEIGHT_SUFFIX)]


def checked_layers(ckpt: LatticeCheckpoint) -> dict[str, tuple[int, int]]:
    """{weight name: (K, N)} after checking names, packing divisibility and aliases; raises ExportError."""
    layers = {}
    for name, q in sorted(ckpt.quantized.items()):
        module_name(name)
        n, k = q.codes.shape
        if k % NIBBLES_PER_WORD or n % NIBBLES_PER_WORD:
            raise ExportError(f"{name}: shape {n}x{k}; int32 packing needs inputs and outputs multiples of 8")
        layers[name] = (k, n)
    for alias, target in sorted(ckpt.aliases.items()):
        if target in ckpt.quantized:
            raise ExportError(f"{alias} is tied to the quantized {target}; a tied quantized weight cannot be "
                              f"written as a packed Linear: keep {target} in 16 bits")
    return layers



# ------------------------------------------------------------------------------------------ directory output
def untouched_tensors(ckpt: LatticeCheckpoint) -> dict[str, torch.Tensor]:
    """Every tensor that was not quantized, in its own dtype; tied copies (aliases of untouched tensors) are
    written as their own tensors so that no loader has to know about the tie."""
    tensors = {name: t.detach().cpu().contiguous() for name, t in ckpt.tensors.items()}
    for alias, target in ckpt.aliases.items():
        if target in ckpt.tensors:
            tensors[alias] = ckpt.tensors[target].detach().cpu().clone().contiguous()
    return tensors


def _model_config(ckpt: LatticeCheckpoint) -> dict:
    raw = ckpt.model_files.get(CONFIG_FILE)
    if raw is None:
        return {}
    try:
        return json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ExportError(f"model file {CONFIG_FILE} is not valid JSON ({e})") from None


def prepare_model_files(ckpt: LatticeCheckpoint, quantization_config: dict, serve_dtype: str,
                        quantize_config_json: bool = False) -> dict[str, bytes]:
    """The model files to write: config.json with ``quantization_config`` (and the serving dtype, so a runtime's
    default is the checked one), the rest copied verbatim except stale weight files or indexes."""
    files = {rel: data for rel, data in ckpt.model_files.items() if not rel.endswith(STALE_WEIGHT_INDEX_SUFFIXES)}
    config = _model_config(ckpt)
    if not config:
        log.warning("lattice checkpoint has no %s; writing one that holds only quantization_config", CONFIG_FILE)
    _set_config_dtype(config, serve_dtype)
    config["quantization_config"] = quantization_config
    files[CONFIG_FILE] = _json_bytes(config)
    if quantize_config_json:
        files[QUANTIZE_CONFIG_FILE] = _json_bytes(quantization_config)
    return files


def _set_config_dtype(config: dict, serve_dtype: str) -> None:
    """Make the config's dtype the checked serving dtype, so that a runtime's default ("auto") is the safe one."""
    found = False
    for section in (config, *(config.get(key) for key in SUB_CONFIG_KEYS)):
        if not isinstance(section, dict):
            continue
        for key in CONFIG_DTYPE_KEYS:
            if key not in section:
                continue
            found = True
            if section[key] != serve_dtype:
                log.warning("config %s %r -> %r: the runtime will cast untouched tensors to %s",
                            key, section[key], serve_dtype, serve_dtype)
                section[key] = serve_dtype
    if not found:
        config[CONFIG_DTYPE_KEYS[0]] = serve_dtype


def _json_bytes(data: dict) -> bytes:
    return (json.dumps(data, indent=2, sort_keys=True) + "\n").encode()


def check_output_path(out_dir: str | os.PathLike, overwrite: bool) -> None:
    """Refuse early, before any packing, to replace an existing output unless asked."""
    if Path(out_dir).exists() and not overwrite:
        raise ExportError(f"{out_dir} already exists; pass overwrite to replace it")


def write_hf_directory(out_dir: str | os.PathLike, tensors: dict[str, torch.Tensor], files: dict[str, bytes],
                       weights_file: str, overwrite: bool = False) -> Path:
    """Write tensors (one safetensors file) and files into a temporary sibling directory, then rename it to
    ``out_dir``; on any error nothing is left behind. An existing ``out_dir`` is replaced only if ``overwrite``."""
    check_output_path(out_dir, overwrite)
    out = Path(out_dir)
    with atomic_directory(out) as tmp:
        save_file(tensors, str(tmp / weights_file), metadata=SAFETENSORS_METADATA)
        for rel, data in sorted(files.items()):
            target = tmp / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(data)
    return out


# ------------------------------------------------------------------------------------------ one writer for all
@dataclass(frozen=True)
class Int4Layout:
    """How one int4 format stores a lattice checkpoint; ``write_int4_checkpoint`` does the rest the same way."""

    name: str  # names the format in errors
    # one quantized Linear -> {tensor suffix: tensor}, given the lattice spec and the serving dtype's name
    pack_layer: Callable[[QuantizedWeight, LatticeSpec, str], dict[str, torch.Tensor]]
    # (spec, the untouched tensors, the quantized modules' names) -> config.json's quantization_config
    quantization_config: Callable[[LatticeSpec, dict[str, torch.Tensor], list[str]], dict]
    # refuses quantized Linears ({weight name: (K, N)}) the serving kernel cannot run; the caller may skip it
    check_shapes: Callable[[LatticeCheckpoint, dict[str, tuple[int, int]]], None]
    quantize_config_json: bool = False  # also write quantization_config as quantize_config.json
    weights_file: str = WEIGHTS_FILE


def write_int4_checkpoint(layout: Int4Layout, ckpt: LatticeCheckpoint, out_dir: str | os.PathLike,
                          serve_dtype: str | None, check_shapes: bool, overwrite: bool) -> Path:
    """Write ``ckpt`` in ``layout`` into ``out_dir`` (atomically); every check runs before anything is written."""
    check_output_path(out_dir, overwrite)
    check_int4_spec(ckpt.spec, layout.name)
    layers = checked_layers(ckpt)
    if check_shapes:
        layout.check_shapes(ckpt, layers)
    serve = resolve_serve_dtype(ckpt, serve_dtype)
    tensors = untouched_tensors(ckpt)
    qconfig = layout.quantization_config(ckpt.spec, tensors, [module_name(n) for n in layers])
    for name, q in sorted(ckpt.quantized.items()):
        prefix = module_name(name)
        for suffix, tensor in layout.pack_layer(q, ckpt.spec, serve).items():
            tensors[f"{prefix}.{suffix}"] = tensor
    files = prepare_model_files(ckpt, qconfig, serve, quantize_config_json=layout.quantize_config_json)
    return write_hf_directory(out_dir, tensors, files, layout.weights_file, overwrite=overwrite)
