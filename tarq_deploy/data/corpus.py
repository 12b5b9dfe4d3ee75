"""Calibration and evaluation corpora: loading, audio decoding, validation, selection and rare-biased pools.

Sources: a JSONL manifest (``{"id", "audio", "text"}`` per line, audio relative to the manifest's folder
allowed; NeMo's spelling ``{"audio_filepath", "text", "offset", "duration"}`` too: an entry is then the stretch of its
file from ``offset`` for ``duration`` seconds, and its id, when absent, is the file's path and offset; an optional
``language`` -- or NeMo's ``lang`` -- names the transcript's language), a Kaldi / ESPnet data folder (``wav.scp``,
``text``, optional ``segments``: :func:`load_kaldi_dir`), a LibriSpeech-layout folder (``speaker/chapter/*.flac`` +
``*.trans.txt``), or a Hugging Face ``datasets`` folder written by ``save_to_disk`` (``datasets`` is imported only
then).

Audio: WAV (PCM 8/16/24/32-bit, float 32/64, any rate and channel count, WAVE_FORMAT_EXTENSIBLE), FLAC and
OGG through ``soundfile``, MP3 through ``soundfile`` (libsndfile >= 1.1) or ``ffmpeg``, and headerless
little-endian 16-bit ``.raw`` (16 kHz mono unless told) -- all to 16 kHz mono float32.  Decoding functions take
bytes and return arrays; only :func:`load_audio` touches the file system.

Every problem with an entry (missing file, unreadable audio, a transcript with no word) raises :class:`CorpusError`
naming the entry id, where it was read (manifest path and line), its file and the problem.
"""
from __future__ import annotations

import io
import json
import math
import os
import re
import shutil
import stat
import struct
import subprocess
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Iterable, Iterator, Mapping, Sequence

import numpy as np

from tarq_deploy.errors import JSON_ERRORS
from tarq_deploy.fileio import write_text_atomic
from tarq_deploy.data.normalize import spoken_words
from tarq_deploy.data.rarity import DEFAULT_ZIPF_THRESHOLD, NumeralPolicy, count_rare_words

__all__ = ["AudioDecodeError", "CorpusError", "POOLS", "TARGET_SAMPLE_RATE", "Utterance", "corpus_statistics",
           "corpus_kind", "decode_wav", "encode_wav_float32", "load_audio", "load_corpus", "load_kaldi_dir",
           "refuse_longer_than", "select_pool", "to_mono_16k", "write_manifest"]

TARGET_SAMPLE_RATE = 16_000
DEFAULT_CALIBRATION_SIZE = 128
# Sample rates decoded audio may have: telephone-band and below up to the highest studio rate. Outside it a header is
# corrupt, and resampling would multiply the samples (1 Hz -> 16 kHz: 16000 times) or build a huge filter.
MIN_SAMPLE_RATE, MAX_SAMPLE_RATE = 1_000, 768_000
# Polyphase resampling builds a filter of ~20 * max(up, down) taps: every common rate needs up, down <= 441
# (44.1 kHz -> 16 kHz is 160 / 441); an odd rate (767 999 Hz: 16000 / 767999) would take seconds and 100 MB, so it
# goes to the FFT resampler, whose cost does not depend on the ratio.
MAX_POLYPHASE_FACTOR = 1_000


class CorpusError(ValueError):
    """A corpus entry or corpus source is unusable; the message names the entry id and file."""


class AudioDecodeError(ValueError):
    """Bytes that are not decodable audio of the claimed format (no file context; see CorpusError)."""


@dataclass(frozen=True)
class Utterance:
    """One corpus entry.  ``audio`` is a file path; ``audio_bytes`` holds the encoded file when it has none."""

    id: str
    audio: str
    text: str
    dataset: str = ""
    audio_bytes: bytes | None = field(default=None, repr=False, compare=False)
    origin: str = field(default="", compare=False)  # where it was read ("calib.jsonl:3"), for error messages
    offset: float = 0.0  # seconds into the file where the entry starts (a NeMo manifest's "offset")
    duration: float | None = None  # seconds of the file from offset; None: to its end
    language: str = ""  # the transcript's language (a manifest's "language" or NeMo's "lang"); "": not said


def _entry_error(utterance_id: str, audio: str, problem: str, origin: str = "") -> CorpusError:
    where = f"{origin}, " if origin else ""
    return CorpusError(f"corpus entry {utterance_id!r} ({where}file {audio or '<in memory>'}): {problem}")


def _utterance_error(utterance: Utterance, problem: str) -> CorpusError:
    return _entry_error(utterance.id, utterance.audio, problem, utterance.origin)


def refuse_longer_than(utterances: list[Utterance], audios: list[np.ndarray], max_seconds: float, what: str) -> None:
    """CorpusError naming the first utterance longer than ``max_seconds``: Whisper's feature extractor keeps the
    first 30 s and drops the rest, while the transcript stays whole, so such an entry would be calibrated (or scored)
    against words its audio no longer holds -- silently. ``what`` says who needs the limit."""
    for utterance, audio in zip(utterances, audios):
        seconds = len(audio) / TARGET_SAMPLE_RATE
        if seconds > max_seconds:
            raise _utterance_error(utterance, f"is {seconds:.1f} s long; {what} takes at most {max_seconds:g} s "
                                              f"(the rest would be cut while its whole transcript is kept): split it "
                                              f"into segments of at most {max_seconds:g} s, each with its own "
                                              f"transcript, or leave it out")


# -------------------------------------------------------------------------------------------- audio decoding


@dataclass(frozen=True)
class _WavFormat:
    tag: int
    channels: int
    sample_rate: int
    bits: int


_WAVE_FORMAT_PCM, _WAVE_FORMAT_FLOAT, _WAVE_FORMAT_EXTENSIBLE = 1, 3, 0xFFFE


