"""Word error rates as the paper reports them: plain WER, rare-WER, common-WER, capped WER, repetition loops, and
bootstrap confidence intervals (pure computation: no files, no models).

Normalisation. Reference and hypothesis both go through Whisper's English text normaliser (transformers'
``EnglishTextNormalizer``: lowercase, punctuation and bracketed text removed, contractions and spelled-out numbers
standardised) with Whisper's British-to-American spelling map when the ``whisper_normalizer`` package supplies it
(:func:`normalizer_description` says which). Words are the whitespace-separated tokens of the normalised text
(tarq_deploy.data.normalize: the corpus readers refuse a transcript with no word under the same normaliser).

Rarity. A *normalised* reference word is rare iff :func:`tarq_deploy.data.rarity.is_rare_word` says so (wordfreq
Zipf < k, default 3.0) -- the same rule, code and numeral policy that tag calibration positions, applied to the
words that are actually aligned.

Alignment and charging. jiwer computes a minimum-edit alignment of the two word sequences. Every error is charged
to exactly one reference position, so rare and common errors add up to the plain error count:

* a substitution or deletion is charged to its own reference word;
* a run of inserted words sits between the reference word aligned just before it (its left neighbour L) and the one
  just after it (its right neighbour R). The whole run is charged to L if L is rare, else to R if R is rare, else
  to L (or to R when the run precedes the first reference word). So an insertion *adjacent to a rare reference word
  counts as a rare error* (the paper's "Evaluation conventions"), preferring the left neighbour when both are rare;
* insertions into an empty reference have no position and count only in plain WER.

Then ``rare-WER = rare errors / rare reference words`` and ``common-WER = common errors / common reference words``;
``WER = (S + D + I) / reference words``. Corpus-level rates are ratios of sums over utterances (not means of
per-utterance rates). *Capped* rates cap each utterance's errors at its own reference length first (its rare errors
at its rare-word count), so one repetition loop cannot outweigh the rest of the corpus; loops are counted apart.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Iterable, Sequence

import numpy as np

from ..data.normalize import (Normalizer, english_spelling_mapping, normalized_words,  # noqa: F401 -- re-exported
                              normalizer_description, normalizer_for, whisper_english_normalizer)
from ..data.rarity import DEFAULT_LANGUAGE, DEFAULT_ZIPF_THRESHOLD, NumeralPolicy, is_rare_word, written_words

__all__ = ["CONFIDENCE_LEVEL", "DEFAULT_LOOP_MAX_NGRAM", "DEFAULT_LOOP_REPEATS", "DEFAULT_RESAMPLES", "DEFAULT_SEED",
           "DELETED", "METRICS", "OK", "SUBSTITUTED", "UtteranceScore", "align_words", "bootstrap_indices",
           "bootstrap_interval", "check_same_references",
           "is_repetition_loop", "longest_repetition", "metric_counts", "normalized_words", "normalizer_description",
           "paired_difference", "ratio", "score_utterance", "totals"]

OK, SUBSTITUTED, DELETED = "ok", "sub", "del"
DEFAULT_LOOP_REPEATS = 4
# n-grams up to 32 words: a long recording's loop repeats whole sentences (a 15-word cycle repeated 30 times in
# results/decoding), which an 8-word limit missed
DEFAULT_LOOP_MAX_NGRAM = 32
DEFAULT_RESAMPLES = 1000
DEFAULT_SEED = 0
CONFIDENCE_LEVEL = 0.95


# ------------------------------------------------------------------------------------------ one utterance
@dataclass(frozen=True)
class WordOutcome:
    """What became of one normalised reference word: kept (ok), substituted or deleted, plus charged insertions."""

    index: int
    word: str
    rare: bool
    op: str
    hypothesis_word: str = ""
    inserted: int = 0
    hypothesis_index: int = -1  # position of hypothesis_word in the hypothesis (-1: deleted)

    @property
    def errors(self) -> int:
        return int(self.op != OK) + self.inserted


@dataclass(frozen=True)
class Alignment:
    """Per-reference-word outcomes; ``hyp_cursor[j]`` = hypothesis words consumed before reference word j
    (``hyp_cursor[n]`` = all of them), so ``hyp[hyp_cursor[a]:hyp_cursor[b + 1]]`` is what reference words a..b
    became, with the insertions between them."""

    outcomes: tuple[WordOutcome, ...]
    unattached_insertions: int
    hyp_cursor: tuple[int, ...]


def align_words(reference: Sequence[str], hypothesis: Sequence[str], rare: Sequence[bool]) -> Alignment:
    """Align word lists with jiwer and charge every error to one reference position (module doc)."""
    if len(rare) != len(reference):
        raise ValueError(f"{len(rare)} rare flags for {len(reference)} reference words")
    ops, hyp_index, cursor, insert_runs = _edit_operations(reference, hypothesis)
    inserted = [0] * len(reference)
    unattached = 0
    for before, count in insert_runs:  # a run inserted between reference words before-1 and before
        target = _insertion_target(before, rare)
        if target is None:
            unattached += count
        else:
            inserted[target] += count
    outcomes = tuple(WordOutcome(j, reference[j], bool(rare[j]), ops[j],
                                 hypothesis[hyp_index[j]] if hyp_index[j] >= 0 else "", inserted[j], hyp_index[j])
                     for j in range(len(reference)))
    return Alignment(outcomes, unattached, tuple(cursor))


def _edit_operations(reference: Sequence[str], hypothesis: Sequence[str]):
    """(op per reference word, index of its hypothesis word or -1, hyp cursor, [(reference index after the run,
    run length)])."""
    import jiwer

    n = len(reference)
    ops, hyp_index, cursor = [OK] * n, [-1] * n, [0] * (n + 1)
    insert_runs: list[tuple[int, int]] = []
    if n == 0 or not hypothesis:  # jiwer handles these too; this keeps the trivial cases dependency-free
        ops = [DELETED] * n
        if hypothesis:
            insert_runs.append((0, len(hypothesis)))
        cursor = [0] * n + [len(hypothesis)]
        return ops, hyp_index, cursor, insert_runs
    chunks = jiwer.process_words(" ".join(reference), " ".join(hypothesis)).alignments[0]
    for chunk in chunks:
        if chunk.type == "insert":
            insert_runs.append((chunk.ref_start_idx, chunk.hyp_end_idx - chunk.hyp_start_idx))
            continue
        for offset, j in enumerate(range(chunk.ref_start_idx, chunk.ref_end_idx)):
            cursor[j] = chunk.hyp_start_idx + (offset if chunk.type != "delete" else 0)
            if chunk.type == "delete":
                ops[j] = DELETED
            else:
                ops[j] = OK if chunk.type == "equal" else SUBSTITUTED
                hyp_index[j] = chunk.hyp_start_idx + offset
    cursor[n] = len(hypothesis)
    _cursor_before_insertions(cursor, insert_runs)
    return ops, hyp_index, cursor, insert_runs


def _cursor_before_insertions(cursor: list[int], insert_runs: list[tuple[int, int]]) -> None:
    """A run inserted before reference word j belongs to j's window: move cursor[j] back over it."""
    for before, count in insert_runs:
        if before < len(cursor) - 1:
            cursor[before] -= count


