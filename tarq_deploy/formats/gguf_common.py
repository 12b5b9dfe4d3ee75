"""What the GGUF exporters share: the Qwen3-ASR source as exporters see it, the tensor table both runtimes use (under
their own names), packing, the tokenizer arrays, an atomic writer, a strict fast reader and the exactness check.

A GGUF file (v3, little-endian): "GGUF", uint32 version, uint64 tensor count, uint64 key/value count; key/values
(string key, uint32 value type, value; arrays: uint32 element type, uint64 count, elements; strings: uint64 length,
bytes); tensor infos (name, uint32 n_dims, uint64 ne[n_dims] with ne[0] the row length, uint32 ggml type, uint64
offset into the data section); padding to ``general.alignment`` (default 32); the data section. Writing goes through
gguf-py's GGUFWriter; reading uses our parser (gguf-py's GGUFReader needs ~10 s for a 151936-token vocabulary) and
gguf-py's reference decoders (gguf.quants.dequantize) for the tensor values.

Tensor roles decide the stored type: weight matrices take the file's weight type (Q4_0 / Q8_0 blocks straight from
the lattice, see tarq_deploy/formats/ggml_blocks.py; F16 in an F16 file or for a matrix the checkpoint kept in 16 bits), Conv2d
kernels are F16 (what ggml convolutions take), norms, biases and the mel front-end tables F32. Computing and I/O are
separate: ``pack_tensors`` builds every tensor in memory (refusing what the target cannot hold before a byte is
written); ``write_gguf`` only writes, to a temporary name renamed when complete.
"""
from __future__ import annotations

import functools
import json
import logging
import mmap
import os
import secrets
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

import numpy as np
import torch

from tarq_deploy.checkpoint import LatticeCheckpoint, load_checkpoint
from tarq_deploy.quant.lattice import QuantizedWeight

from .model_files import ModelFilesError, ModelTensors, feature_extractor_config, json_file
from .f16_rounding import F16Rounding
from .ggml_blocks import (GGML_BLOCK, GGML_TYPE_F16, GGML_TYPE_F32, GGML_TYPE_NAMES, GGML_TYPE_Q4_0, GGML_TYPE_Q8_0,
                          LatticeNotRepresentable, pack_lattice, tensor_nbytes)

log = logging.getLogger(__name__)

GGUF_MAGIC = b"GGUF"
GGUF_VERSION = 3
GGUF_DEFAULT_ALIGNMENT = 32
TARGET_TYPES = {"f16": GGML_TYPE_F16, "q8_0": GGML_TYPE_Q8_0, "q4_0": GGML_TYPE_Q4_0}
QUANTIZED_TYPES = (GGML_TYPE_Q4_0, GGML_TYPE_Q8_0)
TORCH_DTYPES = {GGML_TYPE_F32: torch.float32, GGML_TYPE_F16: torch.float16}
FILE_TYPES = {GGML_TYPE_F16: 1, GGML_TYPE_Q4_0: 2, GGML_TYPE_Q8_0: 7}  # llama_ftype: MOSTLY_F16 / _Q4_0 / _Q8_0
QUANTIZATION_VERSION = 2
# tensor roles: which type the tensor is stored in
ROLE_MATRIX = "matrix"  # the file's weight type (lattice blocks), F16 for 16-bit matrices
ROLE_CONV = "conv"  # F16
ROLE_F32 = "f32"  # norms, biases, filters, windows

# GGUF value types (gguf.h enum gguf_type)
GGUF_UINT8, GGUF_INT8, GGUF_UINT16, GGUF_INT16, GGUF_UINT32, GGUF_INT32, GGUF_FLOAT32, GGUF_BOOL = range(8)
GGUF_STRING, GGUF_ARRAY, GGUF_UINT64, GGUF_INT64, GGUF_FLOAT64 = range(8, 13)
_SCALAR_FORMATS = {GGUF_UINT8: "<B", GGUF_INT8: "<b", GGUF_UINT16: "<H", GGUF_INT16: "<h", GGUF_UINT32: "<I",
                   GGUF_INT32: "<i", GGUF_FLOAT32: "<f", GGUF_BOOL: "<?", GGUF_UINT64: "<Q", GGUF_INT64: "<q",
                   GGUF_FLOAT64: "<d"}
MAX_DIMS = 4
MAX_STRING_BYTES = 1 << 24

# tokenizer.ggml.token_type values (llama.cpp llama_token_type)
TOKEN_NORMAL, TOKEN_CONTROL, TOKEN_USER_DEFINED, TOKEN_UNUSED = 1, 3, 4, 5
UNUSED_TOKEN = "[PAD{}]"  # name of an id the tokenizer leaves empty (as the upstream converters write it)

