"""Recognisers behind one interface, so every model is scored on the same audio with the same greedy decoding.

Backends (a registry: a GGUF runtime plugs in with :func:`register_backend`):

* ``torch`` -- transformers Whisper on CPU (or CUDA): a plain model (``packaged:NAME``, a transformers or CTranslate2
  directory, a hub id), a lattice checkpoint directory (every lattice weight dequantized to s * q, the tied token
  embedding / output projection honoured), or a whisper.cpp model file dequantized tensor by tensor (so ggml's own
  Q4_0 rounding can be run in PyTorch too; its tokenizer and configs come from a companion model, ``--tokenizer``).
  Greedy: ``<|startoftranscript|> [<|en|> <|transcribe|>] <|notimestamps|>`` as the decoder prompt (the multilingual
  models need the language and task tokens or they loop), no sampling, one beam, no temperature fallback.
* ``whisper.cpp`` -- a whisper.cpp model file through pywhispercpp in a worker subprocess: language "en",
  temperature 0 with no fallback (temperature_inc 0), no timestamps, no context carried between utterances, fixed
  threads, and non-speech tokens suppressed (``suppress_nst``: the symbols OpenAI's ``suppress_tokens="-1"`` list
  names, which transformers' generation config suppresses too; without it whisper.cpp emits quote marks where the
  PyTorch decoder cannot, and the two greedy paths part). The file is parsed by our strict reader first (a file
  whisper.cpp fails to load makes pywhispercpp segfault on the first transcribe rather than raise), and a crash of
  the worker is reported with the model file and the utterance instead of killing the evaluation.

Audio is decoded once by :func:`tarq_deploy.data.corpus.load_audio` in the parent process and handed to every
backend as the same float32 16 kHz array (the whisper.cpp worker receives the raw samples).
"""
from __future__ import annotations

import base64
import json
import os
import queue
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator, Protocol, Sequence

import numpy as np

from ..errors import UserError

SAMPLE_RATE = 16_000
GGML_MAGIC = b"lmgg"  # 0x67676d6c little-endian: the legacy whisper.cpp file
GGUF_MAGIC = b"GGUF"
CHECKPOINT_MARKERS = ("manifest.json", "lattice.safetensors")
WORKER_FLAG = "--whisper-cpp-worker"
# Decoding settings of every whisper.cpp run (pywhispercpp names); they are part of a cached hypothesis's identity.
WHISPER_CPP_PARAMS = {"language": "en", "translate": False, "temperature": 0.0, "temperature_inc": 0.0,
                      "no_timestamps": True, "no_context": True, "suppress_nst": True}


class BackendError(RuntimeError):
    """A recogniser failed on real input (crash, timeout); the message names the model file and the utterance."""


@dataclass(frozen=True)
class DecodeOptions:
    """What every backend must honour so runs are comparable."""

    threads: int = 1
    max_new_tokens: int = 224  # whisper.cpp stops a segment at n_text_ctx / 2 = 224 tokens as well
    device: str = "cpu"
    timeout_s: float = 600.0  # per utterance: a looping 4-bit model on a busy machine is slow, never this slow


@dataclass(frozen=True)
class ModelSpec:
    """One column of the evaluation: a display label, where the model is, and which backend runs it."""

    label: str
    source: str
    backend: str
    tokenizer: str | None = None  # torch backend on a whisper.cpp file: where config and tokenizer come from

    @property
    def key(self) -> str:
        return f"{self.label} [{self.backend}]"


class Transcriber(Protocol):
    def transcribe(self, audio: np.ndarray, utterance_id: str) -> str: ...

    def describe(self) -> dict: ...

    def close(self) -> None: ...


@dataclass(frozen=True)
class Backend:
    """A registered backend: ``claims(source)`` says whether it is the natural backend for a source (inference),
    ``open(spec, options)`` loads the model."""

    name: str
    description: str
    claims: Callable[[str], bool]
    open: Callable[[ModelSpec, DecodeOptions], Transcriber]


BACKENDS: dict[str, Backend] = {}


def register_backend(backend: Backend) -> None:
    BACKENDS[backend.name] = backend


