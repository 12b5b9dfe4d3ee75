"""CrispASR (PyPI ``crispasr``, a ggml runtime) as an evaluation backend for Qwen3-ASR GGUF files (arch "qwen3asr",
written by converters/crispasr.py).

Decoding: language "en" (CrispASR prefills the assistant turn with "language English<asr_text>", as Qwen3-ASR's own
inference code does), greedy (temperature 0, no frequency penalty, one beam), at most ``max_new_tokens`` tokens,
fixed threads. CrispASR post-processes the text (special tokens and tags dropped, long runs of one token shortened).
The model runs in a worker subprocess that loads it once and answers one JSON line per utterance, so a runtime crash
is reported with the model file and the utterance instead of killing the evaluation. The file is parsed by our strict
GGUF reader first.

Registered on import (``register_backend``); ``claims`` is true for a GGUF whose architecture is "qwen3asr".
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

import numpy as np

from ..errors import UserError
from .backends import Backend, BackendError, DecodeOptions, ModelSpec, is_gguf_file, register_backend

NAME = "crispasr"
ARCH = "qwen3asr"
LANGUAGE = "en"
WORKER_FLAG = "--crispasr-worker"


def is_crispasr_file(source: str) -> bool:
    """A Qwen3-ASR GGUF in CrispASR's flavour (the architecture key decides; a broken file is not claimed)."""
    if not is_gguf_file(source):
        return False
    from converters.gguf_common import GGUFFileError, read_gguf

    try:
        return read_gguf(Path(source).expanduser()).arch == ARCH
    except GGUFFileError:
        return False


@dataclass
class CrispASRTranscriber:
    """A worker process holding one CrispASR session; utterances go in as raw samples, text comes back."""

    model_file: Path
    options: DecodeOptions
    process: subprocess.Popen | None = None
    replies: "queue.Queue[str | None]" = field(default_factory=queue.Queue)
    stderr_path: Path | None = None

    def start(self) -> "CrispASRTranscriber":
        log = tempfile.NamedTemporaryFile(prefix="crispasr-worker-", suffix=".log", delete=False)
        self.stderr_path = Path(log.name)
        env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE", "PYTHONPATH": _package_root_path()}
        command = [sys.executable, "-m", "tarq_deploy.evaluate.crispasr_backend", WORKER_FLAG, str(self.model_file),
                   str(self.options.threads), str(self.options.max_new_tokens)]
        self.process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True,
                                        env=env)
        log.close()
        threading.Thread(target=self._read_replies, daemon=True).start()
        self._expect("ready", "loading the model")
        return self

    def _read_replies(self) -> None:
        assert self.process is not None and self.process.stdout is not None
        for line in self.process.stdout:
            self.replies.put(line)
        self.replies.put(None)  # the worker exited

    def _expect(self, key: str, doing: str) -> dict:
        try:
            line = self.replies.get(timeout=self.options.timeout_s)
        except queue.Empty:
            self.close()
            raise BackendError(f"{self.model_file}: CrispASR gave no answer within {self.options.timeout_s:.0f} s "
                               f"while {doing}") from None
        if line is None:
            raise BackendError(f"{self.model_file}: the CrispASR worker died while {doing}; its log ends with:\n"
                               f"{self._log_tail()}")
        reply = json.loads(line)
        if key not in reply:
            raise BackendError(f"{self.model_file}: unexpected reply from the CrispASR worker while {doing}: {line}")
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

    def describe(self) -> dict:
        import importlib.metadata

        return {"loaded_as": "CrispASR Qwen3-ASR GGUF", "runtime": "crispasr " + importlib.metadata.version("crispasr"),
                "threads": self.options.threads, "language": LANGUAGE, "temperature": 0.0,
                "max_new_tokens": self.options.max_new_tokens}

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

    def _log_tail(self, chars: int = 2000) -> str:
        if self.stderr_path is None or not self.stderr_path.exists():
            return "(no log)"
        return self.stderr_path.read_text(errors="replace")[-chars:]


def _package_root_path() -> str:
    """PYTHONPATH for the worker: this very tarq_deploy (and converters) first, whatever is installed."""
    root = str(Path(__file__).resolve().parents[2])
    existing = os.environ.get("PYTHONPATH")
    return root + (os.pathsep + existing if existing else "")


def open_crispasr(spec: ModelSpec, options: DecodeOptions) -> CrispASRTranscriber:
    from converters.gguf_common import GGUFFileError, read_gguf

    path = Path(spec.source).expanduser()
    try:
        arch = read_gguf(path).arch
    except GGUFFileError as error:
        raise UserError(f"model {spec.label!r}: {error}") from None
    if arch != ARCH:
        raise UserError(f"model {spec.label!r}: {path} is a {arch!r} GGUF; CrispASR runs Qwen3-ASR files of "
                        f"architecture {ARCH!r} (tarq-deploy export --target crispasr)")
    return CrispASRTranscriber(path.resolve(), options).start()


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
    """Runs in the subprocess: load once, then one JSON line in (samples), one JSON line out (text) per utterance."""
    session = open_session(model_file, threads, max_new_tokens)
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        audio = np.frombuffer(base64.b64decode(request["samples"]), dtype="<f4").astype(np.float32)
        started = time.perf_counter()
        text, _ = session_text(session, audio)
        print(json.dumps({"id": request["id"], "text": text, "seconds": time.perf_counter() - started}), flush=True)
    return 0


register_backend(Backend(NAME, "Qwen3-ASR GGUF (arch qwen3asr) through the crispasr wheel (worker subprocess)",
                         is_crispasr_file, open_crispasr))


if __name__ == "__main__" and len(sys.argv) == 5 and sys.argv[1] == WORKER_FLAG:
    sys.exit(_worker_main(sys.argv[2], int(sys.argv[3]), int(sys.argv[4])))
