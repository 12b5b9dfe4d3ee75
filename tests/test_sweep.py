"""`tarq-deploy sweep` on a real local Ray and on a real two-node Ray cluster (issue 31): a tiny random Whisper, 2
methods (ggml's rounding and GPTQ) × 2 calibration corpora, one of them with a corrupt clip, through whisper.cpp, at
Q4_0 (the plan is also checked for two types; the runs keep one, for time), calibrating on the CPU the sweep file
names. The model is helpers.tiny_random_whisper (1+1 layers, d_model 32, tiny.en's own tokenizer, feature extractor and
generation config): what is tested is the orchestration, which no weight value changes, and real tiny.en made each
GPTQ step 16 s where this one takes 7, in a module that runs some thirty steps.

One uninterrupted sweep on an embedded Ray makes the reference report for both kinds of interruption below. A second
sweep of the same file into another folder is killed (SIGKILL to its whole process group: driver, Ray head and
workers) once some steps have finished and others are running, then re-run: it must write the same report bytes, and
the cell log must show that no step finished before the kill ran again. The cells calibrated on the corrupt corpus
fail, are named in the report with the clip, and do not stop the others.

On the cluster (tests/ray_cluster.py: a head and a node B with a declared GPU, one CPU each, on this machine):
- Steps run on both nodes, and each step's ``done.json`` and start event name its Ray node and host.
- Node B is killed (SIGKILL to every process of its session: its raylet, agents, workers and their commands) while
  it runs a step, after it has finished one: the sweep fails the steps it was running, finishes the rest on the
  head, and exits 1. The re-run finishes them on the head alone, re-runs nothing that was finished, and writes
  report.md / report.json / size-quality.png byte for byte as the uninterrupted sweep on an embedded Ray did (the
  report holds no machine or node record: it describes the outputs, not where they were made).
- A calibration that asks for a GPU (``device = "cuda"`` in the sweep file) is placed on the node that declares one
  and is run with that device (which then fails here: there is no CUDA).
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from ray_cluster import ENV, Cluster, cluster  # noqa: F401 (cluster: a fixture of the tests below)

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
"tiny" = "MODEL_SOURCE"

[calibration]
clips = { manifest = "calib.jsonl", n = 2 }
broken = "broken.jsonl"

[evaluation]
dev = "eval.jsonl"

[quantize]
device = "cpu"

[eval]
limit = 2
resamples = 200
"""
KILL_TIMEOUT_S = 600
SWEEP_TIMEOUT_S = 900
BROKEN_CELL = "tiny/broken/gptq/q4_0"