# --------------------------------------------------------------------------------------------- file type sniffing
def file_magic(source: str) -> bytes:
    path = Path(source).expanduser()
    if not path.is_file():
        return b""
    with open(path, "rb") as f:
        return f.read(4)


def is_whisper_cpp_file(source: str) -> bool:
    return file_magic(source) == GGML_MAGIC


def is_gguf_file(source: str) -> bool:
    return file_magic(source) == GGUF_MAGIC


def is_gguf_of_arch(source: str, arch: str) -> bool:
    """A GGUF file whose general.architecture is ``arch`` (a file our reader rejects is not claimed)."""
    if not is_gguf_file(source):
        return False
    from tarq_deploy.formats.gguf_file import GGUFFileError, read_gguf

    try:
        return read_gguf(Path(source).expanduser()).arch == arch
    except GGUFFileError:
        return False


def checked_gguf(spec: "ModelSpec", arch: str, runtime: str, export_target: str) -> Path:
    """The resolved path of ``spec``'s GGUF once our strict reader accepts it and its architecture is ``arch``; a
    UserError naming the model and file otherwise (a runtime must never see a file our parser rejects)."""
    from tarq_deploy.formats.gguf_file import GGUFFileError, read_gguf

    path = Path(spec.source).expanduser()
    try:
        found = read_gguf(path).arch
    except GGUFFileError as error:
        raise UserError(f"model {spec.label!r}: {error}") from None
    if found != arch:
        raise UserError(f"model {spec.label!r}: {path} is a {found!r} GGUF; {runtime} runs architecture {arch!r} "
                        f"(tarq-deploy export --target {export_target})")
    return path.resolve()


def is_lattice_checkpoint(source: str) -> bool:
    path = Path(source).expanduser()
    return path.is_dir() and all((path / marker).is_file() for marker in CHECKPOINT_MARKERS)


def infer_backend(source: str) -> str:
    """The backend a source runs on by default: the first registered backend that claims it (torch claims the rest)."""
    if is_gguf_file(source):
        runtimes = [b.name for b in BACKENDS.values() if b.claims(source)]
        if not runtimes:
            raise UserError(f"{source}: a GGUF file, and no GGUF runtime backend is registered yet "
                            f"(available: {', '.join(BACKENDS)})")
        return runtimes[0]
    for backend in BACKENDS.values():
        if backend.name != "torch" and backend.claims(source):
            return backend.name
    return "torch"


def open_transcriber(spec: ModelSpec, options: DecodeOptions) -> Transcriber:
    if spec.backend not in BACKENDS:
        raise UserError(f"model {spec.label!r}: unknown backend {spec.backend!r} (available: {', '.join(BACKENDS)})")
    return BACKENDS[spec.backend].open(spec, options)


