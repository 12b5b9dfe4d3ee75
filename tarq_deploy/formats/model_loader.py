"""One entry point for Whisper checkpoints, wherever they come from.

``load_whisper(source)`` accepts:

* ``packaged:NAME`` -- real weights shipped in pip packages (see :mod:`tarq_deploy.models.packaged`);
* a local CTranslate2 / faster-whisper directory (``model.bin`` + ``config.json`` + ``tokenizer.json``);
* a local transformers directory (``config.json`` of a Whisper model + safetensors / PyTorch weights);
* a float whisper.cpp model file (``ggml-base.bin``: F16 or F32 matrices), tokenizer and all from the file
  (:mod:`tarq_deploy.formats.whisper_cpp_model`; a quantized one is refused);
* anything else: a Hugging Face Hub id, loaded with ``from_pretrained``.

Which of these a source is, tarq_deploy.model_source decides. Since it reads file formats (a whisper.cpp file through
formats/whisper_cpp_model.py), this module and formats/backbones.py above it are filed in formats/, the layer they
belong to, and the model adapters in models/ import nothing from formats/ (tests/test_layers.py).
"""

from __future__ import annotations

import torch
from transformers import GenerationConfig, WhisperForConditionalGeneration, WhisperProcessor

from tarq_deploy.formats.whisper_cpp_model import load_whisper_cpp
from tarq_deploy.model_source import ModelSource, SourceKind, resolve_source
from tarq_deploy.models.ct2 import load_ct2_whisper
from tarq_deploy.models.packaged import resolve_packaged

__all__ = ["STORED", "load_whisper"]

WHISPER_MODEL_TYPE = "whisper"

WhisperBundle = tuple[WhisperForConditionalGeneration, WhisperProcessor, GenerationConfig]


def is_transformers_whisper(found: ModelSource) -> bool:
    """A transformers folder whose config says Whisper and that holds weights."""
    return found.kind is SourceKind.TRANSFORMERS and found.model_type == WHISPER_MODEL_TYPE and found.has_weights


STORED = "stored"  # load_whisper's dtype for "as the source stores its weights"
Dtype = torch.dtype | str


def _load_transformers(name_or_path: str, dtype: Dtype) -> WhisperBundle:
    dtype = "auto" if dtype == STORED else dtype  # transformers' name for the dtype the checkpoint stores
    model = WhisperForConditionalGeneration.from_pretrained(name_or_path, dtype=dtype).eval()
    processor = WhisperProcessor.from_pretrained(name_or_path)
    return model, processor, model.generation_config


def _load_local(found: ModelSource, dtype: Dtype) -> WhisperBundle:
    path = found.path
    if found.kind is SourceKind.MISSING:
        raise FileNotFoundError(f"{path}: no such file or directory")
    if found.kind is SourceKind.CT2:
        return load_ct2_whisper(path, dtype=dtype)
    if found.kind is SourceKind.WHISPER_CPP:
        return load_whisper_cpp(path, dtype=dtype)
    if is_transformers_whisper(found):
        return _load_transformers(str(path), dtype)
    listing = sorted(child.name for child in path.iterdir())[:20] if path.is_dir() else []
    raise ValueError(
        f"{path}: neither a CTranslate2 Whisper directory (model.bin, config.json, tokenizer.json) nor a "
        f"transformers Whisper directory (config.json with model_type 'whisper' and model weights); "
        f"found: {listing or 'a plain file'}")


def load_whisper(source: str | ModelSource, dtype: Dtype = torch.float32) -> WhisperBundle:
    """Load (model, processor, generation config) from a packaged name, a local directory or file, or a Hub id;
    ``dtype`` "stored" keeps the weights in the precision the source stores them (float16 for the packaged
    checkpoints, the hub's large models and F16 whisper.cpp files), which halves the memory of a float16 source
    against float32."""
    found = resolve_source(source)
    if found.kind is SourceKind.PACKAGED:
        return load_ct2_whisper(resolve_packaged(found.text), dtype=dtype)
    if found.kind is SourceKind.HUB:
        return _load_transformers(found.text, dtype)
    return _load_local(found, dtype)
