"""Qwen3-ASR and Voxtral for transcribe.cpp (PyPI ``transcribe-cpp`` + ``transcribe-cpp-native``): one GGUF of
architecture "qwen3_asr" or "voxtral" whose weight matrices each keep their own lattice type (a uniform lattice or a
``--tensor-type`` mix is written bit for bit; nothing re-quantizes), and ``verify`` reads it back exactly. The
Whisper flavour of the same runtime is transcribe_whisper.py; both share its loader allowlist and packing.

What transcribe.cpp's loaders want (read from its sources and checked by loading in the 0.4.1 wheel):

* tensors: audio tower ``enc.conv.{0,1[,2]}.*`` (Qwen3-ASR: three Conv2d and the ``enc.conv_out`` Linear; Voxtral:
  two Conv1d and ``enc.pos_emb.weight``), ``enc.blocks.N.{norm_attn, attn.{q,k,v,out}, norm_ffn, ffn.fc1,
  ffn.fc2}``, ``enc.ln_post``; the projector (Qwen3-ASR ``enc.proj{1,2}`` with biases, Voxtral
  ``proj.linear_{1,2}.weight``); the LLM ``dec.token_embd.weight``, ``dec.blocks.N.{norm_attn, norm_ffn,
  attn.{q,k,v,o}, ffn.{gate,up,down}}`` (Qwen3-ASR also ``attn.{q,k}_norm``), ``dec.output_norm.weight``, and
  Voxtral's untied ``dec.output.weight`` (Qwen3-ASR's head is tied: the loader has no slot for one);
* the front end: ``frontend.mel_filterbank`` F32 [n_mels, 201] (Slaney) and ``frontend.window`` (periodic Hann);
* types: Linear weights and embeddings in the allowlist (transcribe_whisper.LOADER_TYPES), ``ffn.gate`` and
  ``ffn.up`` of a layer in one type (it fuses them), conv kernels F32 or F16, norms and biases F32;
* keys ``stt.qwen3_asr.*`` / ``stt.voxtral.*`` (dimensions, token ids), ``stt.frontend.*`` (normalize
  "per_utterance") and a "gpt2" byte-level BPE ``tokenizer.ggml.*`` whose length is the decoder's vocab_size; the
  prompt's control tokens must be in it (Qwen3-ASR ``<|im_start|>``, ``<|im_end|>``, "system", "user",
  "assistant", the byte-level newline; Voxtral ``[INST]``, ``[/INST]``, ``[BEGIN_AUDIO]``, ``[TRANSCRIBE]``, bos,
  eos). Voxtral's Tekken ranks become byte-level tokens after its control slots, with merges rebuilt from the ranks.

CrispASR names its Voxtral architecture "voxtral" too; a transcribe.cpp file is told apart by its ``stt.voxtral``
keys (``is_transcribe_voxtral``).
"""
from __future__ import annotations

import functools
import os
import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
from gguf.constants import GGUFValueType

from tarq_deploy.checkpoint import LatticeCheckpoint

from . import crispasr, crispasr_voxtral
from .crispasr_voxtral import TekkenVocab, VoxtralSource
from .f16_rounding import F16Rounding
from .ggml_blocks import GGML_TYPE_NAMES, GGMLType
from .ggml_tensors import ROLE_MATRIX, CheckpointValues, PackedTensor, TensorSlot, as_checkpoint, compare_tensors
from .gguf_file import (KV, GGUFExportError, GGUFFile, GGUFModel, GGUFVerifyError, check_metadata, file_kv,
                        read_gguf, write_gguf)
from .model_files import ModelTensors
from .qwen3_asr_gguf import (AUDIO_END_TOKEN, AUDIO_PAD_TOKEN, AUDIO_START_TOKEN, EOS_TOKEN, HF_EMBEDDING,
                             HF_LM_HEAD, PAD_TOKEN, TOKEN_CONTROL, TOKEN_NORMAL, Qwen3ASRSource,
                             check_nothing_left_over, gguf_vocab, qwen3_asr_slots)
from .qwen3_asr_gguf import as_source as qwen3_as_source, float_model_source as qwen3_float_source
from .transcribe_whisper import (TARGET, main_file_type, front_end_table_diff, check_export_options, check_loader_types,
                                 matrix_type, pack_slot)

