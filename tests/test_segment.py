"""data/segment.py: a long recording's transcript cut at the model's own segment times, or refused (None)."""
from __future__ import annotations

from tarq_deploy.data.segment import TimedText, align_segments

TRANSCRIPT = ("And so, my fellow Americans: ask not what your country can do for you. Ask what you can do for your "
              "country. He was not an ill-disposed young man. Go forward ten meters.")


def _segments(*pieces: tuple[float, float, str]) -> list[TimedText]:
    return [TimedText(a, b, t) for a, b, t in pieces]


def test_pieces_follow_the_segments_and_keep_every_word_once():
    decoded = _segments((0.0, 11.0, "and so my fellow americans ask not what your country can do for you"),
                        (11.5, 24.0, "ask what you can do for your country"),
                        (24.5, 33.0, "he was not an ill disposed young man"), (33.5, 40.0, "go forward ten meters"))
    pieces = align_segments(TRANSCRIPT, decoded, 40.0)
    assert pieces is not None and all(p.end_s - p.start_s <= 30.0 for p in pieces)
    assert " ".join(p.text for p in pieces) == TRANSCRIPT  # every word once, in order, as written
    assert pieces[0].start_s == 0.0 and pieces[-1].end_s == 40.0
    assert [p.start_s for p in pieces[1:]] == [p.end_s for p in pieces[:-1]]  # contiguous
    assert pieces[1].text.startswith(("He was", "Go forward"))  # cut where a segment starts


def test_a_decode_unlike_the_transcript_is_not_aligned():
    decoded = _segments((0.0, 20.0, "the quick brown fox jumps over the lazy dog"), (20.5, 40.0, "again and again"))
    assert align_segments(TRANSCRIPT, decoded, 40.0) is None


def test_no_cut_within_reach_is_not_aligned():
    """One segment boundary at 35 s: the first piece would be longer than 30 s."""
    decoded = _segments((0.0, 35.0, "and so my fellow americans ask not what your country can do for you ask what "
                                    "you can do for your country he was not an ill disposed young man"),
                        (35.5, 40.0, "go forward ten meters"))
    assert align_segments(TRANSCRIPT, decoded, 40.0) is None


def test_a_boundary_whose_first_word_was_misheard_is_no_cut():
    """The boundary at 24 s starts with a misheard word: the first piece ends at the 11 s cut instead (the furthest
    trusted one within 30 s), and the rest fits in one piece."""
    decoded = _segments((0.0, 11.0, "and so my fellow americans ask not what your country can do for you"),
                        (11.5, 24.0, "ask what you can do for your country"),
                        (24.5, 33.0, "we was not an ill disposed young man"), (33.5, 40.0, "go forward ten meters"))
    pieces = align_segments(TRANSCRIPT, decoded, 40.0)
    assert pieces is not None and [round(p.start_s, 2) for p in pieces] == [0.0, 11.25]
