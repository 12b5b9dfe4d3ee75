"""Export Whisper to whisper.cpp's model file (a lattice checkpoint bit-exactly, or a float model), and ``verify`` a
model file against a lattice checkpoint.

Targets (``target`` = the ggml type of the weight matrices):

* ``q4_0``, ``q4_1``, ``q5_0``, ``q5_1``, ``q8_0``, ``q2_k`` ... ``q6_k``, ``iq4_nl``, ``iq4_xs``, ``iq3_s``,
  ``iq3_xxs``, ``iq2_s``, ``iq2_xs`` -- a lattice checkpoint of that type, every weight matrix and the tied token
  embedding stored exactly (the lattice's codes and group parameters become the type's blocks; see
  quant/ggml_types.py). whisper.cpp holds one type for all
  weight matrices, so a checkpoint whose matrices are on different lattices is refused; the K-quants need d_model a
  multiple of 256.
* ``f16``  -- a float model, or a checkpoint's dequantized values s * q rounded to fp16 (fp16 cannot hold every
  s * q: a warning says how many values were rounded; verify shows it).
* ``baseline="rtn"`` with any quantized type -- ggml's own rounding of a float model, byte for byte what
  whisper.cpp's ``quantize`` tool makes from the F16 file (weights are rounded to fp16 first, as in that F16 file).

Computing and I/O are separate: ``build_whisper_cpp`` packs every tensor in memory (and refuses anything the target
cannot hold before a byte is written); ``write_whisper_cpp`` only writes, to a temporary name renamed when complete.
The file layout and its strict parser are in ggml_file.py.
"""
from __future__ import annotations

import functools
import logging
import os
import struct
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
import torch
from tqdm import tqdm

from tarq_deploy.checkpoint import LatticeCheckpoint, LatticeWeights
from tarq_deploy.fileio import atomic_file, write_buffers
from tarq_deploy.quant.choices import GGML_NEEDS_IMPORTANCE
from tarq_deploy.vocabulary import NotByteLevel, TokenTable, table_of_tokens, token_strings

from .f16_rounding import F16Rounding, F16Values, MadeAhead
from .ggml_blocks import (GGML_TYPE_NAMES, K_TYPES, QUANTIZED_TYPES, GGMLType, LatticeNotRepresentable, ggml_rtn,
                          type_for_spec)
from .ggml_file import FILE_MAGIC, N_FFT_BINS, WhisperCppFile, WhisperHParams, read_whisper_cpp, tensor_slots
from .ggml_tensors import (CheckpointValues, PackedTensor, TensorSlot, VerifyError, as_checkpoint, compare_tensors,
                           max_abs_diff, pack_float, stored_blocks_as_f16, stored_or_packed)
from .model_files import ModelFilesError, ModelTensors, as_model_source, feature_extractor_config, json_file

__all__ = ["BASELINES", "OUTPUT_PROJECTION", "PackedTensor", "TARGET_TYPES", "WhisperCppModel", "WhisperExportError",
           "WhisperSource", "as_source", "base_vocab_table", "build_whisper_cpp", "checkpoint_source", "default_target",
           "export_whisper_cpp", "model_source", "verify", "write_whisper_cpp"]

log = logging.getLogger(__name__)

TARGET_TYPES = {"f16": GGMLType.F16, "q8_0": GGMLType.Q8_0, "q4_0": GGMLType.Q4_0, "q4_1": GGMLType.Q4_1,
                "q5_0": GGMLType.Q5_0, "q5_1": GGMLType.Q5_1, "q4_k": GGMLType.Q4_K, "q5_k": GGMLType.Q5_K,
                "q6_k": GGMLType.Q6_K, "q3_k": GGMLType.Q3_K, "q2_k": GGMLType.Q2_K,
                "iq4_nl": GGMLType.IQ4_NL, "iq4_xs": GGMLType.IQ4_XS, "iq3_s": GGMLType.IQ3_S,
                "iq3_xxs": GGMLType.IQ3_XXS, "iq2_s": GGMLType.IQ2_S, "iq2_xs": GGMLType.IQ2_XS}
