"""Pick the backbone adapter (models/) for a model source: Whisper (any source load_whisper takes, a whisper.cpp file
among them: so this module sits with the formats it reads), Voxtral or Qwen3-ASR (a local or hub transformers
directory whose config says so)."""

from __future__ import annotations

import sys

from ..model_source import ModelSource, resolve_source
from .model_loader import load_whisper

__all__ = ["is_whisper_source", "load_backbone", "model_type"]


def model_type(source: str | ModelSource) -> str:
    """The model type a backbone is picked by (ModelSource.assumed_model_type); ValueError naming a config.json that
    is not JSON."""
    found = resolve_source(source)
    if found.config_error is not None:
        raise ValueError(found.config_error)
    return found.assumed_model_type


def is_whisper_source(source: str | ModelSource) -> bool:
    """Whether ``source`` is a Whisper model by model_type; a config.json that is not JSON counts as not Whisper (the
    command that loads it names the problem)."""
    try:
        return model_type(source) == "whisper"
    except ValueError:
        return False


def load_backbone(source: str | ModelSource, device: str = "cpu", head_identity_weight: float = 1.0,
                  quantize_audio_tower: bool = False):
    # Every backbone is held in the precision its source stores (a bfloat16 Voxtral-Mini-3B is 9.4 GB, 19 GB in
    # float32); calibration widens one module at a time to float32 (quant/precision.py), so the arithmetic and the
    # lattice are those of a float32 copy.
    found = resolve_source(source)
    kind, text = model_type(found), found.text
    if kind == "voxtral":
        import torch
        from transformers import VoxtralForConditionalGeneration, VoxtralProcessor

        from ..models.voxtral import VoxtralBackbone

        model = VoxtralForConditionalGeneration.from_pretrained(text, dtype="auto")
        processor = VoxtralProcessor.from_pretrained(text, mistral_format=False)
        return VoxtralBackbone(model, processor, device, quantize_audio_tower=quantize_audio_tower)
    if kind == "qwen3_asr":
        from ..models.qwen3_asr import load_qwen3_asr_backbone

        return load_qwen3_asr_backbone(text, device, head_identity_weight, dtype="auto")
    if kind != "whisper":
        raise ValueError(f"{text}: model type {kind!r} is not supported (whisper, voxtral, qwen3_asr)")
    from .model_loader import STORED
    from ..models.whisper import WhisperBackbone, round_conv_kernels_to_f16

    model, processor, generation_config = load_whisper(found, dtype=STORED)
    rounded = round_conv_kernels_to_f16(model)
    if rounded:
        print(f"{text}: {rounded} convolution kernel values rounded to fp16, as every runtime file stores them",
              file=sys.stderr)
    return WhisperBackbone(model, processor, generation_config, device, head_identity_weight)
