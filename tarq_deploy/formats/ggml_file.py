"""The legacy whisper.cpp model file ("ggml" magic, what whisper.cpp 1.8.5 loads): its layout and a strict parser
(the exporter and ``verify`` are in whisper_cpp.py).

Layout (all int32 little-endian, no padding):

    magic 0x67676d6c
    hparams: n_vocab n_audio_ctx n_audio_state n_audio_head n_audio_layer n_text_ctx n_text_state n_text_head
             n_text_layer n_mels ftype            (ftype = ggml_ftype + 1000 * quantization version)
    mel filters: n_mel, n_fft (201), n_mel * n_fft float32
    vocab: count, then per token: length, raw bytes
    tensors until EOF: n_dims, name length, ggml type, ne[0..n_dims) (ne[0] = row length), name, data

whisper.cpp creates every tensor itself with a fixed type and shape (``whisper_model_load``) and reads the file's bytes
straight into it, so the layout below (``tensor_slots``) is what a file must match tensor for tensor: weight matrices
and the token embedding in the header's type, conv weights F16, everything else F32. Shapes here are numpy order
(row-major, last axis = ggml ne[0]); they are reversed only at the file boundary.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, fields
from pathlib import Path

import numpy as np

from .ggml_blocks import BLOCKS, GGML_TYPE_NAMES, QUANTIZED_TYPES, GGMLType, tensor_nbytes
from .ggml_tensors import (ROLE_CONV, ROLE_F32, ROLE_MATRIX, ByteCursor, MappedTensors, TensorFileError, TensorRecord,
                           TensorSlot, map_file)

__all__ = ["FILE_MAGIC", "FTYPE_OF_TYPE", "GGMLFileError", "N_FFT_BINS", "QNT_VERSION", "QNT_VERSION_FACTOR",
           "WhisperCppFile", "WhisperHParams", "read_whisper_cpp", "tensor_slots"]

FILE_MAGIC = 0x67676D6C  # "ggml"
QNT_VERSION = 2  # GGML_QNT_VERSION: the block layouts of ggml-common.h
QNT_VERSION_FACTOR = 1000  # GGML_QNT_VERSION_FACTOR
# ggml_ftype of a file whose weight matrices are of the given ggml type (enum ggml_ftype, ggml.h)
FTYPE_OF_TYPE = {GGMLType.F32: 0, GGMLType.F16: 1, GGMLType.Q4_0: 2, GGMLType.Q4_1: 3, GGMLType.Q8_0: 7,
                 GGMLType.Q5_0: 8, GGMLType.Q5_1: 9, GGMLType.Q4_K: 12, GGMLType.Q5_K: 13, GGMLType.Q6_K: 14,
                 GGMLType.Q2_K: 10, GGMLType.Q3_K: 11, GGMLType.IQ4_NL: 19,
                 GGMLType.IQ4_XS: 22, GGMLType.IQ3_XXS: 17, GGMLType.IQ3_S: 20, GGMLType.IQ2_XS: 16,
                 GGMLType.IQ2_S: 21}
TYPE_OF_FTYPE = {ftype: t for t, ftype in FTYPE_OF_TYPE.items()}
N_FFT_BINS = 201  # whisper.cpp's WHISPER_N_FFT 400 -> 201 frequency bins
MAX_TOKEN_BYTES = 1024  # no real BPE token comes near; a larger length means a corrupt vocabulary
MAX_NAME_BYTES = 256
MAX_DIMS = 4
# far beyond any Whisper (large-v3: 32 layers, 1280 wide, 51866 tokens); a header past them is corrupt, and
# building its tensor list would only waste memory
HPARAM_LIMITS = {"n_vocab": 1 << 20, "n_audio_ctx": 1 << 16, "n_audio_state": 1 << 16, "n_audio_head": 1 << 10,
                 "n_audio_layer": 1 << 10, "n_text_ctx": 1 << 16, "n_text_state": 1 << 16, "n_text_head": 1 << 10,
                 "n_text_layer": 1 << 10, "n_mels": 1 << 10}


class GGMLFileError(TensorFileError):
    """A whisper.cpp model file that is not what whisper.cpp would load; the message names the file and the problem."""


# --------------------------------------------------------------------------------------------------- the layout
@dataclass(frozen=True)
class WhisperHParams:
    """The 11 header integers, in file order."""

    n_vocab: int
    n_audio_ctx: int
    n_audio_state: int
    n_audio_head: int
    n_audio_layer: int
    n_text_ctx: int
    n_text_state: int
    n_text_head: int
    n_text_layer: int
    n_mels: int
    ftype: int

    @classmethod
    def from_config(cls, config: dict, weight_type: int) -> "WhisperHParams":
        """Header of a transformers WhisperConfig (as a dict) whose matrices are stored as ``weight_type``."""
        quant_version = QNT_VERSION if weight_type in QUANTIZED_TYPES else 0  # as whisper.cpp's own tools write it
        return cls(
            n_vocab=config["vocab_size"], n_audio_ctx=config["max_source_positions"], n_audio_state=config["d_model"],
            n_audio_head=config["encoder_attention_heads"], n_audio_layer=config["encoder_layers"],
            n_text_ctx=config["max_target_positions"], n_text_state=config["d_model"],
            n_text_head=config["decoder_attention_heads"], n_text_layer=config["decoder_layers"],
            n_mels=config["num_mel_bins"], ftype=FTYPE_OF_TYPE[weight_type] + QNT_VERSION_FACTOR * quant_version)

    def ints(self) -> tuple[int, ...]:
        return tuple(getattr(self, f.name) for f in fields(self))

    @property
    def weight_type(self) -> int:
        return TYPE_OF_FTYPE[self.ftype % QNT_VERSION_FACTOR]

    def same_model(self, other: "WhisperHParams") -> bool:
        """Same architecture, whatever the storage type."""
        return self.ints()[:-1] == other.ints()[:-1]


# transformers name piece -> whisper.cpp name piece, inside a layer (the inverse of whisper.cpp's converters)
_ATTENTION_PARTS = {"q_proj": ("query", True), "k_proj": ("key", False), "v_proj": ("value", True),
                    "out_proj": ("out", True)}  # (name, has bias): whisper.cpp's attn.key has no bias


def tensor_slots(h: WhisperHParams) -> list[TensorSlot]:
    """Every tensor whisper.cpp 1.8.5 creates for these hyper-parameters, in the order we write them. Roles:
    weight matrices and the token embedding take the header's type, conv kernels F16, everything else F32."""
    d, n_mels = h.n_audio_state, h.n_mels
    slots = [
        TensorSlot("encoder.positional_embedding", "model.encoder.embed_positions.weight", ROLE_F32,
                   (h.n_audio_ctx, d)),
        TensorSlot("encoder.conv1.weight", "model.encoder.conv1.weight", ROLE_CONV, (d, n_mels, 3)),
        TensorSlot("encoder.conv1.bias", "model.encoder.conv1.bias", ROLE_F32, (d, 1)),
        TensorSlot("encoder.conv2.weight", "model.encoder.conv2.weight", ROLE_CONV, (d, d, 3)),
        TensorSlot("encoder.conv2.bias", "model.encoder.conv2.bias", ROLE_F32, (d, 1)),
    ]
    for i in range(h.n_audio_layer):
        slots += _block_slots(f"encoder.blocks.{i}", f"model.encoder.layers.{i}", d, cross=False)
    slots += _layer_norm_slots("encoder.ln_post", "model.encoder.layer_norm", d)
    slots += [
        TensorSlot("decoder.positional_embedding", "model.decoder.embed_positions.weight", ROLE_F32, (h.n_text_ctx, d)),
        TensorSlot("decoder.token_embedding.weight", "model.decoder.embed_tokens.weight", ROLE_MATRIX, (h.n_vocab, d)),
    ]
    for i in range(h.n_text_layer):
        slots += _block_slots(f"decoder.blocks.{i}", f"model.decoder.layers.{i}", d, cross=True)
    slots += _layer_norm_slots("decoder.ln", "model.decoder.layer_norm", d)
    return slots