K_SUPER_BLOCK = 256
BASELINES = ("rtn",)
EOT_TOKEN = "<|endoftext|>"  # the last token of the base vocabulary whisper.cpp reads from the file
TOKEN_EMBEDDING = "model.decoder.embed_tokens.weight"
OUTPUT_PROJECTION = "proj_out.weight"  # tied to the token embedding; whisper.cpp has no separate tensor for it
NOT_FEATURE_EXTRACTOR_ARGUMENTS = ("feature_extractor_type", "processor_class")  # saved config entries, not kwargs


class WhisperExportError(ModelFilesError):
    """The source cannot be exported as asked; the message says what and why."""


# ---------------------------------------------------------------------------------------------------- sources
@dataclass
class WhisperSource(ModelTensors):
    """A Whisper model as the exporter sees it, whatever it was read from."""

    config: dict
    read_tokenizer: Callable[[], dict]  # parses tokenizer.json (or gives {"model": {"vocab": ...}, ...}) when needed
    feature_extractor: dict  # WhisperFeatureExtractor keyword arguments
    floats: dict[str, torch.Tensor]
    lattice: LatticeWeights = field(default_factory=LatticeWeights)
    aliases: dict[str, str] = field(default_factory=dict)  # name -> the name whose tensor it shares
    origin: str = "model"
    token_table: TokenTable | None = None  # the checkpoint's stored tokens, where it has them
    wait_verified: Callable[[], None] = lambda: None  # the checkpoint's digest check, when it runs in the background
    error = WhisperExportError
    runtime = "whisper.cpp"
    reshape_unit_axes = True  # conv biases: [d] in transformers, [d, 1] in the file

    @cached_property
    def tokenizer(self) -> dict:
        return self.read_tokenizer()

    def hparams(self, weight_type: int) -> WhisperHParams:
        _check_whisper_cpp_config(self.config, self.origin)
        return WhisperHParams.from_config(self.config, weight_type)

    def vocab(self) -> list[bytes]:
        """The base vocabulary from the tokenizer itself: the reference ``verify`` compares a file with."""
        return base_vocab_bytes(self.tokenizer, self.origin)

    def export_vocab(self) -> TokenTable:
        """The base vocabulary as the exporter writes it: from the checkpoint's token table when it has one (no
        4 MB JSON to parse), else from the tokenizer; the same bytes either way (tests/test_whisper_cpp_export.py)."""
        if self.token_table is None:
            return base_vocab_table(self.tokenizer, self.origin)
        eot = self.token_table.find(EOT_TOKEN.encode())
        if eot is None:
            raise WhisperExportError(f"{self.origin}: the tokenizer has no {EOT_TOKEN} token")
        return self.token_table.prefix(eot + 1)

    def mel_filters(self) -> np.ndarray:
        """float32 [n_mels, 201]: transformers' WhisperFeatureExtractor filters (Slaney), as whisper.cpp expects."""
        from transformers import WhisperFeatureExtractor

        kwargs = {k: v for k, v in self.feature_extractor.items() if k not in NOT_FEATURE_EXTRACTOR_ARGUMENTS}
        filters = np.asarray(WhisperFeatureExtractor(**kwargs).mel_filters, dtype=np.float32).T
        if filters.shape != (self.config["num_mel_bins"], N_FFT_BINS):
            raise WhisperExportError(f"{self.origin}: mel filters {filters.shape}, expected "
                                     f"({self.config['num_mel_bins']}, {N_FFT_BINS})")
        return np.ascontiguousarray(filters)


def checkpoint_source(ckpt: LatticeCheckpoint, origin: str = "checkpoint") -> WhisperSource:
    files = ckpt.model_files
    config = json_file(files, "config.json", origin)
    if config.get("model_type") != "whisper":
        # A Qwen3-ASR or Voxtral checkpoint has no Whisper header to compare a .bin with: say so, not KeyError.
        raise WhisperExportError(f"{origin}: a {config.get('model_type')!r} checkpoint, not a Whisper one; "
                                 "whisper.cpp files hold Whisper models only")
    if "tokenizer.json" not in files and "vocab.json" not in files:
        raise WhisperExportError(f"{origin}: no tokenizer.json or vocab.json among the model files")
    source = WhisperSource(config, lambda: _tokenizer_of(files, origin), feature_extractor_config(files, origin),
                           dict(ckpt.tensors), ckpt.quantized, dict(ckpt.aliases), origin, ckpt.tokens(),
                           ckpt.wait_verified)
    _tie_output_projection(source)
    return source


