"""No command writes over what it reads, one writer per output, and a sweep file read strictly (issue #27); what a
write leaves (a named file in a target folder, nothing on a refused or full disk, the usual permissions, a checkpoint
that reads back or is refused by name) (issue #14).

Each refusal: exit status 2, one line naming both paths (or the key), the inputs byte for byte as they were, and
nothing partial left. The lock tests run two real processes: a first run held inside its lock (the real command,
stopped where it would load the model) and a second one into the same --out."""

from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import pytest
from helpers import assert_user_error, forbid_loading, quantize_args, run_cli

from tarq_deploy import cli
from tarq_deploy.checkpoint import CheckpointError, load_checkpoint
from tarq_deploy.sweep.plan import load_sweep

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.usefixtures("one_torch_thread")  # conftest.py: small torch ops, one thread


def snapshot(*roots: Path) -> dict[str, bytes | None]:
    """Every file and folder under ``roots`` (and their parents' listings): what 'untouched' compares."""
    found: dict[str, bytes | None] = {}
    for root in roots:
        for folder in {root.parent, *([root] if root.is_dir() else [])}:
            found[f"{folder}/"] = "\n".join(sorted(os.listdir(folder))).encode()
        paths = [root, *root.rglob("*")] if root.is_dir() else [root]
        for path in paths:
            found[str(path)] = None if path.is_dir() else path.read_bytes()
    return found


@pytest.fixture
def ckpt(checkpoint, tmp_path) -> Path:  # a copy: a failing test must not spoil the shared one
    return Path(shutil.copytree(checkpoint, tmp_path / "ckpt"))


# ----------------------------------------------------------------------------------------------------- export
@pytest.mark.parametrize("target, output", [
    ("whisper.cpp", "ckpt/lattice.safetensors"),  # the reported case: the lattice replaced by a .bin
    ("whisper.cpp", "link/lattice.safetensors"),  # the same file through a symlink to the checkpoint
    ("gptq", "ckpt"),                             # a GPU target's folder over its own checkpoint
])
def test_export_over_its_checkpoint_is_refused(ckpt, tmp_path, capsys, target, output):
    (tmp_path / "link").symlink_to(ckpt)
    before = snapshot(ckpt)
    status, _, err = run_cli(capsys, "export", "--target", target, ckpt, "-o", tmp_path / output, "--overwrite")
    assert_user_error(status, err, f"--output {tmp_path / output}", f"CHECKPOINT_DIR {ckpt}")
    assert snapshot(ckpt) == before


# ------------------------------------------------------------------------------------------------------- eval
def test_eval_out_over_its_manifest_is_refused(corpus, tmp_path, capsys):
    manifest = Path(shutil.copy(corpus, tmp_path / "test.jsonl"))
    before = snapshot(manifest)
    status, _, err = run_cli(capsys, "eval", "--data", manifest, "--model", "packaged:tiny.en", "--out", manifest)
    assert_user_error(status, err, f"--out {manifest}: is the input --data {manifest}")
    assert snapshot(manifest) == before


def test_eval_out_inside_a_model_checkpoint_is_refused(ckpt, corpus, capsys):
    before = snapshot(ckpt)
    status, _, err = run_cli(capsys, "eval", "--data", corpus, "--model", ckpt, "--out", ckpt / "eval")
    assert_user_error(status, err, f"--out {ckpt / 'eval'}: lies inside the input --model {ckpt}")
    assert snapshot(ckpt) == before


# ------------------------------------------------------------------------------------------------------ bench
def test_bench_out_inside_its_checkpoint_is_refused(ckpt, capsys):
    before = snapshot(ckpt)
    status, _, err = run_cli(capsys, "bench", "--gpu", "--model", "packaged:tiny.en", "--checkpoint", ckpt,
                          "--out", ckpt / "bench")
    assert_user_error(status, err, f"--out {ckpt / 'bench'}", f"--checkpoint {ckpt}")
    assert snapshot(ckpt) == before


