"""Verify a file exported for a ggml runtime against a lattice checkpoint: a whisper.cpp model file or a Qwen3-ASR
GGUF (either flavour), told apart by its magic. Every array is decoded and compared with the checkpoint's exact
values; an exact export differs nowhere."""
from __future__ import annotations

import os
from dataclasses import dataclass

from tarq_deploy.checkpoint import CheckpointError, LatticeCheckpoint
from tarq_deploy.model_source import SourceKind, resolve_source

from .ggml_blocks import GGML_TYPE_NAMES, LatticeNotRepresentable
from .ggml_file import read_whisper_cpp
from .ggml_tensors import TensorFileError, VerifyError
from .gguf_file import read_gguf
from .model_files import ModelFilesError
from .qwen3_asr_targets import verify_gguf
from .whisper_cpp import verify as verify_whisper_cpp

__all__ = ["VERIFY_ERRORS", "verify_model_file"]

# Errors that name a bad model file, checkpoint or mismatch between them (not a bug of ours).
VERIFY_ERRORS: tuple[type[BaseException], ...] = (TensorFileError, VerifyError, ModelFilesError,
                                                   LatticeNotRepresentable, CheckpointError, FileNotFoundError)


@dataclass(frozen=True)
class Verification:
    """max |diff| per array of the file, in file order, and how the file stores each array."""

    diffs: dict[str, float]
    types: dict[str, str]  # array -> ggml type name ("F32" for the arrays that are not tensors: mel filters)

    @property
    def differing(self) -> dict[str, float]:
        return {name: diff for name, diff in self.diffs.items() if diff != 0.0}

    @property
    def worst(self) -> str | None:
        """The array with the largest difference, None for an exact file."""
        differing = self.differing
        return max(differing, key=differing.get) if differing else None


def verify_model_file(model_file: str | os.PathLike,
                      checkpoint: str | os.PathLike | LatticeCheckpoint) -> Verification:
    """Decode every array of ``model_file`` and compare it with ``checkpoint``'s exact values."""
    if resolve_source(model_file).kind is SourceKind.GGUF:  # else the whisper.cpp reader names what it is
        diffs = verify_gguf(model_file, checkpoint)
        tensors = read_gguf(model_file).tensors
    else:
        diffs = verify_whisper_cpp(model_file, checkpoint)
        tensors = read_whisper_cpp(model_file).tensors
    types = {name: GGML_TYPE_NAMES[tensors[name].ggml_type] if name in tensors else "F32" for name in diffs}
    return Verification(diffs, types)
