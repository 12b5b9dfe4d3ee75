"""The 2-bit grid types in stock whisper.cpp (issue 38): TARQ calibrates real Whisper base onto IQ2_S and IQ2_XS from
128 synthetic utterances made here by `corpus synth` (voices slt and joe, sentences and voices disjoint from the real
clips) through the CLI; the export is bit-exact (verify) and whisper.cpp (pywhispercpp) transcribes the 12 real clips,
none of them calibrated on, within a capped-WER bound. The 3-bit types: tests/test_grid_whisper_cpp.py.

The bound is on the 12 clips together, not on jfk alone: at 2 bits one 22-word clip swings with the rounding of a near
tie. jfk's WER from four calibration corpora (seeds 0-3) was 0.27 / 0 / 0.14 / 0 at IQ2_XS, so an earlier bound of 0.25
on jfk alone failed from seed 0 and from a change that only reordered float sums (992a7ae). Capped WER on the 12 clips
(whisper.cpp, greedy; 2-core AMD EPYC family 25, 2026-11-29; `tarq-deploy eval`'s scoring):

| model | seed 0 | seed 1 | seed 2 (this test's) | seed 3 |
|---|---|---|---|---|
| TARQ IQ2_S, 128 synthetic | 0.094 | 0.128 | 0.128 | 0.171 |
| TARQ IQ2_XS, 128 synthetic | 0.188 | 0.162 | 0.179 (four "five"s) | 0.222 (a long loop on "five five") |
| the same, metric factored otherwise (992a7ae: equal in exact arithmetic) | 0.308 | 0.222 | 0.453 (a loop on jfk) | 0.171 |

For scale: the float model 0.043; the nearest points, IQ2_S 0.90 and IQ2_XS 0.98 (loops on 4 and 5 of the 12 clips). A
change of float rounding alone moved IQ2_XS from 0.18 to 0.45 on this test's corpus, so its bound (0.6) sits above that
with margin, and still far below an uncalibrated or misexported model; IQ2_S's sits 0.18 above its runs.

The corpus stays at 128 utterances: with 32 (to save time; results/test_bounds/grid-iq2-32-intel.json, Intel Xeon,
2026-12-06) IQ2_S gave 0.248 / 0.162 / 0.205 / 0.453 over seeds 0-3 and IQ2_XS 0.727 from seed 0, past both bounds,
while calibrating only about a quarter faster (the solver, not the data, takes most of the time); with 64
(grid-iq2-64-intel.json, 2026-12-07) IQ2_XS gave 0.692 from seed 0, loops on two clips.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import check_tarq_export, held_out_capped_wer, quantize_tarq_of_base, transcribe_whisper_cpp_clips

from tarq_deploy.cli import main as cli
from tarq_deploy.data.real_clips import all_real_clips
from tarq_deploy.formats.ggml_file import read_whisper_cpp
from tarq_deploy.quant.ggml_types import type_by_name

pytestmark = pytest.mark.usefixtures("one_torch_thread")
N_SYNTH_CALIB, SYNTH_SEED = 128, 2
HELD_OUT_CAPPED_WER = {"iq2_s": 0.35, "iq2_xs": 0.60}  # measured: see above


@pytest.fixture(scope="module")
def synthetic_calib(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("synth")
    assert cli(["corpus", "synth", "--out", str(out), "--n", "1", "--n-calib", str(N_SYNTH_CALIB),
                "--seed", str(SYNTH_SEED)]) == 0
    return out / "calib.jsonl"


@pytest.mark.parametrize("type_name", ["iq2_s", "iq2_xs"])
def test_tarq_on_a_2_bit_grid_type_of_base_transcribes_held_out_clips_in_whisper_cpp(capsys, tmp_path, synthetic_calib,
                                                                                     type_name):
    ckpt, out = tmp_path / "ck", tmp_path / f"{type_name}.bin"
    quantize_tarq_of_base(type_name, synthetic_calib, N_SYNTH_CALIB, ckpt)
    check_tarq_export(capsys, ckpt, out, type_name)
    model = read_whisper_cpp(out)
    assert model.tensors["decoder.token_embedding.weight"].ggml_type == type_by_name(type_name)
    assert model.tensors["encoder.blocks.0.mlp.0.weight"].ggml_type == type_by_name(type_name)
    knobs = json.loads((ckpt / "manifest.json").read_text())["method"]
    assert knobs.get("lookup_pass", False) == (type_name == "iq2_xs")  # --lookup-pass auto
    held_out = all_real_clips()  # the calibration was synthetic: every real clip is held out
    texts = transcribe_whisper_cpp_clips(out, [str(c.path) for c in held_out])
    assert held_out_capped_wer(held_out, texts) <= HELD_OUT_CAPPED_WER[type_name], \
        list(zip([c.id for c in held_out], texts))
