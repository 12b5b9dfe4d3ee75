"""The Qwen3-ASR model as both GGUF runtimes (qwen3-asr.cpp, CrispASR) take it: hyper-parameters, the source as the
exporters see it, the tensor table (each runtime names the audio tower's tensors its own way), the tokenizer arrays,
the packing of every tensor, and the build and verify every runtime flavour shares (``Qwen3ASRFlavour``). The
flavours are records in qwen3_asr_cpp.py and crispasr.py (names, metadata, extra tables); qwen3_asr_targets.py
picks one.

Tensor roles decide the stored type: weight matrices take the file's weight type (its ggml blocks straight from
the lattice, see ggml_blocks.py; F16 in an F16 file or for a matrix the checkpoint kept in 16 bits), Conv2d kernels
are F16 (what ggml convolutions take), norms, biases and the mel front-end tables F32. Computing and I/O are
separate: ``pack_tensors`` builds every tensor in memory (refusing what the target cannot hold before a byte is
written); ``gguf_file.write_gguf`` only writes.
"""
from __future__ import annotations

import functools
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
from gguf.constants import GGUFValueType

from tarq_deploy.checkpoint import LatticeCheckpoint, LatticeWeights

from .f16_rounding import F16Rounding, F16Values
from .ggml_blocks import (GGML_TYPE_NAMES, LATTICE_TYPES, QUANTIZED_TYPES, GGMLType, LatticeNotRepresentable,
                          type_for_spec)
from .ggml_tensors import (ROLE_CONV, ROLE_F32, ROLE_MATRIX, CheckpointValues, PackedTensor, TensorSlot, as_checkpoint,
                           compare_tensors, max_abs_diff, pack_float, stored_blocks_as_f16, stored_or_packed)
from .gguf_file import (KV, GGUFExportError, GGUFModel, GGUFVerifyError, check_metadata, file_kv, most_weights_type,
                        read_gguf, write_gguf)
from .model_files import ModelTensors, as_model_source, feature_extractor_config, json_file

__all__ = ["AUDIO_END_TOKEN", "AUDIO_PAD_TOKEN", "AUDIO_START_TOKEN", "EOS_TOKEN", "HF_EMBEDDING", "HF_LM_HEAD",
           "PAD_TOKEN", "Qwen3ASRFlavour", "Qwen3ASRHParams", "Qwen3ASRNames", "Qwen3ASRSource", "TARGET_TYPES",
           "TOKEN_CONTROL", "TOKEN_NORMAL", "TextDecoderHParams", "as_source", "check_nothing_left_over",
           "default_target", "float_model_source", "front_end_and_llm_keys", "gguf_vocab", "pack_tensors",
           "qwen3_asr_slots", "text_decoder_fields", "vocab_kv", "weight_type_of"]

TARGET_TYPES = {"f16": GGMLType.F16, **{t.name.lower(): t for t in LATTICE_TYPES}}

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


# ---------------------------------------------------------------------------------------------------- hparams
@dataclass(frozen=True)
class TextDecoderHParams:
    """The LLM decoder's dimensions, as a speech-LLM config's text_config gives them (Qwen3-ASR, Voxtral)."""

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


def text_decoder_fields(text: dict, positions: int, rope_theta: float, rms_norm_eps: float) -> dict:
    """TextDecoderHParams' fields from a text_config, with the architecture's defaults for what it may leave out;
    KeyError / TypeError for a config that is not one."""
    rope = text.get("rope_parameters") or {}
    return dict(text_layers=text["num_hidden_layers"], text_hidden=text["hidden_size"],
                text_heads=text["num_attention_heads"], text_kv_heads=text["num_key_value_heads"],
                head_dim=text.get("head_dim") or text["hidden_size"] // text["num_attention_heads"],
                text_ffn=text["intermediate_size"], vocab_size=text["vocab_size"],
                text_positions=text.get("max_position_embeddings", positions),
                rope_theta=float(rope.get("rope_theta", text.get("rope_theta", rope_theta))),
                rms_norm_eps=float(text.get("rms_norm_eps", rms_norm_eps)))


