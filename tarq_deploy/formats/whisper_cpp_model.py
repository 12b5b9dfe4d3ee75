"""A float whisper.cpp model file (ggml F16 or F32 matrices) as a transformers Whisper: (model, processor, generation
config), everything taken from the file, for every command that loads a Whisper source (formats/model_loader.py).

What comes from where:

* config: the header's dimensions (the MLP 4 x d_model wide, as whisper.cpp fixes it);
* weights: every tensor of ``ggml_file.tensor_slots``, in the file's precision; dtype "stored" keeps an F16 file in
  float16 when its F32 tensors (norms, biases, positional tables) hold float16 values only, as every file converted
  from float16 weights does, and takes float32 otherwise, so that nothing is rounded;
* tokenizer: the stored text tokens, merges derived from their ranks, control tokens by n_vocab (models/whisper_tokens);
* features: the stored mel filters are checked against the Slaney filters transformers' WhisperFeatureExtractor
  computes (what whisper.cpp's converters store) and the standard extractor is used, so features are those of the
  transformers and CTranslate2 copies of the model;
* generation config: the suppressed tokens follow from the tokenizer; the alignment heads are those of the stock model
  with the file's dimensions (whisper.cpp's own presets), as the model's own files have none.

A quantized file is refused at once: its weights are rounded already, and a model source is quantized from floats.
"""
from __future__ import annotations

import json
import logging
import os

import numpy as np
import torch
from tokenizers import Tokenizer
from transformers import (GenerationConfig, WhisperConfig, WhisperFeatureExtractor, WhisperForConditionalGeneration,
                          WhisperProcessor, WhisperTokenizer)

from tarq_deploy.models.ct2 import (START_OF_TRANSCRIPT, build_generation_config, build_processor, instantiate_model,
                                    whisper_tokenizer)
from tarq_deploy.models.whisper_tokens import (ControlTokens, begin_suppressed_tokens, suppressed_tokens, text_tokens,
                                               tokenizer_json)

from .ggml_blocks import GGML_TYPE_NAMES, GGMLType
from .ggml_file import GGMLFileError, WhisperCppFile, WhisperHParams, read_whisper_cpp, tensor_slots

__all__ = ["STOCK_ALIGNMENT_HEADS", "load_whisper_cpp", "read_float_whisper_cpp"]

log = logging.getLogger(__name__)

FLOAT_TYPES = {GGMLType.F16: np.dtype("<f2"), GGMLType.F32: np.dtype("<f4")}
STORED = "stored"  # formats/model_loader.py's dtype for "as the source stores its weights"
# The feature extractor makes 30 s windows of 3000 frames, which the encoder's stride-2 convolution halves: every
# Whisper's n_audio_ctx (transformers checks the frame count against it at the first forward).
AUDIO_CTX = 1500
# Stored filters and transformers' agree to float32 rounding (librosa computes in float32, transformers in float64:
# a few units in the last place of values up to 0.03); any other filter design differs by orders of magnitude more.
MEL_FILTER_TOLERANCE = 1e-6

# Alignment heads (decoder layer, head) of the stock Whisper models, keyed by (d_model, encoder layers, decoder
# layers, n_vocab, n_mels): whisper.cpp 1.8.5's presets (g_aheads in libwhisper), which equal the packaged tiny.en's
# and base's config.json. large-v1 and large-v2 share every dimension, so no entry can tell them apart.
STOCK_ALIGNMENT_HEADS: dict[tuple[int, int, int, int, int], tuple[tuple[int, int], ...]] = {
    # tiny.en, tiny
    (384, 4, 4, 51864, 80): ((1, 0), (2, 0), (2, 5), (3, 0), (3, 1), (3, 2), (3, 3), (3, 4)),
    (384, 4, 4, 51865, 80): ((2, 2), (3, 0), (3, 2), (3, 3), (3, 4), (3, 5)),
    # base.en, base
    (512, 6, 6, 51864, 80): ((3, 3), (4, 7), (5, 1), (5, 5), (5, 7)),
    (512, 6, 6, 51865, 80): ((3, 1), (4, 2), (4, 3), (4, 7), (5, 1), (5, 2), (5, 4), (5, 6)),
    # small.en, small
    (768, 12, 12, 51864, 80): ((6, 6), (7, 0), (7, 3), (7, 8), (8, 2), (8, 5), (8, 7), (9, 0), (9, 4), (9, 8),
                               (9, 10), (10, 0), (10, 1), (10, 2), (10, 3), (10, 6), (10, 11), (11, 2), (11, 4)),
    (768, 12, 12, 51865, 80): ((5, 3), (5, 9), (8, 0), (8, 4), (8, 7), (8, 8), (9, 0), (9, 7), (9, 9), (10, 5)),
    # medium.en, medium
    (1024, 24, 24, 51864, 80): ((11, 4), (14, 1), (14, 12), (14, 14), (15, 4), (16, 0), (16, 4), (16, 9), (17, 12),
                                (17, 14), (18, 7), (18, 10), (18, 15), (20, 0), (20, 3), (20, 9), (20, 14), (21, 12)),
    (1024, 24, 24, 51865, 80): ((13, 15), (15, 4), (15, 15), (16, 1), (20, 0), (23, 4)),
    # large-v3, large-v3-turbo
    (1280, 32, 32, 51866, 128): ((7, 0), (10, 17), (12, 18), (13, 12), (16, 1), (17, 14), (19, 11), (21, 4),
                                 (24, 1), (25, 6)),
    (1280, 32, 4, 51866, 128): ((2, 4), (2, 11), (3, 3), (3, 6), (3, 11), (3, 14)),
}

