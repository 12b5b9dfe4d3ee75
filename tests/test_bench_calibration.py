"""bench.calibration's grid: every (dims, n, method) is a row, a calibration over --max-seconds is stopped and
recorded rather than waited for, and TARQ/GPTQ ratios pair rows of the same dims and n only."""
from __future__ import annotations

import json

import pytest

from tarq_deploy.bench.calibration import DIMS, main, tarq_over_gptq


def test_the_five_whisper_sizes_have_their_real_dimensions():
    assert list(DIMS) == ["tiny", "base", "small", "medium", "large-v3"]
    assert [DIMS[d]["d_model"] for d in DIMS] == [384, 512, 768, 1024, 1280]
    assert [DIMS[d]["encoder_layers"] for d in DIMS] == [4, 6, 12, 24, 32]


def test_ratios_pair_the_same_dims_and_n():
    rows = [{"dims": "tiny", "n": 32, "method": "gptq", "wall_s": 10.0},
            {"dims": "tiny", "n": 32, "method": "tarq", "wall_s": 12.0},
            {"dims": "tiny", "n": 128, "method": "gptq", "wall_s": 30.0},
            {"dims": "tiny", "n": 128, "method": "tarq", "stopped_after_s": 5.0},
            {"dims": "base", "n": 32, "method": "tarq", "wall_s": 99.0}]
    assert tarq_over_gptq(rows) == [{"dims": "tiny", "n": 32, "ratio": pytest.approx(1.2)}]


def test_a_calibration_over_the_limit_is_a_stopped_row(tmp_path):
    out = tmp_path / "cal.json"
    assert main(["--dims", "tiny", "--n", "2,1", "--methods", "gptq", "--max-seconds", "0.01", "--type", "q4_0",
                 "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert [(r["n"], r["stopped_after_s"]) for r in result["rows"]] == [(1, 0.01), (2, 0.01)]  # smallest first
    assert result["ratios_tarq_over_gptq"] == []


@pytest.mark.parametrize("args, message", [(["--dims", "huge"], "--dims: unknown huge"),
                                           (["--n", "3,x"], "--n 3,x: comma-separated whole numbers")])
def test_bad_grids_are_named(args, message, capsys):
    with pytest.raises(SystemExit) as stop:
        main(args)
    assert stop.value.code == 2 and message in capsys.readouterr().err