def _insertion_target(before: int, rare: Sequence[bool]) -> int | None:
    left = before - 1 if before > 0 else None
    right = before if before < len(rare) else None
    if left is not None and rare[left]:
        return left
    if right is not None and rare[right]:
        return right
    return left if left is not None else right


@dataclass(frozen=True)
class UtteranceScore:
    """One utterance under one model: texts, normalised words, the charged alignment and the loop flag."""

    id: str
    reference: str
    hypothesis: str
    reference_words: tuple[str, ...]
    hypothesis_words: tuple[str, ...]
    alignment: Alignment
    loop: bool

    @property
    def outcomes(self) -> tuple[WordOutcome, ...]:
        return self.alignment.outcomes

    @property
    def n_words(self) -> int:
        return len(self.reference_words)

    @property
    def n_rare(self) -> int:
        return sum(o.rare for o in self.outcomes)

    @property
    def n_common(self) -> int:
        return self.n_words - self.n_rare

    @property
    def substitutions(self) -> int:
        return sum(o.op == SUBSTITUTED for o in self.outcomes)

    @property
    def deletions(self) -> int:
        return sum(o.op == DELETED for o in self.outcomes)

    @property
    def insertions(self) -> int:
        return sum(o.inserted for o in self.outcomes) + self.alignment.unattached_insertions

    @property
    def errors(self) -> int:
        return self.substitutions + self.deletions + self.insertions

    @property
    def rare_errors(self) -> int:
        return sum(o.errors for o in self.outcomes if o.rare)

    @property
    def common_errors(self) -> int:
        return sum(o.errors for o in self.outcomes if not o.rare)

    def record(self) -> dict:
        """A JSON-ready per-utterance record."""
        return {
            "id": self.id, "reference": self.reference, "hypothesis": self.hypothesis,
            "reference_normalized": " ".join(self.reference_words),
            "hypothesis_normalized": " ".join(self.hypothesis_words),
            "words": self.n_words, "rare_words": self.n_rare, "errors": self.errors, "rare_errors": self.rare_errors,
            "common_errors": self.common_errors, "substitutions": self.substitutions, "deletions": self.deletions,
            "insertions": self.insertions, "loop": self.loop,
            "rare": [o.word for o in self.outcomes if o.rare],
            "rare_lost": [o.word for o in self.outcomes if o.rare and o.op != OK],
        }