# The sizes a streaming writer leaves in a header it could not seek back to patch (it wrote to a pipe): 0, sox's
# "unspecified length" 0x7FFFF000 and ffmpeg's 0xFFFFFFFF. A data chunk of one of these sizes runs to the end of the
# file; any other size past the end of the file means the file was cut short, and is refused.
_STREAMED_SIZES = frozenset({0, 0x7FFFF000, 0xFFFFFFFF})
_CHUNK_HEADER_BYTES = 8  # four-letter id, uint32 size
# (format tag, bits per sample) of the encodings _pcm_to_float decodes
_DECODABLE = frozenset({(_WAVE_FORMAT_PCM, 8), (_WAVE_FORMAT_PCM, 16), (_WAVE_FORMAT_PCM, 24),
                        (_WAVE_FORMAT_PCM, 32), (_WAVE_FORMAT_FLOAT, 32), (_WAVE_FORMAT_FLOAT, 64)})


@dataclass(frozen=True)
class _Chunk:
    id: bytes
    body: bytes
    streamed: bool  # a data chunk whose size is a streaming placeholder: its body is the rest of the file


def _wav_chunks(data: bytes) -> Iterable[_Chunk]:
    """The chunks after the RIFF header; a chunk whose size runs past the end of the file is a truncation (a
    streamed data chunk excepted). Sizes are only compared, never allocated."""
    position = 12
    while position + _CHUNK_HEADER_BYTES <= len(data):
        chunk_id, size = data[position: position + 4], struct.unpack_from("<I", data, position + 4)[0]
        body_start = position + _CHUNK_HEADER_BYTES
        streamed = chunk_id == b"data" and size in _STREAMED_SIZES
        if not streamed and body_start + size > len(data):
            raise AudioDecodeError(f"WAV file is truncated: its {chunk_id.decode('latin-1')!r} chunk declares {size} "
                                   f"bytes, the file holds {len(data) - body_start} after its header")
        body_end = len(data) if streamed else body_start + size
        yield _Chunk(chunk_id, data[body_start:body_end], streamed)
        position = body_end + (size & 1)  # chunks are word-aligned


def _check_riff_size(data: bytes, data_chunk_streamed: bool) -> None:
    """The RIFF size (the file's length less 8) may not claim more than the file holds: a placeholder is accepted as
    for the data chunk, and so is any size when the data chunk is streamed (a writer that could not patch one could
    not patch the other; sox writes its placeholder plus the header size there)."""
    declared = struct.unpack_from("<I", data, 4)[0]
    if declared in _STREAMED_SIZES or data_chunk_streamed or declared + 8 <= len(data):
        return
    raise AudioDecodeError(f"WAV file is truncated: its RIFF header declares {declared + 8} bytes, the file holds "
                           f"{len(data)}")


def _parse_fmt(body: bytes) -> _WavFormat:
    if len(body) < 16:
        raise AudioDecodeError("WAV fmt chunk is truncated")
    tag, channels, rate, _, _, bits = struct.unpack_from("<HHIIHH", body)
    if tag == _WAVE_FORMAT_EXTENSIBLE:
        if len(body) < 26:
            raise AudioDecodeError("WAVE_FORMAT_EXTENSIBLE fmt chunk is truncated")
        tag = struct.unpack_from("<H", body, 24)[0]  # first two bytes of the sub-format GUID
    if channels < 1 or rate < 1:
        raise AudioDecodeError(f"WAV header declares {channels} channels at {rate} Hz")
    if (tag, bits) not in _DECODABLE:
        raise AudioDecodeError(f"unsupported WAV encoding (format tag {tag}, {bits} bits)")
    return _WavFormat(tag, channels, rate, bits)


def _pcm_to_float(payload: bytes, fmt: _WavFormat) -> np.ndarray:
    """Samples of an encoding _parse_fmt accepted (_DECODABLE)."""
    width = fmt.bits // 8
    usable = len(payload) // (width * fmt.channels) * width * fmt.channels  # drop a torn last frame
    raw = payload[:usable]
    if fmt.tag == _WAVE_FORMAT_FLOAT:
        samples = np.frombuffer(raw, dtype=f"<f{width}").astype(np.float32)
        _require_finite(samples)
    elif fmt.tag == _WAVE_FORMAT_PCM and fmt.bits == 8:  # 8-bit WAV is unsigned
        samples = (np.frombuffer(raw, dtype=np.uint8).astype(np.float32) - 128.0) / 128.0
    elif fmt.tag == _WAVE_FORMAT_PCM and fmt.bits in (16, 32):
        samples = np.frombuffer(raw, dtype=f"<i{width}").astype(np.float32) / float(2 ** (fmt.bits - 1))
    else:  # 24-bit PCM
        triplets = np.frombuffer(raw, dtype=np.uint8).reshape(-1, 3).astype(np.int32)
        values = triplets[:, 0] | (triplets[:, 1] << 8) | (triplets[:, 2] << 16)
        samples = (np.where(values >= 1 << 23, values - (1 << 24), values) / float(1 << 23)).astype(np.float32)
    return samples.reshape(-1, fmt.channels)


def _require_finite(samples: np.ndarray) -> None:
    """Float samples must be numbers: a NaN or an infinity would turn every feature of the utterance into NaN."""
    bad = int(np.count_nonzero(~np.isfinite(samples)))
    if bad:
        raise AudioDecodeError(f"{bad} of {samples.size} float samples are NaN or infinite")


