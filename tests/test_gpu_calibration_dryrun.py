"""The lent-GPU calibration script (bench/gpu_calibration.sh, issue 41) dry-run on the CPU at tiny dimensions: the
same script and modules the device runs, fed only by what --prepare-carry writes (the clips, a processor folder and
the pure-Python packages a GPU machine lacks, wordfreq with its English tables only), so that the first device
minute is not spent finding a missing file or package."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tarq_deploy.bench.calibration import main

REPO = Path(__file__).resolve().parents[1]


def test_the_device_script_runs_a_cell_from_the_carried_files_alone(tmp_path):
    carry, out = tmp_path / "carry", tmp_path / "out"
    assert main(["--prepare-carry", str(carry)]) == 0
    assert (carry / "site" / "wordfreq" / "data" / "large_en.msgpack.gz").is_file()
    assert not list((carry / "site" / "wordfreq" / "data").glob("large_de*"))  # English only: the carry stays small
    size = sum(p.stat().st_size for p in carry.rglob("*") if p.is_file())
    assert size < 16 << 20, size  # the device takes 64 MiB per call, the repository included
    env = {**os.environ, "PYTHON": sys.executable, "DEVICE": "cpu", "DIMS": "tiny", "N": "2", "LIMIT_S": "300",
           "CARRY": str(carry), "OUT": str(out)}
    run = subprocess.run(["bash", "bench/gpu_calibration.sh", "gptq"], cwd=REPO, env=env, capture_output=True,
                         text=True, timeout=420)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    log = (out / "log-gptq.txt").read_text()
    assert "wordfreq" in log and "MISSING" not in log, log
    rows = json.loads((out / "calibration-tiny-gptq.json").read_text())["rows"]
    assert len(rows) == 1 and "wall_s" in rows[0], rows  # finished, not stopped or failed
    assert rows[0]["weights_dtype"] == "float16" and rows[0]["blocks"] == 9
    assert rows[0]["stage_s"]["windows"] > 0 and "load_average_at_start" in rows[0]
