"""The lattice checkpoint: the one contract between calibration and every converter, evaluator and publisher.

Layout of a checkpoint directory::

    manifest.json         format, version, lattice (bits, group size, scheme, ggml type) and, for a per-tensor type
                          mix, ``lattice_overrides`` (the tensors on another lattice), method and knobs, per-layer records,
                          calibration summary, source model, sha256 of every file below, and ``manifest_sha256``:
                          the sha256 of the manifest itself (its canonical JSON without that key)
    lattice.safetensors   per quantized weight NAME: "NAME.codes" and "NAME.scales" (float16 [m, n_groups]), and
                          for the affine and K-quant schemes "NAME.mins", "NAME.sub_scales", "NAME.sub_mins" as
                          lattice.py stores them. Codes are uint8 nibble pairs [m, n/2] for 4-bit (code - qmin:
                          code + 8 for the symmetric lattice; column 2j in the low nibble, 2j+1 in the high nibble)
                          and int8 [m, n] otherwise. The manifest's ``lattice`` names the scheme and the ggml type.
    tensors.safetensors   every tensor of the model that was not quantized, in its own dtype
    model/                the model's config, tokenizer and processor files, copied verbatim

Tied tensors (Whisper's token embedding is its output projection) are stored once; ``aliases`` in the manifest maps
each other name to the quantized weight it shares. Nothing in a checkpoint is a pickle. Every write goes to a
temporary directory that is renamed into place only when complete.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from .fileio import atomic_directory
from .quant.lattice import PARAM_FIELDS, LatticeSpec, QuantizedWeight, check_on_lattice

FORMAT_NAME = "tarq-lattice"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
LATTICE_FILE = "lattice.safetensors"
TENSORS_FILE = "tensors.safetensors"
MODEL_FILES_DIR = "model"
MANIFEST_DIGEST_KEY = "manifest_sha256"


class CheckpointError(Exception):
    """A checkpoint that cannot be read as what it claims to be; the message names the file and the problem."""


@dataclass
class LatticeCheckpoint:
    """In-memory form of a lattice checkpoint."""

    spec: LatticeSpec
    quantized: dict[str, QuantizedWeight]
    tensors: dict[str, torch.Tensor]
    aliases: dict[str, str] = field(default_factory=dict)
    metadata: dict = field(default_factory=dict)  # method, knobs, layer records, calibration, source model
    model_files: dict[str, bytes] = field(default_factory=dict)

    def weight_names(self) -> list[str]:
        """Every tensor name of the full model, quantized or not, aliases included."""
        return sorted([*self.quantized, *self.tensors, *self.aliases])

    def dequantized_state_dict(self, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
        """The model's state dict with every lattice weight replaced by its exact value s * q. float32 holds s * q
        exactly; a 16-bit ``dtype`` rounds some products (fp16(s) * 3 needs 13 significant bits), which is what a
        runtime computing in that dtype holds too."""
        state = {name: q.dequantize().to(dtype) for name, q in self.quantized.items()}
        state.update(self.tensors)
        for alias, target in self.aliases.items():
            state[alias] = state[target]
        return state


# ----------------------------------------------------------------------------------------------------- codes packing
def pack_codes(q: QuantizedWeight) -> torch.Tensor:
    """4-bit codes as uint8 nibble pairs (code - qmin), other widths as int8 unchanged."""
    if not _packs_to_nibbles(q.spec, q.codes.shape[1]):
        return q.codes.contiguous()
    u = (q.codes.to(torch.int16) - q.spec.qmin).to(torch.uint8)
    return (u[:, 0::2] | (u[:, 1::2] << 4)).contiguous()


def unpack_codes(stored: torch.Tensor, spec: LatticeSpec, n_cols: int) -> torch.Tensor:
    if not _packs_to_nibbles(spec, n_cols):
        return stored
    # numpy, one pass per nibble into a preallocated array: torch's stack of two int8 halves cost seconds for base
    packed = stored.numpy()
    codes = np.empty((packed.shape[0], n_cols), dtype=np.int8)
    codes[:, 0::2] = (packed & 0x0F).view(np.int8)
    codes[:, 1::2] = (packed >> 4).view(np.int8)
    codes += np.int8(spec.qmin)
    return torch.from_numpy(codes)


def _packs_to_nibbles(spec: LatticeSpec, n_cols: int) -> bool:
    return spec.bits == 4 and n_cols % 2 == 0


# ------------------------------------------------------------------------------------------------------------ writing
def save_checkpoint(ckpt: LatticeCheckpoint, out_dir: str | os.PathLike) -> Path:
    """Write ``ckpt`` to ``out_dir`` atomically (temporary directory, then rename); returns the final path."""
    out = Path(out_dir)
    with atomic_directory(out) as tmp:
        _write_contents(ckpt, tmp)
        _check_replaceable(out)
    return out


def _write_contents(ckpt: LatticeCheckpoint, directory: Path) -> None:
    lattice: dict[str, torch.Tensor] = {}
    shapes: dict[str, list[int]] = {}
    for name in sorted(ckpt.quantized):
        q = ckpt.quantized[name]
        check_on_lattice(q)
        lattice[f"{name}.codes"] = pack_codes(q).cpu()
        for part, tensor in q.params().items():
            lattice[f"{name}.{part}"] = tensor.cpu().contiguous()
        shapes[name] = list(q.codes.shape)
    save_file(lattice, str(directory / LATTICE_FILE), metadata={"format": FORMAT_NAME})
    tensors = {k: v.detach().cpu().contiguous() for k, v in sorted(ckpt.tensors.items())}
    save_file(tensors, str(directory / TENSORS_FILE), metadata={"format": FORMAT_NAME})
    (directory / MODEL_FILES_DIR).mkdir()
    for rel, data in sorted(ckpt.model_files.items()):
        target = directory / MODEL_FILES_DIR / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data)
    manifest = {
        "format": FORMAT_NAME,
        "format_version": FORMAT_VERSION,
        "lattice": _lattice_record(ckpt.spec),
        "quantized": shapes,
        "aliases": dict(sorted(ckpt.aliases.items())),
        **ckpt.metadata,
        "files": {rel: _sha256(directory / rel) for rel in _payload_files(directory)},
    }
    overrides = {name: _lattice_record(q.spec) for name, q in sorted(ckpt.quantized.items()) if q.spec != ckpt.spec}
    if overrides:  # a per-tensor type mix (quant/recipe.py); a uniform checkpoint's manifest has no such key
        manifest["lattice_overrides"] = overrides
    manifest[MANIFEST_DIGEST_KEY] = manifest_digest(manifest)
    (directory / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")


def _lattice_record(spec: LatticeSpec) -> dict:
    return {"bits": spec.bits, "group_size": spec.group_size, "scheme": spec.scheme, "ggml_type": ggml_type_name(spec),
            "scale_dtype": "float16", "scale_grid": spec.scale_grid,
            "code_storage": "nibble" if spec.bits == 4 else "int8"}


def _spec_of_record(record: dict) -> LatticeSpec:
    return LatticeSpec(bits=record["bits"], group_size=record["group_size"], scheme=record.get("scheme", "symmetric"),
                       scale_grid=record.get("scale_grid", "float16"))


def ggml_type_name(spec: LatticeSpec) -> str | None:
    """The ggml type a lattice is stored in exactly ("q4_0", "q5_k", ...), or None (a symmetric lattice of another
    bit width, for the GPU formats)."""
    from .quant.choices import GGML_TYPES

    for name, (scheme, bits, _group) in GGML_TYPES.items():
        if (scheme, bits) == (spec.scheme, spec.bits):
            return name
    return None


def manifest_digest(manifest: dict) -> str:
    """sha256 of the manifest's canonical JSON (sorted keys, no whitespace) without its own digest: an edit to the
    manifest (a shape, the lattice, a file hash) is caught like an edit to any file it lists."""
    body = {k: v for k, v in manifest.items() if k != MANIFEST_DIGEST_KEY}
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def _payload_files(directory: Path) -> list[str]:
    return sorted(str(p.relative_to(directory)) for p in directory.rglob("*") if p.is_file() and p.name != MANIFEST)


def _check_replaceable(out: Path) -> None:
    """Only an earlier checkpoint may be replaced (atomic_directory sets it aside, removed after the move)."""
    if out.exists() and not (out / MANIFEST).is_file():
        raise CheckpointError(f"{out}: exists and is not a lattice checkpoint; refusing to overwrite it")


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


# ------------------------------------------------------------------------------------------------------------ reading
def read_manifest(directory: str | os.PathLike) -> dict:
    path = Path(directory) / MANIFEST
    if not path.is_file():
        raise CheckpointError(f"{path}: missing; {directory} is not a lattice checkpoint")
    try:
        manifest = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: not valid JSON ({e})") from None
    if manifest.get("format") != FORMAT_NAME:
        raise CheckpointError(f"{path}: format is {manifest.get('format')!r}, expected {FORMAT_NAME!r}")
    if manifest.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(f"{path}: format version {manifest.get('format_version')} is not supported "
                              f"(this tool reads version {FORMAT_VERSION})")
    return manifest


def load_checkpoint(directory: str | os.PathLike, verify_hashes: bool = True) -> LatticeCheckpoint:
    """Read a checkpoint back: bit-identical codes and scales, untouched tensors, model files and metadata."""
    root = Path(directory)
    manifest = read_manifest(root)
    if verify_hashes:
        _verify_manifest(root, manifest)
        _verify_files(root, manifest)
    try:
        spec = _spec_of_record(manifest["lattice"])
        overrides = {name: _spec_of_record(record) for name, record in manifest.get("lattice_overrides", {}).items()}
        shapes = dict(manifest["quantized"])
    except (KeyError, TypeError, ValueError) as e:
        raise CheckpointError(f"{root / MANIFEST}: malformed lattice description ({type(e).__name__}: {e})") from None
    raw = _load_safetensors(root / LATTICE_FILE)
    quantized = {name: _quantized_from(raw, name, shape, overrides.get(name, spec), root / LATTICE_FILE)
                 for name, shape in shapes.items()}
    tensors = _load_safetensors(root / TENSORS_FILE)
    model_files = {str(p.relative_to(root / MODEL_FILES_DIR)): p.read_bytes()
                   for p in sorted((root / MODEL_FILES_DIR).rglob("*")) if p.is_file()}
    reserved = {"format", "format_version", "lattice", "lattice_overrides", "quantized", "aliases", "files"}
    metadata = {k: v for k, v in manifest.items() if k not in reserved}
    return LatticeCheckpoint(spec, quantized, tensors, manifest.get("aliases", {}), metadata, model_files)


def _verify_manifest(root: Path, manifest: dict) -> None:
    """The manifest's own digest (checkpoints written before it existed carry none and are not checked)."""
    recorded = manifest.get(MANIFEST_DIGEST_KEY)
    if recorded is not None and recorded != manifest_digest(manifest):
        raise CheckpointError(f"{root / MANIFEST}: content does not match its own {MANIFEST_DIGEST_KEY} (edited or "
                              f"corrupted)")


