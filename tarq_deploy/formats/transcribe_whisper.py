"""Whisper for transcribe.cpp (handy-computer/transcribe.cpp; PyPI ``transcribe-cpp`` + ``transcribe-cpp-native``):
one GGUF of architecture "whisper" whose weight matrices each keep their own type, so a lattice checkpoint -- a
uniform one or a ``--tensor-type`` mix -- is written bit for bit (its codes become the type's blocks; nothing
re-quantizes), and ``verify`` reads it back exactly.

What transcribe.cpp's Whisper loader wants (read from its sources, 0.2.x, and checked by loading in the 0.4.1 wheel):

* tensors ``enc.conv.{0,1}.*``, ``enc.pos_emb.weight``, ``enc.blocks.N.{norm_attn, attn.{q,k,v,out}, norm_ffn,
  ffn.fc1, ffn.fc2}``, ``enc.final_norm``, ``dec.token_embd.weight`` (the tied output projection too),
  ``dec.pos_emb.weight``, ``dec.blocks.N.{norm_self, self_attn.*, norm_cross, cross_attn.*, norm_ffn, ffn.*}``,
  ``dec.final_norm``; ``attn.k`` has no bias; every shape is the transformers one (conv biases 1-D);
* the front end as tensors: ``frontend.mel_filterbank`` F32 [n_mels, 201] (the Slaney filters) and
  ``frontend.window`` F32 [n_fft] (periodic Hann);
* types: weight matrices and the token embedding in its allowlist (``LOADER_TYPES``: no Q2_K/Q3_K, no IQ types), conv
  kernels F32 or F16, norms, biases and both positional tables F32 only;
* keys ``stt.whisper.{encoder,decoder}.*`` (dimensions, activation "gelu"), the prompt token ids, the suppress lists,
  ``stt.frontend.*`` (it refuses any front end but Whisper's log-mel), ``stt.capability.*``, ``general.languages``
  (each multilingual code must have its ``<|code|>`` token) and a "gpt2" byte-level BPE ``tokenizer.ggml.*``.

Float tensors are stored as the checkpoint holds them: conv kernels F16 when their values are float16 ones, else F32 (so
a float32-born model verifies exactly too); a float ``--model`` exports F16 matrices.

Presets (``quantize --tensor-type q4_k_m``, quant/presets.py): ``preset_plan`` gives every tensor the type
transcribe.cpp's own quantizer would, by GGUF name and row width; the checkpoint records the preset, and its file takes
the preset's conv kernels (F32) and ``general.file_type`` (Q4_K_M 15, Q5_K_M 17), its matrices checked against the plan.
"""
from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf.constants import GGUFValueType

from tarq_deploy.checkpoint import LatticeCheckpoint, read_manifest
from tarq_deploy.quant.choices import GGML_TYPES
from tarq_deploy.quant.presets import PRESETS, Preset, matrix_type as preset_matrix_type

from .f16_rounding import F16Rounding, F16Values
from .ggml_blocks import GGML_TYPE_NAMES, GGMLType, type_for_spec
from .ggml_tensors import (ROLE_CONV, ROLE_F32, ROLE_MATRIX, CheckpointValues, PackedTensor, TensorSlot, as_checkpoint,
                           compare_tensors, max_abs_diff, pack_float, stored_blocks_as_f16, stored_or_packed)
from .gguf_file import (FILE_TYPES, KV, GGUFExportError, GGUFFile, GGUFModel, GGUFVerifyError, check_metadata,
                        file_kv, most_weights_type, read_gguf, write_gguf)
from .whisper_cpp import OUTPUT_PROJECTION, WhisperSource, as_source, checkpoint_source

__all__ = ["ARCH", "TARGET", "TARGET_TYPES", "check_export_options", "check_loader_types", "export_transcribe_whisper",
           "front_end_table_diff", "main_file_type", "matrix_type", "pack_slot", "preset_plan", "preset_tensor_types",
           "tensor_slots"]

