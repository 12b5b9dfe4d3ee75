"""The recognisers ``tarq-deploy eval`` scores, by the name ``--backend`` gives them: the runtime registry
(``tarq_deploy.runtimes.registry``) as the evaluation sees it, so every model is scored on the same audio with the
same greedy decoding. Each runtime's decoding is described in its module under ``tarq_deploy/runtimes/``.

Audio is decoded once by :func:`tarq_deploy.data.corpus.load_audio` in the parent process and handed to every
backend as the same float32 16 kHz array (a worker subprocess receives the raw samples).
"""
from __future__ import annotations

import time
from typing import TYPE_CHECKING, Iterator, Sequence

from ..runtimes.base import BackendError, DecodeOptions, ModelSpec, RuntimeAdapter, Transcriber
from ..runtimes.registry import BY_NAME, open_transcriber
from ..runtimes.registry import infer_runtime as infer_backend
from ..runtimes.sources import is_whisper_cpp_file
from ..runtimes.torch_whisper import load_torch_bundle
from ..runtimes.whisper_cpp import WHISPER_CPP_PARAMS

if TYPE_CHECKING:
    import numpy as np

__all__ = ["BACKENDS", "WHISPER_CPP_PARAMS", "BackendError", "DecodeOptions", "ModelSpec", "Transcriber",
           "infer_backend", "is_whisper_cpp_file", "load_torch_bundle", "open_transcriber", "transcribe_all"]

BACKENDS: dict[str, RuntimeAdapter] = BY_NAME  # --backend's choices, in the registry's order


def transcribe_all(transcriber: Transcriber,
                   items: Sequence[tuple[str, "np.ndarray"]]) -> Iterator[tuple[str, str, float]]:
    """(utterance id, text, seconds) for each (id, audio), in order."""
    for utterance_id, audio in items:
        started = time.perf_counter()
        text = transcriber.transcribe(audio, utterance_id)
        yield utterance_id, text, time.perf_counter() - started