def test_bench_may_still_rerender_a_saved_result_in_place(tmp_path):
    from tarq_deploy.checks import check_outputs_apart
    from tarq_deploy.commands.bench import bench_inputs, bench_outputs

    saved = tmp_path / "bench-cpu.json"
    saved.write_text('{"kind": "cpu", "cells": []}\n')
    args = cli.build_parser().parse_args(["bench", "--report-only", str(saved), "--out", str(tmp_path)])
    check_outputs_apart(bench_outputs(args), bench_inputs(args))  # the documented re-render: no error
    args.report_only = str(tmp_path / "other.json")
    (tmp_path / "other.json").write_text("{}")
    args.name = "other"
    check_outputs_apart(bench_outputs(args), bench_inputs(args))


# ---------------------------------------------------------------------------------------------------- publish
def test_publish_staging_over_a_published_file_is_refused(tmp_path, capsys):
    staged = tmp_path / "hub"
    staged.mkdir()
    model = staged / "model.bin"
    model.write_bytes(b"lmgg" + bytes(64))
    before = snapshot(staged)
    status, _, err = run_cli(capsys, "publish", staged, "--repo-id", "me/m", "--file", model, "--dry-run")
    assert_user_error(status, err, f"-o/--out {staged}: would replace the folder holding the input --file {model}")
    assert snapshot(staged) == before


def test_publish_staging_over_its_checkpoint_is_refused(ckpt, capsys):
    before = snapshot(ckpt)
    status, _, err = run_cli(capsys, "publish", ckpt, "--repo-id", "me/m", "--checkpoint", ckpt, "--dry-run")
    assert_user_error(status, err, f"-o/--out {ckpt}: is the input --checkpoint {ckpt}")
    assert snapshot(ckpt) == before


# --------------------------------------------------------------------------------------------------- quantize
def _quantize_leftovers(out: Path) -> list[Path]:
    names = (".partial", ".partial.lock", ".log.json")
    return [p for p in (out.with_name(out.name + n) for n in names) if p.exists()]


@pytest.mark.parametrize("where, message", [
    ("model", "is the input --model"),
    ("model/ckpt", "lies inside the input --model"),
    ("calib", "is the input --calib"),
])
def test_quantize_out_over_its_inputs_is_refused(models, corpus, tmp_path, capsys, monkeypatch,
                                                 where, message):
    model = Path(shutil.copytree(models["clean"], tmp_path / "model"))
    calib = Path(shutil.copy(corpus, tmp_path / "calib"))
    out = tmp_path / where
    before = snapshot(model, calib)
    forbid_loading(monkeypatch)
    status, _, err = run_cli(capsys, *quantize_args(model, out, "--method", "gptq", calib=calib))
    assert_user_error(status, err, f"--out {out}: {message}")
    assert snapshot(model, calib) == before
    assert _quantize_leftovers(out) == []


# ------------------------------------------------------------------------------------------------------ sweep
SWEEP = '[sweep]\nmethods = ["rtn"]\nsteps = ["quantize"]\n[models]\n{models}\n'


def _sweep_file(tmp_path: Path, models: str = 'a = "packaged:tiny.en"', extra: str = "") -> Path:
    path = tmp_path / "sweep.toml"
    path.write_text(SWEEP.format(models=models) + extra)
    return path


def test_sweep_out_over_its_sweep_file_is_refused(tmp_path, capsys):
    sweep = _sweep_file(tmp_path)
    before = snapshot(sweep)
    status, _, err = run_cli(capsys, "sweep", sweep, "--out", sweep)
    assert_user_error(status, err, f"--out {sweep}: is the input SWEEP.toml {sweep}")
    assert snapshot(sweep) == before


def test_sweep_out_inside_a_model_folder_is_refused(models, tmp_path, capsys):
    model = Path(shutil.copytree(models["clean"], tmp_path / "model"))
    sweep = _sweep_file(tmp_path, f'local = "{model}"')
    before = snapshot(model, sweep)
    status, _, err = run_cli(capsys, "sweep", sweep, "--out", model / "runs", "--plan")
    assert_user_error(status, err, f"--out {model / 'runs'}: lies inside the input [models] local {model}")
    assert snapshot(model, sweep) == before


