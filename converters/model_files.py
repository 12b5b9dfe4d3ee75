"""Reading a checkpoint's model files (config, tokenizer, feature extractor) for the converters: one place for the
JSON parsing and the transformers-version differences, with errors that name the file."""

from __future__ import annotations

import json


class ModelFilesError(ValueError):
    """A model file is missing or unreadable; the message names it and the checkpoint."""


def json_file(files: dict[str, bytes], name: str, origin: str) -> dict:
    if name not in files:
        raise ModelFilesError(f"{origin}: model file {name} missing")
    try:
        return json.loads(files[name])
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelFilesError(f"{origin}: model file {name} is not valid JSON ({e})") from None


def feature_extractor_config(files: dict[str, bytes], origin: str) -> dict:
    """preprocessor_config.json, or the 'feature_extractor' entry transformers 5 nests in processor_config.json."""
    if "preprocessor_config.json" in files:
        return json_file(files, "preprocessor_config.json", origin)
    if "processor_config.json" in files:
        nested = json_file(files, "processor_config.json", origin).get("feature_extractor")
        if isinstance(nested, dict):
            return nested
    raise ModelFilesError(f"{origin}: no feature extractor config (preprocessor_config.json, or "
                          f"processor_config.json with a 'feature_extractor' entry) among the model files")
