"""Failure figures of a recogniser on long recordings and non-speech, computed from texts alone (no decoding here):
empty outputs, repetition loops, dropped stretches of speech and words invented where nobody speaks.

Alignment. The same minimum-edit word alignment WER is scored under (jiwer.process_words on the space-joined
normalised words, as tarq_deploy.evaluate.wer.align_words calls it), read chunk by chunk: align_words charges every
insertion to a neighbouring reference word, which loses where the insertion sits, and where it sits is what says
whether it fell into a gap.

* Dropped span: a run of at least ``min_words`` consecutive reference words the alignment deletes (a recogniser that
  skips a window of audio drops whole sentences; an ordinary deletion is one or two words).
* Loop: some n-gram (n <= 8) repeated back to back at least 4 times and more often than anything repeats in the
  reference -- wer.is_repetition_loop, on the normalised words and on the words as written (the normaliser joins
  "five, five, five" into one number), as the WER report flags them; :func:`loop_runs` lists every such run.
* Invented words: words inserted at the position of a gap span (between reference words ``first_word - 1`` and
  ``first_word``) count for that gap, per kind: silence and noise make the non-speech figure, pauses are reported
  apart (a pause is part of speech, and an insertion at a pause may be a mis-split of either neighbour). Only words
  holding a letter or a digit count (data.normalize.spoken_words): the normaliser leaves a lone "." standing.
* In :func:`failure_figures` the hypothesis is its spoken words alone (so an output of "..." is empty and drops
  everything); the reference keeps every normalised word, the words a long recording's spans index.
* Non-speech clips have no reference: every spoken word of their transcript is invented.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Mapping, Sequence

from ..data.long_form import GAP_KINDS, NOISE, PAUSE, SILENCE, Span
from ..data.normalize import Normalizer, normalized_words, spoken_words
from ..data.rarity import written_words
from .wer import DEFAULT_LOOP_MAX_NGRAM, DEFAULT_LOOP_REPEATS, is_repetition_loop, longest_repetition

__all__ = ["DEFAULT_DROP_MIN_WORDS", "FailureFigures", "FailureInput", "ItemFailures", "LOOP_MAX_NGRAM",
           "LOOP_MIN_REPEATS", "LoopRun", "dropped_spans", "failure_figures", "invented_words", "loop_runs",
           "nonspeech_words_per_minute"]

DEFAULT_DROP_MIN_WORDS = 8
# wer.is_repetition_loop's own defaults: one definition of a loop for the WER report and these figures
LOOP_MIN_REPEATS = DEFAULT_LOOP_REPEATS
LOOP_MAX_NGRAM = DEFAULT_LOOP_MAX_NGRAM
NONSPEECH_GAP_KINDS = (SILENCE, NOISE)


# ------------------------------------------------------------------------------------------------- alignment
@dataclass(frozen=True)
class _Chunk:
    """One jiwer alignment chunk: ``kind`` equal | substitute | delete | insert over reference [ref_start, ref_end)
    and hypothesis [hyp_start, hyp_end)."""

    kind: str
    ref_start: int
    ref_end: int
    hyp_start: int
    hyp_end: int


def _alignment(reference: Sequence[str], hypothesis: Sequence[str]) -> list[_Chunk]:
    if not reference or not hypothesis:  # jiwer refuses an empty reference; both are trivial
        chunks = [_Chunk("delete", 0, len(reference), 0, 0)] if reference else []
        return chunks + ([_Chunk("insert", 0, 0, 0, len(hypothesis))] if hypothesis else [])
    import jiwer

    output = jiwer.process_words(" ".join(reference), " ".join(hypothesis))
    return [_Chunk(c.type, c.ref_start_idx, c.ref_end_idx, c.hyp_start_idx, c.hyp_end_idx)
            for c in output.alignments[0]]


def _as_written(text: str) -> str:
    return text  # words already normalised: only the spoken-word test of data.normalize applies


def _spoken_count(words: Sequence[str]) -> int:
    return len(spoken_words(" ".join(words), _as_written))


# ------------------------------------------------------------------------------------------- single texts
def dropped_spans(reference_words: Sequence[str], hypothesis_words: Sequence[str],
                  min_words: int = DEFAULT_DROP_MIN_WORDS) -> list[tuple[int, int]]:
    """(first reference word, number of words) of every run of >= ``min_words`` consecutive deleted reference words,
    in order (an insertion between two deleted words does not end the run: the reference words are still
    consecutive)."""
    deleted = sorted(j for chunk in _alignment(reference_words, hypothesis_words) if chunk.kind == "delete"
                     for j in range(chunk.ref_start, chunk.ref_end))
    runs: list[tuple[int, int]] = []
    for j in deleted:
        if runs and runs[-1][0] + runs[-1][1] == j:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((j, 1))
    return [run for run in runs if run[1] >= min_words]


@dataclass(frozen=True)
class LoopRun:
    """``repeats`` back-to-back copies of the ``n``-gram starting at word ``start``."""

    start: int
    n: int
    repeats: int

    @property
    def words(self) -> int:
        return self.n * self.repeats


def loop_runs(words: Sequence[str], reference: Sequence[str] = (), min_repeats: int = LOOP_MIN_REPEATS,
              max_ngram: int = LOOP_MAX_NGRAM) -> list[LoopRun]:
    """Every run of an n-gram (n <= ``max_ngram``) repeated back to back at least ``min_repeats`` times and more
    often than anything repeats in ``reference`` (wer.longest_repetition), left to right without overlap: at each
    position the run covering the most words (the shortest n on a tie), then on after it. Non-empty exactly when
    wer.is_repetition_loop says so."""
    words = list(words)
    needed = max(min_repeats, longest_repetition(list(reference), max_ngram) + 1)
    runs: list[LoopRun] = []
    position = 0
    while position < len(words):
        run = _best_run_at(words, position, needed, max_ngram)
        if run is None:
            position += 1
        else:
            runs.append(run)
            position += run.words
    return runs


def _best_run_at(words: list[str], start: int, needed: int, max_ngram: int) -> LoopRun | None:
    best: LoopRun | None = None
    for n in range(1, max_ngram + 1):
        if start + needed * n > len(words):
            break
        repeats = _copies(words, start, n)
        if repeats >= needed and (best is None or repeats * n > best.words):
            best = LoopRun(start, n, repeats)
    return best


def _copies(words: list[str], start: int, n: int) -> int:
    gram = words[start: start + n]
    copies = 1
    while words[start + copies * n: start + (copies + 1) * n] == gram:
        copies += 1
    return copies


def invented_words(spans: Sequence[Span], reference_words: Sequence[str], hypothesis_words: Sequence[str]) -> dict:
    """Words inserted in the gaps of one long recording (module doc), by gap kind and by signal (``detail``), with
    the minutes of each. ``nonspeech_*`` sum silence and noise; pauses stay apart."""
    inserted_at: dict[int, int] = {}
    for chunk in _alignment(reference_words, hypothesis_words):
        if chunk.kind == "insert":
            count = _spoken_count(hypothesis_words[chunk.hyp_start: chunk.hyp_end])
            inserted_at[chunk.ref_start] = inserted_at.get(chunk.ref_start, 0) + count
    words = dict.fromkeys(GAP_KINDS, 0)
    minutes = dict.fromkeys(GAP_KINDS, 0.0)
    by_detail: dict[str, dict[str, float]] = {}
    for gap in _one_gap_per_position(spans):
        count, length = inserted_at.get(gap.first_word, 0), (gap.end_s - gap.start_s) / 60.0
        words[gap.kind] += count
        minutes[gap.kind] += length
        detail = by_detail.setdefault(gap.detail or gap.kind, {"words": 0, "minutes": 0.0})
        detail["words"] += count
        detail["minutes"] += length
    nonspeech_words = sum(words[kind] for kind in NONSPEECH_GAP_KINDS)
    nonspeech_minutes = sum(minutes[kind] for kind in NONSPEECH_GAP_KINDS)
    return {"words": words, "minutes": minutes, "by_detail": dict(sorted(by_detail.items())),
            "nonspeech_words": nonspeech_words, "nonspeech_minutes": nonspeech_minutes,
            "pause_words": words[PAUSE], "pause_minutes": minutes[PAUSE],
            "nonspeech_words_per_minute": _rate(nonspeech_words, nonspeech_minutes)}


def _one_gap_per_position(spans: Sequence[Span]) -> list[Span]:
    """The gap spans, the first only where two share a word position (one insertion run cannot be split)."""
    gaps: dict[int, Span] = {}
    for span in spans:
        if span.kind in GAP_KINDS:
            gaps.setdefault(span.first_word, span)
    return list(gaps.values())


def _rate(count: float, denominator: float) -> float | None:
    return count / denominator if denominator > 0 else None


def nonspeech_words_per_minute(texts_by_clip: Mapping[str, str], seconds_by_clip: Mapping[str, float],
                               kinds_by_clip: Mapping[str, str] | None = None,
                               normalizer: Normalizer | None = None) -> dict:
    """Spoken words in the transcripts of non-speech clips, per clip, per kind (when ``kinds_by_clip`` is given) and
    per minute of clip audio. Every clip with a text needs its length."""
    missing = sorted(set(texts_by_clip) - set(seconds_by_clip))
    if missing:
        raise ValueError(f"no length for non-speech clip(s) {', '.join(missing)}")
    words = {clip: len(spoken_words(text, normalizer)) for clip, text in texts_by_clip.items()}
    minutes = sum(seconds_by_clip[clip] for clip in texts_by_clip) / 60.0
    result = {"words": sum(words.values()), "minutes": minutes, "words_per_minute": _rate(sum(words.values()), minutes),
              "by_clip": dict(sorted(words.items()))}
    if kinds_by_clip is not None:
        result["by_kind"] = _clip_kinds(words, seconds_by_clip, kinds_by_clip)
    return result


def _clip_kinds(words: Mapping[str, int], seconds: Mapping[str, float], kinds: Mapping[str, str]) -> dict:
    by_kind: dict[str, dict] = {}
    for clip, count in words.items():
        entry = by_kind.setdefault(kinds.get(clip, "unknown"), {"words": 0, "minutes": 0.0})
        entry["words"] += count
        entry["minutes"] += seconds[clip] / 60.0
    for entry in by_kind.values():
        entry["words_per_minute"] = _rate(entry["words"], entry["minutes"])
    return dict(sorted(by_kind.items()))


# -------------------------------------------------------------------------------------------------- aggregate
@dataclass(frozen=True)
class FailureInput:
    """One scored text: an utterance (no spans) or a long recording (its spans from data.long_form)."""

    id: str
    reference: str
    hypothesis: str
    spans: tuple[Span, ...] = ()


@dataclass(frozen=True)
class ItemFailures:
    """What went wrong in one utterance or recording."""

    id: str
    reference_words: int
    hypothesis_words: int
    empty: bool
    loop: bool
    loop_runs: tuple[LoopRun, ...]
    dropped_spans: tuple[tuple[int, int], ...]
    invented: dict = field(default_factory=dict)  # invented_words(...) for a recording with spans, else {}


@dataclass(frozen=True)
class FailureFigures:
    """Failure counts and rates over a set of utterances / recordings plus non-speech clips. A rate whose
    denominator is 0 is None (JSON has no NaN)."""

    items: int
    empty_outputs: int
    empty_output_rate: float | None
    loops: int
    loop_rate: float | None
    dropped_items: int
    dropped_rate: float | None
    dropped_words: int
    gap_invented_words: int
    gap_minutes: float
    pause_invented_words: int
    pause_minutes: float
    clip_invented_words: int
    clip_minutes: float
    invented_per_nonspeech_minute: float | None  # (gap + clip words) / (gap + clip minutes); pauses not included
    per_item: tuple[ItemFailures, ...] = ()
    clips: dict = field(default_factory=dict)  # nonspeech_words_per_minute(...) of the clips

    def as_dict(self) -> dict:
        return asdict(self)


def failure_figures(items: Sequence[FailureInput], nonspeech_texts: Mapping[str, str] | None = None,
                    nonspeech_seconds: Mapping[str, float] | None = None,
                    nonspeech_kinds: Mapping[str, str] | None = None,
                    min_dropped_words: int = DEFAULT_DROP_MIN_WORDS,
                    normalizer: Normalizer | None = None) -> FailureFigures:
    """The figures of the module doc over ``items`` and the non-speech clips' transcripts."""
    per_item = tuple(_item_failures(item, min_dropped_words, normalizer) for item in items)
    clips = nonspeech_words_per_minute(nonspeech_texts or {}, nonspeech_seconds or {}, nonspeech_kinds, normalizer)
    with_words = [f for f in per_item if f.reference_words]
    inventions = [f.invented for f in per_item if f.invented]
    gap_words = sum(i["nonspeech_words"] for i in inventions)
    gap_minutes = sum(i["nonspeech_minutes"] for i in inventions)
    dropped = [f for f in per_item if f.dropped_spans]
    return FailureFigures(
        items=len(per_item), empty_outputs=sum(f.empty for f in with_words),
        empty_output_rate=_rate(sum(f.empty for f in with_words), len(with_words)),
        loops=sum(f.loop for f in per_item), loop_rate=_rate(sum(f.loop for f in per_item), len(per_item)),
        dropped_items=len(dropped), dropped_rate=_rate(len(dropped), len(per_item)),
        dropped_words=sum(n for f in dropped for _, n in f.dropped_spans),
        gap_invented_words=gap_words, gap_minutes=gap_minutes,
        pause_invented_words=sum(i["pause_words"] for i in inventions),
        pause_minutes=sum(i["pause_minutes"] for i in inventions),
        clip_invented_words=clips["words"], clip_minutes=clips["minutes"],
        invented_per_nonspeech_minute=_rate(gap_words + clips["words"], gap_minutes + clips["minutes"]),
        per_item=per_item, clips=clips)


def _item_failures(item: FailureInput, min_dropped_words: int, normalizer: Normalizer | None) -> ItemFailures:
    reference = normalized_words(item.reference, normalizer)  # the words the spans index: WER's reference words
    hypothesis = spoken_words(item.hypothesis, normalizer)  # a lone "." aligned to a lost word would hide a drop
    loop = is_repetition_loop(hypothesis, reference) or is_repetition_loop(written_words(item.hypothesis),
                                                                           written_words(item.reference))
    return ItemFailures(
        id=item.id, reference_words=len(reference), hypothesis_words=len(hypothesis),
        empty=not hypothesis, loop=loop,
        loop_runs=tuple(loop_runs(hypothesis, reference)),
        dropped_spans=tuple(dropped_spans(reference, hypothesis, min_dropped_words)),
        invented=invented_words(item.spans, reference, hypothesis) if item.spans else {})