def model_source(model: Any, processor: Any, origin: str = "model") -> WhisperSource:
    """A transformers WhisperForConditionalGeneration and its WhisperProcessor."""
    floats = {k: v.detach() for k, v in model.state_dict().items()}
    source = WhisperSource(model.config.to_dict(), functools.cache(lambda: _tokenizer_of_processor(processor)),
                           processor.feature_extractor.to_dict(), floats, origin=origin)
    _tie_output_projection(source)
    return source


def as_source(source: Any) -> WhisperSource:
    """A WhisperSource from a LatticeCheckpoint, a checkpoint directory, or (model, processor[, generation_config]).
    A directory's digests are checked while the export packs and writes; the file is renamed into place only after
    they matched (WhisperCppModel.wait_verified)."""
    return as_model_source(source, WhisperSource, checkpoint_source, model_source, model_items=(2, 3),
                           background_digests=True)


def _tokenizer_of_processor(processor: Any) -> dict:
    """The parts of tokenizer.json the vocabulary needs, asked of the tokenizer object: serialising a fast tokenizer
    to JSON and parsing it back cost 0.1-0.2 s per export, most of an in-memory model's."""
    backend = getattr(processor.tokenizer, "backend_tokenizer", None)  # a fast (tokenizers) tokenizer
    if backend is None:
        return {"model": {"vocab": processor.tokenizer.get_vocab()}}
    return {"model": {"vocab": backend.get_vocab(with_added_tokens=False)},
            "added_tokens": [{"id": i, "content": token.content}
                             for i, token in sorted(backend.get_added_tokens_decoder().items())]}


def _tokenizer_of(files: dict[str, bytes], origin: str) -> dict:
    """tokenizer.json, or a slow tokenizer's vocab.json (checkpoint_source has made sure there is one of them)."""
    if "tokenizer.json" in files:
        return json_file(files, "tokenizer.json", origin)
    added = json_file(files, "added_tokens.json", origin) if "added_tokens.json" in files else {}
    return {"model": {"vocab": json_file(files, "vocab.json", origin)},
            "added_tokens": [{"id": i, "content": t} for t, i in added.items()]}


def _tie_output_projection(source: WhisperSource) -> None:
    """whisper.cpp uses decoder.token_embedding as the output projection too; refuse a model where they differ."""
    emb, proj = source.resolve(TOKEN_EMBEDDING), source.resolve(OUTPUT_PROJECTION)
    if emb == proj:
        return
    if proj in source.floats and emb in source.floats and torch.equal(source.floats[emb], source.floats[proj]):
        source.aliases[OUTPUT_PROJECTION] = emb
        return
    if proj not in source.floats and proj not in source.lattice:
        return  # no separate output projection at all: the embedding is the projection
    if emb not in source.floats and emb not in source.lattice:
        source.aliases[TOKEN_EMBEDDING] = proj  # only the projection is stored: it is the tied embedding
        return
    raise WhisperExportError(f"{source.origin}: {OUTPUT_PROJECTION} is not tied to {TOKEN_EMBEDDING}; whisper.cpp "
                             f"has one matrix for both, so an untied output projection cannot be exported")


def _check_whisper_cpp_config(config: dict, origin: str) -> None:
    d = config["d_model"]
    for key in ("encoder_ffn_dim", "decoder_ffn_dim"):
        if config.get(key, 4 * d) != 4 * d:
            raise WhisperExportError(f"{origin}: {key} = {config[key]}, but whisper.cpp fixes the MLP width at "
                                     f"4 * d_model = {4 * d}")


# --------------------------------------------------------------------------------------------------- vocabulary
def base_vocab_table(tokenizer: dict, origin: str = "tokenizer") -> TokenTable:
    """Raw bytes of tokens 0 .. <|endoftext|> (50257 for English-only Whisper, 50258 multilingual: an id without a
    token, 50256 there, is written empty). whisper.cpp adds the special tokens after these itself."""
    id_to_token = token_strings(tokenizer)
    eot = [i for i, t in id_to_token.items() if t == EOT_TOKEN]
    if not eot:
        raise WhisperExportError(f"{origin}: the tokenizer has no {EOT_TOKEN} token")
    try:
        return table_of_tokens(id_to_token, min(eot) + 1)
    except NotByteLevel as e:
        raise WhisperExportError(f"{origin}: {e}") from None


