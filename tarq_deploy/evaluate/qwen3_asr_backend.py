"""Qwen3-ASR evaluation backends: PyTorch (a float transformers directory or a lattice checkpoint, dequantized to
s * q) and upstream qwen3-asr.cpp (a GGUF of architecture "qwen3-asr", run by the binary ``QWEN3_ASR_CPP_BIN`` points
to -- built from predict-woo/qwen3-asr.cpp with third_party/qwen3-asr.cpp's loader patch).

Decoding is greedy in both. The PyTorch backend prefills "language English<asr_text>" (as transformers'
``apply_transcription_request`` and CrispASR do); upstream qwen3-asr.cpp takes no language and lets the model write
the "language <Name><asr_text>" prefix, which is cut off here (tarq_deploy.models.qwen3_asr.transcript_of). The binary
reads a WAV file per utterance (16-bit PCM written to a temporary file) in a fresh process, so a crash is reported with
the model file and the utterance.

Registered on import; ``qwen3-asr-torch`` claims Qwen3-ASR checkpoints and transformers directories (inferred before
the Whisper ``torch`` backend), ``qwen3-asr.cpp`` claims GGUF files of architecture "qwen3-asr".
"""
from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import wave
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import UserError
from .backends import (Backend, BackendError, DecodeOptions, ModelSpec, checked_gguf, is_gguf_of_arch,
                       register_backend)

TORCH_NAME = "qwen3-asr-torch"
CPP_NAME = "qwen3-asr.cpp"
CPP_ARCH = "qwen3-asr"
BINARY_ENV = "QWEN3_ASR_CPP_BIN"
SAMPLE_RATE = 16_000


# ------------------------------------------------------------------------------------------------- PyTorch backend
def is_qwen3_asr_source(source: str) -> bool:
    from ..models.qwen3_asr import is_qwen3_asr_checkpoint, is_qwen3_asr_directory

    return is_qwen3_asr_checkpoint(source) or is_qwen3_asr_directory(source)


class Qwen3ASRTorchTranscriber:
    """Greedy transcription with transformers' Qwen3-ASR, one utterance at a time."""

    def __init__(self, model, processor, options: DecodeOptions, origin: dict) -> None:
        import torch

        from ..models.qwen3_asr import Qwen3ASRBackbone

        torch.set_num_threads(options.threads)
        self.backbone = Qwen3ASRBackbone(model, processor, options.device)
        self.max_new_tokens = options.max_new_tokens
        self.origin = {**origin, "threads": options.threads, "device": options.device, "language": "en",
                       "max_new_tokens": options.max_new_tokens}

    def transcribe(self, audio: np.ndarray, utterance_id: str) -> str:
        return self.backbone.transcribe(audio, self.max_new_tokens)

    def describe(self) -> dict:
        return self.origin

    def close(self) -> None:
        self.backbone = None  # type: ignore[assignment]


def open_torch_qwen3_asr(spec: ModelSpec, options: DecodeOptions) -> Qwen3ASRTorchTranscriber:
    from ..models.qwen3_asr import is_qwen3_asr_checkpoint, load_dequantized_qwen3_asr, load_qwen3_asr

    source = spec.source
    try:
        if is_qwen3_asr_checkpoint(source):
            return Qwen3ASRTorchTranscriber(*load_dequantized_qwen3_asr(source), options,
                                            {"loaded_as": "Qwen3-ASR lattice checkpoint, dequantized (s * q)"})
        return Qwen3ASRTorchTranscriber(*load_qwen3_asr(source), options, {"loaded_as": "Qwen3-ASR float model"})
    except (ValueError, OSError) as error:
        raise UserError(f"model {spec.label!r} ({source}): cannot load it as a Qwen3-ASR model: {error}") from None


# ---------------------------------------------------------------------------------------------- qwen3-asr.cpp backend
def is_qwen3_asr_cpp_file(source: str) -> bool:
    return is_gguf_of_arch(source, CPP_ARCH)


