"""The grid types in stock whisper.cpp (issue 38): TARQ calibrates real Whisper base onto IQ3_S and IQ3_XXS (3 real
clips) and onto IQ2_S and IQ2_XS (128 synthetic utterances made here by `corpus synth`: voices slt and joe, sentences
and voices disjoint from the real clips) through the CLI; the export is bit-exact (verify) and whisper.cpp
(pywhispercpp) transcribes the real clips the calibration did not see (all 12 at 2 bits, 9 at 3 bits) within a
capped-WER bound. IQ2_S and IQ2_XS nearest points of base (data-free) export bit-exactly and run on a short clip. What
ggml cannot quantize is refused in one line.

The bound is on the held-out clips together, not on jfk alone: at 2 bits one 22-word clip swings with the rounding of a
near tie. jfk's WER from four calibration corpora (seeds 0-3) was 0.27 / 0 / 0.14 / 0 at IQ2_XS, so the earlier bound
of 0.25 on jfk alone failed from seed 0 and from a change that only reordered float sums (992a7ae). Capped WER on the 12
clips (whisper.cpp, greedy; 2-core AMD EPYC family 25, 2026-11-29; `tarq-deploy eval`'s scoring):

| model | seed 0 | seed 1 | seed 2 (this test's) | seed 3 |
|---|---|---|---|---|
| TARQ IQ2_S, 128 synthetic | 0.094 | 0.128 | 0.128 | 0.171 |
| TARQ IQ2_XS, 128 synthetic | 0.188 | 0.162 | 0.179 (four "five"s) | 0.222 (a long loop on "five five") |
| the same, metric factored otherwise (992a7ae: equal in exact arithmetic) | 0.308 | 0.222 | 0.453 (a loop on jfk) | 0.171 |

and on the 9 clips not calibrated on: TARQ IQ3_S 0.096, IQ3_XXS 0.151 (the same on one and two torch threads). For
scale: the float model 0.043; the nearest points, IQ2_S 0.90 and IQ2_XS 0.98 (loops on 4 and 5 of the 12 clips). A
change of float rounding alone moved IQ2_XS from 0.18 to 0.45 on this test's corpus, so its bound (0.6) sits above
that with margin, and still far below an uncalibrated or misexported model; the other bounds sit 0.15-0.18 above
their runs."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import calibration_clips, check_tarq_export, exports_exactly_and_transcribes, run_cli, transcribe_whisper_cpp_clips

from tarq_deploy.cli import main as cli
from tarq_deploy.data.corpus import Utterance, write_manifest
from tarq_deploy.data.real_clips import all_real_clips
from tarq_deploy.evaluate.wer import metric_counts, ratio, score_utterance
from tarq_deploy.formats.ggml_file import read_whisper_cpp
from tarq_deploy.quant.ggml_types import type_by_name
from tarq_deploy.formats.model_loader import load_whisper

pytestmark = pytest.mark.usefixtures("one_torch_thread")
SHORT_CLIP = "cards-001"  # 1.1 s: a garbled 2-bit model loops to the window's last token, over a second of audio
N_SYNTH_CALIB, SYNTH_SEED = 128, 2
CALIBRATION_TIMEOUT_S = 1200
HELD_OUT_CAPPED_WER = {"iq3_s": 0.25, "iq3_xxs": 0.30, "iq2_s": 0.35, "iq2_xs": 0.60}  # measured: see above


@pytest.fixture(scope="module")
def real_calib(tmp_path_factory) -> Path:
    return write_manifest([Utterance(c.id, str(c.path), c.text) for c in calibration_clips()],
                          tmp_path_factory.mktemp("calib") / "calib.jsonl")


@pytest.fixture(scope="module")
def synthetic_calib(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("synth")
    assert cli(["corpus", "synth", "--out", str(out), "--n", "1", "--n-calib", str(N_SYNTH_CALIB),
                "--seed", str(SYNTH_SEED)]) == 0
    return out / "calib.jsonl"


def quantize_tarq_of_base(type_name: str, calib: Path, n_calib: int, ckpt: Path) -> None:
    """``tarq-deploy quantize`` in its own process, on torch's default threads (this module runs on one)."""
    run = subprocess.run([sys.executable, "-m", "tarq_deploy.cli", "quantize", "--model", "packaged:base", "--method",
                          "tarq", "--type", type_name, "--calib", str(calib), "--n-calib", str(n_calib), "--out",
                          str(ckpt)], capture_output=True, text=True, timeout=CALIBRATION_TIMEOUT_S)
    assert run.returncode == 0, run.stderr[-2000:]


