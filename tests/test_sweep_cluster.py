"""`tarq-deploy sweep --address` on a real two-node Ray cluster on this machine (issue 31).

Two raylets on one host: a head (`ray start --head`, 1 CPU) and a worker node B (`ray start --address`, 1 CPU, a
custom resource ``node_b`` and a declared GPU, which Ray accepts without a real one). The sweep is the smallest one
tests/test_sweep.py runs (Whisper tiny.en, rtn + gptq on 2 clips, Q4_0 through whisper.cpp, evaluated on jfk),
with ``device = "cpu"`` in [quantize] so that B's GPU does not turn the calibrations to CUDA.

- Steps run on both nodes, and each step's ``done.json`` and start event name its Ray node and host.
- Node B is killed (SIGKILL to every process of its session: its raylet, agents, workers and their commands) while
  it runs a step, after it has finished one: the sweep fails the steps it was running, finishes the rest on the
  head, and exits 1. The re-run finishes them on the head alone, re-runs nothing that was finished, and writes
  report.md / report.json / size-quality.png byte for byte as an uninterrupted sweep of the same file on an embedded
  Ray does (the report holds no machine or node record: it describes the outputs, not where they were made).
- A calibration that asks for a GPU (``device = "cuda"`` in the sweep file) is placed on the node that declares one
  and is run with that device (which then fails here: there is no CUDA).

The nodes are started with ``--block`` in sessions of their own and torn down by killing every process of those
sessions by pid -- never ``ray stop``, which would kill every Ray process on the machine, other users' included.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

import test_sweep

pytestmark = pytest.mark.slow

RAY = str(Path(sys.executable).with_name("ray"))
ENV = {**os.environ, "RAY_AUTH_MODE": "disabled",  # a loopback test cluster: no token to hand to each node
       "RAY_USAGE_STATS_ENABLED": "0", "RAY_DEDUP_LOGS": "0"}
OBJECT_STORE_BYTES = 80 * 1024 * 1024
START_TIMEOUT_S = 90
SWEEP_TIMEOUT_S = 900
KILL_WAIT_S = 600

# test_sweep.py's grid without its corrupt corpus, calibrating on the CPU the sweep names, two utterances evaluated
SWEEP = (test_sweep.SWEEP.replace('broken = "broken.jsonl"\n', "")
         .replace("[eval]\n", '[quantize]\ndevice = "cpu"\n\n[eval]\nlimit = 2\n'))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _manifest(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


@dataclass
class Cluster:
    address: str
    temp_dir: str
    sessions: dict[str, subprocess.Popen] = field(default_factory=dict)  # node name -> its `ray start --block`
    node_ids: dict[str, str] = field(default_factory=dict)  # node name -> Ray node id

    def start_node(self, name: str, args: list[str]) -> None:
        log = open(Path(self.temp_dir) / f"{name}.log", "wb")
        self.sessions[name] = subprocess.Popen(
            [RAY, "start", "--block", "--num-cpus", "1", "--object-store-memory", str(OBJECT_STORE_BYTES),
             "--disable-usage-stats", "--min-worker-port", "0", "--max-worker-port", "0",
             "--dashboard-agent-listen-port", str(_free_port()), "--temp-dir", self.temp_dir, *args],
            stdout=log, stderr=subprocess.STDOUT, env=ENV, start_new_session=True)
        log.close()

    def wait_started(self, name: str) -> None:
        log = Path(self.temp_dir) / f"{name}.log"
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if "Ray runtime started" in log.read_text(errors="replace"):
                return
            assert self.sessions[name].poll() is None, f"ray start ({name}) exited:\n{log.read_text()[-3000:]}"
            time.sleep(0.5)
        raise AssertionError(f"ray start ({name}) not up in {START_TIMEOUT_S} s:\n{log.read_text()[-3000:]}")

    def nodes(self) -> list[dict]:
        """The cluster's nodes as the GCS sees them, from a short-lived driver (this process never imports ray)."""
        code = ("import json, ray; ray.init(address=%r, log_to_driver=False); "
                "print(json.dumps([{'id': n['NodeID'], 'alive': n['Alive'], 'resources': n['Resources']} "
                "for n in ray.nodes()]))" % self.address)
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=ENV, timeout=120)
        assert done.returncode == 0, done.stderr[-3000:]
        return json.loads(done.stdout.strip().splitlines()[-1])

    def kill(self, name: str) -> list[int]:
        """SIGKILL every process of the node's session (workers lead process groups of their own, not sessions)."""
        leader = self.sessions[name]
        pids = [leader.pid] + [pid for pid in _pids() if pid != leader.pid and _sid(pid) == leader.pid]
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        leader.wait(timeout=30)
        return pids

    def teardown(self) -> None:
        for name in list(self.sessions):
            self.kill(name)
        deadline = time.monotonic() + 30  # a killed process leaves the session only once it is reaped
        while time.monotonic() < deadline and any(_sid(p) in {s.pid for s in self.sessions.values()}
                                                  for p in _pids()):
            time.sleep(0.2)
        shutil.rmtree(self.temp_dir, ignore_errors=True)


def _pids() -> list[int]:
    return [int(name) for name in os.listdir("/proc") if name.isdigit()]


def _sid(pid: int) -> int | None:
    try:
        return os.getsid(pid)
    except (ProcessLookupError, PermissionError):
        return None


def _alive_in(sid: int) -> list[int]:
    alive = []
    for pid in _pids():
        if _sid(pid) == sid:
            try:
                state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
            except OSError:
                continue
            if state != "Z":
                alive.append(pid)
    return alive