@dataclass(frozen=True)
class Qwen3ASRHParams(TextDecoderHParams):
    """The dimensions both runtimes need, read from a transformers Qwen3-ASR config."""

    n_mels: int
    audio_layers: int
    audio_d_model: int
    audio_heads: int
    audio_ffn: int
    conv_channels: int
    n_window_infer: int

    @classmethod
    def from_config(cls, config: dict, origin: str) -> "Qwen3ASRHParams":
        try:
            audio, text = config["audio_config"], config["text_config"]
            return cls(
                n_mels=audio["num_mel_bins"], audio_layers=audio["encoder_layers"], audio_d_model=audio["d_model"],
                audio_heads=audio["encoder_attention_heads"], audio_ffn=audio["encoder_ffn_dim"],
                conv_channels=audio["downsample_hidden_size"], n_window_infer=audio.get("n_window_infer", 800),
                **text_decoder_fields(text, positions=65536, rope_theta=1e6, rms_norm_eps=1e-6))
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
    lattice: LatticeWeights = field(default_factory=LatticeWeights)  # a checkpoint's blocks stay undecoded
    aliases: dict[str, str] = field(default_factory=dict)
    chat_template: str | None = None
    origin: str = "model"
    error = GGUFExportError

    def __post_init__(self) -> None:
        if not isinstance(self.lattice, LatticeWeights):
            self.lattice = LatticeWeights(self.lattice)

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
                          feature_extractor_config(files, origin), dict(ckpt.tensors), ckpt.quantized,
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
    return as_model_source(source, Qwen3ASRSource, checkpoint_source, model_source, model_items=(2,))


def float_model_source(directory: str) -> Qwen3ASRSource:
    """A float transformers Qwen3-ASR directory (the export command's ``--model``)."""
    from tarq_deploy.models.qwen3_asr import load_qwen3_asr

    try:
        return model_source(*load_qwen3_asr(directory), origin=directory)
    except (OSError, ValueError) as e:
        raise GGUFExportError(f"--model {directory}: cannot load it as a transformers Qwen3-ASR directory "
                              f"({e})") from None


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
def weight_type_of(target: str) -> int:
    if target not in TARGET_TYPES:
        raise GGUFExportError(f"unknown weight type {target!r}; choose one of {', '.join(TARGET_TYPES)}")
    return TARGET_TYPES[target]


def default_target(source: Qwen3ASRSource) -> str:
    """The weight type a source naturally exports to: its lattice's type (for a per-tensor mix, the type holding the
    most weights, which names the file's general.file_type), f16 for a float model."""
    weights: dict[int | None, int] = {}
    for name in source.lattice:
        t = type_for_spec(source.lattice.spec_of(name))
        rows, cols = source.lattice.shape_of(name)
        weights[t] = weights.get(t, 0) + rows * cols
    if not weights:
        return "f16"
    if None in weights:
        raise GGUFExportError(f"{source.origin}: some lattice weights are on a lattice no ggml type stores; use f16")
    return GGML_TYPE_NAMES[most_weights_type(weights)].lower()


def is_mix(source: Qwen3ASRSource) -> bool:
    """Whether the lattice weights are on more than one ggml type (a --tensor-type recipe)."""
    return len({type_for_spec(source.lattice.spec_of(name)) for name in source.lattice}) > 1


def pack_tensors(slots: list[TensorSlot], source: Qwen3ASRSource, weight_type: int) -> list[PackedTensor]:
    """Pack every slot; raises before anything is written if the source does not fit."""
    if weight_type in QUANTIZED_TYPES and not source.lattice:
        raise LatticeNotRepresentable(f"{source.origin}: no lattice weights; a {GGML_TYPE_NAMES[weight_type]} export "
                                      f"stores a lattice checkpoint exactly (quantize first, or export f16)")
    rounding = F16Rounding(source.origin)
    packed = [_pack_slot(slot, source, weight_type, rounding) for slot in slots]
    rounding.report()
    return packed