def decode_wav(data: bytes) -> tuple[np.ndarray, int]:
    """WAV bytes -> (float32 [frames, channels] in [-1, 1], sample rate).

    Sizes. A RIFF size or a chunk size (data chunk included) that claims more bytes than the file holds is refused as
    a truncated file (AudioDecodeError saying "truncated"). Streaming writers, which cannot seek back to patch the
    header when they write to a pipe, leave a placeholder instead: 0 (a header never patched), 0x7FFFF000 (sox's
    "unspecified length") or 0xFFFFFFFF (ffmpeg). A data chunk of one of these sizes is accepted and read to the end
    of the file, and so is such a RIFF size, or any RIFF size when the data chunk is streamed. Only the file's own
    bytes are ever read or allocated, whatever the header claims. Chunks after the data chunk are not read.
    """
    if len(data) < 12 or data[:4] != b"RIFF" or data[8:12] != b"WAVE":
        raise AudioDecodeError("not a RIFF/WAVE file")
    fmt: _WavFormat | None = None
    for chunk in _wav_chunks(data):
        if chunk.id == b"fmt ":
            fmt = _parse_fmt(chunk.body)
        elif chunk.id == b"data":
            if fmt is None:
                raise AudioDecodeError("WAV data chunk comes before its fmt chunk")
            _check_riff_size(data, chunk.streamed)
            samples = _pcm_to_float(chunk.body, fmt)
            if samples.shape[0] == 0:
                raise AudioDecodeError("WAV file holds no audio frames")
            return samples, fmt.sample_rate
    raise AudioDecodeError("WAV file has no data chunk" if fmt else "WAV file has no fmt chunk")


def decode_raw_pcm16(data: bytes, sample_rate: int = TARGET_SAMPLE_RATE, channels: int = 1) -> tuple[np.ndarray, int]:
    """Headerless little-endian signed 16-bit PCM -> (float32 [frames, channels], sample rate)."""
    frame_bytes = 2 * channels
    usable = len(data) // frame_bytes * frame_bytes
    if usable == 0:
        raise AudioDecodeError("raw PCM file holds no complete frame")
    samples = np.frombuffer(data[:usable], dtype="<i2").astype(np.float32) / 32768.0
    return samples.reshape(-1, channels), sample_rate


def _decode_with_soundfile(data: bytes, kind: str) -> tuple[np.ndarray, int]:
    try:
        import soundfile
    except ImportError as error:
        raise AudioDecodeError(
            f"decoding {kind} needs the Python package 'soundfile' (pip install soundfile)"
        ) from error
    try:
        samples, rate = soundfile.read(io.BytesIO(data), dtype="float32", always_2d=True)
    except Exception as error:  # soundfile raises LibsndfileError / RuntimeError subclasses
        raise AudioDecodeError(f"soundfile cannot decode this {kind} data: {error}") from error
    if samples.shape[0] == 0:
        raise AudioDecodeError(f"{kind} file holds no audio frames")
    return samples, int(rate)


def _decode_with_ffmpeg(data: bytes, kind: str) -> tuple[np.ndarray, int]:
    ffmpeg = shutil.which("ffmpeg")
    if ffmpeg is None:
        raise AudioDecodeError(f"decoding {kind} needs 'soundfile' built on libsndfile >= 1.1 or the ffmpeg program")
    command = [ffmpeg, "-nostdin", "-loglevel", "error", "-i", "pipe:0", "-f", "f32le", "-ac", "1",
               "-ar", str(TARGET_SAMPLE_RATE), "pipe:1"]
    result = subprocess.run(command, input=data, capture_output=True, check=False)
    if result.returncode != 0 or not result.stdout:
        detail = result.stderr.decode(errors="replace")[-300:]
        raise AudioDecodeError(f"ffmpeg cannot decode this {kind} data: {detail}")
    return np.frombuffer(result.stdout, dtype="<f4").reshape(-1, 1).copy(), TARGET_SAMPLE_RATE


def decode_mp3(data: bytes) -> tuple[np.ndarray, int]:
    try:
        return _decode_with_soundfile(data, "MP3")
    except AudioDecodeError as soundfile_error:
        if shutil.which("ffmpeg") is None:
            raise soundfile_error
        return _decode_with_ffmpeg(data, "MP3")


def sniff_audio_format(data: bytes, name: str = "") -> str:
    """'wav' | 'flac' | 'ogg' | 'mp3' | 'raw' from magic bytes, else from the file extension."""
    if data[:4] == b"RIFF" and data[8:12] == b"WAVE":
        return "wav"
    if data[:4] == b"fLaC":
        return "flac"
    if data[:4] == b"OggS":
        return "ogg"
    if data[:3] == b"ID3" or (len(data) > 1 and data[0] == 0xFF and data[1] & 0xE0 == 0xE0):
        return "mp3"
    extension = Path(name).suffix.lower().lstrip(".")
    if extension in {"raw", "pcm"}:
        return "raw"
    return {"wave": "wav", "oga": "ogg", "opus": "ogg"}.get(extension, extension)


def decode_audio(
    data: bytes, name: str = "", raw_sample_rate: int = TARGET_SAMPLE_RATE, raw_channels: int = 1
) -> tuple[np.ndarray, int]:
    """Encoded bytes -> (float32 [frames, channels], native sample rate).  Pure: no file access."""
    samples, rate = _decode_by_kind(data, sniff_audio_format(data, name), raw_sample_rate, raw_channels)
    if not MIN_SAMPLE_RATE <= rate <= MAX_SAMPLE_RATE:
        raise AudioDecodeError(f"sample rate {rate} Hz is outside {MIN_SAMPLE_RATE}..{MAX_SAMPLE_RATE} Hz "
                               f"(a corrupt header?)")
    return samples, rate


def _decode_by_kind(data: bytes, kind: str, raw_sample_rate: int, raw_channels: int) -> tuple[np.ndarray, int]:
    if kind == "wav":
        return decode_wav(data)
    if kind == "raw":
        return decode_raw_pcm16(data, raw_sample_rate, raw_channels)
    if kind in {"flac", "ogg"}:
        return _decode_with_soundfile(data, kind.upper())
    if kind == "mp3":
        return decode_mp3(data)
    raise AudioDecodeError(f"unrecognised audio format {kind or '(no extension)'!r}")


