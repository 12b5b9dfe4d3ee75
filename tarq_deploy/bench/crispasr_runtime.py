"""CrispASR (PyPI ``crispasr``) as a CPU-bench runtime for Qwen3-ASR GGUF files (arch "qwen3asr").

The child imports the wheel, reads the audio, opens a session (= loads the model) and transcribes once, in process
(ctypes), so the harness's peak RSS and timings are the runtime's own. Decoding: language "en" (CrispASR prefills
"language English<asr_text>"), greedy, no frequency penalty, at most ``max_new_tokens`` tokens. Files are validated
by our strict GGUF reader in the harness first.

Registered on import (bench.cpu.register_runtime).
"""
from __future__ import annotations

import importlib.metadata
import time
from pathlib import Path
from typing import Any

from tarq_deploy.bench.cpu import ModelInfo, Runtime, proc_status_mb, read_wav_float32, register_runtime

NAME = "crispasr"
ARCH = "qwen3asr"
CRISPASR_DECODE = {"language": "en", "temperature": 0.0, "frequency_penalty": 0.0, "max_new_tokens": 224}


def describe_crispasr_file(path: Path) -> ModelInfo:
    """Validate with our strict GGUF reader (GGUFFileError is a ValueError naming the problem)."""
    from tarq_deploy.formats.qwen3_asr_targets import describe_qwen3_asr_gguf

    backbone, precision, details = describe_qwen3_asr_gguf(path, ARCH)
    return ModelInfo(backbone, precision, details)


def measure_crispasr(spec: dict) -> dict:
    """Child side: import crispasr, read the audio, load the model, transcribe once. With no model: baseline."""
    started = time.perf_counter()
    import crispasr

    out: dict[str, Any] = {"import_s": time.perf_counter() - started}
    audio = read_wav_float32(spec["audio"])
    if spec.get("model") is None:
        out["runtime_info"] = {"crispasr": importlib.metadata.version("crispasr"),
                               "backends": crispasr.Session.available_backends()}
        return out
    settings = spec["settings"]
    started = time.perf_counter()
    session = crispasr.Session(spec["model"], n_threads=spec["threads"])
    session.set_max_new_tokens(int(settings["max_new_tokens"]))
    session.set_temperature(float(settings["temperature"]))
    session.set_frequency_penalty(float(settings["frequency_penalty"]))
    out["load_s"] = time.perf_counter() - started
    out["rss_after_load_mb"] = proc_status_mb("VmRSS")
    started = time.perf_counter()
    segments = session.transcribe(audio, language=settings["language"])
    out["transcribe_s"] = time.perf_counter() - started
    out["tokens"] = sum(len(s.tokens) for s in segments)
    out["text"] = " ".join(s.text.strip() for s in segments).strip()
    return out


register_runtime(Runtime(NAME, describe_crispasr_file, "tarq_deploy.bench.crispasr_runtime:measure_crispasr", CRISPASR_DECODE,
                         "CrispASR wheel, in process (model file: Qwen3-ASR GGUF, arch qwen3asr)"))
