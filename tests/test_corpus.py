"""Corpus loading, decoding, validation, selections and rare-biased pools."""
from __future__ import annotations

import json
import struct
import sys
from pathlib import Path

import numpy as np
import pytest

from tarq_deploy.data import corpus as cp
from tarq_deploy.data.corpus import CorpusError, Utterance

RATE = cp.TARGET_SAMPLE_RATE


def _tone(rate: int, seconds: float, hz: float = 440.0, amplitude: float = 0.5) -> np.ndarray:
    t = np.arange(int(rate * seconds)) / rate
    return amplitude * np.sin(2 * np.pi * hz * t)


def _wav_bytes(samples: np.ndarray, rate: int, bits: int = 16, float_format: bool = False) -> bytes:
    """A hand-built WAV (not via the code under test); samples [frames] or [frames, channels] in [-1, 1]."""
    frames = samples.reshape(len(samples), -1)
    channels = frames.shape[1]
    if float_format:
        payload, tag = frames.astype("<f4").tobytes(), 3
    elif bits == 8:
        payload, tag = np.round(frames * 127 + 128).astype(np.uint8).tobytes(), 1
    elif bits == 24:
        ints = np.round(frames * (2**23 - 1)).astype("<i4").reshape(-1)
        payload, tag = b"".join(int(v).to_bytes(3, "little", signed=True) for v in ints), 1
    else:
        payload, tag = np.round(frames * (2 ** (bits - 1) - 1)).astype(f"<i{bits // 8}").tobytes(), 1
    width = bits // 8
    fmt = struct.pack("<HHIIHH", tag, channels, rate, rate * channels * width, channels * width, bits)
    body = b"WAVE" + b"fmt " + struct.pack("<I", 16) + fmt + b"LIST" + struct.pack("<I", 3) + b"abc\x00"
    body += b"data" + struct.pack("<I", len(payload)) + payload
    return b"RIFF" + struct.pack("<I", len(body)) + body


def _dominant_hz(samples: np.ndarray, rate: int = RATE) -> float:
    spectrum = np.abs(np.fft.rfft(samples * np.hanning(len(samples))))
    return float(np.argmax(spectrum) * rate / len(samples))


# ----------------------------------------------------------------------------------------------- decoding


@pytest.mark.parametrize("rate", [8_000, 44_100])
def test_stereo_wav_to_16k_mono(rate: int) -> None:
    left, right = _tone(rate, 1.0, 440.0, 0.6), _tone(rate, 1.0, 440.0, 0.2)
    samples, native_rate = cp.decode_audio(_wav_bytes(np.stack([left, right], axis=1), rate), "x.wav")
    assert native_rate == rate and samples.shape == (rate, 2)
    mono = cp.to_mono_16k(samples, native_rate)
    assert mono.dtype == np.float32 and mono.ndim == 1
    assert len(mono) == pytest.approx(RATE, abs=2)
    assert _dominant_hz(mono) == pytest.approx(440.0, abs=2.0)
    middle = mono[2000:-2000]  # skip the filter's edge transients
    assert np.max(np.abs(middle)) == pytest.approx(0.4, abs=0.01)  # mean of 0.6 and 0.2


@pytest.mark.parametrize(("bits", "float_format"), [(8, False), (16, False), (24, False), (32, False), (32, True)])
def test_wav_sample_widths(bits: int, float_format: bool) -> None:
    tone = _tone(RATE, 0.25, 1000.0, 0.5)
    samples, rate = cp.decode_wav(_wav_bytes(tone, RATE, bits, float_format))
    tolerance = 1.5 / 128 if bits == 8 else 1e-4
    assert rate == RATE and np.max(np.abs(samples[:, 0] - tone)) < tolerance


def test_raw_pcm16_defaults_to_16k_mono() -> None:
    tone = _tone(RATE, 0.5, 300.0, 0.25)
    data = np.round(tone * 32767).astype("<i2").tobytes()
    samples, rate = cp.decode_audio(data, "clip.raw")
    assert rate == RATE and samples.shape == (len(tone), 1)
    assert np.max(np.abs(samples[:, 0] - tone)) < 1e-4
    eight_k, _ = cp.decode_audio(data, "clip.raw", raw_sample_rate=8_000)
    assert len(cp.to_mono_16k(eight_k, 8_000)) == 2 * len(tone)


def test_flac_and_mp3_through_soundfile(tmp_path: Path) -> None:
    soundfile = pytest.importorskip("soundfile")
    tone = _tone(22_050, 1.0, 440.0, 0.5)
    flac = tmp_path / "a.flac"
    soundfile.write(flac, tone, 22_050)
    decoded = cp.load_audio(flac)
    assert len(decoded) == pytest.approx(RATE, abs=2) and _dominant_hz(decoded) == pytest.approx(440, abs=2)
    if "MP3" in soundfile.available_formats():
        mp3 = tmp_path / "a.mp3"
        soundfile.write(mp3, tone, 22_050, format="MP3")
        decoded = cp.load_audio(mp3)
        assert _dominant_hz(decoded) == pytest.approx(440, abs=3)