def resample(samples: np.ndarray, source_rate: int, target_rate: int = TARGET_SAMPLE_RATE) -> np.ndarray:
    """Band-limited resampling of a 1-D signal: scipy's polyphase filter for the usual rates, an FFT resampler for
    odd ones (MAX_POLYPHASE_FACTOR) or without scipy."""
    if source_rate == target_rate:
        return samples.astype(np.float32, copy=False)
    divisor = math.gcd(source_rate, target_rate)
    up, down = target_rate // divisor, source_rate // divisor
    if max(up, down) > MAX_POLYPHASE_FACTOR:
        return _fft_resample(samples, source_rate, target_rate)
    try:
        from scipy.signal import resample_poly
    except ImportError:
        return _fft_resample(samples, source_rate, target_rate)
    return resample_poly(samples.astype(np.float64), up, down).astype(np.float32)


def _fft_resample(samples: np.ndarray, source_rate: int, target_rate: int) -> np.ndarray:
    # Truncating / zero-padding the spectrum is an ideal low-pass; fine for utterance-length signals.
    target_length = max(1, round(len(samples) * target_rate / source_rate))
    spectrum = np.fft.rfft(samples.astype(np.float64))
    bins = target_length // 2 + 1
    resized = np.zeros(bins, dtype=np.complex128)
    keep = min(bins, spectrum.size)
    resized[:keep] = spectrum[:keep]
    return (np.fft.irfft(resized, n=target_length) * (target_length / len(samples))).astype(np.float32)


def to_mono_16k(samples: np.ndarray, sample_rate: int) -> np.ndarray:
    """[frames] or [frames, channels] at any rate -> 1-D float32 at 16 kHz (channels averaged)."""
    mono = samples.mean(axis=1) if samples.ndim == 2 else samples
    return resample(np.asarray(mono, dtype=np.float32), sample_rate, TARGET_SAMPLE_RATE)


def load_audio(
    source: Utterance | str | os.PathLike[str], raw_sample_rate: int = TARGET_SAMPLE_RATE, raw_channels: int = 1
) -> np.ndarray:
    """Read and decode one utterance (or file) to 16 kHz mono float32; failures raise CorpusError."""
    utterance = source if isinstance(source, Utterance) else Utterance(Path(source).name, str(source), "-")
    data = utterance.audio_bytes if utterance.audio_bytes is not None else _read_audio_file(utterance)
    try:
        samples, rate = decode_audio(data, utterance.audio, raw_sample_rate, raw_channels)
    except AudioDecodeError as error:
        raise _utterance_error(utterance, f"unreadable audio: {error}") from error
    return _stretch(utterance, to_mono_16k(samples, rate))


def _stretch(utterance: Utterance, audio: np.ndarray) -> np.ndarray:
    """The entry's part of its file (offset, duration); an entry reaching past the file's end is refused by name."""
    if utterance.offset == 0.0 and utterance.duration is None:
        return audio
    start = round(utterance.offset * TARGET_SAMPLE_RATE)
    end = len(audio) if utterance.duration is None else start + round(utterance.duration * TARGET_SAMPLE_RATE)
    if end > len(audio) + TARGET_SAMPLE_RATE // 100:  # 10 ms of rounding in a manifest's times is not an error
        raise _utterance_error(utterance, f"offset {utterance.offset:g} s + duration {utterance.duration:g} s "
                                          f"reaches past the file's end at {len(audio) / TARGET_SAMPLE_RATE:.2f} s")
    return audio[start:min(end, len(audio))]


def _read_audio_file(utterance: Utterance) -> bytes:
    path = Path(utterance.audio)
    try:
        # a device (/dev/zero) or a pipe would be read without end
        data = path.read_bytes() if stat.S_ISREG(path.stat().st_mode) else None
    except FileNotFoundError as error:
        raise _utterance_error(utterance, "audio file does not exist") from error
    except (OSError, ValueError) as error:  # ValueError: a path with a NUL byte, which no file can have
        raise _utterance_error(utterance, f"unreadable audio: {error}") from error
    if data is None:
        raise _utterance_error(utterance, "unreadable audio: not a regular file")
    return data


# ------------------------------------------------------------------------------------------------ validation


def validate_utterance(utterance: Utterance, decode: bool = False) -> None:
    """A transcript with no word or a missing file raise CorpusError; ``decode=True`` also decodes the audio."""
    require_words(utterance)
    if utterance.audio_bytes is None and not _is_file(utterance):
        raise _utterance_error(utterance, "audio file does not exist")
    if decode:
        load_audio(utterance)


def _is_file(utterance: Utterance) -> bool:
    try:
        return Path(utterance.audio).is_file()
    except OSError as error:  # is_file() lets a name too long for the file system through
        raise _utterance_error(utterance, f"unusable audio path ({error.strerror})") from None


def require_words(utterance: Utterance) -> None:
    """CorpusError naming the entry when its transcript has no word left after the normalisation WER is scored under
    (data.normalize.spoken_words: ``"..."`` has none): calibration would tag no position of it and evaluation would
    divide by zero reference words. Every corpus loader checks here, so calibration and evaluation both refuse it."""
    if not utterance.text.strip():
        raise _utterance_error(utterance, "empty transcript")
    if not spoken_words(utterance.text):
        shown = utterance.text if len(utterance.text) <= 60 else utterance.text[:57] + "..."
        raise _utterance_error(utterance, f"transcript {shown!r} has no word after normalisation (Whisper's English "
                                          f"normaliser, as WER scores it): nothing to calibrate on or to score")


