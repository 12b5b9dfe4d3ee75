"""The lattice checkpoint: the one contract between calibration and every converter, evaluator and publisher.

Layout of a checkpoint directory::

    manifest.json         format, version, lattice (bits, group size, scheme, ggml type, code storage) and, for a
                          per-tensor type mix, ``lattice_overrides`` (the tensors on another lattice), method and knobs,
                          per-layer records, calibration summary, source model, two digests of every file below
                          (``files``: sha256, ``files_xxh3``: xxh3-128) and ``manifest_sha256``: the sha256 of the
                          manifest itself (its canonical JSON without that key)
    lattice.safetensors   per quantized weight NAME, by the lattice's ``code_storage``:
                          "ggml-blocks": "NAME.blocks", uint8 [m, row bytes], the weight as the blocks of the ggml type
                          whose lattice it is group for group (Q4_0 ... Q6_K: quant/ggml_types.py), so an export to
                          that type copies bytes and a load decodes them only when a caller needs the codes;
                          "nibble" / "int8" (every other lattice): "NAME.codes" and "NAME.scales" (float16
                          [m, n_groups]), and for the affine and K-quant schemes "NAME.mins", "NAME.sub_scales",
                          "NAME.sub_mins" as lattice.py stores them. Codes are uint8 nibble pairs [m, n/2] for 4-bit
                          (code - qmin: code + 8 for the symmetric lattice; column 2j in the low nibble, 2j+1 in the
                          high nibble) and int8 [m, n] otherwise.
    tensors.safetensors   every tensor of the model that was not quantized, in its own dtype
    vocabulary.safetensors  a byte-level BPE tokenizer's tokens as raw bytes (vocabulary.py), derived from
                          model/tokenizer.json when the checkpoint is written (the manifest's ``vocabulary`` names
                          the tokenizer's xxh3); absent for other tokenizers
    model/                the model's config, tokenizer and processor files, copied verbatim

Loading checks every file against its xxh3-128 digest (a 40 MB checkpoint in 2 ms; sha256 takes 25 ms, as long as
reading it); ``load_checkpoint(..., sha256=True)`` checks the sha256 digests too, as ``tarq-deploy verify`` does.
Version 1 checkpoints (codes for every lattice, sha256 only, no vocabulary) are read as before.

Tied tensors (Whisper's token embedding is its output projection) are stored once; ``aliases`` in the manifest maps
each other name to the quantized weight it shares. Nothing in a checkpoint is a pickle. Every write goes to a
temporary directory that is renamed into place only when complete.
"""

from __future__ import annotations

import json
import mmap
import os
import threading
from collections.abc import Callable, Iterator, Mapping, MutableMapping
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import torch
import xxhash
from safetensors import SafetensorError
from safetensors.numpy import save_file as save_numpy_file
from safetensors.torch import load as load_torch_bytes

from .errors import JSON_ERRORS
from .fileio import atomic_directory
from .hashing import file_sha256_and, json_fingerprint, sha256_hex
from .model_source import CHECKPOINT_LATTICE, CHECKPOINT_MANIFEST, CHECKPOINT_MODEL_DIR
from .quant.ggml_types import block_matrix_shape, check_block_scales, native_type, pack, unpack
from .quant.lattice import PARAM_FIELDS, LatticeSpec, QuantizedWeight, check_on_lattice
from .quant.precision import release_mapped_pages
from .safetensors_view import (SafetensorsViewError, map_private, map_readonly, tensor_views, torch_views,
                               write_safetensors)
from .vocabulary import TokenTable, table_of_tokens, token_strings

__all__ = ["CheckpointError", "FAST_DIGESTS_KEY", "LatticeCheckpoint", "LatticeWeights", "MANIFEST",
           "MANIFEST_DIGEST_KEY", "fast_digest", "ggml_type_name", "load_checkpoint", "manifest_digest", "pack_codes",
           "read_manifest", "save_checkpoint", "table_of_tokenizer", "unpack_codes"]