def test_fft_resampler_fallback_matches_polyphase() -> None:
    tone = _tone(44_100, 0.5, 440.0, 0.5)
    fft = cp._fft_resample(tone, 44_100, RATE)
    poly = cp.resample(tone, 44_100, RATE)
    assert len(fft) == len(poly)
    assert np.max(np.abs(fft[1000:-1000] - poly[1000:-1000])) < 0.01


def test_real_clip_decodes(jfk_wav: str) -> None:
    audio = cp.load_audio(jfk_wav)
    assert len(audio) == 176_000 and 0.05 < float(np.max(np.abs(audio))) <= 1.0


# ----------------------------------------------------------------------------------------------- validation


def _manifest(tmp_path: Path, records: list[dict]) -> Path:
    path = tmp_path / "set.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in records) + "\n")
    return path


def test_manifest_relative_paths_and_round_trip(tmp_path: Path) -> None:
    (tmp_path / "audio").mkdir()
    (tmp_path / "audio" / "a.wav").write_bytes(_wav_bytes(_tone(RATE, 0.1), RATE))
    utterances = cp.load_manifest(_manifest(tmp_path, [{"id": "a", "audio": "audio/a.wav", "text": "hello"}]))
    assert utterances == [Utterance("a", str(tmp_path / "audio" / "a.wav"), "hello", "set")]
    copy = cp.write_manifest(utterances, tmp_path / "copy.jsonl")
    assert json.loads(copy.read_text())["audio"] == "audio/a.wav"
    assert cp.load_corpus(copy) == [Utterance("a", str(tmp_path / "audio" / "a.wav"), "hello", "copy")]


def test_missing_file_names_entry_and_file(tmp_path: Path) -> None:
    path = _manifest(tmp_path, [{"id": "utt-7", "audio": "gone.wav", "text": "hello"}])
    with pytest.raises(CorpusError, match=r"'utt-7'.*gone\.wav.*does not exist"):
        cp.load_manifest(path)


def test_empty_transcript_names_entry_and_file(tmp_path: Path) -> None:
    (tmp_path / "a.wav").write_bytes(_wav_bytes(_tone(RATE, 0.1), RATE))
    path = _manifest(tmp_path, [{"id": "utt-3", "audio": "a.wav", "text": "   "}])
    with pytest.raises(CorpusError, match=r"'utt-3'.*a\.wav.*empty transcript"):
        cp.load_manifest(path)


@pytest.mark.parametrize("payload", [b"this is not audio at all", b"RIFF\x10\x00\x00\x00WAVEfmt \x02\x00\x00\x00"])
def test_corrupt_file_names_entry_and_file(tmp_path: Path, payload: bytes) -> None:
    (tmp_path / "bad.wav").write_bytes(payload)
    path = _manifest(tmp_path, [{"id": "utt-9", "audio": "bad.wav", "text": "hello"}])
    utterances = cp.load_manifest(path)  # cheap checks pass; decoding fails
    with pytest.raises(CorpusError, match=r"'utt-9'.*bad\.wav.*unreadable audio"):
        cp.load_audio(utterances[0])
    with pytest.raises(CorpusError, match=r"'utt-9'.*bad\.wav"):
        cp.load_manifest(path, decode=True)


def test_malformed_manifest_line(tmp_path: Path) -> None:
    path = tmp_path / "m.jsonl"
    path.write_text('{"id": "a", "text": "no audio key"}\n')
    with pytest.raises(CorpusError, match=r"m\.jsonl:1"):
        cp.load_manifest(path)


def test_librispeech_layout(tmp_path: Path) -> None:
    soundfile = pytest.importorskip("soundfile")
    chapter = tmp_path / "train-clean-100" / "19" / "198"
    chapter.mkdir(parents=True)
    for name in ("19-198-0001", "19-198-0000"):
        soundfile.write(chapter / f"{name}.flac", _tone(RATE, 0.2), RATE)
    (chapter / "19-198-0000.trans.txt").write_text("19-198-0000 NORTHANGER ABBEY\n19-198-0001 WAS WRITTEN\n")
    utterances = cp.load_corpus(tmp_path / "train-clean-100")
    assert [(u.id, u.text, u.dataset) for u in utterances] == [
        ("19-198-0000", "NORTHANGER ABBEY", "train-clean-100"), ("19-198-0001", "WAS WRITTEN", "train-clean-100")]
    assert len(cp.load_audio(utterances[0])) == int(0.2 * RATE)
    (chapter / "19-198-0001.flac").unlink()
    with pytest.raises(CorpusError, match=r"'19-198-0001'.*19-198-0001\.flac"):
        cp.load_librispeech_dir(tmp_path)


