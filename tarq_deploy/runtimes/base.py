"""What every runtime adapter speaks: decoding options, a model to open, what a transcriber does, what the CPU bench
needs of a runtime, and the adapter record the registry (``runtimes.registry``) lists.

Stdlib only at module level: the CPU bench's child processes import the adapters' modules, and what they import is
part of what the bench measures.
"""
from __future__ import annotations

import importlib.metadata
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Protocol

if TYPE_CHECKING:
    import numpy as np

    from ..model_source import ModelSource

__all__ = ["BackendError", "BenchRuntime", "DecodeOptions", "ModelInfo", "ModelSpec", "RuntimeAdapter", "SAMPLE_RATE",
           "Transcriber", "dist_version", "torch_stack_info"]

SAMPLE_RATE = 16_000  # every runtime here takes 16 kHz mono float32


class BackendError(RuntimeError):
    """A recogniser failed on real input (crash, timeout); the message names the model file and the utterance."""


@dataclass(frozen=True)
class DecodeOptions:
    """What every runtime must honour so runs are comparable."""

    threads: int = 1
    max_new_tokens: int = 224  # whisper.cpp stops a segment at n_text_ctx / 2 = 224 tokens as well
    device: str = "cpu"
    timeout_s: float = 600.0  # per utterance: a looping 4-bit model on a busy machine is slow, never this slow
    # runtimes/decoding.py's profile name. "greedy" here, so library callers keep the research protocol they were
    # written against; the commands' --decode defaults to what users run ("cli").
    profile: str = "greedy"
    # The language decoded (whisper.cpp and PyTorch Whisper; the eval's --language): English unless told.
    language: str = "en"


@dataclass(frozen=True)
class ModelSpec:
    """One column of the evaluation: a display label, where the model is, and which runtime runs it."""

    label: str
    source: str
    backend: str
    tokenizer: str | None = None  # PyTorch Whisper on a whisper.cpp file: where config and tokenizer come from

    @property
    def key(self) -> str:
        return f"{self.label} [{self.backend}]"


@dataclass(frozen=True)
class ModelInfo:
    """What validating a model file tells: which model it is and at what precision."""

    backbone: str  # e.g. "tiny.en"; files of one backbone are compared side by side
    precision: str  # e.g. "F16", "Q4_0"
    details: dict = field(default_factory=dict)


class Transcriber(Protocol):
    def transcribe(self, audio: "np.ndarray", utterance_id: str) -> str: ...

    def describe(self) -> dict: ...

    def close(self) -> None: ...


@dataclass(frozen=True)
class BenchRuntime:
    """What the CPU bench needs of a runtime: validate + describe a model file (in the harness), measure one run (in
    a fresh child process)."""

    name: str
    describe_model: Callable[[Path], ModelInfo]  # raises ValueError naming the problem
    worker: str  # "module:function", called in the child with the run spec (dict); returns measurements (dict)
    settings: dict  # decode settings passed to the runtime, recorded in the output
    description: str = ""
    # the settings of a decode profile (runtimes/decoding.py) for this runtime; None: it has one decoding only
    profile_settings: Callable[[str], dict] | None = None


@dataclass(frozen=True)
class RuntimeAdapter:
    """One runtime: ``claims(source)`` says whether it is the natural runtime for a model source, ``open(spec,
    options)`` loads the model into a transcriber, ``info()`` names the packages or binary it runs on, and ``bench``
    is how the CPU bench drives it (None where the bench does not)."""

    name: str
    description: str
    claims: Callable[[str | ModelSource], bool]  # given a resolved source (tarq_deploy.model_source), or its text
    open: Callable[[ModelSpec, DecodeOptions], Transcriber]
    info: Callable[[], dict]
    bench: BenchRuntime | None = None


def dist_version(name: str) -> str | None:
    """An installed distribution's version from its metadata (without importing it), None when not installed."""
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def torch_stack_info() -> dict:
    """The PyTorch stack's versions, from package metadata (importing torch only to ask would cost seconds)."""
    return {name: dist_version(name) for name in ("torch", "transformers")}