def _manifest(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


@pytest.fixture(scope="module")
def sweep_file(tmp_path_factory, real_clips, models) -> Path:
    root = tmp_path_factory.mktemp("sweep")
    clips = {c.id: c for c in real_clips}
    calib = [clips["librivox-sense_and_sensibility_01_austen_64kb-0870"],
             clips["librivox-sense_and_sensibility_01_austen_64kb-0880"]]
    _manifest(root / "calib.jsonl", [{"id": c.id, "audio": c.path, "text": c.text} for c in calib])
    _manifest(root / "eval.jsonl", [{"id": "jfk", "audio": clips["jfk"].path, "text": clips["jfk"].text}])
    (root / "corrupt.wav").write_bytes(b"RIFF\x24\x00\x00\x00WAVEfmt " + b"\x07" * 40)  # a header, then garbage
    _manifest(root / "broken.jsonl", [{"id": "corrupt", "audio": "corrupt.wav", "text": "a clip that will not decode"}])
    (root / "sweep.toml").write_text(SWEEP.replace("MODEL_SOURCE", str(models["clean"])))
    return root / "sweep.toml"


def _sweep_command(sweep_file: Path, out: Path, *args: str) -> list[str]:
    return [sys.executable, "-m", "tarq_deploy.cli", "sweep", str(sweep_file), "--out", str(out), "--quiet", *args]


def _run(command: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(command, capture_output=True, text=True, env=ENV, timeout=SWEEP_TIMEOUT_S,
                          start_new_session=True)


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

    two_types = sweep_file.read_text().replace('types = ["q4_0"]', 'types = ["q4_0", "q8_0"]')
    grid = tmp_path / "grid.toml"
    grid.write_text(two_types)
    for manifest in ("calib.jsonl", "broken.jsonl", "eval.jsonl"):
        grid.with_name(manifest).write_text(sweep_file.with_name(manifest).read_text())
    cells, steps = plan(load_sweep(grid))
    names = [c.name for c in cells]
    assert names[0] == "tiny/-/f16/f16" and len(names) == 1 + 2 * 2 + 2 * 2 - 2  # rtn reads no corpus: 2 cells
    assert len({c.steps["quantize"] for c in cells if "quantize" in c.steps}) == 6
    only_quantize = tmp_path / "quantize.toml"
    only_quantize.write_text(two_types.replace('steps = ["quantize", "export", "verify", "eval"]',
                                               'steps = ["quantize"]'))
    cells, steps = plan(load_sweep(only_quantize))
    assert {s.kind for s in steps.values()} == {"quantize"} and len(steps) == 6  # no export or verify scheduled
    bad = tmp_path / "bad.toml"
    bad.write_text(sweep_file.read_text().replace('"q4_0"]', '"q3_x"]'))
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
    assert failed == {BROKEN_CELL}
    for name in failed:
        assert cells[name]["failed_step"] == "quantize" and "corrupt.wav" in cells[name]["error"]
        assert cells[name]["steps"]["eval"] == "skipped"
    markdown = (uninterrupted / "report.md").read_text()
    assert "## Failed cells" in markdown and BROKEN_CELL in markdown
    evaluated = [row["label"] for row in report["models"][0]["evaluation"]["datasets"][0]["models"]]
    assert evaluated == [n for n in cells if n not in failed]
    differences = {(d["model"], d["versus"]) for d in report["models"][0]["evaluation"]["datasets"][0]["differences"]}
    assert ("tiny/-/rtn/q4_0", "tiny/clips/gptq/q4_0") in differences
    sizes = {p["cell"]: p["file_mib"] for p in report["size_quality"]}
    assert sizes["tiny/-/rtn/q4_0"] == sizes["tiny/clips/gptq/q4_0"] < sizes["tiny/-/f16/f16"] / 2


# ------------------------------------------------------------------------------------- on a two-node cluster
def test_a_gpu_calibration_goes_to_the_node_that_declares_a_gpu(cluster: Cluster, sweep_file: Path):
    """Runs first, while node B (the one with a GPU) is up."""
    gpu_file = sweep_file.with_name("gpu.toml")
    gpu_file.write_text(sweep_file.read_text().replace('broken = "broken.jsonl"\n', "")
                        .replace('device = "cpu"', 'device = "cuda"')
                        .replace('methods = ["rtn", "gptq"]', 'methods = ["gptq"]')
                        .replace('steps = ["quantize", "export", "verify", "eval"]', 'steps = ["quantize"]'))
    out = sweep_file.parent / "run-gpu"
    done = _run(_sweep_command(gpu_file, out, "--address", cluster.address))
    assert done.returncode == 1, done.stderr[-3000:]  # the calibration fails: there is no CUDA behind B's GPU
    starts = [e for e in _log(out) if e["event"] == "start"]
    assert [e["step"] for e in starts] == ["quantize"]
    assert starts[0]["machine"]["ray_node_id"] == cluster.node_ids["b"]
    log = next((out / "steps" / "quantize").glob("*/log.txt")).read_text()
    assert "--device cuda" in log.splitlines()[0]


def test_a_sweep_survives_losing_a_node(cluster: Cluster, sweep_file: Path, uninterrupted: Path):
    head, b = cluster.node_ids["head"], cluster.node_ids["b"]
    out = sweep_file.parent / "run-cluster"
    driver = subprocess.Popen(_sweep_command(sweep_file, out, "--address", cluster.address), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=ENV, start_new_session=True)
    try:
        node_of: dict[str, str] = {}
        deadline = time.monotonic() + KILL_TIMEOUT_S
        while time.monotonic() < deadline and driver.poll() is None:
            events = _log(out)
            node_of = {e["key"]: e["machine"]["ray_node_id"] for e in events if e["event"] == "start"}
            ended = {e["key"] for e in events if e["event"] != "start"}
            on_b = {k for k, node in node_of.items() if node == b}
            if on_b & ended and on_b - ended:
                break
            time.sleep(0.2)
        assert driver.poll() is None, "the sweep ended before node B had finished one step and started another"
        killed = cluster.kill("b")
        assert killed
        stdout, stderr = driver.communicate(timeout=SWEEP_TIMEOUT_S)
    finally:
        if driver.poll() is None:
            os.killpg(driver.pid, signal.SIGKILL)
            driver.wait()
    assert driver.returncode == 1, stderr[-3000:]  # the steps B was running failed (and the corrupt corpus's)
    before = _log(out)
    finished_before = {e["key"] for e in before if e["event"] == "done"}
    started_before = {e["key"]: e for e in before if e["event"] == "start"}
    interrupted = set(started_before) - {e["key"] for e in before if e["event"] != "start"}
    assert interrupted and all(started_before[k]["machine"]["ray_node_id"] == b for k in interrupted)
    report = json.loads((out / "report.json").read_text())
    failed = {c["cell"] for c in report["cells"] if "failed" in c["steps"].values()}
    assert {cell for key in interrupted for cell in started_before[key]["cells"]} <= failed

    resumed = _run(_sweep_command(sweep_file, out, "--address", cluster.address))
    assert resumed.returncode == 1, resumed.stderr[-3000:]  # 1: the corrupt corpus's cell, as in the reference
    after = _log(out)[len(before):]
    restarted = {e["key"]: e for e in after if e["event"] == "start"}
    assert interrupted <= set(restarted)
    assert not set(restarted) & finished_before, "a step finished before the kill ran again"
    assert {e["machine"]["ray_node_id"] for e in restarted.values()} == {head}
    assert finished_before <= {e["key"] for e in after if e["event"] == "cached"}

    records = [json.loads(p.read_text())["machine"] for p in (out / "steps").rglob("done.json")]
    assert {m["ray_node_id"] for m in records} == {head, b}, "steps did not run on both nodes"
    assert all(m["host"] == socket.gethostname() and m["cpu_model"] and m["ray_node_ip"] for m in records)

    for name in ("report.md", "report.json", "size-quality.png"):
        assert (out / name).read_bytes() == (uninterrupted / name).read_bytes(), name
    assert b not in (out / "report.json").read_text() and "ray_node" not in (out / "report.json").read_text()