WhisperBundle = tuple[WhisperForConditionalGeneration, WhisperProcessor, GenerationConfig]


def read_float_whisper_cpp(path: str | os.PathLike) -> WhisperCppFile:
    """The parsed file when its weight matrices are F16 or F32; GGMLFileError (a UserError: exit 2) naming the file
    and the type otherwise. Parsing maps the file and reads only headers: cheap enough to check before any work."""
    model_file = read_whisper_cpp(path)
    weight_type = model_file.hparams.weight_type
    if weight_type not in FLOAT_TYPES:
        raise GGMLFileError(model_file.path, f"its weight matrices are {GGML_TYPE_NAMES[weight_type]}, a quantized "
                                             f"whisper.cpp file; a model source must hold float weights (F16 or F32), "
                                             f"e.g. the F16 file it was quantized from")
    return model_file


def load_whisper_cpp(path: str | os.PathLike, dtype: torch.dtype | str = torch.float32) -> WhisperBundle:
    """(model, processor, generation config) of a float whisper.cpp model file; ``dtype`` "stored" keeps the file's
    precision (see the module docstring). Every problem with the file is a GGMLFileError naming it."""
    model_file = read_float_whisper_cpp(path)
    h = model_file.hparams
    _check_dimensions(model_file)
    _check_mel_filters(model_file)
    control, tokenizer = _tokenizer(model_file)  # the slow part (~2 s): after every cheap check
    pieces = _generation_pieces(tokenizer, control, h)
    config = _whisper_config(h, control, pieces)
    arrays = _hf_arrays(model_file)
    if dtype == STORED:
        dtype = _stored_dtype(model_file, arrays)
    model = instantiate_model(config, arrays, dtype, model_file.path)
    generation_config = build_generation_config(config, control.ids, {i: n for n, i in control.ids.items()}, pieces)
    model.generation_config = generation_config
    return model, build_processor(tokenizer, h.n_mels), generation_config


def _check_dimensions(model_file: WhisperCppFile) -> None:
    """What the tensor shapes do not fix: whole heads, and the 1500 encoder positions of a 30 s window."""
    h = model_file.hparams
    problems = [f"{side} width {h.n_audio_state} is not a multiple of its {heads} heads"
                for side, heads in (("encoder", h.n_audio_head), ("decoder", h.n_text_head)) if h.n_audio_state % heads]
    if h.n_audio_ctx != AUDIO_CTX:
        problems.append(f"n_audio_ctx {h.n_audio_ctx} is not Whisper's {AUDIO_CTX} (30 s windows)")
    if problems:
        raise GGMLFileError(model_file.path, f"bad header: {'; '.join(problems)}")


# ----------------------------------------------------------------------------------------------------- weights
def _hf_arrays(model_file: WhisperCppFile) -> dict[str, np.ndarray]:
    """Every tensor by its transformers name, as the file stores it (views of the memory map)."""
    arrays = {}
    for slot in tensor_slots(model_file.hparams):
        record = model_file.tensors[slot.name]
        values = model_file.raw(slot.name).view(FLOAT_TYPES[GGMLType(record.ggml_type)]).reshape(record.shape)
        # whisper.cpp stores the conv biases as [d, 1] columns (added to [d, frames]); every transformers bias is 1-D
        arrays[slot.hf_name] = values.reshape(-1) if slot.hf_name.endswith(".bias") else values
    return arrays


