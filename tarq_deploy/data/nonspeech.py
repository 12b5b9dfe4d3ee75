"""Clips without speech, to count the words a recogniser invents where nobody speaks.

Kinds (``NONSPEECH_KINDS``) and their default levels (RMS, dBFS; ``DEFAULT_LEVELS_DBFS``):

* ``silence``   -- digital silence: every sample exactly 0;
* ``low-noise`` -- white noise at -60 dBFS: the hiss of a quiet room or a cheap microphone;
* ``white``     -- white noise (flat spectrum);
* ``pink``      -- pink noise (power falls as 1/f: white noise shaped in the FFT domain);
* ``babble``    -- several overlapped *time-reversed* speech recordings: speech's spectrum and rhythm, no words
  (the speech is given as arrays: :func:`babble`);
* ``music``     -- a synthetic tune: notes (harmonics 1-5 of a pentatonic pitch under a plucked envelope) over a
  simple beat (a decaying 60 Hz kick on every beat, a noise hi-hat between beats).

Every clip is float32 in [-1, 1] and never clips: a signal whose peak would pass ``PEAK_LIMIT`` at the asked level is
scaled down to it (its measured level is what the manifest records). The same kind, length and seed give the same
samples; each clip draws from ``numpy.random.default_rng((seed, kind number, clip number))``, so leaving a kind out
changes no other clip.

Files: :func:`write_nonspeech_corpus` writes ``OUT/audio/<id>.wav`` (16 kHz mono 16-bit) and ``OUT/nonspeech.jsonl``,
one line per clip: ``{"id", "audio", "text": "", "kind", "seconds", "level_dbfs"}`` (audio relative to OUT;
level_dbfs null for digital silence). The corpus manifest reader refuses an empty transcript, so these files have
their own reader, :func:`load_nonspeech_manifest`, strict about every field.
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import numpy as np

from ..fileio import write_bytes_atomic, write_text_atomic
from .corpus import TARGET_SAMPLE_RATE, CorpusError, load_audio
from .strict_jsonl import FieldReader, jsonl_objects
from .synth import encode_wav_pcm16

__all__ = ["DEFAULT_LEVELS_DBFS", "NONSPEECH_KINDS", "NONSPEECH_MANIFEST", "NonspeechClip", "NonspeechEntry",
           "NonspeechError", "PEAK_LIMIT", "at_level", "babble", "build_nonspeech_clips", "digital_silence",
           "load_nonspeech_manifest", "make_clip", "music_like", "pink_noise", "rms_dbfs", "white_noise",
           "write_nonspeech_corpus"]

NONSPEECH_KINDS = ("silence", "low-noise", "white", "pink", "babble", "music")
DEFAULT_LEVELS_DBFS: dict[str, float | None] = {"silence": None, "low-noise": -60.0, "white": -35.0, "pink": -35.0,
                                                 "babble": -30.0, "music": -25.0}
PEAK_LIMIT = 0.99  # below 1.0, so the 16-bit encoder never clips a peak either
NONSPEECH_MANIFEST = "nonspeech.jsonl"
BABBLE_TALKERS = 6
PINK_FLOOR_HZ = 20.0  # below this pink noise stays flat: 1/f would put most of its power below hearing
_MANIFEST_KEYS = ("id", "audio", "text", "kind", "seconds", "level_dbfs")


class NonspeechError(CorpusError):
    """A non-speech clip request or manifest entry is unusable; the message names the file and line or the kind."""


# ------------------------------------------------------------------------------------------------------ signals
def rms_dbfs(samples: np.ndarray) -> float:
    """RMS level in dB relative to full scale (a full-scale sine is -3 dBFS); -inf for silence."""
    rms = math.sqrt(float(np.mean(np.square(samples, dtype=np.float64)))) if len(samples) else 0.0
    return 20.0 * math.log10(rms) if rms > 0 else -math.inf


def at_level(samples: np.ndarray, level_dbfs: float) -> np.ndarray:
    """``samples`` scaled to an RMS of ``level_dbfs``, then down to PEAK_LIMIT if a peak would pass it; float32."""
    signal = np.asarray(samples, dtype=np.float64)
    rms = math.sqrt(float(np.mean(np.square(signal)))) if len(signal) else 0.0
    if rms == 0.0:
        return np.zeros(len(signal), dtype=np.float32)
    scaled = signal * (10.0 ** (level_dbfs / 20.0) / rms)
    peak = float(np.max(np.abs(scaled)))
    if peak > PEAK_LIMIT:
        scaled *= PEAK_LIMIT / peak
    return scaled.astype(np.float32)


def digital_silence(n_samples: int) -> np.ndarray:
    return np.zeros(n_samples, dtype=np.float32)


def white_noise(n_samples: int, level_dbfs: float, rng: np.random.Generator) -> np.ndarray:
    return at_level(rng.standard_normal(n_samples), level_dbfs)


def pink_noise(n_samples: int, level_dbfs: float, rng: np.random.Generator,
               sample_rate: int = TARGET_SAMPLE_RATE) -> np.ndarray:
    """White noise with its amplitude spectrum scaled by 1/sqrt(f) (power 1/f), flat below PINK_FLOOR_HZ, no DC."""
    spectrum = np.fft.rfft(rng.standard_normal(n_samples))
    frequencies = np.fft.rfftfreq(n_samples, 1.0 / sample_rate)
    gain = 1.0 / np.sqrt(np.maximum(frequencies, PINK_FLOOR_HZ))
    gain[0] = 0.0
    return at_level(np.fft.irfft(spectrum * gain, n=n_samples), level_dbfs)


def babble(sources: Sequence[np.ndarray], n_samples: int, level_dbfs: float, rng: np.random.Generator,
           talkers: int = BABBLE_TALKERS) -> np.ndarray:
    """``talkers`` streams of time-reversed ``sources`` (each a random order, from a random offset), summed: it sounds
    like a crowd, and reversed speech holds no word a recogniser could rightly write."""
    usable = [np.asarray(s, dtype=np.float64)[::-1] for s in sources if len(s)]
    if not usable:
        raise NonspeechError("babble needs at least one speech recording to reverse")
    mix = np.zeros(n_samples, dtype=np.float64)
    for _ in range(talkers):
        mix += _reversed_stream(usable, n_samples, rng)
    return at_level(mix, level_dbfs)


def _reversed_stream(reversed_sources: list[np.ndarray], n_samples: int, rng: np.random.Generator) -> np.ndarray:
    pieces: list[np.ndarray] = []
    held = 0
    while held < n_samples + 1:  # one sample more than needed, so the random offset below always has room
        piece = reversed_sources[int(rng.integers(len(reversed_sources)))]
        pieces.append(piece)
        held += len(piece)
    stream = np.concatenate(pieces)
    offset = int(rng.integers(0, len(stream) - n_samples))
    return stream[offset: offset + n_samples]


_PENTATONIC_SEMITONES = (0, 2, 4, 7, 9, 12, 14, 16, 19, 21, 24)  # A major pentatonic over two octaves
_TUNE_ROOT_HZ = 220.0
_BEAT_SECONDS = 0.5  # 120 beats a minute


def music_like(n_samples: int, level_dbfs: float, rng: np.random.Generator,
               sample_rate: int = TARGET_SAMPLE_RATE) -> np.ndarray:
    """A tune of random pentatonic notes (quarter and half beats) over a kick-and-hi-hat beat."""
    mix = _melody(n_samples, rng, sample_rate) + 0.8 * _kicks(n_samples, sample_rate)
    mix += 0.15 * _hi_hats(n_samples, rng, sample_rate)
    return at_level(mix, level_dbfs)


def _melody(n_samples: int, rng: np.random.Generator, sample_rate: int) -> np.ndarray:
    melody = np.zeros(n_samples, dtype=np.float64)
    position = 0
    while position < n_samples:
        length = int(sample_rate * _BEAT_SECONDS * rng.choice((0.5, 1.0)))
        pitch = _TUNE_ROOT_HZ * 2.0 ** (int(rng.choice(_PENTATONIC_SEMITONES)) / 12.0)
        note = _note(pitch, min(length, n_samples - position), sample_rate)
        melody[position: position + len(note)] += note
        position += length
    return melody


def _note(pitch_hz: float, n_samples: int, sample_rate: int) -> np.ndarray:
    t = np.arange(n_samples) / sample_rate
    envelope = (1.0 - np.exp(-t / 0.01)) * np.exp(-t / 0.3)  # a 10 ms attack, then a plucked decay
    harmonics = sum(np.sin(2 * np.pi * k * pitch_hz * t) / k for k in range(1, 6))
    return envelope * harmonics


def _kicks(n_samples: int, sample_rate: int) -> np.ndarray:
    t = np.arange(int(0.2 * sample_rate)) / sample_rate
    kick = np.sin(2 * np.pi * 60.0 * t) * np.exp(-t / 0.08)
    return _on_beats(kick, n_samples, sample_rate, offset_beats=0.0)


def _hi_hats(n_samples: int, rng: np.random.Generator, sample_rate: int) -> np.ndarray:
    t = np.arange(int(0.05 * sample_rate)) / sample_rate
    hat = rng.standard_normal(len(t)) * np.exp(-t / 0.01)
    return _on_beats(hat, n_samples, sample_rate, offset_beats=0.5)


def _on_beats(sound: np.ndarray, n_samples: int, sample_rate: int, offset_beats: float) -> np.ndarray:
    track = np.zeros(n_samples, dtype=np.float64)
    beat = int(_BEAT_SECONDS * sample_rate)
    for start in range(int(offset_beats * beat), n_samples, beat):
        piece = sound[: n_samples - start]
        track[start: start + len(piece)] += piece
    return track


def make_clip(kind: str, n_samples: int, rng: np.random.Generator, level_dbfs: float | None = None,
              babble_sources: Sequence[np.ndarray] = ()) -> np.ndarray:
    """``n_samples`` of one kind at ``level_dbfs`` (the kind's default when None; digital silence has none)."""
    if kind not in NONSPEECH_KINDS:
        raise NonspeechError(f"unknown non-speech kind {kind!r} (known: {', '.join(NONSPEECH_KINDS)})")
    level = DEFAULT_LEVELS_DBFS[kind] if level_dbfs is None else level_dbfs
    if kind == "silence":
        return digital_silence(n_samples)
    assert level is not None  # only silence has no default level
    if kind in ("low-noise", "white"):
        return white_noise(n_samples, level, rng)
    if kind == "pink":
        return pink_noise(n_samples, level, rng)
    if kind == "babble":
        return babble(babble_sources, n_samples, level, rng)
    return music_like(n_samples, level, rng)


# -------------------------------------------------------------------------------------------------------- clips
@dataclass(frozen=True)
class NonspeechClip:
    """One clip: its id, kind, length, measured level (None for digital silence) and samples."""

    id: str
    kind: str
    seconds: float
    level_dbfs: float | None
    audio: np.ndarray = field(repr=False, compare=False)


def build_nonspeech_clips(seconds: float, seed: int, per_kind: int = 1, kinds: Sequence[str] = NONSPEECH_KINDS,
                          babble_sources: Sequence[np.ndarray] = ()) -> list[NonspeechClip]:
    """``per_kind`` clips of ``seconds`` for each kind, ids ``<kind>-<nn>``; babble needs ``babble_sources``."""
    _check_request(seconds, per_kind, kinds, babble_sources)
    n_samples = round(seconds * TARGET_SAMPLE_RATE)
    clips = []
    for kind in kinds:
        for number in range(per_kind):
            rng = np.random.default_rng((seed, NONSPEECH_KINDS.index(kind), number))
            audio = make_clip(kind, n_samples, rng, babble_sources=babble_sources)
            level = rms_dbfs(audio)
            clips.append(NonspeechClip(f"{kind}-{number:02d}", kind, n_samples / TARGET_SAMPLE_RATE,
                                       round(level, 2) if math.isfinite(level) else None, audio))
    return clips


def _check_request(seconds: float, per_kind: int, kinds: Sequence[str], babble_sources: Sequence[np.ndarray]) -> None:
    unknown = [kind for kind in kinds if kind not in NONSPEECH_KINDS]
    if unknown:
        raise NonspeechError(f"unknown non-speech kind(s) {', '.join(unknown)} (known: {', '.join(NONSPEECH_KINDS)})")
    if not (math.isfinite(seconds) and round(seconds * TARGET_SAMPLE_RATE) >= 1) or per_kind < 1:
        raise NonspeechError(f"clips need a positive length and count (got {seconds} s, {per_kind} per kind)")
    if "babble" in kinds and not any(len(s) for s in babble_sources):
        raise NonspeechError("babble needs speech to reverse: give speech recordings or leave babble out")


def write_nonspeech_corpus(out_dir: str | os.PathLike[str], clips: Sequence[NonspeechClip]) -> Path:
    """OUT/audio/<id>.wav for every clip, then OUT/nonspeech.jsonl (written last, so it names only finished files)."""
    out = Path(out_dir)
    lines = []
    for clip in clips:
        write_bytes_atomic(out / "audio" / f"{clip.id}.wav", encode_wav_pcm16(clip.audio))
        lines.append(_manifest_line(clip))
    return write_text_atomic(out / NONSPEECH_MANIFEST, "".join(lines))


def _manifest_line(clip: NonspeechClip) -> str:
    record = {"id": clip.id, "audio": f"audio/{clip.id}.wav", "text": "", "kind": clip.kind, "seconds": clip.seconds,
              "level_dbfs": clip.level_dbfs}
    return json.dumps(record, ensure_ascii=False) + "\n"


# ------------------------------------------------------------------------------------------------------- reading
@dataclass(frozen=True)
class NonspeechEntry:
    """One line of a non-speech manifest; ``audio`` is resolved against the manifest's folder."""

    id: str
    audio: str
    kind: str
    seconds: float
    level_dbfs: float | None
    origin: str = field(default="", compare=False)


def load_nonspeech_manifest(path: str | os.PathLike[str], decode: bool = False) -> list[NonspeechEntry]:
    """Every entry of a nonspeech.jsonl, strictly: known fields only, each of its type, an empty transcript, a known
    kind, a positive length, unique ids and an existing audio file; ``decode=True`` also decodes each file and checks
    its length. Problems raise NonspeechError naming the file and line."""
    manifest = Path(path)
    entries: list[NonspeechEntry] = []
    seen: set[str] = set()
    for line_number, record in jsonl_objects(manifest, NonspeechError):
        entry = _entry(FieldReader(record, f"{manifest}:{line_number}", NonspeechError), manifest.parent)
        if entry.id in seen:
            raise NonspeechError(f"{entry.origin}: duplicate clip id {entry.id!r}")
        seen.add(entry.id)
        _check_audio(entry, decode)
        entries.append(entry)
    return entries


def _entry(fields: FieldReader, base: Path) -> NonspeechEntry:
    fields.only_keys(_MANIFEST_KEYS)
    clip_id, audio = fields.string("id"), fields.string("audio")
    if fields.string("text", empty=True).strip():
        raise fields.fail("a non-speech clip has an empty transcript (field 'text' must be \"\")")
    kind = fields.string("kind")
    if kind not in NONSPEECH_KINDS:
        raise fields.fail(f"unknown kind {kind!r} (known: {', '.join(NONSPEECH_KINDS)})")
    seconds = fields.number("seconds")
    if seconds <= 0:
        raise fields.fail(f"field 'seconds' must be positive, not {seconds}")
    level = fields.optional_number("level_dbfs")
    if level is not None and level > 0:
        raise fields.fail(f"field 'level_dbfs' is a level below full scale (<= 0), not {level}")
    resolved = audio if os.path.isabs(audio) else str(base / audio)
    return NonspeechEntry(clip_id, resolved, kind, seconds, level, origin=fields.where)


def _check_audio(entry: NonspeechEntry, decode: bool) -> None:
    try:
        exists = Path(entry.audio).is_file()
    except (OSError, ValueError) as error:  # a name too long for the file system, a NUL byte
        raise NonspeechError(f"{entry.origin}: unusable audio path ({error})") from None
    if not exists:
        raise NonspeechError(f"{entry.origin}: audio file {entry.audio} does not exist")
    if decode:
        try:
            samples = len(load_audio(entry.audio))
        except CorpusError as error:
            raise NonspeechError(f"{entry.origin}: {error}") from None
        if abs(samples - entry.seconds * TARGET_SAMPLE_RATE) > 1:
            raise NonspeechError(f"{entry.origin}: audio file {entry.audio} holds {samples / TARGET_SAMPLE_RATE:.3f} "
                                 f"s, the manifest says {entry.seconds} s")