# --------------------------------------------------------------------------------------------------- torch backend
class TorchTranscriber:
    """Greedy transcription with a transformers Whisper model, one utterance at a time (batching did not pay off
    on CPU: the 30 s encoder pass dominates, and single items keep results independent of batch composition)."""

    def __init__(self, bundle, options: DecodeOptions, origin: dict) -> None:
        import torch

        from ..models.whisper import WhisperBackbone

        model, processor, generation_config = bundle
        torch.set_num_threads(options.threads)
        self.backbone = WhisperBackbone(model, processor, generation_config, options.device)
        self.generation_config = _greedy_config(generation_config, options.max_new_tokens)
        self.prompt = torch.tensor([self.backbone.prompt_ids()], device=self.backbone.device)
        self.origin = {**origin, "threads": options.threads, "device": options.device,
                       "max_new_tokens": options.max_new_tokens}

    def transcribe(self, audio: np.ndarray, utterance_id: str) -> str:
        import torch

        with torch.inference_mode():
            ids = self.backbone.model.generate(self._features(audio), decoder_input_ids=self.prompt,
                                               generation_config=self.generation_config)
        return self.backbone.processor.tokenizer.decode(ids[0], skip_special_tokens=True).strip()

    def continuation_margin(self, audio: np.ndarray, other_text: str) -> float | None:
        """How close a disagreement is to a tie for this model: at the first token where its own greedy transcript
        and ``other_text`` part, log p(own token) - log p(other's token) given the shared prefix (teacher forcing,
        raw log-probabilities). A margin near zero is a near-tie that tiny numerical differences between runtimes can
        flip; None when the token sequences do not differ."""
        import torch

        features = self._features(audio)
        with torch.inference_mode():
            generated = self.backbone.model.generate(features, decoder_input_ids=self.prompt,
                                                     generation_config=self.generation_config)[0].tolist()
            prompt, eos = self.prompt[0].tolist(), self.backbone.generation_config.eos_token_id
            if generated[: len(prompt)] == prompt:  # transformers returns the new tokens only, older versions all
                generated = generated[len(prompt):]
            own = [t for t in generated if t != eos]
            other = self.backbone.processor.tokenizer.encode(" " + other_text.strip(), add_special_tokens=False)
            split = next((i for i, (x, y) in enumerate(zip(own, other)) if x != y), min(len(own), len(other)))
            if split == len(own) == len(other):
                return None
            prefix = torch.cat([self.prompt, torch.tensor([own[:split]], dtype=self.prompt.dtype,
                                                          device=self.prompt.device)], dim=1)
            logits = self.backbone.model(input_features=features, decoder_input_ids=prefix).logits[0, -1]
        log_probs = torch.log_softmax(logits.float(), dim=-1)
        own_next = own[split] if split < len(own) else eos
        other_next = other[split] if split < len(other) else eos
        return float(log_probs[own_next] - log_probs[other_next])

    def _features(self, audio: np.ndarray):
        processor = self.backbone.processor
        features = processor.feature_extractor(audio, sampling_rate=SAMPLE_RATE, return_tensors="pt").input_features
        return features.to(self.backbone.device)

    def describe(self) -> dict:
        return self.origin

    def close(self) -> None:
        self.backbone = None  # type: ignore[assignment]


def _greedy_config(generation_config, max_new_tokens: int):
    config = generation_config.__class__.from_dict(generation_config.to_dict())
    config.do_sample, config.num_beams, config.max_new_tokens, config.max_length = False, 1, max_new_tokens, None
    config.temperature = None
    return config


def _quiet_transformers() -> None:
    from transformers.utils import logging

    logging.set_verbosity_error()


def open_torch(spec: ModelSpec, options: DecodeOptions) -> TorchTranscriber:
    bundle, loaded_as = load_torch_bundle(spec)
    origin = {"loaded_as": loaded_as, **({"tokenizer": spec.tokenizer} if is_whisper_cpp_file(spec.source) else {})}
    return TorchTranscriber(bundle, options, origin)


def load_torch_bundle(spec: ModelSpec) -> tuple[tuple, str]:
    """(model, processor, generation_config) of any source the torch backend takes, and how it was loaded: a
    lattice checkpoint (s * q exactly), a whisper.cpp file (dequantized by gguf-py) or a float model."""
    _quiet_transformers()
    source = spec.source
    try:
        if is_lattice_checkpoint(source):
            from ..models.from_checkpoint import load_dequantized_whisper

            return load_dequantized_whisper(source), "lattice checkpoint, dequantized (s * q)"
        if is_whisper_cpp_file(source):
            return load_whisper_cpp_in_torch(source, spec.tokenizer), "whisper.cpp file, dequantized"
        from ..models.loader import load_whisper

        return load_whisper(source), "float model"
    except (ValueError, OSError) as error:
        raise UserError(f"model {spec.label!r} ({source}): cannot load it for the torch backend: {error}") from None


def load_whisper_cpp_in_torch(path: str, companion: str | None):
    """A transformers Whisper whose every tensor is the whisper.cpp file's value (dequantized by gguf-py);
    config, generation config and tokenizer come from ``companion`` (any source load_whisper takes, or a lattice
    checkpoint), which must have the file's dimensions and vocabulary size."""
    import torch

    from tarq_deploy.formats.ggml_file import read_whisper_cpp, tensor_slots

    if companion is None:
        raise UserError(f"{path}: the torch backend needs a tokenizer and config for a whisper.cpp file; give "
                        f"--tokenizer SOURCE (e.g. packaged:tiny.en)")
    model, processor, generation_config = _load_companion(companion)
    ggml = read_whisper_cpp(path)
    expected = _hparams_of(model.config, ggml.hparams.weight_type)
    if not ggml.hparams.same_model(expected):
        raise UserError(f"{path}: its dimensions {ggml.hparams.ints()[:-1]} differ from --tokenizer {companion}'s "
                        f"{expected.ints()[:-1]}")
    state = {}
    for slot in tensor_slots(ggml.hparams):
        values = torch.from_numpy(ggml.dequantize(slot.name).copy())
        state[slot.hf_name] = values.reshape(model.state_dict()[slot.hf_name].shape)
    state["proj_out.weight"] = state["model.decoder.embed_tokens.weight"]  # tied, as whisper.cpp computes logits
    missing, unexpected = model.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise UserError(f"{path}: tensors do not fit the Whisper model (missing {missing[:3]}, unexpected "
                        f"{unexpected[:3]})")
    return model.float().eval(), processor, generation_config