def _block_slots(prefix: str, hf_prefix: str, d: int, cross: bool) -> list[TensorSlot]:
    slots = _attention_slots(f"{prefix}.attn", f"{hf_prefix}.self_attn", d)
    slots += _layer_norm_slots(f"{prefix}.attn_ln", f"{hf_prefix}.self_attn_layer_norm", d)
    if cross:
        slots += _attention_slots(f"{prefix}.cross_attn", f"{hf_prefix}.encoder_attn", d)
        slots += _layer_norm_slots(f"{prefix}.cross_attn_ln", f"{hf_prefix}.encoder_attn_layer_norm", d)
    ffn = 4 * d  # whisper.cpp hard-codes the MLP width as 4 * n_state
    slots += [
        TensorSlot(f"{prefix}.mlp.0.weight", f"{hf_prefix}.fc1.weight", ROLE_MATRIX, (ffn, d)),
        TensorSlot(f"{prefix}.mlp.0.bias", f"{hf_prefix}.fc1.bias", ROLE_F32, (ffn,)),
        TensorSlot(f"{prefix}.mlp.2.weight", f"{hf_prefix}.fc2.weight", ROLE_MATRIX, (d, ffn)),
        TensorSlot(f"{prefix}.mlp.2.bias", f"{hf_prefix}.fc2.bias", ROLE_F32, (d,)),
    ]
    slots += _layer_norm_slots(f"{prefix}.mlp_ln", f"{hf_prefix}.final_layer_norm", d)
    return slots