def _pack_slot(slot: TensorSlot, source: Qwen3ASRSource, weight_type: int, rounding: F16Rounding) -> PackedTensor:
    key = source.resolve(slot.hf_name)
    if not source.has(slot.hf_name):
        raise GGUFExportError(f"{source.origin}: tensor {slot.hf_name} missing (the runtime needs {slot.name})")
    if slot.role == ROLE_MATRIX and weight_type in QUANTIZED_TYPES and key in source.lattice:
        # a mix writes every tensor in its own lattice's type; a uniform lattice must be the file's type
        stored = type_for_spec(source.lattice.spec_of(key)) if is_mix(source) else weight_type
        return PackedTensor(slot.name, stored, slot.shape, _pack_lattice_slot(slot, key, source, stored))
    ggml_type = slot.ggml_type(GGMLType.F16)  # what a float file stores: F16, norms and biases F32
    data = stored_blocks_as_f16(source, slot) if ggml_type == GGMLType.F16 else None
    if data is None:
        data = pack_float(slot.name, source.float_in_slot(slot), ggml_type)
    # gguf-py's writer takes every tensor's array before it writes: F16 values are made here, not while writing
    values = rounding.made(data) if isinstance(data, F16Values) else data
    return PackedTensor(slot.name, ggml_type, slot.shape, values)


def _pack_lattice_slot(slot: TensorSlot, key: str, source: Qwen3ASRSource, weight_type: int) -> np.ndarray:
    source.check_lattice_shape(slot)
    return stored_or_packed(source.lattice, key, weight_type, slot.hf_name, source.origin)


def vocab_kv(vocab: GGUFVocab, eos_id: int, pad_id: int, chat_template: str | None) -> list[KV]:
    string, int32, uint32 = GGUFValueType.STRING, GGUFValueType.INT32, GGUFValueType.UINT32
    kv = [KV("tokenizer.ggml.model", TOKENIZER_MODEL, string),
          KV("tokenizer.ggml.pre", TOKENIZER_PRE, string),
          KV("tokenizer.ggml.tokens", vocab.tokens, string, True),
          KV("tokenizer.ggml.token_type", vocab.types, int32, True),
          KV("tokenizer.ggml.merges", vocab.merges, string, True),
          KV("tokenizer.ggml.eos_token_id", eos_id, uint32),
          KV("tokenizer.ggml.padding_token_id", pad_id, uint32)]
    if chat_template:
        kv.append(KV("tokenizer.chat_template", chat_template, string))
    return kv


