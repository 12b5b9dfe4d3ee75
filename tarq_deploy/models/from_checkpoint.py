"""A transformers Whisper model whose weights are a lattice checkpoint's exact values (for evaluation in PyTorch)."""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch
from transformers import GenerationConfig, WhisperConfig, WhisperForConditionalGeneration, WhisperProcessor

from ..checkpoint import LatticeCheckpoint, load_checkpoint


def load_dequantized_whisper(checkpoint: str | Path | LatticeCheckpoint, dtype: torch.dtype = torch.float32):
    """(model, processor, generation_config) with every lattice weight replaced by s * q; the tied token embedding
    and output projection are the same lattice matrix, as in the exported runtime file."""
    ckpt = checkpoint if isinstance(checkpoint, LatticeCheckpoint) else load_checkpoint(checkpoint)
    with tempfile.TemporaryDirectory() as tmp:
        for name, data in ckpt.model_files.items():
            (Path(tmp) / name).parent.mkdir(parents=True, exist_ok=True)
            (Path(tmp) / name).write_bytes(data)
        config = WhisperConfig.from_pretrained(tmp)
        processor = WhisperProcessor.from_pretrained(tmp)
        generation_config = GenerationConfig.from_pretrained(tmp)
    model = WhisperForConditionalGeneration(config)
    state = ckpt.dequantized_state_dict()
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [m for m in missing if m not in state]
    if missing or unexpected:
        raise ValueError(f"checkpoint does not fit the Whisper architecture: missing {missing[:5]}, "
                         f"unexpected {unexpected[:5]}")
    model.generation_config = generation_config
    return model.to(dtype).eval(), processor, generation_config
