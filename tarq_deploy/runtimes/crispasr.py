"""CrispASR (PyPI ``crispasr``, a ggml runtime called in process through ctypes) on Qwen3-ASR GGUF files of
architecture "qwen3asr" (written by tarq_deploy/formats/crispasr.py), on Voxtral GGUF files of architecture
"voxtral" (tarq_deploy/formats/crispasr_voxtral.py; the wheel picks its voxtral backend from the key) and on Whisper's whisper.cpp model files, which
its whisper backend reads (it reads no Whisper GGUF: tarq_deploy/formats/crispasr_whisper.py). A .bin runs in
whisper.cpp by default; ``--backend crispasr`` runs it here.

Decoding: language "en" (CrispASR prefills the assistant turn with "language English<asr_text>", as Qwen3-ASR's own
inference code does), greedy (temperature 0, no frequency penalty, one beam), at most ``max_new_tokens`` tokens,
fixed threads. CrispASR post-processes the text (special tokens and tags dropped, long runs of one token shortened).
Whisper: language "en" and the decode profile (runtimes/decoding.py) as the whisper.cpp adapter decodes: ``greedy``,
no temperature fallback (temperature_inc 0, the other fallback thresholds at whisper.cpp's defaults) and non-speech
tokens suppressed; ``cli``, whisper-cli's beam search (5 beams, best_of 5), fallback +0.2 and no suppression. Files are parsed by our
strict readers first (GGUF, or the whisper.cpp .bin).

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

from ..model_source import ModelSource, resolve_source
from .base import BenchRuntime, DecodeOptions, ModelInfo, ModelSpec, RuntimeAdapter
from .child import measure_transcription
from .decoding import GREEDY, fresh_state_per_item, profile_named
from .sources import checked_gguf, checked_whisper_cpp, is_gguf_of_arch, is_whisper_cpp_file
from .worker import WorkerTranscriber, serve_worker

if TYPE_CHECKING:
    import numpy as np

__all__ = ["ARCH", "describe_crispasr_file", "is_crispasr_file", "open_session"]

NAME = "crispasr"
MODULE = "tarq_deploy.runtimes.crispasr"  # what worker and bench child import (there __name__ is __main__)
ARCH = "qwen3asr"
VOXTRAL_ARCH = "voxtral"  # Voxtral GGUF (formats/crispasr_voxtral.py), run by the wheel's voxtral backend
WHISPER_BACKEND = "whisper"  # the crispasr backend that runs a whisper.cpp .bin
LANGUAGE = "en"
WORKER_FLAG = "--crispasr-worker"
# the whisper backend (a .bin): no temperature fallback (temperature_inc 0; the entropy, logprob and no-speech
# thresholds stay at whisper.cpp's defaults) and non-speech tokens suppressed, as the whisper.cpp adapter decodes
WHISPER_THRESHOLDS = {"entropy_thold": 2.4, "logprob_thold": -1.0, "no_speech_thold": 0.6}
WHISPER_DECODE = {"whisper_temperature_inc": 0.0, "whisper_suppress_nst": True}
CRISPASR_DECODE = {"language": LANGUAGE, "temperature": 0.0, "frequency_penalty": 0.0, "max_new_tokens": 224,
                   **WHISPER_DECODE}


def is_crispasr_file(source: str | ModelSource) -> bool:
    """A Qwen3-ASR GGUF in CrispASR's flavour, or a CrispASR Voxtral GGUF (the architecture key decides; a broken
    file is not claimed)."""
    return is_gguf_of_arch(source, ARCH) or is_crispasr_voxtral(source)


def is_crispasr_voxtral(source: str | ModelSource) -> bool:
    """A Voxtral GGUF of CrispASR's flavour: transcribe.cpp names its Voxtral architecture "voxtral" too (its files
    carry stt.voxtral keys and are transcribe.cpp's)."""
    if not is_gguf_of_arch(source, VOXTRAL_ARCH):
        return False
    from tarq_deploy.formats.gguf_file import read_gguf
    from tarq_deploy.formats.transcribe_llm import is_transcribe_voxtral

    return not is_transcribe_voxtral(read_gguf(resolve_source(source).path))