def _verify_files(root: Path, manifest: dict) -> None:
    for rel, expected in manifest.get("files", {}).items():
        path = root / rel
        if not path.is_file():
            raise CheckpointError(f"{path}: listed in {MANIFEST} but missing")
        if _sha256(path) != expected:
            raise CheckpointError(f"{path}: content does not match its sha256 in {MANIFEST} (corrupted or truncated)")


def _load_safetensors(path: Path) -> dict[str, torch.Tensor]:
    if not path.is_file():
        raise CheckpointError(f"{path}: missing")
    try:
        return load_file(str(path))
    except (SafetensorError, OSError, ValueError) as e:
        raise CheckpointError(f"{path}: not a readable safetensors file ({e})") from None


def _quantized_from(raw: dict[str, torch.Tensor], name: str, shape: list[int], spec: LatticeSpec, path: Path) -> QuantizedWeight:
    if f"{name}.codes" not in raw or f"{name}.scales" not in raw:
        raise CheckpointError(f"{path}: codes or scales of {name} missing")
    params = {part: raw[f"{name}.{part}"] for part in PARAM_FIELDS if f"{name}.{part}" in raw}
    if not (isinstance(shape, list) and len(shape) == 2 and all(isinstance(d, int) and d > 0 for d in shape)):
        raise CheckpointError(f"{path.parent / MANIFEST}: shape of {name} is {shape!r}, not [rows, columns]")
    stored = raw[f"{name}.codes"]
    packed = [shape[0], shape[1] // 2] if _packs_to_nibbles(spec, shape[1]) else list(shape)
    if list(stored.shape) != packed:
        raise CheckpointError(f"{path}: codes of {name} are stored as {list(stored.shape)}, which does not fit its "
                              f"shape {shape} in {MANIFEST}")
    q = QuantizedWeight(unpack_codes(stored, spec, shape[1]), spec=spec, **params)
    if list(q.codes.shape) != list(shape):
        raise CheckpointError(f"{path}: codes of {name} have shape {list(q.codes.shape)}, manifest says {shape}")
    try:
        check_on_lattice(q)
    except ValueError as e:
        raise CheckpointError(f"{path}: {name}: {e}") from None
    return q
