"""An utterance longer than Whisper's 30 s window is never silently cut (the feature extractor would keep its first
30 s while the whole transcript is taught or scored): calibration segments it -- by a NeMo manifest's offset /
duration, or at the full-precision model's own timestamps aligned to its transcript -- and refuses by name what
cannot be aligned; the teacher-forced figures refuse it."""
from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
import soundfile

from tarq_deploy import cli
from tarq_deploy.data.corpus import CorpusError, Utterance, load_audio, load_corpus, refuse_longer_than
from tarq_deploy.data.real_clips import all_real_clips

RATE = 16_000


@pytest.fixture(scope="module")
def long_manifest(tmp_path_factory) -> Path:
    """A manifest of one real clip and one 40 s recording (real clips end to end, their transcripts joined)."""
    folder = tmp_path_factory.mktemp("long")
    clips = [c for c in all_real_clips() if c.id != "jfk"]
    pieces, texts, seconds = [], [], 0.0
    for clip in clips * 2:  # the clips are 37 s together
        audio = load_audio(clip.path)
        pieces.append(audio)
        texts.append(clip.text)
        seconds += len(audio) / RATE
        if seconds >= 40:
            break
    long_audio = np.concatenate(pieces)[: 40 * RATE]
    soundfile.write(folder / "long.wav", long_audio, RATE, subtype="PCM_16")
    rows = [{"id": clips[0].id, "audio": str(clips[0].path), "text": clips[0].text},
            {"id": "forty-seconds", "audio": str(folder / "long.wav"), "text": " ".join(texts)}]
    manifest = folder / "calib.jsonl"
    manifest.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return manifest


def test_the_limit_is_inclusive_and_names_the_entry():
    utterances = [Utterance("exact", "a.wav", "x"), Utterance("over", "b.wav", "y", origin="m.jsonl:2")]
    audios = [np.zeros(30 * RATE, np.float32), np.zeros(30 * RATE + 160, np.float32)]
    refuse_longer_than(utterances[:1], audios[:1], 30.0, "a window")  # exactly 30 s fits
    with pytest.raises(CorpusError, match=r"'over' \(m.jsonl:2, file b.wav\): is 30.0 s long; a window takes at most "
                                          r"30 s"):
        refuse_longer_than(utterances, audios, 30.0, "a window")


def test_quantize_segments_a_40_second_utterance_at_the_models_timestamps(long_manifest, tmp_path, capsys):
    """The full-precision model's own timestamped decode, aligned to the transcript, cuts it into pieces of at most
    30 s, each with its words; the log says so."""
    out = tmp_path / "ckpt"
    status = cli.main(["quantize", "--model", "packaged:tiny.en", "--calib", str(long_manifest), "--method", "gptq",
                       "--n-calib", "2", "-o", str(out)])
    captured = capsys.readouterr()
    assert status == 0, captured.err[-2000:]
    said = [line for line in captured.out.splitlines() if "segmented into" in line]
    assert said and "'forty-seconds' (40.0 s)" in said[0] and "aligned to its transcript" in said[0], captured.out
    spans = re.findall(r"(\d+\.\d)-(\d+\.\d) s", said[0])
    assert len(spans) >= 2 and all(float(b) - float(a) <= 30.0 for a, b in spans)
    assert float(spans[0][0]) == 0.0 and float(spans[-1][1]) == 40.0


def test_a_nemo_manifest_cuts_each_entry_from_its_file(long_manifest, tmp_path, capsys):
    """NeMo's audio_filepath / offset / duration: each entry is its stretch of the 40 s file (said in the log)."""
    long_wav = long_manifest.parent / "long.wav"
    rows = [{"audio_filepath": str(long_wav), "offset": 0.0, "duration": 20.0, "text": "and mister john dashwood"},
            {"audio_filepath": str(long_wav), "offset": 20.0, "duration": 20.0, "text": "he might even have been"}]
    manifest = tmp_path / "nemo.jsonl"
    manifest.write_text("".join(json.dumps(r) + "\n" for r in rows))
    utterances = load_corpus(manifest)
    whole = load_audio(long_wav)
    assert [u.id for u in utterances] == [f"{long_wav}@0", f"{long_wav}@20"]
    assert np.array_equal(load_audio(utterances[1]), whole[20 * RATE: 40 * RATE])
    out = tmp_path / "ckpt"
    status = cli.main(["quantize", "--model", "packaged:tiny.en", "--calib", str(manifest), "--method", "gptq",
                       "--n-calib", "2", "-o", str(out)])
    captured = capsys.readouterr()
    assert status == 0, captured.err[-2000:]
    assert "2 entries cut from their files by the manifest's offset/duration" in captured.out


def test_a_40_second_utterance_whose_transcript_does_not_align_is_refused(long_manifest, tmp_path, capsys):
    rows = [{"id": "unrelated", "audio": str(long_manifest.parent / "long.wav"),
             "text": "the quick brown fox jumps over the lazy dog " * 12}]
    manifest = tmp_path / "calib.jsonl"
    manifest.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "ckpt"
    status = cli.main(["quantize", "--model", "packaged:tiny.en", "--calib", str(manifest), "--method", "gptq",
                       "--n-calib", "1", "-o", str(out)])
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert status == 2, err
    assert err.startswith("tarq-deploy quantize: error: corpus entry 'unrelated'") and "40.0 s long" in err, err
    assert "could not be aligned" in err
    assert not out.exists() and not list(tmp_path.glob("ckpt*"))  # nothing written, no work folder left either


@pytest.mark.parametrize("bad, problem", [({"offset": -1.0, "duration": 2.0}, "'offset' must be"),
                                          ({"offset": 1.0}, "needs its 'duration'"),
                                          ({"duration": 0}, "'duration' must be positive"),
                                          ({"offset": 39.0, "duration": 5.0}, "reaches past the file's end")])
def test_bad_offsets_and_durations_are_named_by_file_and_line(long_manifest, tmp_path, bad, problem):
    manifest = tmp_path / "nemo.jsonl"
    manifest.write_text(json.dumps({"audio_filepath": str(long_manifest.parent / "long.wav"), "text": "words here",
                                    **bad}) + "\n")
    with pytest.raises(CorpusError, match=re.escape(problem)) as caught:
        load_audio(load_corpus(manifest)[0])
    assert str(manifest) in str(caught.value)


def test_teacher_forced_eval_refuses_it_before_any_model_runs(long_manifest, tmp_path, capsys):
    """Decoding takes a long recording whole (tests/test_long_form_decode.py); the teacher-forced figures read one
    window and refuse it by name."""
    out = tmp_path / "eval"
    status = cli.main(["eval", "--data", str(long_manifest), "--model", "f16=packaged:tiny.en", "--backend", "torch",
                       "--reference", "f16", "--teacher-forced-only", "-o", str(out), "--quiet"])
    err = capsys.readouterr().err.strip()
    assert status == 2, err
    assert "'forty-seconds'" in err and "--teacher-forced" in err and len(err.splitlines()) == 1, err
    assert not out.exists()