def describe_crispasr_file(path: Path) -> ModelInfo:
    """Validate with our strict readers (GGUFFileError / GGMLFileError are ValueErrors naming the problem): a
    Qwen3-ASR GGUF, or a whisper.cpp .bin for the whisper backend."""
    if is_whisper_cpp_file(str(path)):
        from .whisper_cpp import describe_whisper_cpp_file

        info = describe_whisper_cpp_file(path)
        return ModelInfo(info.backbone, info.precision, {**info.details, "crispasr_backend": WHISPER_BACKEND})
    from tarq_deploy.formats.qwen3_asr_targets import describe_qwen3_asr_gguf

    if is_gguf_of_arch(str(path), VOXTRAL_ARCH):
        from tarq_deploy.formats.crispasr_voxtral import describe_voxtral_gguf

        backbone, precision, details = describe_voxtral_gguf(path)
        return ModelInfo(backbone, precision, details)
    backbone, precision, details = describe_qwen3_asr_gguf(path, ARCH)
    return ModelInfo(backbone, precision, details)


def backend_of(model_file: str) -> str | None:
    """The crispasr backend to open ``model_file`` with: "whisper" for a whisper.cpp .bin, else None (the wheel picks
    it from the GGUF's architecture)."""
    return WHISPER_BACKEND if is_whisper_cpp_file(model_file) else None


def open_session(model_file: str, threads: int, max_new_tokens: int, temperature: float = 0.0,
                 frequency_penalty: float = 0.0, whisper_temperature_inc: float = 0.0,
                 whisper_suppress_nst: bool = True, whisper_profile: str = GREEDY):
    """A CrispASR session (the model loaded); greedy and reproducible with the default settings. The whisper_*
    settings apply to a whisper.cpp .bin (the whisper backend), the others to a GGUF; ``whisper_profile`` "cli"
    sets whisper-cli's beams and fallback there (its settings override the two whisper_* above)."""
    import crispasr

    backend = backend_of(model_file)
    session = crispasr.Session(model_file, n_threads=threads, backend=backend)
    if backend == WHISPER_BACKEND:
        settings = profile_named(whisper_profile).crispasr_whisper
        if whisper_profile != GREEDY:
            whisper_temperature_inc, whisper_suppress_nst = settings["temperature_inc"], settings["suppress_nst"]
        session.set_fallback_thresholds(**WHISPER_THRESHOLDS, temperature_inc=whisper_temperature_inc)
        session.set_whisper_decode_extras(suppress_nst=whisper_suppress_nst)
        if settings["beam_size"] is not None:
            session.set_beam_size(settings["beam_size"])
            session.set_best_of(settings["best_of"])
        return session
    session.set_max_new_tokens(max_new_tokens)
    session.set_temperature(temperature)
    session.set_frequency_penalty(frequency_penalty)
    return session


def bench_settings(profile_name: str) -> dict:
    """The bench's settings under a decode profile; the profile reaches the whisper backend only (a GGUF of the LLM
    families has one decoding)."""
    return CRISPASR_DECODE if profile_name == GREEDY else {**CRISPASR_DECODE, "whisper_profile": profile_name}


def crispasr_info() -> dict:
    import crispasr

    return {"crispasr": importlib.metadata.version("crispasr"), "backends": crispasr.Session.available_backends()}


# ------------------------------------------------------------------------------------------------- evaluation
def session_text(session, audio: "np.ndarray", language: str = LANGUAGE) -> tuple[str, int]:
    """(transcript, tokens) of one utterance in ``language``."""
    import numpy as np

    segments = session.transcribe(np.ascontiguousarray(audio, dtype=np.float32), language=language)
    text = " ".join(s.text.strip() for s in segments).strip()
    return text, sum(len(s.tokens) for s in segments)


class CrispASRTranscriber(WorkerTranscriber):
    """A worker process holding one CrispASR session; utterances go in as raw samples, text comes back."""

    def __init__(self, model_file: Path, options: DecodeOptions) -> None:
        super().__init__(model_file, options, "CrispASR",
                         ["-m", MODULE, WORKER_FLAG, str(model_file), str(options.threads),
                          str(options.max_new_tokens), options.profile, options.language])

    def describe(self) -> dict:
        runtime = "crispasr " + importlib.metadata.version("crispasr")
        if backend_of(str(self.model_file)) == WHISPER_BACKEND:
            profile = profile_named(self.options.profile)
            return {"loaded_as": "whisper.cpp model file (CrispASR whisper backend)", "runtime": runtime,
                    "threads": self.options.threads, "language": self.options.language, "temperature": 0.0,
                    **WHISPER_THRESHOLDS,
                    "decode": profile.name, **profile.crispasr_whisper,
                    **({"state": "fresh per item"} if fresh_state_per_item(profile.name) else {})}
        kind = "Voxtral" if is_gguf_of_arch(str(self.model_file), VOXTRAL_ARCH) else "Qwen3-ASR"
        return {"loaded_as": f"CrispASR {kind} GGUF", "runtime": runtime,
                "threads": self.options.threads, "language": self.options.language, "temperature": 0.0,
                "max_new_tokens": self.options.max_new_tokens}


