"""whisper.cpp through pywhispercpp, on a legacy ggml whisper.cpp model file.

Evaluation: a worker subprocess (:class:`WhisperCppTranscriber`) decodes with a decode profile
(runtimes/decoding.py): ``greedy`` -- language "en", temperature 0 with no fallback (temperature_inc 0), no
timestamps, no context carried between utterances, fixed threads, and non-speech tokens suppressed (``suppress_nst``:
the symbols OpenAI's ``suppress_tokens="-1"`` list names, which transformers' generation config suppresses too;
without it whisper.cpp emits quote marks where the PyTorch decoder cannot, and the two greedy paths part) -- or
``cli``, whisper-cli's own defaults (beam search, fallback, timestamps). A long recording is handed to
whisper_full whole: whisper.cpp's own window-by-window loop decodes it. The file is parsed by our strict reader first: pywhispercpp does not raise on a file it cannot
load (the first transcribe() segfaults), and it takes a path that does not exist as a model *name* and downloads it.

CPU bench: :func:`measure_whisper_cpp` runs in the bench's child with :data:`WHISPER_CPP_DECODE`.
"""
from __future__ import annotations

import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np

from .base import BenchRuntime, DecodeOptions, ModelInfo, ModelSpec, RuntimeAdapter, dist_version
from .child import measure_transcription
from .decoding import WHISPER_GREEDY_PARAMS, fresh_state_per_item, profile_named
from .sources import checked_whisper_cpp, is_whisper_cpp_file
from .worker import WorkerTranscriber, serve_worker

__all__ = ["WHISPER_CPP_PARAMS", "describe_whisper_cpp_file", "teacher_forced_logits",
           "whisper_backbone", "whisper_cpp_model_arguments"]

NAME = "whisper.cpp"
MODULE = "tarq_deploy.runtimes.whisper_cpp"  # what worker and bench child import (there __name__ is __main__)
WORKER_FLAG = "--whisper-cpp-worker"
# The greedy profile's settings (pywhispercpp names), the research protocol of every earlier evaluation run
WHISPER_CPP_PARAMS = WHISPER_GREEDY_PARAMS
# The CPU bench's reproducible greedy English decoding: no language detection, no temperature fallback (a fallback
# re-decodes the window and would make latency depend on the weights' confidence, not only their speed). Everything
# else stays at whisper.cpp's defaults (timestamps on, flash attention per its context defaults), as whisper-cli runs.
WHISPER_CPP_DECODE = {"language": "en", "temperature": 0.0, "temperature_inc": 0.0, "print_progress": False,
                      "print_realtime": False, "print_timestamps": False}
# (n_audio_layer, n_audio_state) -> Whisper size
_WHISPER_SIZES = {(4, 384): "tiny", (6, 512): "base", (12, 768): "small", (24, 1024): "medium", (32, 1280): "large"}
_ENGLISH_ONLY_VOCAB = 51864


# ----------------------------------------------------------------------------------------------- the model file
def whisper_backbone(n_audio_layer: int, n_audio_state: int, n_text_layer: int, n_vocab: int, n_mels: int) -> str:
    """Whisper's size name from a whisper.cpp header (tiny.en, base, large-v3, large-v3-turbo, ...)."""
    size = _WHISPER_SIZES.get((n_audio_layer, n_audio_state), f"whisper-L{n_audio_layer}-d{n_audio_state}")
    if size == "large":
        size = "large-v3" if n_mels == 128 else "large"
        if n_text_layer == 4:
            size += "-turbo"
    return size + (".en" if n_vocab == _ENGLISH_ONLY_VOCAB else "")


def describe_whisper_cpp_file(path: Path) -> ModelInfo:
    """Validate with our strict parser (raises GGMLFileError, a ValueError naming the problem)."""
    from tarq_deploy.formats.ggml_blocks import GGML_TYPE_NAMES
    from tarq_deploy.formats.ggml_file import read_whisper_cpp

    h = read_whisper_cpp(path).hparams
    backbone = whisper_backbone(h.n_audio_layer, h.n_audio_state, h.n_text_layer, h.n_vocab, h.n_mels)
    return ModelInfo(backbone, GGML_TYPE_NAMES[h.weight_type], {"hparams": asdict(h)})