# ------------------------------------------------------------------------------------------- runtime flavours
@dataclass(frozen=True)
class Qwen3ASRFlavour:
    """One runtime's Qwen3-ASR GGUF: what tells it from the other flavour (names, metadata, extra tables). Packing,
    the file's layout and the checks are the same for every flavour, so ``build`` and ``verify`` live here."""

    target: str  # the export command's --target; errors name the runtime by it
    arch: str  # general.architecture
    file_kind: str  # how verify names a file of this flavour ("a <file_kind> file")
    model_name: str  # general.name
    names: Qwen3ASRNames
    metadata: Callable[[Qwen3ASRHParams, Qwen3ASRSource], list[KV]]  # every key but the file-type ones
    structural_keys: tuple[str, ...]  # keys that pin the model's structure: verify compares them
    size_keys: tuple[str, str, str, str]  # audio layers, audio d_model, text layers, text hidden
    # F32 arrays written before the model tensors (CrispASR's mel front end); verify compares them too
    tables: Callable[[Qwen3ASRSource], dict[str, np.ndarray]] = lambda source: {}  # none by default

    def build(self, source: Any, target: str | None = None) -> GGUFModel:
        """Pack every tensor for ``target`` (q4_0 | q8_0 | f16; default: the lattice's type, f16 for a float
        model)."""
        source = as_source(source)
        h = source.hparams()
        weight_type = weight_type_of(target or default_target(source))
        slots = qwen3_asr_slots(h, self.names)
        check_nothing_left_over(source, slots, self.target)
        tables = [PackedTensor(name, GGMLType.F32, values.shape, values)
                  for name, values in self.tables(source).items()]
        kv = file_kv(self.model_name, weight_type) + self.metadata(h, source)
        return GGUFModel(self.arch, kv, tables + pack_tensors(slots, source, weight_type))

    def export(self, source: Any, out_path: str | os.PathLike, target: str | None = None) -> Path:
        """Export a LatticeCheckpoint, a checkpoint directory or (model, processor) to ``out_path``; returns the
        path."""
        return write_gguf(self.build(source, target), out_path)

    def verify(self, model_file: str | os.PathLike, checkpoint: str | os.PathLike | LatticeCheckpoint
               ) -> dict[str, float]:
        """Decode every tensor of ``model_file`` with gguf-py and compare it with the checkpoint's exact values (s * q
        for lattice weights, the stored tensors otherwise) and the flavour's tables; max |diff| per array, 0.0
        everywhere for an exact export."""
        model = read_gguf(model_file)
        if model.arch != self.arch:
            raise GGUFVerifyError(f"{model_file}: architecture {model.arch!r}, not a {self.file_kind} file "
                                  f"({self.arch!r})")
        ckpt, origin = as_checkpoint(checkpoint)
        source = checkpoint_source(ckpt, origin=origin)
        h = source.hparams()
        check_metadata(model, self.metadata(h, source), self.structural_keys, origin)
        diffs = {}
        for name, values in self.tables(source).items():
            if name not in model.tensors:
                raise GGUFVerifyError(f"{model_file}: tensor {name} missing")
            diffs[name] = max_abs_diff(model.dequantize(name), values)
        diffs.update(compare_tensors(model, qwen3_asr_slots(h, self.names), CheckpointValues(ckpt), origin))
        return diffs


def front_end_and_llm_keys(fe: dict, n_mels: int, audio: tuple[int, int, int, int], h: Any) -> tuple[list, list]:
    """The (key, value, type) triples every speech-LLM GGUF of CrispASR shares: the audio front end and encoder
    dimensions (``audio`` = layers, d_model, heads, ffn), and the language model's (``h``: text_* fields)."""
    u32, f32 = GGUFValueType.UINT32, GGUFValueType.FLOAT32
    layers, d_model, heads, ffn = audio
    front = [("sample_rate", fe.get("sampling_rate", 16000), u32), ("n_mels", n_mels, u32),
             ("n_fft", fe.get("n_fft", 400), u32), ("win_length", fe.get("n_fft", 400), u32),
             ("hop_length", fe.get("hop_length", 160), u32),
             ("audio.n_layers", layers, u32), ("audio.d_model", d_model, u32), ("audio.n_heads", heads, u32),
             ("audio.head_dim", d_model // heads, u32), ("audio.ff_dim", ffn, u32)]
    llm = [("llm.n_layers", h.text_layers, u32), ("llm.d_model", h.text_hidden, u32), ("llm.n_heads", h.text_heads, u32),
           ("llm.n_kv_heads", h.text_kv_heads, u32), ("llm.head_dim", h.head_dim, u32), ("llm.ff_dim", h.text_ffn, u32),
           ("llm.rope_theta", h.rope_theta, f32), ("llm.rms_norm_eps", h.rms_norm_eps, f32),
           ("llm.vocab_size", h.vocab_size, u32), ("llm.max_pos", h.text_positions, u32)]
    return front, llm
