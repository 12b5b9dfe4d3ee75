"""Export Qwen3-ASR to CrispASR's GGUF (PyPI ``crispasr``, a ggml runtime; arch "qwen3asr"): a lattice checkpoint
bit-exactly (the blocks of the lattice's ggml type: Q4_0 ... Q6_K), or a float model as F16.

Layout (CrispASR's qwen3-asr backend; its models/convert-qwen3-asr-to-gguf.py writes the same):
* audio tower under ``audio.``: ``conv.{1,2,3}.{weight,bias}`` (Conv2d kernels F16, biases F32), ``conv_out.weight``,
  ``blk.{i}.{attn_q,attn_k,attn_v,attn_out,ffn_up,ffn_down}.{weight,bias}``, ``blk.{i}.{attn_norm,ffn_norm}.*``,
  ``ln_post.*``, the projector as ``proj1.*`` / ``proj2.*``;
* the front end the runtime computes mel spectrograms with: ``audio.mel_filters`` (F32, numpy [201, 128]: the
  feature extractor's Slaney filters, frequency-major) and ``audio.mel_window`` (F32 [400]: the periodic Hann window
  torch.stft uses), so CrispASR's features follow transformers' Qwen3ASRFeatureExtractor;
* the Qwen3 decoder under llama.cpp names (``token_embd``, ``blk.{i}.*``, ``output_norm``, ``output`` -- written for a
  tied model too, the same lattice as ``token_embd``);
* metadata ``qwen3asr.{sample_rate, n_mels, n_fft, win_length, hop_length}``, ``qwen3asr.audio.{n_layers, d_model,
  n_heads, head_dim, ff_dim, conv_channels, proj_dim, max_source_pos}``, ``qwen3asr.llm.{n_layers, d_model, n_heads,
  n_kv_heads, head_dim, ff_dim, rope_theta, rms_norm_eps, vocab_size, max_pos}``, ``qwen3asr.{audio_start, audio_end,
  audio_pad, eos, pad}_token_id``, and the tokenizer (``tokenizer.ggml.*``: CrispASR tokenizes its ChatML prompt with
  the file's vocabulary and merges, so the special tokens must be there under their names).
"""
from __future__ import annotations

import numpy as np
import torch
from gguf.constants import GGUFValueType

from .gguf_file import KV, GGUFExportError
from .qwen3_asr_gguf import (front_end_and_llm_keys, AUDIO_END_TOKEN, AUDIO_PAD_TOKEN, AUDIO_START_TOKEN, EOS_TOKEN, PAD_TOKEN,
                             Qwen3ASRFlavour, Qwen3ASRHParams, Qwen3ASRNames, Qwen3ASRSource, gguf_vocab, vocab_kv)

__all__ = ["SIZE_KEYS"]

ARCH = "qwen3asr"
TARGET = "crispasr"
MODEL_NAME = "Qwen3-ASR"
NAMES = Qwen3ASRNames(conv="audio.conv.{i}", conv_out="audio.conv_out", audio_block="audio.blk.{i}",
                      ln_post="audio.ln_post", proj="audio.proj{i}")
MEL_FILTERS, MEL_WINDOW = "audio.mel_filters", "audio.mel_window"
AUDIO_MAX_SOURCE_POSITIONS = 1500  # what CrispASR's converter writes (transformers' config has no such entry)
NOT_FEATURE_EXTRACTOR_ARGUMENTS = ("feature_extractor_type", "processor_class")
STRUCTURAL_KEYS = (
    f"{ARCH}.n_mels", f"{ARCH}.n_fft", f"{ARCH}.hop_length", f"{ARCH}.audio.n_layers", f"{ARCH}.audio.d_model",
    f"{ARCH}.audio.n_heads", f"{ARCH}.audio.ff_dim", f"{ARCH}.audio.conv_channels", f"{ARCH}.audio.proj_dim",
    f"{ARCH}.llm.n_layers", f"{ARCH}.llm.d_model", f"{ARCH}.llm.n_heads", f"{ARCH}.llm.n_kv_heads",
    f"{ARCH}.llm.head_dim", f"{ARCH}.llm.ff_dim", f"{ARCH}.llm.vocab_size", f"{ARCH}.audio_pad_token_id",
    "tokenizer.ggml.tokens", "tokenizer.ggml.merges",
)
# the keys of the dimensions that name a model size: audio layers, audio d_model, text layers, text hidden
SIZE_KEYS = (f"{ARCH}.audio.n_layers", f"{ARCH}.audio.d_model", f"{ARCH}.llm.n_layers", f"{ARCH}.llm.d_model")


def front_end(source: Qwen3ASRSource) -> dict[str, np.ndarray]:
    """The mel filters [201, n_mels] and analysis window [n_fft] of the model's own feature extractor (float32)."""
    from transformers import Qwen3ASRFeatureExtractor

    kwargs = {k: v for k, v in source.feature_extractor.items() if k not in NOT_FEATURE_EXTRACTOR_ARGUMENTS}
    extractor = Qwen3ASRFeatureExtractor(**kwargs)
    filters = np.ascontiguousarray(extractor.mel_filters, dtype=np.float32)
    window = torch.hann_window(extractor.n_fft).numpy().astype(np.float32)  # what torch.stft is given
    if filters.shape != (extractor.n_fft // 2 + 1, source.hparams().n_mels):
        raise GGUFExportError(f"{source.origin}: mel filters {filters.shape} do not fit {extractor.n_fft} FFT points "
                              f"and {source.hparams().n_mels} mel bins")
    return {MEL_FILTERS: filters, MEL_WINDOW: window}


def model_metadata(h: Qwen3ASRHParams, source: Qwen3ASRSource) -> list[KV]:
    """Every key but the file-type ones: front end, audio and LLM dimensions, token ids, the vocabulary."""
    u32 = GGUFValueType.UINT32
    front, llm = front_end_and_llm_keys(source.feature_extractor, h.n_mels,
                                        (h.audio_layers, h.audio_d_model, h.audio_heads, h.audio_ffn), h)
    values = [
        *front, ("audio.conv_channels", h.conv_channels, u32),
        ("audio.proj_dim", h.text_hidden, u32), ("audio.max_source_pos", AUDIO_MAX_SOURCE_POSITIONS, u32), *llm,
        ("audio_start_token_id", source.token_id(AUDIO_START_TOKEN), u32),
        ("audio_end_token_id", source.token_id(AUDIO_END_TOKEN), u32),
        ("audio_pad_token_id", source.token_id(AUDIO_PAD_TOKEN), u32),
        ("eos_token_id", source.token_id(EOS_TOKEN), u32), ("pad_token_id", source.token_id(PAD_TOKEN), u32),
    ]
    vocab = gguf_vocab(source.tokenizer, h.vocab_size, source.origin)
    return ([KV(f"{ARCH}.{k}", v, t) for k, v, t in values]
            + vocab_kv(vocab, source.token_id(EOS_TOKEN), source.token_id(PAD_TOKEN), source.chat_template))


FLAVOUR = Qwen3ASRFlavour(target=TARGET, arch=ARCH, file_kind="CrispASR Qwen3-ASR", model_name=MODEL_NAME, names=NAMES,
                          metadata=model_metadata, structural_keys=STRUCTURAL_KEYS, size_keys=SIZE_KEYS,
                          tables=front_end)
build_crispasr = FLAVOUR.build
export_crispasr = FLAVOUR.export
verify = FLAVOUR.verify  # also compares the mel filters and window with the feature extractor's
