"""Running one step of a sweep: the `tarq-deploy` command it stands for, in a child process, into the step's own
content-addressed folder.

A step is the same command a user would type (quantize, export, verify, eval, bench), so a sweep cell fails and
resumes exactly as the command does: a calibration interrupted mid-model resumes from its ``OUT.partial``, an
evaluation from its hypothesis cache. A step's folder is final once ``done.json`` is in it; a failure leaves no
``done.json`` and is retried by the next run. The child dies with the process that started it (PR_SET_PDEATHSIG),
so killing a sweep leaves no calibration running behind it.
"""
from __future__ import annotations

import ctypes
import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

from ..evaluate.teacher_forced import TEACHER_FORCED_LINES
from ..fileio import write_json_atomic
from ..hashing import json_fingerprint
from ..machine import machine_record
from .plan import TARGETS, Step

__all__ = ["LOG", "StepResult", "append_log", "finished", "run_step"]

DONE = "done.json"
LOG = "cells.log.jsonl"
PR_SET_PDEATHSIG = 1
REFERENCE_LABEL = "F16"  # the score step's label for the model's F16 file
PATH_OUTPUTS = frozenset({"checkpoint", "file", "report", "utterances", "figures", "bench"})  # stored relative to OUT


@dataclass(frozen=True)
class StepResult:
    """What a step left behind: ``status`` is done (ran now), cached (found finished), failed or skipped (a step it
    needs failed); ``outputs`` names its files."""

    kind: str
    key: str
    status: str
    outputs: dict[str, str] = field(default_factory=dict)
    error: str = ""
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return self.status in ("done", "cached")


def step_dir(out: Path, step: Step) -> Path:
    return out / "steps" / step.kind / step.key


def append_log(out: Path, record: dict[str, Any]) -> None:
    """One JSON line per event; O_APPEND keeps lines whole when several workers write at once."""
    line = (json.dumps(record, sort_keys=True) + "\n").encode()
    fd = os.open(out / LOG, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line)
    finally:
        os.close(fd)


def finished(out: Path, step: Step, upstream: Sequence[StepResult] = ()) -> StepResult | None:
    """The cached result of a step whose folder is complete, else None."""
    folder = _output_dir(out, step, upstream)
    marker = folder / DONE
    if not marker.is_file():
        return None
    record = json.loads(marker.read_text())
    outputs = {name: str(out / value) if name in PATH_OUTPUTS else value
               for name, value in record.get("outputs", {}).items()}
    return StepResult(step.kind, step.key, "cached", outputs, seconds=record.get("seconds", 0.0))


def run_step(out: Path, step: Step, cells: Sequence[str], cpus: int, *upstream: StepResult) -> StepResult:
    """Run ``step`` unless finished; never raises (a failure is a result, so the sweep carries on)."""
    inputs = {r.key: r for r in upstream}
    needed = [inputs[k] for k in step.needs if k in inputs]
    blocking = [r for r in needed + [inputs[k] for k in step.after if k in inputs] if not r.ok]
    if step.kind == "bench":  # measures every file that was made; a failed cell is reported by its own steps
        needed = [r for r in needed if r.ok]
        blocking = [] if needed else [StepResult("export", "-", "failed", error="no exported file")]
    if blocking:
        return StepResult(step.kind, step.key, "skipped", error=f"{blocking[0].kind} did not finish")
    cached = finished(out, step, needed)
    if cached:
        return cached
    machine = {**machine_record(), **node_record(), "threads": cpus}  # where it ran: the scope of its bytes
    append_log(out, {"event": "start", "step": step.kind, "key": step.key, "cells": list(cells), "machine": machine})
    started = time.monotonic()
    folder = _output_dir(out, step, needed)
    folder.mkdir(parents=True, exist_ok=True)
    try:
        outputs = _RUNNERS[step.kind](step, folder, needed, cpus)
        error = ""
    except StepFailed as failure:
        outputs, error = {}, str(failure)
    except Exception as bug:  # noqa: BLE001 - a bug in one cell must not stop the sweep; it is reported
        outputs, error = {}, f"{type(bug).__name__}: {bug}"
    seconds = round(time.monotonic() - started, 3)
    status = "failed" if error else "done"
    if not error:
        relative = {name: str(Path(value).relative_to(out)) if name in PATH_OUTPUTS else value
                    for name, value in outputs.items()}  # the output folder may move; its steps go with it
        write_json_atomic(folder / DONE, {"step": step.kind, "key": step.key, "params": dict(step.params),
                                          "outputs": relative, "seconds": seconds, "machine": machine})
    append_log(out, {"event": status, "step": step.kind, "key": step.key, "cells": list(cells),
                     "seconds": seconds, **({"error": error} if error else {})})
    return StepResult(step.kind, step.key, status, outputs, error, seconds)