def score_utterance(utterance_id: str, reference: str, hypothesis: str, k: float = DEFAULT_ZIPF_THRESHOLD,
                    numerals: NumeralPolicy = "zipf", normalizer: Normalizer | None = None,
                    language: str = DEFAULT_LANGUAGE) -> UtteranceScore:
    """Normalise both texts (``language``'s normaliser unless one is given), tag rare reference words by
    ``language``'s Zipf table, align, charge errors, flag a repetition loop."""
    normalizer = normalizer or (normalizer_for(language) if language != DEFAULT_LANGUAGE else None)
    ref_words = normalized_words(reference, normalizer)
    hyp_words = normalized_words(hypothesis, normalizer)
    rare = [is_rare_word(w, k, numerals, language) for w in ref_words]
    alignment = align_words(ref_words, hyp_words, rare)
    # Also on the words as written: the normaliser joins spelled-out numbers, so "five, five, five, ..." (a loop)
    # reads as the one token "555..." (one substitution of "55", measured on a 2-bit base).
    loop = is_repetition_loop(hyp_words, ref_words) or is_repetition_loop(written_words(hypothesis),
                                                                          written_words(reference))
    return UtteranceScore(utterance_id, reference, hypothesis, tuple(ref_words), tuple(hyp_words), alignment, loop)


# -------------------------------------------------------------------------------------------- repetition loops
def longest_repetition(words: Sequence[str], max_ngram: int = DEFAULT_LOOP_MAX_NGRAM) -> int:
    """The largest number of consecutive copies of any n-gram (n <= max_ngram) in ``words`` (1 when none repeats)."""
    best = 1 if words else 0
    for n in range(1, max_ngram + 1):
        for start in range(len(words) - 2 * n + 1):
            copies = 1
            while words[start + copies * n: start + (copies + 1) * n] == words[start: start + n]:
                copies += 1
            best = max(best, copies)
    return best


def is_repetition_loop(hypothesis: Sequence[str], reference: Sequence[str] = (),
                       min_repeats: int = DEFAULT_LOOP_REPEATS, max_ngram: int = DEFAULT_LOOP_MAX_NGRAM) -> bool:
    """A decoding loop: some n-gram (n <= max_ngram) repeated back to back at least ``min_repeats`` times, more
    often than anything repeats in the reference (a reference that says "no no no no" is not a loop)."""
    repeats = longest_repetition(hypothesis, max_ngram)
    return repeats >= min_repeats and repeats > longest_repetition(reference, max_ngram)


# ------------------------------------------------------------------------------------------------- corpus level
METRICS = ("wer", "rare_wer", "common_wer", "capped_wer", "capped_rare_wer")


