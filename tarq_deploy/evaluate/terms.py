"""Term figures: how many of a user's terms (data/terms.py) each model keeps, beside WER (pure computation).

A term's reference occurrence is **found** when the alignment keeps every one of its words (op ok) and the
hypothesis holds them back to back (nothing inserted inside a multi-word term): "Joe Keaton" heard as "Jo Kitson",
"Joe" or "Joe the Keaton" is lost. Term words are compared after the normaliser that scores WER, applied to the term
as to the reference. **Term recall** = found / occurrences; **term-WER** = the errors charged to term words (the
WER charging rule of evaluate/wer.py with the term words as the tagged ones) / term words. Both are ratios of sums
over utterances, so the bootstrap over utterances of evaluate/wer.py gives their intervals and paired differences.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from ..data.normalize import Normalizer, normalized_words
from ..data.terms import TermList, find_terms
from .wer import OK, UtteranceScore, align_words, bootstrap_indices, bootstrap_interval, paired_difference

__all__ = ["TermScore", "render_terms", "score_terms", "term_section"]

TERM_METRICS = ("term_recall", "term_wer")
MAX_TERM_ROWS = 40


@dataclass(frozen=True)
class TermScore:
    """One utterance's term occurrences under one model: which term, whether found, and the term-word errors."""

    terms: tuple[int, ...]  # the term of each reference occurrence
    found: tuple[bool, ...]
    term_words: int
    term_errors: int


def term_forms(terms: TermList, normalizer: Normalizer | None = None) -> list[tuple[str, ...]]:
    """Each term's words under the normaliser that scores WER. Two terms the normaliser makes one ("analyse" and
    "analyze" under the English spelling map) are counted as the first of them: the later one's form is left empty,
    so it never matches."""
    forms = terms.word_forms(lambda text: normalized_words(text, normalizer))
    first: dict[tuple[str, ...], int] = {}
    return [form if first.setdefault(form, i) == i else () for i, form in enumerate(forms)]


def score_terms(score: UtteranceScore, forms: Sequence[tuple[str, ...]]) -> TermScore:
    """The term occurrences of ``score``'s reference, found or lost in its hypothesis."""
    occurrences = find_terms(score.reference_words, forms)
    in_term = [False] * score.n_words
    for o in occurrences:
        in_term[o.start: o.end] = [True] * (o.end - o.start)
    outcomes = score.outcomes
    found = tuple(all(outcomes[j].op == OK for j in range(o.start, o.end))
                  and all(outcomes[j + 1].hypothesis_index == outcomes[j].hypothesis_index + 1
                          for j in range(o.start, o.end - 1))
                  for o in occurrences)
    errors = 0
    if occurrences:
        charged = align_words(score.reference_words, score.hypothesis_words, in_term)
        errors = sum(o.errors for o in charged.outcomes if o.rare)
    return TermScore(tuple(o.term for o in occurrences), found, sum(in_term), errors)


def _counts(scores: Sequence[TermScore]) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    occurrences = np.array([len(s.found) for s in scores], dtype=np.float64)
    return {"term_recall": (np.array([sum(s.found) for s in scores], dtype=np.float64), occurrences),
            "term_wer": (np.array([s.term_errors for s in scores], dtype=np.float64),
                         np.array([s.term_words for s in scores], dtype=np.float64))}


def term_section(terms: TermList, runs: dict[str, list[UtteranceScore]], pairs: Sequence[tuple[str, str]],
                 ids: Sequence[str], resamples: int, seed: int, normalizer: Normalizer | None = None) -> dict:
    """The dataset's term figures: each run's recall and term-WER with intervals, the paired differences of
    ``pairs`` (run key A, run key B), and the per-term table (which terms each run loses that B keeps)."""
    forms = term_forms(terms, normalizer)
    scored = {key: [score_terms(s, forms) for s in scores] for key, scores in runs.items()}
    indices = bootstrap_indices(len(ids), resamples, seed)
    counts = {key: _counts(rows) for key, rows in scored.items()}
    first = next(iter(scored.values()), [])
    occurring = sorted({t for s in first for t in s.terms})
    return {
        **terms.record(), "occurring_terms": len(occurring), "occurrences": sum(len(s.found) for s in first),
        "models": {key: {metric: bootstrap_interval(*c[metric], indices).as_dict() for metric in TERM_METRICS}
                   for key, c in counts.items()},
        "differences": [{"a": a, "b": b, **{metric: paired_difference(counts[a][metric], counts[b][metric],
                                                                      indices).as_dict() for metric in TERM_METRICS}}
                        for a, b in pairs if a in counts and b in counts],
        "per_term": _per_term(terms, scored, occurring, pairs, ids),
    }


def _per_term(terms: TermList, scored: dict[str, list[TermScore]], occurring: list[int],
              pairs: Sequence[tuple[str, str]], ids: Sequence[str]) -> list[dict]:
    """Per term: its occurrences, how many each run found, and where a run loses what its pair's B keeps."""
    rows = []
    for term in occurring:
        found = {key: [(ids[i], f) for i, s in enumerate(rows_) for t, f in zip(s.terms, s.found) if t == term]
                 for key, rows_ in scored.items()}
        lost = {f"{a} vs {b}": [uid for (uid, fa), (_, fb) in zip(found[a], found[b]) if fb and not fa]
                for a, b in pairs if a in found and b in found}
        rows.append({"term": terms.terms[term].text, "occurrences": len(next(iter(found.values()))),
                     "found": {key: sum(f for _, f in hits) for key, hits in found.items()},
                     "lost": {pair: uids for pair, uids in lost.items() if uids}})
    return rows


def render_terms(section: dict) -> list[str]:
    """Markdown lines of a term section."""
    pct = lambda x: f"{100 * x:.1f}" if x == x else "n/a"  # noqa: E731 -- NaN: no occurrence
    lines = [f"### Terms ({section['file']}: {section['occurring_terms']} of {section['terms']} terms occur, "
             f"{section['occurrences']} occurrences)", "",
             "| model | term recall % [95% CI] | term-WER % [95% CI] |", "|---|---|---|"]
    for key, m in section["models"].items():
        r, w = m["term_recall"], m["term_wer"]
        lines.append(f"| {key} | {pct(r['value'])} [{pct(r['low'])}, {pct(r['high'])}] | {pct(w['value'])} "
                     f"[{pct(w['low'])}, {pct(w['high'])}] |")
    if section["differences"]:
        lines += ["", "| A - B | term recall (points) [95% CI] | term-WER (points) [95% CI] |", "|---|---|---|"]
        for d in section["differences"]:
            r, w = d["term_recall"], d["term_wer"]
            lines.append(f"| {d['a']} - {d['b']} | {pct(r['value'])} [{pct(r['low'])}, {pct(r['high'])}]"
                         f"{'*' if r['significant'] else ''} | {pct(w['value'])} [{pct(w['low'])}, "
                         f"{pct(w['high'])}]{'*' if w['significant'] else ''} |")
    lost = [row for row in section["per_term"] if row["lost"]]
    keys = list(section["models"])
    lines += ["", "| term | occurrences | " + " | ".join(f"found: {k}" for k in keys) + " | lost where B keeps it |",
              "|---|---|" + "---|" * len(keys) + "---|"]
    for row in (lost or section["per_term"])[:MAX_TERM_ROWS]:
        where = "; ".join(f"{pair}: {', '.join(uids)}" for pair, uids in row["lost"].items())
        lines.append(f"| {row['term']} | {row['occurrences']} | "
                     + " | ".join(str(row["found"][k]) for k in keys) + f" | {where or '-'} |")
    return lines + [""]
