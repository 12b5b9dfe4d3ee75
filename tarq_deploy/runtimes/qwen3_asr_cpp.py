"""Upstream qwen3-asr.cpp (predict-woo/qwen3-asr.cpp with third_party/qwen3-asr.cpp's loader patch) on Qwen3-ASR GGUF
files of architecture "qwen3-asr". The runtime is a binary, not a Python module: ``$QWEN3_ASR_CPP_BIN -m MODEL -f
AUDIO -t THREADS --max-tokens N --tokens`` prints the text on stdout and the load time, timings and token ids on
stderr. It takes no language: the model writes its "language <Name><asr_text>" prefix itself.

Evaluation: one fresh process per utterance on a WAV file (16-bit PCM written to a temporary directory), the prefix
cut off (tarq_deploy.models.qwen3_asr.transcript_of); a crash is reported with the model file and the utterance.

CPU bench: :func:`measure_qwen3_asr_cpp` runs the CLI once in the bench's child and reports the binary's own figures:
model load time ("Model loaded in N ms") and transcription time ("Total: N ms", mel + encoder + decoder) from its
stderr, token count from its token list, text from stdout. The binary's peak RSS is its ru_maxrss (the child's
RUSAGE_CHILDREN after the run), reported as ``binary_peak_rss_mb``: the harness's own ``peak_rss_mb`` is the Python
child's, not the runtime's.
"""
from __future__ import annotations

import os
import re
import resource
import shutil
import subprocess
import tempfile
import time
import wave
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import UserError
from ..hashing import file_sha256
from ..model_source import ModelSource
from .base import SAMPLE_RATE, BackendError, BenchRuntime, DecodeOptions, ModelInfo, ModelSpec, RuntimeAdapter
from .sources import checked_gguf, is_gguf_of_arch

if TYPE_CHECKING:
    import numpy as np

__all__ = ["run_qwen3_asr_cpp"]

NAME = "qwen3-asr.cpp"
ARCH = "qwen3-asr"
BINARY_ENV = "QWEN3_ASR_CPP_BIN"
QWEN3_ASR_CPP_DECODE = {"max_new_tokens": 224}  # the CLI takes no language: the model writes its language tag
_LOADED = re.compile(r"Model loaded in (\d+) ms")
_TOTAL = re.compile(r"Total:\s+(\d+) ms")
_TOKENS = re.compile(r"Tokens \((\d+)\):")


def is_qwen3_asr_cpp_file(source: str | ModelSource) -> bool:
    return is_gguf_of_arch(source, ARCH)


def describe_qwen3_asr_cpp_file(path: Path) -> ModelInfo:
    """Validate with our strict GGUF reader (GGUFFileError is a ValueError naming the problem)."""
    from tarq_deploy.formats.qwen3_asr_targets import describe_qwen3_asr_gguf

    backbone, precision, details = describe_qwen3_asr_gguf(path, ARCH)
    return ModelInfo(backbone, precision, details)


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


def binary_info(binary: Path) -> dict:
    return {"binary": str(binary), "sha256": file_sha256(binary)}


def qwen3_asr_cpp_info() -> dict:
    return binary_info(qwen3_asr_cpp_binary())


def cli_command(binary: Path, model_file: str | Path, wav: str | Path, threads: int, max_tokens: int) -> list[str]:
    return [str(binary), "-m", str(model_file), "-f", str(wav), "-t", str(threads), "--max-tokens", str(max_tokens),
            "--tokens"]


# ------------------------------------------------------------------------------------------------- evaluation
def write_wav_pcm16(audio: "np.ndarray", path: Path) -> None:
    import numpy as np

    pcm = (np.clip(audio, -1.0, 1.0) * 32767.0).round().astype("<i2")
    with wave.open(str(path), "wb") as out:
        out.setnchannels(1)
        out.setsampwidth(2)
        out.setframerate(SAMPLE_RATE)
        out.writeframes(pcm.tobytes())


def run_qwen3_asr_cpp(binary: Path, model_file: Path, wav: Path, threads: int, max_tokens: int,
                      timeout_s: float) -> subprocess.CompletedProcess:
    """One transcription by the CLI (text on stdout; load time, timings and token ids on stderr)."""
    env = {**os.environ, "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY", "PASSIVE")}
    # errors="replace": a token that splits a UTF-8 sequence must not end the whole eval run with a traceback
    return subprocess.run(cli_command(binary, model_file, wav, threads, max_tokens), capture_output=True, text=True,
                          encoding="utf-8", errors="replace", timeout=timeout_s, env=env)


@dataclass
class Qwen3ASRCppTranscriber:
    binary: Path
    model_file: Path
    options: DecodeOptions

    def __post_init__(self) -> None:
        self.work = Path(tempfile.mkdtemp(prefix="qwen3-asr-cpp-"))

    def transcribe(self, audio: "np.ndarray", utterance_id: str) -> str:
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
    path = checked_gguf(spec, ARCH, "qwen3-asr.cpp", "qwen3-asr.cpp")
    return Qwen3ASRCppTranscriber(qwen3_asr_cpp_binary(), path, options)


# -------------------------------------------------------------------------------------------------- CPU bench
def bench_binary() -> Path:
    """The binary for the bench's child; a missing one ends the child with this message, which the harness shows."""
    value = os.environ.get(BINARY_ENV)
    if not value or not os.access(value, os.X_OK):
        raise FileNotFoundError(f"{BINARY_ENV}={value!r}: set it to a qwen3-asr-cli built with the loader patch "
                                f"(third_party/qwen3-asr.cpp/README.md)")
    return Path(value)


def measure_qwen3_asr_cpp(spec: dict) -> dict:
    """Child side: run the CLI once on the audio; with no model, only describe the binary (baseline)."""
    binary = bench_binary()
    out: dict[str, Any] = {"import_s": 0.0}
    if spec.get("model") is None:
        out["runtime_info"] = binary_info(binary)
        return out
    command = cli_command(binary, spec["model"], spec["audio"], spec["threads"], spec["settings"]["max_new_tokens"])
    started = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, encoding="utf-8", errors="replace")
    wall_s = time.perf_counter() - started
    if done.returncode != 0:
        raise RuntimeError(f"{binary} exited with status {done.returncode}: {done.stderr[-500:]}")
    out.update(_figures(done.stderr, wall_s))
    out["text"] = done.stdout.strip()
    out["binary_peak_rss_mb"] = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    return out


def _figures(stderr: str, wall_s: float) -> dict:
    loaded, total, tokens = _LOADED.search(stderr), _TOTAL.search(stderr), _TOKENS.search(stderr)
    return {"load_s": int(loaded.group(1)) / 1000 if loaded else None,
            "transcribe_s": int(total.group(1)) / 1000 if total else None,
            "tokens": int(tokens.group(1)) if tokens else None, "binary_wall_s": wall_s}


ADAPTER = RuntimeAdapter(
    NAME, f"Qwen3-ASR GGUF (arch qwen3-asr) through the qwen3-asr.cpp CLI (${BINARY_ENV}, with the loader patch)",
    is_qwen3_asr_cpp_file, open_qwen3_asr_cpp, qwen3_asr_cpp_info,
    BenchRuntime(NAME, describe_qwen3_asr_cpp_file, "tarq_deploy.runtimes.qwen3_asr_cpp:measure_qwen3_asr_cpp",
                 QWEN3_ASR_CPP_DECODE, f"qwen3-asr.cpp CLI (${BINARY_ENV}, loader patch; model file: Qwen3-ASR GGUF, "
                                       f"arch qwen3-asr)"))
