"""The failure figures of an evaluation, beside its WER: per dataset and model, the empty-output, loop and dropped-span
rates and the words invented in a long recording's silent and noisy stretches (evaluate/failures.py), and per model
the words it writes into non-speech clips, against the reference model's. Each rate comes with a paired bootstrap
interval of its difference from the dataset's reference (``--reference``, else the first model of the backend), over
the same utterances or recordings, as the WER differences are."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

import numpy as np

from ..data.long_form import Span
from .failures import FailureInput, failure_figures
from .wer import bootstrap_indices, paired_difference

__all__ = ["FAILURE_RATES", "NonspeechSet", "failure_section", "nonspeech_section", "rate_difference",
           "render_failures", "render_nonspeech"]

# rate name -> (per-item indicator from ItemFailures' dict, display name)
FAILURE_RATES = {"empty_output_rate": "empty", "loop_rate": "loops", "dropped_rate": "dropped spans"}


@dataclass(frozen=True)
class NonspeechSet:
    """The non-speech clips an evaluation decodes: ids, seconds and kinds (data/nonspeech.py's manifest)."""

    manifest: str
    seconds: dict[str, float]
    kinds: dict[str, str]


def _indicators(per_item: Sequence[dict]) -> dict[str, np.ndarray]:
    """Per-item 0/1 arrays of each rate (an item without reference words counts in no empty-output rate)."""
    spoken = np.array([1.0 if i["reference_words"] else 0.0 for i in per_item])
    return {"empty_output_rate": (np.array([float(i["empty"] and i["reference_words"] > 0) for i in per_item]),
                                  spoken),
            "loop_rate": (np.array([float(i["loop"]) for i in per_item]), np.ones(len(per_item))),
            "dropped_rate": (np.array([float(bool(i["dropped_spans"])) for i in per_item]), np.ones(len(per_item))),
            "invented_per_nonspeech_minute": (
                np.array([float(i["invented"].get("nonspeech_words", 0)) for i in per_item]),
                np.array([float(i["invented"].get("nonspeech_minutes", 0.0)) for i in per_item]))}


def failure_section(references: Sequence[tuple[str, str]], hypotheses: Mapping[str, Sequence[str]],
                    spans: Mapping[str, Sequence[Span]], pairs: Sequence[tuple[str, str]], resamples: int,
                    seed: int) -> dict:
    """{"models": {key: figures}, "differences": [...]} of one dataset. ``references``: (id, text) per utterance;
    ``hypotheses``: run key -> texts in that order; ``pairs``: (run key, the key it is compared with)."""
    figures = {key: failure_figures([FailureInput(uid, text, hyp, tuple(spans.get(uid, ())))
                                     for (uid, text), hyp in zip(references, texts)]).as_dict()
               for key, texts in hypotheses.items()}
    indices = bootstrap_indices(len(references), resamples, seed)
    counts = {key: _indicators(f["per_item"]) for key, f in figures.items()}
    differences = []
    for key, base in dict.fromkeys(pairs):
        for rate, _ in [*FAILURE_RATES.items(), ("invented_per_nonspeech_minute", "invented/min")]:
            if counts[base][rate][1].sum() > 0:
                d = paired_difference(counts[key][rate], counts[base][rate], indices)
                differences.append({"model": key, "against": base, "figure": rate, **d.as_dict()})
    for f in figures.values():
        f["per_item"] = [{k: v for k, v in item.items() if k != "invented"} | _invented_summary(item)
                         for item in f["per_item"]]
    return {"models": figures, "differences": differences, "long_form": bool(spans)}


def _invented_summary(item: dict) -> dict:
    invented = item.get("invented") or {}
    return {"invented_words": invented.get("nonspeech_words", 0), "pause_words": invented.get("pause_words", 0)}


def nonspeech_section(clips: NonspeechSet, hypotheses: Mapping[str, Sequence[str]],
                      baselines: Mapping[str, str]) -> dict:
    """Words per non-speech minute of every run on the clips, in total and per kind, and each run's excess over
    its baseline's (the reference model's: a quantized file should invent no more than its full-precision one)."""
    ids = list(clips.seconds)
    models = {}
    for key, texts in hypotheses.items():
        figures = failure_figures([], dict(zip(ids, texts)), clips.seconds, clips.kinds).clips
        models[key] = figures
    excess = {key: rate_difference(models[key], models[base]) for key, base in baselines.items()}
    return {"manifest": clips.manifest, "clips": len(ids), "minutes": sum(clips.seconds.values()) / 60,
            "models": models, "excess_over_baseline": excess}


def rate_difference(ours: dict, theirs: dict | None) -> float | None:
    """Words per non-speech minute of ``ours`` less ``theirs`` (None where either is missing)."""
    a, b = ours.get("words_per_minute"), (theirs or {}).get("words_per_minute")
    return None if a is None or b is None else a - b


def _pct(x: float | None) -> str:
    return "—" if x is None else f"{100 * x:.1f}"


def render_failures(section: dict) -> list[str]:
    """Markdown: the failure table of one dataset and the paired differences that exclude 0."""
    lines = ["", "Failure figures" + (" (long recordings decoded whole)" if section["long_form"] else "") +
             ": empty outputs, loops (an n-gram repeated 4+ times beyond the reference), dropped spans (8+ "
             "reference words deleted in a row), words invented inside silent/noisy stretches per minute of them.", "",
             "| model | items | empty % | loops % | dropped % | dropped words | invented words | invented / min | "
             "pause words |", "|---|---|---|---|---|---|---|---|---|"]
    for key, f in section["models"].items():
        per_minute = f["invented_per_nonspeech_minute"]
        lines.append(f"| {key} | {f['items']} | {_pct(f['empty_output_rate'])} | {_pct(f['loop_rate'])} | "
                     f"{_pct(f['dropped_rate'])} | {f['dropped_words']} | {f['gap_invented_words']} | "
                     f"{'—' if per_minute is None else f'{per_minute:.2f}'} | {f['pause_invented_words']} |")
    for d in section["differences"]:
        scale = 1 if d["figure"] == "invented_per_nonspeech_minute" else 100
        unit = " words/min" if scale == 1 else " points"
        lines.append(f"- {d['model']} - {d['against']}, {d['figure']}: {scale * d['value']:+.2f} "
                     f"[{scale * d['low']:+.2f}, {scale * d['high']:+.2f}]{unit}")
    return lines


def render_nonspeech(section: dict) -> list[str]:
    kinds = sorted({k for m in section["models"].values() for k in m.get("by_kind", {})})
    lines = ["", "## Non-speech", "",
             f"`{section['manifest']}`: {section['clips']} clips, {section['minutes']:.1f} min with no words; every "
             "word a model writes there is invented. Words per minute, in total and per kind; excess = this model's rate "
             "minus its baseline's.", "",
             "| model | words / min | excess | " + " | ".join(kinds) + " |", "|---|---|---|" + "---|" * len(kinds)]
    for key, m in section["models"].items():
        excess = section["excess_over_baseline"].get(key)
        per_kind = [m.get("by_kind", {}).get(k, {}).get("words_per_minute") for k in kinds]
        lines.append(f"| {key} | {_num(m.get('words_per_minute'))} | {'—' if excess is None else f'{excess:+.2f}'} | "
                     + " | ".join(_num(x) for x in per_kind) + " |")
    return lines


def _num(x: float | None) -> str:
    return "—" if x is None else f"{x:.2f}"