__all__ = ["MODEL_TYPES", "describe", "export_transcribe_llm", "family_of_file", "is_transcribe_voxtral",
           "tekken_merges", "transcribe_name"]

QWEN3_ASR_ARCH, VOXTRAL_ARCH = "qwen3_asr", "voxtral"
VOXTRAL_KEY = "stt.voxtral.encoder.n_layers"  # present in transcribe.cpp's Voxtral files, absent in CrispASR's
MEL_FILTERBANK, WINDOW = "frontend.mel_filterbank", "frontend.window"
VOXTRAL_FRAME_STACK = 4  # encoder frames per projector input (transformers reshapes by intermediate_size)
# Qwen3-ASR's conv front end runs its chunks in batches of this many (the published configs' conv_chunksize; a
# batching size, not a weight shape; transformers' config does not carry it)
QWEN3_CONV_CHUNKSIZE = 500

# ------------------------------------------------------------------------------------------------------ names
# The tensor tables come from the CrispASR writers (same transformers tensors, same shapes); transcribe.cpp spells
# the names its own way. Block parts: CrispASR suffix -> transcribe.cpp suffix.
_AUDIO_PARTS = {"attn_q": "attn.q", "attn_k": "attn.k", "attn_v": "attn.v", "attn_out": "attn.out",
                "attn_norm": "norm_attn", "ffn_norm": "norm_ffn", "ffn_up": "ffn.fc1", "ffn_down": "ffn.fc2"}
_TEXT_PARTS = {"attn_norm": "norm_attn", "ffn_norm": "norm_ffn", "attn_q": "attn.q", "attn_k": "attn.k",
               "attn_v": "attn.v", "attn_output": "attn.o", "attn_q_norm": "attn.q_norm",
               "attn_k_norm": "attn.k_norm", "ffn_gate": "ffn.gate", "ffn_up": "ffn.up", "ffn_down": "ffn.down"}
_WHOLE = {"token_embd.weight": "dec.token_embd.weight", "output_norm.weight": "dec.output_norm.weight",
          "output.weight": "dec.output.weight", "audio.embed_positions": "enc.pos_emb.weight",
          "proj1.weight": "proj.linear_1.weight", "proj2.weight": "proj.linear_2.weight"}
_BLOCK = re.compile(r"(audio\.blk|blk)\.(\d+)\.([a-z_]+)\.(weight|bias)")
_TOP = re.compile(r"audio\.(conv\.(\d)|conv_out|ln_post|proj(\d))\.(weight|bias)")


def transcribe_name(name: str) -> str:
    """transcribe.cpp's name of the tensor CrispASR calls ``name``."""
    if name in _WHOLE:
        return _WHOLE[name]
    block = _BLOCK.fullmatch(name)
    if block:
        side, i, part, kind = block.groups()
        enc = side == "audio.blk"
        return f"{'enc' if enc else 'dec'}.blocks.{i}.{(_AUDIO_PARTS if enc else _TEXT_PARTS)[part]}.{kind}"
    top = _TOP.fullmatch(name)
    if top is None:
        raise KeyError(name)  # a slot this table does not know: a bug, not a user error
    what, conv, proj, kind = top.groups()
    if conv is not None:
        return f"enc.conv.{int(conv) - 1}.{kind}"  # CrispASR counts convolutions from 1, transcribe.cpp from 0
    return f"enc.{what}.{kind}"


def renamed(slots: list[TensorSlot]) -> list[TensorSlot]:
    return [replace(slot, name=transcribe_name(slot.name)) for slot in slots]


# ------------------------------------------------------------------------------------------------- front end
def mel_tables(filters_by_frequency: np.ndarray, n_fft: int) -> dict[str, np.ndarray]:
    """transcribe.cpp's front-end tensors from transformers' filters [n_fft/2+1, n_mels]: the filterbank mel-major,
    and the periodic Hann window torch.stft is given."""
    window = 0.5 - 0.5 * np.cos(2.0 * np.pi * np.arange(n_fft) / n_fft)
    return {MEL_FILTERBANK: np.ascontiguousarray(np.asarray(filters_by_frequency, dtype=np.float32).T),
            WINDOW: window.astype(np.float32)}


