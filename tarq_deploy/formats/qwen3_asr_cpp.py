"""Export Qwen3-ASR to upstream qwen3-asr.cpp's GGUF (predict-woo/qwen3-asr.cpp, arch "qwen3-asr"): a lattice
checkpoint bit-exactly (Q4_0 / Q8_0 blocks), or a float model as F16.

Layout (what the upstream converter scripts/convert_hf_to_gguf.py writes and its C++ loads):
* audio tower under ``audio.encoder.``: ``conv{1,2,3}.{weight,bias}`` (Conv2d kernels F16, biases F32),
  ``conv_out.weight`` (no bias), ``blk.{i}.{attn_q,attn_k,attn_v,attn_out,ffn_up,ffn_down}.{weight,bias}``,
  ``blk.{i}.{attn_norm,ffn_norm}.{weight,bias}``, ``ln_post.*``, and the projector as ``proj1.*`` / ``proj2.*``
  (transformers' ``model.multi_modal_projector.linear_1/2``);
* the Qwen3 decoder under llama.cpp names: ``token_embd.weight``, ``blk.{i}.{attn_norm, attn_q, attn_k, attn_v,
  attn_output, attn_q_norm, attn_k_norm, ffn_norm, ffn_gate, ffn_up, ffn_down}.weight``, ``output_norm.weight`` and
  ``output.weight`` -- written for a tied model too (the same lattice as ``token_embd``), as the runtime reads both.
* metadata: the keys the upstream converter writes (``qwen3-asr.block_count``, ``qwen3-asr.embedding_length``, ...,
  ``qwen3-asr.audio.encoder.layer_count``, ...) AND the keys upstream's audio-encoder loader actually reads
  (``audio.encoder_layers``, ``audio.d_model``, ``audio.attention_heads``, ``audio.ffn_dim``, ``audio.conv_channels``,
  ``audio.conv_out_dim``, ``audio.num_mel_bins``, ``audio.n_window_infer``, ``audio.layer_norm_eps``,
  ``text.hidden_size``, ...): an unpatched loader reads only the latter and otherwise falls back to 0.6B defaults.
  Tokenizer: the model's own byte-level BPE (``tokenizer.ggml.*``, gpt2 / qwen2), one entry per id up to the
  model's vocabulary size (ids the tokenizer leaves empty are written "[PADid]", as upstream does).

Upstream's loaders build each tensor's shape from hyper-parameters and name patterns instead of the file; with the
loader patch (third_party/qwen3-asr.cpp) they take it from the file and check sizes. Either way this file is right.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from gguf.constants import GGUFValueType

from tarq_deploy.checkpoint import LatticeCheckpoint

from .ggml_tensors import CheckpointValues, as_checkpoint, compare_tensors
from .gguf_file import KV, GGUFModel, GGUFVerifyError, check_metadata, file_kv, read_gguf, write_gguf
from .qwen3_asr_gguf import (AUDIO_END_TOKEN, AUDIO_PAD_TOKEN, AUDIO_START_TOKEN, EOS_TOKEN, PAD_TOKEN,
                             Qwen3ASRHParams, Qwen3ASRNames, Qwen3ASRSource, as_source, check_nothing_left_over,
                             checkpoint_source, default_target, gguf_vocab, pack_tensors, qwen3_asr_slots, vocab_kv,
                             weight_type_of)

ARCH = "qwen3-asr"
TARGET = "qwen3-asr.cpp"
MODEL_NAME = "Qwen3-ASR"
NAMES = Qwen3ASRNames(conv="audio.encoder.conv{i}", conv_out="audio.encoder.conv_out",
                      audio_block="audio.encoder.blk.{i}", ln_post="audio.encoder.ln_post",
                      proj="audio.encoder.proj{i}")
AUDIO_LAYER_NORM_EPS = 1e-5  # transformers' nn.LayerNorm default, which Qwen3-ASR's encoder uses
# Keys that pin the model's structure: verify compares them with what this exporter writes for the checkpoint.
STRUCTURAL_KEYS = (
    f"{ARCH}.block_count", f"{ARCH}.embedding_length", f"{ARCH}.feed_forward_length", f"{ARCH}.attention.head_count",
    f"{ARCH}.attention.head_count_kv", f"{ARCH}.attention.key_length", f"{ARCH}.vocab_size",
    f"{ARCH}.audio.encoder.layer_count", f"{ARCH}.audio.encoder.embedding_length",
    f"{ARCH}.audio.encoder.attention.head_count", f"{ARCH}.audio.encoder.feed_forward_length",
    f"{ARCH}.audio.conv_channels", "audio.d_model", "audio.encoder_layers", "text.hidden_size",
    "tokenizer.ggml.tokens", "tokenizer.ggml.merges",
)
# the keys of the dimensions that name a model size: audio layers, audio d_model, text layers, text hidden
SIZE_KEYS = (f"{ARCH}.audio.encoder.layer_count", f"{ARCH}.audio.encoder.embedding_length", f"{ARCH}.block_count",
             f"{ARCH}.embedding_length")


def model_metadata(h: Qwen3ASRHParams, source: Qwen3ASRSource) -> list[KV]:
    """Every key but the file-type ones: dimensions for both of upstream's loaders, token ids, the vocabulary."""
    u32, f32 = GGUFValueType.UINT32, GGUFValueType.FLOAT32
    text = [  # the upstream converter's keys; upstream's text decoder reads these
        ("block_count", h.text_layers, u32), ("embedding_length", h.text_hidden, u32),
        ("feed_forward_length", h.text_ffn, u32), ("attention.head_count", h.text_heads, u32),
        ("attention.head_count_kv", h.text_kv_heads, u32), ("attention.key_length", h.head_dim, u32),
        ("attention.value_length", h.head_dim, u32), ("rope.freq_base", h.rope_theta, f32),
        ("attention.layer_norm_rms_epsilon", h.rms_norm_eps, f32), ("vocab_size", h.vocab_size, u32),
        ("context_length", h.text_positions, u32),
        ("audio.encoder.layer_count", h.audio_layers, u32), ("audio.encoder.embedding_length", h.audio_d_model, u32),
        ("audio.encoder.attention.head_count", h.audio_heads, u32),
        ("audio.encoder.feed_forward_length", h.audio_ffn, u32), ("audio.num_mel_bins", h.n_mels, u32),
        ("audio.conv_channels", h.conv_channels, u32),
        ("audio.start_token_id", source.token_id(AUDIO_START_TOKEN), u32),
        ("audio.end_token_id", source.token_id(AUDIO_END_TOKEN), u32),
        ("audio.pad_token_id", source.token_id(AUDIO_PAD_TOKEN), u32),
    ]
    loader = [  # the keys upstream's audio-encoder loader (src/gguf_loader.cpp) reads, without the arch prefix
        ("audio.encoder_layers", h.audio_layers, u32), ("audio.d_model", h.audio_d_model, u32),
        ("audio.attention_heads", h.audio_heads, u32), ("audio.ffn_dim", h.audio_ffn, u32),
        ("audio.conv_channels", h.conv_channels, u32), ("audio.conv_out_dim", h.audio_d_model, u32),
        ("audio.num_mel_bins", h.n_mels, u32), ("audio.n_window_infer", h.n_window_infer, u32),
        ("audio.layer_norm_eps", AUDIO_LAYER_NORM_EPS, f32), ("text.hidden_size", h.text_hidden, u32),
        ("text.decoder_layers", h.text_layers, u32), ("text.attention_heads", h.text_heads, u32),
        ("text.num_key_value_heads", h.text_kv_heads, u32), ("text.intermediate_size", h.text_ffn, u32),
        ("text.rms_norm_eps", h.rms_norm_eps, f32),
    ]
    vocab = gguf_vocab(source.tokenizer, h.vocab_size, source.origin)
    return ([KV(f"{ARCH}.{k}", v, t) for k, v, t in text] + [KV(k, v, t) for k, v, t in loader]
            + vocab_kv(vocab, source.token_id(EOS_TOKEN), source.token_id(PAD_TOKEN), source.chat_template))