# ---------------------------------------------------------------------------------- Qwen3-ASR, one place for names
# Special tokens the runtimes look for (token strings of the Qwen tokenizer).
AUDIO_START_TOKEN, AUDIO_END_TOKEN, AUDIO_PAD_TOKEN = "<|audio_start|>", "<|audio_end|>", "<|audio_pad|>"
EOS_TOKEN, PAD_TOKEN = "<|im_end|>", "<|endoftext|>"
TOKENIZER_MODEL, TOKENIZER_PRE = "gpt2", "qwen2"
# transformers state-dict names
HF_AUDIO = "model.audio_tower"
HF_TEXT = "model.language_model"
HF_PROJECTOR = "model.multi_modal_projector"
HF_EMBEDDING = f"{HF_TEXT}.embed_tokens.weight"
HF_LM_HEAD = "lm_head.weight"
# audio encoder layer parts: runtime suffix -> transformers suffix (both runtimes use these suffixes)
AUDIO_LAYER_PARTS = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_out": "self_attn.out_proj", "attn_norm": "self_attn_layer_norm", "ffn_norm": "final_layer_norm",
    "ffn_up": "fc1", "ffn_down": "fc2",
}
# text decoder layer parts: runtime suffix -> transformers suffix (llama.cpp names, both runtimes)
TEXT_LAYER_PARTS = {
    "attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm", "ffn_norm": "post_attention_layernorm", "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}


class GGUFExportError(ModelFilesError):
    """The source cannot be exported as asked; the message says what and why."""


class GGUFFileError(ValueError):
    """A file that is not the GGUF it should be; the message names the file and the problem."""

    def __init__(self, path: str | os.PathLike, problem: str) -> None:
        super().__init__(f"{path}: {problem}")
        self.path, self.problem = str(path), problem


class GGUFVerifyError(ValueError):
    """The GGUF file does not belong to the checkpoint it is verified against (metadata, vocabulary or layout)."""


# ---------------------------------------------------------------------------------------------------- hparams
@dataclass(frozen=True)
class Qwen3ASRHParams:
    """The dimensions both runtimes need, read from a transformers Qwen3-ASR config."""

    n_mels: int
    audio_layers: int
    audio_d_model: int
    audio_heads: int
    audio_ffn: int
    conv_channels: int
    n_window_infer: int
    text_layers: int
    text_hidden: int
    text_heads: int
    text_kv_heads: int
    head_dim: int
    text_ffn: int
    vocab_size: int
    text_positions: int
    rope_theta: float
    rms_norm_eps: float

    @classmethod
    def from_config(cls, config: dict, origin: str) -> "Qwen3ASRHParams":
        try:
            audio, text = config["audio_config"], config["text_config"]
            rope = text.get("rope_parameters") or {}
            return cls(
                n_mels=audio["num_mel_bins"], audio_layers=audio["encoder_layers"], audio_d_model=audio["d_model"],
                audio_heads=audio["encoder_attention_heads"], audio_ffn=audio["encoder_ffn_dim"],
                conv_channels=audio["downsample_hidden_size"], n_window_infer=audio.get("n_window_infer", 800),
                text_layers=text["num_hidden_layers"],
                text_hidden=text["hidden_size"], text_heads=text["num_attention_heads"],
                text_kv_heads=text["num_key_value_heads"],
                head_dim=text.get("head_dim") or text["hidden_size"] // text["num_attention_heads"],
                text_ffn=text["intermediate_size"], vocab_size=text["vocab_size"],
                text_positions=text.get("max_position_embeddings", 65536),
                rope_theta=float(rope.get("rope_theta", text.get("rope_theta", 1e6))),
                rms_norm_eps=float(text.get("rms_norm_eps", 1e-6)))
        except (KeyError, TypeError) as e:
            raise GGUFExportError(f"{origin}: config.json is not a Qwen3-ASR config (model_type 'qwen3_asr' with "
                                  f"audio_config and text_config): missing {e}") from None

    @property
    def conv_freq_bins(self) -> int:
        """Frequency bins after the three stride-2 convolutions (128 mel bins -> 16)."""
        bins = self.n_mels
        for _ in range(3):
            bins = (bins + 1) // 2
        return bins


# ------------------------------------------------------------------------------------------------------ sources
@dataclass
class Qwen3ASRSource(ModelTensors):
    """A Qwen3-ASR model as the exporters see it, whatever it was read from."""

    config: dict
    tokenizer: dict  # parsed tokenizer.json
    feature_extractor: dict
    floats: dict[str, torch.Tensor]
    lattice: dict[str, QuantizedWeight] = field(default_factory=dict)
    aliases: dict[str, str] = field(default_factory=dict)
    chat_template: str | None = None
    origin: str = "model"
    error = GGUFExportError

    def hparams(self) -> Qwen3ASRHParams:
        if self.config.get("model_type") not in (None, "qwen3_asr"):
            raise GGUFExportError(f"{self.origin}: model_type {self.config.get('model_type')!r} is not 'qwen3_asr'")
        return Qwen3ASRHParams.from_config(self.config, self.origin)

    @functools.cached_property
    def token_ids(self) -> dict[str, int]:
        return token_ids(self.tokenizer)

    def token_id(self, token: str) -> int:
        ids = self.token_ids
        if token not in ids:
            raise GGUFExportError(f"{self.origin}: the tokenizer has no {token!r} (not a Qwen3-ASR tokenizer)")
        return ids[token]


def checkpoint_source(ckpt: LatticeCheckpoint, origin: str = "checkpoint") -> Qwen3ASRSource:
    files = ckpt.model_files
    tokenizer_config = json_file(files, "tokenizer_config.json", origin) if "tokenizer_config.json" in files else {}
    return Qwen3ASRSource(json_file(files, "config.json", origin), json_file(files, "tokenizer.json", origin),
                          feature_extractor_config(files, origin), dict(ckpt.tensors), dict(ckpt.quantized),
                          dict(ckpt.aliases), _chat_template(files, tokenizer_config), origin)


def model_source(model: Any, processor: Any, origin: str = "model") -> Qwen3ASRSource:
    """A transformers Qwen3ASRForConditionalGeneration and its Qwen3ASRProcessor (a float model: F16 export)."""
    backend = getattr(processor.tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise GGUFExportError(f"{origin}: the tokenizer is not a fast (tokenizers) tokenizer")
    floats = {k: v.detach() for k, v in model.state_dict().items()}
    template = processor.chat_template if isinstance(processor.chat_template, str) else None
    return Qwen3ASRSource(json.loads(model.config.to_json_string()), json.loads(backend.to_str()),
                          processor.feature_extractor.to_dict(), floats, chat_template=template, origin=origin)


def as_source(source: Any) -> Qwen3ASRSource:
    """A source from a Qwen3ASRSource, LatticeCheckpoint, checkpoint directory or (model, processor)."""
    if isinstance(source, Qwen3ASRSource):
        return source
    if isinstance(source, LatticeCheckpoint):
        return checkpoint_source(source)
    if isinstance(source, (str, os.PathLike)):
        return checkpoint_source(load_checkpoint(source), origin=str(source))
    if isinstance(source, (tuple, list)) and len(source) == 2:
        return model_source(*source)
    raise TypeError(f"cannot export {type(source).__name__}: pass a LatticeCheckpoint, a checkpoint directory or "
                    f"(model, processor)")


def _chat_template(files: dict[str, bytes], tokenizer_config: dict) -> str | None:
    if "chat_template.jinja" in files:
        return files["chat_template.jinja"].decode("utf-8")
    template = tokenizer_config.get("chat_template")
    return template if isinstance(template, str) else None


# --------------------------------------------------------------------------------------------------- vocabulary
def token_ids(tokenizer: dict) -> dict[str, int]:
    """token string -> id over the BPE vocabulary and the added tokens of a parsed tokenizer.json."""
    ids = dict(tokenizer.get("model", {}).get("vocab", {}))
    for added in tokenizer.get("added_tokens", []):
        ids[added["content"]] = added["id"]
    return ids


@dataclass(frozen=True)
class GGUFVocab:
    tokens: list[str]  # byte-level BPE strings, one per id up to the model's vocabulary size
    types: list[int]
    merges: list[str]  # "left right", by rank


def gguf_vocab(tokenizer: dict, vocab_size: int, origin: str) -> GGUFVocab:
    """The tokenizer.ggml.* arrays for a byte-level BPE tokenizer.json, padded to ``vocab_size`` ids."""
    tokens: list[str | None] = [None] * vocab_size
    types = [TOKEN_UNUSED] * vocab_size
    for token, i in tokenizer.get("model", {}).get("vocab", {}).items():
        _place(tokens, types, i, token, TOKEN_NORMAL, origin)
    for added in tokenizer.get("added_tokens", []):
        kind = TOKEN_CONTROL if added.get("special", True) else TOKEN_USER_DEFINED
        _place(tokens, types, added["id"], added["content"], kind, origin)
    names = [t if t is not None else UNUSED_TOKEN.format(i) for i, t in enumerate(tokens)]
    merges = [m if isinstance(m, str) else " ".join(m) for m in tokenizer.get("model", {}).get("merges", [])]
    if not merges:
        raise GGUFExportError(f"{origin}: tokenizer.json has no BPE merges (not a byte-level BPE tokenizer)")
    return GGUFVocab(names, types, merges)


def _place(tokens: list, types: list[int], i: int, token: str, kind: int, origin: str) -> None:
    if not 0 <= i < len(tokens):
        raise GGUFExportError(f"{origin}: token {token!r} has id {i}, outside the model's {len(tokens)}-entry "
                              f"vocabulary")
    tokens[i], types[i] = token, kind


# ------------------------------------------------------------------------------------------- the tensor table
@dataclass(frozen=True)
class TensorSlot:
    """One tensor of a runtime file: its name there, where its values come from, its role and shape (numpy order)."""

    name: str
    hf_name: str
    role: str
    shape: tuple[int, ...]


@dataclass(frozen=True)
class Qwen3ASRNames:
    """How a runtime names the audio tower's tensors (the text decoder uses llama.cpp's names in both)."""

    conv: str  # "...{i}" for conv 1, 2, 3
    conv_out: str
    audio_block: str  # "...{i}" for encoder layer i
    ln_post: str
    proj: str  # "...{i}" for projector 1, 2


def qwen3_asr_slots(h: Qwen3ASRHParams, names: Qwen3ASRNames) -> list[TensorSlot]:
    """Every model tensor of a Qwen3-ASR runtime file, in the order written."""
    slots = _frontend_slots(h, names)
    for i in range(h.audio_layers):
        slots += _audio_layer_slots(h, names.audio_block.format(i=i), f"{HF_AUDIO}.layers.{i}")
    slots += _norm_slots(names.ln_post, f"{HF_AUDIO}.ln_post", h.audio_d_model, bias=True)
    slots += _linear_slots(names.proj.format(i=1), f"{HF_PROJECTOR}.linear_1", (h.audio_d_model, h.audio_d_model))
    slots += _linear_slots(names.proj.format(i=2), f"{HF_PROJECTOR}.linear_2", (h.text_hidden, h.audio_d_model))
    slots.append(TensorSlot("token_embd.weight", HF_EMBEDDING, ROLE_MATRIX, (h.vocab_size, h.text_hidden)))
    for i in range(h.text_layers):
        slots += _text_layer_slots(h, f"blk.{i}", f"{HF_TEXT}.layers.{i}")
    slots.append(TensorSlot("output_norm.weight", f"{HF_TEXT}.norm.weight", ROLE_F32, (h.text_hidden,)))
    slots.append(TensorSlot("output.weight", HF_LM_HEAD, ROLE_MATRIX, (h.vocab_size, h.text_hidden)))
    return slots


def _frontend_slots(h: Qwen3ASRHParams, names: Qwen3ASRNames) -> list[TensorSlot]:
    slots = []
    for i in (1, 2, 3):
        in_channels = 1 if i == 1 else h.conv_channels
        prefix, hf = names.conv.format(i=i), f"{HF_AUDIO}.conv2d{i}"
        slots.append(TensorSlot(f"{prefix}.weight", f"{hf}.weight", ROLE_CONV, (h.conv_channels, in_channels, 3, 3)))
        slots.append(TensorSlot(f"{prefix}.bias", f"{hf}.bias", ROLE_F32, (h.conv_channels,)))
    slots.append(TensorSlot(f"{names.conv_out}.weight", f"{HF_AUDIO}.conv_out.weight", ROLE_MATRIX,
                            (h.audio_d_model, h.conv_channels * h.conv_freq_bins)))
    return slots


def _audio_layer_slots(h: Qwen3ASRHParams, prefix: str, hf_prefix: str) -> list[TensorSlot]:
    d, ffn, parts = h.audio_d_model, h.audio_ffn, AUDIO_LAYER_PARTS
    slots = []
    for part in ("attn_q", "attn_k", "attn_v", "attn_out"):
        slots += _linear_slots(f"{prefix}.{part}", f"{hf_prefix}.{parts[part]}", (d, d))
    slots += _norm_slots(f"{prefix}.attn_norm", f"{hf_prefix}.{parts['attn_norm']}", d, bias=True)
    slots += _linear_slots(f"{prefix}.ffn_up", f"{hf_prefix}.{parts['ffn_up']}", (ffn, d))
    slots += _linear_slots(f"{prefix}.ffn_down", f"{hf_prefix}.{parts['ffn_down']}", (d, ffn))
    slots += _norm_slots(f"{prefix}.ffn_norm", f"{hf_prefix}.{parts['ffn_norm']}", d, bias=True)
    return slots


def _text_layer_slots(h: Qwen3ASRHParams, prefix: str, hf_prefix: str) -> list[TensorSlot]:
    hidden, q_width, kv_width = h.text_hidden, h.text_heads * h.head_dim, h.text_kv_heads * h.head_dim
    shapes = {"attn_norm": (hidden,), "attn_q": (q_width, hidden), "attn_k": (kv_width, hidden),
              "attn_v": (kv_width, hidden), "attn_output": (hidden, q_width), "attn_q_norm": (h.head_dim,),
              "attn_k_norm": (h.head_dim,), "ffn_norm": (hidden,), "ffn_gate": (h.text_ffn, hidden),
              "ffn_up": (h.text_ffn, hidden), "ffn_down": (hidden, h.text_ffn)}
    return [TensorSlot(f"{prefix}.{part}.weight", f"{hf_prefix}.{TEXT_LAYER_PARTS[part]}.weight",
                       ROLE_MATRIX if len(shape) == 2 else ROLE_F32, shape) for part, shape in shapes.items()]


def _linear_slots(prefix: str, hf_prefix: str, shape: tuple[int, int]) -> list[TensorSlot]:
    return [TensorSlot(f"{prefix}.weight", f"{hf_prefix}.weight", ROLE_MATRIX, shape),
            TensorSlot(f"{prefix}.bias", f"{hf_prefix}.bias", ROLE_F32, (shape[0],))]


def _norm_slots(prefix: str, hf_prefix: str, width: int, bias: bool) -> list[TensorSlot]:
    parts = ("weight", "bias") if bias else ("weight",)
    return [TensorSlot(f"{prefix}.{p}", f"{hf_prefix}.{p}", ROLE_F32, (width,)) for p in parts]


def check_nothing_left_over(source: Qwen3ASRSource, slots: list[TensorSlot], target: str) -> None:
    """Refuse a source with tensors the runtime has no place for (another architecture, extra heads)."""
    used = {s.hf_name for s in slots} | {source.resolve(s.hf_name) for s in slots}
    extra = sorted(n for n in [*source.floats, *source.lattice] if n not in used and source.resolve(n) not in used)
    if extra:
        raise GGUFExportError(f"{source.origin}: tensors {target} has no place for: {', '.join(extra[:5])}"
                              + (f" and {len(extra) - 5} more" if len(extra) > 5 else ""))


# ------------------------------------------------------------------------------------------------------ packing
@dataclass
class PackedTensor:
    """One tensor ready to write: ``data`` holds exactly its bytes (float32 / float16 values or uint8 blocks)."""

    name: str
    ggml_type: int
    shape: tuple[int, ...]  # numpy order
    data: np.ndarray


@dataclass(frozen=True)
class KV:
    key: str
    value: Any
    value_type: int  # GGUF_* (for arrays: the element type)
    is_array: bool = False


@dataclass
class GGUFModel:
    """Everything a GGUF file holds, computed and validated, nothing written yet."""

    arch: str
    kv: list[KV]
    tensors: list[PackedTensor]


def weight_type_of(target: str) -> int:
    if target not in TARGET_TYPES:
        raise GGUFExportError(f"unknown weight type {target!r}; choose one of {', '.join(TARGET_TYPES)}")
    return TARGET_TYPES[target]


def default_target(source: Qwen3ASRSource) -> str:
    """The weight type a source naturally exports to: its lattice's type, f16 for a float model."""
    bits = {q.spec.bits for q in source.lattice.values()}
    if not bits:
        return "f16"
    if bits in ({4}, {8}):
        return "q4_0" if bits == {4} else "q8_0"
    raise GGUFExportError(f"{source.origin}: a {'/'.join(map(str, sorted(bits)))}-bit lattice has no single exact "
                          f"ggml type (Q4_0 holds 4-bit, Q8_0 8-bit lattices); use f16")


def pack_tensors(slots: list[TensorSlot], source: Qwen3ASRSource, weight_type: int) -> list[PackedTensor]:
    """Pack every slot; raises before anything is written if the source does not fit."""
    if weight_type in QUANTIZED_TYPES and not source.lattice:
        raise LatticeNotRepresentable(f"{source.origin}: no lattice weights; a {GGML_TYPE_NAMES[weight_type]} export "
                                      f"stores a lattice checkpoint exactly (quantize first, or export f16)")
    rounding = F16Rounding()
    packed = [_pack_slot(slot, source, weight_type, rounding) for slot in slots]
    rounding.report(source.origin)
    return packed


def _pack_slot(slot: TensorSlot, source: Qwen3ASRSource, weight_type: int, rounding: "F16Rounding") -> PackedTensor:
    key = source.resolve(slot.hf_name)
    if not source.has(slot.hf_name):
        raise GGUFExportError(f"{source.origin}: tensor {slot.hf_name} missing (the runtime needs {slot.name})")
    if slot.role == ROLE_MATRIX and weight_type in QUANTIZED_TYPES and key in source.lattice:
        return PackedTensor(slot.name, weight_type, slot.shape, _pack_lattice_slot(slot, source.lattice[key], source,
                                                                                   weight_type))
    ggml_type = GGML_TYPE_F32 if slot.role == ROLE_F32 else GGML_TYPE_F16
    values = _shaped(source.float_value(slot.hf_name), slot, source.origin)
    stored = values.to(TORCH_DTYPES[ggml_type]).contiguous()
    if ggml_type == GGML_TYPE_F16:
        rounding.count(slot.name, values, stored)
    return PackedTensor(slot.name, ggml_type, slot.shape, stored.numpy())


def _pack_lattice_slot(slot: TensorSlot, q: QuantizedWeight, source: Qwen3ASRSource, weight_type: int) -> np.ndarray:
    if tuple(q.shape) != slot.shape:
        raise GGUFExportError(f"{source.origin}: {slot.hf_name} has shape {list(q.shape)}, the runtime expects "
                              f"{list(slot.shape)} for {slot.name}")
    try:
        return pack_lattice(q.codes, q.scales, q.spec.bits, weight_type)
    except LatticeNotRepresentable as e:
        raise LatticeNotRepresentable(f"{source.origin}: {slot.hf_name} cannot be stored exactly as "
                                      f"{GGML_TYPE_NAMES[weight_type]}: {e}") from None


def _shaped(t: torch.Tensor, slot: TensorSlot, origin: str) -> torch.Tensor:
    if tuple(t.shape) != slot.shape:
        raise GGUFExportError(f"{origin}: {slot.hf_name} has shape {list(t.shape)}, the runtime expects "
                              f"{list(slot.shape)} for {slot.name}")
    return t.detach().cpu().float()


def vocab_kv(vocab: GGUFVocab, eos_id: int, pad_id: int, chat_template: str | None) -> list[KV]:
    kv = [KV("tokenizer.ggml.model", TOKENIZER_MODEL, GGUF_STRING),
          KV("tokenizer.ggml.pre", TOKENIZER_PRE, GGUF_STRING),
          KV("tokenizer.ggml.tokens", vocab.tokens, GGUF_STRING, True),
          KV("tokenizer.ggml.token_type", vocab.types, GGUF_INT32, True),
          KV("tokenizer.ggml.merges", vocab.merges, GGUF_STRING, True),
          KV("tokenizer.ggml.eos_token_id", eos_id, GGUF_UINT32),
          KV("tokenizer.ggml.padding_token_id", pad_id, GGUF_UINT32)]
    if chat_template:
        kv.append(KV("tokenizer.chat_template", chat_template, GGUF_STRING))
    return kv


def file_kv(name: str, weight_type: int) -> list[KV]:
    return [KV("general.name", name, GGUF_STRING), KV("general.type", "model", GGUF_STRING),
            KV("general.file_type", FILE_TYPES[weight_type], GGUF_UINT32),
            KV("general.quantization_version", QUANTIZATION_VERSION, GGUF_UINT32)]


# ---------------------------------------------------------------------------------------------- export / verify
# runtime target -> (module, builder) of its exporter (each module also has ``verify``); both write Qwen3-ASR GGUF
TARGETS = {"qwen3-asr.cpp": ("tarq_deploy.formats.qwen3_asr_cpp", "build_qwen3_asr_cpp"),
           "crispasr": ("tarq_deploy.formats.crispasr", "build_crispasr")}
ARCH_TARGETS = {"qwen3-asr": "qwen3-asr.cpp", "qwen3asr": "crispasr"}


def _target_module(target: str) -> Any:
    import importlib

    if target not in TARGETS:
        raise GGUFExportError(f"unknown GGUF target {target!r}; choose one of {', '.join(TARGETS)}")
    return importlib.import_module(TARGETS[target][0])


def export_qwen3_asr_gguf(target: str, checkpoint: str | None, model: str | None, weight_type: str | None,
                          out_path: str | os.PathLike) -> tuple[Path, str]:
    """The export command for the GGUF targets: a lattice checkpoint directory or a float transformers Qwen3-ASR
    directory (``model``) to ``out_path``; returns the path and a one-line summary."""
    if (checkpoint is None) == (model is None):
        raise GGUFExportError("give either CHECKPOINT_DIR or --model SOURCE (exactly one)")
    source = as_source(checkpoint) if checkpoint is not None else float_model_source(model)
    built = getattr(_target_module(target), TARGETS[target][1])(source, weight_type)
    out = write_gguf(built, out_path)
    types = sorted({GGML_TYPE_NAMES[t.ggml_type] for t in built.tensors})
    return out, f"{target} GGUF ({'/'.join(types)}), {len(built.tensors)} tensors, {out.stat().st_size / 1e6:.1f} MB"


def float_model_source(directory: str) -> Qwen3ASRSource:
    from tarq_deploy.models.qwen3_asr import load_qwen3_asr

    try:
        return model_source(*load_qwen3_asr(directory), origin=directory)
    except (OSError, ValueError) as e:
        raise GGUFExportError(f"--model {directory}: cannot load it as a transformers Qwen3-ASR directory "
                              f"({e})") from None


def verify_gguf(model_file: str | os.PathLike, checkpoint_dir: str | os.PathLike) -> dict[str, float]:
    """Verify a Qwen3-ASR GGUF of either flavour (chosen by its general.architecture) against a checkpoint."""
    arch = read_gguf(model_file).arch
    if arch not in ARCH_TARGETS:
        raise GGUFVerifyError(f"{model_file}: architecture {arch!r} is none this tool exports "
                              f"({', '.join(ARCH_TARGETS)})")
    return _target_module(ARCH_TARGETS[arch]).verify(model_file, checkpoint_dir)


# known sizes: (audio layers, audio d_model, text layers, text hidden) -> name
QWEN3_ASR_SIZES = {(18, 896, 28, 1024): "qwen3-asr-0.6B", (24, 1024, 28, 2048): "qwen3-asr-1.7B"}
FILE_TYPE_NAMES = {0: "F32", 1: "F16", 2: "Q4_0", 7: "Q8_0"}
# the dimension keys of each flavour, in the order of QWEN3_ASR_SIZES' tuples
SIZE_KEYS = {"qwen3-asr": ("qwen3-asr.audio.encoder.layer_count", "qwen3-asr.audio.encoder.embedding_length",
                           "qwen3-asr.block_count", "qwen3-asr.embedding_length"),
             "qwen3asr": ("qwen3asr.audio.n_layers", "qwen3asr.audio.d_model", "qwen3asr.llm.n_layers",
                          "qwen3asr.llm.d_model")}


def describe_qwen3_asr_gguf(path: str | os.PathLike, arch: str) -> tuple[str, str, dict]:
    """(backbone name, precision, details) of a Qwen3-ASR GGUF of flavour ``arch``; GGUFFileError if it is not one.
    The name is the published size the dimensions match, else "qwen3-asr-a<L>x<d>-t<L>x<d>"."""
    model = read_gguf(path)
    if model.arch != arch:
        raise GGUFFileError(path, f"architecture {model.arch!r}, expected {arch!r}")
    dims = tuple(int(model.require(key)) for key in SIZE_KEYS[arch])
    name = QWEN3_ASR_SIZES.get(dims, f"qwen3-asr-a{dims[0]}x{dims[1]}-t{dims[2]}x{dims[3]}")
    file_type = int(model.kv.get("general.file_type", -1))
    counts: dict[str, int] = {}
    for record in model.tensors.values():
        kind = GGML_TYPE_NAMES[record.ggml_type]
        counts[kind] = counts.get(kind, 0) + 1
    details = {"arch": arch, "audio_layers": dims[0], "audio_d_model": dims[1], "text_layers": dims[2],
               "text_hidden": dims[3], "tensor_types": counts}
    return name, FILE_TYPE_NAMES.get(file_type, f"file_type {file_type}"), details


# ------------------------------------------------------------------------------------------------------ writing
def write_gguf(model: GGUFModel, out_path: str | os.PathLike) -> Path:
    """Write ``model`` through a temporary file in the same directory, renamed when complete; nothing is left
    behind on error."""
    import gguf

    out = Path(out_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.{os.getpid()}.{secrets.token_hex(4)}.part"
    writer = gguf.GGUFWriter(tmp, arch=model.arch)
    try:
        for kv in model.kv:
            _add_kv(writer, kv)
        for t in model.tensors:
            writer.add_tensor(t.name, np.ascontiguousarray(t.data), raw_dtype=gguf.GGMLQuantizationType(t.ggml_type),
                              raw_shape=None if t.ggml_type in QUANTIZED_TYPES else t.shape)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        os.replace(tmp, out)
    except BaseException:
        writer.close()
        tmp.unlink(missing_ok=True)
        raise
    return out


def _add_kv(writer: Any, kv: KV) -> None:
    import gguf

    value_type = gguf.GGUFValueType(kv.value_type)
    if kv.is_array:
        writer.add_key_value(kv.key, list(kv.value), gguf.GGUFValueType.ARRAY, sub_type=value_type)
    else:
        writer.add_key_value(kv.key, kv.value, value_type)


# ------------------------------------------------------------------------------------------------------ reading
@dataclass(frozen=True)
class TensorRecord:
    name: str
    ggml_type: int
    shape: tuple[int, ...]  # numpy order
    offset: int  # absolute, in the file
    nbytes: int


@dataclass
class GGUFFile:
    """A parsed GGUF file; tensor data stays in a read-only memory map."""

    path: Path
    kv: dict[str, Any]
    tensors: dict[str, TensorRecord]
    data: np.ndarray  # uint8 view of the whole file

    @property
    def arch(self) -> str:
        return str(self.kv.get("general.architecture", ""))

    def raw(self, name: str) -> np.ndarray:
        rec = self.tensors[name]
        rows = int(np.prod(rec.shape[:-1], dtype=np.int64)) if len(rec.shape) > 1 else 1
        return self.data[rec.offset:rec.offset + rec.nbytes].reshape(rows, -1)

    def dequantize(self, name: str) -> np.ndarray:
        """float32 values in the tensor's shape, decoded by gguf-py (the reference decoder)."""
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize

        rec = self.tensors[name]
        values = dequantize(self.raw(name), GGMLQuantizationType(rec.ggml_type))
        return values.astype(np.float32, copy=False).reshape(rec.shape)

    def require(self, key: str) -> Any:
        if key not in self.kv:
            raise GGUFFileError(self.path, f"metadata key {key} missing")
        return self.kv[key]


def is_gguf_file(path: str | os.PathLike) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(4) == GGUF_MAGIC
    except OSError:
        return False


def read_gguf(path: str | os.PathLike) -> GGUFFile:
    """Parse ``path`` strictly (any truncation, unknown type or misplaced tensor raises GGUFFileError)."""
    path = Path(path)
    if not path.is_file():
        raise GGUFFileError(path, "no such file")
    with open(path, "rb") as f:
        if os.fstat(f.fileno()).st_size == 0:
            raise GGUFFileError(path, "empty file")
        buffer = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    cur = _Cursor(buffer, path)
    if cur.take(4, "the magic") != GGUF_MAGIC:
        raise GGUFFileError(path, "bad magic: not a GGUF file")
    version = cur.scalar(GGUF_UINT32, "the version")
    if version != GGUF_VERSION:
        raise GGUFFileError(path, f"GGUF version {version}; this reader knows version {GGUF_VERSION}")
    n_tensors, n_kv = cur.scalar(GGUF_UINT64, "the tensor count"), cur.scalar(GGUF_UINT64, "the key count")
    kv = dict(_read_kv(cur) for _ in range(n_kv))
    infos = [_read_tensor_info(cur) for _ in range(n_tensors)]
    alignment = int(kv.get("general.alignment", GGUF_DEFAULT_ALIGNMENT))
    data_start = -(-cur.pos // alignment) * alignment
    tensors = _place_tensors(path, infos, data_start, alignment, len(buffer))
    return GGUFFile(path, kv, tensors, np.frombuffer(buffer, dtype=np.uint8))


class _Cursor:
    """Sequential little-endian reads with truncation errors that say what was being read."""

    def __init__(self, buffer: mmap.mmap, path: Path) -> None:
        self.buffer, self.path, self.pos = buffer, path, 0

    def skip(self, n: int, what: str) -> int:
        if n < 0 or self.pos + n > len(self.buffer):
            raise GGUFFileError(self.path, f"truncated: {what} needs {n} bytes at offset {self.pos} "
                                           f"(file has {len(self.buffer)} bytes)")
        start, self.pos = self.pos, self.pos + n
        return start

    def take(self, n: int, what: str) -> bytes:
        start = self.skip(n, what)
        return self.buffer[start:start + n]

    def scalar(self, value_type: int, what: str) -> Any:
        fmt = _SCALAR_FORMATS[value_type]
        return struct.unpack_from(fmt, self.buffer, self.skip(struct.calcsize(fmt), what))[0]

    def string(self, what: str) -> str:
        n = self.scalar(GGUF_UINT64, f"the length of {what}")
        if n > MAX_STRING_BYTES:
            raise GGUFFileError(self.path, f"{what} claims {n} bytes")
        raw = self.take(n, what)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise GGUFFileError(self.path, f"{what} is not UTF-8") from None

    def value(self, value_type: int, what: str) -> Any:
        if value_type == GGUF_STRING:
            return self.string(what)
        if value_type == GGUF_ARRAY:
            element_type = self.scalar(GGUF_UINT32, f"the element type of {what}")
            count = self.scalar(GGUF_UINT64, f"the length of {what}")
            return self.array(element_type, count, what)
        if value_type not in _SCALAR_FORMATS:
            raise GGUFFileError(self.path, f"{what} has unknown value type {value_type}")
        return self.scalar(value_type, what)

    def array(self, element_type: int, count: int, what: str) -> list:
        if element_type in _SCALAR_FORMATS and element_type != GGUF_BOOL:
            fmt = _SCALAR_FORMATS[element_type]
            size = struct.calcsize(fmt)
            start = self.skip(size * count, what)
            return np.frombuffer(self.buffer, dtype=np.dtype(fmt), count=count, offset=start).tolist()
        return [self.value(element_type, what) for _ in range(count)]


def _read_kv(cur: _Cursor) -> tuple[str, Any]:
    key = cur.string(f"a metadata key at offset {cur.pos}")
    value_type = cur.scalar(GGUF_UINT32, f"the type of {key}")
    return key, cur.value(value_type, key)


def _read_tensor_info(cur: _Cursor) -> tuple[str, int, tuple[int, ...], int]:
    name = cur.string(f"a tensor name at offset {cur.pos}")
    n_dims = cur.scalar(GGUF_UINT32, f"the dimension count of {name}")
    if not 1 <= n_dims <= MAX_DIMS:
        raise GGUFFileError(cur.path, f"tensor {name}: {n_dims} dimensions")
    ne = [cur.scalar(GGUF_UINT64, f"the dimensions of {name}") for _ in range(n_dims)]
    ggml_type = cur.scalar(GGUF_UINT32, f"the type of {name}")
    offset = cur.scalar(GGUF_UINT64, f"the data offset of {name}")
    if ggml_type not in GGML_BLOCK:
        raise GGUFFileError(cur.path, f"tensor {name}: ggml type {ggml_type} (this reader knows "
                                      f"{', '.join(GGML_TYPE_NAMES.values())})")
    return name, ggml_type, tuple(reversed(ne)), offset


def _place_tensors(path: Path, infos: list, data_start: int, alignment: int, size: int) -> dict[str, TensorRecord]:
    tensors: dict[str, TensorRecord] = {}
    for name, ggml_type, shape, offset in infos:
        if name in tensors:
            raise GGUFFileError(path, f"tensor {name} appears twice")
        try:
            nbytes = tensor_nbytes(ggml_type, shape)
        except ValueError as e:
            raise GGUFFileError(path, f"tensor {name}: {e}") from None
        start = data_start + offset
        if offset % alignment or start + nbytes > size:
            raise GGUFFileError(path, f"tensor {name}: data at offset {offset} (+{nbytes} bytes) is misaligned or "
                                      f"past the end of the file (truncated?)")
        tensors[name] = TensorRecord(name, ggml_type, shape, start, nbytes)
    return tensors


# ------------------------------------------------------------------------------------------------------- verify
def check_metadata(model: GGUFFile, expected: list[KV], keys: Iterable[str], checkpoint: str) -> None:
    """Every key of ``keys`` holds what the exporter writes for ``checkpoint`` (else GGUFVerifyError)."""
    wanted = {kv.key: kv.value for kv in expected}
    for key in keys:
        actual = model.require(key)
        want = wanted[key]
        same = actual == want if not isinstance(want, float) else np.float32(actual) == np.float32(want)
        if not same:
            shown = (f"{len(actual)} entries" if isinstance(actual, list) else repr(actual),
                     f"{len(want)} entries" if isinstance(want, list) else repr(want))
            raise GGUFVerifyError(f"{model.path}: {key} is {shown[0]}, the checkpoint {checkpoint} gives {shown[1]}")


def as_checkpoint(checkpoint: str | os.PathLike | LatticeCheckpoint) -> tuple[LatticeCheckpoint, str]:
    """(checkpoint, its name for messages) from a checkpoint directory or an in-memory LatticeCheckpoint."""
    if isinstance(checkpoint, LatticeCheckpoint):
        return checkpoint, "the checkpoint"
    return load_checkpoint(checkpoint), str(checkpoint)


@dataclass(frozen=True)
class CheckpointValues:
    """The checkpoint's exact float32 values, one tensor at a time: s * q for lattice weights, aliases resolved."""

    ckpt: LatticeCheckpoint

    def resolve(self, name: str) -> str:
        return self.ckpt.aliases.get(name, name)

    def __call__(self, name: str) -> torch.Tensor:
        key = self.resolve(name)
        if key in self.ckpt.quantized:
            return lattice_values(self.ckpt.quantized[key])
        if key in self.ckpt.tensors:
            return self.ckpt.tensors[key].float()
        raise KeyError(name)


def lattice_values(q: QuantizedWeight) -> torch.Tensor:
    """s * q in float32, group by group (QuantizedWeight.dequantize's values; each product is exact in float32)."""
    m, n = q.codes.shape
    groups = q.scales.shape[1]
    return (q.codes.view(m, groups, n // groups).float() * q.scales.float()[:, :, None]).view(m, n)


def compare_tensors(model: GGUFFile, slots: list[TensorSlot], exact: CheckpointValues,
                    checkpoint: str) -> dict[str, float]:
    """max |diff| between every slot's decoded values and the checkpoint's exact values (file order)."""
    missing = [s.name for s in slots if s.name not in model.tensors]
    if missing:
        raise GGUFVerifyError(f"{model.path}: tensors missing: {', '.join(missing[:5])}")
    diffs: dict[str, float] = {}
    decoded: dict[str, str] = {}  # checkpoint tensor -> the slot already compared with it (tied embedding / output)
    for slot in slots:
        record = model.tensors[slot.name]
        if record.shape != slot.shape:
            raise GGUFVerifyError(f"{model.path}: tensor {slot.name} has shape {list(record.shape)}, the checkpoint "
                                  f"gives {list(slot.shape)}")
        twin = decoded.get(exact.resolve(slot.hf_name))
        if twin is not None and np.array_equal(model.raw(twin), model.raw(slot.name)):
            diffs[slot.name] = diffs[twin]  # the same bytes decode to the same values
            continue
        try:
            expected = exact(slot.hf_name)
        except KeyError:
            raise GGUFVerifyError(f"{checkpoint}: the checkpoint has no tensor {slot.hf_name} "
                                  f"(for {slot.name})") from None
        diffs[slot.name] = max_abs_diff(model.dequantize(slot.name), expected)
        decoded[exact.resolve(slot.hf_name)] = slot.name
    return diffs


def max_abs_diff(actual: np.ndarray, expected: np.ndarray | torch.Tensor) -> float:
    """max |actual - expected| in float32 (0.0 means identical values; NaN against NaN counts as equal)."""
    if isinstance(expected, torch.Tensor):
        decoded = torch.from_numpy(np.require(actual, dtype=np.float32, requirements="W"))  # mmap views are read-only
        if torch.equal(decoded, expected.float().reshape(decoded.shape)):
            return 0.0
        expected = expected.float().numpy()
    a = np.asarray(actual, dtype=np.float32)
    e = np.asarray(expected, dtype=np.float32).reshape(a.shape)
    same = (a == e) | (np.isnan(a) & np.isnan(e))
    if same.all():
        return 0.0
    diff = np.abs(a[~same] - e[~same])
    return float("inf") if np.isnan(diff).any() else float(diff.max())