# ------------------------------------------------------------------------------------------------- evaluation
class WhisperCppTranscriber(WorkerTranscriber):
    """A pywhispercpp worker process holding one model; utterances go in as raw samples, text comes back."""

    def __init__(self, model_file: Path, options: DecodeOptions) -> None:
        super().__init__(model_file, options, "whisper.cpp",
                         ["-m", MODULE, WORKER_FLAG, str(model_file), str(options.threads), options.profile,
                          options.language])

    def describe(self) -> dict:
        import importlib.metadata

        profile = profile_named(self.options.profile)
        return {"loaded_as": "whisper.cpp model file", "runtime": "pywhispercpp "
                + importlib.metadata.version("pywhispercpp"), "threads": self.options.threads,
                "decode": profile.name, "beam_search": profile.beam_search, **profile.whisper_cpp,
                "language": self.options.language,
                **({"state": "fresh per item"} if fresh_state_per_item(profile.name) else {})}


def open_whisper_cpp(spec: ModelSpec, options: DecodeOptions) -> WhisperCppTranscriber:
    return WhisperCppTranscriber(checked_whisper_cpp(spec), options).start()


def bench_settings(profile_name: str) -> dict:
    """The bench child's Model arguments under a decode profile: ``greedy`` is the bench's reproducible greedy
    (:data:`WHISPER_CPP_DECODE`, kept as every earlier bench result ran), ``cli`` whisper-cli's defaults."""
    if profile_name == "greedy":
        return WHISPER_CPP_DECODE
    arguments = whisper_cpp_model_arguments(profile_name, threads=1)
    del arguments["n_threads"], arguments["redirect_whispercpp_logs_to"]  # the child sets them per run
    return arguments


def whisper_cpp_model_arguments(profile_name: str, threads: int, language: str = "en") -> dict:
    """pywhispercpp ``Model`` keyword arguments of a decode profile in ``language`` (printing off: it changes no
    decoding)."""
    profile = profile_named(profile_name)
    return {"params_sampling_strategy": 1 if profile.beam_search else 0, "redirect_whispercpp_logs_to": None,
            "n_threads": threads, "print_progress": False, "print_realtime": False, "print_timestamps": False,
            **profile.whisper_cpp, "language": language}


def _worker_main(model_file: str, threads: int, profile_name: str, language: str = "en") -> int:
    """Runs in the worker subprocess: load, then serve utterances (worker.serve_worker). Each utterance is one
    whisper_full call, so a recording longer than 30 s runs through whisper.cpp's own long-form loop. A profile that
    samples gets a fresh context after every utterance (``fresh_state_per_item``)."""
    from pywhispercpp.model import Model

    arguments = whisper_cpp_model_arguments(profile_name, threads, language)
    loaded = [Model(model_file, **arguments)]

    def transcribe(audio) -> str:
        return " ".join(s.text.strip() for s in loaded[0].transcribe(audio)).strip()

    def fresh_state() -> None:
        loaded[0] = Model(model_file, **arguments)

    return serve_worker(transcribe, fresh_state if fresh_state_per_item(profile_name) else None)


# -------------------------------------------------------------------------------------------------- CPU bench
def measure_whisper_cpp(spec: dict) -> dict:
    """Child side: import pywhispercpp, read the audio, load the model, transcribe once. With no model: baseline."""
    started = time.perf_counter()
    import _pywhispercpp as pw
    from pywhispercpp.model import Model

    def load(model_file: str) -> Model:
        model_path = Path(model_file)
        if not model_path.is_file():  # pywhispercpp would take the string as a model name and download it
            raise FileNotFoundError(f"{model_path}: no such model file")
        return Model(str(model_path), redirect_whispercpp_logs_to=None, n_threads=spec["threads"], **spec["settings"])

    # tokens of the output segments (text and timestamp tokens): the decoder steps that produced the transcript
    return measure_transcription(
        spec, started, whisper_cpp_runtime_info, load, transcribe=lambda model, audio: model.transcribe(audio),
        count_tokens=lambda model, segments: sum(pw.whisper_full_n_tokens(model._ctx, i)
                                                 for i in range(len(segments))))


def whisper_cpp_runtime_info() -> dict:
    """Versions of the whisper.cpp and ggml libraries pywhispercpp actually loaded, and its build's CPU features."""
    import _pywhispercpp as pw

    info: dict[str, Any] = {"pywhispercpp": dist_version("pywhispercpp"),
                            "system_info": pw.whisper_print_system_info().strip()}
    defaults = pw.whisper_context_default_params()
    info["context_defaults"] = {"flash_attn": defaults.flash_attn, "use_gpu": defaults.use_gpu}
    for library, symbols in (("libwhisper", ("whisper_version",)), ("libggml-base", ("ggml_version", "ggml_commit"))):
        info.update(_loaded_library_strings(library, symbols))
    return info


