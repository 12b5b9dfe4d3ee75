"""CrispASR (PyPI ``crispasr``, a ggml runtime called in process through ctypes) on Qwen3-ASR GGUF files of
architecture "qwen3asr" (written by tarq_deploy/formats/crispasr.py).

Decoding: language "en" (CrispASR prefills the assistant turn with "language English<asr_text>", as Qwen3-ASR's own
inference code does), greedy (temperature 0, no frequency penalty, one beam), at most ``max_new_tokens`` tokens,
fixed threads. CrispASR post-processes the text (special tokens and tags dropped, long runs of one token shortened).
Files are parsed by our strict GGUF reader first.

Evaluation: a worker subprocess loads the model once and answers one JSON line per utterance, so a runtime crash is
reported with the model file and the utterance. CPU bench: :func:`measure_crispasr` opens a session (= loads the
model) and transcribes once in the bench's child, so the child's peak RSS and timings are the runtime's own.
"""
from __future__ import annotations

import importlib.metadata
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from .base import BenchRuntime, DecodeOptions, ModelInfo, ModelSpec, RuntimeAdapter
from .child import measure_transcription
from .sources import checked_gguf, is_gguf_of_arch
from .worker import WorkerTranscriber, serve_worker

if TYPE_CHECKING:
    import numpy as np

NAME = "crispasr"
MODULE = "tarq_deploy.runtimes.crispasr"  # what worker and bench child import (there __name__ is __main__)
ARCH = "qwen3asr"
LANGUAGE = "en"
WORKER_FLAG = "--crispasr-worker"
CRISPASR_DECODE = {"language": LANGUAGE, "temperature": 0.0, "frequency_penalty": 0.0, "max_new_tokens": 224}


def is_crispasr_file(source: str) -> bool:
    """A Qwen3-ASR GGUF in CrispASR's flavour (the architecture key decides; a broken file is not claimed)."""
    return is_gguf_of_arch(source, ARCH)


def describe_crispasr_file(path: Path) -> ModelInfo:
    """Validate with our strict GGUF reader (GGUFFileError is a ValueError naming the problem)."""
    from tarq_deploy.formats.qwen3_asr_targets import describe_qwen3_asr_gguf

    backbone, precision, details = describe_qwen3_asr_gguf(path, ARCH)
    return ModelInfo(backbone, precision, details)


def open_session(model_file: str, threads: int, max_new_tokens: int, temperature: float = 0.0,
                 frequency_penalty: float = 0.0):
    """A CrispASR session (the model loaded); greedy and reproducible with the default settings."""
    import crispasr

    session = crispasr.Session(model_file, n_threads=threads)
    session.set_max_new_tokens(max_new_tokens)
    session.set_temperature(temperature)
    session.set_frequency_penalty(frequency_penalty)
    return session


def crispasr_info() -> dict:
    import crispasr

    return {"crispasr": importlib.metadata.version("crispasr"), "backends": crispasr.Session.available_backends()}


# ------------------------------------------------------------------------------------------------- evaluation
def session_text(session, audio: "np.ndarray") -> tuple[str, int]:
    """(transcript, tokens) of one utterance."""
    import numpy as np

    segments = session.transcribe(np.ascontiguousarray(audio, dtype=np.float32), language=LANGUAGE)
    text = " ".join(s.text.strip() for s in segments).strip()
    return text, sum(len(s.tokens) for s in segments)


class CrispASRTranscriber(WorkerTranscriber):
    """A worker process holding one CrispASR session; utterances go in as raw samples, text comes back."""

    def __init__(self, model_file: Path, options: DecodeOptions) -> None:
        super().__init__(model_file, options, "CrispASR",
                         ["-m", MODULE, WORKER_FLAG, str(model_file), str(options.threads),
                          str(options.max_new_tokens)])

    def describe(self) -> dict:
        return {"loaded_as": "CrispASR Qwen3-ASR GGUF", "runtime": "crispasr " + importlib.metadata.version("crispasr"),
                "threads": self.options.threads, "language": LANGUAGE, "temperature": 0.0,
                "max_new_tokens": self.options.max_new_tokens}


def open_crispasr(spec: ModelSpec, options: DecodeOptions) -> CrispASRTranscriber:
    return CrispASRTranscriber(checked_gguf(spec, ARCH, "CrispASR", "crispasr"), options).start()


def _worker_main(model_file: str, threads: int, max_new_tokens: int) -> int:
    """Runs in the worker subprocess: load once, then serve utterances (worker.serve_worker)."""
    session = open_session(model_file, threads, max_new_tokens)
    return serve_worker(lambda audio: session_text(session, audio)[0])


# -------------------------------------------------------------------------------------------------- CPU bench
def measure_crispasr(spec: dict) -> dict:
    """Child side: import crispasr, read the audio, load the model, transcribe once. With no model: baseline."""
    started = time.perf_counter()
    import crispasr  # noqa: F401  (timed: the import is part of what a run costs)

    def load(model_file: str):
        settings = spec["settings"]
        return open_session(model_file, spec["threads"], int(settings["max_new_tokens"]),
                            float(settings["temperature"]), float(settings["frequency_penalty"]))

    return measure_transcription(
        spec, started, crispasr_info, load,
        transcribe=lambda session, audio: session.transcribe(audio, language=spec["settings"]["language"]),
        count_tokens=lambda session, segments: sum(len(s.tokens) for s in segments))


ADAPTER = RuntimeAdapter(
    NAME, "Qwen3-ASR GGUF (arch qwen3asr) through the crispasr wheel (worker subprocess)", is_crispasr_file,
    open_crispasr, crispasr_info,
    BenchRuntime(NAME, describe_crispasr_file, f"{MODULE}:measure_crispasr", CRISPASR_DECODE,
                 "CrispASR wheel, in process (model file: Qwen3-ASR GGUF, arch qwen3asr)"))

if __name__ == "__main__" and len(sys.argv) == 5 and sys.argv[1] == WORKER_FLAG:
    sys.exit(_worker_main(sys.argv[2], int(sys.argv[3]), int(sys.argv[4])))
