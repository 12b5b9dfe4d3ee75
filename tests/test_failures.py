"""Failure figures from texts (tarq_deploy/evaluate/failures.py): dropped spans, loops, words invented in gaps and in
non-speech clips, and their aggregate as JSON."""
from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tarq_deploy.data.long_form import Span
from tarq_deploy.evaluate.failures import (FailureInput, dropped_spans, failure_figures, invented_words, loop_runs,
                                           nonspeech_words_per_minute)
from tarq_deploy.evaluate.wer import is_repetition_loop

# forty distinct words: a deletion or an insertion among them has one best alignment
REFERENCE = ("alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november oscar papa "
             "quebec romeo sierra tango uniform victor whiskey xray yankee zulu amber basalt cobalt dune ember "
             "flint garnet heron iris jade kelp lotus marble nectar").split()


# ------------------------------------------------------------------------------------------------ dropped spans
def test_a_deletion_of_ten_words_is_a_dropped_span_and_one_of_five_is_not() -> None:
    ten = REFERENCE[:12] + REFERENCE[22:]
    assert dropped_spans(REFERENCE, ten) == [(12, 10)]
    five = REFERENCE[:12] + REFERENCE[17:]
    assert dropped_spans(REFERENCE, five) == []
    assert dropped_spans(REFERENCE, five, min_words=5) == [(12, 5)]


def test_substitutions_around_a_dropped_span_leave_it_whole() -> None:
    hypothesis = ["zz"] + REFERENCE[1:5] + REFERENCE[15:30] + ["qq"] + REFERENCE[31:]
    assert dropped_spans(REFERENCE, hypothesis) == [(5, 10)]


def test_an_empty_hypothesis_drops_everything_and_an_empty_reference_nothing() -> None:
    assert dropped_spans(REFERENCE, []) == [(0, len(REFERENCE))]
    assert dropped_spans([], ["hello"] * 20) == []


@given(start=st.integers(0, 39), length=st.integers(1, 40))
def test_any_planted_deletion_is_found_exactly(start: int, length: int) -> None:
    length = min(length, len(REFERENCE) - start)
    hypothesis = REFERENCE[:start] + REFERENCE[start + length:]
    expected = [(start, length)] if length >= 8 else []
    assert dropped_spans(REFERENCE, hypothesis) == expected


# -------------------------------------------------------------------------------------------------------- loops
def test_a_phrase_repeated_six_times_is_a_loop_and_plain_text_is_not() -> None:
    phrase = ["and", "then", "we", "went"]
    hypothesis = REFERENCE[:10] + phrase * 6 + REFERENCE[10:]
    assert [(r.start, r.n, r.repeats) for r in loop_runs(hypothesis, REFERENCE)] == [(10, 4, 6)]
    assert loop_runs(REFERENCE, REFERENCE) == [] and loop_runs("the cat sat on the mat the end".split()) == []


def test_a_repetition_the_reference_has_too_is_no_loop() -> None:
    reference = "no no no no no said the man".split()
    assert loop_runs(reference, reference) == []
    assert [(r.n, r.repeats) for r in loop_runs(["no"] * 6 + reference[5:], reference)] == [(1, 6)]


def test_every_loop_in_a_long_text_is_listed_once() -> None:
    words = REFERENCE[:5] + ["thank", "you"] * 5 + REFERENCE[5:20] + ["so"] * 9 + REFERENCE[20:]
    assert [(r.start, r.n, r.repeats) for r in loop_runs(words)] == [(5, 2, 5), (30, 1, 9)]


@given(st.lists(st.sampled_from(["a", "b", "c"]), max_size=40), st.lists(st.sampled_from(["a", "b"]), max_size=12))
def test_loop_runs_agree_with_the_wer_loop_flag(words: list[str], reference: list[str]) -> None:
    runs = loop_runs(words, reference)
    assert bool(runs) == is_repetition_loop(words, reference)
    assert all(a.start + a.words <= b.start for a, b in zip(runs, runs[1:]))
    for run in runs:
        gram = words[run.start: run.start + run.n]
        assert words[run.start: run.start + run.words] == gram * run.repeats