def _loaded_library_strings(library: str, symbols: tuple[str, ...]) -> dict[str, str]:
    """Call ``const char *f(void)`` symbols of a shared library this process has loaded (found in /proc/self/maps:
    the wheel vendors its own copies under mangled names, and other packages may ship another libwhisper)."""
    import ctypes

    found: dict[str, str] = {}
    for path in _loaded_library_paths(library):
        lib = ctypes.CDLL(path)  # already loaded: this only returns its handle
        for symbol in symbols:
            fn = getattr(lib, symbol, None)
            if fn is not None and symbol not in found:
                fn.restype = ctypes.c_char_p
                found[symbol] = fn().decode()
        found.setdefault(f"{library}_path", path)
    return found


def teacher_forced_logits(model_file: Path, audio: np.ndarray, tokens: list[int], threads: int = 1) -> np.ndarray:
    """The logits whisper.cpp computes after each prefix of ``tokens`` on ``audio`` (16 kHz float32 samples), as a
    float32 array [len(tokens), n_vocab]: its own mel and encoder once, then its decoder one token at a time on its KV
    cache, as its greedy decoder runs. Through the C API of the libwhisper pywhispercpp loaded (pywhispercpp's
    binding returns one float of the logits). The file must have passed our strict reader (``checked_whisper_cpp``)."""
    import ctypes

    import _pywhispercpp  # noqa: F401  (loads the wheel's libwhisper, whose handle is taken below)

    found = _loaded_library_paths("libwhisper")
    if not found:
        raise RuntimeError("pywhispercpp loaded no libwhisper")
    lib = ctypes.CDLL(found[0])
    lib.whisper_init_from_file.restype, lib.whisper_init_from_file.argtypes = ctypes.c_void_p, [ctypes.c_char_p]
    lib.whisper_pcm_to_mel.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_float), ctypes.c_int, ctypes.c_int]
    lib.whisper_encode.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int]
    lib.whisper_decode.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_int32), ctypes.c_int, ctypes.c_int,
                                   ctypes.c_int]
    lib.whisper_get_logits.restype, lib.whisper_get_logits.argtypes = ctypes.POINTER(ctypes.c_float), [ctypes.c_void_p]
    lib.whisper_n_vocab.argtypes = [ctypes.c_void_p]
    lib.whisper_free.argtypes = [ctypes.c_void_p]
    ctx = lib.whisper_init_from_file(str(model_file).encode())
    if not ctx:
        raise RuntimeError(f"{model_file}: whisper.cpp could not load it")
    try:
        samples = np.ascontiguousarray(audio, dtype=np.float32)
        if lib.whisper_pcm_to_mel(ctx, samples.ctypes.data_as(ctypes.POINTER(ctypes.c_float)), len(samples), threads):
            raise RuntimeError("whisper_pcm_to_mel failed")
        if lib.whisper_encode(ctx, 0, threads):
            raise RuntimeError("whisper_encode failed")
        n_vocab = lib.whisper_n_vocab(ctx)
        rows = []
        for n_past, token in enumerate(tokens):
            one = (ctypes.c_int32 * 1)(token)
            if lib.whisper_decode(ctx, one, 1, n_past, threads):
                raise RuntimeError(f"whisper_decode failed at token {n_past}")
            rows.append(np.ctypeslib.as_array(lib.whisper_get_logits(ctx), shape=(n_vocab,)).copy())
        return np.stack(rows)
    finally:
        lib.whisper_free(ctx)


def _loaded_library_paths(library: str) -> list[str]:
    """Paths of a shared library this process has loaded (pywhispercpp's wheel loads its copies under mangled
    names), from /proc/self/maps."""
    try:
        maps = Path("/proc/self/maps").read_text().split("\n")
    except OSError:
        return []
    return sorted({line.split()[-1] for line in maps if f"/{library}" in line and ".so" in line})


ADAPTER = RuntimeAdapter(
    NAME, "whisper.cpp model file through pywhispercpp (worker subprocess)", is_whisper_cpp_file, open_whisper_cpp,
    whisper_cpp_runtime_info,
    BenchRuntime(NAME, describe_whisper_cpp_file, f"{MODULE}:measure_whisper_cpp", WHISPER_CPP_DECODE,
                 "whisper.cpp through pywhispercpp (model file: legacy ggml .bin)", bench_settings))

if __name__ == "__main__" and len(sys.argv) == 6 and sys.argv[1] == WORKER_FLAG:
    sys.exit(_worker_main(sys.argv[2], int(sys.argv[3]), sys.argv[4], sys.argv[5]))
