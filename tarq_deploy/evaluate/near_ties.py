"""Near-ties between backends: when a runtime's text differs from the PyTorch run of the same label, how close the
PyTorch model itself finds the two continuations (its ``continuation_margin`` of the other run's text at the first
differing token, in nats). The report counts a disagreement within ``--near-tie-margin`` as a near-tie. A margin is a
greedy decoder's notion (one token chosen at a time, from one 30 s window): under another decode profile, or for a
longer recording, there are none."""
from __future__ import annotations

from pathlib import Path

from ..runtimes.base import SAMPLE_RATE, DecodeOptions, ModelSpec
from ..runtimes.decoding import GREEDY
from ..runtimes.registry import open_transcriber
from .cache import MarginCache
from .dataset import Dataset
from .wer import normalized_words

__all__ = ["near_tie_margins"]

WINDOW_SECONDS = 30


def near_tie_margins(specs: list[ModelSpec], datasets: list[Dataset], hypotheses: dict, options: DecodeOptions,
                     cache_dir: Path) -> dict[str, dict[str, dict[str, float | None]]]:
    """{run key: {dataset: {utterance id: margin}}} for every non-PyTorch run of a label that also has a PyTorch run,
    over the utterances whose normalised texts differ; the PyTorch model is loaded only when a margin is missing
    from the cache (keyed by the PyTorch model, the audio and the other run's text)."""
    if options.profile != GREEDY:
        return {}
    torch_runs = {s.label: s for s in specs if s.backend == "torch"}
    margins: dict[str, dict[str, dict[str, float | None]]] = {}
    for spec in specs:
        reference = torch_runs.get(spec.label)
        if spec.backend == "torch" or reference is None:
            continue
        cache = MarginCache(cache_dir, reference, spec)
        todo = []
        margins[spec.key] = {d.name: {} for d in datasets}
        for d in datasets:
            for i, u in enumerate(d.utterances):
                if len(d.audio[i]) > WINDOW_SECONDS * SAMPLE_RATE:
                    continue
                other = hypotheses[spec.key][d.name][i]
                if normalized_words(hypotheses[reference.key][d.name][i]["text"]) == normalized_words(other["text"]):
                    continue
                key = cache.key(d.name, u.id, other["audio"], other["text"])
                if key in cache.entries:
                    margins[spec.key][d.name][u.id] = cache.entries[key]
                else:
                    todo.append((d, i, key))
        if todo and not _score_margins(reference, options, todo, hypotheses[spec.key], margins[spec.key], cache):
            del margins[spec.key]
    return margins


def _score_margins(reference: ModelSpec, options: DecodeOptions, todo: list, other_rows: dict, into: dict,
                   cache: MarginCache) -> bool:
    """Score the missing margins with the PyTorch model into ``into`` and the cache; False when its runtime cannot
    score a given continuation (then the run has no margins at all)."""
    transcriber = open_transcriber(reference, options)
    try:
        if not hasattr(transcriber, "continuation_margin"):  # a runtime that cannot score a given continuation
            return False
        for d, i, key in todo:
            margin = transcriber.continuation_margin(d.audio[i], other_rows[d.name][i]["text"])
            into[d.name][d.utterances[i].id] = cache.entries[key] = margin
        cache.save()
        return True
    finally:
        transcriber.close()
