"""One entry point for Whisper checkpoints, wherever they come from.

``load_whisper(source)`` accepts:

* ``packaged:NAME`` -- real weights shipped in pip packages (see :mod:`tarq_deploy.models.packaged`);
* a local CTranslate2 / faster-whisper directory (``model.bin`` + ``config.json`` + ``tokenizer.json``);
* a local transformers directory (``config.json`` of a Whisper model + safetensors / PyTorch weights);
* anything else: a Hugging Face Hub id, loaded with ``from_pretrained``.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from transformers import GenerationConfig, WhisperForConditionalGeneration, WhisperProcessor

from tarq_deploy.models.ct2 import is_ct2_directory, load_ct2_whisper
from tarq_deploy.models.packaged import PACKAGED_PREFIX, resolve_packaged

WHISPER_MODEL_TYPE = "whisper"
TRANSFORMERS_CONFIG_NAME = "config.json"
TRANSFORMERS_WEIGHT_PATTERNS = ("model.safetensors", "model.safetensors.index.json", "model-*.safetensors",
                                "pytorch_model.bin", "pytorch_model.bin.index.json")
# Prefixes that can only mean a filesystem path (a Hub id is "name" or "owner/name").
LOCAL_PATH_PREFIXES = ("/", "./", "../", "~", ".\\", "..\\")

WhisperBundle = tuple[WhisperForConditionalGeneration, WhisperProcessor, GenerationConfig]


def is_transformers_whisper_directory(path: Path) -> bool:
    """True when ``path`` holds a transformers Whisper config and weights."""
    config_path = path / TRANSFORMERS_CONFIG_NAME
    if not config_path.is_file():
        return False
    try:
        model_type = json.loads(config_path.read_text(encoding="utf-8")).get("model_type")
    except (json.JSONDecodeError, UnicodeDecodeError, AttributeError):
        return False
    has_weights = any(any(path.glob(pattern)) for pattern in TRANSFORMERS_WEIGHT_PATTERNS)
    return model_type == WHISPER_MODEL_TYPE and has_weights


def _load_transformers(name_or_path: str, dtype: torch.dtype) -> WhisperBundle:
    model = WhisperForConditionalGeneration.from_pretrained(name_or_path, dtype=dtype).eval()
    processor = WhisperProcessor.from_pretrained(name_or_path)
    return model, processor, model.generation_config


def _load_local(path: Path, dtype: torch.dtype) -> WhisperBundle:
    if not path.exists():
        raise FileNotFoundError(f"{path}: no such file or directory")
    if path.is_dir() and is_ct2_directory(path):
        return load_ct2_whisper(path, dtype=dtype)
    if path.is_dir() and is_transformers_whisper_directory(path):
        return _load_transformers(str(path), dtype)
    listing = sorted(child.name for child in path.iterdir())[:20] if path.is_dir() else []
    raise ValueError(
        f"{path}: neither a CTranslate2 Whisper directory (model.bin, config.json, tokenizer.json) nor a "
        f"transformers Whisper directory (config.json with model_type 'whisper' and model weights); "
        f"found: {listing or 'a plain file'}")


def _looks_local(source: str) -> bool:
    return source.startswith(LOCAL_PATH_PREFIXES) or Path(source).exists()


def load_whisper(source: str, dtype: torch.dtype = torch.float32) -> WhisperBundle:
    """Load (model, processor, generation config) from a packaged name, a local directory or a Hub id."""
    if source.startswith(PACKAGED_PREFIX):
        return load_ct2_whisper(resolve_packaged(source), dtype=dtype)
    if _looks_local(source):
        return _load_local(Path(source).expanduser(), dtype)
    return _load_transformers(source, dtype)