def test_hf_dataset_dir_without_datasets_is_a_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "dataset_info.json").write_text("{}")
    monkeypatch.setitem(sys.modules, "datasets", None)  # makes `import datasets` fail
    with pytest.raises(CorpusError, match=r"pip install datasets"):
        cp.load_corpus(tmp_path)


# ------------------------------------------------------------------------------------- selections and pools

TEXTS = [
    "the cat sat on the mat",                       # 0 rare
    "a quixotic archivist smiled",                  # quixotic, archivist: 2 / 4
    "palimpsests",                                  # 1 / 1
    "we went to the shop",                          # 0
    "the amiable dashwood family",                  # amiable, dashwood: 2 / 4
    "he read the palimpsest in reykjavik today",    # palimpsest, reykjavik: 2 / 7
    "it was a good day",                            # 0
    "prudently he bowed",                           # prudently: 1 / 3
]


def _utterances(dataset: str = "d", texts: list[str] = TEXTS) -> list[Utterance]:
    return [Utterance(f"{dataset}-{i}", f"/x/{i}.wav", t, dataset) for i, t in enumerate(texts)]


def test_statistics() -> None:
    stats = cp.corpus_statistics(_utterances())
    assert (stats.utterances, stats.words, stats.rare_words) == (8, 35, 8)
    assert stats.rare_share == pytest.approx(8 / 35)


def test_seeded_random_selection_is_deterministic() -> None:
    corpus = [Utterance(str(i), f"/x/{i}.wav", "w") for i in range(1000)]
    first, again, other = (cp.select_random(corpus, 128, seed) for seed in (7, 7, 8))
    assert first == again and first != other
    assert len(first) == 128 and len({u.id for u in first}) == 128
    assert cp.select_random(corpus[:5], 128, 0) == corpus[:5]


def test_r_top_ranks_by_rare_density() -> None:
    ids = [u.id for u in cp.select_r_top(_utterances(), 4)]
    # 1/1; then 2/4 (two tie: order by id); then 1/3 (0.33) beats 2/7 (0.29)
    assert ids == ["d-2", "d-1", "d-4", "d-7"]


def test_r_mix_is_half_top_half_random_without_overlap() -> None:
    corpus = _utterances()
    mixed = cp.select_r_mix(corpus, 4, seed=3)
    assert [u.id for u in mixed[:2]] == ["d-2", "d-1"]
    assert not {u.id for u in mixed[2:]} & {"d-2", "d-1"} and len({u.id for u in mixed}) == 4
    assert mixed == cp.select_r_mix(corpus, 4, seed=3)
    seeds = {tuple(u.id for u in cp.select_r_mix(corpus, 4, seed=s)[2:]) for s in range(20)}
    assert len(seeds) > 1  # the natural half really is random
    assert cp.select_pool(corpus, "r-mix", 4, seed=3) == mixed


def test_r_cross_pools_sources_and_excludes_the_evaluation_set() -> None:
    sources = {"a": _utterances("a"), "b": _utterances("b", ["sesquipedalian obfuscation", "the day"])}
    chosen = cp.select_r_cross(sources, 3)
    # rho 1.0 twice: b-0 (2 rare words) before a-2 (1 rare word); then a-1 (0.5) wins its tie with a-4 by id
    assert [u.id for u in chosen] == ["b-0", "a-2", "a-1"]
    assert {u.dataset for u in cp.select_r_cross(sources, 3, evaluation_dataset="b")} == {"a"}
    with pytest.raises(CorpusError):
        cp.select_r_cross({"a": _utterances("a")}, 3, evaluation_dataset="a")


def test_hf_saved_dataset_reads_stored_audio_without_decoding_it(tmp_path: Path, jfk_wav: str) -> None:
    import datasets  # pinned by the dev extra (pyproject.toml): a datasets that cannot build this folder fails here

    stored = {"bytes": datasets.Value("binary"), "path": datasets.Value("string")}
    features = datasets.Features({"audio": stored, "sentence": datasets.Value("string")})
    rows = {"audio": [{"path": jfk_wav, "bytes": None}, {"path": None, "bytes": Path(jfk_wav).read_bytes()}],
            "sentence": ["ask not", "what your country"]}
    datasets.DatasetDict({"train": datasets.Dataset.from_dict(rows, features=features)}).save_to_disk(tmp_path)
    utterances = cp.load_corpus(tmp_path, dataset="jfk-hf")
    assert [(u.id, u.text, u.dataset) for u in utterances] == [
        ("jfk-hf-000000", "ask not", "jfk-hf"), ("jfk-hf-000001", "what your country", "jfk-hf")]
    assert np.array_equal(cp.load_audio(utterances[0]), cp.load_audio(utterances[1]))
