"""Export Qwen3-ASR to upstream qwen3-asr.cpp's GGUF (predict-woo/qwen3-asr.cpp, arch "qwen3-asr"): a lattice
checkpoint bit-exactly (the blocks of its lattice's ggml type), or a float model as F16.

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

from gguf.constants import GGUFValueType

from .gguf_file import KV
from .qwen3_asr_gguf import (AUDIO_END_TOKEN, AUDIO_PAD_TOKEN, AUDIO_START_TOKEN, EOS_TOKEN, PAD_TOKEN,
                             Qwen3ASRFlavour, Qwen3ASRHParams, Qwen3ASRNames, Qwen3ASRSource, gguf_vocab, vocab_kv)

__all__ = ["build_qwen3_asr_cpp", "export_qwen3_asr_cpp", "verify"]

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


FLAVOUR = Qwen3ASRFlavour(target=TARGET, arch=ARCH, file_kind=TARGET, model_name=MODEL_NAME, names=NAMES,
                          metadata=model_metadata, structural_keys=STRUCTURAL_KEYS, size_keys=SIZE_KEYS)
build_qwen3_asr_cpp = FLAVOUR.build
export_qwen3_asr_cpp = FLAVOUR.export
verify = FLAVOUR.verify