def _attention_slots(prefix: str, hf_prefix: str, d: int) -> list[TensorSlot]:
    slots = []
    for hf_part, (part, has_bias) in _ATTENTION_PARTS.items():
        slots.append(TensorSlot(f"{prefix}.{part}.weight", f"{hf_prefix}.{hf_part}.weight", ROLE_MATRIX, (d, d)))
        if has_bias:
            slots.append(TensorSlot(f"{prefix}.{part}.bias", f"{hf_prefix}.{hf_part}.bias", ROLE_F32, (d,)))
    return slots


def _layer_norm_slots(prefix: str, hf_prefix: str, d: int) -> list[TensorSlot]:
    return [TensorSlot(f"{prefix}.{p}", f"{hf_prefix}.{p}", ROLE_F32, (d,)) for p in ("weight", "bias")]


# --------------------------------------------------------------------------------------------------- the parser
@dataclass
class WhisperCppFile(MappedTensors):
    """A parsed whisper.cpp model file; tensor data stays in a read-only memory map."""

    path: Path
    hparams: WhisperHParams
    mel_filters: np.ndarray  # float32 [n_mel, 201]
    vocab: list[bytes]
    tensors: dict[str, TensorRecord]
    data: np.ndarray  # uint8 view of the whole file (read-only memory map)


def read_whisper_cpp(path: str | os.PathLike) -> WhisperCppFile:
    """Parse ``path`` strictly; any deviation from what whisper.cpp 1.8.5 loads raises GGMLFileError."""
    path = Path(path)
    buffer = map_file(path, GGMLFileError)
    cur = ByteCursor(buffer, path, GGMLFileError)
    if cur.unpack("<I", "magic")[0] != FILE_MAGIC:
        raise GGMLFileError(path, "bad magic: not a whisper.cpp (ggml) model file")
    hparams = _read_hparams(cur)
    mel = _read_mel_filters(cur, hparams)
    vocab = _read_vocab(cur, hparams)
    tensors = _read_tensors(cur, hparams)
    return WhisperCppFile(path, hparams, mel, vocab, tensors, np.frombuffer(buffer, dtype=np.uint8))


def _read_hparams(cur: ByteCursor) -> WhisperHParams:
    names = [f.name for f in fields(WhisperHParams)]
    h = WhisperHParams(*cur.unpack(f"<{len(names)}i", "the header"))
    bad = [f"{n}={getattr(h, n)} (must be in 1..{HPARAM_LIMITS[n]})"
           for n in names[:-1] if not 0 < getattr(h, n) <= HPARAM_LIMITS[n]]
    if bad:
        raise GGMLFileError(cur.path, f"bad header: {', '.join(bad)}")
    if h.n_audio_state != h.n_text_state:
        raise GGMLFileError(cur.path, f"bad header: n_audio_state {h.n_audio_state} != n_text_state {h.n_text_state}")
    base, version = h.ftype % QNT_VERSION_FACTOR, h.ftype // QNT_VERSION_FACTOR
    if h.ftype < 0 or base not in TYPE_OF_FTYPE:
        raise GGMLFileError(cur.path, f"bad header: unknown ftype {h.ftype}")
    quantized = TYPE_OF_FTYPE[base] in QUANTIZED_TYPES
    if (quantized and version != QNT_VERSION) or (not quantized and version not in (0, QNT_VERSION)):
        raise GGMLFileError(cur.path, f"bad header: ftype {h.ftype} has quantization version {version}; "
                                      f"this reader knows the version-{QNT_VERSION} block layouts")
    return h