# ------------------------------------------------------------------------------------------- one writer per --out
def _held(code: str, *argv: str | Path) -> subprocess.Popen:
    """A real `tarq-deploy` run in another process, stopped inside its lock until the test kills it; returns once
    it holds the lock."""
    holder = subprocess.Popen([sys.executable, "-c", code, *map(str, argv)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO)
    line = holder.stdout.readline()  # "locked", or "" when it exited first
    if line != "locked\n":
        holder.kill()
        pytest.fail(f"the first run did not get to its lock: {line!r} {holder.communicate()[1][-2000:]}")
    return holder


HOLD = """
import sys
from tarq_deploy import cli
import {module} as stop_here

def hold(*args, **kwargs):  # reached with the lock held
    print("locked", flush=True)
    sys.stdin.read()  # until killed

stop_here.{function} = hold
sys.exit(cli.main(sys.argv[1:]))
"""


def test_second_quantize_into_one_out_is_refused_naming_the_holder(models, tmp_path, capsys):
    out = tmp_path / "ckpt"
    argv = quantize_args(models["clean"], out, "--method", "rtn")
    first = _held(HOLD.format(module="tarq_deploy.commands.quantize", function="load_checked_backbone"), *argv)
    try:
        lock = out.with_name("ckpt.partial.lock")
        assert lock.read_text().split()[0] == str(first.pid)
        started = time.monotonic()
        second = subprocess.run([sys.executable, "-m", "tarq_deploy.cli", *argv], capture_output=True, text=True,
                                cwd=REPO, timeout=300)
        lines = [line for line in second.stderr.splitlines() if "tarq-deploy" in line]
        assert_user_error(second.returncode, "\n".join(lines), f"--out {out}", str(lock), f"pid {first.pid}")
        assert time.monotonic() - started < 120  # refused at once, not after the first run (which never ends)
        assert first.poll() is None and lock.read_text().split()[0] == str(first.pid)  # the first is untouched
        assert not out.exists() and not out.with_name("ckpt.partial").exists()
    finally:
        first.send_signal(signal.SIGKILL)  # an interruption: the kernel drops its lock, the file stays behind
        first.communicate()
    assert lock.exists()
    status, _, err = run_cli(capsys, *argv)  # the run after it is not blocked by the dead run's lock file
    assert status == 0, err
    assert (out / "manifest.json").is_file() and _quantize_leftovers(out) == [out.with_name("ckpt.log.json")]


def test_second_sweep_into_one_out_is_refused_naming_the_holder(tmp_path, capsys):
    sweep, out = _sweep_file(tmp_path), tmp_path / "runs"
    first = _held(HOLD.format(module="tarq_deploy.sweep.driver", function="run_sweep"), "sweep", sweep, "--out", out)
    try:
        lock = out / "sweep.lock"
        status, _, err = run_cli(capsys, "sweep", sweep, "--out", out, "--quiet")
        assert_user_error(status, err, f"--out {out}", str(lock), f"pid {first.pid}")
        assert sorted(p.name for p in out.iterdir()) == ["sweep.lock"]
    finally:
        first.send_signal(signal.SIGKILL)
        first.communicate()


# ------------------------------------------------------------------------------------------ sweep file, strictly
@pytest.mark.parametrize("sweep_keys, tables, fragments", [
    ('methdos = ["gptq"]', "", ("[sweep]: unknown key `methdos`", "did you mean `methods`?",
                                "allowed: target, methods, types, type_methods, baseline, steps, reference")),
    ('basline = "rtn"', "", ("unknown key `basline`", "did you mean `baseline`?")),
    ("refrence = false", "", ("unknown key `refrence`", "did you mean `reference`?")),
    ("", "[eval]\nresampels = 100", ("[eval]: unknown key `resampels`", "did you mean `resamples`?")),
    ("", "[bench]\nthreds = [1]", ("[bench]: unknown key `threds`", "did you mean `threads`?")),
    ("", "[quantize]\nsed = 1", ("[quantize]: unknown key `sed`", "did you mean `seed`?")),
    ("", '[quantize]\nmethod = "gptq"', ("`method` is set for each cell",)),
    ("", '[quantize]\npool = "rare"', ("[quantize] pool: 'rare' is not one of",)),
    ("", '[modles]\nb = "packaged:base"', ("unknown table `[modles]`", "did you mean `models`?")),
    ("", '[calibration]\nc = { manifets = "x.jsonl" }',
     ("[calibration] c: unknown key `manifets`", "did you mean `manifest`?")),
])
def test_sweep_file_unknown_names_are_errors(tmp_path, capsys, sweep_keys, tables, fragments):
    sweep = tmp_path / "sweep.toml"
    sweep.write_text(SWEEP.format(models='a = "packaged:tiny.en"').replace("[models]", f"{sweep_keys}\n[models]")
                     + tables + "\n")
    status, _, err = run_cli(capsys, "sweep", sweep, "--out", tmp_path / "out", "--plan")
    assert_user_error(status, err, str(sweep), *fragments)
    assert not (tmp_path / "out").exists()


def test_sweep_key_before_any_table_is_placed(tmp_path, capsys):
    sweep = tmp_path / "sweep.toml"
    sweep.write_text('baseline = "rtn"\n' + SWEEP.format(models='a = "packaged:tiny.en"'))
    status, _, err = run_cli(capsys, "sweep", sweep, "--out", tmp_path / "out", "--plan")
    assert_user_error(status, err, "`baseline` stands before any table header; it belongs in [sweep]")


def committed_sweep_files() -> list[Path]:
    found = subprocess.run(["git", "ls-files", "*.toml"], capture_output=True, text=True, cwd=REPO).stdout.split()
    return [REPO / name for name in found if "[sweep]" in (REPO / name).read_text()]


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git to list the committed files")
def test_every_committed_sweep_file_still_loads(tmp_path):
    """Read strictly, each committed sweep file still loads (its corpora, made by `corpus synth`, stubbed)."""
    files = committed_sweep_files()
    assert files
    for original in files:
        copy = tmp_path / original.relative_to(REPO)
        copy.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(original, copy)
        doc = tomllib.loads(copy.read_text())
        manifests = [v if isinstance(v, str) else v["manifest"] for v in doc.get("calibration", {}).values()]
        for manifest in [*manifests, *doc.get("evaluation", {}).values()]:
            (copy.parent / manifest).parent.mkdir(parents=True, exist_ok=True)
            (copy.parent / manifest).write_text(json.dumps({"id": "a", "audio": "a.wav", "text": "a"}) + "\n")
        sweep = load_sweep(copy)
        assert sweep.methods and sweep.models, original


def _study_cells(label: str) -> tuple[str, str]:
    """(method, type) of a committed report's model label: 'F16', 'tarq-q4_0' (results/types) or 'TARQ' (round 3,
    every model Q4_0)."""
    if label == "F16":
        return "f16", "f16"
    method, _, type_name = label.lower().partition("-")
    return method, type_name or "q4_0"


@pytest.mark.parametrize("study, report", [("results/types/sweep.toml", "results/types/report.json"),
                                           ("results/rarewords/round3/sweep.toml",
                                            "results/rarewords/round3/test600/report.json")])
def test_study_sweep_files_plan_the_cells_of_their_committed_tables(tmp_path, study, report):
    """Each study's sweep file plans exactly the models of the table it stands for (and evaluates as many utterances)."""
    sweep, cells = _planned(tmp_path, study)
    committed = json.loads((REPO / report).read_text())["datasets"][0]
    assert {(c.method, c.type) for c in cells} == {_study_cells(m["label"]) for m in committed["models"]}
    assert sweep.eval_options.get("limit", committed["utterances"]) == committed["utterances"]


def _planned(tmp_path: Path, study: str):
    """(sweep, cells) of a committed sweep file, its corpora stubbed."""
    from tarq_deploy.sweep.plan import plan_cells

    copy = tmp_path / study
    copy.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy(REPO / study, copy)
    doc = tomllib.loads(copy.read_text())
    manifests = [v if isinstance(v, str) else v["manifest"] for v in doc["calibration"].values()]
    for manifest in [*manifests, *doc["evaluation"].values()]:
        (copy.parent / manifest).parent.mkdir(parents=True, exist_ok=True)
        (copy.parent / manifest).write_text(json.dumps({"id": "a", "audio": "a.wav", "text": "a"}) + "\n")
    sweep = load_sweep(copy)
    hashes = {p: "h" for p in [*(c.manifest for c in sweep.corpora), *sweep.evaluation.values()]}
    cells, _ = plan_cells(sweep, {m: "h" for m in sweep.models}, hashes, "code")
    return sweep, cells


@pytest.mark.parametrize("study, report", [("results/frontier/sweep.toml", "results/frontier/report.json"),
                                           ("results/eval/sweep.toml", "results/eval/report.json"),
                                           ("results/frontier/iq4_xs.toml", "results/frontier/iq4_xs/report.json"),
                                           ("results/frontier-speed/sweep.toml", "results/frontier-speed/report.json")])
def test_sweep_made_tables_hold_the_cells_their_files_plan(tmp_path, study, report):
    """A table the sweep itself made lists exactly the cells its sweep file plans, evaluated on as many utterances."""
    sweep, cells = _planned(tmp_path, study)
    committed = json.loads((REPO / report).read_text())
    assert sorted(c["cell"] for c in committed["cells"]) == sorted(c.name for c in cells)
    for model in committed["models"]:
        for dataset in model["evaluation"]["datasets"]:
            assert dataset["name"] in sweep.evaluation
            assert sweep.eval_options.get("limit", dataset["utterances"]) >= dataset["utterances"]


def test_the_speed_frontier_comes_from_its_sweep_file_with_every_files_speed():
    """results/frontier-speed: the table and the speed columns are one sweep's report: every evaluated file has the
    bench's latency, RTF and max-RSS at each thread count of the sweep file's [bench], on its first audio."""
    doc = tomllib.loads((REPO / "results/frontier-speed/sweep.toml").read_text())
    report = json.loads((REPO / "results/frontier-speed/report.json").read_text())
    threads = doc["bench"]["threads"]
    assert report["frontier"] and all(r["dataset"] == "test" for r in report["frontier"])
    for row in report["frontier"]:
        measured = {s["threads"]: s for s in row["speed"] if s["audio"] == doc["bench"]["audio"][0]}
        assert sorted(measured) == sorted(threads), row["cell"]
        assert all(s["latency_s"] > 0 and 0 < s["rtf"] < 1 and s["max_rss_mb"] > 0 for s in measured.values())


# ------------------------------------------------------------------------------------------------------- export
def test_export_to_a_directory_target_writes_a_named_file_inside(checkpoint, tmp_path, capsys):
    target = tmp_path / "models"
    target.mkdir()
    status, _, _ = run_cli(capsys, "export", "--target", "whisper.cpp", checkpoint, "-o", target)
    assert status == 0
    assert [p.name for p in target.iterdir()] == ["clean-rtn-q4_0.bin"]  # MODEL-METHOD-TYPE, llama.cpp style


def test_export_to_a_read_only_target(checkpoint, tmp_path, capsys, monkeypatch):
    import tarq_deploy.checks as checks

    def denied(*args, **kwargs):
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), kwargs.get("dir"))

    monkeypatch.setattr(checks.tempfile, "TemporaryFile", denied)
    status, _, err = run_cli(capsys, "export", "--target", "whisper.cpp", checkpoint, "-o", tmp_path / "m.bin")
    assert_user_error(status, err, str(tmp_path / "m.bin"), "Permission denied")
    assert list(tmp_path.iterdir()) == []