def qwen3_asr_cpp_binary() -> Path:
    """The qwen3-asr-cli that QWEN3_ASR_CPP_BIN names (UserError saying how to get one otherwise)."""
    value = os.environ.get(BINARY_ENV)
    if not value:
        raise UserError(f"{BINARY_ENV} is not set: build predict-woo/qwen3-asr.cpp with the loader patch "
                        f"(third_party/qwen3-asr.cpp/README.md) and point {BINARY_ENV} to its qwen3-asr-cli")
    path = Path(value).expanduser()
    if not (path.is_file() and os.access(path, os.X_OK)):
        raise UserError(f"{BINARY_ENV}={value}: not an executable file")
    return path


def write_wav_pcm16(audio: np.ndarray, path: Path) -> None:
    pcm = (np.clip(audio, -1.0, 1.0) * 32767.0).round().astype("<i2")
    with wave.open(str(path), "wb") as out:
        out.setnchannels(1)
        out.setsampwidth(2)
        out.setframerate(SAMPLE_RATE)
        out.writeframes(pcm.tobytes())


def run_qwen3_asr_cpp(binary: Path, model_file: Path, wav: Path, threads: int, max_tokens: int,
                      timeout_s: float) -> subprocess.CompletedProcess:
    """One transcription by the CLI (text on stdout; load time, timings and token ids on stderr)."""
    command = [str(binary), "-m", str(model_file), "-f", str(wav), "-t", str(threads), "--max-tokens",
               str(max_tokens), "--tokens"]
    env = {**os.environ, "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY", "PASSIVE")}
    # errors="replace": a token that splits a UTF-8 sequence must not end the whole eval run with a traceback
    return subprocess.run(command, capture_output=True, text=True, encoding="utf-8", errors="replace",
                          timeout=timeout_s, env=env)


@dataclass
class Qwen3ASRCppTranscriber:
    binary: Path
    model_file: Path
    options: DecodeOptions

    def __post_init__(self) -> None:
        self.work = Path(tempfile.mkdtemp(prefix="qwen3-asr-cpp-"))

    def transcribe(self, audio: np.ndarray, utterance_id: str) -> str:
        from ..models.qwen3_asr import transcript_of

        wav = self.work / "utterance.wav"
        write_wav_pcm16(audio, wav)
        try:
            done = run_qwen3_asr_cpp(self.binary, self.model_file, wav, self.options.threads,
                                     self.options.max_new_tokens, self.options.timeout_s)
        except subprocess.TimeoutExpired:
            raise BackendError(f"{self.model_file}: qwen3-asr.cpp gave no answer within {self.options.timeout_s:.0f} s "
                               f"on utterance {utterance_id!r}") from None
        if done.returncode != 0:
            raise BackendError(f"{self.model_file}: qwen3-asr.cpp failed on utterance {utterance_id!r} (exit status "
                               f"{done.returncode}); stderr ends with:\n{done.stderr[-2000:]}")
        return transcript_of(done.stdout)

    def describe(self) -> dict:
        return {"loaded_as": "qwen3-asr.cpp GGUF", "runtime": str(self.binary), "threads": self.options.threads,
                "language": "model-detected (the CLI takes none)", "max_new_tokens": self.options.max_new_tokens}

    def close(self) -> None:
        shutil.rmtree(self.work, ignore_errors=True)


def open_qwen3_asr_cpp(spec: ModelSpec, options: DecodeOptions) -> Qwen3ASRCppTranscriber:
    path = checked_gguf(spec, CPP_ARCH, "qwen3-asr.cpp", "qwen3-asr.cpp")
    return Qwen3ASRCppTranscriber(qwen3_asr_cpp_binary(), path, options)


register_backend(Backend(TORCH_NAME, "transformers Qwen3-ASR (float directory or lattice checkpoint dequantized)",
                         is_qwen3_asr_source, open_torch_qwen3_asr))
register_backend(Backend(CPP_NAME, "Qwen3-ASR GGUF (arch qwen3-asr) through the qwen3-asr.cpp CLI "
                                   f"(${BINARY_ENV}, with the loader patch)", is_qwen3_asr_cpp_file,
                         open_qwen3_asr_cpp))