def base_vocab_bytes(tokenizer: dict, origin: str = "tokenizer") -> list[bytes]:
    return base_vocab_table(tokenizer, origin).tokens()


# ------------------------------------------------------------------------------------------------------ packing
@dataclass
class WhisperCppModel:
    """Everything a whisper.cpp model file holds, computed and validated, nothing written yet."""

    hparams: WhisperHParams
    mel_filters: np.ndarray
    vocab: TokenTable
    tensors: list[PackedTensor]
    wait_verified: Callable[[], None] = lambda: None  # the source checkpoint's digests; checked before the rename
    origin: str = "model"  # the source, as the warning about F16 rounding names it

    @property
    def nbytes(self) -> int:
        preamble = 4 * (1 + len(self.hparams.ints()) + 2 + 1) + self.mel_filters.nbytes + len(self.vocab.records)
        headers = sum(12 + 4 * len(t.shape) + len(t.name.encode()) for t in self.tensors)
        return preamble + headers + sum(t.nbytes for t in self.tensors)


def build_whisper_cpp(source: WhisperSource, target: str, baseline: str | None = None,
                      progress: bool = False) -> WhisperCppModel:
    """Pack every tensor for ``target``; raises before anything is written if the source does not fit."""
    try:
        weight_type = _target_type(target, baseline, source)
        hparams = source.hparams(weight_type)
        slots = tensor_slots(hparams)
        _check_nothing_left_over(source, slots)
        with tqdm(slots, desc=f"pack {target}", unit="tensor", disable=not progress, leave=False) as bar:
            tensors = [_pack_slot(slot, source, weight_type, baseline) for slot in bar]
        model = WhisperCppModel(hparams, source.mel_filters(), source.export_vocab(), tensors, source.wait_verified,
                                source.origin)
    except Exception:
        source.wait_verified()  # a damaged checkpoint is named by its digest first, not by what failed on it
        raise
    return model


def _target_type(target: str, baseline: str | None, source: WhisperSource) -> int:
    if target not in TARGET_TYPES:
        raise WhisperExportError(f"unknown target {target!r}; choose one of {', '.join(TARGET_TYPES)}")
    weight_type = TARGET_TYPES[target]
    _check_row_width(source, target, weight_type)
    if baseline is None:
        return weight_type
    if baseline not in BASELINES:
        raise WhisperExportError(f"unknown baseline {baseline!r}; choose one of {', '.join(BASELINES)}")
    if weight_type not in QUANTIZED_TYPES:
        raise WhisperExportError(f"baseline {baseline!r} is ggml's own quantization: use a quantized type, not "
                                 f"{target}")
    if source.lattice:
        raise WhisperExportError(f"{source.origin}: baseline {baseline!r} rounds a float model; this source is a "
                                 f"lattice checkpoint (export it without a baseline, or pass the float model)")
    if target in GGML_NEEDS_IMPORTANCE:
        raise WhisperExportError(f"--baseline: ggml's {target} quantizer needs an importance matrix (calibrate with "
                                 f"quantize --method imatrix --type {target}, then export that checkpoint)")
    return weight_type


def _check_row_width(source: WhisperSource, target: str, weight_type: int) -> None:
    """The K-quants pack rows of 256 values: refuse a model whose width is not a multiple of it, naming what fits."""
    d_model = source.config.get("d_model")
    if weight_type in K_TYPES and isinstance(d_model, int) and d_model % K_SUPER_BLOCK:
        fitting = ", ".join(name for name, t in TARGET_TYPES.items() if t not in K_TYPES)
        raise WhisperExportError(f"{source.origin}: target {target} packs rows of {K_SUPER_BLOCK} values, but this "
                                 f"model's width d_model = {d_model} is not a multiple of {K_SUPER_BLOCK}; types that "
                                 f"fit it: {fitting}")


def _check_nothing_left_over(source: WhisperSource, slots: list[TensorSlot]) -> None:
    used = {source.resolve(s.hf_name) for s in slots} | {s.hf_name for s in slots} | {OUTPUT_PROJECTION}
    extra = sorted(n for n in [*source.floats, *source.lattice] if n not in used)
    if extra:
        raise WhisperExportError(f"{source.origin}: tensors {source.runtime} has no place for: {', '.join(extra[:5])}"
                                 + (f" and {len(extra) - 5} more" if len(extra) > 5 else ""))


