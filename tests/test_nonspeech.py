"""Non-speech clips (tarq_deploy/data/nonspeech.py): lengths, levels, spectra, determinism, the manifest they are
written to and its strict reader (fuzzed), and `tarq-deploy corpus nonspeech`."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from helpers import JSON_VALUES, Seed, fresh_path, hang_guard, mutated, run_cli, write_wav
from hypothesis import event, given
from hypothesis import strategies as st

from tarq_deploy import cli
from tarq_deploy.data.corpus import CorpusError, Utterance, load_audio, load_corpus, write_manifest
from tarq_deploy.data.nonspeech import (DEFAULT_LEVELS_DBFS, NONSPEECH_KINDS, NONSPEECH_MANIFEST, PEAK_LIMIT,
                                        NonspeechError, at_level, babble, build_nonspeech_clips,
                                        load_nonspeech_manifest, make_clip, pink_noise, rms_dbfs, white_noise,
                                        write_nonspeech_corpus)

RATE = 16_000


def _speech_like(seconds: float, seed: int) -> np.ndarray:
    """Sine bursts with gaps: something with speech's on-off rhythm, in milliseconds."""
    rng = np.random.default_rng(seed)
    t = np.arange(int(RATE * seconds)) / RATE
    bursts = (np.sin(2 * np.pi * 3 * t) > 0).astype(np.float64)
    return (0.3 * bursts * np.sin(2 * np.pi * rng.uniform(150, 400) * t)).astype(np.float32)


@pytest.fixture(scope="module")
def speech() -> list[np.ndarray]:
    return [_speech_like(1.0 + 0.3 * i, i) for i in range(4)]


@pytest.fixture(scope="module")
def clips(speech) -> list:
    return build_nonspeech_clips(1.5, seed=7, per_kind=2, babble_sources=speech)


# ------------------------------------------------------------------------------------------------------ signals
def test_every_kind_has_its_length_and_level_and_never_clips(clips) -> None:
    assert sorted({c.kind for c in clips}) == sorted(NONSPEECH_KINDS) and len(clips) == 2 * len(NONSPEECH_KINDS)
    for clip in clips:
        assert clip.audio.dtype == np.float32 and len(clip.audio) == round(1.5 * RATE) and clip.seconds == 1.5
        assert float(np.max(np.abs(clip.audio))) <= PEAK_LIMIT < 1.0
        expected = DEFAULT_LEVELS_DBFS[clip.kind]
        if expected is None:
            assert not np.any(clip.audio) and clip.level_dbfs is None  # digital silence: exactly zero
        else:
            assert rms_dbfs(clip.audio) == pytest.approx(expected, abs=0.05) == clip.level_dbfs
    low = [c for c in clips if c.kind == "low-noise"]
    assert all(rms_dbfs(c.audio) < -50 for c in low)


def test_a_peak_that_would_clip_is_scaled_down_not_cut() -> None:
    impulse = np.zeros(1000)
    impulse[500] = 1.0  # RMS -30 dBFS at full scale: at -10 dBFS its peak would be 10x over
    scaled = at_level(impulse, -10.0)
    assert float(np.max(np.abs(scaled))) == pytest.approx(PEAK_LIMIT, rel=1e-6)
    assert np.count_nonzero(scaled) == 1  # a scaled copy: no sample was cut to the limit