FORMAT_NAME = "tarq-lattice"
FORMAT_VERSION = 2
READABLE_VERSIONS = (1, 2)
MANIFEST = CHECKPOINT_MANIFEST  # the two markers tarq_deploy.model_source knows a checkpoint folder by
LATTICE_FILE = CHECKPOINT_LATTICE
TENSORS_FILE = "tensors.safetensors"
VOCABULARY_FILE = "vocabulary.safetensors"
MODEL_FILES_DIR = CHECKPOINT_MODEL_DIR
MODEL_FILES_PREFIX = MODEL_FILES_DIR + os.sep  # of a model file's path relative to the checkpoint
TOKENIZER_FILE = "tokenizer.json"
MANIFEST_DIGEST_KEY = "manifest_sha256"
FAST_DIGESTS_KEY = "files_xxh3"
VOCABULARY_KEY = "vocabulary"
BLOCK_STORAGE = "ggml-blocks"
# far beyond any tokenizer's ids (Qwen's 151,936; Gemma's 262,144): a larger one is a corrupt tokenizer.json
MAX_TOKEN_ID = 1 << 22


class CheckpointError(Exception):
    """A checkpoint that cannot be read as what it claims to be; the message names the file and the problem."""


# ------------------------------------------------------------------------------------------------ lattice weights
@dataclass(frozen=True)
class StoredBlocks:
    """A lattice weight as read from a checkpoint: the blocks of its native ggml type, not yet decoded."""

    spec: LatticeSpec
    shape: tuple[int, int]
    blocks: np.ndarray  # uint8 [m, row bytes], in the shape block_matrix_shape gives

    @property
    def ggml_type(self):  # -> GGMLType
        return native_type(self.spec)


class LatticeWeights(MutableMapping):
    """The lattice weights of a checkpoint by name (a Mapping[str, QuantizedWeight]). A weight read as ggml blocks
    is decoded into codes and parameters the first time a caller asks for it (and checked on the lattice then), and
    kept; ``blocks`` hands the stored bytes to an exporter of the same type, which then copies them and decodes
    nothing. ``spec_of`` and ``shape_of`` answer without decoding."""

    def __init__(self, weights: Mapping[str, QuantizedWeight] | None = None) -> None:
        self._entries: dict[str, QuantizedWeight | StoredBlocks] = dict(weights or {})
        self._decoded: dict[str, QuantizedWeight] = {}

    def add_blocks(self, name: str, stored: StoredBlocks) -> None:
        self._entries[name] = stored
        self._decoded.pop(name, None)

    def __getitem__(self, name: str) -> QuantizedWeight:
        entry = self._entries[name]
        if isinstance(entry, QuantizedWeight):
            return entry
        if name not in self._decoded:
            q = unpack(entry.blocks, entry.ggml_type)
            check_on_lattice(q)
            self._decoded[name] = q
        return self._decoded[name]

    def __setitem__(self, name: str, q: QuantizedWeight) -> None:
        self._entries[name] = q
        self._decoded.pop(name, None)

    def __delitem__(self, name: str) -> None:
        del self._entries[name]
        self._decoded.pop(name, None)

    def __contains__(self, name: object) -> bool:  # Mapping's own would decode the entry to answer
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def spec_of(self, name: str) -> LatticeSpec:
        return self._entries[name].spec

    def shape_of(self, name: str) -> tuple[int, int]:
        return tuple(self._entries[name].shape)  # type: ignore[return-value]

    def blocks(self, name: str, ggml_type: int) -> np.ndarray | None:
        """The stored blocks of ``name`` if it was read as ``ggml_type`` blocks; None otherwise (pack it)."""
        stored = self.stored(name)
        return stored.blocks if stored is not None and stored.ggml_type == ggml_type else None

    def stored(self, name: str) -> StoredBlocks | None:
        """``name`` as read from the checkpoint's blocks, undecoded; None for a weight held as codes."""
        entry = self._entries[name]
        return entry if isinstance(entry, StoredBlocks) else None


@dataclass
class LatticeCheckpoint:
    """In-memory form of a lattice checkpoint."""

    spec: LatticeSpec
    quantized: LatticeWeights  # a plain dict of QuantizedWeight is taken too (and wrapped)
    tensors: dict[str, torch.Tensor]
    aliases: dict[str, str] = field(default_factory=dict)
    metadata: dict = field(default_factory=dict)  # method, knobs, layer records, calibration, source model
    model_files: dict[str, bytes] = field(default_factory=dict)
    token_table: TokenTable | None = None  # as read from vocabulary.safetensors; see tokens()
    digests: "DigestCheck | None" = None  # still running for a load_checkpoint(..., background=True)

    def __post_init__(self) -> None:
        if not isinstance(self.quantized, LatticeWeights):
            self.quantized = LatticeWeights(self.quantized)

    def wait_verified(self) -> None:
        """Return once the files' digests matched (at once unless loaded with background=True); CheckpointError
        naming the file when one did not."""
        if self.digests is not None:
            self.digests.wait()

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

    def tokens(self) -> TokenTable | None:
        """The tokenizer's tokens as raw bytes: the stored table while model/tokenizer.json is the one it was
        derived from, else derived anew; None without a byte-level BPE tokenizer.json."""
        raw = self.model_files.get(TOKENIZER_FILE)
        if raw is None:
            return None
        if self.token_table is None or self.token_table.source_digest != fast_digest(raw):
            self.token_table = table_of_tokenizer(raw)
        return self.token_table