def _stored_dtype(model_file: WhisperCppFile, arrays: dict[str, np.ndarray]) -> torch.dtype:
    """float16 for an F16 file whose F32 tensors all hold float16 values (so none is rounded), else float32."""
    if model_file.hparams.weight_type != GGMLType.F16:
        return torch.float32
    for values in arrays.values():
        if values.dtype == np.float32 and not np.array_equal(values.astype(np.float16).astype(np.float32), values):
            return torch.float32
    return torch.float16


# ---------------------------------------------------------------------------------------- tokens and features
def _tokenizer(model_file: WhisperCppFile) -> tuple[ControlTokens, WhisperTokenizer]:
    """(the control-token layout, the WhisperTokenizer) of the file's vocabulary."""
    h = model_file.hparams
    try:
        control = ControlTokens.for_vocab_size(h.n_vocab)
        spec = tokenizer_json(text_tokens(model_file.vocab, control), control)
    except ValueError as e:
        raise GGMLFileError(model_file.path, f"bad vocabulary: {e}") from None
    backend = Tokenizer.from_str(json.dumps(spec, ensure_ascii=False))
    try:
        return control, whisper_tokenizer(backend, list(control.names), h.n_vocab, model_file.path)
    except ValueError as e:
        raise GGMLFileError(model_file.path, f"bad vocabulary: {e}") from None


def _check_mel_filters(model_file: WhisperCppFile) -> None:
    """The stored filters are the Slaney filters transformers computes for n_mels bands (to float32 rounding), so the
    standard WhisperFeatureExtractor gives the features whisper.cpp computes with them."""
    expected = np.asarray(WhisperFeatureExtractor(feature_size=model_file.hparams.n_mels).mel_filters).T
    deviation = float(np.abs(model_file.mel_filters.astype(np.float64) - expected).max())
    if not deviation <= MEL_FILTER_TOLERANCE:
        raise GGMLFileError(model_file.path, f"its mel filters differ from Whisper's Slaney filters by up to "
                                             f"{deviation:.3g}; only the standard filters are supported")


# ------------------------------------------------------------------------------------- config and generation
def _generation_pieces(tokenizer: WhisperTokenizer, control: ControlTokens, h: WhisperHParams) -> dict:
    """What a CTranslate2 config.json holds for generation (ct2.build_generation_config reads these keys)."""
    def encode(text: str) -> list[int]:
        return tokenizer.backend_tokenizer.encode(text, add_special_tokens=False).ids

    ids = control.ids
    return {"suppress_ids": suppressed_tokens(encode, control),
            "suppress_ids_begin": begin_suppressed_tokens(encode, control),
            "alignment_heads": [list(pair) for pair in alignment_heads(h)],
            "lang_ids": [ids[name] for name in control.languages]}


def alignment_heads(h: WhisperHParams) -> tuple[tuple[int, int], ...]:
    """The stock model's alignment heads for these dimensions; for any other model (large-v1/v2, a fine-tune of
    other dimensions) every head of the decoder's second half, the usual default where none are known."""
    key = (h.n_audio_state, h.n_audio_layer, h.n_text_layer, h.n_vocab, h.n_mels)
    if key in STOCK_ALIGNMENT_HEADS:
        return STOCK_ALIGNMENT_HEADS[key]
    log.warning("whisper.cpp model of dimensions %s: no known alignment heads; using every head of the last %d "
                "decoder layers", key, h.n_text_layer - h.n_text_layer // 2)
    return tuple((layer, head) for layer in range(h.n_text_layer // 2, h.n_text_layer)
                 for head in range(h.n_text_head))


def _whisper_config(h: WhisperHParams, control: ControlTokens, pieces: dict) -> WhisperConfig:
    """The transformers config of the header's dimensions, with the ids and token lists the CTranslate2 import sets
    (ct2.build_whisper_config), so that both give the same config.json for the same model."""
    end_of_text = control.end_of_text
    return WhisperConfig(
        vocab_size=h.n_vocab, d_model=h.n_audio_state, num_mel_bins=h.n_mels,
        encoder_layers=h.n_audio_layer, decoder_layers=h.n_text_layer,
        encoder_attention_heads=h.n_audio_head, decoder_attention_heads=h.n_text_head,
        encoder_ffn_dim=4 * h.n_audio_state, decoder_ffn_dim=4 * h.n_text_state,
        max_source_positions=h.n_audio_ctx, max_target_positions=h.n_text_ctx,
        pad_token_id=end_of_text, bos_token_id=end_of_text, eos_token_id=end_of_text,
        decoder_start_token_id=control.ids[START_OF_TRANSCRIPT],
        suppress_tokens=list(pieces["suppress_ids"]), begin_suppress_tokens=list(pieces["suppress_ids_begin"]),
        tie_word_embeddings=True,
    )