def _band_density(audio: np.ndarray, low_hz: float, high_hz: float) -> float:
    """Mean power per Hz in [low, high), averaged over 4096-sample frames."""
    frames = audio[: len(audio) // 4096 * 4096].reshape(-1, 4096) * np.hanning(4096)
    power = np.mean(np.abs(np.fft.rfft(frames, axis=1)) ** 2, axis=0)
    frequencies = np.fft.rfftfreq(4096, 1 / RATE)
    return float(power[(frequencies >= low_hz) & (frequencies < high_hz)].mean())


def test_pink_noise_power_falls_as_one_over_f_and_white_stays_flat() -> None:
    rng = np.random.default_rng(3)
    bands = [(100, 200), (400, 800), (1600, 3200), (4000, 8000)]
    pink, white = pink_noise(8 * RATE, -30.0, rng), white_noise(8 * RATE, -30.0, rng)
    pink_density = [_band_density(pink, *band) for band in bands]
    assert pink_density == sorted(pink_density, reverse=True)
    centres = np.log10([np.sqrt(a * b) for a, b in bands])
    slope = np.polyfit(centres, np.log10(pink_density), 1)[0]
    assert -1.2 < slope < -0.8  # power ~ 1/f: a decade of frequency, a decade of power
    white_density = [_band_density(white, *band) for band in bands]
    assert max(white_density) / min(white_density) < 1.3


def test_babble_is_made_of_the_reversed_speech(speech) -> None:
    source = speech[0][:3000].astype(np.float64)
    mix = babble([source], 2000, -30.0, np.random.default_rng(0), talkers=1).astype(np.float64)
    tiled = np.concatenate([source[::-1]] * 3)
    windows = np.lib.stride_tricks.sliding_window_view(tiled, len(mix))
    fits = windows @ mix / (np.linalg.norm(windows, axis=1) * np.linalg.norm(mix) + 1e-12)
    assert fits.max() > 0.9999  # one talker is a scaled slice of the source played backwards
    with pytest.raises(NonspeechError, match="babble"):
        babble([], 100, -30.0, np.random.default_rng(0))


def test_clips_are_the_same_for_a_seed_and_differ_across_seeds(speech) -> None:
    for kind in NONSPEECH_KINDS:
        first = make_clip(kind, 8000, np.random.default_rng(1), babble_sources=speech)
        again = make_clip(kind, 8000, np.random.default_rng(1), babble_sources=speech)
        other = make_clip(kind, 8000, np.random.default_rng(2), babble_sources=speech)
        assert first.tobytes() == again.tobytes(), kind
        assert (first.tobytes() != other.tobytes()) == (kind != "silence"), kind


def test_leaving_a_kind_out_changes_no_other_clip(clips) -> None:
    without_babble = build_nonspeech_clips(1.5, seed=7, per_kind=2, kinds=("white", "music"))
    by_id = {c.id: c.audio for c in clips}
    assert all(by_id[c.id].tobytes() == c.audio.tobytes() for c in without_babble)


def test_bad_requests_are_refused_by_name() -> None:
    with pytest.raises(NonspeechError, match="babble needs speech"):
        build_nonspeech_clips(1.0, 0)
    with pytest.raises(NonspeechError, match="unknown non-speech kind"):
        build_nonspeech_clips(1.0, 0, kinds=("silence", "thunder"))
    with pytest.raises(NonspeechError, match="positive length"):
        build_nonspeech_clips(0.0, 0, kinds=("white",))


# -------------------------------------------------------------------------------------------------------- files
def test_corpus_round_trips_and_the_speech_reader_refuses_it(clips, tmp_path: Path) -> None:
    manifest = write_nonspeech_corpus(tmp_path, clips)
    assert manifest == tmp_path / NONSPEECH_MANIFEST
    entries = load_nonspeech_manifest(manifest, decode=True)
    assert [(e.id, e.kind, e.seconds, e.level_dbfs) for e in entries] == \
        [(c.id, c.kind, c.seconds, c.level_dbfs) for c in clips]
    for entry, clip in zip(entries, clips):
        decoded = load_audio(entry.audio)
        assert len(decoded) == len(clip.audio) and np.max(np.abs(decoded - clip.audio)) < 2 / 32768
        if clip.kind == "silence":
            assert not np.any(decoded)
    with pytest.raises(CorpusError, match="empty transcript"):  # why non-speech clips have a reader of their own
        load_corpus(manifest)


def _write_lines(path: Path, records: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


@pytest.mark.parametrize(("edit", "problem"), [
    ({"text": "hello"}, "empty transcript"),
    ({"kind": "thunder"}, "unknown kind"),
    ({"seconds": 0}, "'seconds' must be positive"),
    ({"seconds": True}, "finite number"),
    ({"level_dbfs": 3.0}, "below full scale"),
    ({"audio": "missing.wav"}, "does not exist"),
    ({"extra": 1}, "unknown field"),
])
def test_a_bad_entry_is_refused_naming_file_and_line(tmp_path: Path, edit: dict, problem: str) -> None:
    write_wav(tmp_path / "a.wav", 0.1)
    good = {"id": "a", "audio": "a.wav", "text": "", "kind": "white", "seconds": 0.1, "level_dbfs": -30.0}
    manifest = _write_lines(tmp_path / "n.jsonl", [good, {**good, "id": "b", **edit}])
    with pytest.raises(NonspeechError, match=problem) as caught:
        load_nonspeech_manifest(manifest)
    assert str(caught.value).startswith(f"{manifest}:2: ") and "\n" not in str(caught.value)


def test_duplicate_ids_and_non_utf8_are_refused(tmp_path: Path) -> None:
    write_wav(tmp_path / "a.wav", 0.1)
    good = {"id": "a", "audio": "a.wav", "text": "", "kind": "white", "seconds": 0.1, "level_dbfs": None}
    with pytest.raises(NonspeechError, match=r"n\.jsonl:2: duplicate clip id"):
        load_nonspeech_manifest(_write_lines(tmp_path / "n.jsonl", [good, good]))
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(b'{"id": "a"}\n{"id": "\xff"}\n')
    with pytest.raises(NonspeechError, match=r"bad\.jsonl:2: not UTF-8"):
        load_nonspeech_manifest(bad)


# ------------------------------------------------------------------------------------------------------ fuzzing
@pytest.fixture(scope="module")
def fuzz_dir(tmp_path_factory, clips) -> Path:
    folder = tmp_path_factory.mktemp("nonspeech-fuzz")
    write_nonspeech_corpus(folder, clips[:4])
    return folder


@st.composite
def edited_records(draw: st.DrawFn, records: list[dict]) -> list:
    """The records with a few fields replaced, deleted or added, or a record replaced by another JSON value."""
    records = [dict(r) for r in records]
    for _ in range(draw(st.integers(1, 3))):
        index = draw(st.integers(0, len(records) - 1))
        if not isinstance(records[index], dict) or draw(st.integers(0, 9)) == 0:
            records[index] = draw(JSON_VALUES)
            continue
        key = draw(st.sampled_from(sorted(records[index]) + ["extra"]))
        if draw(st.booleans()):
            records[index][key] = draw(JSON_VALUES)
        else:
            records[index].pop(key, None)
    return records


def refuses_naming(path: Path, read, error: type[Exception]) -> None:
    """``read()`` parses, or raises ``error`` naming ``path`` on one line, an error the CLI reports as the user's."""
    with hang_guard():
        try:
            read()
        except error as problem:
            assert str(path) in str(problem), problem
            assert "\n" not in cli.user_error_message(problem)
            event("refused")
        else:
            event("parsed")


@given(data=st.data())
def test_fuzzed_nonspeech_manifests_parse_or_raise_the_named_error(fuzz_dir, data) -> None:
    records = [json.loads(line) for line in (fuzz_dir / NONSPEECH_MANIFEST).read_text().splitlines()]
    text = "".join(json.dumps(r, ensure_ascii=data.draw(st.booleans())) + "\n"
                   for r in data.draw(edited_records(records)))
    raw = text.encode()
    if data.draw(st.booleans()):
        raw = data.draw(mutated(Seed(raw, tuple(range(len(raw))))))
    path = fresh_path(fuzz_dir, ".jsonl")
    path.write_bytes(raw)
    refuses_naming(path, lambda: load_nonspeech_manifest(path), NonspeechError)


# ---------------------------------------------------------------------------------------------------------- CLI
def test_cli_writes_clips_and_says_why_babble_is_missing(tmp_path: Path, capsys) -> None:
    out = tmp_path / "ns"
    run = run_cli(capsys, "corpus", "nonspeech", "-o", out, "--seconds", "0.5", "--per-kind", "1", "--seed", "3")
    assert run.status == 0, run.err
    assert "babble: left out" in run.out and "--babble-from" in run.out
    entries = load_nonspeech_manifest(out / NONSPEECH_MANIFEST, decode=True)
    assert sorted(e.kind for e in entries) == sorted(set(NONSPEECH_KINDS) - {"babble"})


def test_cli_builds_babble_from_a_manifest(tmp_path: Path, capsys) -> None:
    speech = [Utterance(f"s{i}", str(write_wav(tmp_path / f"s{i}.wav", 0.6, seed=i)), "some words here")
              for i in range(3)]
    manifest = write_manifest(speech, tmp_path / "speech.jsonl")
    out = tmp_path / "ns"
    run = run_cli(capsys, "corpus", "nonspeech", "-o", out, "--seconds", "0.5", "--per-kind", "1",
                  "--babble-from", manifest)
    assert run.status == 0, run.err
    assert "babble" in {e.kind for e in load_nonspeech_manifest(out / NONSPEECH_MANIFEST)}


@pytest.mark.parametrize(("options", "named"), [
    (["--seconds", "0"], "--seconds"), (["--seconds", "nan"], "--seconds"), (["--seconds", "0.00001"], "--seconds"),
    (["--seconds", "601"], "--seconds"), (["--per-kind", "0"], "--per-kind"),
])
def test_cli_refuses_bad_options_by_name_before_writing(tmp_path: Path, capsys, options: list, named: str) -> None:
    out = tmp_path / "ns"
    run = run_cli(capsys, "corpus", "nonspeech", "-o", out, *options)
    assert run.status == 2 and named in run.message and len(run.message.splitlines()) == 1
    assert not out.exists()


def test_the_sweep_report_merges_each_cells_nonspeech_figures(tmp_path: Path) -> None:
    """A sweep's eval steps each report their own cell on the clips; the merged report gives every cell's rate and
    its excess over the F16 cell's, and renders the section under the model."""
    from types import SimpleNamespace

    from tarq_deploy.sweep import report as sweep_report

    def cell(name: str, words_per_minute: float) -> SimpleNamespace:
        path = tmp_path / f"{name.replace('/', '_')}.json"
        figures = {"words_per_minute": words_per_minute, "by_kind": {"music": {"words_per_minute": words_per_minute}}}
        path.write_text(json.dumps({"nonspeech": {"manifest": "ns.jsonl", "clips": 2, "minutes": 1.0,
                                                  "models": {f"{name} [whisper.cpp]": figures}}}))
        return SimpleNamespace(name=name, steps={"eval": name}, path=path)

    cells = [cell("base/f16", 0.5), cell("base/ggml/q4_0", 0.5), cell("base/tarq/q4_0", 19.5)]
    run = SimpleNamespace(results={c.name: SimpleNamespace(outputs={"report": str(c.path)}) for c in cells})
    merged = sweep_report._nonspeech(cells, run, "base/f16", several=False)
    assert merged["models"]["base/tarq/q4_0"]["words_per_minute"] == 19.5
    assert merged["excess_over_baseline"] == {"base/ggml/q4_0": 0.0, "base/tarq/q4_0": 19.0}
    several = sweep_report._nonspeech(cells, run, "base/f16", several=True)
    assert several["excess_over_baseline"]["base/tarq/q4_0 [whisper.cpp]"] == 19.0
    rendered = "\n".join(sweep_report.render_nonspeech(merged))
    assert "| base/tarq/q4_0 | 19.50 | +19.00 | 19.50 |" in rendered
    assert sweep_report._nonspeech(cells[:1], SimpleNamespace(results={"base/f16": SimpleNamespace(
        outputs={"report": str(_without_nonspeech(tmp_path))})}), "base/f16", several=False) is None


def _without_nonspeech(folder: Path) -> Path:
    path = folder / "plain-report.json"
    path.write_text(json.dumps({"datasets": []}))
    return path