def table_of_tokenizer(raw: bytes) -> TokenTable | None:
    """The token table of a tokenizer.json's bytes, tagged with their digest; None if it is not byte-level BPE (or
    not a tokenizer this table can describe: exporters read the tokenizer itself)."""
    try:
        id_to_token = token_strings(json.loads(raw))
        if not all(isinstance(i, int) and 0 <= i < MAX_TOKEN_ID for i in id_to_token):
            return None  # the table has a row for every id up to the largest: a corrupt id would cost its size
        table = table_of_tokens(id_to_token)
    except (*JSON_ERRORS, AttributeError, TypeError, KeyError):  # NotByteLevel is a ValueError too
        return None
    return replace(table, source_digest=fast_digest(raw))


# ----------------------------------------------------------------------------------------------------- digests
class DigestCheck:
    """A check of file digests run in a thread while the caller goes on (xxh3 and sha256 let go of the GIL while
    they hash); ``wait`` joins it and raises the CheckpointError it found."""

    def __init__(self, check: Callable[[], None]) -> None:
        self._error: CheckpointError | None = None
        self._thread = threading.Thread(target=self._run, args=(check,), name="checkpoint digests", daemon=True)
        self._thread.start()

    def _run(self, check: Callable[[], None]) -> None:
        try:
            check()
        except CheckpointError as e:
            self._error = e

    def wait(self) -> None:
        self._thread.join()
        if self._error is not None:
            raise self._error


def fast_digest(data: bytes | memoryview | mmap.mmap) -> str:
    """xxh3-128 of a buffer: a checksum against corruption and truncation at memory speed."""
    return xxhash.xxh3_128_hexdigest(data)


def manifest_digest(manifest: dict) -> str:
    """sha256 of the manifest's canonical JSON (sorted keys, no whitespace) without its own digest: an edit to the
    manifest (a shape, the lattice, a file hash) is caught like an edit to any file it lists."""
    body = {k: v for k, v in manifest.items() if k != MANIFEST_DIGEST_KEY}
    return json_fingerprint(body, ensure_ascii=True, separators=(",", ":"))


# ----------------------------------------------------------------------------------------------------- codes packing
def pack_codes(q: QuantizedWeight) -> torch.Tensor:
    """4-bit codes as uint8 nibble pairs (code - qmin), other widths as int8 unchanged."""
    if not _packs_to_nibbles(q.spec, q.codes.shape[1]):
        return q.codes.contiguous()
    u = (q.codes.to(torch.int16) - q.spec.qmin).to(torch.uint8)
    return (u[:, 0::2] | (u[:, 1::2] << 4)).contiguous()


def unpack_codes(stored: torch.Tensor | np.ndarray, spec: LatticeSpec, n_cols: int) -> torch.Tensor:
    packed = stored.numpy() if isinstance(stored, torch.Tensor) else stored
    if not _packs_to_nibbles(spec, n_cols):
        return torch.from_numpy(np.array(packed))  # a copy: a view of the file is read-only
    # numpy, one pass per nibble into a preallocated array: torch's stack of two int8 halves cost seconds for base
    codes = np.empty((packed.shape[0], n_cols), dtype=np.int8)
    codes[:, 0::2] = (packed & 0x0F).view(np.int8)
    codes[:, 1::2] = (packed >> 4).view(np.int8)
    codes += np.int8(spec.qmin)
    return torch.from_numpy(codes)


def _packs_to_nibbles(spec: LatticeSpec, n_cols: int) -> bool:
    return spec.bits == 4 and n_cols % 2 == 0


def code_storage(spec: LatticeSpec) -> str:
    if native_type(spec) is not None:
        return BLOCK_STORAGE
    return "nibble" if spec.bits == 4 else "int8"


