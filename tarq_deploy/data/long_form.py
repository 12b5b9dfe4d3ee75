"""Long recordings (minutes, as users record them) built from held-out utterances, with pauses and stretches of
silence and noise between them, and a map of which words lie where.

Building. Each recording draws a target length uniformly from ``target_seconds`` and a fresh order of all the
utterances given (no utterance twice in one recording; recordings may share utterances), then appends utterances
until the target is reached without passing the maximum; between two utterances lies a *pause* (0.3-1.5 s of
near-silence: white noise at -70 dBFS) or, with probability ``LONG_GAP_PROBABILITY``, a long gap (3-12 s). A recording
may also open (``LEADING_GAP_PROBABILITY``) and close (``TRAILING_GAP_PROBABILITY``) with a long gap, where recognisers
like to invent a closing "thank you". Long gaps are

* ``silence`` -- digital silence (``detail`` "digital") or low-level noise, white at -60 dBFS ("low-noise"): nothing
  a listener would hear;
* ``noise``   -- audible noise, white, pink or babble (time-reversed speech of the utterances given, six talkers), at
  -40..-25 dBFS RMS.

Everything random comes from ``numpy.random.default_rng`` seeded by (seed, recording number): the same utterances,
lengths and seed give the same plans and samples, and recording i does not depend on how many others are made.

Words. The transcript is the utterance texts joined by single spaces, in order. Its words are those WER scoring
sees, Whisper's English normaliser's (data.normalize.normalized_words). Each span says which of them it holds:
``first_word`` and ``n_words`` index the transcript's words; a non-speech span holds none (``n_words`` 0) and its
``first_word`` is the index of the next word (the gap's position: len(words) for a closing gap). The normaliser can
join words across a boundary ("twenty" + "One more" -> "21 more"; "he said..." + "what?" loses the lone "."), so an
utterance is only placed after another when their joined words are their words one after the other.

Files: ``OUT/audio/<id>.wav`` (16 kHz mono 16-bit) and ``OUT/long.jsonl``, one manifest entry per recording that
:func:`tarq_deploy.data.corpus.load_corpus` reads (it takes ``id``, ``audio``, ``text`` and ignores the rest):
``{"id", "audio", "text", "seconds", "words", "spans": [{"kind", "start_s", "end_s", "utterance_id", "first_word",
"n_words", "detail", "level_dbfs"}, ...]}``. :func:`load_long_spans` reads the spans back, strictly.
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Iterable, Iterator, Mapping, Sequence

import numpy as np

from ..fileio import write_bytes_atomic, write_text_atomic
from .corpus import TARGET_SAMPLE_RATE, CorpusError, Utterance
from .nonspeech import babble, digital_silence, pink_noise, white_noise
from .normalize import Normalizer, normalized_words
from .strict_jsonl import FieldReader, jsonl_objects
from .synth import encode_wav_pcm16

__all__ = ["GAP_KINDS", "LONG_MANIFEST", "LongFormError", "LongPlan", "LongRecording", "NOISE", "PAUSE",
           "PAUSE_SECONDS", "Piece", "SILENCE", "SPAN_KINDS", "SPEECH", "Span", "build_long_recordings",
           "load_long_spans", "manifest_spans", "plan_long_recordings", "render_long_recording", "render_long_recordings",
           "write_long_corpus"]

SPEECH, PAUSE, SILENCE, NOISE = "speech", "pause", "silence", "noise"
SPAN_KINDS = (SPEECH, PAUSE, SILENCE, NOISE)
GAP_KINDS = (PAUSE, SILENCE, NOISE)
LONG_MANIFEST = "long.jsonl"

PAUSE_SECONDS = (0.3, 1.5)
PAUSE_LEVEL_DBFS = -70.0
LONG_GAP_SECONDS = (3.0, 12.0)
LONG_GAP_PROBABILITY = 0.2
LEADING_GAP_PROBABILITY = 0.25
TRAILING_GAP_PROBABILITY = 0.5
LOW_NOISE_DBFS = -60.0
LOUD_NOISE_DBFS = (-40.0, -25.0)
# (kind, detail, weight) of a long gap; babble only when there is speech to reverse (always, here: the utterances)
LONG_GAPS = ((SILENCE, "digital", 0.2), (SILENCE, "low-noise", 0.3), (NOISE, "white", 0.15), (NOISE, "pink", 0.15),
             (NOISE, "babble", 0.2))
BABBLE_TALKERS = 6
_SPAN_KEYS = ("kind", "start_s", "end_s", "utterance_id", "first_word", "n_words", "detail", "level_dbfs")
_RECORD_KEYS = ("id", "audio", "text", "seconds", "words", "spans")


class LongFormError(CorpusError):
    """Long recordings cannot be built as asked, or a long-recording manifest is unusable (file and line named)."""


# ------------------------------------------------------------------------------------------------------- plans
@dataclass(frozen=True)
class Span:
    """A stretch of a long recording: speech of one utterance, or a gap of one kind (module doc)."""

    kind: str
    start_s: float
    end_s: float
    utterance_id: str | None
    first_word: int
    n_words: int
    detail: str = ""  # a gap's signal: near-silence, digital, low-noise, white, pink, babble
    level_dbfs: float | None = None  # a gap's RMS level (None: digital silence, or speech as recorded)

    def sample_range(self, sample_rate: int = TARGET_SAMPLE_RATE) -> tuple[int, int]:
        return round(self.start_s * sample_rate), round(self.end_s * sample_rate)

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class Piece:
    """One span's recipe: its kind, length in samples, utterance (speech) or signal and level (gaps), and for babble
    the utterances whose reversed audio it mixes."""

    kind: str
    samples: int
    utterance_id: str | None = None
    detail: str = ""
    level_dbfs: float | None = None
    babble_ids: tuple[str, ...] = ()


@dataclass(frozen=True)
class LongPlan:
    """Which utterances and gaps make a recording, in order; its transcript and spans follow from them."""

    id: str
    pieces: tuple[Piece, ...]
    transcript: str
    spans: tuple[Span, ...]

    @property
    def samples(self) -> int:
        return sum(piece.samples for piece in self.pieces)

    @property
    def seconds(self) -> float:
        return self.samples / TARGET_SAMPLE_RATE

    @property
    def n_words(self) -> int:
        return sum(span.n_words for span in self.spans)


@dataclass(frozen=True)
class LongRecording:
    id: str
    audio: np.ndarray = field(repr=False, compare=False)
    transcript: str = ""
    spans: tuple[Span, ...] = ()

    @property
    def seconds(self) -> float:
        return len(self.audio) / TARGET_SAMPLE_RATE


def plan_long_recordings(utterances: Sequence[Utterance], durations_s: Sequence[float],
                         target_seconds: tuple[float, float], seed: int, n_recordings: int = 1,
                         normalizer: Normalizer | None = None) -> list[LongPlan]:
    """Plans of ``n_recordings`` recordings of ``target_seconds`` (min, max) each (module doc); pure: no audio."""
    _check_plan_request(utterances, durations_s, target_seconds, n_recordings)
    pool = _Pool(utterances, durations_s, normalizer)
    return [_plan_one(pool, target_seconds, np.random.default_rng((seed, index)), f"long-{index:03d}")
            for index in range(n_recordings)]


def _check_plan_request(utterances: Sequence[Utterance], durations_s: Sequence[float],
                        target_seconds: tuple[float, float], n_recordings: int) -> None:
    low, high = target_seconds
    if not (math.isfinite(low) and math.isfinite(high) and 0 < low <= high):
        raise LongFormError(f"recording length range {low}..{high} s: need 0 < minimum <= maximum")
    if n_recordings < 1:
        raise LongFormError(f"asked for {n_recordings} recordings; make at least one")
    if len(durations_s) != len(utterances):
        raise LongFormError(f"{len(durations_s)} durations for {len(utterances)} utterances")
    if not all(math.isfinite(d) and round(d * TARGET_SAMPLE_RATE) > 0 for d in map(float, durations_s)):
        raise LongFormError("every utterance needs audio: a duration is below one sample (or not a number)")
    if len({u.id for u in utterances}) != len(utterances):
        raise LongFormError("utterance ids repeat: each speech span names its utterance by id")


class _Pool:
    """The utterances, their lengths in samples and their normalised words, with a cache of boundary checks."""

    def __init__(self, utterances: Sequence[Utterance], durations_s: Sequence[float],
                 normalizer: Normalizer | None) -> None:
        self.utterances = list(utterances)
        self.samples = [round(float(d) * TARGET_SAMPLE_RATE) for d in durations_s]
        self.normalizer = normalizer
        self.words = [normalized_words(u.text, normalizer) for u in self.utterances]
        self._joins: dict[tuple[int, int], bool] = {}

    def joins(self, before: int | None, after: int) -> bool:
        """Whether ``after``'s words follow ``before``'s unchanged when their texts are joined by a space."""
        if before is None:
            return True
        key = (before, after)
        if key not in self._joins:
            joined = normalized_words(f"{self.utterances[before].text} {self.utterances[after].text}",
                                      self.normalizer)
            self._joins[key] = joined == self.words[before] + self.words[after]
        return self._joins[key]


def _plan_one(pool: _Pool, target_seconds: tuple[float, float], rng: np.random.Generator, recording_id: str
              ) -> LongPlan:
    low, high = (round(s * TARGET_SAMPLE_RATE) for s in target_seconds)
    target = int(rng.integers(low, high + 1))
    pieces: list[Piece] = []
    if rng.random() < LEADING_GAP_PROBABILITY:
        _append_if_fits(pieces, _long_gap(pool, rng), high)
    _append_speech(pieces, pool, rng, target, high)
    if rng.random() < TRAILING_GAP_PROBABILITY:
        _append_if_fits(pieces, _long_gap(pool, rng), high)
    total = sum(piece.samples for piece in pieces)
    if total < low or not any(piece.kind == SPEECH for piece in pieces):
        speech = sum(pool.samples) / TARGET_SAMPLE_RATE
        raise LongFormError(f"{recording_id}: {len(pool.utterances)} utterances ({speech:.1f} s of speech) fill only "
                            f"{total / TARGET_SAMPLE_RATE:.1f} s; the minimum length is {low / TARGET_SAMPLE_RATE:g} "
                            f"s: give more speech, a shorter minimum or a wider range")
    return _finish_plan(recording_id, pieces, pool)


def _append_if_fits(pieces: list[Piece], piece: Piece, limit: int) -> None:
    if sum(p.samples for p in pieces) + piece.samples <= limit:
        pieces.append(piece)


def _append_speech(pieces: list[Piece], pool: _Pool, rng: np.random.Generator, target: int, limit: int) -> None:
    """Utterances in a random order, each after a gap, until ``target`` samples are reached (never past ``limit``).
    One waits for a later turn when it would pass the limit, when its words would merge with the previous one's, or
    when no other could follow it (a transcript ending "..." keeps its lone "." only at the very end) unless it
    completes the recording."""
    waiting = [int(i) for i in rng.permutation(len(pool.utterances))]
    total = sum(p.samples for p in pieces)
    last: int | None = None
    while total < target and waiting:
        gap = _between_gap(pool, rng) if last is not None else None
        chosen = _next_utterance(pool, last, waiting, total + (gap.samples if gap else 0), target, limit)
        if chosen is None and gap is not None and gap.kind != PAUSE:  # a pause may leave room where a long gap did not
            gap = _pause(rng)
            chosen = _next_utterance(pool, last, waiting, total + gap.samples, target, limit)
        if chosen is None:
            break
        waiting.remove(chosen)
        pieces.extend([gap] if gap else [])
        pieces.append(Piece(SPEECH, pool.samples[chosen], pool.utterances[chosen].id))
        total += pool.samples[chosen] + (gap.samples if gap else 0)
        last = chosen


def _next_utterance(pool: _Pool, last: int | None, waiting: list[int], used: int, target: int, limit: int
                    ) -> int | None:
    return next((i for i in waiting if _may_come_next(pool, last, i, waiting, used, target, limit)), None)


def _may_come_next(pool: _Pool, last: int | None, candidate: int, waiting: list[int], used: int, target: int,
                   limit: int) -> bool:
    end = used + pool.samples[candidate]
    if end > limit or not pool.joins(last, candidate):
        return False
    return end >= target or any(pool.joins(candidate, j) for j in waiting if j != candidate)


def _between_gap(pool: _Pool, rng: np.random.Generator) -> Piece:
    return _long_gap(pool, rng) if rng.random() < LONG_GAP_PROBABILITY else _pause(rng)


def _pause(rng: np.random.Generator) -> Piece:
    return Piece(PAUSE, _draw_samples(rng, PAUSE_SECONDS), detail="near-silence", level_dbfs=PAUSE_LEVEL_DBFS)


def _draw_samples(rng: np.random.Generator, seconds: tuple[float, float]) -> int:
    return round(float(rng.uniform(*seconds)) * TARGET_SAMPLE_RATE)


def _long_gap(pool: _Pool, rng: np.random.Generator) -> Piece:
    weights = np.array([weight for _, _, weight in LONG_GAPS])
    kind, detail, _ = LONG_GAPS[int(rng.choice(len(LONG_GAPS), p=weights / weights.sum()))]
    samples = _draw_samples(rng, LONG_GAP_SECONDS)
    if detail == "digital":
        return Piece(kind, samples, detail=detail)
    if detail == "low-noise":
        return Piece(kind, samples, detail=detail, level_dbfs=LOW_NOISE_DBFS)
    level = round(float(rng.uniform(*LOUD_NOISE_DBFS)), 2)
    talkers = ()
    if detail == "babble":
        chosen = rng.choice(len(pool.utterances), size=min(BABBLE_TALKERS, len(pool.utterances)), replace=False)
        talkers = tuple(pool.utterances[int(i)].id for i in sorted(chosen))
    return Piece(kind, samples, detail=detail, level_dbfs=level, babble_ids=talkers)


def _finish_plan(recording_id: str, pieces: list[Piece], pool: _Pool) -> LongPlan:
    by_id = {u.id: i for i, u in enumerate(pool.utterances)}
    spans, texts, words, start = [], [], 0, 0
    for piece in pieces:
        n_words = len(pool.words[by_id[piece.utterance_id]]) if piece.kind == SPEECH else 0
        end = start + piece.samples
        spans.append(Span(piece.kind, start / TARGET_SAMPLE_RATE, end / TARGET_SAMPLE_RATE, piece.utterance_id,
                          words, n_words, piece.detail, piece.level_dbfs))
        if piece.kind == SPEECH:
            texts.append(pool.utterances[by_id[piece.utterance_id]].text)
        words, start = words + n_words, end
    transcript = " ".join(texts)
    _check_words(recording_id, transcript, pieces, pool, by_id)
    return LongPlan(recording_id, tuple(pieces), transcript, tuple(spans))


def _check_words(recording_id: str, transcript: str, pieces: list[Piece], pool: _Pool, by_id: dict[str, int]) -> None:
    """The spans index the transcript's own words only if normalising the whole of it gives the utterances' words
    in turn; neighbours are checked while planning, this catches an effect that reaches further."""
    expected = [w for p in pieces if p.kind == SPEECH for w in pool.words[by_id[p.utterance_id]]]
    if normalized_words(transcript, pool.normalizer) != expected:
        raise LongFormError(f"{recording_id}: the normaliser changes words across utterance boundaries in this "
                            f"transcript, so its spans could not index its words; try another seed")


# ----------------------------------------------------------------------------------------------------- rendering
def render_long_recording(plan: LongPlan, audios: Mapping[str, np.ndarray], seed: int) -> np.ndarray:
    """The recording's float32 samples: each utterance's own samples, each gap's signal drawn from
    ``default_rng(seed)`` in order. ``audios`` maps utterance id -> 16 kHz samples (the plan's and babble's)."""
    rng = np.random.default_rng(seed)
    parts = [_render_piece(plan.id, piece, audios, rng) for piece in plan.pieces]
    return np.concatenate(parts).astype(np.float32, copy=False) if parts else np.zeros(0, np.float32)


def _render_piece(recording_id: str, piece: Piece, audios: Mapping[str, np.ndarray],
                  rng: np.random.Generator) -> np.ndarray:
    if piece.kind == SPEECH:
        audio = np.asarray(_audio_of(recording_id, piece.utterance_id, audios), dtype=np.float32)
        if len(audio) != piece.samples:
            raise LongFormError(f"{recording_id}: utterance {piece.utterance_id!r} has {len(audio)} samples, the plan "
                                f"counted {piece.samples} (its duration)")
        return audio
    if piece.detail == "digital":
        return digital_silence(piece.samples)
    assert piece.level_dbfs is not None  # every gap but digital silence has a level
    if piece.detail == "pink":
        return pink_noise(piece.samples, piece.level_dbfs, rng)
    if piece.detail == "babble":
        sources = [_audio_of(recording_id, talker, audios) for talker in piece.babble_ids]
        return babble(sources, piece.samples, piece.level_dbfs, rng)
    return white_noise(piece.samples, piece.level_dbfs, rng)  # near-silence, low-noise, white


def _audio_of(recording_id: str, utterance_id: str | None, audios: Mapping[str, np.ndarray]) -> np.ndarray:
    if utterance_id not in audios:
        raise LongFormError(f"{recording_id}: no audio given for utterance {utterance_id!r}")
    return audios[utterance_id]


def render_long_recordings(plans: Sequence[LongPlan], audios: Mapping[str, np.ndarray], seed: int
                           ) -> Iterator[LongRecording]:
    """The recordings of ``plans`` one at a time (a 10-minute recording is 38 MB of float32: a writer that takes
    them in turn holds one); plan i's gaps are drawn from a seed derived from (seed, i)."""
    for index, plan in enumerate(plans):
        render_seed = int(np.random.SeedSequence((seed, index, 1)).generate_state(1)[0])
        yield LongRecording(plan.id, render_long_recording(plan, audios, render_seed), plan.transcript, plan.spans)


