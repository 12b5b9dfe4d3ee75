"""Cut a recording longer than one 30 s window into calibration pieces, each with its own part of the transcript.

The cut points come from the full-precision model's own timestamped decode of the recording (``TimedText``: what
Whisper's long-form generation returns per segment): the decoded words are aligned to the transcript's words, and
a segment boundary is a cut point when the first word after it is decoded exactly as the transcript has it (so the
transcript is cut at a word the audio is known to start with there). Pieces are packed greedily from the start:
each runs to the furthest cut point within ``max_seconds``. A recording whose decode differs too much from its
transcript (``max_mismatch``), or that has no cut point within reach, is not alignable: the caller refuses it.

Pure functions over text and times; the decode itself is the model adapter's (models/whisper.py).
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Sequence

__all__ = ["DEFAULT_MAX_MISMATCH", "Piece", "TimedText", "align_segments"]

DEFAULT_MAX_MISMATCH = 0.35  # word error rate of the decode against the transcript beyond which no cut is trusted


@dataclass(frozen=True)
class TimedText:
    """One decoded segment: its start and end in seconds and its text."""

    start_s: float
    end_s: float
    text: str


@dataclass(frozen=True)
class Piece:
    """A calibration piece: audio from start_s to end_s and the transcript words that it holds."""

    start_s: float
    end_s: float
    text: str


def _key(word: str) -> str:
    """A word as the alignment compares it: lower case, letters, digits and apostrophes only."""
    return re.sub(r"[^\w']", "", word.lower())


def _matched_reference_index(reference: list[str], decoded: list[str]) -> tuple[dict[int, int], float]:
    """{decoded word index: reference word index} for the words decoded exactly, and the decode's error rate."""
    import jiwer

    output = jiwer.process_words(" ".join(reference), " ".join(decoded))
    matched: dict[int, int] = {}
    for chunk in output.alignments[0]:
        if chunk.type == "equal":
            for offset in range(chunk.ref_end_idx - chunk.ref_start_idx):
                matched[chunk.hyp_start_idx + offset] = chunk.ref_start_idx + offset
    return matched, float(output.wer)


def _cut_points(segments: Sequence[TimedText], reference_keys: list[str]) -> list[tuple[float, int]] | None:
    """(time, reference word index) of every trusted cut, in order; None when the decode does not match."""
    decoded, first_word_of = [], []
    for segment in segments:
        first_word_of.append(len(decoded))
        decoded += [k for k in map(_key, segment.text.split()) if k]
    if not decoded:
        return None
    matched, mismatch = _matched_reference_index(reference_keys, decoded)
    if mismatch > DEFAULT_MAX_MISMATCH:
        return None
    cuts = []
    for i in range(1, len(segments)):
        reference_index = matched.get(first_word_of[i])
        if reference_index is not None and first_word_of[i] < len(decoded):
            # halfway through the silence between the two segments: neither loses a word's onset or tail
            cuts.append(((segments[i - 1].end_s + segments[i].start_s) / 2, reference_index))
    return cuts


def align_segments(transcript: str, segments: Sequence[TimedText], seconds: float,
                   max_seconds: float = 30.0) -> list[Piece] | None:
    """The pieces of a recording of ``seconds`` (module doc), or None when it cannot be aligned."""
    words = transcript.split()
    kept = [i for i, w in enumerate(words) if _key(w)]  # reference words the alignment sees, by position in words
    cuts = _cut_points(segments, [_key(words[i]) for i in kept])
    if cuts is None:
        return None
    pieces, start_s, start_word = [], 0.0, 0
    while seconds - start_s > max_seconds:
        reachable = [(t, kept[j]) for t, j in cuts if start_s < t <= start_s + max_seconds and kept[j] > start_word]
        if not reachable:
            return None
        cut_s, cut_word = reachable[-1]
        pieces.append(Piece(start_s, cut_s, " ".join(words[start_word:cut_word])))
        start_s, start_word = cut_s, cut_word
    pieces.append(Piece(start_s, seconds, " ".join(words[start_word:])))
    return pieces if all(_has_word(p.text) for p in pieces) else None


def _has_word(text: str) -> bool:
    return any(_key(w) for w in text.split())