def _pack_slot(slot: TensorSlot, source: WhisperSource, weight_type: int, baseline: str | None) -> PackedTensor:
    if not source.has(slot.hf_name):
        raise WhisperExportError(f"{source.origin}: tensor {slot.hf_name} missing ({source.runtime} needs {slot.name})")
    ggml_type = slot.ggml_type(weight_type)
    if ggml_type in QUANTIZED_TYPES:
        data = _ggml_rtn(slot, source, ggml_type) if baseline else _pack_lattice_slot(slot, source, ggml_type)
    else:
        data = stored_blocks_as_f16(source, slot) if ggml_type == GGMLType.F16 else None
        if data is None:
            data = pack_float(slot.name, source.float_in_slot(slot), ggml_type)
    return PackedTensor(slot.name, ggml_type, slot.shape, data)


def _pack_lattice_slot(slot: TensorSlot, source: WhisperSource, ggml_type: int) -> np.ndarray:
    key = source.resolve(slot.hf_name)
    name = GGML_TYPE_NAMES[ggml_type]
    if key not in source.lattice:
        raise LatticeNotRepresentable(
            f"{source.origin}: {slot.hf_name} is not on a lattice; a {name} export stores a lattice checkpoint "
            f"exactly (quantize every weight matrix and proj_out), or use baseline 'rtn' for ggml's own rounding")
    source.check_lattice_shape(slot)
    return stored_or_packed(source.lattice, key, ggml_type, slot.hf_name, source.origin)


def _ggml_rtn(slot: TensorSlot, source: WhisperSource, ggml_type: int) -> np.ndarray:
    # whisper.cpp's quantize tool reads the F16 file, so it rounds the fp16 weights: do the same
    w = source.float_in_slot(slot).to(torch.float16).float()
    return ggml_rtn(w.numpy(), ggml_type)


# ------------------------------------------------------------------------------------------------------ writing
def write_whisper_cpp(model: WhisperCppModel, out_path: str | os.PathLike, progress: bool = False) -> Path:
    """Write ``model`` to ``out_path`` through a temporary file in the same directory, renamed when complete;
    nothing is left behind on error. F16 tensors are made while the tensors before them are written (MadeAhead)."""
    out = Path(out_path)
    rounding = F16Rounding(model.origin)
    f16 = MadeAhead([t.data for t in model.tensors if isinstance(t.data, F16Values)], rounding)
    with atomic_file(out, before_rename=model.wait_verified) as f:
        f.write(_preamble_bytes(model))
        with tqdm(total=model.nbytes, desc=f"write {out.name}", unit="B", unit_scale=True,
                  disable=not progress, leave=False) as bar:
            for batch in _batches(model.tensors, WRITE_BATCH_BYTES, f16.ready):
                bar.update(write_buffers(f, [part for tensor in batch for part in _tensor_parts(tensor, f16)]))
                for tensor in batch:
                    if isinstance(tensor.data, F16Values):
                        f16.written(tensor.data)
    rounding.report()
    return out


WRITE_BATCH_BYTES = 64 << 20  # tensors handed to the kernel together; progress moves once per batch


def _batches(tensors: list[PackedTensor], limit: int, f16_ready: Callable[[F16Values], bool]
             ) -> Iterator[list[PackedTensor]]:
    """The tensors in runs of at most ``limit`` bytes, handed to the kernel together; a run also ends before an F16
    tensor still being made, so that what is ready is written meanwhile."""
    batch: list[PackedTensor] = []
    size = 0
    for tensor in tensors:
        waits = isinstance(tensor.data, F16Values) and not f16_ready(tensor.data)
        if batch and (size + tensor.nbytes > limit or waits):
            yield batch
            batch, size = [], 0
        batch.append(tensor)
        size += tensor.nbytes
    if batch:
        yield batch


def _preamble_bytes(model: WhisperCppModel) -> bytes:
    h, mel = model.hparams, model.mel_filters
    parts = [struct.pack("<I", FILE_MAGIC), struct.pack(f"<{len(h.ints())}i", *h.ints()),
             struct.pack("<2i", *mel.shape), mel.astype("<f4").tobytes(), struct.pack("<i", len(model.vocab)),
             model.vocab.records.tobytes()]
    return b"".join(parts)