def build_long_recordings(utterances: Sequence[Utterance], audios: Sequence[np.ndarray],
                          target_seconds: tuple[float, float], seed: int, n_recordings: int = 1,
                          normalizer: Normalizer | None = None) -> list[LongRecording]:
    """Plan and render ``n_recordings``; ``audios[i]`` is ``utterances[i]``'s 16 kHz samples."""
    durations = [len(audio) / TARGET_SAMPLE_RATE for audio in audios]
    plans = plan_long_recordings(utterances, durations, target_seconds, seed, n_recordings, normalizer)
    return list(render_long_recordings(plans, {u.id: audio for u, audio in zip(utterances, audios)}, seed))


# --------------------------------------------------------------------------------------------------------- files
def write_long_corpus(out_dir: str | os.PathLike[str], recordings: Iterable[LongRecording]) -> Path:
    """OUT/audio/<id>.wav for every recording (taken one at a time), then OUT/long.jsonl (last: it names only
    finished files)."""
    out = Path(out_dir)
    lines = []
    for recording in recordings:
        write_bytes_atomic(out / "audio" / f"{recording.id}.wav", encode_wav_pcm16(recording.audio))
        record = {"id": recording.id, "audio": f"audio/{recording.id}.wav", "text": recording.transcript,
                  "seconds": recording.seconds, "words": sum(s.n_words for s in recording.spans),
                  "spans": [span.as_dict() for span in recording.spans]}
        lines.append(json.dumps(record, ensure_ascii=False) + "\n")
    return write_text_atomic(out / LONG_MANIFEST, "".join(lines))