def node_record() -> dict[str, Any]:
    """The node a step runs on: its host name, and its Ray node id and IP when it runs in a Ray worker (ray is then
    already imported; this never imports it, so a step run outside Ray records its host alone)."""
    record: dict[str, Any] = {"host": socket.gethostname()}
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        record["ray_node_id"] = ray.get_runtime_context().get_node_id()
        record["ray_node_ip"] = ray.util.get_node_ip_address()
    return record


class StepFailed(RuntimeError):
    """The command of a step exited non-zero; the message is its own one-line error."""


def _output_dir(out: Path, step: Step, needed: Sequence[StepResult]) -> Path:
    folder = step_dir(out, step)
    if step.kind == "bench":  # a bench measures the files that exist: a cell that failed today may not tomorrow
        folder = folder.with_name(f"{step.key}-{json_fingerprint(sorted(r.key for r in needed))[:16]}")
    return folder


# ---------------------------------------------------------------------------------------------- the commands
def _tarq_deploy(args: list[str], folder: Path, cpus: int, ok_codes: tuple[int, ...] = (0,)) -> str:
    """Run ``tarq-deploy ARGS`` (its stdout and stderr into folder/log.txt); returns stdout."""
    env = {**os.environ, "OMP_NUM_THREADS": str(cpus), "OMP_WAIT_POLICY": "PASSIVE"}
    with open(folder / "log.txt", "ab") as log:
        log.write(("$ tarq-deploy " + " ".join(args) + "\n").encode())
        log.flush()
        process = subprocess.run([sys.executable, "-m", "tarq_deploy.cli", *args], stdout=subprocess.PIPE,
                                 stderr=log, env=env, preexec_fn=_die_with_parent, check=False)
        log.write(process.stdout)
    if process.returncode not in ok_codes:
        raise StepFailed(_last_error(folder / "log.txt") or f"tarq-deploy {args[0]} exited {process.returncode}")
    return process.stdout.decode("utf-8", "replace")


def _die_with_parent() -> None:
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def _last_error(log: Path) -> str:
    text = log.read_text("utf-8", "replace").replace("\r", "\n")  # progress bars redraw with carriage returns
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    errors = [line for line in lines if "error" in line.lower()]
    last = (errors or lines or [""])[-1]
    return last[last.find("tarq-deploy "):][:500] if "tarq-deploy " in last else last[:500]  # drop a bar before it


def _flags(options: dict[str, Any]) -> list[str]:
    """{'n_calib': 512, 'act_order': False, 'quiet': True} -> ['--n-calib', '512', '--no-act-order', '--quiet']."""
    argv: list[str] = []
    for name, value in options.items():
        flag = "--" + name.replace("_", "-")
        if value is True:
            argv.append(flag)
        elif value is False:
            argv.append("--no-" + name.replace("_", "-"))
        else:
            argv += [flag, str(value)]
    return argv


def _quantize(step: Step, folder: Path, needed: Sequence[StepResult], cpus: int) -> dict[str, str]:
    p = step.params
    checkpoint = folder / "checkpoint"
    data = ["--calib", p["calib"], *(["--n-calib", str(p["n_calib"])] if p.get("n_calib") else [])] \
        if "calib" in p else []
    _tarq_deploy(["quantize", "--model", p["model"], "--method", p["method"], "--target", p["target"],
                  "--type", p["type"], *(["--group-size", str(p["group_size"])] if "group_size" in p else []),
                  *data, *(arg for rule in p.get("tensor_type", ()) for arg in ("--tensor-type", rule)),
                  *_flags(p["options"]),
                  "--out", str(checkpoint)], folder, cpus)
    return {"checkpoint": str(checkpoint)}


