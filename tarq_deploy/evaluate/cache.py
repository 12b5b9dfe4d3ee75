"""The evaluation's caches on disk, so an interrupted or repeated ``tarq-deploy eval`` redoes only what is missing:
decoded hypotheses, teacher-forced figures and near-tie margins. Each cache is valid only for the model bytes and
settings that made it (its identity); anything else is started over."""
from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np

from ..fileio import write_text_atomic
from ..hashing import file_sha256, sha1_hex
from ..model_source import CHECKPOINT_MANIFEST, SourceKind, resolve_source
from ..runtimes.base import DecodeOptions, ModelSpec
from ..runtimes.decoding import fresh_state_per_item, profile_named
from ..runtimes.sources import is_whisper_cpp_file
from .dataset import Dataset

__all__ = ["FigureCache", "HypothesisCache", "MarginCache", "audio_digest", "decode_identity", "source_fingerprint"]


def source_fingerprint(source: str) -> str:
    """Identifies a model's bytes: a file's sha256 (so re-exporting identical bytes keeps the cache, and changed bytes
    never reuse it), a checkpoint's manifest (it holds the sha256 of every file), or the name itself."""
    found = resolve_source(source)
    if found.on_disk and found.path.is_file():
        return f"sha256:{file_sha256(found.path)}"
    if found.kind is SourceKind.CHECKPOINT:
        return f"{found.path.resolve()}:{file_sha256(found.path / CHECKPOINT_MANIFEST)}"
    return source


def audio_digest(audio: np.ndarray) -> str:
    return sha1_hex(np.ascontiguousarray(audio, dtype="<f4").tobytes())


def file_stem(text: str) -> str:
    """A cache file name made of ``text``: every run of characters unsafe in a file name becomes one underscore."""
    return re.sub(r"[^A-Za-z0-9._-]+", "_", text)


class IdentityJsonl:
    """A JSONL cache whose first line is the identity of what made its records (model, settings); the records count
    only while that identity matches, and an unreadable file (a torn last line) is started over."""

    def __init__(self, path: Path, identity: dict) -> None:
        self.path = path
        self.identity = identity
        self.valid = False  # the file exists and holds this identity

    def read(self) -> list[dict]:
        if not self.path.is_file():
            return []
        lines = self.path.read_text(encoding="utf-8").splitlines()
        try:
            header = json.loads(lines[0]) if lines else {}
            records = [json.loads(line) for line in lines[1:] if line.strip()]
        except json.JSONDecodeError:
            return []
        self.valid = header == self.identity and bool(records)
        return records if self.valid else []

    def append(self, records: list[dict]) -> None:
        """Append records, starting the file (identity line first) when it holds nothing valid."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "a" if self.valid else "w", encoding="utf-8") as f:
            if not self.valid:
                f.write(json.dumps(self.identity) + "\n")
            f.writelines(json.dumps(record, ensure_ascii=False) + "\n" for record in records)
        self.valid = True


def decode_identity(profile_name: str) -> dict:
    """The decode profile as a cache key holds it: its name and every backend's settings, so a change of any
    setting starts the hypotheses over."""
    profile = profile_named(profile_name)
    # a whisper.cpp context made afresh per utterance (runtimes/whisper_cpp.py) writes other texts than one
    # long-lived context did: the caches of those runs start over
    fresh = {"whisper_cpp_state": "fresh per item"} if fresh_state_per_item(profile.name) else {}
    return {"profile": profile.name, "whisper_cpp": profile.whisper_cpp, "beam_search": profile.beam_search,
            "torch": {k: list(v) if isinstance(v, tuple) else v for k, v in profile.torch.items()},
            "crispasr_whisper": profile.crispasr_whisper, "transcribe_cpp": profile.transcribe_cpp, **fresh}


def crispasr_state(spec: ModelSpec, profile_name: str) -> dict:
    """CrispASR's whisper backend got its own state per utterance after whisper.cpp's (same RNG, found later): its
    sampled caches from before start over, every other cache keeps its key."""
    if spec.backend == "crispasr" and is_whisper_cpp_file(spec.source) and fresh_state_per_item(profile_name):
        return {"crispasr_state": "fresh per item"}
    return {}


class HypothesisCache(IdentityJsonl):
    """JSONL of {id, audio, text, seconds} per (model, dataset, decode profile), valid while the model and decode
    settings match."""

    def __init__(self, directory: Path, spec: ModelSpec, dataset: Dataset, options: DecodeOptions) -> None:
        stem = file_stem(f"{spec.label}__{spec.backend}__{dataset.name}__{options.profile}")
        super().__init__(directory / f"{stem}.jsonl",
                         {"model": source_fingerprint(spec.source), "backend": spec.backend,
                          "tokenizer": spec.tokenizer if spec.backend == "torch" else None,
                          "threads": options.threads, "max_new_tokens": options.max_new_tokens,
                          "decode": decode_identity(options.profile),
                          **crispasr_state(spec, options.profile),
                          # English, as every earlier cache decoded, keeps their keys
                          **({"language": options.language} if options.language != "en" else {})})
        self.entries = {(r["id"], r["audio"]): r for r in self.read()}

    def get(self, utterance_id: str, digest: str) -> dict | None:
        return self.entries.get((utterance_id, digest))

    def add(self, record: dict) -> None:
        self.entries[(record["id"], record["audio"])] = record
        self.append([record])


class FigureCache(IdentityJsonl):
    """JSONL of teacher-forced figures per (reference, model), keyed by utterance within its whole dataset."""

    def __init__(self, directory: Path, label: str, identity: dict) -> None:
        super().__init__(directory / f"{file_stem(label)}.jsonl", identity)
        self.entries: dict[str, dict] = {r["key"]: r["figures"] for r in self.read()}

    def get(self, key: str) -> dict | None:
        return self.entries.get(key)

    def add_all(self, rows: list[tuple[str, dict]]) -> None:
        self.entries.update(rows)
        self.append([{"key": key, "figures": figures} for key, figures in rows])


class MarginCache:
    """{dataset/id/audio digest/text hash: margin} of one (PyTorch model, other run) pair, as one JSON file."""

    def __init__(self, directory: Path, reference: ModelSpec, other: ModelSpec) -> None:
        stem = file_stem(f"margins__{other.label}__{other.backend}")
        self.path = directory / f"{stem}.json"
        self.identity = source_fingerprint(reference.source)
        stored = json.loads(self.path.read_text()) if self.path.is_file() else {}
        self.entries: dict[str, float | None] = stored.get("entries", {}) if stored.get("model") == self.identity \
            else {}

    @staticmethod
    def key(dataset: str, utterance_id: str, audio: str, text: str) -> str:
        return f"{dataset}/{utterance_id}/{audio}/{sha1_hex(text.encode())}"

    def save(self) -> None:
        write_text_atomic(self.path, json.dumps({"model": self.identity, "entries": self.entries}) + "\n")
