"""quantize --nonspeech-share: Whisper calibration windows without speech (silence, noise, babble, music) whose
decoder prompt predicts the end of text at once, beside the speech windows (models/whisper.py)."""
from __future__ import annotations

import json

import pytest

from helpers import (assert_refused_for_a_model_that_is_not_whisper, assert_user_error, quantize_options_for,
                     run_cli)


def test_the_share_adds_nonspeech_windows_kinds_in_turn(tiny, real_clips):
    """Half as many non-speech windows as speech windows, kinds in turn, their decoder input the prompt alone with
    no tail tag; their samples come from a seed stream no `corpus nonspeech --seed` clip uses; the speech windows
    stay as they were."""
    import torch

    from tarq_deploy.data.corpus import load_audio
    from tarq_deploy.data.nonspeech import NONSPEECH_KINDS, build_nonspeech_clips
    from tarq_deploy.models.common import TextAudio
    from tarq_deploy.models.whisper import WhisperBackbone

    model, processor, gc = tiny
    backbone = WhisperBackbone(model, processor, gc)
    clips = [TextAudio(c.id, load_audio(str(c.path)), c.text) for c in real_clips[:4]]
    plain = backbone.build_windows(clips, pack=False, encoder_tagging="none")
    mixed = backbone.build_windows(clips, pack=False, encoder_tagging="none", nonspeech_share=0.5, seed=3)
    assert len(mixed) == len(plain) + 2
    for before, after in zip(plain, mixed):
        assert torch.equal(before.inputs["input_features"], after.inputs["input_features"])
        assert "nonspeech" not in after.info
    extra = mixed[len(plain):]
    assert [w.info["nonspeech"] for w in extra] == list(NONSPEECH_KINDS[:2])
    for window in extra:
        assert window.inputs["decoder_input_ids"][0].tolist() == backbone.prompt_ids()
        assert not window.masks["tokens"].any() and not window.masks["frames"].any()
        assert window.info["speech_frames"] == 0 and window.info["rare_tokens"] == 0
    # the low-noise window is not the clip `corpus nonspeech --seed 3` writes
    held_out = build_nonspeech_clips(30.0, 3, kinds=("low-noise",))[0].audio
    features = processor.feature_extractor(held_out, sampling_rate=16000, return_tensors="pt").input_features
    assert not torch.equal(features, extra[1].inputs["input_features"])
    again = backbone.build_windows(clips, pack=False, encoder_tagging="none", nonspeech_share=0.5, seed=3)
    assert torch.equal(again[-1].inputs["input_features"], extra[-1].inputs["input_features"])


def test_nonspeech_windows_run_through_the_alignment_pass(tiny, real_clips):
    """With the alignment pass (which encodes and decodes every window when the fp stream is kept), the speech
    windows' rare frames are tagged as without the non-speech windows."""
    from tarq_deploy.data.corpus import load_audio
    from tarq_deploy.models.common import TextAudio
    from tarq_deploy.models.whisper import WhisperBackbone

    model, processor, gc = tiny
    backbone = WhisperBackbone(model, processor, gc)
    clips = [TextAudio(c.id, load_audio(str(c.path)), c.text) for c in real_clips[:3]]
    plain = backbone.build_windows(clips, keep_fp_bytes=2**34)
    mixed = backbone.build_windows(clips, keep_fp_bytes=2**34, nonspeech_share=1.0)
    assert [w.info["rare_frames"] for w in mixed[:len(plain)]] == [w.info["rare_frames"] for w in plain]
    assert all(w.info["rare_frames"] == 0 for w in mixed[len(plain):])


@pytest.mark.parametrize("share", ["1.5", "-0.1", "nan"])
def test_a_share_outside_0_to_1_is_refused(capsys, tmp_path, monkeypatch, corpus, share):
    monkeypatch.chdir(tmp_path)
    status, _, err = run_cli(capsys, "quantize", "--model", "packaged:tiny.en", "--calib", str(corpus),
                             "--nonspeech-share", share, "--out", "o")
    assert_user_error(status, err, f"--nonspeech-share {float(share)}", "between 0 and 1")
    assert list(tmp_path.iterdir()) == []


def test_the_share_is_refused_for_a_model_that_is_not_whisper(capsys, tmp_path, monkeypatch, corpus):
    monkeypatch.chdir(tmp_path)
    assert_refused_for_a_model_that_is_not_whisper(capsys, tmp_path, corpus, ["--nonspeech-share", "0.2"],
                                                   "--nonspeech-share 0.2", "not a Whisper model")


def test_the_share_is_read_only_where_a_corpus_is_and_recorded_only_when_set():
    rounding = quantize_options_for("packaged:tiny.en", method="ggml", type="q4_0", nonspeech_share=0.3)
    assert rounding.nonspeech_share == 0.0 and "nonspeech_share" not in rounding.result_knobs()
    given = quantize_options_for("packaged:tiny.en", method="tarq", type="q4_0", nonspeech_share=0.3)
    assert given.nonspeech_share == 0.3 and given.result_knobs()["nonspeech_share"] == 0.3
    default = quantize_options_for("packaged:tiny.en", method="tarq", type="q4_0")
    assert default.nonspeech_share == 0.0 and "nonspeech_share" not in default.result_knobs()


def test_quantize_with_nonspeech_windows_records_them(tmp_path, corpus):
    """End to end on tiny.en (two short utterances: one speech window): the manifest names the non-speech window the
    calibration ran on and records the knob; the speech windows' figures stay the speech windows' own."""
    from tarq_deploy import cli

    out = tmp_path / "ck"
    assert cli.main(["quantize", "--model", "packaged:tiny.en", "--calib", str(corpus), "--type", "q4_0",
                     "--nonspeech-share", "1", "--out", str(out)]) == 0
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["method"]["nonspeech_share"] == 1.0
    assert manifest["calibration"]["nonspeech_windows"] == ["nonspeech:silence-00"]
    assert manifest["calibration"]["windows"] == 1
    assert manifest["calibration"]["padding_frame_share"] == pytest.approx(1 - 3.3 / 30, abs=0.005)  # speech only