def validate_corpus(utterances: Iterable[Utterance], decode: bool = False) -> list[Utterance]:
    """Check every entry (and that ids are unique); returns the entries as a list."""
    checked: list[Utterance] = []
    seen: set[str] = set()
    for utterance in utterances:
        if utterance.id in seen:
            raise _utterance_error(utterance, "duplicate utterance id")
        seen.add(utterance.id)
        validate_utterance(utterance, decode)
        checked.append(utterance)
    return checked


# ---------------------------------------------------------------------------------------------------- loaders


def load_manifest(path: str | os.PathLike[str], dataset: str | None = None, decode: bool = False) -> list[Utterance]:
    """JSONL manifest -> utterances in file order; relative audio paths are taken from the manifest's folder."""
    manifest = Path(path)
    base = manifest.parent
    name = dataset if dataset is not None else manifest.stem
    utterances = []
    for line_number, line in enumerate(_utf8_lines(manifest), start=1):
        if not line.strip():
            continue
        where = f"{manifest}:{line_number}"
        try:
            record = json.loads(line)
            audio = str(record["audio"] if "audio" in record else record["audio_filepath"])
            offset, duration = _stretch_times(record, where)
            utterance_id = str(record["id"]) if "id" in record else f"{audio}@{offset:g}"
            text = str(record["text"] or "")
            language = _record_language(record, where)
        except (*JSON_ERRORS, KeyError, TypeError) as error:
            raise CorpusError(
                f'{where}: not an {{"id", "audio", "text"}} record (nor NeMo\'s {{"audio_filepath", "text", '
                f'"offset", "duration"}}) ({type(error).__name__}: {error})') from None
        audio_path = audio if os.path.isabs(audio) else str(base / audio)
        utterances.append(Utterance(utterance_id, audio_path, text, name, origin=where, offset=offset,
                                    duration=duration, language=language))
    return validate_corpus(utterances, decode)


_LANGUAGE_CODE = re.compile(r"[a-z]{2,3}(?:[-_][a-z0-9]{2,8})?")


def _record_language(record: dict, where: str) -> str:
    """A manifest record's language code ("language", or NeMo's "lang"), lower case; "" when it names none. A
    region tag ("pt-BR") is dropped: wordfreq and Whisper know languages, not regions."""
    value = record.get("language", record.get("lang", ""))
    if value in ("", None):
        return ""
    if not isinstance(value, str) or not _LANGUAGE_CODE.fullmatch(value.lower()):
        raise CorpusError(f"{where}: 'language' must be a language code such as 'en' or 'de', got {value!r}")
    return re.split(r"[-_]", value.lower())[0]


def _stretch_times(record: dict, where: str) -> tuple[float, float | None]:
    """(offset, duration) of a manifest record: NeMo's keys, in seconds; absent = the whole file."""
    offset, duration = record.get("offset", 0.0), record.get("duration")
    for key, value in (("offset", offset), ("duration", duration)):
        if value is None and key == "duration":
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
            raise CorpusError(f"{where}: {key!r} must be a finite number of seconds >= 0, got {value!r}")
    if duration is not None and duration <= 0:
        raise CorpusError(f"{where}: 'duration' must be positive, got {duration!r}")
    if "offset" in record and duration is None:
        raise CorpusError(f"{where}: an 'offset' needs its 'duration' (NeMo manifests give both)")
    return float(offset), None if duration is None else float(duration)


def _utf8_lines(path: Path) -> list[str]:
    """The lines of a UTF-8 text file; CorpusError naming the file and line when it is not UTF-8."""
    data = path.read_bytes()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as error:
        line_number = data[: error.start].count(b"\n") + 1
        raise CorpusError(f"{path}:{line_number}: not UTF-8 text ({error.reason} at byte {error.start}); save it as "
                          f"UTF-8") from None
    return text.splitlines()


