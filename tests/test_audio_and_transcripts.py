"""WAV sizes and transcripts without a word (issue 27).

A WAV whose RIFF or data-chunk size claims more than the file holds is refused like a truncated one, before anything of
the claimed size is allocated; the placeholders streaming writers leave (0, sox's 0x7FFFF000, ffmpeg's 0xFFFFFFFF)
read to the end of the file. A transcript with no word after WER's normalisation is refused for calibration and for
evaluation, naming the manifest line and the utterance id.
"""
from __future__ import annotations

import io
import json
import struct
import tracemalloc
import wave
from pathlib import Path

import numpy as np
import pytest
from helpers import run_cli

from tarq_deploy.data.corpus import (AudioDecodeError, CorpusError, Utterance, decode_wav, encode_wav_float32,
                                     load_audio, load_corpus)

ONE_SECOND = 16_000
TWO_GB = 1 << 31
SOX_UNSPECIFIED, FFMPEG_UNSPECIFIED = 0x7FFFF000, 0xFFFFFFFF


def pcm_wav(frames: int = ONE_SECOND) -> bytes:
    """16-bit mono 16 kHz, as Python's wave module writes it (RIFF, fmt, data)."""
    buffer = io.BytesIO()
    with wave.open(buffer, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(16_000)
        w.writeframes((np.sin(np.arange(frames) / 9.0) * 8000).astype("<i2").tobytes())
    return buffer.getvalue()


def with_sizes(wav: bytes, data: int | None = None, riff: int | None = None) -> bytes:
    """``wav`` with its data-chunk size and / or RIFF size replaced."""
    edited = bytearray(wav)
    if data is not None:
        struct.pack_into("<I", edited, edited.index(b"data") + 4, data)
    if riff is not None:
        struct.pack_into("<I", edited, 4, riff)
    return bytes(edited)


def write_manifest_lines(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


# ------------------------------------------------------------------------------------------------------ WAV sizes
def test_a_header_claiming_2_gb_of_samples_on_a_1_s_file_is_refused_without_allocating_them():
    claimed = with_sizes(pcm_wav(), data=TWO_GB)
    tracemalloc.start()
    try:
        with pytest.raises(AudioDecodeError, match=rf"truncated: its 'data' chunk declares {TWO_GB} bytes"):
            decode_wav(claimed)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 4 * len(claimed), peak  # nothing of the claimed size, not even a copy of the samples


@pytest.mark.parametrize("riff", [TWO_GB, 10 ** 6])
def test_a_riff_size_past_the_end_of_the_file_is_refused(riff):
    with pytest.raises(AudioDecodeError, match=rf"truncated: its RIFF header declares {riff + 8} bytes"):
        decode_wav(with_sizes(pcm_wav(), riff=riff))


def test_a_chunk_before_the_data_that_runs_past_the_end_is_refused():
    wav = pcm_wav(100)
    at = wav.index(b"data")
    listed = wav[:at] + b"LIST" + struct.pack("<I", FFMPEG_UNSPECIFIED) + b"INFO" + wav[at:]
    with pytest.raises(AudioDecodeError, match="its 'LIST' chunk declares 4294967295 bytes"):
        decode_wav(listed)  # a placeholder size is the data chunk's only


@pytest.mark.parametrize("placeholder", [0, SOX_UNSPECIFIED, FFMPEG_UNSPECIFIED])
def test_a_streamed_data_size_reads_to_the_end_of_the_file(placeholder):
    wav = pcm_wav()
    expected, _ = decode_wav(wav)
    # a writer that could not patch the data size could not patch the RIFF size: sox writes its placeholder + 36
    for riff in (None, 0, SOX_UNSPECIFIED + 36, FFMPEG_UNSPECIFIED, TWO_GB):
        samples, rate = decode_wav(with_sizes(wav, data=placeholder, riff=riff))
        assert rate == 16_000 and np.array_equal(samples, expected)


def test_a_streaming_riff_size_with_an_exact_data_size_is_accepted():
    wav = pcm_wav()
    for riff in (0, FFMPEG_UNSPECIFIED):
        assert decode_wav(with_sizes(wav, riff=riff))[0].shape == (ONE_SECOND, 1)


def test_a_streamed_data_chunk_holding_nothing_is_refused():
    header_only = with_sizes(pcm_wav()[:44], data=FFMPEG_UNSPECIFIED)
    with pytest.raises(AudioDecodeError, match="no audio frames"):
        decode_wav(header_only)


@pytest.mark.parametrize("bits", [0, 4, 12])
def test_a_sample_width_without_a_decoder_is_refused(bits):
    wav = bytearray(pcm_wav(100))
    struct.pack_into("<H", wav, wav.index(b"fmt ") + 8 + 14, bits)
    with pytest.raises(AudioDecodeError, match=f"unsupported WAV encoding \\(format tag 1, {bits} bits\\)"):
        decode_wav(bytes(wav))


@pytest.mark.parametrize("rate", [1, 999, 768_001, 0xFFFFFFFF])
def test_a_sample_rate_outside_the_audio_range_is_refused(rate):
    wav = bytearray(pcm_wav(100))
    struct.pack_into("<I", wav, wav.index(b"fmt ") + 8 + 4, rate)
    with pytest.raises(CorpusError, match=f"sample rate {rate} Hz is outside"):
        load_audio(Utterance("r", "r.wav", "x", audio_bytes=bytes(wav)))


def test_an_odd_sample_rate_resamples_without_a_huge_filter():
    """767 999 Hz -> 16 kHz is 16000 / 767999: a polyphase filter of 15 million taps (2 s, 120 MB); the FFT resampler
    takes what any rate takes."""
    odd = encode_wav_float32(np.zeros(7680, dtype=np.float32), 767_999)
    tracemalloc.start()
    try:
        audio = load_audio(Utterance("odd", "odd.wav", "x", audio_bytes=odd))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert audio.shape == (160,) and peak < 4 << 20, peak


def test_float_samples_that_are_not_finite_are_refused():
    samples = np.zeros(1600, dtype=np.float32)
    samples[[5, 9]] = [np.nan, np.inf]
    with pytest.raises(AudioDecodeError, match="2 of 1600 float samples are NaN or infinite"):
        decode_wav(encode_wav_float32(samples, 16_000))


def test_eval_refuses_the_2_gb_wav_naming_the_entry_and_file(tmp_path, capsys):
    wav = tmp_path / "claims-2gb.wav"
    wav.write_bytes(with_sizes(pcm_wav(), data=TWO_GB))
    manifest = write_manifest_lines(tmp_path / "dev.jsonl", [{"id": "big", "audio": wav.name, "text": "hello there"}])
    status, _, err = run_cli(capsys, "eval", "--model", "packaged:tiny.en", "--data", manifest, "--out", tmp_path / "out")
    assert status == 2, err
    assert "'big'" in err and str(wav) in err and "truncated" in err and "Traceback" not in err
    assert not (tmp_path / "out" / "report.json").exists()


# ---------------------------------------------------------------------------------------- transcripts with no word
@pytest.mark.parametrize("text", ["...", '"..."', "[noise]", " - ", "?!"])
def test_a_transcript_with_no_word_after_normalisation_is_refused_naming_line_and_id(tmp_path, text):
    wav = tmp_path / "a.wav"
    wav.write_bytes(pcm_wav(1600))
    manifest = write_manifest_lines(tmp_path / "m.jsonl", [{"id": "fine", "audio": "a.wav", "text": "hello..."},
                                                           {"id": "dots", "audio": "a.wav", "text": text}])
    with pytest.raises(CorpusError, match=rf"'dots' \({manifest}:2, file {wav}\): transcript .* has no word"):
        load_corpus(manifest)


def test_a_librispeech_transcript_with_no_word_names_its_trans_file_and_line(tmp_path):
    chapter = tmp_path / "19" / "198"
    chapter.mkdir(parents=True)
    for utterance in ("19-198-0000", "19-198-0001"):
        (chapter / f"{utterance}.wav").write_bytes(pcm_wav(1600))
    transcript = chapter / "19-198.trans.txt"
    transcript.write_text("19-198-0000 NORTHANGER ABBEY\n19-198-0001 ...\n")
    with pytest.raises(CorpusError, match=rf"'19-198-0001' \({transcript}:2, .*has no word"):
        load_corpus(tmp_path)


@pytest.fixture
def dots_manifest(tmp_path) -> Path:
    (tmp_path / "a.wav").write_bytes(pcm_wav(1600))
    return write_manifest_lines(tmp_path / "calib.jsonl", [{"id": "u1", "audio": "a.wav", "text": "a real sentence"},
                                                           {"id": "u2", "audio": "a.wav", "text": "..."}])


def test_calibration_refuses_a_transcript_with_no_word(tmp_path, capsys, dots_manifest):
    out = tmp_path / "ckpt"
    status, _, err = run_cli(capsys, "quantize", "--model", "packaged:tiny.en", "--method", "gptq", "--calib",
                          dots_manifest, "--out", out)
    assert status == 2, err
    assert f"{dots_manifest}:2" in err and "'u2'" in err and "has no word" in err and "Traceback" not in err
    assert not out.exists()


def test_evaluation_refuses_a_transcript_with_no_word(tmp_path, capsys, dots_manifest):
    status, _, err = run_cli(capsys, "eval", "--model", "packaged:tiny.en", "--data", dots_manifest, "--out",
                          tmp_path / "out")
    assert status == 2, err
    assert f"{dots_manifest}:2" in err and "'u2'" in err and "has no word" in err and "Traceback" not in err
