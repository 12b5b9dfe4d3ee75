"""Export Voxtral (transformers ``VoxtralForConditionalGeneration``, e.g. Voxtral-Mini-3B-2507) to CrispASR's GGUF
(PyPI ``crispasr``, its ``voxtral`` backend; arch "voxtral"): a lattice checkpoint bit-exactly (the blocks of each
lattice weight's own ggml type, Q4_0 ... Q6_K, per-tensor mixes included), or a float model as F16.

Layout (what the crispasr 0.8.45 voxtral loader binds -- src/voxtral.cpp ``voxtral_load_model`` -- and CrispASR's
models/convert-voxtral-to-gguf.py writes):
* audio encoder (Whisper-like): ``audio.conv.{1,2}.{weight,bias}`` (Conv1d kernels F16, biases F32),
  ``audio.embed_positions`` (F32 [1500, d]), ``audio.blk.{i}.{attn_q,attn_v,attn_out,ffn_up,ffn_down}.{weight,bias}``,
  ``audio.blk.{i}.attn_k.weight`` (no bias), ``audio.blk.{i}.{attn_norm,ffn_norm}.{weight,bias}``,
  ``audio.ln_post.{weight,bias}``;
* projector (4 encoder frames stacked per input): ``proj1.weight`` [text hidden, 4 d], ``proj2.weight`` (no biases);
* the Llama/Mistral decoder under llama.cpp names: ``token_embd``, ``blk.{i}.{attn_norm, attn_q, attn_k, attn_v,
  attn_output, ffn_norm, ffn_gate, ffn_up, ffn_down}.weight``, ``output_norm``, ``output`` (lm_head; the embedding's
  values for a tied model);
* front end: ``audio.mel_filters`` (F32, numpy [201, 128]: WhisperFeatureExtractor's Slaney filters, frequency-major)
  and ``audio.mel_window`` (F32 [400], the periodic Hann window torch.stft is given);
* tokenizer: Tekken, as CrispASR keeps it: ``tokenizer.tekken.pattern`` (string), ``tokenizer.tekken.specials``
  (string array, rank = id), ``tokenizer.tekken.n_specials``, ``tokenizer.tekken.n_vocab`` (u32) and the tensor
  ``tokenizer.tekken.vocab_tensor`` (F32 [n bytes], one float per byte of the blob: per BPE rank a u16 little-endian
  length, then the token's bytes) -- text token id = n_specials + rank;
* metadata ``voxtral.{sample_rate, n_mels, n_fft, win_length, hop_length}``, ``voxtral.audio.{n_layers, d_model,
  n_heads, head_dim, ff_dim, max_pos}``, ``voxtral.proj.{in_dim, out_dim, frame_stack}``, ``voxtral.llm.{n_layers,
  d_model, n_heads, n_kv_heads, head_dim, ff_dim, rope_theta, rms_norm_eps, vocab_size, max_pos}``,
  ``voxtral.audio_token_id``.

What the runtime hard-codes (so a model without it is refused here, before a file exists): 128 mel bins, 3000 mel
frames per 30 s chunk (``max_source_positions`` 1500), a projector input of 4 stacked encoder frames
(``linear_1`` in-dim = 4 x audio d_model, which is also what transformers' reshape by ``intermediate_size`` needs).
"""
from __future__ import annotations

import base64
import functools
import json
import os
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf.constants import GGUFValueType

from tarq_deploy.checkpoint import LatticeCheckpoint, LatticeWeights

from .ggml_blocks import GGML_TYPE_NAMES, GGMLType
from .ggml_tensors import (ROLE_CONV, ROLE_F32, ROLE_MATRIX, CheckpointValues, PackedTensor, TensorSlot, as_checkpoint,
                           compare_tensors, max_abs_diff)
from .gguf_file import KV, GGUFExportError, GGUFModel, GGUFVerifyError, check_metadata, file_kv, read_gguf, write_gguf
from .model_files import ModelTensors, as_model_source, feature_extractor_config, json_file
from .qwen3_asr_gguf import (TextDecoderHParams, check_nothing_left_over, default_target, front_end_and_llm_keys,
                             pack_tensors, text_decoder_fields, weight_type_of)

__all__ = ["HF_PROJECTOR", "TekkenVocab", "VoxtralSource", "build_crispasr_voxtral", "checkpoint_source",
           "describe_voxtral_gguf", "export_voxtral_gguf"]