def load_long_spans(manifest_path: str | os.PathLike[str], normalizer: Normalizer | None = None,
                    check_words: bool = True) -> dict[str, list[Span]]:
    """Recording id -> its spans, from a long.jsonl, strictly: the spans must tile the recording from 0 to its
    ``seconds`` and its words from 0 to its ``words`` (speech spans hold words, gaps none), and with ``check_words``
    the transcript must normalise to that many words. Problems raise LongFormError naming the file and line."""
    manifest = Path(manifest_path)
    spans_by_id: dict[str, list[Span]] = {}
    for line_number, record in jsonl_objects(manifest, LongFormError):
        fields = FieldReader(record, f"{manifest}:{line_number}", LongFormError)
        recording_id, spans = _read_record(fields, normalizer, check_words)
        if recording_id in spans_by_id:
            raise fields.fail(f"duplicate recording id {recording_id!r}")
        spans_by_id[recording_id] = spans
    return spans_by_id


def _read_record(fields: FieldReader, normalizer: Normalizer | None, check_words: bool) -> tuple[str, list[Span]]:
    fields.only_keys(_RECORD_KEYS)
    recording_id, text = fields.string("id"), fields.string("text")
    fields.string("audio")
    seconds, words = fields.number("seconds"), fields.integer("words")
    spans = [_read_span(fields, index, value) for index, value in enumerate(fields.array("spans"))]
    _check_tiling(fields, spans, seconds, words)
    if check_words:
        found = len(normalized_words(text, normalizer))
        if found != words:
            raise fields.fail(f"its transcript has {found} words after normalisation, the spans index {words}")
    return recording_id, spans