def test_export_to_a_full_disk(checkpoint, tmp_path, capsys, monkeypatch):
    import tarq_deploy.formats.whisper_cpp as whisper_cpp

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(whisper_cpp, "write_buffers", full)
    out = tmp_path / "m.bin"
    status, _, err = run_cli(capsys, "export", "--target", "whisper.cpp", checkpoint, "-o", out, "--quiet")
    assert_user_error(status, err, str(out), "No space left on device")
    assert list(tmp_path.iterdir()) == []


# ------------------------------------------------------------------------------------------------- checkpoints
def test_tampered_manifest_shape_is_a_checkpoint_error(checkpoint, tmp_path, capsys):
    tampered = tmp_path / "tampered"
    shutil.copytree(checkpoint, tampered)
    manifest = json.loads((tampered / "manifest.json").read_text())
    name = sorted(manifest["quantized"])[0]
    manifest["quantized"][name] = [manifest["quantized"][name][0], 96]
    (tampered / "manifest.json").write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    with pytest.raises(CheckpointError, match="manifest.json: content does not match its own manifest_sha256"):
        load_checkpoint(tampered)
    with pytest.raises(CheckpointError, match=f"blocks of {name} are stored as"):  # no reshape traceback either
        load_checkpoint(tampered, verify_hashes=False)
    status, _, err = run_cli(capsys, "inspect", tampered)
    assert_user_error(status, err, str(tampered / "manifest.json"), "manifest_sha256")