def frontend_keys(fe: dict, n_mels: int) -> list[KV]:
    """stt.frontend.*: the Whisper log-mel both families use, normalised per utterance."""
    u32, f32, string, boolean = GGUFValueType.UINT32, GGUFValueType.FLOAT32, GGUFValueType.STRING, GGUFValueType.BOOL
    sample_rate, n_fft = int(fe.get("sampling_rate", 16000)), int(fe.get("n_fft", 400))
    hop, chunk = int(fe.get("hop_length", 160)), int(fe.get("chunk_length", 30))
    n_samples = int(fe.get("n_samples", chunk * sample_rate))
    return [KV("stt.frontend.type", "mel", string), KV("stt.frontend.num_mels", n_mels, u32),
            KV("stt.frontend.sample_rate", sample_rate, u32), KV("stt.frontend.n_fft", n_fft, u32),
            KV("stt.frontend.win_length", n_fft, u32), KV("stt.frontend.hop_length", hop, u32),
            KV("stt.frontend.window", "hann_periodic", string),
            KV("stt.frontend.normalize", "per_utterance", string),
            KV("stt.frontend.dither", float(fe.get("dither", 0.0)), f32), KV("stt.frontend.pre_emphasis", 0.0, f32),
            KV("stt.frontend.f_min", 0.0, f32), KV("stt.frontend.f_max", sample_rate / 2.0, f32),
            KV("stt.frontend.pad_mode", "reflect", string), KV("stt.frontend.center", True, boolean),
            KV("stt.frontend.mel_norm", "slaney", string), KV("stt.frontend.chunk_length", chunk, u32),
            KV("stt.frontend.n_samples", n_samples, u32),
            KV("stt.frontend.nb_max_frames", int(fe.get("nb_max_frames", n_samples // hop)), u32)]


def tokenizer_keys(tokens: list[str], types: list[int], merges: list[str], pre: str, ids: dict[str, int],
                   add_bos: bool) -> list[KV]:
    string, i32, u32, boolean = GGUFValueType.STRING, GGUFValueType.INT32, GGUFValueType.UINT32, GGUFValueType.BOOL
    return [KV("tokenizer.ggml.model", "gpt2", string), KV("tokenizer.ggml.pre", pre, string),
            KV("tokenizer.ggml.tokens", tokens, string, True), KV("tokenizer.ggml.token_type", types, i32, True),
            KV("tokenizer.ggml.merges", merges, string, True),
            *[KV(f"tokenizer.ggml.{role}_token_id", i, u32) for role, i in ids.items()],
            KV("tokenizer.ggml.add_bos_token", add_bos, boolean)]


# ------------------------------------------------------------------------------------------------- Qwen3-ASR
def qwen3_slots(source: Qwen3ASRSource) -> list[TensorSlot]:
    """Every model tensor, without the output head: transcribe.cpp projects with the token embedding."""
    slots = qwen3_asr_slots(source.hparams(), crispasr.NAMES)
    return renamed([slot for slot in slots if slot.name != "output.weight"])


def qwen3_tied_head(source: Qwen3ASRSource) -> list[TensorSlot]:
    """The output head the file leaves out (the loader projects with the token embedding): a float model's
    state dict lists lm_head beside the embedding it shares; a head that differs from the embedding is refused, as
    the file would lose it."""
    slot = next(s for s in qwen3_asr_slots(source.hparams(), crispasr.NAMES) if s.name == "output.weight")
    if not source.has(HF_LM_HEAD) or source.resolve(HF_LM_HEAD) == source.resolve(HF_EMBEDDING):
        return [slot]
    head, embedding = source.resolve(HF_LM_HEAD), source.resolve(HF_EMBEDDING)
    if head in source.floats and embedding in source.floats and torch.equal(source.floats[head],
                                                                              source.floats[embedding]):
        return [slot]
    raise GGUFExportError(f"{source.origin}: {HF_LM_HEAD} is not the token embedding; {TARGET}'s Qwen3-ASR projects "
                          f"with the embedding (tied), so the file would lose the head")


def qwen3_tables(source: Qwen3ASRSource) -> dict[str, np.ndarray]:
    filters = crispasr.front_end(source)[crispasr.MEL_FILTERS]
    return mel_tables(filters, int(source.feature_extractor.get("n_fft", 400)))


def qwen3_metadata(source: Qwen3ASRSource) -> list[KV]:
    h, c = source.hparams(), source.config
    audio, text = c["audio_config"], c["text_config"]
    u32, f32, string, boolean = GGUFValueType.UINT32, GGUFValueType.FLOAT32, GGUFValueType.STRING, GGUFValueType.BOOL
    t, hh, w = _mrope_sections(text, h.head_dim)
    enc = [("n_layers", h.audio_layers), ("d_model", h.audio_d_model), ("n_heads", h.audio_heads),
           ("ffn_dim", h.audio_ffn), ("num_mel_bins", h.n_mels), ("downsample_hidden", h.conv_channels),
           ("output_dim", int(audio.get("output_dim", h.text_hidden))),
           ("max_source_positions", int(audio.get("max_source_positions") or audio["max_position_embeddings"])),
           ("n_window", int(audio.get("n_window", 50))), ("n_window_infer", h.n_window_infer),
           ("conv_chunksize", int(audio.get("conv_chunksize") or QWEN3_CONV_CHUNKSIZE))]
    dec = [("n_layers", h.text_layers), ("hidden_size", h.text_hidden), ("intermediate_size", h.text_ffn),
           ("n_heads", h.text_heads), ("n_kv_heads", h.text_kv_heads), ("head_dim", h.head_dim),
           ("rope_mrope_section_t", t), ("rope_mrope_section_h", hh), ("rope_mrope_section_w", w),
           ("max_position_embeddings", h.text_positions), ("vocab_size", h.vocab_size)]
    p = "stt.qwen3_asr"
    kv = [KV(f"{p}.encoder.{k}", v, u32) for k, v in enc] + [KV(f"{p}.decoder.{k}", v, u32) for k, v in dec]
    kv += [KV(f"{p}.encoder.activation", str(audio.get("activation_function", "gelu")).lower(), string),
           KV(f"{p}.decoder.hidden_act", str(text.get("hidden_act", "silu")).lower(), string),
           KV(f"{p}.decoder.rms_norm_eps", h.rms_norm_eps, f32), KV(f"{p}.decoder.rope_theta", h.rope_theta, f32),
           KV(f"{p}.decoder.rope_mrope_interleaved", True, boolean),
           KV(f"{p}.decoder.tie_word_embeddings", True, boolean),
           KV(f"{p}.audio_token_id", source.token_id(AUDIO_PAD_TOKEN), u32),
           KV(f"{p}.audio_start_token_id", source.token_id(AUDIO_START_TOKEN), u32),
           KV(f"{p}.audio_end_token_id", source.token_id(AUDIO_END_TOKEN), u32)]
    return kv + frontend_keys(source.feature_extractor, h.n_mels) + _qwen3_tokenizer(source)


def _mrope_sections(text: dict, head_dim: int) -> tuple[int, int, int]:
    """The (t, h, w) MRoPE split of the rotary pairs. Speech alone gives every axis the same position, so any split
    rotates as plain RoPE does; a config without one (transformers' "default" rope) is written as all-temporal."""
    rope = text.get("rope_scaling") or text.get("rope_parameters") or {}
    section = rope.get("mrope_section")
    if section and len(section) == 3 and sum(section) == head_dim // 2:
        return int(section[0]), int(section[1]), int(section[2])
    if section:
        raise GGUFExportError(f"mrope_section {section} does not split head_dim {head_dim}'s {head_dim // 2} rotary "
                              f"pairs in three")
    return head_dim // 2, 0, 0


def _qwen3_tokenizer(source: Qwen3ASRSource) -> list[KV]:
    vocab = gguf_vocab(source.tokenizer, source.hparams().vocab_size, source.origin)
    ids = {"eos": source.token_id(EOS_TOKEN), "padding": source.token_id(PAD_TOKEN)}
    kv = tokenizer_keys(vocab.tokens, vocab.types, vocab.merges, "qwen2", ids, add_bos=False)
    if source.chat_template:
        kv.append(KV("tokenizer.chat_template", source.chat_template, GGUFValueType.STRING))
    return kv


# --------------------------------------------------------------------------------------------------- Voxtral
def voxtral_slots(source: VoxtralSource) -> list[TensorSlot]:
    return renamed(crispasr_voxtral.voxtral_slots(source.hparams, source.output_name))


def voxtral_tables(source: VoxtralSource) -> dict[str, np.ndarray]:
    filters = crispasr_voxtral.front_end(source)[crispasr_voxtral.MEL_FILTERS]
    return mel_tables(filters, int(source.feature_extractor.get("n_fft", 400)))


def voxtral_metadata(source: VoxtralSource) -> list[KV]:
    h, c = source.hparams, source.config
    u32, f32, string, boolean = GGUFValueType.UINT32, GGUFValueType.FLOAT32, GGUFValueType.STRING, GGUFValueType.BOOL
    audio, text = c["audio_config"], c["text_config"]
    enc = [("n_layers", h.audio_layers), ("d_model", h.audio_d_model), ("n_heads", h.audio_heads),
           ("head_dim", h.audio_d_model // h.audio_heads), ("ffn_dim", h.audio_ffn), ("num_mel_bins", h.n_mels),
           ("max_source_positions", h.audio_positions)]
    dec = [("n_layers", h.text_layers), ("hidden_size", h.text_hidden), ("intermediate_size", h.text_ffn),
           ("n_heads", h.text_heads), ("n_kv_heads", h.text_kv_heads), ("head_dim", h.head_dim),
           ("max_position_embeddings", h.text_positions), ("vocab_size", h.vocab_size)]
    p = "stt.voxtral"
    kv = [KV(f"{p}.encoder.{k}", v, u32) for k, v in enc] + [KV(f"{p}.decoder.{k}", v, u32) for k, v in dec]
    kv += [KV(f"{p}.encoder.activation", str(audio.get("activation_function", "gelu")).lower(), string),
           KV(f"{p}.projector.downsample_factor", VOXTRAL_FRAME_STACK, u32),
           KV(f"{p}.projector.input_dim", VOXTRAL_FRAME_STACK * h.audio_d_model, u32),
           KV(f"{p}.projector.hidden_act", str(c.get("projector_hidden_act", "gelu")).lower(), string),
           KV(f"{p}.decoder.hidden_act", str(text.get("hidden_act", "silu")).lower(), string),
           KV(f"{p}.decoder.rms_norm_eps", h.rms_norm_eps, f32), KV(f"{p}.decoder.rope_theta", h.rope_theta, f32),
           KV(f"{p}.decoder.tie_word_embeddings", h.tied, boolean),
           KV(f"{p}.audio_token_id", h.audio_token_id, u32)]
    return kv + frontend_keys(source.feature_extractor, h.n_mels) + _voxtral_tokenizer(source)


def _voxtral_tokenizer(source: VoxtralSource) -> list[KV]:
    vocab = source.vocab
    tokens = vocab.specials + [_byte_level(piece) for piece in vocab.pieces]
    if len(tokens) != source.hparams.vocab_size:
        raise GGUFExportError(f"{source.origin}: the Tekken tokenizer has {len(tokens)} ids, the decoder's "
                              f"vocab_size is {source.hparams.vocab_size} ({TARGET} needs them equal)")
    types = [TOKEN_CONTROL] * len(vocab.specials) + [TOKEN_NORMAL] * len(vocab.pieces)
    ids = {role: _special_id(vocab, token, source.origin)
           for role, token in (("bos", "<s>"), ("eos", "</s>"), ("unknown", "<unk>"))}
    ids["padding"] = vocab.specials.index("<pad>") if "<pad>" in vocab.specials else ids["eos"]
    return tokenizer_keys(tokens, types, tekken_merges(vocab), "tekken", ids, add_bos=True)


def _special_id(vocab: TekkenVocab, token: str, origin: str) -> int:
    if token not in vocab.specials:
        raise GGUFExportError(f"{origin}: the Tekken tokenizer has no {token} ({TARGET}'s Voxtral prompt needs it)")
    return vocab.specials.index(token)


def _byte_level(piece: bytes) -> str:
    """GPT-2's byte-level spelling of ``piece`` (the alphabet tokenizer.ggml.tokens of a "gpt2" model uses)."""
    table = _byte_to_unicode()
    return "".join(table[b] for b in piece)


@functools.lru_cache(maxsize=1)
def _byte_to_unicode() -> dict[int, str]:
    return {b: c for c, b in crispasr_voxtral._unicode_to_byte().items()}


def tekken_merges(vocab: TekkenVocab) -> list[str]:
    """Byte-level BPE merges equivalent to Tekken's ranks: for each multi-byte piece, by rank, every split of it
    into two known pieces (lower-ranked halves first). Tekken merges the adjacent pair whose concatenation has the
    lowest rank; a merge table ordered by that rank makes the same choice."""
    rank = {piece: r for r, piece in enumerate(vocab.pieces)}
    merges = []
    for piece in vocab.pieces:
        splits = [(piece[:j], piece[j:]) for j in range(1, len(piece)) if piece[:j] in rank and piece[j:] in rank]
        for left, right in sorted(splits, key=lambda s: (rank[s[0]], rank[s[1]])):
            merges.append(f"{_byte_level(left)} {_byte_level(right)}")
    return merges


# ------------------------------------------------------------------------------------------- the two flavours
@dataclass(frozen=True)
class Family:
    """One model family as transcribe.cpp loads it: how to read a source, its tensors, tables and keys."""

    arch: str
    name: str  # how messages name the family
    source: Callable[[Any], ModelTensors]  # a checkpoint directory / LatticeCheckpoint -> source
    float_source: Callable[[str], ModelTensors]  # a float transformers directory -> source
    slots: Callable[[Any], list[TensorSlot]]
    tables: Callable[[Any], dict[str, np.ndarray]]
    metadata: Callable[[Any], list[KV]]
    structural_keys: tuple[str, ...]  # keys verify compares with the checkpoint's
    size_keys: tuple[str, str, str, str]  # audio layers, audio d_model, text layers, text hidden
    # source tensors the file deliberately leaves out (refusing when it cannot), so none counts as left over
    unwritten: Callable[[Any], list[TensorSlot]] = lambda source: []


def _keys(prefix: str, encoder: tuple[str, ...], decoder: tuple[str, ...]) -> tuple[str, ...]:
    return (*(f"{prefix}.encoder.{k}" for k in encoder), *(f"{prefix}.decoder.{k}" for k in decoder),
            f"{prefix}.audio_token_id", "stt.frontend.num_mels", "tokenizer.ggml.tokens", "tokenizer.ggml.token_type")


QWEN3_ASR = Family(
    QWEN3_ASR_ARCH, "Qwen3-ASR", qwen3_as_source, qwen3_float_source, qwen3_slots, qwen3_tables, qwen3_metadata,
    _keys("stt.qwen3_asr", ("n_layers", "d_model", "n_heads", "ffn_dim", "num_mel_bins", "downsample_hidden"),
          ("n_layers", "hidden_size", "intermediate_size", "n_heads", "n_kv_heads", "head_dim", "vocab_size")),
    ("stt.qwen3_asr.encoder.n_layers", "stt.qwen3_asr.encoder.d_model", "stt.qwen3_asr.decoder.n_layers",
     "stt.qwen3_asr.decoder.hidden_size"), qwen3_tied_head)
VOXTRAL = Family(
    VOXTRAL_ARCH, "Voxtral", crispasr_voxtral.as_source, crispasr_voxtral.float_model_source, voxtral_slots,
    voxtral_tables, voxtral_metadata,
    _keys("stt.voxtral", ("n_layers", "d_model", "n_heads", "ffn_dim", "num_mel_bins", "max_source_positions"),
          ("n_layers", "hidden_size", "intermediate_size", "n_heads", "n_kv_heads", "head_dim", "vocab_size")),
    ("stt.voxtral.encoder.n_layers", "stt.voxtral.encoder.d_model", "stt.voxtral.decoder.n_layers",
     "stt.voxtral.decoder.hidden_size"))
FAMILIES = {QWEN3_ASR_ARCH: QWEN3_ASR, VOXTRAL_ARCH: VOXTRAL}
MODEL_TYPES = {"qwen3_asr": QWEN3_ASR, "voxtral": VOXTRAL}  # transformers model_type -> family


def is_transcribe_voxtral(model: GGUFFile) -> bool:
    return model.arch == VOXTRAL_ARCH and VOXTRAL_KEY in model.kv


def family_of_file(model: GGUFFile) -> Family | None:
    """The family of a transcribe.cpp Qwen3-ASR / Voxtral file, None for any other GGUF."""
    if model.arch == QWEN3_ASR_ARCH or is_transcribe_voxtral(model):
        return FAMILIES[model.arch]
    return None


# ------------------------------------------------------------------------------------------------ build, write
def build(family: Family, source: Any) -> GGUFModel:
    """Every tensor packed and every key computed; raises naming the tensor (a type the loader rejects, a shape,
    a missing or extra tensor) before anything is written."""
    slots = family.slots(source)
    check_nothing_left_over(source, slots + family.unwritten(source), TARGET)
    check_loader_types(source, slots)
    check_fused_pairs(source, slots)
    rounding = F16Rounding(source.origin)
    tables = [PackedTensor(name, GGMLType.F32, values.shape, values) for name, values in family.tables(source).items()]
    tensors = tables + [pack_slot(slot, source, rounding) for slot in slots]
    rounding.report()
    kv = file_kv(f"{family.name} (tarq-deploy)", main_file_type(tensors)) + family.metadata(source)
    return GGUFModel(family.arch, kv, tensors)


def check_fused_pairs(source: ModelTensors, slots: list[TensorSlot]) -> None:
    """The loader fuses each layer's gate and up projections into one matrix: both must be of one type."""
    by_name = {slot.name: slot for slot in slots if slot.role == ROLE_MATRIX}
    for name, gate in by_name.items():
        if name.endswith(".ffn.gate.weight"):
            up = by_name[name.replace(".ffn.gate.", ".ffn.up.")]
            gate_type, up_type = matrix_type(source, gate), matrix_type(source, up)
            if gate_type != up_type:
                raise GGUFExportError(f"{source.origin}: {gate.hf_name} is {GGML_TYPE_NAMES[gate_type].lower()} but "
                                      f"{up.hf_name} is {GGML_TYPE_NAMES[up_type].lower()}; {TARGET} fuses a layer's "
                                      f"gate and up projections, so they need one type (quantize both alike)")


def export_transcribe_llm(family: Family, checkpoint: str | None, model: str | None, weight_type: str | None,
                          out_path: str | os.PathLike) -> tuple[Path, str]:
    """The export command for a Qwen3-ASR or Voxtral source: a lattice checkpoint (each matrix in its own type) or a
    float transformers directory (F16)."""
    check_export_options(checkpoint, model, weight_type)
    source = family.source(checkpoint) if checkpoint is not None else family.source(family.float_source(model))
    built = build(family, source)
    out = write_gguf(built, out_path)
    types = sorted({GGML_TYPE_NAMES[t.ggml_type] for t in built.tensors})
    return out, f"{TARGET} {family.name} GGUF ({'/'.join(types)}), {len(built.tensors)} tensors, " \
                f"{out.stat().st_size / 1e6:.1f} MB"


# ------------------------------------------------------------------------------------------------------- verify
def verify(model_file: str | os.PathLike, checkpoint: str | os.PathLike | LatticeCheckpoint) -> dict[str, float]:
    """Decode every array of a transcribe.cpp Qwen3-ASR / Voxtral GGUF and compare it with the checkpoint's exact
    values: the front-end tables, then every tensor; the keys that fix the model's structure must agree too."""
    model = read_gguf(model_file)
    family = family_of_file(model)
    if family is None:
        raise GGUFVerifyError(f"{model_file}: architecture {model.arch!r}, not a {TARGET} Qwen3-ASR or Voxtral file")
    ckpt, origin = as_checkpoint(checkpoint)
    source = family.source(ckpt)
    source.origin = origin
    check_metadata(model, family.metadata(source), family.structural_keys, origin)
    diffs = {name: front_end_table_diff(model, name, values) for name, values in family.tables(source).items()}
    diffs.update(compare_tensors(model, family.slots(source), CheckpointValues(ckpt), origin, GGUFVerifyError))
    return diffs


def describe(model: GGUFFile) -> tuple[str, dict]:
    """(backbone name, details) of a transcribe.cpp Qwen3-ASR / Voxtral file (GGUFFileError when keys are
    missing): named by its dimensions."""
    family = family_of_file(model)
    if family is None:
        raise GGUFVerifyError(f"{model.path}: not a {TARGET} Qwen3-ASR or Voxtral file")
    dims = tuple(model.integer(key) for key in family.size_keys)
    name = f"{family.arch.replace('_', '-')}-a{dims[0]}x{dims[1]}-t{dims[2]}x{dims[3]}"
    return name, {"arch": family.arch, "audio_layers": dims[0], "audio_d_model": dims[1], "text_layers": dims[2],
                  "text_hidden": dims[3]}