ARCH = "voxtral"
TARGET = "crispasr"
MODEL_NAME = "Voxtral"
RUNTIME = "CrispASR's voxtral backend"
MEL_FILTERS, MEL_WINDOW = "audio.mel_filters", "audio.mel_window"
VOCAB_TENSOR = "tokenizer.tekken.vocab_tensor"
FRAME_STACK = 4  # encoder frames per projector input
RUNTIME_MELS, RUNTIME_POSITIONS, RUNTIME_FFT = 128, 1500, 400  # what voxtral.cpp hard-codes (3000 mel frames)
# transformers state-dict names (5.x)
HF_AUDIO = "model.audio_tower"
HF_TEXT = "model.language_model"
HF_PROJECTOR = "model.multi_modal_projector"
HF_EMBEDDING = f"{HF_TEXT}.embed_tokens.weight"
HF_LM_HEAD = "lm_head.weight"
AUDIO_PARTS = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
               "attn_out": "self_attn.out_proj", "ffn_up": "fc1", "ffn_down": "fc2"}
AUDIO_NORMS = {"attn_norm": "self_attn_layer_norm", "ffn_norm": "final_layer_norm"}
TEXT_PARTS = {"attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
              "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj", "ffn_norm": "post_attention_layernorm",
              "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
STRUCTURAL_KEYS = tuple(f"{ARCH}.{k}" for k in (
    "n_mels", "n_fft", "hop_length", "audio.n_layers", "audio.d_model", "audio.n_heads", "audio.ff_dim",
    "audio.max_pos", "proj.in_dim", "proj.out_dim", "proj.frame_stack", "llm.n_layers", "llm.d_model", "llm.n_heads",
    "llm.n_kv_heads", "llm.head_dim", "llm.ff_dim", "llm.vocab_size", "audio_token_id")) + (
    "tokenizer.tekken.specials", "tokenizer.tekken.n_specials", "tokenizer.tekken.n_vocab")
SIZE_KEYS = (f"{ARCH}.audio.n_layers", f"{ARCH}.audio.d_model", f"{ARCH}.llm.n_layers", f"{ARCH}.llm.d_model")


# ---------------------------------------------------------------------------------------------------- hparams
@dataclass(frozen=True)
class VoxtralHParams(TextDecoderHParams):
    n_mels: int
    audio_layers: int
    audio_d_model: int
    audio_heads: int
    audio_ffn: int
    audio_positions: int
    audio_token_id: int
    tied: bool

    @classmethod
    def from_config(cls, config: dict, origin: str) -> "VoxtralHParams":
        try:
            audio, text = config["audio_config"], config["text_config"]
            return cls(
                n_mels=audio.get("num_mel_bins", 128), audio_layers=audio["num_hidden_layers"],
                audio_d_model=audio["hidden_size"], audio_heads=audio["num_attention_heads"],
                audio_ffn=audio["intermediate_size"], audio_positions=audio.get("max_source_positions", 1500),
                **text_decoder_fields(text, positions=131072, rope_theta=1e8, rms_norm_eps=1e-5),
                audio_token_id=int(config.get("audio_token_id", 24)),
                tied=bool(text.get("tie_word_embeddings", config.get("tie_word_embeddings", False))))
        except (KeyError, TypeError) as e:
            raise GGUFExportError(f"{origin}: config.json is not a Voxtral config (model_type 'voxtral' with "
                                  f"audio_config and text_config): missing {e}") from None

    def check_runtime(self, origin: str) -> None:
        """What voxtral.cpp hard-codes; a model that differs would load and compute garbage (or read past a
        tensor), so it is refused here."""
        if self.n_mels != RUNTIME_MELS:
            raise GGUFExportError(f"{origin}: {self.n_mels} mel bins; {RUNTIME} computes {RUNTIME_MELS} (hard-coded)")
        if self.audio_positions != RUNTIME_POSITIONS:
            raise GGUFExportError(f"{origin}: max_source_positions {self.audio_positions}; {RUNTIME} encodes 3000 mel "
                                  f"frames into {RUNTIME_POSITIONS} positions (hard-coded)")
        if self.audio_d_model % self.audio_heads:
            raise GGUFExportError(f"{origin}: audio d_model {self.audio_d_model} is not a multiple of its "
                                  f"{self.audio_heads} heads")


# ------------------------------------------------------------------------------------------------------ sources
@dataclass
class VoxtralSource(ModelTensors):
    """A Voxtral model as the exporter sees it, whatever it was read from."""

    config: dict
    tokenizer: dict  # parsed tokenizer.json (transformers' fast conversion of tekken.json)
    feature_extractor: dict
    floats: dict[str, torch.Tensor]
    lattice: LatticeWeights = field(default_factory=LatticeWeights)
    aliases: dict[str, str] = field(default_factory=dict)
    tekken: dict | None = None  # tekken.json when the source has it (a hub directory); preferred over tokenizer.json
    origin: str = "model"
    error = GGUFExportError
    runtime = RUNTIME

    def __post_init__(self) -> None:
        if not isinstance(self.lattice, LatticeWeights):
            self.lattice = LatticeWeights(self.lattice)

    @functools.cached_property
    def hparams(self) -> VoxtralHParams:
        return VoxtralHParams.from_config(self.config, self.origin)

    @functools.cached_property
    def vocab(self) -> "TekkenVocab":
        return (tekken_from_json(self.tekken, self.origin) if self.tekken is not None
                else tekken_from_tokenizer(self.tokenizer, self.origin))

    @property
    def output_name(self) -> str:
        """The transformers tensor behind ``output.weight``: lm_head, or the embedding of a tied model."""
        return HF_LM_HEAD if self.has(HF_LM_HEAD) or not self.hparams.tied else HF_EMBEDDING


def checkpoint_source(ckpt: LatticeCheckpoint, origin: str = "checkpoint") -> VoxtralSource:
    files = ckpt.model_files
    tekken = json_file(files, "tekken.json", origin) if "tekken.json" in files else None
    tokenizer = json_file(files, "tokenizer.json", origin) if tekken is None or "tokenizer.json" in files else {}
    return VoxtralSource(json_file(files, "config.json", origin), tokenizer, feature_extractor_config(files, origin),
                         dict(ckpt.tensors), ckpt.quantized, dict(ckpt.aliases), tekken, origin)


def model_source(model: Any, processor: Any, origin: str = "model", tekken: dict | None = None) -> VoxtralSource:
    """A transformers VoxtralForConditionalGeneration and its VoxtralProcessor (a float model: F16 export)."""
    backend = getattr(processor.tokenizer, "backend_tokenizer", None)
    if backend is None and tekken is None:
        raise GGUFExportError(f"{origin}: the tokenizer is not a fast (tokenizers) tokenizer and no tekken.json given "
                              f"(load the processor with mistral_format=False)")
    floats = {k: v.detach() for k, v in model.state_dict().items()}
    return VoxtralSource(json.loads(model.config.to_json_string()),
                         json.loads(backend.to_str()) if backend is not None else {},
                         processor.feature_extractor.to_dict(), floats, tekken=tekken, origin=origin)


def as_source(source: Any) -> VoxtralSource:
    """A source from a VoxtralSource, LatticeCheckpoint, checkpoint directory or (model, processor)."""
    return as_model_source(source, VoxtralSource, checkpoint_source, model_source, model_items=(2,))


def float_model_source(directory: str) -> VoxtralSource:
    """A float transformers Voxtral directory (the export command's ``--model``); its tekken.json when it has one."""
    from transformers import VoxtralForConditionalGeneration, VoxtralProcessor

    try:
        model = VoxtralForConditionalGeneration.from_pretrained(directory, dtype=torch.float32).eval()
        processor = VoxtralProcessor.from_pretrained(directory, mistral_format=False)
    except (OSError, ValueError) as e:
        raise GGUFExportError(f"--model {directory}: cannot load it as a transformers Voxtral directory "
                              f"({e})") from None
    tekken_path = Path(directory) / "tekken.json"
    tekken = json.loads(tekken_path.read_text(encoding="utf-8")) if tekken_path.is_file() else None
    return model_source(model, processor, origin=directory, tekken=tekken)


# ------------------------------------------------------------------------------------------------------ tekken
@dataclass(frozen=True)
class TekkenVocab:
    pattern: str
    specials: list[str]  # rank = token id
    pieces: list[bytes]  # BPE rank r = token id n_specials + r

    def blob(self) -> bytes:
        """Per rank: u16 little-endian length, then the bytes (CrispASR's tokenizer.tekken.vocab layout)."""
        return b"".join(struct.pack("<H", len(p)) + p for p in self.pieces)


@functools.lru_cache(maxsize=1)
def _unicode_to_byte() -> dict[str, int]:
    """Inverse of GPT-2's bytes_to_unicode (the byte-level alphabet of tokenizers' ByteLevel)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    chars, n = list(printable), 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(printable, chars)}


def tekken_from_json(tekken: dict, origin: str) -> TekkenVocab:
    try:
        specials = sorted(tekken.get("special_tokens", []), key=lambda s: s["rank"])
        if [s["rank"] for s in specials] != list(range(len(specials))):
            raise GGUFExportError(f"{origin}: tekken.json special-token ranks are not 0..{len(specials) - 1}")
        vocab = sorted(tekken["vocab"], key=lambda v: v["rank"])
        pieces = [base64.b64decode(v["token_bytes"]) for v in vocab]
        return TekkenVocab(tekken.get("config", {}).get("pattern", ""), [s["token_str"] for s in specials], pieces)
    except (KeyError, TypeError, ValueError) as e:
        if isinstance(e, GGUFExportError):
            raise
        raise GGUFExportError(f"{origin}: tekken.json is not a Tekken tokenizer ({e!r})") from None


def tekken_from_tokenizer(tokenizer: dict, origin: str) -> TekkenVocab:
    """The Tekken vocabulary back from transformers' conversion of tekken.json: special tokens at ids 0..n-1, then
    byte-level BPE pieces at ids n + rank."""
    model = tokenizer.get("model", {})
    if model.get("type") != "BPE" or not model.get("vocab"):
        raise GGUFExportError(f"{origin}: tokenizer.json is not a byte-level BPE (a converted tekken.json)")
    added = {a["id"]: a["content"] for a in tokenizer.get("added_tokens", []) if a.get("special", True)}
    n_specials = 0
    while n_specials in added:
        n_specials += 1
    if n_specials == 0 or len(added) != n_specials:
        raise GGUFExportError(f"{origin}: tokenizer.json special tokens are not ids 0..n-1 (not a Tekken tokenizer)")
    by_id = {i: t for t, i in model["vocab"].items() if i >= n_specials}
    if sorted(by_id) != list(range(n_specials, n_specials + len(by_id))):
        raise GGUFExportError(f"{origin}: tokenizer.json BPE ids are not contiguous after the {n_specials} specials")
    table = _unicode_to_byte()
    try:
        pieces = [bytes(table[c] for c in by_id[i]) for i in sorted(by_id)]
    except KeyError as e:
        raise GGUFExportError(f"{origin}: tokenizer.json holds a character {e} outside the byte-level alphabet") from None
    return TekkenVocab(_split_pattern(tokenizer), [added[i] for i in range(n_specials)], pieces)


def _split_pattern(tokenizer: dict) -> str:
    pre = tokenizer.get("pre_tokenizer") or {}
    for p in [pre, *pre.get("pretokenizers", [])]:
        if p.get("type") == "Split" and isinstance(p.get("pattern"), dict):
            return p["pattern"].get("Regex", "")
    return ""


# ------------------------------------------------------------------------------------------- front end, tables
def front_end(source: VoxtralSource) -> dict[str, np.ndarray]:
    """Mel filters [201, 128], analysis window [400] (the model's WhisperFeatureExtractor) and the Tekken blob."""
    from transformers import WhisperFeatureExtractor

    fe = source.feature_extractor
    kwargs = {k: fe[k] for k in ("feature_size", "sampling_rate", "hop_length", "chunk_length", "n_fft") if k in fe}
    extractor = WhisperFeatureExtractor(**kwargs)
    filters = np.ascontiguousarray(extractor.mel_filters, dtype=np.float32)
    if extractor.n_fft != RUNTIME_FFT or filters.shape != (RUNTIME_FFT // 2 + 1, RUNTIME_MELS):
        raise GGUFExportError(f"{source.origin}: mel filters {filters.shape} ({extractor.n_fft}-point FFT); {RUNTIME} "
                              f"computes {RUNTIME_MELS} mel bins from a {RUNTIME_FFT}-point FFT (hard-coded)")
    window = torch.hann_window(extractor.n_fft).numpy().astype(np.float32)
    blob = np.frombuffer(source.vocab.blob(), dtype=np.uint8).astype(np.float32)  # one float per byte, exact
    return {MEL_FILTERS: filters, MEL_WINDOW: window, VOCAB_TENSOR: blob}


def model_metadata(h: VoxtralHParams, source: VoxtralSource) -> list[KV]:
    u32, string = GGUFValueType.UINT32, GGUFValueType.STRING
    front, llm = front_end_and_llm_keys(source.feature_extractor, h.n_mels,
                                        (h.audio_layers, h.audio_d_model, h.audio_heads, h.audio_ffn), h)
    values = [
        *front, ("audio.max_pos", h.audio_positions, u32),
        ("proj.in_dim", FRAME_STACK * h.audio_d_model, u32), ("proj.out_dim", h.text_hidden, u32),
        ("proj.frame_stack", FRAME_STACK, u32), *llm,
        ("audio_token_id", h.audio_token_id, u32),
    ]
    vocab = source.vocab
    return [KV(f"{ARCH}.{k}", v, t) for k, v, t in values] + [
        KV("tokenizer.tekken.pattern", vocab.pattern, string),
        KV("tokenizer.tekken.specials", vocab.specials, string, True),
        KV("tokenizer.tekken.n_specials", len(vocab.specials), u32),
        KV("tokenizer.tekken.n_vocab", len(vocab.pieces), u32)]


# ------------------------------------------------------------------------------------------- the tensor table
def voxtral_slots(h: VoxtralHParams, output_name: str = HF_LM_HEAD) -> list[TensorSlot]:
    """Every model tensor of the file, in the order written."""
    d, a = h.audio_d_model, HF_AUDIO
    slots = [TensorSlot("audio.conv.1.weight", f"{a}.conv1.weight", ROLE_CONV, (d, h.n_mels, 3)),
             TensorSlot("audio.conv.1.bias", f"{a}.conv1.bias", ROLE_F32, (d,)),
             TensorSlot("audio.conv.2.weight", f"{a}.conv2.weight", ROLE_CONV, (d, d, 3)),
             TensorSlot("audio.conv.2.bias", f"{a}.conv2.bias", ROLE_F32, (d,)),
             TensorSlot("audio.embed_positions", f"{a}.embed_positions.weight", ROLE_F32, (h.audio_positions, d))]
    shapes = {"attn_q": (d, d), "attn_k": (d, d), "attn_v": (d, d), "attn_out": (d, d), "ffn_up": (h.audio_ffn, d),
              "ffn_down": (d, h.audio_ffn)}
    for i in range(h.audio_layers):
        prefix, hf = f"audio.blk.{i}", f"{a}.layers.{i}"
        for part, norm in AUDIO_NORMS.items():
            slots += [TensorSlot(f"{prefix}.{part}.{p}", f"{hf}.{norm}.{p}", ROLE_F32, (d,)) for p in ("weight", "bias")]
        for part, shape in shapes.items():
            slots.append(TensorSlot(f"{prefix}.{part}.weight", f"{hf}.{AUDIO_PARTS[part]}.weight", ROLE_MATRIX, shape))
            if part != "attn_k":  # Whisper's k_proj has no bias
                slots.append(TensorSlot(f"{prefix}.{part}.bias", f"{hf}.{AUDIO_PARTS[part]}.bias", ROLE_F32,
                                        (shape[0],)))
    slots += [TensorSlot(f"audio.ln_post.{p}", f"{a}.layer_norm.{p}", ROLE_F32, (d,)) for p in ("weight", "bias")]
    slots += [TensorSlot("proj1.weight", f"{HF_PROJECTOR}.linear_1.weight", ROLE_MATRIX,
                         (h.text_hidden, FRAME_STACK * d)),
              TensorSlot("proj2.weight", f"{HF_PROJECTOR}.linear_2.weight", ROLE_MATRIX, (h.text_hidden, h.text_hidden))]
    slots.append(TensorSlot("token_embd.weight", HF_EMBEDDING, ROLE_MATRIX, (h.vocab_size, h.text_hidden)))
    hidden, q_width, kv_width = h.text_hidden, h.text_heads * h.head_dim, h.text_kv_heads * h.head_dim
    text_shapes = {"attn_norm": (hidden,), "attn_q": (q_width, hidden), "attn_k": (kv_width, hidden),
                   "attn_v": (kv_width, hidden), "attn_output": (hidden, q_width), "ffn_norm": (hidden,),
                   "ffn_gate": (h.text_ffn, hidden), "ffn_up": (h.text_ffn, hidden), "ffn_down": (hidden, h.text_ffn)}
    for i in range(h.text_layers):
        slots += [TensorSlot(f"blk.{i}.{part}.weight", f"{HF_TEXT}.layers.{i}.{TEXT_PARTS[part]}.weight",
                             ROLE_MATRIX if len(shape) == 2 else ROLE_F32, shape)
                  for part, shape in text_shapes.items()]
    slots.append(TensorSlot("output_norm.weight", f"{HF_TEXT}.norm.weight", ROLE_F32, (hidden,)))
    slots.append(TensorSlot("output.weight", output_name, ROLE_MATRIX, (h.vocab_size, hidden)))
    return slots


# ------------------------------------------------------------------------------------------------ build, verify
def build_crispasr_voxtral(source: Any, target: str | None = None) -> GGUFModel:
    """Pack every tensor (``target``: f16 or a lattice type; default the lattice's own type, a per-tensor mix kept
    tensor by tensor; f16 for a float model). Raises GGUFExportError / LatticeNotRepresentable naming the tensor
    before anything is written."""
    source = as_source(source)
    h = source.hparams
    h.check_runtime(source.origin)
    weight_type = weight_type_of(target or default_target(source))
    slots = voxtral_slots(h, source.output_name)
    check_nothing_left_over(source, slots, TARGET)
    kv = file_kv(MODEL_NAME, weight_type) + model_metadata(h, source)
    tables = [PackedTensor(name, GGMLType.F32, values.shape, values) for name, values in front_end(source).items()]
    return GGUFModel(ARCH, kv, tables + pack_tensors(slots, source, weight_type))


def export_crispasr_voxtral(source: Any, out_path: str | os.PathLike, target: str | None = None) -> Path:
    """Export a LatticeCheckpoint, a checkpoint directory or (model, processor); written to a temporary name and
    renamed when complete."""
    return write_gguf(build_crispasr_voxtral(source, target), out_path)


def export_summary(built: GGUFModel, out: Path) -> str:
    types = sorted({GGML_TYPE_NAMES[t.ggml_type] for t in built.tensors})
    return f"crispasr Voxtral GGUF ({'/'.join(types)}), {len(built.tensors)} tensors, {out.stat().st_size / 1e6:.1f} MB"


def verify(model_file: str | os.PathLike, checkpoint: str | os.PathLike | LatticeCheckpoint) -> dict[str, float]:
    """Decode every tensor with gguf-py and compare it with the checkpoint's exact values (s * q for lattice weights),
    the front-end tables and the Tekken blob; max |diff| per array (0.0 everywhere for an exact export)."""
    model = read_gguf(model_file)
    if model.arch != ARCH:
        raise GGUFVerifyError(f"{model_file}: architecture {model.arch!r}, not a CrispASR Voxtral file ({ARCH!r})")
    ckpt, origin = as_checkpoint(checkpoint)
    source = checkpoint_source(ckpt, origin=origin)
    h = source.hparams
    check_metadata(model, model_metadata(h, source), STRUCTURAL_KEYS, origin)
    diffs = {}
    for name, values in front_end(source).items():
        if name not in model.tensors:
            raise GGUFVerifyError(f"{model_file}: tensor {name} missing")
        diffs[name] = max_abs_diff(model.dequantize(name), values)
    diffs.update(compare_tensors(model, voxtral_slots(h, source.output_name), CheckpointValues(ckpt), origin))
    return diffs


def describe_voxtral_gguf(path: str | os.PathLike) -> tuple[str, str, dict]:
    """(backbone name, precision, details) of a CrispASR Voxtral GGUF."""
    from .gguf_file import GGUFFileError, file_types

    model = read_gguf(path)
    if model.arch != ARCH:
        raise GGUFFileError(path, f"architecture {model.arch!r}, expected {ARCH!r}")
    dims = tuple(model.integer(key) for key in SIZE_KEYS)
    name = "voxtral-mini-3b" if dims == (32, 1280, 30, 3072) else f"voxtral-a{dims[0]}x{dims[1]}-t{dims[2]}x{dims[3]}"
    precision, counts = file_types(model)
    details = {"arch": ARCH, "audio_layers": dims[0], "audio_d_model": dims[1], "text_layers": dims[2],
               "text_hidden": dims[3], "tensor_types": counts}
    return name, precision, details


def export_voxtral_gguf(target: str, checkpoint: str | None, model: str | None, weight_type: str | None,
                        out_path: str | os.PathLike) -> tuple[Path, str]:
    """The export command for ``--target crispasr`` of a Voxtral source: a lattice checkpoint directory or a float
    transformers Voxtral directory (``model``); returns the path and a one-line summary."""
    if target != TARGET:
        raise GGUFExportError(f"--target {target}: Voxtral exports to a GGUF only for {TARGET}")
    if (checkpoint is None) == (model is None):
        raise GGUFExportError("give either CHECKPOINT_DIR or --model SOURCE (exactly one)")
    source = as_source(checkpoint) if checkpoint is not None else float_model_source(model)
    built = build_crispasr_voxtral(source, weight_type)
    out = write_gguf(built, out_path)
    return out, export_summary(built, out)