def test_outputs_get_the_usual_permissions(checkpoint, tmp_path):
    from tarq_deploy.fileio import write_bytes_atomic

    umask = os.umask(0o022)
    os.umask(umask)
    file_mode, dir_mode = 0o666 & ~umask, 0o777 & ~umask
    assert os.stat(write_bytes_atomic(tmp_path / "x.bin", b"x")).st_mode & 0o777 == file_mode
    assert os.stat(checkpoint).st_mode & 0o777 == dir_mode
    for path in checkpoint.rglob("*"):
        assert os.stat(path).st_mode & 0o777 == (dir_mode if path.is_dir() else file_mode), path


def test_atomic_file_writes_through_the_temporary_it_made(tmp_path, monkeypatch):
    """Outputs are written through the descriptor that created them: opening an existing temporary again with "wb"
    truncated it, and ext4 flushes a file truncated to zero when it closes, which doubled the time to write a model
    file. Text and binary modes both work, and a failed writer leaves nothing."""
    import builtins

    from tarq_deploy.fileio import atomic_file

    def no_reopen(*args, **kwargs):
        raise AssertionError(f"atomic_file opened {args[0]!r} again")

    monkeypatch.setattr(builtins, "open", no_reopen)
    with atomic_file(tmp_path / "model.bin") as f:
        f.write(b"\x00model")
    with atomic_file(tmp_path / "card.md", "w") as f:
        f.write("# card\n")
    with pytest.raises(RuntimeError), atomic_file(tmp_path / "broken.bin") as f:
        f.write(b"half")
        raise RuntimeError("writer failed")
    monkeypatch.undo()
    assert (tmp_path / "model.bin").read_bytes() == b"\x00model"
    assert (tmp_path / "card.md").read_text() == "# card\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["card.md", "model.bin"]


