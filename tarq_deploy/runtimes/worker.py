"""A runtime in a worker subprocess that loads one model and answers one JSON line per utterance, so a crash or a hang
is reported with the model file and the utterance instead of killing the evaluation.

Parent side: :class:`WorkerTranscriber`. Worker side: :func:`serve_worker`, called by the runtime's module once its
model is loaded (``python -m tarq_deploy.runtimes.<runtime> --<runtime>-worker ...``). Children find this very
tarq_deploy first on their path (:func:`with_package_on_path`), whatever is installed.
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
from typing import TYPE_CHECKING, Callable

from .base import BackendError, DecodeOptions

if TYPE_CHECKING:
    import numpy as np

__all__ = ["WorkerTranscriber", "serve_worker", "with_package_on_path"]

PACKAGE_PARENT = Path(__file__).resolve().parents[2]  # the directory that holds tarq_deploy/


def with_package_on_path(pythonpath: str | None) -> str:
    """PYTHONPATH for a child process: the directory holding this tarq_deploy first, then ``pythonpath``."""
    return os.pathsep.join([str(PACKAGE_PARENT), *filter(None, [pythonpath])])


@dataclass
class WorkerTranscriber:
    """The parent side of a worker subprocess (see :func:`serve_worker`). ``command`` runs the worker (arguments of
    the Python interpreter); ``runtime`` names it in messages."""

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
        env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE",
               "PYTHONPATH": with_package_on_path(os.environ.get("PYTHONPATH"))}
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

    def transcribe(self, audio: "np.ndarray", utterance_id: str) -> str:
        import numpy as np

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


def serve_worker(transcribe: Callable[["np.ndarray"], str], after_each: Callable[[], None] | None = None) -> int:
    """The worker side of :class:`WorkerTranscriber`, run once the model is loaded: say ready, then per stdin line
    {id, samples (base64 little-endian float32)} answer one stdout line {id, text, seconds}; ``after_each`` runs
    once an answer is out (outside its time), before the next line is read."""
    import numpy as np

    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        audio = np.frombuffer(base64.b64decode(request["samples"]), dtype="<f4").astype(np.float32)
        started = time.perf_counter()
        text = transcribe(audio)
        print(json.dumps({"id": request["id"], "text": text, "seconds": time.perf_counter() - started}), flush=True)
        if after_each is not None:
            after_each()
    return 0
