"""`tarq-deploy publish`: the staged model card (parsed and validated with huggingface_hub, carrying the measured
numbers) and the upload, against a small Hub stand-in on 127.0.0.1.

The stand-in implements exactly the calls huggingface_hub 2.4's HfApi makes for a publish (read from the client:
hf_api.py, _commit_api.py): GET /api/whoami-v2; GET /api/models/{repo}[/revision/{rev}]; POST /api/repos/create;
POST /api/models/{repo}/branch/{branch}; POST /api/validate-yaml (create_commit checks README.md first);
POST /api/models/{repo}/preupload/{rev} (upload mode per file, and the oid of the file the repo already holds: the
client skips unchanged files with it); POST /api/models/{repo}/commit/{rev} (NDJSON: a header line, then one
{"key": "file", "value": {path, content (base64), encoding}} line per regular file). It answers "regular" for every
file, so no LFS / Xet transfer is triggered (the test files are small). Anything else is a 404 recorded as unexpected.
The server serves one request per loop turn with a short timeout and stops itself at a deadline.
"""
from __future__ import annotations

import base64
import hashlib
import json
import os
import re
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Iterator
from urllib.parse import unquote, urlparse

import numpy as np
import pytest
import torch
from huggingface_hub import ModelCard
from huggingface_hub import constants as hf_constants
from huggingface_hub.repocard_data import model_index_to_eval_results

from tarq_deploy import cli, hub
from tarq_deploy.checkpoint import LatticeCheckpoint, save_checkpoint
from tarq_deploy.errors import UserError
from tarq_deploy.quant.lattice import LatticeSpec
from tarq_deploy.quant.lattice_fit import quantize_rtn

REPO_ROOT = Path(__file__).resolve().parents[1]
TOKEN = "hf_test_token_for_the_local_stand_in"
USER, ORG = "tester", "tarq-org"
SERVER_SECONDS = 45  # the stand-in stops itself after this, whatever happens to the test


