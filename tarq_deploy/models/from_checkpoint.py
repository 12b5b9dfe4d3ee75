"""A transformers Whisper model whose weights are a lattice checkpoint's exact values (for evaluation in PyTorch)."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import GenerationConfig, WhisperConfig, WhisperForConditionalGeneration, WhisperProcessor

from ..checkpoint import LatticeCheckpoint, load_checkpoint
from .common import load_lattice_weights, model_files_dir

__all__ = ["load_dequantized_whisper"]


def load_dequantized_whisper(checkpoint: str | Path | LatticeCheckpoint, dtype: torch.dtype = torch.float32):
    """(model, processor, generation_config) with every lattice weight replaced by s * q; the tied token embedding
    and output projection are the same lattice matrix, as in the exported runtime file."""
    ckpt = checkpoint if isinstance(checkpoint, LatticeCheckpoint) else load_checkpoint(checkpoint)
    with model_files_dir(ckpt) as tmp:
        config = WhisperConfig.from_pretrained(tmp)
        processor = WhisperProcessor.from_pretrained(tmp)
        generation_config = GenerationConfig.from_pretrained(tmp)
    model = WhisperForConditionalGeneration(config)
    load_lattice_weights(model, ckpt, "Whisper")
    model.generation_config = generation_config
    return model.to(dtype).eval(), processor, generation_config