ARCH = "whisper"
TARGET = "transcribe.cpp"
# transcribe.cpp's allowlist for linear weights and the token embedding (TRANSCRIBE_QUANT_LINEAR_TYPES; BF16 too,
# which no lattice of ours makes); a file with any other type there fails to load
LOADER_TYPES = (GGMLType.F32, GGMLType.F16, GGMLType.Q4_0, GGMLType.Q4_1, GGMLType.Q5_0, GGMLType.Q5_1,
                GGMLType.Q8_0, GGMLType.Q4_K, GGMLType.Q5_K, GGMLType.Q6_K)
TARGET_TYPES = {GGML_TYPE_NAMES[t].lower(): t for t in LOADER_TYPES}  # by name, as `tarq-deploy types` lists them
FRONT_END_TABLES = ("frontend.mel_filterbank", "frontend.window")
N_FFT_BINS = 201  # n_fft 400 / 2 + 1
TIMESTAMPS = 1501  # <|0.00|> ... <|30.00|>, after the control tokens
TOKEN_NORMAL, TOKEN_CONTROL = 1, 3  # llama.cpp token types
# keys that pin the model's structure and decoding: verify compares them with what the checkpoint gives
STRUCTURAL_KEYS = ("stt.whisper.encoder.n_layers", "stt.whisper.encoder.d_model", "stt.whisper.encoder.n_heads",
                   "stt.whisper.encoder.ffn_dim", "stt.whisper.encoder.num_mel_bins",
                   "stt.whisper.decoder.n_layers", "stt.whisper.decoder.n_heads", "stt.whisper.decoder.ffn_dim",
                   "stt.whisper.decoder.vocab_size", "stt.whisper.decoder_start_token_id",
                   "stt.whisper.no_timestamps_token_id", "stt.whisper.suppress_tokens",
                   "stt.whisper.begin_suppress_tokens", "general.languages", "tokenizer.ggml.tokens",
                   "tokenizer.ggml.token_type")


# ------------------------------------------------------------------------------------------------------ tensors
def tensor_slots(config: dict) -> list[TensorSlot]:
    """Every tensor transcribe.cpp's Whisper loader asks for, transformers' name beside it (numpy shapes)."""
    d, n_mels = config["d_model"], config["num_mel_bins"]
    enc, dec = "model.encoder", "model.decoder"
    slots = [TensorSlot("enc.conv.0.weight", f"{enc}.conv1.weight", ROLE_CONV, (d, n_mels, 3)),
             TensorSlot("enc.conv.0.bias", f"{enc}.conv1.bias", ROLE_F32, (d,)),
             TensorSlot("enc.conv.1.weight", f"{enc}.conv2.weight", ROLE_CONV, (d, d, 3)),
             TensorSlot("enc.conv.1.bias", f"{enc}.conv2.bias", ROLE_F32, (d,)),
             TensorSlot("enc.pos_emb.weight", f"{enc}.embed_positions.weight", ROLE_F32,
                        (config["max_source_positions"], d))]
    slots += _norm("enc.final_norm", f"{enc}.layer_norm", d)
    for i in range(config["encoder_layers"]):
        slots += _block(f"enc.blocks.{i}", f"{enc}.layers.{i}", d, config["encoder_ffn_dim"], cross=False)
    slots += [TensorSlot("dec.token_embd.weight", f"{dec}.embed_tokens.weight", ROLE_MATRIX, (config["vocab_size"], d)),
              TensorSlot("dec.pos_emb.weight", f"{dec}.embed_positions.weight", ROLE_F32,
                         (config["max_target_positions"], d))]
    slots += _norm("dec.final_norm", f"{dec}.layer_norm", d)
    for i in range(config["decoder_layers"]):
        slots += _block(f"dec.blocks.{i}", f"{dec}.layers.{i}", d, config["decoder_ffn_dim"], cross=True)
    return slots