# ------------------------------------------------------------------------------------------------------------ writing
def save_checkpoint(ckpt: LatticeCheckpoint, out_dir: str | os.PathLike) -> Path:
    """Write ``ckpt`` to ``out_dir`` atomically (temporary directory, then rename); returns the final path."""
    out = Path(out_dir)
    with atomic_directory(out) as tmp:
        _write_contents(ckpt, tmp)
        _check_replaceable(out)
    return out


def _write_contents(ckpt: LatticeCheckpoint, directory: Path) -> None:
    lattice: dict[str, np.ndarray] = {}
    shapes: dict[str, list[int]] = {}
    for name in sorted(ckpt.quantized):
        lattice.update(_lattice_arrays(ckpt.quantized, name))
        shapes[name] = list(ckpt.quantized.shape_of(name))
    # streamed a tensor at a time (the library's save_file holds a copy of them all), the same bytes; a source's
    # memory-mapped tensors leave the resident set once written
    write_safetensors(directory / LATTICE_FILE, lattice, {"format": FORMAT_NAME})
    del lattice
    write_safetensors(directory / TENSORS_FILE, dict(ckpt.tensors), {"format": FORMAT_NAME},
                      written=lambda tensor: release_mapped_pages([tensor]))
    vocabulary = _write_vocabulary(ckpt.model_files, directory)
    (directory / MODEL_FILES_DIR).mkdir()
    for rel, data in sorted(ckpt.model_files.items()):
        target = directory / MODEL_FILES_DIR / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data)
    digests = {rel: _file_digests(directory / rel) for rel in _payload_files(directory)}
    manifest = {
        "format": FORMAT_NAME,
        "format_version": FORMAT_VERSION,
        "lattice": _lattice_record(ckpt.spec),
        "quantized": shapes,
        "aliases": dict(sorted(ckpt.aliases.items())),
        **ckpt.metadata,
        "files": {rel: sha256 for rel, (sha256, _) in digests.items()},
        FAST_DIGESTS_KEY: {rel: fast for rel, (_, fast) in digests.items()},
    }
    if vocabulary is not None:
        manifest[VOCABULARY_KEY] = vocabulary
    overrides = {name: _lattice_record(ckpt.quantized.spec_of(name)) for name in sorted(ckpt.quantized)
                 if ckpt.quantized.spec_of(name) != ckpt.spec}
    if overrides:  # a per-tensor type mix (quant/recipe.py); a uniform checkpoint's manifest has no such key
        manifest["lattice_overrides"] = overrides
    manifest[MANIFEST_DIGEST_KEY] = manifest_digest(manifest)
    (directory / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")


def _file_digests(path: Path) -> tuple[str, str]:
    """(sha256, fast_digest) of a file, read once in chunks (a 3-billion-parameter lattice is not held twice)."""
    return file_sha256_and(path, xxhash.xxh3_128())


def _lattice_arrays(weights: LatticeWeights, name: str) -> dict[str, np.ndarray]:
    """The arrays lattice.safetensors holds for one weight, by its lattice's code storage (module docstring)."""
    spec = weights.spec_of(name)
    ggml_type = native_type(spec)
    stored = weights.blocks(name, ggml_type) if ggml_type is not None else None
    if stored is not None:
        return {f"{name}.blocks": stored}  # checked when it was read: saved again as it is
    q = weights[name]
    check_on_lattice(q)
    if ggml_type is not None:
        return {f"{name}.blocks": pack(q, ggml_type)}
    arrays = {f"{name}.codes": pack_codes(q).cpu().numpy()}
    arrays.update({f"{name}.{part}": t.cpu().contiguous().numpy() for part, t in q.params().items()})
    return arrays


def _write_vocabulary(model_files: dict[str, bytes], directory: Path) -> dict | None:
    """Write vocabulary.safetensors when the tokenizer is byte-level BPE; its manifest entry, or None."""
    raw = model_files.get(TOKENIZER_FILE)
    table = table_of_tokenizer(raw) if raw is not None else None
    if table is None:
        return None
    arrays = {"token_records": table.records, "token_lengths": table.lengths,
              "token_defined": table.defined.astype(np.uint8)}
    # one metadata key: safetensors writes a metadata map in hash order, and the same checkpoint must give the
    # same bytes; where the table came from goes into the manifest
    save_numpy_file(arrays, str(directory / VOCABULARY_FILE), metadata={"format": FORMAT_NAME})
    return {"file": VOCABULARY_FILE, "from": f"{MODEL_FILES_DIR}/{TOKENIZER_FILE}", "from_xxh3": table.source_digest}


def _lattice_record(spec: LatticeSpec) -> dict:
    return {"bits": spec.bits, "group_size": spec.group_size, "scheme": spec.scheme, "ggml_type": ggml_type_name(spec),
            "scale_dtype": "float16", "scale_grid": spec.scale_grid, "code_storage": code_storage(spec)}


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


def _payload_files(directory: Path) -> list[str]:
    return sorted(str(p.relative_to(directory)) for p in directory.rglob("*") if p.is_file() and p.name != MANIFEST)


def _check_replaceable(out: Path) -> None:
    """Only an earlier checkpoint may be replaced (atomic_directory sets it aside, removed after the move)."""
    if out.exists() and not (out / MANIFEST).is_file():
        raise CheckpointError(f"{out}: exists and is not a lattice checkpoint; refusing to overwrite it")


# ------------------------------------------------------------------------------------------------------------ reading
def read_manifest(directory: str | os.PathLike) -> dict:
    path = Path(directory) / MANIFEST
    if not path.is_file():
        raise CheckpointError(f"{path}: missing; {directory} is not a lattice checkpoint")
    try:
        manifest = json.loads(path.read_text())
    except JSON_ERRORS as e:
        raise CheckpointError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT_NAME:
        found = manifest.get("format") if isinstance(manifest, dict) else type(manifest).__name__
        raise CheckpointError(f"{path}: format is {found!r}, expected {FORMAT_NAME!r}")
    if manifest.get("format_version") not in READABLE_VERSIONS:
        raise CheckpointError(f"{path}: format version {manifest.get('format_version')} is not supported "
                              f"(this tool reads versions {', '.join(map(str, READABLE_VERSIONS))})")
    _check_manifest_tables(path, manifest)
    return manifest


# manifest key -> the type of its table's values (None: any). A manifest without its digest (an old one) or read
# with verify_hashes=False is taken as it stands, so every table is checked before a reader walks it.
_MANIFEST_TABLES: dict[str, type | None] = {
    "lattice": None, "quantized": list, "lattice_overrides": dict, "aliases": str, "files": str,
    FAST_DIGESTS_KEY: str, VOCABULARY_KEY: None}


def _check_manifest_tables(path: Path, manifest: dict) -> None:
    for key, value_type in _MANIFEST_TABLES.items():
        table = manifest.get(key, {})
        if not isinstance(table, dict) or (value_type and not all(isinstance(v, value_type) for v in table.values())):
            kind = f"an object of {value_type.__name__} values" if value_type else "an object"
            raise CheckpointError(f"{path}: {key} is not {kind}")


def load_checkpoint(directory: str | os.PathLike, verify_hashes: bool = True, sha256: bool = False,
                    background: bool = False) -> LatticeCheckpoint:
    """Read a checkpoint back: bit-identical lattices, untouched tensors, model files and metadata. Every file is
    read once; ``verify_hashes`` checks those very bytes against the manifest's fast digests (sha256 for a version 1
    checkpoint), ``sha256`` against its sha256 digests as well. With ``background`` the file digests are checked in
    a thread while the caller works on: it must call ``wait_verified()`` before it lets anything out (the exporters
    do so before they rename their output into place)."""
    root = Path(directory)
    manifest = read_manifest(root)
    contents = _read_files(root, manifest)
    digests = None
    if verify_hashes:
        _verify_manifest(root, manifest)
        check = lambda: _verify_files(root, manifest, contents, sha256)  # noqa: E731
        if background:
            digests = DigestCheck(check)
        else:
            check()
    try:
        ckpt = _parse(root, manifest, contents, check_values=not verify_hashes)
    except CheckpointError:
        if digests is not None:
            digests.wait()  # a damaged file is better named by its digest than by what failed to parse
        raise
    ckpt.digests = digests
    return ckpt


def _parse(root: Path, manifest: dict, contents: dict, check_values: bool) -> LatticeCheckpoint:
    """The checkpoint in the files' bytes; ``check_values`` checks stored blocks' scales and the token table's
    records, which a file whose digest matched had checked when it was written."""
    try:
        spec = _spec_of_record(manifest["lattice"])
        override_records = dict(manifest.get("lattice_overrides", {}))
        overrides = {name: _spec_of_record(record) for name, record in override_records.items()}
        shapes = dict(manifest["quantized"])
        # version 1 had no code_storage: codes for every lattice
        as_blocks = {name for name in shapes
                     if override_records.get(name, manifest["lattice"]).get("code_storage") == BLOCK_STORAGE}
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise CheckpointError(f"{root / MANIFEST}: malformed lattice description ({type(e).__name__}: {e})") from None
    views = _views(root / LATTICE_FILE, contents[LATTICE_FILE])
    quantized = LatticeWeights()
    for name, shape in shapes.items():
        _check_shape(root, name, shape)
        weight_spec = overrides.get(name, spec)
        if name in as_blocks:
            # blocks whose digest matched are the bytes save_checkpoint wrote after checking them on the lattice;
            # unverified ones get their scales checked here
            quantized.add_blocks(name, _blocks_from(views, name, tuple(shape), weight_spec, root / LATTICE_FILE,
                                                    check_scales=check_values))
        else:
            quantized[name] = _quantized_from(views, name, shape, weight_spec, root / LATTICE_FILE)
    model_files = {rel[len(MODEL_FILES_PREFIX):]: data for rel, data in contents.items()
                   if rel.startswith(MODEL_FILES_PREFIX)}
    reserved = {"format", "format_version", "lattice", "lattice_overrides", "quantized", "aliases", "files",
                FAST_DIGESTS_KEY, VOCABULARY_KEY}
    metadata = {k: v for k, v in manifest.items() if k not in reserved}
    tensors = _torch_tensors(root / TENSORS_FILE, contents[TENSORS_FILE])
    aliases = manifest.get("aliases", {})
    for alias, target in aliases.items():
        if target not in quantized and target not in tensors:
            raise CheckpointError(f"{root / MANIFEST}: alias {alias} names {target}, which the checkpoint does not "
                                  f"hold")
    return LatticeCheckpoint(spec, quantized, tensors, aliases, metadata, model_files,
                             _token_table(root / VOCABULARY_FILE, contents.get(VOCABULARY_FILE),
                                          manifest.get(VOCABULARY_KEY), check=check_values))


def _read_files(root: Path, manifest: dict) -> dict[str, bytes | mmap.mmap]:
    """Every file of the checkpoint by its path relative to ``root``: the lattice and the tensors memory-mapped
    (used in place), the others read whole. Every file the manifest lists must exist."""
    present = {os.path.relpath(os.path.join(directory, name), root)
               for directory, _, names in os.walk(root) for name in names if name != MANIFEST}
    listed = {*manifest.get("files", {}), *manifest.get(FAST_DIGESTS_KEY, {})}
    for rel in sorted(listed):
        if rel not in present:
            raise CheckpointError(f"{root / rel}: listed in {MANIFEST} but missing")
    for required in (LATTICE_FILE, TENSORS_FILE):
        if required not in present:
            raise CheckpointError(f"{root / required}: missing")
    wanted = {LATTICE_FILE, TENSORS_FILE, VOCABULARY_FILE, *listed}
    return {rel: _read(root, rel) for rel in sorted(present)
            if rel in wanted or rel.startswith(MODEL_FILES_PREFIX)}


def _read(root: Path, rel: str) -> bytes | mmap.mmap:
    if rel == LATTICE_FILE:
        return map_readonly(os.path.join(root, rel), populate=True)
    if rel == TENSORS_FILE:  # torch tensors view it in place; they may be written to, the file never is
        return map_private(os.path.join(root, rel))
    with open(os.path.join(root, rel), "rb") as f:
        return f.read()


def _verify_manifest(root: Path, manifest: dict) -> None:
    """The manifest's own digest (checkpoints written before it existed carry none and are not checked)."""
    recorded = manifest.get(MANIFEST_DIGEST_KEY)
    if recorded is not None and recorded != manifest_digest(manifest):
        raise CheckpointError(f"{root / MANIFEST}: content does not match its own {MANIFEST_DIGEST_KEY} (edited or "
                              f"corrupted)")


def _verify_files(root: Path, manifest: dict, contents: dict, sha256: bool) -> None:
    fast = manifest.get(FAST_DIGESTS_KEY)
    for rel, expected in (fast or {}).items():
        if fast_digest(contents[rel]) != expected:
            raise CheckpointError(f"{root / rel}: content does not match its xxh3 digest in {MANIFEST} (corrupted or "
                                  f"truncated)")
    if fast is not None and not sha256:
        return
    for rel, expected in manifest.get("files", {}).items():
        if sha256_hex(contents[rel]) != expected:
            raise CheckpointError(f"{root / rel}: content does not match its sha256 in {MANIFEST} (corrupted or "
                                  f"truncated)")


def _views(path: Path, buffer: object) -> dict[str, np.ndarray]:
    try:
        return tensor_views(buffer)[0]
    except SafetensorsViewError as e:
        raise CheckpointError(f"{path}: not a readable safetensors file ({e})") from None


def _torch_tensors(path: Path, data: bytes | mmap.mmap) -> dict[str, torch.Tensor]:
    """Tensors viewing the file's map (torch_views); the safetensors library's copies for dtypes it has no view of."""
    try:
        views = torch_views(data)
        return views if views is not None else load_torch_bytes(bytes(data))
    except (SafetensorError, SafetensorsViewError, OSError, ValueError) as e:
        raise CheckpointError(f"{path}: not a readable safetensors file ({e})") from None


def _token_table(path: Path, buffer: bytes | None, record: dict | None, check: bool) -> TokenTable | None:
    """The stored token table; ``check`` reads every record's count (a table whose digest matched was checked when
    it was made)."""
    if buffer is None or not isinstance(record, dict):
        return None  # without its manifest entry a table cannot say which tokenizer it belongs to: not used
    try:
        arrays, _ = tensor_views(buffer)
        table = TokenTable(arrays["token_records"], arrays["token_lengths"], arrays["token_defined"].view(bool),
                           str(record["from_xxh3"]))
        if check:
            table.check()
    except (SafetensorsViewError, KeyError, ValueError) as e:
        raise CheckpointError(f"{path}: not a token table ({type(e).__name__}: {e})") from None
    return table


def _check_shape(root: Path, name: str, shape: object) -> None:
    if not (isinstance(shape, list) and len(shape) == 2 and all(isinstance(d, int) and d > 0 for d in shape)):
        raise CheckpointError(f"{root / MANIFEST}: shape of {name} is {shape!r}, not [rows, columns]")


def _blocks_from(views: dict[str, np.ndarray], name: str, shape: tuple[int, int], spec: LatticeSpec,
                 path: Path, check_scales: bool) -> StoredBlocks:
    if native_type(spec) is None:
        raise CheckpointError(f"{path.parent / MANIFEST}: {name} is stored as ggml blocks, but its lattice "
                              f"({spec.bits}-bit {spec.scheme}, group {spec.group_size}) is no ggml type's")
    if f"{name}.blocks" not in views:
        raise CheckpointError(f"{path}: blocks of {name} missing")
    blocks = views[f"{name}.blocks"]
    try:
        spec.check_columns(shape[1])
        expected = block_matrix_shape(native_type(spec), shape)
        if blocks.dtype != np.uint8 or tuple(blocks.shape) != expected:
            raise CheckpointError(f"{path}: blocks of {name} are stored as {blocks.dtype} {list(blocks.shape)}, which "
                                  f"does not fit its shape {list(shape)} as {native_type(spec).name} blocks "
                                  f"({list(expected)} uint8)")
        if check_scales:
            check_block_scales(blocks, native_type(spec))
    except ValueError as e:
        raise CheckpointError(f"{path}: {name}: {e}") from None
    return StoredBlocks(spec, shape, blocks)


def _quantized_from(views: dict[str, np.ndarray], name: str, shape: list[int], spec: LatticeSpec,
                    path: Path) -> QuantizedWeight:
    if f"{name}.codes" not in views or f"{name}.scales" not in views:
        raise CheckpointError(f"{path}: codes or scales of {name} missing")
    params = {part: torch.from_numpy(np.array(views[f"{name}.{part}"])) for part in PARAM_FIELDS
              if f"{name}.{part}" in views}
    stored = views[f"{name}.codes"]
    packed = [shape[0], shape[1] // 2] if _packs_to_nibbles(spec, shape[1]) else list(shape)
    if list(stored.shape) != packed:
        raise CheckpointError(f"{path}: codes of {name} are stored as {list(stored.shape)}, which does not fit its "
                              f"shape {shape} in {MANIFEST}")
    q = QuantizedWeight(unpack_codes(stored, spec, shape[1]), spec=spec, **params)
    try:
        check_on_lattice(q)
    except ValueError as e:
        raise CheckpointError(f"{path}: {name}: {e}") from None
    return q
