"""Pick the backbone adapter for a model source: Whisper (any source load_whisper takes) or Voxtral (a local or hub
transformers directory whose config says ``voxtral``)."""

from __future__ import annotations

import json
from pathlib import Path

from .loader import load_whisper


def model_type(source: str) -> str:
    """The config's model_type for a local transformers directory; "whisper" for every other source."""
    config = Path(source).expanduser() / "config.json"
    if config.is_file():
        try:
            return str(json.loads(config.read_text()).get("model_type", "whisper"))
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise ValueError(f"{config}: not valid JSON") from None
    return "voxtral" if "voxtral" in source.lower() else "whisper"


def is_whisper_source(source: str) -> bool:
    """Whether ``source`` is a Whisper model by model_type; a config.json that is not JSON counts as not Whisper (the
    command that loads it names the problem)."""
    try:
        return model_type(source) == "whisper"
    except ValueError:
        return False


def load_backbone(source: str, device: str = "cpu", head_identity_weight: float = 1.0,
                  quantize_audio_tower: bool = False):
    kind = model_type(source)
    if kind == "voxtral":
        import torch
        from transformers import VoxtralForConditionalGeneration, VoxtralProcessor

        from .voxtral import VoxtralBackbone

        model = VoxtralForConditionalGeneration.from_pretrained(source, dtype=torch.float32)
        processor = VoxtralProcessor.from_pretrained(source, mistral_format=False)
        return VoxtralBackbone(model, processor, device, quantize_audio_tower=quantize_audio_tower)
    if kind == "qwen3_asr":
        from .qwen3_asr import load_qwen3_asr_backbone

        return load_qwen3_asr_backbone(source, device, head_identity_weight)
    if kind != "whisper":
        raise ValueError(f"{source}: model type {kind!r} is not supported (whisper, voxtral, qwen3_asr)")
    from .whisper import WhisperBackbone

    model, processor, generation_config = load_whisper(source)
    return WhisperBackbone(model, processor, generation_config, device, head_identity_weight)