def _read_mel_filters(cur: ByteCursor, h: WhisperHParams) -> np.ndarray:
    n_mel, n_fft = cur.unpack("<2i", "the mel filter dimensions")
    if n_mel != h.n_mels or n_fft != N_FFT_BINS:
        raise GGMLFileError(cur.path, f"bad mel filters: {n_mel} x {n_fft}, expected {h.n_mels} x {N_FFT_BINS}")
    mel = np.frombuffer(cur.take(4 * n_mel * n_fft, "the mel filters"), dtype="<f4").reshape(n_mel, n_fft)
    if not np.isfinite(mel).all():
        raise GGMLFileError(cur.path, "bad mel filters: inf or nan")
    return mel


def _read_vocab(cur: ByteCursor, h: WhisperHParams) -> list[bytes]:
    (count,) = cur.unpack("<i", "the vocabulary size")
    if not 0 < count <= h.n_vocab:
        raise GGMLFileError(cur.path, f"bad vocabulary: {count} tokens (header n_vocab {h.n_vocab})")
    vocab = []
    for i in range(count):
        (length,) = cur.unpack("<i", f"the length of token {i}")
        if not 0 <= length <= MAX_TOKEN_BYTES:
            raise GGMLFileError(cur.path, f"bad vocabulary: token {i} has length {length}")
        vocab.append(cur.take(length, f"token {i}"))
    return vocab


def _read_tensors(cur: ByteCursor, h: WhisperHParams) -> dict[str, TensorRecord]:
    expected = {slot.name: slot for slot in tensor_slots(h)}
    found: dict[str, TensorRecord] = {}
    while cur.remaining > 0:
        rec = _read_tensor(cur)
        _check_tensor(cur.path, rec, expected, found, h.weight_type)
        found[rec.name] = rec
    missing = [name for name in expected if name not in found]
    if missing:
        listed = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise GGMLFileError(cur.path, f"missing tensors ({len(missing)} of {len(expected)}): {listed} "
                                      f"(truncated file, or not a complete whisper.cpp model)")
    return found


def _read_tensor(cur: ByteCursor) -> TensorRecord:
    start = cur.pos
    n_dims, name_len, ggml_type = cur.unpack("<3i", f"a tensor header at offset {start}")
    if not 1 <= n_dims <= MAX_DIMS:
        raise GGMLFileError(cur.path, f"bad tensor header at offset {start}: n_dims {n_dims}")
    if not 1 <= name_len <= MAX_NAME_BYTES:
        raise GGMLFileError(cur.path, f"bad tensor header at offset {start}: name length {name_len}")
    if ggml_type not in BLOCKS:
        raise GGMLFileError(cur.path, f"bad tensor header at offset {start}: unknown ggml type {ggml_type}")
    ne = cur.unpack(f"<{n_dims}i", f"the dimensions of the tensor at offset {start}")
    raw_name = cur.take(name_len, f"the name of the tensor at offset {start}")
    try:
        name = raw_name.decode("utf-8")
    except UnicodeDecodeError:
        raise GGMLFileError(cur.path, f"bad tensor name at offset {start}: {raw_name!r}") from None
    if any(n <= 0 for n in ne):
        raise GGMLFileError(cur.path, f"tensor {name}: bad dimensions {ne}")
    shape = tuple(reversed(ne))
    try:
        nbytes = tensor_nbytes(ggml_type, shape)
    except ValueError as e:
        raise GGMLFileError(cur.path, f"tensor {name}: {e}") from None
    offset = cur.skip(nbytes, f"the data of tensor {name}")
    return TensorRecord(name, ggml_type, shape, offset, nbytes)


def _check_tensor(path: Path, rec: TensorRecord, expected: dict[str, TensorSlot], found: dict[str, TensorRecord],
                  weight_type: int) -> None:
    slot = expected.get(rec.name)
    if slot is None:
        raise GGMLFileError(path, f"unknown tensor {rec.name!r} (whisper.cpp refuses it)")
    if rec.name in found:
        raise GGMLFileError(path, f"tensor {rec.name} appears twice")
    if rec.shape != slot.shape:
        raise GGMLFileError(path, f"tensor {rec.name} has shape {list(rec.shape)}, expected {list(slot.shape)}")
    want = slot.ggml_type(weight_type)
    if rec.ggml_type != want:
        raise GGMLFileError(path, f"tensor {rec.name} is {GGML_TYPE_NAMES[rec.ggml_type]}, but whisper.cpp expects "
                                  f"{GGML_TYPE_NAMES[want]} in a file of ftype {FTYPE_OF_TYPE[weight_type]} "
                                  f"({GGML_TYPE_NAMES[weight_type]} matrices)")