# --------------------------------------------------------------------------------------------- the Hub stand-in
def git_blob_sha1(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


@dataclass
class FakeRepo:
    private: bool
    branches: dict[str, str] = field(default_factory=dict)  # branch -> commit sha
    commits: dict[str, dict[str, bytes]] = field(default_factory=dict)  # commit sha -> full tree {path: bytes}

    def files(self, revision: str = "main") -> dict[str, bytes]:
        return self.commits[self.branches[revision]]


@dataclass
class FakeHub:
    """State and request log of the stand-in; ``fail`` picks a failure: "commit-drop" closes the connection on the
    commit request without answering, "create-403" refuses repo creation in the organisation."""

    fail: str | None = None
    repos: dict[str, FakeRepo] = field(default_factory=dict)
    calls: list[tuple[str, str]] = field(default_factory=list)
    unexpected: list[tuple[str, str]] = field(default_factory=list)
    created: list[str] = field(default_factory=list)
    validated_cards: list[str] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def commit(self, repo: FakeRepo, revision: str, files: dict[str, bytes], summary: str) -> str:
        parent = repo.branches.get(revision, "")
        tree = {**repo.commits.get(parent, {}), **files}
        listing = "".join(f"{p}:{git_blob_sha1(d)}\n" for p, d in sorted(tree.items()))
        sha = hashlib.sha1(f"{parent}\n{summary}\n{listing}".encode()).hexdigest()
        repo.commits[sha] = tree
        repo.branches[revision] = sha
        return sha


_MODELS = re.compile(r"^/api/models/(?P<repo>[^/]+/[^/]+)(?:/(?P<op>revision|preupload|commit|branch)/(?P<rev>.+))?$")


class _Handler(BaseHTTPRequestHandler):
    hub: FakeHub  # set on the subclass made per server
    base: str

    def log_message(self, *args) -> None:  # keep pytest output clean
        pass

    def do_GET(self) -> None:
        self._dispatch("GET")

    def do_POST(self) -> None:
        self._dispatch("POST")

    # -- plumbing
    def _dispatch(self, method: str) -> None:
        path = urlparse(self.path).path
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        with self.hub.lock:
            self.hub.calls.append((method, path))
            if self.headers.get("Authorization") != f"Bearer {TOKEN}":
                self.hub.unexpected.append((method, f"{path} without the token"))
                return self._send(401, {"error": "Invalid credentials in Authorization header"},
                                  {"X-Error-Message": "Invalid credentials in Authorization header"})
            self._route(method, path, body)

    def _send(self, status: int, payload: dict, headers: dict | None = None) -> None:
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.end_headers()
        self.wfile.write(data)

    def _not_found(self, what: str, code: str) -> None:
        self._send(404, {"error": f"{what} not found"}, {"X-Error-Code": code})

    # -- the API
    def _route(self, method: str, path: str, body: bytes) -> None:
        if (method, path) == ("GET", "/api/whoami-v2"):
            return self._send(200, {"type": "user", "name": USER, "orgs": [{"name": ORG}]})
        if (method, path) == ("POST", "/api/repos/create"):
            return self._create(json.loads(body))
        if (method, path) == ("POST", "/api/validate-yaml"):
            self.hub.validated_cards.append(json.loads(body)["content"])
            return self._send(200, {"errors": [], "warnings": []})
        match = _MODELS.match(path)
        if match is None:
            self.hub.unexpected.append((method, path))
            return self._not_found(path, "EntryNotFound")
        repo = self.hub.repos.get(match["repo"])
        if repo is None:
            return self._not_found("Repository", "RepoNotFound")
        op, rev = match["op"], unquote(match["rev"] or "main")
        handlers = {("GET", None): self._info, ("GET", "revision"): self._info, ("POST", "branch"): self._branch,
                    ("POST", "preupload"): self._preupload, ("POST", "commit"): self._commit}
        handler = handlers.get((method, op))
        if handler is None:
            self.hub.unexpected.append((method, path))
            return self._not_found(path, "EntryNotFound")
        if op != "branch" and rev not in repo.branches:
            return self._not_found("Revision", "RevisionNotFound")
        handler(match["repo"], repo, rev, body)

    def _create(self, payload: dict) -> None:
        repo_id = f"{payload['organization']}/{payload['name']}"
        if self.hub.fail == "create-403" and payload["organization"] == ORG:
            return self._send(403, {"error": f"You don't have the rights to create a model under {ORG}"})
        if repo_id in self.hub.repos:
            return self._send(409, {"error": "You already created this model repo", "url": f"{self.base}/{repo_id}"})
        repo = FakeRepo(private=payload.get("visibility") == "private")
        self.hub.commit(repo, "main", {".gitattributes": b"*.bin filter=lfs diff=lfs merge=lfs -text\n"},
                        "initial commit")
        self.hub.repos[repo_id] = repo
        self.hub.created.append(repo_id)
        self._send(200, {"url": f"{self.base}/{repo_id}", "name": repo_id})

    def _info(self, repo_id: str, repo: FakeRepo, rev: str, body: bytes) -> None:
        self._send(200, {"id": repo_id, "sha": repo.branches[rev], "private": repo.private,
                         "siblings": [{"rfilename": p} for p in sorted(repo.files(rev))]})

    def _branch(self, repo_id: str, repo: FakeRepo, rev: str, body: bytes) -> None:
        if rev in repo.branches:
            return self._send(409, {"error": "Reference already exists"})
        repo.branches[rev] = repo.branches["main"]
        self._send(200, {})

    def _preupload(self, repo_id: str, repo: FakeRepo, rev: str, body: bytes) -> None:
        held = repo.files(rev)
        files = [{"path": f["path"], "uploadMode": "regular", "shouldIgnore": False,
                  "oid": git_blob_sha1(held[f["path"]]) if f["path"] in held else None}
                 for f in json.loads(body)["files"]]
        self._send(200, {"files": files})

    def _commit(self, repo_id: str, repo: FakeRepo, rev: str, body: bytes) -> None:
        if self.hub.fail == "commit-drop":
            self.close_connection = True  # the network fails mid-upload: no answer at all
            return
        lines = [json.loads(line) for line in body.splitlines() if line.strip()]
        header, operations = lines[0], lines[1:]
        assert header["key"] == "header", header
        if any(op["key"] != "file" or op["value"]["encoding"] != "base64" for op in operations):
            self.hub.unexpected.append(("POST", f"commit with {[op['key'] for op in operations]}"))
            return self._send(400, {"error": "this stand-in takes regular files only"})
        files = {op["value"]["path"]: base64.b64decode(op["value"]["content"]) for op in operations}
        sha = self.hub.commit(repo, rev, files, header["value"]["summary"])
        self._send(200, {"success": True, "commitOid": sha, "commitUrl": f"{self.base}/{repo_id}/commit/{sha}"})


@contextmanager
def serving(fake: FakeHub, seconds: float = SERVER_SECONDS) -> Iterator[str]:
    """Run the stand-in on a free loopback port; yields its base URL. Bounded: it stops at the deadline."""
    handler = type("Handler", (_Handler,), {"hub": fake})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    server.timeout = 0.05  # handle_request returns after this when idle, so the loop sees stop and the deadline
    handler.base = f"http://127.0.0.1:{server.server_address[1]}"
    stop, deadline = threading.Event(), time.monotonic() + seconds

    def loop() -> None:
        while not stop.is_set() and time.monotonic() < deadline:
            server.handle_request()
        server.server_close()

    thread = threading.Thread(target=loop, name="fake-hub", daemon=True)
    thread.start()
    try:
        yield handler.base
    finally:
        stop.set()
        thread.join(timeout=5)


# -------------------------------------------------------------------------------------------------- inputs
def write_tiny_whisper_cpp(path: Path) -> Path:
    """A whisper.cpp Q4_0 file of a one-layer, 64-wide Whisper: valid for the strict parser, a few hundred kB."""
    from tarq_deploy.formats.ggml_blocks import GGMLType, tensor_nbytes
    from tarq_deploy.formats.ggml_file import QNT_VERSION, QNT_VERSION_FACTOR, FTYPE_OF_TYPE, WhisperHParams, tensor_slots
    from tarq_deploy.formats.whisper_cpp import PackedTensor, WhisperCppModel, write_whisper_cpp
    from tarq_deploy.vocabulary import TokenTable

    h = WhisperHParams(n_vocab=64, n_audio_ctx=8, n_audio_state=64, n_audio_head=1, n_audio_layer=1, n_text_ctx=8,
                       n_text_state=64, n_text_head=1, n_text_layer=1, n_mels=80,
                       ftype=FTYPE_OF_TYPE[GGMLType.Q4_0] + QNT_VERSION_FACTOR * QNT_VERSION)
    rng = np.random.default_rng(0)
    tensors = []
    for slot in tensor_slots(h):
        ggml_type = slot.ggml_type(GGMLType.Q4_0)
        tensors.append(PackedTensor(slot.name, ggml_type, slot.shape,
                                    rng.integers(0, 60, tensor_nbytes(ggml_type, slot.shape), dtype=np.uint8)))
    vocab = TokenTable.of([bytes([65 + i % 26]) for i in range(64)])
    model = WhisperCppModel(h, np.zeros((80, 201), np.float32), vocab, tensors)
    return write_whisper_cpp(model, path)


def write_tiny_gguf(path: Path) -> Path:
    import gguf

    writer = gguf.GGUFWriter(str(path), "qwen3asr")
    writer.add_tensor("blk.0.attn_q.weight", np.arange(4 * 32, dtype=np.float16).reshape(4, 32))
    writer.add_tensor("output_norm.weight", np.ones(32, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def write_tiny_checkpoint(path: Path) -> Path:
    spec = LatticeSpec(4, 32)
    g = torch.Generator().manual_seed(0)
    ckpt = LatticeCheckpoint(
        spec=spec,
        quantized={"model.decoder.layers.0.fc1.weight": quantize_rtn(torch.randn(16, 64, generator=g), spec)},
        tensors={"model.decoder.layers.0.fc1.bias": torch.zeros(16)},
        metadata={"method": {"name": "tarq", "zipf_threshold": 3.0, "cost_ratio": 1.5, "n_calib": 64, "seed": 0},
                  "calibration": {"utterances": 64, "words": 1234, "rare_words": 187, "rare_word_share": 0.1523,
                                  "tail_share": {"decoder_tokens": 0.2034, "encoder_frames": 0.0875},
                                  "pool": "rare", "windows": 12},
                  "source_model": {"id": "openai/whisper-tiny.en", "architecture": "whisper",
                                   "state_sha256": "ab" * 32},
                  "tool": {"name": "tarq-deploy", "version": "0.1.0"}},
        model_files={"config.json": b'{"model_type": "whisper"}\n',
                     "generation_config.json": b'{"is_multilingual": false}\n',
                     "README.md": b"---\nlicense: apache-2.0\n---\n# whisper tiny.en\n"})
    return save_checkpoint(ckpt, path)


EVAL_DOC = {
    "kind": "eval", "ci_level": 0.95,
    "datasets": [
        {"name": "Rare-word speech (held-out)", "id": "tarq/rare-speech", "split": "test", "n_utterances": 244,
         "zipf_threshold": 3.0,
         "models": [
             {"label": "F16", "model": "out/tiny.en-f16.bin", "wer": 0.2193, "wer_ci": [0.2011, 0.2379],
              "rare_wer": 0.5912, "rare_wer_ci": [0.5521, 0.6302], "common_wer": 0.1712, "n_words": 3233,
              "n_rare_words": 413},
             {"label": "TARQ Q4_0", "model": "out/model-q4_0.bin", "wer": 0.2276, "wer_ci": [0.2087, 0.2468],
              "rare_wer": {"value": 0.6047, "low": 0.5633, "high": 0.6459},  # the evaluate.wer.Interval form
              "common_wer": 0.1793, "common_wer_ci": [0.16, 0.2],
              "n_words": 3233, "n_rare_words": 413}]},
        {"name": "LibriVox clips", "n_utterances": 5,
         "models": [{"label": "TARQ Q4_0", "wer": 0.0714}]},
    ],
}


def bench_doc() -> dict:
    """A CPU bench result in bench.cpu's own records (so the shape follows theirs), numbers made up."""
    from tarq_deploy.bench.cpu import Baseline, BenchConfig, CellResult, CpuBenchResult, Stat

    def cell(model: str, precision: str, latency: float, rss: float) -> CellResult:
        rtf = latency / 11.0
        summary = {"transcribe_s": Stat(latency, latency - 0.02, latency + 0.03, 3), "rtf": Stat(rtf, rtf, rtf, 3),
                   "peak_rss_mb": Stat(rss, rss, rss, 3)}
        return CellResult(runtime="whisper.cpp", model=model, model_label=Path(model).name, model_size_mb=24.0,
                          backbone="tiny.en", precision=precision, audio="jfk.wav", audio_label="jfk", audio_s=11.0,
                          threads=1, oversubscribed=False, status="ok", summary=summary)

    cells = [cell("out/tiny.en-f16.bin", "F16", 1.21, 190.4), cell("out/model-q4_0.bin", "Q4_0", 0.90, 139.2)]
    result = CpuBenchResult(
        kind="cpu", config=asdict(BenchConfig(models=[c.model for c in cells], audios=["jfk.wav"], threads=[1])),
        runtime={"name": "whisper.cpp", "settings": {"language": "en"}},
        machine={"cpu_model": "Test CPU", "usable_cores": 2, "logical_cores": 2, "memory_total_mb": 8192,
                 "platform": "Linux", "python": "3.11.7"},
        versions={"whisper.cpp": "1.8.5", "ggml": "0.9.5", "ggml_commit": "a8db410", "pywhispercpp": "1.5.1",
                  "torch": "2.13.0"}, environment={"OMP_WAIT_POLICY": "PASSIVE"},
        harness={"rss_mb": 310.0}, baselines=[Baseline("whisper.cpp", "jfk.wav", peak_rss_mb=47.0)], cells=cells,
        loadavg={"start": [0.4, 0.4, 0.4], "end": [0.5, 0.5, 0.5], "runs_1m_min": 0.4, "runs_1m_max": 0.6},
        notes=[], started="2026-01-01T00:00:00", finished="2026-01-01T00:01:00", elapsed_s=60.0)
    return json.loads(json.dumps(result.to_dict()))


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("publish-inputs")
    (root / "eval.json").write_text(json.dumps(EVAL_DOC))
    (root / "bench.json").write_text(json.dumps(bench_doc()))
    return {"bin": write_tiny_whisper_cpp(root / "model-q4_0.bin"), "gguf": write_tiny_gguf(root / "tiny-f16.gguf"),
            "ckpt": write_tiny_checkpoint(root / "ckpt"), "eval": root / "eval.json", "bench": root / "bench.json"}


def publish_argv(inputs: dict[str, Path], out: Path, repo_id: str, *extra: str, measured: bool = True) -> list[str]:
    argv = ["publish", str(out), "--repo-id", repo_id, "--checkpoint", str(inputs["ckpt"]),
            "--file", str(inputs["bin"]), "--file", str(inputs["gguf"])]
    if measured:
        argv += ["--eval", str(inputs["eval"]), "--bench", str(inputs["bench"])]
    return argv + list(extra)


@pytest.fixture
def hub_env(monkeypatch, tmp_path):
    """In-process runs: the token, no login cache, and the endpoint (the library reads HF_ENDPOINT at import)."""
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    monkeypatch.setattr(hf_constants, "HF_TOKEN_PATH", str(tmp_path / "no-token-cache"))
    monkeypatch.setenv("NO_PROXY", "127.0.0.1,localhost")
    # no telemetry: the client would otherwise fetch its agent-harness registry from the endpoint and cache it
    # in the user's HF_HOME
    monkeypatch.setattr(hf_constants, "HF_HUB_DISABLE_TELEMETRY", True)

    def point_at(url: str) -> None:
        monkeypatch.setenv("HF_ENDPOINT", url)
        monkeypatch.setattr(hf_constants, "ENDPOINT", url)

    return point_at


def expected_tree(inputs: dict[str, Path], out: Path) -> dict[str, bytes]:
    """Every file a publish must upload: the staged folder, whose files are the sources byte for byte."""
    tree = {p.relative_to(out).as_posix(): p.read_bytes() for p in out.rglob("*") if p.is_file()}
    assert tree["model-q4_0.bin"] == inputs["bin"].read_bytes()
    assert tree["tiny-f16.gguf"] == inputs["gguf"].read_bytes()
    for src in inputs["ckpt"].rglob("*"):
        if src.is_file():
            assert tree[f"lattice/{src.relative_to(inputs['ckpt']).as_posix()}"] == src.read_bytes()
    return tree


# ------------------------------------------------------------------------------------------------------- the card
def test_staged_card_parses_validates_and_carries_the_measured_numbers(inputs, tmp_path, capsys):
    out = tmp_path / "stage"
    assert cli.main(publish_argv(inputs, out, f"{USER}/whisper-tiny.en-tarq-q4_0", "--dry-run")) == 0
    assert "nothing uploaded" in capsys.readouterr().out
    text = (out / "README.md").read_text()
    hub.check_card(text)
    card = ModelCard.load(out / "README.md")
    meta = card.data.to_dict()
    assert meta["base_model"] == "openai/whisper-tiny.en" and meta["base_model_relation"] == "quantized"
    assert meta["license"] == "apache-2.0"  # inherited from the source's own README
    assert meta["pipeline_tag"] == "automatic-speech-recognition" and meta["library_name"] == "whisper.cpp"
    assert {"tarq", "whisper.cpp", "gguf", "4-bit"} <= set(meta["tags"]) and "gptq" not in meta["tags"]
    assert meta["language"] == ["en"]

    model_name, results = model_index_to_eval_results(meta["model-index"])
    assert model_name == "whisper-tiny.en-tarq-q4_0"
    values = {(r.dataset_name, r.metric_type): r.metric_value for r in results}
    assert values == {("Rare-word speech (held-out)", "wer"): 22.76, ("Rare-word speech (held-out)", "rare-wer"): 60.47,
                      ("LibriVox clips", "wer"): 7.14}
    assert all(r.task_type == "automatic-speech-recognition" for r in results)
    assert {r.dataset_type for r in results} == {"tarq/rare-speech", "LibriVox clips"}

    body = card.text
    for number in ("22.76 [20.87, 24.68]", "60.47 [56.33, 64.59]", "21.93", "59.12", "17.93 [16.00, 20.00]",
                   "| **TARQ Q4_0** |", "244 utterances"):
        assert number in body, number
    for number in ("1.21", "0.90", "1.34×", "0.082", "190", "139", "Test CPU"):  # bench table and its conditions
        assert number in body, number
    for fact in ("`tarq`", "zipf_threshold = 3.0", "cost_ratio = 1.5", "64 utterances", "1234 words, 187 rare (15.2%)",
                 "decoder tokens 20.3%", "tarq-deploy 0.1.0", "ab" * 32):
        assert fact in body, fact
    for usage in ("whisper-cli -m model-q4_0.bin", "pywhispercpp.model import Model", "crispasr.Session",
                  'tarq-deploy export lattice', f'hf download {USER}/whisper-tiny.en-tarq-q4_0 model-q4_0.bin'):
        assert usage in body, usage
    assert "## License" not in body


def test_sections_without_data_are_left_out(inputs, tmp_path):
    out = tmp_path / "stage"
    argv = ["publish", str(out), "--repo-id", f"{USER}/plain", "--file", str(inputs["bin"]), "--dry-run"]
    assert cli.main(argv) == 0
    text = (out / "README.md").read_text()
    meta = hub.check_card(text).metadata
    assert "model-index" not in meta and "base_model" not in meta and "license" not in meta
    for section in ("## Evaluation", "## Speed and memory", "## Quantization recipe"):
        assert section not in text
    assert "## License" in text and "## Usage" in text
    assert sorted(p.name for p in out.iterdir()) == ["README.md", "model-q4_0.bin"]


def test_card_check_rejects_a_malformed_model_index():
    bad = "---\npipeline_tag: automatic-speech-recognition\nmodel-index:\n- name: x\n  results:\n  - task: {}\n---\n"
    with pytest.raises(UserError, match="model-index|metadata does not parse"):
        hub.check_card(bad)
    with pytest.raises(UserError, match="base_model_relation"):
        hub.check_card("---\npipeline_tag: automatic-speech-recognition\nbase_model_relation: quantized\n---\n")


def test_eval_input_errors_name_the_field(inputs):
    with pytest.raises(UserError, match=r"datasets\[0\].*models\[0\] \(F16\): 'wer' missing"):
        hub.eval_datasets({"datasets": [{"name": "d", "n_utterances": 1, "models": [{"label": "F16"}]}]},
                          "e.json", set(), None)
    two_rows = {"datasets": [{"name": "d", "n_utterances": 1,
                              "models": [{"label": "a", "wer": 0.1}, {"label": "b", "wer": 0.2}]}]}
    with pytest.raises(UserError, match="--eval-model"):
        hub.eval_datasets(two_rows, "e.json", {"model.bin"}, None)
    assert hub.eval_datasets(two_rows, "e.json", set(), "b")[0].published == "b"


def test_staging_never_replaces_a_foreign_folder(inputs, tmp_path):
    foreign = tmp_path / "work"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    with pytest.raises(UserError, match="not a folder staged by tarq-deploy"):
        hub.stage(foreign, "---\n---\n", [])
    assert (foreign / "notes.txt").read_text() == "mine"


# ----------------------------------------------------------------------------------------------------- the upload
def test_publish_uploads_every_file_byte_exact_and_creates_the_repo_once(inputs, tmp_path, hub_env, capsys):
    fake, out, repo_id = FakeHub(), tmp_path / "stage", f"{USER}/whisper-tiny.en-tarq-q4_0"
    with serving(fake) as url:
        # first publish: the real CLI in a fresh process, the endpoint from HF_ENDPOINT as a user would set it
        env = {**os.environ, "HF_ENDPOINT": url, "HF_TOKEN": TOKEN, "HF_HOME": str(tmp_path / "hf-home"),
               "NO_PROXY": "127.0.0.1,localhost", "HF_HUB_DISABLE_TELEMETRY": "1", "PYTHONPATH": str(REPO_ROOT)}
        run = subprocess.run([sys.executable, "-m", "tarq_deploy.cli", *publish_argv(inputs, out, repo_id)],
                             env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120)
        assert run.returncode == 0, run.stderr
        assert "created the repo and published" in run.stdout
        tree = expected_tree(inputs, out)
        repo = fake.repos[repo_id]
        assert repo.files() == {**tree, ".gitattributes": repo.files()[".gitattributes"]}  # every byte, nothing else
        assert fake.validated_cards == [tree["README.md"].decode()]
        head = repo.branches["main"]

        # the same content again: no new commit, and the command says so
        hub_env(url)
        assert cli.main(publish_argv(inputs, out, repo_id)) == 0
        assert "nothing to publish" in capsys.readouterr().out
        assert repo.branches["main"] == head

    assert fake.created == [repo_id]
    assert [c for c in fake.calls if c[1].endswith("/commit/main")] == [("POST", f"/api/models/{repo_id}/commit/main")]
    assert fake.unexpected == []
    first_publish = fake.calls[:fake.calls.index(("POST", f"/api/models/{repo_id}/commit/main")) + 1]
    assert first_publish == [("GET", "/api/whoami-v2"), ("GET", f"/api/models/{repo_id}"),
                             ("POST", "/api/repos/create"), ("GET", f"/api/models/{repo_id}/revision/main"),
                             ("POST", "/api/validate-yaml"), ("POST", f"/api/models/{repo_id}/preupload/main"),
                             ("POST", f"/api/models/{repo_id}/commit/main")]


def test_publish_to_a_new_branch_leaves_main_alone(inputs, tmp_path, hub_env, capsys):
    fake, repo_id = FakeHub(), f"{ORG}/whisper-tiny.en-tarq"
    with serving(fake) as url:
        hub_env(url)
        argv = publish_argv(inputs, tmp_path / "stage", repo_id, "--revision", "candidate", "--private",
                            "--message", "TARQ g32 candidate", measured=False)
        assert cli.main(argv) == 0
    repo = fake.repos[repo_id]
    assert repo.private and set(repo.files("main")) == {".gitattributes"}
    assert repo.files("candidate")["model-q4_0.bin"] == inputs["bin"].read_bytes()
    assert "published" in capsys.readouterr().out and fake.unexpected == []


def test_network_failure_mid_upload_says_what_state_the_repo_is_in(inputs, tmp_path, hub_env, capsys):
    fake, repo_id = FakeHub(fail="commit-drop"), f"{USER}/dropped"
    with serving(fake) as url:
        hub_env(url)
        assert cli.main(publish_argv(inputs, tmp_path / "stage", repo_id, measured=False)) == 1
    err = capsys.readouterr().err
    assert "upload failed: network failure" in err
    assert "is unchanged" in err and "no commit was made" in err and "created by this run (public)" in err
    assert set(fake.repos[repo_id].files()) == {".gitattributes"}


def test_a_repo_owned_by_someone_else_is_refused_clearly(inputs, tmp_path, hub_env, capsys):
    fake = FakeHub(fail="create-403")
    with serving(fake) as url:
        hub_env(url)
        # a namespace that is neither the user's nor one of their organisations: refused before any write
        assert cli.main(publish_argv(inputs, tmp_path / "a", "someone-else/model", measured=False)) == 2
        assert "belongs to someone else" in capsys.readouterr().err
        assert fake.calls == [("GET", "/api/whoami-v2")]
        # the Hub itself refusing (403): a clear message, non-zero exit, nothing created
        assert cli.main(publish_argv(inputs, tmp_path / "b", f"{ORG}/model", measured=False)) == 1
        err = capsys.readouterr().err
        assert "403" in err and "may not write there" in err and "Nothing was created or uploaded" in err
    assert fake.repos == {} and fake.unexpected == []


def test_no_token_and_no_endpoint_give_clear_errors(inputs, tmp_path, hub_env, monkeypatch, capsys):
    hub_env("http://127.0.0.1:9")  # discard port: nothing listens
    monkeypatch.delenv("HF_TOKEN")
    assert cli.main(publish_argv(inputs, tmp_path / "a", f"{USER}/model", measured=False)) == 2
    assert "no Hugging Face token" in capsys.readouterr().err
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    assert cli.main(publish_argv(inputs, tmp_path / "b", f"{USER}/model", measured=False)) == 1
    err = capsys.readouterr().err
    assert "network failure talking to http://127.0.0.1:9" in err and "Nothing was created or uploaded" in err


def test_the_eval_commands_own_report_feeds_the_card(inputs, tmp_path):
    """`tarq-deploy eval`'s report.json (built here by the real report code) is read directly; a label run through
    two backends becomes one row per backend, named by its key."""
    from tarq_deploy.evaluate.report import DatasetRuns, ModelRun, ReportOptions, build_report
    from tarq_deploy.evaluate.wer import score_utterance
    from tarq_deploy.hub import eval_datasets

    pairs = [("the abbot of dunfermline spoke", "the abbot of dunfermline spoke"),
             ("seventeen hogsheads of claret", "seventeen hogs heads of claret")]

    def run(label: str, backend: str, source: str, hypotheses: list[str]) -> ModelRun:
        scores = [score_utterance(f"u{i}", ref, hyp) for i, ((ref, _), hyp) in enumerate(zip(pairs, hypotheses))]
        return ModelRun(f"{label} [{backend}]", label, backend, source, scores, 1.0, 6.0)

    runs = [run("F16", "torch", "packaged:tiny.en", [h for _, h in pairs]),
            run("F16", "whisper.cpp", "out/tiny.en-f16.bin", [h for _, h in pairs]),
            run("TARQ", "whisper.cpp", "out/model-q4_0.bin", ["the abbot of dunfermline spoke", "claret"])]
    report = build_report([DatasetRuns("synth", "eval.jsonl", runs)], ReportOptions(n_resamples=50),
                          {"zipf_threshold": 3.0})
    (dataset,) = eval_datasets(json.loads(json.dumps(report)), "report.json", {"model-q4_0.bin"}, None)
    assert [r.label for r in dataset.rows] == ["F16 [torch]", "F16 [whisper.cpp]", "TARQ"]
    assert dataset.n_utterances == 2 and dataset.published == "TARQ" and dataset.zipf_threshold == 3.0
    tarq = dataset.rows[2]
    assert tarq.wer.value == pytest.approx(report["datasets"][0]["models"][2]["wer"]["value"]) and tarq.wer.value > 0
    assert tarq.n_words == report["datasets"][0]["words"]


# ----------------------------------------------------------------------------------- failure figures and decoding
def _report_with_failures(tmp_path: Path, published_loops: bool) -> Path:
    """An eval report made by the real report code: F16 and the published file on one long recording and two
    utterances; the published file loops on every utterance when ``published_loops``."""
    from tarq_deploy.data.long_form import Span
    from tarq_deploy.evaluate.failure_runs import failure_section
    from tarq_deploy.evaluate.report import DatasetRuns, ModelRun, ReportOptions, build_report
    from tarq_deploy.evaluate.wer import score_utterance
    from tarq_deploy.runtimes.decoding import profile_named

    refs = [("u0", "the abbot of dunfermline spoke to the assembled monks"),
            ("u1", "seventeen hogsheads of claret came from bordeaux by sea")]
    loop = " the monks" * 8
    hyps = {"F16 [whisper.cpp]": [r for _, r in refs],
            "TARQ [whisper.cpp]": [r + (loop if published_loops else "") for _, r in refs]}
    runs = [ModelRun(key, key.split(" ")[0], "whisper.cpp", source,
                     [score_utterance(uid, ref, hyp) for (uid, ref), hyp in zip(refs, hyps[key])], 1.0, 6.0)
            for key, source in (("F16 [whisper.cpp]", "out/tiny.en-f16.bin"),
                                ("TARQ [whisper.cpp]", "out/model-q4_0.bin"))]
    settings = {"zipf_threshold": 3.0, "decoding": profile_named("cli").record(), "reference": "F16"}
    report = build_report([DatasetRuns("synth", "eval.jsonl", runs)], ReportOptions(n_resamples=50), settings)
    report["datasets"][0]["failures"] = failure_section(refs, hyps, {"u0": (Span("speech", 0.0, 3.0, "u0", 0, 9),)},
                                                        [("TARQ [whisper.cpp]", "F16 [whisper.cpp]")], 50, 0)
    path = tmp_path / "report.json"
    path.write_text(json.dumps(report))
    return path


def _publish_dry_run(tmp_path: Path, inputs: dict, report: Path) -> list[str]:
    """`publish --dry-run` of the tiny Q4 file with ``report`` as its eval, staged into tmp_path/out."""
    return ["publish", str(tmp_path / "out"), "--repo-id", "me/tiny-q4", "--file", str(inputs["bin"]), "--eval",
            str(report), "--eval-model", "TARQ", "--base-model", "openai/whisper-tiny.en", "--license", "mit",
            "--dry-run"]


def test_publish_refuses_a_file_that_loops_more_than_its_f16_unless_allowed(inputs, tmp_path, capsys):
    report = _report_with_failures(tmp_path, published_loops=True)
    argv = _publish_dry_run(tmp_path, inputs, report)
    assert cli.main(argv) == 1
    err = capsys.readouterr().err.strip()
    assert "loop_rate of TARQ is 1 against F16's 0" in err and "--allow-regressions" in err, err
    assert len(err.splitlines()) == 1 and not (tmp_path / "out").exists()  # refused before staging anything
    assert cli.main(argv + ["--allow-regressions"]) == 0
    card = (tmp_path / "out" / "README.md").read_text()
    assert "Decoding: `cli` (whisper-cli's defaults" in card
    assert "| **TARQ** | 0.0 | 100.0 | 0.0 |" in card  # empty outputs, loops, dropped spans of the published row
    from tarq_deploy.hashing import file_sha256

    assert f"`{file_sha256(inputs['bin'])}`" in card  # each file's sha256
    assert f"whisper-cli -m {inputs['bin'].name} -f audio.wav\n" in card  # decoded as the figures were: cli's own
    assert "params_sampling_strategy=1" in card


def test_a_file_that_fails_no_more_than_its_f16_publishes_and_greedy_usage_says_so(inputs, tmp_path, capsys):
    report = _report_with_failures(tmp_path, published_loops=False)
    doc = json.loads(report.read_text())
    doc["settings"]["decoding"] = {"profile": "greedy", "description": "greedy"}
    report.write_text(json.dumps(doc))
    argv = _publish_dry_run(tmp_path, inputs, report)
    assert cli.main(argv) == 0, capsys.readouterr().err
    card = (tmp_path / "out" / "README.md").read_text()
    assert "Decoding: `greedy`" in card and "-bs 1 -nf -nt -sns" in card and "temperature_inc=0.0" in card


def test_the_card_shows_term_recall_and_the_terms_the_file_loses(inputs, tmp_path, capsys):
    """An eval report with a term section (evaluate/terms.py, built by the real code): the card has each row's
    recall and term-WER and names the terms the published file loses where F16 keeps them."""
    from tarq_deploy.data.terms import Term, TermList
    from tarq_deploy.evaluate.terms import term_section
    from tarq_deploy.evaluate.wer import score_utterance

    report = _report_with_failures(tmp_path, published_loops=False)
    doc = json.loads(report.read_text())
    refs = ["the abbot of dunfermline spoke to the assembled monks",
            "seventeen hogsheads of claret came from bordeaux by sea"]
    hyps = {"F16 [whisper.cpp]": refs, "TARQ [whisper.cpp]": [refs[0], refs[1].replace("hogsheads", "hogs heads")]}
    terms = TermList("terms.txt", (Term("dunfermline"), Term("hogsheads"), Term("claret")), "ab" * 32)
    runs = {key: [score_utterance(f"u{i}", r, h) for i, (r, h) in enumerate(zip(refs, texts))]
            for key, texts in hyps.items()}
    doc["datasets"][0]["terms"] = term_section(terms, runs, [("TARQ [whisper.cpp]", "F16 [whisper.cpp]")],
                                               ["u0", "u1"], 50, 0)
    report.write_text(json.dumps(doc))
    argv = _publish_dry_run(tmp_path, inputs, report)
    assert cli.main(argv) == 0, capsys.readouterr().err
    card = (tmp_path / "out" / "README.md").read_text()
    assert "Terms of `terms.txt` (sha256 abababababab…): 3 of 3 terms occur, 3 times." in card
    assert "| F16 | 100.0 [100.0, 100.0] | 0.0 [0.0, 0.0] |" in card
    assert "| **TARQ** | 66.7 [" in card
    assert "Terms TARQ loses somewhere F16 keeps them: hogsheads." in card