def _block(prefix: str, hf: str, d: int, ffn: int, cross: bool) -> list[TensorSlot]:
    self_attn = "self_attn" if cross else "attn"  # the decoder names its self-attention apart from cross-attention
    slots = _norm(f"{prefix}.{'norm_self' if cross else 'norm_attn'}", f"{hf}.self_attn_layer_norm", d)
    slots += _attention(f"{prefix}.{self_attn}", f"{hf}.self_attn", d)
    if cross:
        slots += _norm(f"{prefix}.norm_cross", f"{hf}.encoder_attn_layer_norm", d)
        slots += _attention(f"{prefix}.cross_attn", f"{hf}.encoder_attn", d)
    slots += _norm(f"{prefix}.norm_ffn", f"{hf}.final_layer_norm", d)
    slots += [TensorSlot(f"{prefix}.ffn.fc1.weight", f"{hf}.fc1.weight", ROLE_MATRIX, (ffn, d)),
              TensorSlot(f"{prefix}.ffn.fc1.bias", f"{hf}.fc1.bias", ROLE_F32, (ffn,)),
              TensorSlot(f"{prefix}.ffn.fc2.weight", f"{hf}.fc2.weight", ROLE_MATRIX, (d, ffn)),
              TensorSlot(f"{prefix}.ffn.fc2.bias", f"{hf}.fc2.bias", ROLE_F32, (d,))]
    return slots


def _attention(prefix: str, hf: str, d: int) -> list[TensorSlot]:
    slots = []
    for part, hf_part in (("q", "q_proj"), ("k", "k_proj"), ("v", "v_proj"), ("out", "out_proj")):
        slots.append(TensorSlot(f"{prefix}.{part}.weight", f"{hf}.{hf_part}.weight", ROLE_MATRIX, (d, d)))
        if part != "k":  # Whisper's key projection has no bias, and the loader has no slot for one
            slots.append(TensorSlot(f"{prefix}.{part}.bias", f"{hf}.{hf_part}.bias", ROLE_F32, (d,)))
    return slots


def _norm(prefix: str, hf: str, d: int) -> list[TensorSlot]:
    return [TensorSlot(f"{prefix}.{p}", f"{hf}.{p}", ROLE_F32, (d,)) for p in ("weight", "bias")]


# ------------------------------------------------------------------------------------------------------ presets
def preset_plan(preset: Preset, config: dict) -> dict[str, str]:
    """GGUF name -> type name of every tensor transcribe.cpp's ``preset`` writes for this Whisper (quant/presets.py):
    weight matrices by bucket and row width, conv kernels the preset's conv type, the rest F32."""
    plan = {name: "f32" for name in FRONT_END_TABLES}
    for slot in tensor_slots(config):
        if slot.role == ROLE_MATRIX:
            plan[slot.name] = preset_matrix_type(preset, slot.name, slot.shape[-1])  # numpy [rows, ne0]
        else:
            plan[slot.name] = preset.conv if slot.role == ROLE_CONV else "f32"
    return plan


def preset_tensor_types(preset: Preset, config: dict) -> tuple[tuple[str, str], ...]:
    """The preset's matrix types as --tensor-type overrides naming each transformers weight exactly (the tied
    output head ``proj_out.weight`` takes the token embedding's type); ValueError where a matrix would stay F16,
    which no lattice holds."""
    plan = preset_plan(preset, config)
    types = {slot.hf_name: plan[slot.name] for slot in tensor_slots(config) if slot.role == ROLE_MATRIX}
    types[OUTPUT_PROJECTION] = plan["dec.token_embd.weight"]
    for name, type_name in types.items():
        if type_name not in GGML_TYPES:
            raise ValueError(f"{name}: {preset.name} keeps it {type_name.upper()} (no quantized block divides its "
                             f"rows), which a lattice checkpoint cannot hold")
    return tuple((f"^{re.escape(name)}$", type_name) for name, type_name in sorted(types.items()))


def checkpoint_preset(checkpoint: str | os.PathLike) -> Preset | None:
    """The preset a checkpoint was quantized with (quantize --tensor-type q4_k_m records it), if any."""
    method = read_manifest(checkpoint).get("method") or {}
    name = method.get("preset") if isinstance(method, dict) else None
    if name is None:
        return None
    if name not in PRESETS:
        raise GGUFExportError(f"{checkpoint}: quantized with preset {name!r}, which this version does not know")
    return PRESETS[name]