@pytest.mark.parametrize("type_name, calibration", [("iq3_s", "real"), ("iq3_xxs", "real"), ("iq2_s", "synthetic"),
                                                     ("iq2_xs", "synthetic")])
def test_tarq_on_a_grid_type_of_base_transcribes_held_out_clips_in_whisper_cpp(request, capsys, tmp_path, type_name,
                                                                                calibration):
    calib = request.getfixturevalue(f"{calibration}_calib")
    n_calib = N_SYNTH_CALIB if calibration == "synthetic" else len(calibration_clips())
    ckpt, out = tmp_path / "ck", tmp_path / f"{type_name}.bin"
    quantize_tarq_of_base(type_name, calib, n_calib, ckpt)
    check_tarq_export(capsys, ckpt, out, type_name)
    model = read_whisper_cpp(out)
    assert model.tensors["decoder.token_embedding.weight"].ggml_type == type_by_name(type_name)
    knobs = json.loads((ckpt / "manifest.json").read_text())["method"]
    assert knobs.get("lookup_pass", False) == (type_name == "iq2_xs")  # --lookup-pass auto
    calibrated_on = {clip.id for clip in calibration_clips()} if calibration == "real" else set()
    held_out = [clip for clip in all_real_clips() if clip.id not in calibrated_on]
    texts = transcribe_whisper_cpp_clips(out, [str(c.path) for c in held_out])
    wer = capped_wer(held_out, texts)
    assert wer <= HELD_OUT_CAPPED_WER[type_name], list(zip([c.id for c in held_out], texts))


def capped_wer(clips: list, texts: list[str]) -> float:
    """The eval command's capped WER over ``clips``: word errors under Whisper's normaliser, each clip's capped at its
    word count (a loop on a two-word clip costs 2, not 100), per reference word."""
    return ratio(*metric_counts([score_utterance(c.id, c.text, text) for c, text in zip(clips, texts)])["capped_wer"])


@pytest.fixture(scope="module")
def base():
    return load_whisper("packaged:base")


@pytest.mark.parametrize("type_name", ["iq2_s", "iq2_xs"])
def test_the_other_grids_of_base_export_exactly_and_run_in_whisper_cpp(base, tmp_path, type_name):
    clip = next(c for c in all_real_clips() if c.id == SHORT_CLIP)
    assert isinstance(exports_exactly_and_transcribes(base, type_name, tmp_path, str(clip.path)), str)


@pytest.mark.parametrize("argv, match", [
    (["quantize", "--model", "packaged:base", "--method", "ggml", "--type", "iq2_xs", "--out", "o"],
     "--method ggml: ggml's iq2_xs quantizer needs an importance matrix (use --method imatrix)"),
    (["export", "--target", "whisper.cpp", "--model", "packaged:base", "--baseline", "ggml", "--type", "iq2_xs",
      "-o", "x.bin"], "--baseline: ggml's iq2_xs quantizer needs an importance matrix"),
    (["quantize", "--model", "packaged:tiny.en", "--method", "rtn", "--type", "iq3_s", "--out", "o"],
     "384 input columns, not a multiple of 256"),
])
def test_what_ggml_cannot_quantize_is_refused_in_one_line(capsys, tmp_path, monkeypatch, argv, match):
    monkeypatch.chdir(tmp_path)
    status, _, err = run_cli(capsys, *argv)
    assert status == 2 and match in err, err
    assert list(tmp_path.iterdir()) == []
