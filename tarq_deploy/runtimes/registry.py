"""The one list of runtimes, each an adapter (``base.RuntimeAdapter``): evaluation opens transcribers through it, the
CPU bench drives the runtimes that have a ``bench`` part.

The order is meaningful: it is the order ``--backend`` lists them in, and inference asks them in it -- the Whisper
PyTorch runtime first in the list but last to be asked (it claims every source), the Qwen3-ASR PyTorch runtime before
it (Qwen3-ASR directories and checkpoints look like any other model directory to it).
"""
from __future__ import annotations

from ..errors import UserError
from ..model_source import ModelSource, SourceKind, resolve_source
from . import crispasr, qwen3_asr_cpp, torch_qwen3_asr, torch_whisper, transcribe_cpp, whisper_cpp
from .base import BenchRuntime, DecodeOptions, ModelSpec, RuntimeAdapter, Transcriber

__all__ = ["ADAPTERS", "BY_NAME", "FALLBACK", "bench_runtimes", "infer_runtime", "open_transcriber"]

ADAPTERS: tuple[RuntimeAdapter, ...] = (torch_whisper.ADAPTER, whisper_cpp.ADAPTER, crispasr.ADAPTER,
                                        torch_qwen3_asr.ADAPTER, qwen3_asr_cpp.ADAPTER, transcribe_cpp.ADAPTER)
FALLBACK = torch_whisper.NAME  # the runtime of a source no other runtime claims
BY_NAME: dict[str, RuntimeAdapter] = {adapter.name: adapter for adapter in ADAPTERS}


def runtime_names() -> str:
    return ", ".join(BY_NAME)


def infer_runtime(source: str | ModelSource) -> str:
    """The runtime a source runs on by default: the first that claims it, else the fallback -- except for a GGUF
    file, which the fallback cannot read: one that no runtime claims is an error. Resolved once, for every claim."""
    found = resolve_source(source)
    for adapter in ADAPTERS:
        if adapter.name != FALLBACK and adapter.claims(found):
            return adapter.name
    if found.kind is SourceKind.GGUF:
        raise UserError(f"{found.text}: a GGUF file of an architecture no runtime here runs (available: {runtime_names()})")
    return FALLBACK


def open_transcriber(spec: ModelSpec, options: DecodeOptions) -> Transcriber:
    if spec.backend not in BY_NAME:
        raise UserError(f"model {spec.label!r}: unknown backend {spec.backend!r} (available: {runtime_names()})")
    return BY_NAME[spec.backend].open(spec, options)


def bench_runtimes() -> dict[str, BenchRuntime]:
    """The runtimes the CPU bench can drive, by name, in the registry's order."""
    return {adapter.name: adapter.bench for adapter in ADAPTERS if adapter.bench is not None}