# ----------------------------------------------------------------------------------------------- invented words
def _spans() -> list[Span]:
    """speech (words 0-9) | pause | speech (10-19) | silence | speech (20-29) | noise | speech (30-39) | silence."""
    spans, time, word = [], 0.0, 0
    for index, gap in enumerate(("pause", "silence", "noise", None)):
        spans.append(Span("speech", time, time + 4.0, f"u{index}", word, 10))
        time, word = time + 4.0, word + 10
        gap_seconds = 1.0 if gap == "pause" else 6.0
        spans.append(Span(gap or "silence", time, time + gap_seconds, None, word, 0, "digital"))
        time += gap_seconds
    return spans


def test_a_phrase_planted_in_a_silence_gap_counts_as_invented_there() -> None:
    hypothesis = REFERENCE[:20] + ["thank", "you", "for", "watching"] + REFERENCE[20:]
    invented = invented_words(_spans(), REFERENCE, hypothesis)
    assert invented["words"] == {"pause": 0, "silence": 4, "noise": 0}
    assert invented["nonspeech_words"] == 4 and invented["pause_words"] == 0
    assert invented["nonspeech_minutes"] == pytest.approx(18.0 / 60) and invented["pause_minutes"] == 1.0 / 60
    assert invented["nonspeech_words_per_minute"] == pytest.approx(4 / 0.3)


def test_words_in_pauses_noise_and_after_the_end_each_count_for_their_kind() -> None:
    hypothesis = (REFERENCE[:10] + ["um"] + REFERENCE[10:30] + ["music", "playing"] + REFERENCE[30:]
                  + ["bye", ".", "bye"])
    invented = invented_words(_spans(), REFERENCE, hypothesis)
    assert invented["words"] == {"pause": 1, "silence": 2, "noise": 2}  # the lone "." is no word
    assert invented["nonspeech_words"] == 4 and invented["pause_words"] == 1


def test_insertions_inside_speech_are_not_invented_in_a_gap() -> None:
    hypothesis = REFERENCE[:5] + ["extra", "words"] + REFERENCE[5:]
    assert invented_words(_spans(), REFERENCE, hypothesis)["nonspeech_words"] == 0


def test_non_speech_clips_count_every_spoken_word() -> None:
    counts = nonspeech_words_per_minute({"a": "Thank you.", "b": "...", "c": ""}, {"a": 30.0, "b": 30.0, "c": 60.0},
                                        {"a": "white", "b": "white", "c": "silence"})
    assert counts["words"] == 2 and counts["minutes"] == 2.0 and counts["words_per_minute"] == 1.0
    assert counts["by_kind"]["white"]["words_per_minute"] == 2.0 and counts["by_kind"]["silence"]["words"] == 0
    with pytest.raises(ValueError, match="no length"):
        nonspeech_words_per_minute({"a": "x"}, {})


# ---------------------------------------------------------------------------------------------------- aggregate
def test_failure_figures_aggregate_and_serialise_as_json() -> None:
    reference = " ".join(REFERENCE)
    items = [
        FailureInput("fine", reference, reference),
        FailureInput("empty", reference, " ..."),
        FailureInput("loop", reference, " ".join(REFERENCE[:10] + ["over", "and"] * 8 + REFERENCE[10:])),
        FailureInput("dropped", reference, " ".join(REFERENCE[:10] + REFERENCE[25:])),
        FailureInput("long", reference, " ".join(REFERENCE[:20] + ["thank", "you"] + REFERENCE[20:]), tuple(_spans())),
    ]
    figures = failure_figures(items, {"noise-00": "thank you thank you"}, {"noise-00": 30.0}, {"noise-00": "white"})
    assert (figures.items, figures.empty_outputs, figures.loops, figures.dropped_items) == (5, 1, 1, 2)
    assert figures.empty_output_rate == 0.2 and figures.loop_rate == 0.2 and figures.dropped_rate == 0.4
    assert figures.dropped_words == 40 + 15  # the empty output drops everything
    assert figures.gap_invented_words == 2 and figures.gap_minutes == pytest.approx(0.3)
    assert figures.clip_invented_words == 4 and figures.clip_minutes == 0.5
    assert figures.invented_per_nonspeech_minute == pytest.approx(6 / 0.8)
    as_json = json.loads(json.dumps(figures.as_dict(), allow_nan=False))
    assert as_json["per_item"][2]["loop_runs"] == [{"start": 10, "n": 2, "repeats": 8}]


def test_rates_without_a_denominator_are_none() -> None:
    figures = failure_figures([])
    assert figures.empty_output_rate is None and figures.invented_per_nonspeech_minute is None
    json.dumps(figures.as_dict(), allow_nan=False)
