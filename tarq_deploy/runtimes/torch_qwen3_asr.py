"""transformers Qwen3-ASR in PyTorch: a float transformers directory or a lattice checkpoint (dequantized to s * q).

Greedy, prefilling "language English<asr_text>" (as transformers' ``apply_transcription_request`` and CrispASR do).
It claims Qwen3-ASR checkpoints and transformers directories (the registry asks it before the Whisper fallback).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from ..errors import UserError
from ..model_source import ModelSource, SourceKind, resolve_source
from .base import DecodeOptions, ModelSpec, RuntimeAdapter, torch_stack_info

if TYPE_CHECKING:
    import numpy as np

NAME = "qwen3-asr-torch"
QWEN3_ASR_TYPE = "qwen3_asr"  # the model_type of its config.json (models.qwen3_asr.ARCHITECTURE, not imported: torch)


def is_qwen3_asr_source(source: str | ModelSource) -> bool:
    """A Qwen3-ASR transformers folder or lattice checkpoint (by the model_type its config says)."""
    found = resolve_source(source)
    return found.kind in (SourceKind.TRANSFORMERS, SourceKind.CHECKPOINT) and found.model_type == QWEN3_ASR_TYPE


class Qwen3ASRTorchTranscriber:
    """Greedy transcription with transformers' Qwen3-ASR, one utterance at a time."""

    def __init__(self, model, processor, options: DecodeOptions, origin: dict) -> None:
        import torch

        from ..models.qwen3_asr import Qwen3ASRBackbone

        torch.set_num_threads(options.threads)
        self.backbone = Qwen3ASRBackbone(model, processor, options.device)
        self.max_new_tokens = options.max_new_tokens
        self.origin = {**origin, "threads": options.threads, "device": options.device, "language": "en",
                       "max_new_tokens": options.max_new_tokens}

    def transcribe(self, audio: "np.ndarray", utterance_id: str) -> str:
        return self.backbone.transcribe(audio, self.max_new_tokens)

    def describe(self) -> dict:
        return self.origin

    def close(self) -> None:
        self.backbone = None  # type: ignore[assignment]


def open_torch_qwen3_asr(spec: ModelSpec, options: DecodeOptions) -> Qwen3ASRTorchTranscriber:
    from ..models.qwen3_asr import load_dequantized_qwen3_asr, load_qwen3_asr

    source = spec.source
    try:
        if resolve_source(source).kind is SourceKind.CHECKPOINT:
            return Qwen3ASRTorchTranscriber(*load_dequantized_qwen3_asr(source), options,
                                            {"loaded_as": "Qwen3-ASR lattice checkpoint, dequantized (s * q)"})
        return Qwen3ASRTorchTranscriber(*load_qwen3_asr(source), options, {"loaded_as": "Qwen3-ASR float model"})
    except (ValueError, OSError) as error:
        raise UserError(f"model {spec.label!r} ({source}): cannot load it as a Qwen3-ASR model: {error}") from None


ADAPTER = RuntimeAdapter(NAME, "transformers Qwen3-ASR (float directory or lattice checkpoint dequantized)",
                         is_qwen3_asr_source, open_torch_qwen3_asr, torch_stack_info)
