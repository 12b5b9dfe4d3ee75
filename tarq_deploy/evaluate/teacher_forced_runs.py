"""Teacher-forced figures (:mod:`.teacher_forced`) of every label against the reference label, through the figure
cache: the models are loaded in PyTorch only when some dataset has a figure missing."""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import UserError
from ..hashing import json_fingerprint, sha256_hex
from ..runtimes.base import ModelSpec
from ..runtimes.torch_whisper import load_torch_bundle
from .cache import FigureCache, audio_digest, source_fingerprint
from .dataset import Dataset

if TYPE_CHECKING:
    from ..data.rarity import TailRule

__all__ = ["teacher_forced_figures"]


def teacher_forced_specs(specs: list[ModelSpec], reference: str) -> tuple[ModelSpec, list[ModelSpec]]:
    """One spec per label, loaded in PyTorch (a label's backends share its weights): the reference and the rest."""
    by_label: dict[str, ModelSpec] = {}
    for spec in specs:
        if spec.label not in by_label or spec.backend == "torch":
            by_label[spec.label] = spec
    if reference not in by_label:
        raise UserError(f"--reference {reference}: no model has that label ({', '.join(by_label)})")
    torch_specs = {label: ModelSpec(s.label, s.source, "torch", s.tokenizer) for label, s in by_label.items()}
    return torch_specs.pop(reference), list(torch_specs.values())


def teacher_forced_figures(specs: list[ModelSpec], datasets: list[Dataset], reference_label: str, k: float,
                           device: str, cache_dir: Path, progress: bool,
                           tail: "TailRule | None" = None) -> dict[str, dict[str, list]]:
    """{dataset: {label: [UtteranceFigures]}}; cached per (reference, model, utterance), models loaded only when
    something is missing. The tagged ("rare") positions are Zipf-rare words' (below ``k``), or ``tail``'s: a term
    list's (eval --terms: KLD at term positions)."""
    from tqdm.auto import tqdm

    from .teacher_forced import TeacherForcedScorer, UtteranceFigures, score_utterances

    reference, models = teacher_forced_specs(specs, reference_label)
    # a Zipf tail keeps the keys of every earlier cache; a term tail adds the list's digest
    tagged = {} if tail is None or tail.mode == "zipf" else \
        {"tail": tail.mode, "terms": tail.terms.sha256 if tail.terms else None, "language": tail.language}
    identity = {spec.label: {"reference": source_fingerprint(reference.source), "model": source_fingerprint(spec.source),
                             "tokenizer": spec.tokenizer, "zipf_threshold": k, "windows": "packed 30 s", **tagged}
                for spec in models}
    caches = {spec.label: FigureCache(cache_dir, spec.label, identity[spec.label]) for spec in models}
    # Utterances are scored in packed windows, so a figure depends on the whole dataset's composition: the cache
    # key includes it, and a dataset with anything missing is scored again whole (the same windows every time).
    keys = {d.name: dataset_keys(d) for d in datasets}
    missing = [d for d in datasets if any(c.get(k) is None for c in caches.values() for k in keys[d.name])]
    if missing:
        rule = tail if tagged else k
        scorers = {spec.label: TeacherForcedScorer(load_torch_bundle(spec)[0], device, rule) for spec in models}
        ref_scorer = TeacherForcedScorer(load_torch_bundle(reference)[0], device, rule)
        bar = tqdm(total=sum(len(d.utterances) for d in missing), desc="teacher-forced", unit="utt",
                   disable=not progress)
        for d in missing:
            scored = score_utterances(ref_scorer, scorers, [(u.id, a, u.text) for u, a in zip(d.utterances, d.audio)],
                                      bar.update)
            for label, rows in scored.items():
                caches[label].add_all([(key, row.record()) for key, row in zip(keys[d.name], rows)])
        bar.close()
    return {d.name: {label: [UtteranceFigures.from_record(cache.get(key)) for key in keys[d.name]]
                     for label, cache in caches.items()} for d in datasets}


def dataset_keys(d: Dataset) -> list[str]:
    """One key per utterance: the dataset's name and every utterance's (id, audio, text), then the utterance's id."""
    items = [(u.id, audio_digest(a), u.text) for u, a in zip(d.utterances, d.audio)]
    whole = json_fingerprint([d.name, items], ensure_ascii=True)  # lists only: sorting keys changes nothing
    return [sha256_hex(f"{whole}:{u_id}".encode()) for u_id, _, _ in items]