def _load_companion(source: str):
    if is_lattice_checkpoint(source):
        from ..models.from_checkpoint import load_dequantized_whisper

        return load_dequantized_whisper(source)
    from ..models.loader import load_whisper

    return load_whisper(source)


def _hparams_of(config, weight_type: int):
    from tarq_deploy.formats.ggml_file import WhisperHParams

    return WhisperHParams.from_config(config.to_dict(), weight_type)


register_backend(Backend("torch", "transformers Whisper (float model, lattice checkpoint or whisper.cpp file "
                                  "dequantized)", lambda source: True, open_torch))


# ------------------------------------------------------------------------------------------- worker subprocesses
@dataclass
class WorkerTranscriber:
    """A runtime in a worker subprocess that loads one model and answers one JSON line per utterance (see
    :func:`serve_worker`), so a crash or a hang is reported with the model file and the utterance instead of killing
    the evaluation. ``command`` runs the worker; ``runtime`` names it in messages."""

    model_file: Path
    options: DecodeOptions
    runtime: str
    command: list[str]
    process: subprocess.Popen | None = None
    replies: "queue.Queue[str | None]" = field(default_factory=queue.Queue)
    stderr_path: Path | None = None

    def start(self) -> "WorkerTranscriber":
        slug = "".join(c if c.isalnum() else "-" for c in self.runtime.lower())
        log = tempfile.NamedTemporaryFile(prefix=f"{slug}-worker-", suffix=".log", delete=False)
        self.stderr_path = Path(log.name)
        env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE", "PYTHONPATH": _package_root_path()}
        self.process = subprocess.Popen([sys.executable, *self.command], stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, stderr=log, text=True, env=env)
        log.close()
        threading.Thread(target=self._read_replies, daemon=True).start()
        self._expect("ready", "loading the model")
        return self

    def _read_replies(self) -> None:
        assert self.process is not None and self.process.stdout is not None
        for line in self.process.stdout:
            self.replies.put(line)
        self.replies.put(None)  # end of output: the worker exited

    def _expect(self, key: str, doing: str) -> dict:
        deadline = time.monotonic() + self.options.timeout_s
        while True:
            try:
                line = self.replies.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                self.close()
                raise BackendError(f"{self.model_file}: {self.runtime} gave no answer within "
                                   f"{self.options.timeout_s:.0f} s while {doing}") from None
            if line is None:
                raise BackendError(f"{self.model_file}: the {self.runtime} worker died while {doing} (exit status "
                                   f"{self._exit_status()}); its log ends with:\n{self._log_tail()}")
            if not line.startswith("{"):  # a library printing to stdout
                continue
            reply = json.loads(line)
            if key not in reply:
                raise BackendError(f"{self.model_file}: unexpected reply from the {self.runtime} worker while "
                                   f"{doing}: {line}")
            return reply

    def transcribe(self, audio: np.ndarray, utterance_id: str) -> str:
        assert self.process is not None and self.process.stdin is not None
        samples = base64.b64encode(np.ascontiguousarray(audio, dtype="<f4").tobytes()).decode("ascii")
        try:
            self.process.stdin.write(json.dumps({"id": utterance_id, "samples": samples}) + "\n")
            self.process.stdin.flush()
        except BrokenPipeError:
            pass  # the reply reader reports the dead worker with its log
        return self._expect("text", f"transcribing utterance {utterance_id!r}")["text"]

    def close(self) -> None:
        if self.process is not None and self.process.poll() is None:
            try:
                self.process.stdin.close()  # type: ignore[union-attr]
                self.process.wait(timeout=30)
            except (OSError, subprocess.TimeoutExpired):
                self.process.kill()
                self.process.wait()
        if self.stderr_path is not None and self.stderr_path.exists():
            self.stderr_path.unlink()

    def _exit_status(self) -> int | None:
        assert self.process is not None
        try:
            return self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            return None

    def _log_tail(self, chars: int = 2000) -> str:
        if self.stderr_path is None or not self.stderr_path.exists():
            return "(no log)"
        return self.stderr_path.read_text(errors="replace")[-chars:]


