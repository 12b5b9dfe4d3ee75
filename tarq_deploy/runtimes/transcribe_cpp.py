"""transcribe.cpp (PyPI ``transcribe-cpp`` + ``transcribe-cpp-native``, a ggml speech runtime called in process
through ctypes) on Whisper GGUF files of architecture "whisper" (written by tarq_deploy/formats/transcribe_whisper.py)
and on Qwen3-ASR / Voxtral GGUF files of architecture "qwen3_asr" / "voxtral" (formats/transcribe_llm.py; a Voxtral
file of CrispASR's flavour, same architecture name, is CrispASR's); each weight matrix in its own type.

Decoding Whisper under a decode profile (runtimes/decoding.py). ``greedy``: as the whisper.cpp adapter decodes so
results compare -- language "en", transcribe, greedy with no temperature fallback (temperature 0, temperature_inc 0),
no timestamps, fixed threads. ``cli``: whisper-cli's fallback (+0.2), thresholds, context and segment timestamps, as
far as WhisperRunOptions reaches (the binding has no beam search). Qwen3-ASR and Voxtral: the
runtime's own greedy decoding with the language left to the model (``LLM_DECODE``: forcing "en" makes Qwen3-ASR's
prompt need the ``<asr_text>`` token, which only the published vocabulary has). A run that the runtime stops
for repetition or length (OutputTruncated) gives its partial transcript: a looping 4-bit model is a result to count,
not a crash. Files are parsed by our strict GGUF reader first.

Evaluation: a worker subprocess loads the model once and answers one JSON line per utterance, so a native abort is
reported with the model file and the utterance. CPU bench: :func:`measure_transcribe_cpp` loads the model and
transcribes once in the bench's child, so the child's peak RSS and timings are the runtime's own.
"""
from __future__ import annotations

import importlib.metadata
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..model_source import ModelSource, resolve_source
from .base import BenchRuntime, DecodeOptions, ModelInfo, ModelSpec, RuntimeAdapter
from .child import measure_transcription
from .decoding import GREEDY, profile_named
from .sources import checked_gguf, is_gguf_of_arch
from .worker import WorkerTranscriber, serve_worker

if TYPE_CHECKING:
    import numpy as np

__all__ = ["NAME", "describe_transcribe_cpp_file"]

NAME = "transcribe.cpp"
MODULE = "tarq_deploy.runtimes.transcribe_cpp"  # what worker and bench child import (there __name__ is __main__)
ARCH = "whisper"
LLM_ARCHS = ("qwen3_asr", "voxtral")  # transcribe_llm.py's families
WORKER_FLAG = "--transcribe-cpp-worker"
# part of a cached hypothesis's identity: the same greedy English decoding as the whisper.cpp adapter
TRANSCRIBE_CPP_DECODE = {"language": "en", "task": "transcribe", "timestamps": "none", "temperature": 0.0,
                         "temperature_inc": 0.0}
# Qwen3-ASR / Voxtral: greedy is the runtime's only decoding there; the Whisper-only knobs are not sent
LLM_DECODE = {"language": None, "task": "transcribe", "timestamps": "none"}


def is_transcribe_cpp_file(source: str | ModelSource) -> bool:
    """A Whisper GGUF our strict reader accepts (the architecture key decides), or a Qwen3-ASR / Voxtral GGUF of
    transcribe.cpp's flavour."""
    return is_gguf_of_arch(source, ARCH) or llm_family(source) is not None


def llm_family(source: str | ModelSource) -> Any:
    """The transcribe_llm family of a transcribe.cpp Qwen3-ASR / Voxtral file our strict reader accepts, else None."""
    from tarq_deploy.formats.gguf_file import GGUFFileError, read_gguf
    from tarq_deploy.formats.transcribe_llm import family_of_file

    if not any(is_gguf_of_arch(source, arch) for arch in LLM_ARCHS):
        return None
    try:
        return family_of_file(read_gguf(resolve_source(source).path))
    except GGUFFileError:
        return None


def describe_transcribe_cpp_file(path: Path) -> ModelInfo:
    """Validate with our strict reader (GGUFFileError is a ValueError naming the problem); the backbone is named by
    its dimensions as for a whisper.cpp file, the precision by the file type."""
    from tarq_deploy.formats.gguf_file import GGUFFileError, file_types, read_gguf

    from .whisper_cpp import whisper_backbone

    model = read_gguf(path)
    if model.arch in LLM_ARCHS:
        return _describe_llm(model)
    if model.arch != ARCH:
        raise GGUFFileError(path, f"architecture {model.arch!r}, expected {ARCH!r}")
    dims = [model.integer(f"stt.whisper.{key}") for key in ("encoder.n_layers", "encoder.d_model", "decoder.n_layers",
                                                            "decoder.vocab_size", "encoder.num_mel_bins")]
    precision, counts = file_types(model)
    return ModelInfo(whisper_backbone(*dims), precision, {"arch": ARCH, "tensor_types": counts})


def _describe_llm(model: Any) -> ModelInfo:
    from tarq_deploy.formats.gguf_file import GGUFFileError, GGUFVerifyError, file_types
    from tarq_deploy.formats.transcribe_llm import describe

    try:
        backbone, details = describe(model)
    except GGUFVerifyError as e:  # a CrispASR Voxtral file: not ours to describe
        raise GGUFFileError(model.path, str(e)) from None
    precision, counts = file_types(model)
    return ModelInfo(backbone, precision, {**details, "tensor_types": counts})


def load_model(model_file: str) -> Any:
    import transcribe_cpp

    return transcribe_cpp.Model(model_file)


