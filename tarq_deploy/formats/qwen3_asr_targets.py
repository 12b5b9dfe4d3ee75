"""The Qwen3-ASR GGUF targets, one table: each runtime flavour (qwen3-asr.cpp, CrispASR, a ``Qwen3ASRFlavour``
record with its build, verify and the metadata keys of its dimensions); export, verify and describe pick the
flavour from it."""
from __future__ import annotations

import os
from pathlib import Path

from tarq_deploy.checkpoint import LatticeCheckpoint

from . import crispasr, crispasr_voxtral, qwen3_asr_cpp, transcribe_llm, transcribe_whisper
from .ggml_blocks import GGML_TYPE_NAMES
from .gguf_file import GGUFExportError, GGUFFileError, GGUFVerifyError, file_types, read_gguf, write_gguf
from .qwen3_asr_gguf import as_source, float_model_source

__all__ = ["describe_qwen3_asr_gguf", "export_qwen3_asr_gguf", "verify_gguf"]


TARGETS = {flavour.target: flavour for flavour in (qwen3_asr_cpp.FLAVOUR, crispasr.FLAVOUR)}
ARCH_TARGETS = {target.arch: target for target in TARGETS.values()}
# known sizes: (audio layers, audio d_model, text layers, text hidden) -> name
QWEN3_ASR_SIZES = {(18, 896, 28, 1024): "qwen3-asr-0.6B", (24, 1024, 28, 2048): "qwen3-asr-1.7B"}


def export_qwen3_asr_gguf(target: str, checkpoint: str | None, model: str | None, weight_type: str | None,
                          out_path: str | os.PathLike) -> tuple[Path, str]:
    """The export command for the GGUF targets: a lattice checkpoint directory or a float transformers Qwen3-ASR
    directory (``model``) to ``out_path``; returns the path and a one-line summary."""
    if (checkpoint is None) == (model is None):
        raise GGUFExportError("give either CHECKPOINT_DIR or --model SOURCE (exactly one)")
    if target not in TARGETS:
        raise GGUFExportError(f"unknown GGUF target {target!r}; choose one of {', '.join(TARGETS)}")
    source = as_source(checkpoint) if checkpoint is not None else float_model_source(model)
    built = TARGETS[target].build(source, weight_type)
    out = write_gguf(built, out_path)
    types = sorted({GGML_TYPE_NAMES[t.ggml_type] for t in built.tensors})
    return out, f"{target} GGUF ({'/'.join(types)}), {len(built.tensors)} tensors, {out.stat().st_size / 1e6:.1f} MB"


def verify_gguf(model_file: str | os.PathLike, checkpoint: str | os.PathLike | LatticeCheckpoint) -> dict[str, float]:
    """Verify a Qwen3-ASR GGUF of any flavour, a Voxtral GGUF (CrispASR's or transcribe.cpp's) or a transcribe.cpp
    Whisper GGUF (chosen by its general.architecture and keys) against a checkpoint."""
    model = read_gguf(model_file)
    arch = model.arch
    if transcribe_llm.family_of_file(model) is not None:  # before CrispASR's Voxtral: the same architecture name
        return transcribe_llm.verify(model_file, checkpoint)
    if arch == crispasr_voxtral.ARCH:
        return crispasr_voxtral.verify(model_file, checkpoint)
    if arch == transcribe_whisper.ARCH:
        return transcribe_whisper.verify(model_file, checkpoint)
    if arch not in ARCH_TARGETS:
        raise GGUFVerifyError(f"{model_file}: architecture {arch!r} is none this tool exports "
                              f"({', '.join([*ARCH_TARGETS, crispasr_voxtral.ARCH])})")
    return ARCH_TARGETS[arch].verify(model_file, checkpoint)


def describe_qwen3_asr_gguf(path: str | os.PathLike, arch: str) -> tuple[str, str, dict]:
    """(backbone name, precision, details) of a Qwen3-ASR GGUF of flavour ``arch``; GGUFFileError if it is not one.
    The name is the published size the dimensions match, else "qwen3-asr-a<L>x<d>-t<L>x<d>"."""
    model = read_gguf(path)
    if model.arch != arch:
        raise GGUFFileError(path, f"architecture {model.arch!r}, expected {arch!r}")
    dims = tuple(model.integer(key) for key in ARCH_TARGETS[arch].size_keys)
    name = QWEN3_ASR_SIZES.get(dims, f"qwen3-asr-a{dims[0]}x{dims[1]}-t{dims[2]}x{dims[3]}")
    precision, counts = file_types(model)
    details = {"arch": arch, "audio_layers": dims[0], "audio_d_model": dims[1], "text_layers": dims[2],
               "text_hidden": dims[3], "tensor_types": counts}
    return name, precision, details