def _tensor_parts(tensor: PackedTensor, f16: MadeAhead) -> tuple[bytes, memoryview]:
    name = tensor.name.encode("utf-8")
    ne = tuple(reversed(tensor.shape))  # ggml order: ne[0] is the row length
    header = struct.pack(f"<3i{len(ne)}i", len(ne), len(name), tensor.ggml_type, *ne) + name
    array = f16.values(tensor.data) if isinstance(tensor.data, F16Values) else tensor.data  # waits for an F16 one
    data = np.ascontiguousarray(array, dtype=array.dtype.newbyteorder("<"))  # no-op on little-endian
    return header, memoryview(data).cast("B")


# --------------------------------------------------------------------------------------------------- public API
def export_whisper_cpp(source: Any, out_path: str | os.PathLike, target: str | None = None, *,
                       baseline: str | None = None, progress: bool = False) -> Path:
    """Export ``source`` (a LatticeCheckpoint, a checkpoint directory, or (model, processor[, generation_config]))
    to a whisper.cpp model file; returns the path written. See the module docstring for targets; the default is
    the source's own (``default_target``)."""
    whisper = as_source(source)
    built = build_whisper_cpp(whisper, target or default_target(whisper, baseline), baseline, progress)
    return write_whisper_cpp(built, out_path, progress)


def default_target(source: WhisperSource, baseline: str | None) -> str:
    """The target a source naturally exports to: its lattice's type, q4_0 for a baseline, f16 for a float model."""
    if baseline:
        return "q4_0"
    specs = [source.lattice.spec_of(name) for name in source.lattice]
    types = {type_for_spec(spec) for spec in specs}
    if not types:
        return "f16"
    if None in types:
        bits = sorted({spec.bits for spec in specs if type_for_spec(spec) is None})
        raise WhisperExportError(f"{source.origin}: a {'/'.join(map(str, bits))}-bit lattice has no exact "
                                 f"whisper.cpp type (Q4_0/Q5_0/Q8_0 hold 4/5/8-bit symmetric lattices); use "
                                 f"target f16")
    if len(types) > 1:
        names = ", ".join(sorted(GGML_TYPE_NAMES[t].lower() for t in types))
        raise WhisperExportError(f"{source.origin}: the weight matrices are on a mix of types ({names}); "
                                 f"whisper.cpp stores one type for all of them (a per-tensor mix is for GGUF targets)")
    return GGML_TYPE_NAMES[types.pop()].lower()


# ------------------------------------------------------------------------------------------------------ verify
def verify(model_bin: str | os.PathLike, checkpoint: str | os.PathLike | LatticeCheckpoint) -> dict[str, float]:
    """Decode every tensor of ``model_bin`` with gguf-py and compare it with the checkpoint's exact values (s * q for
    lattice weights, the stored tensors otherwise; the token embedding is proj_out's lattice). Returns max |diff| per
    array, "mel_filters" first and then every tensor in file-layout order; 0.0 everywhere for a lossless export."""
    model = read_whisper_cpp(model_bin)
    ckpt, origin = as_checkpoint(checkpoint)
    source = checkpoint_source(ckpt, origin=origin)  # the same reading of header, vocabulary and mel filters as export
    _check_same_model(model, source.hparams(model.hparams.weight_type), source.vocab(), origin)
    diffs = {"mel_filters": max_abs_diff(model.mel_filters, source.mel_filters())}
    diffs.update(compare_tensors(model, tensor_slots(model.hparams), CheckpointValues(ckpt), origin))
    return diffs


def _check_same_model(model: WhisperCppFile, expected: WhisperHParams, vocab: list[bytes], checkpoint: str) -> None:
    if not model.hparams.same_model(expected):
        raise VerifyError(f"{model.path}: header {model.hparams.ints()[:-1]} does not match the checkpoint "
                          f"{checkpoint} ({expected.ints()[:-1]})")
    if model.vocab != vocab:
        differing = sum(a != b for a, b in zip(model.vocab, vocab)) + abs(len(model.vocab) - len(vocab))
        raise VerifyError(f"{model.path}: vocabulary differs from the checkpoint {checkpoint}'s tokenizer "
                          f"({differing} tokens; {len(model.vocab)} in the file, {len(vocab)} expected)")