def serve_worker(transcribe: Callable[[np.ndarray], str]) -> int:
    """The worker side of :class:`WorkerTranscriber`, run once the model is loaded: say ready, then per stdin line
    {id, samples (base64 little-endian float32)} answer one stdout line {id, text, seconds}."""
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        audio = np.frombuffer(base64.b64decode(request["samples"]), dtype="<f4").astype(np.float32)
        started = time.perf_counter()
        text = transcribe(audio)
        print(json.dumps({"id": request["id"], "text": text, "seconds": time.perf_counter() - started}), flush=True)
    return 0


def _package_root_path() -> str:
    """PYTHONPATH for the worker: this very tarq_deploy first, whatever is installed."""
    root = str(Path(__file__).resolve().parents[2])
    existing = os.environ.get("PYTHONPATH")
    return root + (os.pathsep + existing if existing else "")


# ---------------------------------------------------------------------------------------------- whisper.cpp backend
class WhisperCppTranscriber(WorkerTranscriber):
    """A pywhispercpp worker process holding one model; utterances go in as raw samples, text comes back."""

    def __init__(self, model_file: Path, options: DecodeOptions) -> None:
        super().__init__(model_file, options, "whisper.cpp",
                         ["-m", "tarq_deploy.evaluate.backends", WORKER_FLAG, str(model_file), str(options.threads)])

    def describe(self) -> dict:
        import importlib.metadata

        return {"loaded_as": "whisper.cpp model file", "runtime": "pywhispercpp "
                + importlib.metadata.version("pywhispercpp"), "threads": self.options.threads, **WHISPER_CPP_PARAMS}


def open_whisper_cpp(spec: ModelSpec, options: DecodeOptions) -> WhisperCppTranscriber:
    from tarq_deploy.formats.ggml_file import GGMLFileError, read_whisper_cpp

    path = Path(spec.source).expanduser()
    try:
        read_whisper_cpp(path)  # whisper.cpp must never see a file our parser rejects
    except GGMLFileError as error:
        raise UserError(f"model {spec.label!r}: {error}") from None
    return WhisperCppTranscriber(path.resolve(), options).start()


register_backend(Backend("whisper.cpp", "whisper.cpp model file through pywhispercpp (worker subprocess)",
                         is_whisper_cpp_file, open_whisper_cpp))


# -------------------------------------------------------------------------------------------------- worker process
def _worker_main(model_file: str, threads: int) -> int:
    """Runs in the subprocess: load once, then serve utterances (:func:`serve_worker`)."""
    from pywhispercpp.model import Model

    model = Model(model_file, redirect_whispercpp_logs_to=None, n_threads=threads, print_progress=False,
                  print_realtime=False, print_timestamps=False, **WHISPER_CPP_PARAMS)
    return serve_worker(lambda audio: " ".join(s.text.strip() for s in model.transcribe(audio)).strip())


def transcribe_all(transcriber: Transcriber,
                   items: Sequence[tuple[str, np.ndarray]]) -> Iterator[tuple[str, str, float]]:
    """(utterance id, text, seconds) for each (id, audio), in order."""
    for utterance_id, audio in items:
        started = time.perf_counter()
        text = transcriber.transcribe(audio, utterance_id)
        yield utterance_id, text, time.perf_counter() - started


# The Qwen3-ASR runtimes register themselves; imported last because they build on the definitions above.
from . import crispasr_backend, qwen3_asr_backend  # noqa: E402,F401

if __name__ == "__main__" and len(sys.argv) == 4 and sys.argv[1] == WORKER_FLAG:
    sys.exit(_worker_main(sys.argv[2], int(sys.argv[3])))