@pytest.fixture(scope="module")
def cluster():
    port = _free_port()
    cluster = Cluster(f"127.0.0.1:{port}", tempfile.mkdtemp(prefix="tarq-ray-", dir="/tmp"))  # short: socket paths
    try:
        cluster.start_node("head", ["--head", "--port", str(port), "--include-dashboard=false"])
        cluster.wait_started("head")
        cluster.start_node("b", ["--address", cluster.address, "--resources", '{"node_b": 1}', "--num-gpus", "1"])
        cluster.wait_started("b")
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            nodes = [n for n in cluster.nodes() if n["alive"]]
            if len(nodes) == 2:
                break
            time.sleep(1)
        assert len(nodes) == 2, nodes
        cluster.node_ids = {("b" if "node_b" in n["resources"] else "head"): n["id"] for n in nodes}
        assert set(cluster.node_ids) == {"head", "b"}
        yield cluster
    finally:
        cluster.teardown()
        left = [pid for s in cluster.sessions.values() for pid in _alive_in(s.pid)]
        assert not left, f"Ray processes left running: {left}"


@pytest.fixture(scope="module")
def sweep_file(tmp_path_factory, real_clips) -> Path:
    root = tmp_path_factory.mktemp("cluster-sweep")
    clips = {c.id: c for c in real_clips}
    calib = [clips["librivox-sense_and_sensibility_01_austen_64kb-0870"],
             clips["librivox-sense_and_sensibility_01_austen_64kb-0880"]]
    _manifest(root / "calib.jsonl", [{"id": c.id, "audio": c.path, "text": c.text} for c in calib])
    _manifest(root / "eval.jsonl", [{"id": "jfk", "audio": clips["jfk"].path, "text": clips["jfk"].text}])
    (root / "sweep.toml").write_text(SWEEP)
    return root / "sweep.toml"


def _sweep(sweep_file: Path, out: Path, *args: str) -> list[str]:
    return [sys.executable, "-m", "tarq_deploy.cli", "sweep", str(sweep_file), "--out", str(out), "--quiet", *args]


def _run(command: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(command, capture_output=True, text=True, env=ENV, timeout=SWEEP_TIMEOUT_S,
                          start_new_session=True)


def _log(out: Path) -> list[dict]:
    path = out / "cells.log.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]


def test_a_gpu_calibration_goes_to_the_node_that_declares_a_gpu(cluster: Cluster, sweep_file: Path):
    """Runs first, while node B (the one with a GPU) is up."""
    gpu_file = sweep_file.with_name("gpu.toml")
    gpu_file.write_text(SWEEP.replace('device = "cpu"', 'device = "cuda"')
                        .replace('methods = ["rtn", "gptq"]', 'methods = ["gptq"]')
                        .replace('steps = ["quantize", "export", "verify", "eval"]', 'steps = ["quantize"]'))
    out = sweep_file.parent / "run-gpu"
    done = _run(_sweep(gpu_file, out, "--address", cluster.address))
    assert done.returncode == 1, done.stderr[-3000:]  # the calibration fails: there is no CUDA behind B's GPU
    starts = [e for e in _log(out) if e["event"] == "start"]
    assert [e["step"] for e in starts] == ["quantize"]
    assert starts[0]["machine"]["ray_node_id"] == cluster.node_ids["b"]
    log = next((out / "steps" / "quantize").glob("*/log.txt")).read_text()
    assert "--device cuda" in log.splitlines()[0]


def test_a_sweep_survives_losing_a_node(cluster: Cluster, sweep_file: Path):
    head, b = cluster.node_ids["head"], cluster.node_ids["b"]
    out = sweep_file.parent / "run-cluster"
    driver = subprocess.Popen(_sweep(sweep_file, out, "--address", cluster.address), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=ENV, start_new_session=True)
    try:
        node_of: dict[str, str] = {}
        deadline = time.monotonic() + KILL_WAIT_S
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
    assert driver.returncode == 1, stderr[-3000:]  # the steps B was running failed; the others finished
    before = _log(out)
    finished_before = {e["key"] for e in before if e["event"] == "done"}
    started_before = {e["key"]: e for e in before if e["event"] == "start"}
    interrupted = set(started_before) - {e["key"] for e in before if e["event"] != "start"}
    assert interrupted and all(started_before[k]["machine"]["ray_node_id"] == b for k in interrupted)
    report = json.loads((out / "report.json").read_text())
    assert any("failed" in c["steps"].values() for c in report["cells"])

    resumed = _run(_sweep(sweep_file, out, "--address", cluster.address))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    after = _log(out)[len(before):]
    restarted = {e["key"]: e for e in after if e["event"] == "start"}
    assert interrupted <= set(restarted)
    assert not set(restarted) & finished_before, "a step finished before the kill ran again"
    assert {e["machine"]["ray_node_id"] for e in restarted.values()} == {head}
    assert finished_before <= {e["key"] for e in after if e["event"] == "cached"}

    records = [json.loads(p.read_text())["machine"] for p in (out / "steps").rglob("done.json")]
    assert {m["ray_node_id"] for m in records} == {head, b}, "steps did not run on both nodes"
    assert all(m["host"] == socket.gethostname() and m["cpu_model"] and m["ray_node_ip"] for m in records)

    reference = sweep_file.parent / "run-embedded"
    embedded = _run(_sweep(sweep_file, reference, "--cpus", "2"))
    assert embedded.returncode == 0, embedded.stderr[-3000:]
    for name in ("report.md", "report.json", "size-quality.png"):
        assert (out / name).read_bytes() == (reference / name).read_bytes(), name
    assert b not in (out / "report.json").read_text() and "ray_node" not in (out / "report.json").read_text()