def check_preset(source: WhisperSource, preset: Preset) -> None:
    """Every weight matrix on the lattice type the preset gives it: a file tagged with the preset holds its mix."""
    plan = preset_plan(preset, source.config)
    for slot in tensor_slots(source.config):
        if slot.role == ROLE_MATRIX:
            found = GGML_TYPE_NAMES[matrix_type(source, slot)].lower()
            if found != plan[slot.name]:
                raise GGUFExportError(f"{source.origin}: {slot.hf_name} is {found}, but preset {preset.name} gives "
                                      f"{slot.name} {plan[slot.name]}")


def front_end_tables(source: WhisperSource) -> dict[str, np.ndarray]:
    """The F32 arrays of the mel front end the runtime computes features with (transformers' own filters)."""
    n_fft = int(source.feature_extractor.get("n_fft", 400))
    window = 0.5 - 0.5 * np.cos(2.0 * np.pi * np.arange(n_fft) / n_fft)  # periodic Hann, as torch.hann_window
    return {"frontend.mel_filterbank": source.mel_filters(), "frontend.window": window.astype(np.float32)}


# ------------------------------------------------------------------------------------------------------ packing
def matrix_type(source: WhisperSource, slot: TensorSlot) -> int:
    """The type a weight matrix is stored in: its lattice's (refused when the loader cannot take it), else F16."""
    key = source.resolve(slot.hf_name)
    if key not in source.lattice:
        return GGMLType.F16
    ggml_type = type_for_spec(source.lattice.spec_of(key))
    if ggml_type not in LOADER_TYPES:
        allowed = ", ".join(GGML_TYPE_NAMES[t].lower() for t in LOADER_TYPES)
        shown = GGML_TYPE_NAMES[ggml_type].lower() if ggml_type is not None else f"{source.lattice.spec_of(key)}"
        raise GGUFExportError(f"{source.origin}: {slot.hf_name} is on the {shown} lattice; {TARGET}'s loader takes "
                              f"{allowed} for weight matrices, so the file would not load (quantize again with "
                              f"--type / --tensor-type set to one of those)")
    return ggml_type


def check_loader_types(source: WhisperSource, slots: list[TensorSlot]) -> None:
    """Refuse, before anything is packed, a lattice type the loader would reject."""
    for slot in slots:
        if slot.role == ROLE_MATRIX:
            matrix_type(source, slot)


def pack_slot(slot: TensorSlot, source: WhisperSource, rounding: F16Rounding,
              preset: Preset | None = None) -> PackedTensor:
    if not source.has(slot.hf_name):
        raise GGUFExportError(f"{source.origin}: tensor {slot.hf_name} missing ({TARGET} needs {slot.name})")
    key = source.resolve(slot.hf_name)
    if slot.role == ROLE_MATRIX and key in source.lattice:
        ggml_type = matrix_type(source, slot)
        source.check_lattice_shape(slot)
        return PackedTensor(slot.name, ggml_type, slot.shape,
                            stored_or_packed(source.lattice, key, ggml_type, slot.hf_name, source.origin))
    ggml_type = _float_type(slot, source, preset)
    data = stored_blocks_as_f16(source, slot) if ggml_type == GGMLType.F16 else None
    if data is None:
        data = pack_float(slot.name, source.float_in_slot(slot), ggml_type)
    # gguf-py's writer takes every array before it writes: F16 values are made here
    values = rounding.made(data) if isinstance(data, F16Values) else data
    return PackedTensor(slot.name, ggml_type, slot.shape, values)


def _float_type(slot: TensorSlot, source: WhisperSource, preset: Preset | None = None) -> int:
    """F32 for norms, biases and positional tables (the loader takes nothing else there); conv kernels the preset's
    type (F32: as transcribe-quantize writes them) or else F16 when they hold float16 values (whatever dtype the
    checkpoint keeps them in), F32 otherwise (nothing rounded); a float weight matrix F16."""
    if slot.role == ROLE_F32:
        return GGMLType.F32
    if slot.role == ROLE_CONV and preset is not None:
        return GGMLType.F32 if preset.conv == "f32" else GGMLType.F16
    if slot.role == ROLE_CONV:
        values = source.float_in_slot(slot).float()
        return GGMLType.F16 if torch.equal(values.half().float(), values) else GGMLType.F32
    return GGMLType.F16