def write_manifest(utterances: Iterable[Utterance], path: str | os.PathLike[str]) -> Path:
    """Write a JSONL manifest (audio relative to its folder when below it), atomically."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    lines = []
    for utterance in utterances:
        if utterance.audio_bytes is not None and not utterance.audio:
            raise _entry_error(utterance.id, "", "in-memory audio cannot be written to a manifest", utterance.origin)
        audio = Path(utterance.audio).resolve()
        try:
            audio_field = str(audio.relative_to(target.parent.resolve()))
        except ValueError:
            audio_field = str(audio)
        record: dict[str, Any] = {"id": utterance.id, "audio": audio_field, "text": utterance.text}
        if utterance.duration is not None:  # a stretch of its file: kept as NeMo spells it
            record.update(offset=utterance.offset, duration=utterance.duration)
        if utterance.language:
            record["language"] = utterance.language
        lines.append(json.dumps(record, ensure_ascii=False))
    return write_text_atomic(target, "\n".join(lines) + ("\n" if lines else ""))


def load_librispeech_dir(
    root: str | os.PathLike[str], dataset: str | None = None, decode: bool = False
) -> list[Utterance]:
    """LibriSpeech layout (``speaker/chapter/<id>.flac`` + ``<speaker>-<chapter>.trans.txt``), sorted by id.

    ``root`` may be the split folder or any folder above it; every ``*.trans.txt`` below it is read.
    """
    folder = Path(root)
    transcripts = sorted(folder.rglob("*.trans.txt"))
    if not transcripts:
        raise CorpusError(f"{folder}: no LibriSpeech *.trans.txt transcripts found below it")
    utterances = []
    for transcript in transcripts:
        for line_number, line in enumerate(_utf8_lines(transcript), start=1):
            if not line.strip():
                continue
            utterance_id, _, text = line.strip().partition(" ")
            audio = _librispeech_audio(transcript.parent, utterance_id)
            utterances.append(Utterance(utterance_id, str(audio), text.strip(), dataset or folder.name,
                                        origin=f"{transcript}:{line_number}"))
    return validate_corpus(sorted(utterances, key=lambda u: u.id), decode)


def _librispeech_audio(chapter_dir: Path, utterance_id: str) -> Path:
    for extension in (".flac", ".wav", ".mp3"):
        candidate = chapter_dir / f"{utterance_id}{extension}"
        if candidate.is_file():
            return candidate
    return chapter_dir / f"{utterance_id}.flac"  # missing: validation names this file


_TEXT_COLUMNS = ("text", "sentence", "transcript", "transcription", "normalized_text", "raw_text")
_ID_COLUMNS = ("id", "utterance_id", "segment_id", "audio_id", "file")


def load_hf_dataset_dir(
    path: str | os.PathLike[str],
    split: str | None = None,
    audio_column: str | None = None,
    text_column: str | None = None,
    id_column: str | None = None,
    dataset: str | None = None,
    decode: bool = False,
) -> list[Utterance]:
    """A ``datasets`` folder written by ``save_to_disk``; audio is taken as encoded bytes (decoded by us)."""
    try:
        import datasets
    except ImportError as error:
        raise CorpusError(
            f"{path} is a Hugging Face datasets folder; reading it needs the optional package 'datasets' "
            "(pip install datasets)"
        ) from error
    loaded = datasets.load_from_disk(str(path))
    table = _pick_split(loaded, split, path)
    columns = list(table.column_names)
    audio_column = audio_column or "audio"
    text_column = text_column or _first_present(_TEXT_COLUMNS, columns, "transcript", path)
    id_column = id_column or next((c for c in _ID_COLUMNS if c in columns), None)
    if audio_column not in columns:
        raise CorpusError(f"{path}: no audio column {audio_column!r} (columns: {', '.join(columns)}); name it with "
                          f"--audio-column")
    name = dataset or Path(path).name
    utterances = [
        replace(_hf_row_to_utterance(row, i, audio_column, text_column, id_column, name), origin=f"{path} row {i}")
        for i, row in enumerate(_undecoded_rows(table, [c for c in (audio_column, text_column, id_column) if c]))
    ]
    return validate_corpus(utterances, decode)


def _undecoded_rows(table: Any, columns: list[str]) -> Iterable[dict[str, Any]]:
    """Rows as stored (an Audio column stays {"bytes", "path"}), read from the backing Arrow table.

    This skips the ``datasets`` audio decoder (torchcodec in datasets >= 4) and any fingerprinted transform
    (datasets 5.2 with pyarrow 26 cannot fingerprint: dill fails to pickle pyarrow's MonthDayNano).
    """
    if getattr(table, "_indices", None) is not None:  # a selection that save_to_disk did not flatten
        table = table.flatten_indices()
    for batch in table.data.select(columns).to_batches(max_chunksize=256):
        yield from batch.to_pylist()


def _pick_split(loaded: Any, split: str | None, path: Any) -> Any:
    if not hasattr(loaded, "keys"):  # a single Dataset
        return loaded
    names = list(loaded.keys())
    if split is None and len(names) == 1:
        return loaded[names[0]]
    if split not in names:
        raise CorpusError(f"{path}: choose a split with split=... (available: {', '.join(names)})")
    return loaded[split]


def _first_present(candidates: Sequence[str], columns: Sequence[str], what: str, path: Any) -> str:
    for candidate in candidates:
        if candidate in columns:
            return candidate
    raise CorpusError(f"{path}: no {what} column among {', '.join(columns)}; name it with --text-column")


def _hf_row_to_utterance(
    row: Mapping[str, Any], index: int, audio_column: str, text_column: str, id_column: str | None, name: str
) -> Utterance:
    utterance_id = str(row[id_column]) if id_column else f"{name}-{index:06d}"
    audio = row[audio_column]
    text = str(row[text_column] or "")
    if isinstance(audio, Mapping):
        path, payload = str(audio.get("path") or ""), audio.get("bytes")
        if payload is None and audio.get("array") is not None:  # already decoded: store as float WAV bytes
            payload = encode_wav_float32(np.asarray(audio["array"], dtype=np.float32), int(audio["sampling_rate"]))
        return Utterance(utterance_id, path, text, name, payload)
    return Utterance(utterance_id, str(audio), text, name)


def encode_wav_float32(samples: np.ndarray, sample_rate: int) -> bytes:
    """Mono float32 samples -> IEEE-float WAV bytes (lossless carrier for already-decoded audio)."""
    payload = np.asarray(samples, dtype="<f4").tobytes()
    fmt = struct.pack("<HHIIHH", _WAVE_FORMAT_FLOAT, 1, sample_rate, sample_rate * 4, 4, 32)
    body = b"WAVE" + b"fmt " + struct.pack("<I", len(fmt)) + fmt + b"data" + struct.pack("<I", len(payload)) + payload
    return b"RIFF" + struct.pack("<I", len(body)) + body


# ------------------------------------------------------------------------------------------ Kaldi / ESPnet


KALDI_FILES = ("wav.scp", "text")  # what makes a folder a Kaldi data folder; "segments" is optional


def load_kaldi_dir(root: str | os.PathLike[str], dataset: str | None = None, decode: bool = False) -> list[Utterance]:
    """A Kaldi / ESPnet data folder: ``wav.scp`` (``<recording> <audio file>``), ``text`` (``<utterance> <words>``)
    and, when present, ``segments`` (``<utterance> <recording> <start> <end>``, seconds; end -1: to the file's end).
    Without ``segments`` an utterance is its whole recording. A relative audio path is taken from the folder, else
    from the working directory (where Kaldi's recipes run). Entries come in ``text``'s order. A command in
    ``wav.scp`` (``sox ... |``) or an archive offset (``foo.ark:123``) is refused by file and line: nothing here runs a
    command or reads an archive -- write the audio out once and list the files."""
    folder = Path(root)
    recordings = {key: (value, where) for key, value, where in _kaldi_table(folder / "wav.scp", 1)}
    for key, (value, where) in recordings.items():
        _check_kaldi_audio(value, where)
    segments = ({key: (value, where) for key, value, where in _kaldi_table(folder / "segments", 3)}
                if (folder / "segments").is_file() else None)
    name = dataset if dataset is not None else folder.name
    utterances = []
    for utterance_id, text, where in _kaldi_table(folder / "text", 0):
        recording, offset, duration = _kaldi_stretch(utterance_id, segments, where)
        if recording not in recordings:
            raise CorpusError(f"{where}: utterance {utterance_id!r}: its recording {recording!r} is not in "
                              f"{folder / 'wav.scp'}")
        audio = _kaldi_audio_path(folder, recordings[recording][0])
        utterances.append(Utterance(utterance_id, audio, text, name, origin=where, offset=offset, duration=duration))
    if segments is not None:
        unused = sorted(set(segments) - {u.id for u in utterances})
        if unused:
            raise CorpusError(f"{segments[unused[0]][1]}: segment {unused[0]!r} has no transcript in "
                              f"{folder / 'text'}")
    return validate_corpus(utterances, decode)


def _kaldi_table(path: Path, min_fields: int) -> Iterator[tuple[str, str, str]]:
    """(key, rest of the line, "file:line") of a Kaldi table; a key twice, or a line with fewer than ``min_fields``
    fields after its key, refused by file and line."""
    if not path.is_file():
        raise CorpusError(f"{path}: missing; a Kaldi data folder holds wav.scp and text (segments optional)")
    seen: dict[str, int] = {}
    for number, line in enumerate(_utf8_lines(path), start=1):
        if not line.strip():
            continue
        key, _, rest = line.strip().partition(" ")
        rest, where = rest.strip(), f"{path}:{number}"
        if len(rest.split()) < min_fields:
            raise CorpusError(f"{where}: expected '<id>' and {min_fields} more field(s), got {line.strip()!r}")
        if key in seen:
            raise CorpusError(f"{where}: id {key!r} again (first on line {seen[key]})")
        seen[key] = number
        yield key, rest, where


_ARCHIVE_OFFSET = re.compile(r":\d+$")


def _check_kaldi_audio(value: str, where: str) -> None:
    """A wav.scp entry must name a file: Kaldi also allows a command (``sox a.sph -t wav - |``), standard input (``-``)
    and an archive offset (``feats.ark:123``), none of which is read here."""
    if value.endswith("|") or value == "-":
        raise CorpusError(f"{where}: {value!r} is a command or standard input; write its audio to a file once and "
                          f"list the file (nothing here runs a command)")
    if _ARCHIVE_OFFSET.search(value):
        raise CorpusError(f"{where}: {value!r} is an archive offset; extract the audio to files and list them")


def _kaldi_stretch(utterance_id: str, segments: dict | None, where: str) -> tuple[str, float, float | None]:
    """(recording, offset, duration) of an utterance: its segment, or its whole recording (same id)."""
    if segments is None:
        return utterance_id, 0.0, None
    if utterance_id not in segments:
        raise CorpusError(f"{where}: utterance {utterance_id!r} has no line in segments")
    value, segment_where = segments[utterance_id]
    fields = value.split()  # at least three: _kaldi_table checked
    try:
        start, end = float(fields[1]), float(fields[2])
    except ValueError:
        raise CorpusError(f"{segment_where}: expected '<utterance> <recording> <start> <end>' in seconds, got "
                          f"{value!r}") from None
    recording = fields[0]
    if len(fields) != 3 or not (math.isfinite(start) and math.isfinite(end)) or start < 0 or \
            (end != -1 and end <= start):
        raise CorpusError(f"{segment_where}: expected '<utterance> <recording> <start> <end>' with 0 <= start < end "
                          f"(end -1: to the file's end), got {value!r}")
    return recording, start, None if end == -1 else end - start


def _kaldi_audio_path(folder: Path, value: str) -> str:
    """An audio path of wav.scp: absolute as is; relative, from the data folder, else from the working directory
    (Kaldi's recipes write paths relative to where they run); neither: the folder's, which the check names."""
    if os.path.isabs(value):
        return value
    in_folder = folder / value
    return str(Path(value).resolve()) if not in_folder.exists() and Path(value).exists() else str(in_folder)


# ---------------------------------------------------------------------------------------------- any source


def corpus_kind(path: str | os.PathLike[str]) -> str:
    """What ``path`` is: a JSONL manifest (NeMo's too), a Kaldi/ESPnet data folder, a saved ``datasets`` folder or a
    LibriSpeech-layout folder; CorpusError when it does not exist."""
    source = Path(path)
    if source.is_file():
        return "manifest"
    if not source.is_dir():
        raise CorpusError(f"corpus source {source} does not exist")
    if all((source / name).is_file() for name in KALDI_FILES):
        return "kaldi"
    if any((source / marker).is_file() for marker in ("dataset_info.json", "state.json", "dataset_dict.json")):
        return "datasets"
    return "librispeech"


def load_corpus(path: str | os.PathLike[str], audio_column: str | None = None, text_column: str | None = None,
                **options: Any) -> list[Utterance]:
    """Dispatch on what ``path`` is (:func:`corpus_kind`). ``audio_column`` / ``text_column`` name a ``datasets``
    folder's columns; given for any other source they are refused (they would be ignored)."""
    kind = corpus_kind(path)
    columns = {k: v for k, v in (("audio_column", audio_column), ("text_column", text_column)) if v}
    if columns and kind != "datasets":
        flags = " and ".join("--" + k.replace("_", "-") for k in columns)
        raise CorpusError(f"{path}: {flags} name a datasets folder's columns; this is a {kind} source")
    loader = {"manifest": load_manifest, "kaldi": load_kaldi_dir, "datasets": load_hf_dataset_dir,
              "librispeech": load_librispeech_dir}[kind]
    return loader(Path(path), **columns, **options)


# ---------------------------------------------------------------------------------------- statistics and pools


@dataclass(frozen=True)
class CorpusStatistics:
    utterances: int
    words: int
    rare_words: int

    @property
    def rare_share(self) -> float:
        return self.rare_words / self.words if self.words else 0.0


def corpus_statistics(
    utterances: Iterable[Utterance], k: float = DEFAULT_ZIPF_THRESHOLD, numerals: NumeralPolicy = "zipf"
) -> CorpusStatistics:
    """Utterance, word and rare-word counts (Zipf < k, see tarq_deploy.data.rarity) and the rare share."""
    counts = [count_rare_words(u.text, k, numerals) for u in utterances]
    return CorpusStatistics(len(counts), sum(c.words for c in counts), sum(c.rare_words for c in counts))


def rare_density(utterance: Utterance, k: float = DEFAULT_ZIPF_THRESHOLD) -> float:
    """The paper's rho(utt) = |{w in utt : Zipf(w) < k}| / |utt| (0 for an utterance without words)."""
    return count_rare_words(utterance.text, k).rare_share


def _rank_by_rare_density(utterances: Sequence[Utterance], k: float) -> list[int]:
    """Indices ranked by rho descending; ties to more rare words (more tail positions), then (dataset, id)."""
    scored = []
    for index, utterance in enumerate(utterances):
        counts = count_rare_words(utterance.text, k)
        scored.append((-counts.rare_share, -counts.rare_words, utterance.dataset, utterance.id, index))
    return [entry[-1] for entry in sorted(scored)]


def select_random(
    utterances: Sequence[Utterance], n: int = DEFAULT_CALIBRATION_SIZE, seed: int = 0
) -> list[Utterance]:
    """``n`` utterances drawn uniformly without replacement with ``numpy.random.default_rng(seed)``.

    The same corpus order and seed give the same selection; it is returned in corpus order.  All of the
    corpus is returned when it has fewer than ``n`` entries.
    """
    if n >= len(utterances):
        return list(utterances)
    chosen = np.random.default_rng(seed).choice(len(utterances), size=n, replace=False)
    return [utterances[i] for i in sorted(chosen.tolist())]


def select_r_top(
    utterances: Sequence[Utterance], n: int = DEFAULT_CALIBRATION_SIZE, k: float = DEFAULT_ZIPF_THRESHOLD
) -> list[Utterance]:
    """r-top: the ``n`` utterances with the largest rare density rho from this one source (paper, App. cross).

    Ranked by rho descending; ties go to more rare words, then (dataset, id) ascending.  Returned in rank order.
    """
    return [utterances[i] for i in _rank_by_rare_density(utterances, k)[:n]]


def select_r_mix(
    utterances: Sequence[Utterance],
    n: int = DEFAULT_CALIBRATION_SIZE,
    seed: int = 0,
    k: float = DEFAULT_ZIPF_THRESHOLD,
) -> list[Utterance]:
    """r-mix: ``n // 2`` utterances by top rho (as r-top), plus ``n - n // 2`` drawn uniformly at random
    (``select_random`` with ``seed``) from the rest of the source, so the halves never overlap.

    Returned as the rare half in rank order followed by the random half in corpus order.
    """
    top = _rank_by_rare_density(utterances, k)[: n // 2]
    taken = set(top)
    rest = [u for i, u in enumerate(utterances) if i not in taken]
    return [utterances[i] for i in top] + select_random(rest, n - len(top), seed)


def select_r_cross(
    sources: Mapping[str, Sequence[Utterance]],
    n: int = DEFAULT_CALIBRATION_SIZE,
    k: float = DEFAULT_ZIPF_THRESHOLD,
    evaluation_dataset: str | None = None,
) -> list[Utterance]:
    """r-cross: a rare-dense pool drawn across several source corpora (paper: LibriSpeech-train.100,
    SPGI-S/train, VoxPopuli-en/train).

    From each source take its top ``ceil(4n/3)`` utterances by rho (170 for n = 128), pool them, and return the
    global top ``n`` by rho (same ranking and ties as r-top).  Sources named ``evaluation_dataset`` are left
    out, so calibration never draws from the dataset being evaluated.
    """
    per_source = math.ceil(4 * n / 3)
    candidates: list[Utterance] = []
    for name, utterances in sources.items():
        if name != evaluation_dataset:
            candidates.extend(select_r_top(utterances, per_source, k))
    if not candidates:
        raise CorpusError(f"r-cross needs at least one source other than the evaluation set {evaluation_dataset!r}")
    return select_r_top(candidates, n, k)


POOLS = ("random", "r-top", "r-mix")


def select_pool(
    utterances: Sequence[Utterance],
    pool: str,
    n: int = DEFAULT_CALIBRATION_SIZE,
    seed: int = 0,
    k: float = DEFAULT_ZIPF_THRESHOLD,
) -> list[Utterance]:
    """One-source pools by name: 'random', 'r-top' or 'r-mix' (r-cross takes several sources)."""
    if pool == "random":
        return select_random(utterances, n, seed)
    if pool == "r-top":
        return select_r_top(utterances, n, k)
    if pool == "r-mix":
        return select_r_mix(utterances, n, seed, k)
    raise CorpusError(f"unknown calibration pool {pool!r}; choose one of {', '.join(POOLS)} or use select_r_cross")