def build_qwen3_asr_cpp(source: Any, target: str | None = None) -> GGUFModel:
    """Pack every tensor for ``target`` (q4_0 | q8_0 | f16; default: the lattice's type, f16 for a float model)."""
    source = as_source(source)
    h = source.hparams()
    weight_type = weight_type_of(target or default_target(source))
    slots = qwen3_asr_slots(h, NAMES)
    check_nothing_left_over(source, slots, TARGET)
    kv = file_kv(MODEL_NAME, weight_type) + model_metadata(h, source)
    return GGUFModel(ARCH, kv, pack_tensors(slots, source, weight_type))


def export_qwen3_asr_cpp(source: Any, out_path: str | os.PathLike, target: str | None = None) -> Path:
    """Export a LatticeCheckpoint, a checkpoint directory or (model, processor) to ``out_path``; returns the path."""
    return write_gguf(build_qwen3_asr_cpp(source, target), out_path)


def verify(model_file: str | os.PathLike, checkpoint: str | os.PathLike | LatticeCheckpoint) -> dict[str, float]:
    """Decode every tensor of ``model_file`` with gguf-py and compare it with the checkpoint's exact values (s * q
    for lattice weights, the stored tensors otherwise); max |diff| per tensor, 0.0 everywhere for an exact export."""
    model = read_gguf(model_file)
    if model.arch != ARCH:
        raise GGUFVerifyError(f"{model_file}: architecture {model.arch!r}, not a qwen3-asr.cpp file ({ARCH!r})")
    ckpt, origin = as_checkpoint(checkpoint)
    source = checkpoint_source(ckpt, origin=origin)
    h = source.hparams()
    check_metadata(model, model_metadata(h, source), STRUCTURAL_KEYS, origin)
    return compare_tensors(model, qwen3_asr_slots(h, NAMES), CheckpointValues(ckpt), origin)

