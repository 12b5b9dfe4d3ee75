"""Upstream qwen3-asr.cpp (with third_party/qwen3-asr.cpp's loader patch) as a CPU-bench runtime for Qwen3-ASR GGUF
files (arch "qwen3-asr").

The runtime is a binary, not a Python module: the child runs ``$QWEN3_ASR_CPP_BIN -m MODEL -f AUDIO -t THREADS
--max-tokens N --tokens`` once and reports the binary's own figures: model load time ("Model loaded in N ms") and
transcription time ("Total: N ms", mel + encoder + decoder) from its stderr, token count from its token list, text
from stdout. The binary's peak RSS is its ru_maxrss (the child's RUSAGE_CHILDREN after the run), reported as
``binary_peak_rss_mb``: the harness's own ``peak_rss_mb`` is the Python child's, not the runtime's.

Registered on import (bench.cpu.register_runtime).
"""
from __future__ import annotations

import hashlib
import os
import re
import resource
import subprocess
import time
from pathlib import Path
from typing import Any

from tarq_deploy.bench.cpu import ModelInfo, Runtime, register_runtime

NAME = "qwen3-asr.cpp"
ARCH = "qwen3-asr"
BINARY_ENV = "QWEN3_ASR_CPP_BIN"
QWEN3_ASR_CPP_DECODE = {"max_new_tokens": 224}  # the CLI takes no language: the model writes its language tag
_LOADED = re.compile(r"Model loaded in (\d+) ms")
_TOTAL = re.compile(r"Total:\s+(\d+) ms")
_TOKENS = re.compile(r"Tokens \((\d+)\):")


def describe_qwen3_asr_cpp_file(path: Path) -> ModelInfo:
    """Validate with our strict GGUF reader (GGUFFileError is a ValueError naming the problem)."""
    from tarq_deploy.formats.qwen3_asr_targets import describe_qwen3_asr_gguf

    backbone, precision, details = describe_qwen3_asr_gguf(path, ARCH)
    return ModelInfo(backbone, precision, details)


def binary_path() -> Path:
    value = os.environ.get(BINARY_ENV)
    if not value or not os.access(value, os.X_OK):
        raise FileNotFoundError(f"{BINARY_ENV}={value!r}: set it to a qwen3-asr-cli built with the loader patch "
                                f"(third_party/qwen3-asr.cpp/README.md)")
    return Path(value)


def measure_qwen3_asr_cpp(spec: dict) -> dict:
    """Child side: run the CLI once on the audio; with no model, only describe the binary (baseline)."""
    binary = binary_path()
    out: dict[str, Any] = {"import_s": 0.0}
    if spec.get("model") is None:
        out["runtime_info"] = {"binary": str(binary), "sha256": hashlib.sha256(binary.read_bytes()).hexdigest()}
        return out
    command = [str(binary), "-m", spec["model"], "-f", spec["audio"], "-t", str(spec["threads"]), "--max-tokens",
               str(spec["settings"]["max_new_tokens"]), "--tokens"]
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


register_runtime(Runtime(NAME, describe_qwen3_asr_cpp_file, "tarq_deploy.bench.qwen3_asr_cpp_runtime:measure_qwen3_asr_cpp",
                         QWEN3_ASR_CPP_DECODE, f"qwen3-asr.cpp CLI (${BINARY_ENV}, loader patch; model file: "
                                               f"Qwen3-ASR GGUF, arch qwen3-asr)"))