def metric_counts(scores: Sequence[UtteranceScore]) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Per-utterance (numerator, denominator) arrays of every metric; a corpus rate is sum(num) / sum(den)."""
    words = np.array([s.n_words for s in scores], dtype=np.float64)
    rare = np.array([s.n_rare for s in scores], dtype=np.float64)
    errors = np.array([s.errors for s in scores], dtype=np.float64)
    rare_errors = np.array([s.rare_errors for s in scores], dtype=np.float64)
    common_errors = np.array([s.common_errors for s in scores], dtype=np.float64)
    return {
        "wer": (errors, words),
        "rare_wer": (rare_errors, rare),
        "common_wer": (common_errors, words - rare),
        "capped_wer": (np.minimum(errors, words), words),
        "capped_rare_wer": (np.minimum(rare_errors, rare), rare),
    }


def ratio(numerator: np.ndarray, denominator: np.ndarray) -> float:
    total = float(denominator.sum())
    return float(numerator.sum()) / total if total else float("nan")


@dataclass(frozen=True)
class Interval:
    """A rate (fraction) with its bootstrap confidence interval."""

    value: float
    low: float
    high: float

    def as_dict(self) -> dict:
        return asdict(self)


def bootstrap_indices(n_items: int, n_resamples: int = DEFAULT_RESAMPLES, seed: int = DEFAULT_SEED) -> np.ndarray:
    """[n_resamples, n_items] utterance indices drawn with replacement; the same seed gives the same draws, and
    using one draw for every model of a dataset makes their intervals (and differences) paired."""
    if n_items == 0:
        return np.zeros((n_resamples, 0), dtype=np.int64)
    return np.random.default_rng(seed).integers(0, n_items, size=(n_resamples, n_items))


def _resampled_ratios(numerator: np.ndarray, denominator: np.ndarray, indices: np.ndarray) -> np.ndarray:
    sums_num = numerator[indices].sum(axis=1)
    sums_den = denominator[indices].sum(axis=1)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(sums_den > 0, sums_num / np.where(sums_den > 0, sums_den, 1), np.nan)


def _percentiles(samples: np.ndarray, level: float) -> tuple[float, float]:
    finite = samples[np.isfinite(samples)]
    if finite.size == 0:
        return float("nan"), float("nan")
    tail = (1.0 - level) / 2.0 * 100.0
    low, high = np.percentile(finite, [tail, 100.0 - tail])
    return float(low), float(high)


def bootstrap_interval(numerator: np.ndarray, denominator: np.ndarray, indices: np.ndarray,
                       level: float = CONFIDENCE_LEVEL) -> Interval:
    """Ratio of sums with a percentile bootstrap interval over utterances."""
    return Interval(ratio(numerator, denominator), *_percentiles(_resampled_ratios(numerator, denominator, indices),
                                                                 level))


@dataclass(frozen=True)
class Difference:
    """rate(A) - rate(B) on the same utterances, its paired bootstrap interval, and the two-sided bootstrap
    p-value (twice the smaller share of resamples on either side of zero)."""

    value: float
    low: float
    high: float
    p_value: float

    @property
    def significant(self) -> bool:
        return bool(np.isfinite(self.low) and (self.low > 0 or self.high < 0))

    def as_dict(self) -> dict:
        return {**asdict(self), "significant": self.significant}


def paired_difference(counts_a: tuple[np.ndarray, np.ndarray], counts_b: tuple[np.ndarray, np.ndarray],
                      indices: np.ndarray, level: float = CONFIDENCE_LEVEL) -> Difference:
    """A - B for one metric, both scored on identical references (the denominators must agree)."""
    if not np.array_equal(counts_a[1], counts_b[1]):
        raise ValueError("paired difference needs identical references: the reference word counts differ")
    samples = _resampled_ratios(*counts_a, indices) - _resampled_ratios(*counts_b, indices)
    finite = samples[np.isfinite(samples)]
    p_value = float(min(1.0, 2.0 * min((finite <= 0).mean(), (finite >= 0).mean()))) if finite.size else float("nan")
    return Difference(ratio(*counts_a) - ratio(*counts_b), *_percentiles(samples, level), p_value)


@dataclass(frozen=True)
class Totals:
    """Corpus counts of one model on one dataset."""

    utterances: int
    words: int
    rare_words: int
    errors: int
    rare_errors: int
    common_errors: int
    substitutions: int
    deletions: int
    insertions: int
    loops: int
    loop_ids: tuple[str, ...] = field(default=())


def totals(scores: Iterable[UtteranceScore]) -> Totals:
    scores = list(scores)
    return Totals(
        utterances=len(scores), words=sum(s.n_words for s in scores), rare_words=sum(s.n_rare for s in scores),
        errors=sum(s.errors for s in scores), rare_errors=sum(s.rare_errors for s in scores),
        common_errors=sum(s.common_errors for s in scores), substitutions=sum(s.substitutions for s in scores),
        deletions=sum(s.deletions for s in scores), insertions=sum(s.insertions for s in scores),
        loops=sum(s.loop for s in scores), loop_ids=tuple(s.id for s in scores if s.loop))


def check_same_references(a: Sequence[UtteranceScore], b: Sequence[UtteranceScore]) -> None:
    """Paired statistics only make sense on the same utterances with the same references, in the same order."""
    ids_a, ids_b = [s.id for s in a], [s.id for s in b]
    if ids_a != ids_b:
        raise ValueError("models were scored on different utterances")
    for x, y in zip(a, b):
        if x.reference_words != y.reference_words:
            raise ValueError(f"utterance {x.id!r}: the references differ between models")