def _export(step: Step, folder: Path, needed: Sequence[StepResult], cpus: int) -> dict[str, str]:
    p = step.params
    file = folder / (p["slug"] + TARGETS[p["target"]][1])
    source = ["--model", p["model"], "--type", p["type"]] if "model" in p else [needed[0].outputs["checkpoint"]]
    _tarq_deploy(["export", "--target", p["target"], *source, "-o", str(file), "--quiet"], folder, cpus)
    return {"file": str(file), "bytes": str(file.stat().st_size)}


def _verify(step: Step, folder: Path, needed: Sequence[StepResult], cpus: int) -> dict[str, str]:
    exported, quantized = needed
    report = _tarq_deploy(["verify", exported.outputs["file"], "--against", quantized.outputs["checkpoint"],
                           "--json"], folder, cpus, ok_codes=(0, 1))  # 1: arrays differ, checked below
    diffs, _ = json.JSONDecoder().raw_decode(report)  # the JSON object, then verify's one-line verdict
    worst = max(diffs.values(), default=0.0)
    if worst != 0:
        raise StepFailed(f"verify: {exported.outputs['file']} differs from its checkpoint (max |diff| {worst})")
    write_json_atomic(folder / "verify.json", diffs)
    return {"arrays": str(len(diffs)), "max_abs_diff": "0"}


def _data_args(params: Mapping[str, Any]) -> list[str]:
    """eval's --data NAME=MANIFEST arguments for the evaluation sets a step's params name."""
    return [arg for name, d in params["data"].items() for arg in ("--data", f"{name}={d['manifest']}")]


def _eval(step: Step, folder: Path, needed: Sequence[StepResult], cpus: int) -> dict[str, str]:
    p = step.params
    options = {"threads": 1, **p["options"]}
    backends = options.pop("backends", [p["runtime"]])
    data = _data_args(p)
    models = [arg for backend in backends
              for arg in ("--model", f"{p['label']}={needed[0].outputs['file']}", "--backend", backend)]
    tokenizer = ["--tokenizer", p["tokenizer"]] if "tokenizer" in p else []
    _tarq_deploy(["eval", *data, *models, *tokenizer, *_flags(options), "--out", str(folder), "--quiet"], folder, cpus)
    return {"report": str(folder / "report.json"), "utterances": str(folder / "utterances.jsonl")}


def _score(step: Step, folder: Path, needed: Sequence[StepResult], cpus: int) -> dict[str, str]:
    """Teacher-forced figures of the cell's file against the F16 file, both in PyTorch (eval --teacher-forced-only)."""
    p = step.params
    exported, reference = needed
    data = _data_args(p)
    _tarq_deploy(["eval", *data, "--backend", "torch", "--tokenizer", p["tokenizer"],
                  "--model", f"{REFERENCE_LABEL}={reference.outputs['file']}",
                  "--model", f"{p['label']}={exported.outputs['file']}", "--reference", REFERENCE_LABEL,
                  "--teacher-forced-only", "--threads", str(cpus), *_flags(p["options"]), "--out", str(folder),
                  "--quiet"], folder, cpus)
    return {"report": str(folder / "report.json"), "figures": str(folder / TEACHER_FORCED_LINES)}


def _bench(step: Step, folder: Path, needed: Sequence[StepResult], cpus: int) -> dict[str, str]:
    p = step.params["options"]
    files = [arg for r in needed for arg in ("--model", r.outputs["file"])]
    audio = [arg for a in p.get("audio", ["jfk"]) for arg in ("--audio", a)]
    threads = ["--threads", ",".join(str(t) for t in p.get("threads", [1]))]
    counts = [arg for name in ("runs", "warmup", "decode") if name in p for arg in (f"--{name}", str(p[name]))]
    # exit 1: some rows are errors (a file whisper.cpp rejects); the others are measured and the errors reported
    _tarq_deploy(["bench", *files, *audio, *threads, *counts, "--out", str(folder), "--name", "bench", "--no-plot"],
                 folder, cpus, ok_codes=(0, 1))
    if not (folder / "bench.json").is_file():
        raise StepFailed("bench: nothing was measured (see log.txt)")
    return {"bench": str(folder / "bench.json")}


_RUNNERS = {"quantize": _quantize, "export": _export, "verify": _verify, "eval": _eval, "score": _score,
            "bench": _bench}

