"""The CPU bench's child process: ``python -c CHILD_CODE SPEC.json`` imports this module (stdlib only at module
level, so the child's baseline is the interpreter, the runtime and the audio), then the runtime's measuring function
named in the spec ("module:function"), and writes what it measured to spec["result"].

The helpers the measuring functions share live here too: the audio as whisper.cpp takes it, the process's own
memory figures from /proc/self/status, and the run of an in-process runtime (:func:`measure_transcription`).
"""
from __future__ import annotations

import importlib
import json
import os
import time
import wave
from pathlib import Path
from typing import Any, Callable

from ..fileio import write_text_atomic

__all__ = ["CHILD_CODE", "measure_transcription", "proc_status_mb", "read_wav_float32"]

CHILD_CODE = "import sys; from tarq_deploy.runtimes.child import child_main; sys.exit(child_main(sys.argv[1:]))"


def child_main(argv: list[str]) -> int:
    """Entry of the child: run the spec's measuring function and write its measurements (peak RSS added last)."""
    spec = json.loads(Path(argv[0]).read_text())
    module_name, function_name = spec["worker"].split(":")
    measure = getattr(importlib.import_module(module_name), function_name)
    out = measure(spec)
    out["peak_rss_mb"] = proc_status_mb("VmHWM")  # last, after everything the run allocated
    write_text_atomic(spec["result"], json.dumps(out))
    return 0


def read_wav_float32(path: str | os.PathLike) -> Any:
    """16-bit PCM mono 16 kHz WAV -> float32 numpy array in [-1, 1) (what whisper.cpp's whisper_full takes)."""
    import numpy as np

    with wave.open(str(path), "rb") as wav:
        frames = wav.readframes(wav.getnframes())
    return np.frombuffer(frames, dtype="<i2").astype(np.float32) / 32768.0


def proc_status_mb(key: str) -> float | None:
    """A memory line of /proc/self/status (VmHWM = peak RSS, VmRSS = current) in MiB; None off Linux."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1]) / 1024  # kB
    except OSError:
        pass
    return None


def measure_transcription(spec: dict, import_started: float, runtime_info: Callable[[], dict],
                          load: Callable[[str], Any], transcribe: Callable[[Any, Any], list],
                          count_tokens: Callable[[Any, list], int]) -> dict:
    """One bench run of a runtime that works in process, once the caller has imported it (timed from
    ``import_started``): read the audio, then with no model only the runtime's info (the baseline); else load
    spec["model"], transcribe once, and report the timings, RSS after load, tokens and text of the segments."""
    out: dict[str, Any] = {"import_s": time.perf_counter() - import_started}
    audio = read_wav_float32(spec["audio"])
    if spec.get("model") is None:
        out["runtime_info"] = runtime_info()
        return out
    started = time.perf_counter()
    model = load(spec["model"])
    out["load_s"] = time.perf_counter() - started
    out["rss_after_load_mb"] = proc_status_mb("VmRSS")
    started = time.perf_counter()
    segments = transcribe(model, audio)
    out["transcribe_s"] = time.perf_counter() - started
    out["tokens"] = count_tokens(model, segments)
    out["text"] = " ".join(s.text.strip() for s in segments).strip()
    return out