def test_atomic_path_hands_a_writer_a_path_that_does_not_exist_yet(tmp_path):
    """A writer that opens the file itself creates it (no truncation of a temporary made for it), under the target's
    own name and suffix; the result gets the usual permissions, and nothing else is left. A writer that makes no
    file is an error naming the target, not an empty output."""
    from tarq_deploy.fileio import atomic_path, default_file_mode

    with atomic_path(tmp_path / "model.gguf") as tmp:
        assert not tmp.exists() and tmp.name == "model.gguf" and tmp.parent.parent == tmp_path
        tmp.write_bytes(b"GGUF")
    assert (tmp_path / "model.gguf").read_bytes() == b"GGUF"
    assert os.stat(tmp_path / "model.gguf").st_mode & 0o777 == default_file_mode()
    with pytest.raises(OSError, match="the writer made no file") as made_nothing, atomic_path(tmp_path / "x.bin"):
        pass
    assert made_nothing.value.filename == str(tmp_path / "x.bin")
    with pytest.raises(RuntimeError), atomic_path(tmp_path / "y.bin") as tmp:
        tmp.write_bytes(b"half")
        raise RuntimeError("writer failed")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.gguf"]


# ------------------------------------------------------------------------------------------- a bad sweep file
@pytest.mark.parametrize("text, fragment", [
    (None, "no such sweep file"),
    ("[sweep\n", "not a readable TOML sweep file"),
    ('[sweep]\nmethods = ["gptq"]\n[models]\na = "packaged:tiny.en"\n', "[calibration] names no corpus"),
    ('[sweep]\nmethods = ["gptq"]\ntarget = "marlin"\n[models]\na = "packaged:tiny.en"\n', "target 'marlin'"),
    ('[sweep]\nmethods = ["gptq"]\nsteps = ["quantize"]\n[models]\na = "packaged:tiny.en"\n[calibration]\n'
     'c = "missing.jsonl"\n',
     "missing.jsonl does not exist"),
])
def test_bad_sweep_file_is_one_line_before_any_work(tmp_path, capsys, text, fragment):
    sweep = tmp_path / "sweep.toml"
    if text is not None:
        sweep.write_text(text)
    status, _, err = run_cli(capsys, "sweep", sweep, "--out", tmp_path / "out")
    assert_user_error(status, err, fragment)
    assert not (tmp_path / "out").exists()
