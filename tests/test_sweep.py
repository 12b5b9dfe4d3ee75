"""`tarq-deploy sweep` on a real local Ray: real Whisper tiny.en, 2 methods (ggml's rounding and GPTQ) × 2 calibration
corpora, one of them with a corrupt clip, through whisper.cpp, at Q4_0 (the plan is also checked for two types; the
runs keep one, for time).

One uninterrupted sweep makes the reference report. A second sweep of the same file into another folder is killed
(SIGKILL to its whole process group: driver, Ray head and workers) once some steps have finished and others are
running, then re-run: it must write the same report bytes, and the cell log must show that no step finished before
the kill ran again. The cells calibrated on the corrupt corpus fail, are named in the report with the clip, and do
not stop the others.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tarq_deploy.sweep.plan import load_sweep

pytestmark = pytest.mark.slow

SWEEP = """
[sweep]
target = "whisper.cpp"
methods = ["rtn", "gptq"]
types = ["q4_0"]
baseline = "gptq"
steps = ["quantize", "export", "verify", "eval"]

[models]
"tiny.en" = "packaged:tiny.en"

[calibration]
clips = { manifest = "calib.jsonl", n = 2 }
broken = "broken.jsonl"

[evaluation]
dev = "eval.jsonl"

[eval]
resamples = 200
"""
KILL_TIMEOUT_S = 600


def _manifest(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


@pytest.fixture(scope="module")
def sweep_file(tmp_path_factory, real_clips) -> Path:
    root = tmp_path_factory.mktemp("sweep")
    clips = {c.id: c for c in real_clips}
    calib = [clips["librivox-sense_and_sensibility_01_austen_64kb-0870"],
             clips["librivox-sense_and_sensibility_01_austen_64kb-0880"]]
    _manifest(root / "calib.jsonl", [{"id": c.id, "audio": c.path, "text": c.text} for c in calib])
    _manifest(root / "eval.jsonl", [{"id": "jfk", "audio": clips["jfk"].path, "text": clips["jfk"].text}])
    (root / "corrupt.wav").write_bytes(b"RIFF\x24\x00\x00\x00WAVEfmt " + b"\x07" * 40)  # a header, then garbage
    _manifest(root / "broken.jsonl", [{"id": "corrupt", "audio": "corrupt.wav", "text": "a clip that will not decode"}])
    (root / "sweep.toml").write_text(SWEEP)
    return root / "sweep.toml"


def _sweep_command(sweep_file: Path, out: Path) -> list[str]:
    return [sys.executable, "-m", "tarq_deploy.cli", "sweep", str(sweep_file), "--out", str(out), "--quiet"]


def _log(out: Path) -> list[dict]:
    path = out / "cells.log.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]


@pytest.fixture(scope="module")
def uninterrupted(sweep_file: Path) -> Path:
    out = sweep_file.parent / "run-a"
    done = subprocess.run(_sweep_command(sweep_file, out), capture_output=True, text=True, timeout=1200)
    assert done.returncode == 1, done.stderr[-3000:]  # 1: some cells failed (the corrupt corpus), as intended
    return out


def test_plan_shares_steps_and_checks_the_file(sweep_file: Path, tmp_path: Path):
    from tarq_deploy.errors import UserError
    from tarq_deploy.sweep.driver import plan

    two_types = SWEEP.replace('types = ["q4_0"]', 'types = ["q4_0", "q8_0"]')
    grid = tmp_path / "grid.toml"
    grid.write_text(two_types)
    for manifest in ("calib.jsonl", "broken.jsonl", "eval.jsonl"):
        grid.with_name(manifest).write_text(sweep_file.with_name(manifest).read_text())
    cells, steps = plan(load_sweep(grid))
    names = [c.name for c in cells]
    assert names[0] == "tiny.en/-/f16/f16" and len(names) == 1 + 2 * 2 + 2 * 2 - 2  # rtn reads no corpus: 2 cells
    assert len({c.steps["quantize"] for c in cells if "quantize" in c.steps}) == 6
    only_quantize = tmp_path / "quantize.toml"
    only_quantize.write_text(two_types.replace('steps = ["quantize", "export", "verify", "eval"]',
                                               'steps = ["quantize"]'))
    cells, steps = plan(load_sweep(only_quantize))
    assert {s.kind for s in steps.values()} == {"quantize"} and len(steps) == 6  # no export or verify scheduled
    bad = tmp_path / "bad.toml"
    bad.write_text(SWEEP.replace('"q4_0"]', '"q3_x"]'))
    with pytest.raises(UserError, match="q3_x"):
        load_sweep(bad)


def test_killed_sweep_resumes_to_the_same_report(sweep_file: Path, uninterrupted: Path):
    out = sweep_file.parent / "run-b"
    driver = subprocess.Popen(_sweep_command(sweep_file, out), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                              start_new_session=True)
    try:
        deadline = time.monotonic() + KILL_TIMEOUT_S
        while time.monotonic() < deadline and driver.poll() is None:
            events = _log(out)
            finished = {e["key"] for e in events if e["event"] == "done"}
            running = {e["key"] for e in events if e["event"] == "start"} - finished
            if len(finished) >= 3 and running:
                break
            time.sleep(0.5)
        assert driver.poll() is None, "the sweep ended before it could be interrupted"
    finally:
        os.killpg(driver.pid, signal.SIGKILL)
        driver.wait()
    before = _log(out)
    finished_before = {e["key"] for e in before if e["event"] == "done"}
    interrupted = {e["key"] for e in before if e["event"] == "start"} - finished_before
    assert finished_before and interrupted

    resumed = subprocess.run(_sweep_command(sweep_file, out), capture_output=True, text=True, timeout=1200)
    assert resumed.returncode == 1, resumed.stderr[-3000:]
    after = _log(out)[len(before):]
    restarted = {e["key"] for e in after if e["event"] == "start"}
    assert not restarted & finished_before, "a step finished before the kill ran again"
    assert finished_before <= {e["key"] for e in after if e["event"] == "cached"}
    assert interrupted <= restarted | {e["key"] for e in after if e["event"] == "cached"}
    for name in ("report.md", "report.json", "size-quality.png"):
        assert (out / name).read_bytes() == (uninterrupted / name).read_bytes(), name


def test_each_step_records_the_machine_it_ran_on(uninterrupted: Path):
    """Bytes are promised per processor kind and thread count: a cache shared by mixed nodes must say which made what."""
    done = [json.loads(p.read_text()) for p in uninterrupted.rglob("done.json")]
    starts = [e for e in _log(uninterrupted) if e["event"] == "start"]
    assert done and starts
    for machine in [d["machine"] for d in done] + [e["machine"] for e in starts]:
        assert machine["cpu_model"] and machine["threads"] >= 1 and machine["versions"]["transformers"]


def test_a_corrupt_clip_fails_its_cells_only(uninterrupted: Path):
    report = json.loads((uninterrupted / "report.json").read_text())
    cells = {c["cell"]: c for c in report["cells"]}
    failed = {name for name, c in cells.items() if "error" in c}
    assert failed == {"tiny.en/broken/gptq/q4_0"}
    for name in failed:
        assert cells[name]["failed_step"] == "quantize" and "corrupt.wav" in cells[name]["error"]
        assert cells[name]["steps"]["eval"] == "skipped"
    markdown = (uninterrupted / "report.md").read_text()
    assert "## Failed cells" in markdown and "tiny.en/broken/gptq/q4_0" in markdown
    evaluated = [row["label"] for row in report["models"][0]["evaluation"]["datasets"][0]["models"]]
    assert evaluated == [n for n in cells if n not in failed]
    differences = {(d["model"], d["versus"]) for d in report["models"][0]["evaluation"]["datasets"][0]["differences"]}
    assert ("tiny.en/-/rtn/q4_0", "tiny.en/clips/gptq/q4_0") in differences
    sizes = {p["cell"]: p["file_mib"] for p in report["size_quality"]}
    assert sizes["tiny.en/-/rtn/q4_0"] == sizes["tiny.en/clips/gptq/q4_0"] < sizes["tiny.en/-/f16/f16"] / 2
