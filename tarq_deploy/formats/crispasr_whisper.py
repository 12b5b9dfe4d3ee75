"""Whisper for CrispASR (PyPI ``crispasr``): its whisper backend reads whisper.cpp's legacy ggml model file, so the
``crispasr`` target of a Whisper model is that file, byte for byte what ``--target whisper.cpp`` writes (every
lattice type, the tied token embedding / output projection in the file's type, ``verify`` exact).

What the crispasr wheel 0.8.45 does with Whisper, measured (tests/test_crispasr_whisper.py pins both):

* there is no Whisper GGUF: a GGUF of architecture "whisper" is routed to the whisper backend
  (``crispasr.detect_backend_from_gguf`` says "whisper"), whose loader stops at the magic ("invalid model data (bad
  magic)"); the registry's own whisper model is ``ggml-base.bin``;
* no per-tensor mix: the loader creates every weight matrix and the token embedding in the one type the header's
  ftype names and checks each tensor's byte size against it, so a file mixing types stops at the first tensor of
  another type ("tensor ... has wrong size in model file").

So a checkpoint whose matrices are on several types (a ``--tensor-type`` recipe) is refused here, naming why;
per-tensor mixes in CrispASR are for its GGUF backends (Qwen3-ASR: formats/crispasr.py).
"""
from __future__ import annotations

from typing import Any

from .ggml_blocks import GGML_TYPE_NAMES, type_for_spec
from .whisper_cpp import WhisperCppModel, WhisperExportError, WhisperSource, as_source, build_whisper_cpp, default_target

__all__ = ["build_crispasr_whisper"]

RUNTIME = "CrispASR's whisper backend"


def crispasr_whisper_source(source: Any) -> WhisperSource:
    """A WhisperSource (from a checkpoint, a directory, or (model, processor)) whose errors name CrispASR."""
    whisper = as_source(source)
    whisper.runtime = RUNTIME
    return whisper


def check_one_type(source: WhisperSource) -> None:
    """Refuse a lattice on more than one ggml type: CrispASR's whisper loader holds one type for every matrix."""
    types = {type_for_spec(source.lattice.spec_of(name)) for name in source.lattice}
    if len(types) > 1 and None not in types:
        names = ", ".join(sorted(GGML_TYPE_NAMES[t].lower() for t in types))
        raise WhisperExportError(
            f"{source.origin}: the weight matrices are on a mix of types ({names}); {RUNTIME} (crispasr 0.8.45) reads "
            f"Whisper only from whisper.cpp's .bin (no Whisper GGUF) and makes every weight matrix, the tied token "
            f"embedding / output projection included, in the header's one type, so a mix cannot load there. "
            f"Quantize a uniform lattice (no --tensor-type) for Whisper; per-tensor mixes are for CrispASR's "
            f"Qwen3-ASR GGUF")


def build_crispasr_whisper(source: Any, target: str | None = None, baseline: str | None = None,
                           progress: bool = False) -> tuple[WhisperCppModel, str]:
    """(the packed model file, its weight type) for CrispASR's whisper backend; refuses before anything is written."""
    whisper = crispasr_whisper_source(source)
    try:
        check_one_type(whisper)
    except Exception:
        whisper.wait_verified()  # a damaged checkpoint is named by its digest first
        raise
    target = target or default_target(whisper, baseline)
    return build_whisper_cpp(whisper, target, baseline, progress), target
