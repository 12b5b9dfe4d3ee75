"""GPTQ v1 checkpoints from a lattice checkpoint, bit for bit, plus the shared machinery of the HF-style int4 targets.

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

Scales and the serving dtype: runtimes cast scales to the model's dtype (bf16 for Voxtral). fp16 scales are exact in
fp16 by construction; serving in bf16 is exact only if every scale is also representable in bf16. The converters
here check that and refuse, never round (see ``check_scales_for``).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import sys
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file

from tarq_deploy.checkpoint import LatticeCheckpoint
from tarq_deploy.fileio import replace_directory
from tarq_deploy.quant.lattice import CODE_DTYPE, SCALE_DTYPE, LatticeSpec

log = logging.getLogger(__name__)

INT4_BITS = 4
NIBBLES_PER_WORD = 8
CODE_OFFSET = 8  # u = c + 8; also the symmetric zero point
GPTQ_V1_ZERO_SHIFT = 1  # v1 stores zero point minus one
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
            f"lattice. Quantize with scales snapped to values exact in both float16 and bfloat16, or export and "
            f"serve with dtype float16.")


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


def check_runtime_shapes(ckpt: LatticeCheckpoint, layers: dict[str, tuple[int, int]]) -> None:
    """Every quantized Linear must fit vLLM gptq_marlin (the kernel that serves these checkpoints)."""
    from .marlin import check_marlin_shape  # marlin builds on this module; imported here to avoid a cycle

    for name, (k, n) in layers.items():
        check_marlin_shape(k, n, ckpt.spec.group_size, name)


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


def write_gptq_checkpoint(ckpt: LatticeCheckpoint, out_dir: str | os.PathLike, serve_dtype: str | None = None,
                          require_marlin_shapes: bool = True, overwrite: bool = False) -> Path:
    """Write ``ckpt`` as a GPTQ v1 safetensors checkpoint in ``out_dir`` (atomically); returns the path.

    ``serve_dtype`` ('float16' | 'bfloat16' | 'float32', default: the model config's dtype) is the dtype the runtime
    will run in, written into config.json; bf16 is refused unless every scale is exact in bf16.
    ``require_marlin_shapes`` refuses layers vLLM's Marlin kernel cannot serve (N % 64, K % 128). Everything is
    checked before anything is written."""
    check_output_path(out_dir, overwrite)
    check_int4_spec(ckpt.spec, "GPTQ")
    layers = checked_layers(ckpt)
    if require_marlin_shapes:
        check_runtime_shapes(ckpt, layers)
    serve = resolve_serve_dtype(ckpt, serve_dtype)
    tensors = untouched_tensors(ckpt)
    for name, q in sorted(ckpt.quantized.items()):
        prefix = module_name(name)
        for suffix, tensor in gptq_tensors(q.codes, q.scales, ckpt.spec).items():
            tensors[f"{prefix}.{suffix}"] = tensor
    qconfig = gptq_quantization_config(ckpt.spec, [module_name(n) for n in layers])
    files = prepare_model_files(ckpt, qconfig, serve, quantize_config_json=True)
    return write_hf_directory(out_dir, tensors, files, WEIGHTS_FILE, overwrite=overwrite)


# ------------------------------------------------------------------------------------- shared HF directory output
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
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        save_file(tensors, str(tmp / weights_file), metadata=SAFETENSORS_METADATA)
        for rel, data in sorted(files.items()):
            target = tmp / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(data)
        replace_directory(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