# ----------------------------------------------------------------------------------------------------- metadata
def vocabulary(source: WhisperSource) -> tuple[list[str], list[int], list[str]]:
    """(tokens, token types, merges) for tokenizer.ggml.*: the tokenizer's byte-level strings for every id up to the
    model's vocab_size; control tokens and the 1501 timestamps named by Whisper's layout where the tokenizer lacks
    them (CTranslate2's tokenizer.json has no timestamp tokens)."""
    from tarq_deploy.vocabulary import token_strings

    n_vocab = int(source.config["vocab_size"])
    control = _control_tokens(n_vocab, source.origin)
    named = token_strings(source.tokenizer)
    layout = dict(enumerate(control.names, start=control.end_of_text))
    first_timestamp = control.end_of_text + len(control.names)
    tokens, types = [], []
    for i in range(n_vocab):
        if i >= first_timestamp:
            tokens.append(named.get(i, f"<|{(i - first_timestamp) * 0.02:.2f}|>"))
        else:
            tokens.append(layout.get(i) or named.get(i) or f"<|unused_{i}|>")  # an id without a token stays unique
        types.append(TOKEN_CONTROL if i >= control.end_of_text else TOKEN_NORMAL)
    merges = source.tokenizer.get("model", {}).get("merges") or []
    return tokens, types, [m if isinstance(m, str) else " ".join(m) for m in merges]


def _control_tokens(n_vocab: int, origin: str) -> Any:
    from tarq_deploy.models.whisper_tokens import ControlTokens

    try:
        return ControlTokens.for_vocab_size(n_vocab)
    except ValueError as e:
        raise GGUFExportError(f"{origin}: {e}") from None


