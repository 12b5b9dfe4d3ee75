"""CrispASR (PyPI ``crispasr``, a ggml runtime) as an evaluation backend for Qwen3-ASR GGUF files (arch "qwen3asr",
written by tarq_deploy/formats/crispasr.py).

Decoding: language "en" (CrispASR prefills the assistant turn with "language English<asr_text>", as Qwen3-ASR's own
inference code does), greedy (temperature 0, no frequency penalty, one beam), at most ``max_new_tokens`` tokens,
fixed threads. CrispASR post-processes the text (special tokens and tags dropped, long runs of one token shortened).
The model runs in a worker subprocess that loads it once and answers one JSON line per utterance, so a runtime crash
is reported with the model file and the utterance instead of killing the evaluation. The file is parsed by our strict
GGUF reader first.

Registered on import (``register_backend``); ``claims`` is true for a GGUF whose architecture is "qwen3asr".
"""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

from .backends import (Backend, DecodeOptions, ModelSpec, WorkerTranscriber, checked_gguf, is_gguf_of_arch,
                       register_backend, serve_worker)

NAME = "crispasr"
ARCH = "qwen3asr"
LANGUAGE = "en"
WORKER_FLAG = "--crispasr-worker"


def is_crispasr_file(source: str) -> bool:
    """A Qwen3-ASR GGUF in CrispASR's flavour (the architecture key decides; a broken file is not claimed)."""
    return is_gguf_of_arch(source, ARCH)


class CrispASRTranscriber(WorkerTranscriber):
    """A worker process holding one CrispASR session; utterances go in as raw samples, text comes back."""

    def __init__(self, model_file: Path, options: DecodeOptions) -> None:
        super().__init__(model_file, options, "CrispASR",
                         ["-m", "tarq_deploy.evaluate.crispasr_backend", WORKER_FLAG, str(model_file),
                          str(options.threads), str(options.max_new_tokens)])

    def describe(self) -> dict:
        import importlib.metadata

        return {"loaded_as": "CrispASR Qwen3-ASR GGUF", "runtime": "crispasr " + importlib.metadata.version("crispasr"),
                "threads": self.options.threads, "language": LANGUAGE, "temperature": 0.0,
                "max_new_tokens": self.options.max_new_tokens}


def open_crispasr(spec: ModelSpec, options: DecodeOptions) -> CrispASRTranscriber:
    return CrispASRTranscriber(checked_gguf(spec, ARCH, "CrispASR", "crispasr"), options).start()


def open_session(model_file: str, threads: int, max_new_tokens: int):
    """A CrispASR session with reproducible greedy decoding."""
    import crispasr

    session = crispasr.Session(model_file, n_threads=threads)
    session.set_max_new_tokens(max_new_tokens)
    session.set_temperature(0.0)
    session.set_frequency_penalty(0.0)
    return session


def session_text(session, audio: np.ndarray) -> tuple[str, int]:
    """(transcript, tokens) of one utterance."""
    segments = session.transcribe(np.ascontiguousarray(audio, dtype=np.float32), language=LANGUAGE)
    text = " ".join(s.text.strip() for s in segments).strip()
    return text, sum(len(s.tokens) for s in segments)


def _worker_main(model_file: str, threads: int, max_new_tokens: int) -> int:
    """Runs in the subprocess: load once, then serve utterances (backends.serve_worker)."""
    session = open_session(model_file, threads, max_new_tokens)
    return serve_worker(lambda audio: session_text(session, audio)[0])


register_backend(Backend(NAME, "Qwen3-ASR GGUF (arch qwen3asr) through the crispasr wheel (worker subprocess)",
                         is_crispasr_file, open_crispasr))


if __name__ == "__main__" and len(sys.argv) == 5 and sys.argv[1] == WORKER_FLAG:
    sys.exit(_worker_main(sys.argv[2], int(sys.argv[3]), int(sys.argv[4])))