def open_crispasr(spec: ModelSpec, options: DecodeOptions) -> CrispASRTranscriber:
    if is_whisper_cpp_file(spec.source):
        return CrispASRTranscriber(checked_whisper_cpp(spec), options).start()
    if is_gguf_of_arch(spec.source, VOXTRAL_ARCH) and not is_crispasr_voxtral(spec.source):
        from ..errors import UserError

        raise UserError(f"model {spec.label!r}: {spec.source} is transcribe.cpp's Voxtral GGUF (stt.voxtral keys); "
                        f"CrispASR runs its own (tarq-deploy export --target crispasr), transcribe.cpp this one")
    if is_gguf_of_arch(spec.source, VOXTRAL_ARCH):
        return CrispASRTranscriber(checked_gguf(spec, VOXTRAL_ARCH, "CrispASR", "crispasr"), options).start()
    return CrispASRTranscriber(checked_gguf(spec, ARCH, "CrispASR", "crispasr"), options).start()


def _worker_main(model_file: str, threads: int, max_new_tokens: int, profile_name: str,
                 language: str = LANGUAGE) -> int:
    """Runs in the worker subprocess: load once, then serve utterances (worker.serve_worker). The whisper backend
    under a profile that samples gets a new session after every utterance (``fresh_state_per_item``: its fallback RNG
    is seeded once per state, as in whisper.cpp)."""
    sessions = [open_session(model_file, threads, max_new_tokens, whisper_profile=profile_name)]

    def fresh_session() -> None:
        sessions[0].close()
        sessions[0] = open_session(model_file, threads, max_new_tokens, whisper_profile=profile_name)

    fresh = backend_of(model_file) == WHISPER_BACKEND and fresh_state_per_item(profile_name)
    return serve_worker(lambda audio: session_text(sessions[0], audio, language)[0], fresh_session if fresh else None)


# -------------------------------------------------------------------------------------------------- CPU bench
def measure_crispasr(spec: dict) -> dict:
    """Child side: import crispasr, read the audio, load the model, transcribe once. With no model: baseline."""
    started = time.perf_counter()
    import crispasr  # noqa: F401  (timed: the import is part of what a run costs)

    def load(model_file: str):
        settings = spec["settings"]
        return open_session(model_file, spec["threads"], int(settings["max_new_tokens"]),
                            float(settings["temperature"]), float(settings["frequency_penalty"]),
                            float(settings.get("whisper_temperature_inc", 0.0)),
                            bool(settings.get("whisper_suppress_nst", True)),
                            str(settings.get("whisper_profile", GREEDY)))

    return measure_transcription(
        spec, started, crispasr_info, load,
        transcribe=lambda session, audio: session.transcribe(audio, language=spec["settings"]["language"]),
        count_tokens=lambda session, segments: sum(len(s.tokens) for s in segments))


ADAPTER = RuntimeAdapter(
    NAME, "Qwen3-ASR GGUF (arch qwen3asr), Voxtral GGUF (arch voxtral), or a whisper.cpp .bin (its whisper backend), through the crispasr wheel "
          "(worker subprocess)", is_crispasr_file, open_crispasr, crispasr_info,
    BenchRuntime(NAME, describe_crispasr_file, f"{MODULE}:measure_crispasr", CRISPASR_DECODE,
                 "CrispASR wheel, in process (model file: Qwen3-ASR GGUF, arch qwen3asr; or a whisper.cpp .bin)",
                 bench_settings))

if __name__ == "__main__" and len(sys.argv) == 7 and sys.argv[1] == WORKER_FLAG:
    sys.exit(_worker_main(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5], sys.argv[6]))