def metadata(source: WhisperSource) -> list[KV]:
    """Every key but the file-type ones, from the source's config, tokenizer and feature extractor."""
    c, fe = source.config, source.feature_extractor
    control = _control_tokens(int(c["vocab_size"]), source.origin)
    ids = control.ids
    languages = [name[2:-2] for name in control.languages] if control.multilingual else ["en"]
    tokens, types, merges = vocabulary(source)
    u32, string, boolean = GGUFValueType.UINT32, GGUFValueType.STRING, GGUFValueType.BOOL
    i32, f32 = GGUFValueType.INT32, GGUFValueType.FLOAT32
    sample_rate, n_fft = int(fe.get("sampling_rate", 16000)), int(fe.get("n_fft", 400))
    chunk = int(fe.get("chunk_length", 30))
    kv = [KV("general.languages", languages, string, True),
          KV("stt.capability.lang_detect", control.multilingual, boolean),
          KV("stt.capability.translate", control.multilingual, boolean),
          KV("stt.capability.timestamps", True, boolean),
          KV("tokenizer.ggml.model", "gpt2", string), KV("tokenizer.ggml.pre", "gpt2", string),
          KV("tokenizer.ggml.tokens", tokens, string, True), KV("tokenizer.ggml.token_type", types, i32, True)]
    if merges:
        kv.append(KV("tokenizer.ggml.merges", merges, string, True))
    eot = control.end_of_text
    kv += [KV(f"tokenizer.ggml.{role}_token_id", eot, u32) for role in ("bos", "eos", "padding")]
    kv.append(KV("tokenizer.ggml.add_bos_token", False, boolean))
    for side, layers, heads, ffn in (("encoder", "encoder_layers", "encoder_attention_heads", "encoder_ffn_dim"),
                                     ("decoder", "decoder_layers", "decoder_attention_heads", "decoder_ffn_dim")):
        kv += [KV(f"stt.whisper.{side}.n_layers", int(c[layers]), u32),
               KV(f"stt.whisper.{side}.d_model", int(c["d_model"]), u32),
               KV(f"stt.whisper.{side}.n_heads", int(c[heads]), u32),
               KV(f"stt.whisper.{side}.ffn_dim", int(c[ffn]), u32),
               KV(f"stt.whisper.{side}.activation", str(c.get("activation_function", "gelu")).lower(), string)]
    kv += [KV("stt.whisper.encoder.num_mel_bins", int(c["num_mel_bins"]), u32),
           KV("stt.whisper.encoder.max_source_positions", int(c["max_source_positions"]), u32),
           KV("stt.whisper.decoder.max_target_positions", int(c["max_target_positions"]), u32),
           KV("stt.whisper.decoder.vocab_size", int(c["vocab_size"]), u32),
           KV("stt.whisper.decoder.tie_word_embeddings", True, boolean),
           KV("stt.whisper.decoder.scale_embedding", bool(c.get("scale_embedding", False)), boolean),
           KV("stt.whisper.decoder_start_token_id", ids["<|startoftranscript|>"], u32),
           KV("stt.whisper.sot_token_id", ids["<|startoftranscript|>"], u32),
           KV("stt.whisper.no_timestamps_token_id", ids["<|notimestamps|>"], u32),
           KV("stt.whisper.transcribe_token_id", ids["<|transcribe|>"], u32),
           KV("stt.whisper.translate_token_id", ids["<|translate|>"], u32),
           KV("stt.whisper.prev_sot_token_id", ids["<|startofprev|>"], u32),
           KV("stt.whisper.suppress_tokens", [int(t) for t in c.get("suppress_tokens") or []], i32, True),
           KV("stt.whisper.begin_suppress_tokens", [int(t) for t in c.get("begin_suppress_tokens") or []], i32, True)]
    kv += [KV("stt.frontend.type", "mel", string), KV("stt.frontend.num_mels", int(c["num_mel_bins"]), u32),
           KV("stt.frontend.sample_rate", sample_rate, u32), KV("stt.frontend.n_fft", n_fft, u32),
           KV("stt.frontend.win_length", n_fft, u32),
           KV("stt.frontend.hop_length", int(fe.get("hop_length", 160)), u32),
           KV("stt.frontend.window", "hann_periodic", string), KV("stt.frontend.normalize", "whisper_logmel", string),
           KV("stt.frontend.dither", 0.0, f32), KV("stt.frontend.pre_emphasis", 0.0, f32),
           KV("stt.frontend.f_min", 0.0, f32), KV("stt.frontend.f_max", sample_rate / 2.0, f32),
           KV("stt.frontend.pad_mode", "reflect", string), KV("stt.frontend.center", True, boolean),
           KV("stt.frontend.mel_norm", "slaney", string), KV("stt.frontend.chunk_length", chunk, u32),
           KV("stt.frontend.n_samples", int(fe.get("n_samples", chunk * sample_rate)), u32),
           KV("stt.frontend.nb_max_frames", int(fe.get("nb_max_frames", chunk * sample_rate // 160)), u32)]
    return kv


# ------------------------------------------------------------------------------------------------- build, write
def build(source: WhisperSource, preset: Preset | None = None) -> GGUFModel:
    """Every tensor packed and every key computed; raises before anything is written if the source does not fit.
    ``preset``: the checkpoint's transcribe.cpp preset, whose conv kernels and general.file_type the file takes."""
    try:
        slots = tensor_slots(source.config)
        check_loader_types(source, slots)
        if preset is not None:
            check_preset(source, preset)
        rounding = F16Rounding(source.origin)
        tables = [PackedTensor(name, GGMLType.F32, values.shape, values)
                  for name, values in front_end_tables(source).items()]
        tensors = tables + [pack_slot(slot, source, rounding, preset) for slot in slots]
        rounding.report()
        kv = file_kv(f"whisper-{source.config['d_model']}x{source.config['encoder_layers']}", main_file_type(tensors))
        if preset is not None:  # the preset's own tag (Q4_K_M 15, not the Q4_K_S that its main type alone says)
            kv = [KV(k.key, preset.file_type, k.value_type) if k.key == "general.file_type" else k for k in kv]
        model = GGUFModel(ARCH, kv + metadata(source), tensors)
    finally:
        source.wait_verified()  # a damaged checkpoint is named by its digest, and nothing is written from it
    return model


def main_file_type(tensors: list[PackedTensor]) -> int:
    """general.file_type: the type holding the most weight-matrix values (F16 for a float file)."""
    counts: dict[int, int] = {}
    for t in tensors:
        if t.ggml_type in FILE_TYPES and t.ggml_type != GGMLType.F32 and len(t.shape) == 2:
            counts[t.ggml_type] = counts.get(t.ggml_type, 0) + int(np.prod(t.shape))
    return most_weights_type(counts) if counts else GGMLType.F32


def float_model_source(model_id: str) -> WhisperSource:
    """A float Whisper model (packaged:NAME, a transformers or CTranslate2 folder) with its full tokenizer.json."""
    from tarq_deploy.formats.model_loader import load_whisper

    from .whisper_cpp import model_source

    try:
        model, processor, _ = load_whisper(model_id)
    except (ValueError, OSError) as e:
        raise GGUFExportError(f"--model {model_id}: cannot load it ({e})") from None
    source = model_source(model, processor, origin=model_id)
    backend = getattr(processor.tokenizer, "backend_tokenizer", None)
    if backend is not None:  # the merges are in the serialised tokenizer only
        source.read_tokenizer = lambda: json.loads(backend.to_str())
    return source


def check_export_options(checkpoint: str | None, model: str | None, weight_type: str | None) -> None:
    """GGUFExportError unless exactly one of a checkpoint or a float model is given, and --type is absent (a
    checkpoint: each matrix keeps its lattice's type) or f16 (a float model). Every transcribe.cpp family's export."""
    if (checkpoint is None) == (model is None):
        raise GGUFExportError("give either CHECKPOINT_DIR or --model SOURCE (exactly one)")
    if model is not None and weight_type not in (None, "f16"):
        raise GGUFExportError(f"--type {weight_type} from a float model: --target {TARGET} writes a float model as "
                              f"f16; a lattice is exported from its checkpoint directory")
    if checkpoint is not None and weight_type is not None:
        raise GGUFExportError(f"--type {weight_type}: --target {TARGET} stores every matrix in its own lattice's type "
                              f"(nothing re-quantizes); leave --type out")


def export_transcribe_whisper(checkpoint: str | None, model: str | None, weight_type: str | None,
                              out_path: str | os.PathLike) -> tuple[Path, str]:
    """The export command: a Whisper lattice checkpoint, or a float model as F16, to a transcribe.cpp GGUF."""
    check_export_options(checkpoint, model, weight_type)
    source = as_source(checkpoint) if checkpoint is not None else float_model_source(model)
    preset = checkpoint_preset(checkpoint) if checkpoint is not None else None
    built = build(source, preset)
    out = write_gguf(built, out_path)
    types = sorted({GGML_TYPE_NAMES[t.ggml_type] for t in built.tensors})
    return out, f"{TARGET} Whisper GGUF ({'/'.join(types)}), {len(built.tensors)} tensors, " \
                f"{out.stat().st_size / 1e6:.1f} MB"


# ------------------------------------------------------------------------------------------------------- verify
def verify(model_file: str | os.PathLike, checkpoint: str | os.PathLike | LatticeCheckpoint) -> dict[str, float]:
    """Decode every array of a transcribe.cpp Whisper GGUF and compare it with the checkpoint's exact values: the
    front-end tables first, then every tensor in slot order; keys that fix the model's structure must agree too."""
    model = read_gguf(model_file)
    if model.arch != ARCH:
        raise GGUFVerifyError(f"{model_file}: architecture {model.arch!r}, not a {TARGET} Whisper file")
    ckpt, origin = as_checkpoint(checkpoint)
    source = checkpoint_source(ckpt, origin=origin)
    check_metadata(model, metadata(source), STRUCTURAL_KEYS, origin)
    diffs = {name: front_end_table_diff(model, name, values) for name, values in front_end_tables(source).items()}
    diffs.update(compare_tensors(model, tensor_slots(source.config), CheckpointValues(ckpt), origin,
                                 GGUFVerifyError))
    return diffs


def front_end_table_diff(model: GGUFFile, name: str, expected: np.ndarray) -> float:
    if name not in model.tensors or model.tensors[name].shape != expected.shape:
        raise GGUFVerifyError(f"{model.path}: front-end table {name} missing or of another shape")
    return max_abs_diff(model.dequantize(name), expected)
