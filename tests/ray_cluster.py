"""A real two-node Ray cluster on this machine for tests/test_sweep.py (issue 31).

Two raylets on one host: a head (`ray start --head`, 1 CPU) and a worker node B (`ray start --address`, 1 CPU, a
custom resource ``node_b`` and a declared GPU, which Ray accepts without a real one). The nodes are started with
``--block`` in sessions of their own and torn down by killing every process of those sessions by pid -- never
``ray stop``, which would kill every Ray process on the machine, other users' included. Not a test module: the
cluster tests live in test_sweep.py, so that they share its uninterrupted reference sweep (one module, one worker).
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

RAY = str(Path(sys.executable).with_name("ray"))
ENV = {**os.environ, "RAY_AUTH_MODE": "disabled",  # a loopback test cluster: no token to hand to each node
       "RAY_USAGE_STATS_ENABLED": "0", "RAY_DEDUP_LOGS": "0"}
OBJECT_STORE_BYTES = 80 * 1024 * 1024
START_TIMEOUT_S = 90


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
