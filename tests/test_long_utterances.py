"""An utterance longer than Whisper's 30 s window is refused by name, never silently cut: the feature extractor would
keep its first 30 s and the whole transcript would be taught (calibration) or scored (teacher-forced) against audio
that no longer holds its last words."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import soundfile

from tarq_deploy import cli
from tarq_deploy.data.corpus import CorpusError, Utterance, load_audio, refuse_longer_than
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


def test_quantize_refuses_a_40_second_utterance_before_calibrating(long_manifest, tmp_path, capsys):
    out = tmp_path / "ckpt"
    status = cli.main(["quantize", "--model", "packaged:tiny.en", "--calib", str(long_manifest), "--method", "gptq",
                       "--n-calib", "2", "-o", str(out)])
    err = capsys.readouterr().err.strip().splitlines()[-1]  # after the audio decoding's progress bar
    assert status == 2, err
    assert err.startswith("tarq-deploy quantize: error: corpus entry 'forty-seconds'") and "40.0 s long" in err, err
    assert not out.exists() and not list(tmp_path.glob("ckpt*"))  # nothing written, no work folder left either


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
