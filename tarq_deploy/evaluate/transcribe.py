"""Every model's hypotheses on every dataset, through the hypothesis cache: a model is loaded only when some
utterance of it is missing, and each new hypothesis is cached at once, so an interrupted run resumes where it
stopped."""
from __future__ import annotations

import time
from pathlib import Path

import numpy as np

from ..data.corpus import Utterance
from ..errors import UserError
from ..runtimes.base import DecodeOptions, ModelSpec
from ..runtimes.registry import open_transcriber
from .cache import HypothesisCache, audio_digest
from .dataset import Dataset

__all__ = ["transcribe_models"]


def transcribe_model(spec: ModelSpec, datasets: list[Dataset], options: DecodeOptions, cache_dir: Path,
                     progress: bool) -> dict[str, list[dict]]:
    """{dataset name: [{id, text, seconds}]} for one model; the model is loaded only if something is missing."""
    from tqdm.auto import tqdm

    caches = {d.name: HypothesisCache(cache_dir, spec, d, options) for d in datasets}
    digests = {d.name: [audio_digest(a) for a in d.audio] for d in datasets}
    missing = sum(caches[d.name].get(u.id, h) is None for d in datasets for u, h in zip(d.utterances, digests[d.name]))
    transcriber = open_transcriber(spec, options) if missing else None
    info = transcriber.describe() if transcriber else {}
    results: dict[str, list[dict]] = {}
    try:
        with tqdm(total=missing, desc=spec.key, unit="utt", disable=not progress or not missing) as bar:
            for d in datasets:
                rows = []
                for u, audio, digest in zip(d.utterances, d.audio, digests[d.name]):
                    record = caches[d.name].get(u.id, digest)
                    if record is None:
                        record = {**_transcribe_one(transcriber, u, audio, digest), "info": info}
                        caches[d.name].add(record)
                        bar.update()
                    rows.append(record)
                results[d.name] = rows
    finally:
        if transcriber is not None:
            transcriber.close()
    return results


def transcribe_models(specs: list[ModelSpec], datasets: list[Dataset], options: DecodeOptions, cache_dir: Path,
                      jobs: int, progress: bool) -> dict[str, dict[str, list[dict]]]:
    """Every model's hypotheses, ``jobs`` models at a time (each model's decoding is independent of the others)."""
    if jobs < 1:
        raise UserError(f"--jobs must be at least 1 (got {jobs})")
    if jobs == 1:
        return {spec.key: transcribe_model(spec, datasets, options, cache_dir, progress) for spec in specs}
    from concurrent.futures import ThreadPoolExecutor

    pool = ThreadPoolExecutor(max_workers=jobs)
    try:
        futures = {spec.key: pool.submit(transcribe_model, spec, datasets, options, cache_dir, progress)
                   for spec in specs}
        return {key: future.result() for key, future in futures.items()}
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def _transcribe_one(transcriber, utterance: Utterance, audio: np.ndarray, digest: str) -> dict:
    started = time.perf_counter()
    text = transcriber.transcribe(audio, utterance.id)
    return {"id": utterance.id, "audio": digest, "text": text, "seconds": round(time.perf_counter() - started, 4)}