def _read_span(fields: FieldReader, index: int, value: object) -> Span:
    where = f"{fields.where}, span {index}"
    if not isinstance(value, dict):
        raise fields.error(f"{where}: not a JSON object")
    span = FieldReader(value, where, fields.error)
    span.only_keys(_SPAN_KEYS)
    kind = span.string("kind")
    if kind not in SPAN_KINDS:
        raise span.fail(f"unknown kind {kind!r} (known: {', '.join(SPAN_KINDS)})")
    utterance_id = span.optional_string("utterance_id")
    if (utterance_id is None) == (kind == SPEECH):
        raise span.fail("a speech span names its utterance, a gap none")
    return Span(kind, span.number("start_s"), span.number("end_s"), utterance_id, span.integer("first_word"),
                span.integer("n_words"), span.string("detail", empty=True), span.optional_number("level_dbfs"))


def _check_tiling(fields: FieldReader, spans: list[Span], seconds: float, words: int) -> None:
    time, word = 0.0, 0
    for index, span in enumerate(spans):
        where = f"span {index}"
        if span.start_s != time or span.end_s <= span.start_s:
            raise fields.fail(f"{where} runs {span.start_s}..{span.end_s} s; it must start where the last ended "
                              f"({time} s) and end after it starts")
        if span.first_word != word or (span.n_words > 0) != (span.kind == SPEECH):
            raise fields.fail(f"{where} holds words {span.first_word}+{span.n_words}; it must start at word {word}, "
                              f"and only speech holds words")
        time, word = span.end_s, word + span.n_words
    if time != seconds or word != words:
        raise fields.fail(f"the spans cover {time} s and {word} words; the recording has {seconds} s and {words} words")


def manifest_spans(path: Path, ids: set[str]) -> dict[str, tuple[Span, ...]]:
    """The spans of a long-recording manifest's entries among ``ids`` (``corpus long`` writes them), or {} for any
    other manifest (a folder, a JSONL without spans)."""
    if not (path.is_file() and path.suffix == ".jsonl"):
        return {}
    with open(path, encoding="utf-8") as f:
        first = f.readline()
    if '"spans"' not in first:
        return {}
    return {uid: tuple(spans) for uid, spans in load_long_spans(path).items() if uid in ids}