def profile_settings(profile_name: str, language: str = "en") -> dict:
    """TRANSCRIBE_CPP_DECODE under a decode profile (runtimes/decoding.py) in ``language``: greedy is it unchanged;
    cli adds whisper-cli's fallback, thresholds and context as WhisperRunOptions (the binding has no beams) and
    segment timestamps."""
    if language != TRANSCRIBE_CPP_DECODE["language"]:
        return {**profile_settings(profile_name), "language": language}
    if profile_name == GREEDY:
        return TRANSCRIBE_CPP_DECODE
    chosen = profile_named(profile_name).transcribe_cpp
    options = dict(chosen["options"])
    return {**TRANSCRIBE_CPP_DECODE, "timestamps": chosen["timestamps"], "temperature": options.pop("temperature"),
            "temperature_inc": options.pop("temperature_inc"), "whisper_options": options}


def decode_settings(arch: str, settings: dict = TRANSCRIBE_CPP_DECODE) -> dict:
    """What a model of ``arch`` is decoded with: ``settings`` (Whisper's, or the bench's --decode) for Whisper, the
    runtime's own greedy decoding for the LLM families."""
    return settings if arch == ARCH else LLM_DECODE


def run_text(session: Any, audio: "np.ndarray", settings: dict = TRANSCRIBE_CPP_DECODE, arch: str = ARCH) -> Any:
    """The Result of one utterance decoded with ``settings`` (the bench's --decode overrides TRANSCRIBE_CPP_DECODE);
    the partial one when the runtime stops the output (repetition, length)."""
    import numpy as np
    import transcribe_cpp
    from transcribe_cpp.errors import OutputTruncated

    settings = decode_settings(arch, settings)
    options = None
    if arch == ARCH:  # the Whisper family extension; other families refuse it
        extra = settings.get("whisper_options", {})
        options = transcribe_cpp.WhisperRunOptions(temperature=float(settings["temperature"]),
                                                   temperature_inc=float(settings["temperature_inc"]), **extra)
    try:
        return session.run(np.ascontiguousarray(audio, dtype=np.float32), language=settings["language"],
                           task=settings["task"], timestamps=settings["timestamps"], family=options)
    except OutputTruncated as e:  # OutputRepetition too
        if e.partial_result is None:
            raise
        return e.partial_result


def transcribe_cpp_info() -> dict:
    return {name: importlib.metadata.version(name) for name in ("transcribe-cpp", "transcribe-cpp-native")}


# ------------------------------------------------------------------------------------------------- evaluation
class TranscribeCppTranscriber(WorkerTranscriber):
    """A worker process holding one transcribe.cpp model and session; utterances go in as samples, text comes back."""

    def __init__(self, model_file: Path, options: DecodeOptions) -> None:
        super().__init__(model_file, options, "transcribe.cpp",
                         ["-m", MODULE, WORKER_FLAG, str(model_file), str(options.threads), options.profile,
                          options.language])

    def describe(self) -> dict:
        family = llm_family(str(self.model_file))
        kind, settings = (family.name, LLM_DECODE) if family is not None else \
            ("Whisper", profile_settings(self.options.profile, self.options.language))
        return {"loaded_as": f"transcribe.cpp {kind} GGUF", "runtime": transcribe_cpp_info(),
                "threads": self.options.threads, "decode": self.options.profile, **settings}


def open_transcribe_cpp(spec: ModelSpec, options: DecodeOptions) -> TranscribeCppTranscriber:
    family = llm_family(spec.source)
    arch = family.arch if family is not None else ARCH
    return TranscribeCppTranscriber(checked_gguf(spec, arch, "transcribe.cpp", "transcribe.cpp"), options).start()


def _worker_main(model_file: str, threads: int, profile_name: str, language: str = "en") -> int:
    """Runs in the worker subprocess: load once, then serve utterances (worker.serve_worker)."""
    model = load_model(model_file)
    session = model.session(n_threads=threads)
    settings = profile_settings(profile_name, language)
    return serve_worker(lambda audio: run_text(session, audio, settings, arch=model.arch).text.strip())


# -------------------------------------------------------------------------------------------------- CPU bench
def measure_transcribe_cpp(spec: dict) -> dict:
    """Child side: import the binding, read the audio, load the model (and its session), transcribe once. With no
    model: the baseline."""
    started = time.perf_counter()
    import transcribe_cpp  # noqa: F401  (timed: the import is part of what a run costs)

    def load(model_file: str) -> Any:
        model = load_model(model_file)
        return model.arch, model.session(n_threads=spec["threads"])

    return measure_transcription(
        spec, started, transcribe_cpp_info, load,
        transcribe=lambda loaded, audio: [run_text(loaded[1], audio, spec["settings"], arch=loaded[0])],
        count_tokens=lambda loaded, results: sum(len(r.tokens) for r in results))


ADAPTER = RuntimeAdapter(
    NAME, "Whisper, Qwen3-ASR or Voxtral GGUF (arch whisper / qwen3_asr / voxtral, a type per tensor) through the "
          "transcribe-cpp wheel (worker subprocess)",
    is_transcribe_cpp_file, open_transcribe_cpp, transcribe_cpp_info,
    BenchRuntime(NAME, describe_transcribe_cpp_file, f"{MODULE}:measure_transcribe_cpp", TRANSCRIBE_CPP_DECODE,
                 "transcribe-cpp wheel, in process (model file: Whisper, Qwen3-ASR or Voxtral GGUF)",
                 profile_settings))

if __name__ == "__main__" and len(sys.argv) == 6 and sys.argv[1] == WORKER_FLAG:
    sys.exit(_worker_main(sys.argv[2], int(sys.argv[3]), sys.argv[4], sys.argv[5]))
