"""CPU benchmark of runtime model files: every measurement in a fresh child process.

    tarq-deploy bench --model a-f16.bin --model a-q4_0.bin --audio jfk.wav --threads 4,8,16

One *cell* = (runtime, model file, audio, threads). Each cell gets ``warmup`` runs, then ``runs`` timed runs; every
run is a new process that imports the runtime, reads the audio, loads the model and transcribes once. Reported per
timed run: wall time of the whole process (spawn to reap, measured by the harness), model load time and transcription
latency (measured inside the child), RTF = transcription time / audio duration, peak RSS of the child, tokens
decoded; per cell: median, min and max over the timed runs (warm-ups only warm the page cache and are kept apart).

Peak RSS is the child's own ``VmHWM`` (/proc/self/status, read just before it exits). Not ``ru_maxrss``: Linux keeps
the pre-exec address space's high-water mark in ``ru_maxrss`` across exec, so a child spawned from a big parent
(pytest with torch loaded, say) reports at least the parent's peak -- measured here: a parent holding 800 MB spawned
``python -c pass`` and wait4 said 833 MB while the child's VmHWM was 13.6 MB. ``ru_maxrss`` from wait4 is still
recorded (``ru_maxrss_mb``) for comparison. The harness's *baseline* is the peak RSS of a child that does everything
but load a model (interpreter, runtime import, audio), one per (runtime, audio); ``model_rss_mb`` = peak - baseline.

Model files are validated by the runtime's strict parser in the harness before any child sees them: pywhispercpp does
not raise on a file it cannot load (the first transcribe() segfaults), and it takes a path that does not exist as a
model *name* and downloads it. A file that fails validation, a child that crashes or times out: the cell becomes an
error row and the bench goes on.

Runs are interleaved by default (warm-up of every cell, then timed run 1 of every cell, ...), so a slow drift of the
machine's load -- other jobs on a shared box -- spreads over all cells instead of favouring whichever ran first.
``OMP_WAIT_POLICY=PASSIVE`` by default: ggml's OpenMP workers otherwise spin, and on a shared machine 2 threads ran
5-15x slower. Every environment knob the child sees (OMP_*, GGML_*, ...) is recorded.

The runtimes come from the one registry (``tarq_deploy.runtimes.registry``): those with a ``bench`` part, which is a
parser that validates a model file and describes it, and a measuring function the child calls
(``tarq_deploy.runtimes.child``): whisper.cpp (pywhispercpp), CrispASR and qwen3-asr.cpp.
"""
from __future__ import annotations

import json
import os
import platform
import resource
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import wave
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

from tarq_deploy.machine import cpu_model
from tarq_deploy.runtimes.base import SAMPLE_RATE, BenchRuntime, ModelInfo, dist_version
from tarq_deploy.runtimes.child import CHILD_CODE, proc_status_mb
from tarq_deploy.runtimes.registry import bench_runtimes
from tarq_deploy.runtimes.worker import with_package_on_path

__all__ = ["AudioInfo", "Baseline", "BenchConfig", "BenchConfigError", "CellResult", "CpuBenchResult",
           "DEFAULT_OMP_WAIT_POLICY", "DEFAULT_RUNS", "DEFAULT_THREADS", "DEFAULT_TIMEOUT_S", "DEFAULT_WARMUP",
           "ORDERS", "RUNTIMES", "RunRecord", "Stat", "check_audio", "default_threads", "get_runtime",
           "machine_description", "run_cpu_bench", "schedule", "summarize_cell"]


def default_threads(cores: int | None = None) -> tuple[int, ...]:
    """The default thread ladder for this machine: the top three rungs of 1, 2, 4, ... up to the usable cores, the
    core count itself the last rung (2 cores: 1,2; 6: 2,4,6; 16: 4,8,16)."""
    if cores is None:
        try:
            cores = len(os.sched_getaffinity(0))
        except AttributeError:  # not Linux
            cores = os.cpu_count() or 1
    ladder = [1 << k for k in range(max(cores, 1).bit_length()) if 1 << k < cores] + [max(cores, 1)]
    return tuple(ladder[-3:])


DEFAULT_THREADS = default_threads()
DEFAULT_WARMUP = 1
DEFAULT_RUNS = 3
DEFAULT_TIMEOUT_S = 600.0
DEFAULT_OMP_WAIT_POLICY = "PASSIVE"
ORDERS = ("interleaved", "grouped")
# environment variables that change how a runtime runs; every one set in the child's environment is recorded
ENV_KNOB_PREFIXES = ("OMP_", "GOMP_", "KMP_", "MKL_", "OPENBLAS_", "GGML_", "WHISPER_", "LLAMA_", "CUDA_", "MALLOC_",
                     "LD_PRELOAD")
_MB = 1024 * 1024


# ------------------------------------------------------------------------------------------------------- records
@dataclass(frozen=True)
class AudioInfo:
    path: str
    label: str
    duration_s: float


@dataclass
class RunRecord:
    """One child process."""

    index: int  # 0-based over the cell's runs, warm-ups first
    warmup: bool
    loadavg_1m: float  # the machine's 1-minute load average when the child was spawned
    wall_s: float | None = None
    import_s: float | None = None
    load_s: float | None = None
    transcribe_s: float | None = None
    rtf: float | None = None
    peak_rss_mb: float | None = None  # the child's VmHWM
    rss_after_load_mb: float | None = None
    ru_maxrss_mb: float | None = None  # from wait4; includes the parent's peak at spawn time (see module doc)
    tokens: int | None = None
    text: str | None = None
    error: str | None = None


@dataclass(frozen=True)
class Stat:
    median: float
    min: float
    max: float
    n: int

    @classmethod
    def of(cls, values: list[float]) -> "Stat | None":
        return cls(statistics.median(values), min(values), max(values), len(values)) if values else None


SUMMARIZED_FIELDS = ("wall_s", "load_s", "transcribe_s", "rtf", "peak_rss_mb", "model_rss_mb", "ru_maxrss_mb",
                     "tokens")


@dataclass
class CellResult:
    runtime: str
    model: str
    model_label: str
    model_size_mb: float | None
    backbone: str | None
    precision: str | None
    audio: str
    audio_label: str
    audio_s: float
    threads: int
    oversubscribed: bool
    status: str = "pending"  # "ok" | "error"
    error: str | None = None
    baseline_rss_mb: float | None = None
    summary: dict[str, Stat | None] = field(default_factory=dict)  # SUMMARIZED_FIELDS over the timed runs
    text: str | None = None  # the transcript of the last timed run (F16 and Q4_0 should read alike)
    model_details: dict = field(default_factory=dict)
    runs: list[RunRecord] = field(default_factory=list)


@dataclass
class Baseline:
    """A child that imports the runtime and reads the audio but loads no model: the floor under every RSS figure."""

    runtime: str
    audio: str
    peak_rss_mb: float | None = None
    wall_s: float | None = None
    import_s: float | None = None
    error: str | None = None


@dataclass
class BenchConfig:
    models: list[str]
    audios: list[str]
    threads: list[int] = field(default_factory=lambda: list(DEFAULT_THREADS))
    runtime: str = "whisper.cpp"
    warmup: int = DEFAULT_WARMUP
    runs: int = DEFAULT_RUNS
    timeout_s: float = DEFAULT_TIMEOUT_S
    omp_wait_policy: str | None = DEFAULT_OMP_WAIT_POLICY  # None: leave the inherited environment alone
    order: str = "interleaved"
    decode: dict = field(default_factory=dict)  # overrides of the runtime's decode settings
    profile: str | None = None  # decode profile (runtimes/decoding.py); None: the runtime's own bench settings


@dataclass
class CpuBenchResult:
    kind: str
    config: dict
    runtime: dict  # name, decode settings, what it reported about itself
    machine: dict
    versions: dict
    environment: dict  # every knob the children saw
    harness: dict  # the parent's own RSS, how RSS and time were measured
    baselines: list[Baseline]
    cells: list[CellResult]
    loadavg: dict  # at start and end, and the range over the runs
    notes: list[str]
    started: str
    finished: str
    elapsed_s: float

    def to_dict(self) -> dict:
        return asdict(self)


class BenchConfigError(ValueError):
    """The bench cannot start as asked (no such audio, bad thread list, unknown runtime); names the problem."""


# ------------------------------------------------------------------------------------------------------ runtimes
# The bench's runtimes by name; a test may add one (a runtime whose worker crashes, say).
RUNTIMES: dict[str, BenchRuntime] = bench_runtimes()


def get_runtime(name: str) -> BenchRuntime:
    if name in RUNTIMES:
        return RUNTIMES[name]
    raise BenchConfigError(f"unknown runtime {name!r}; known: {', '.join(RUNTIMES)}")


# --------------------------------------------------------------------------------------------------- parent side
def check_audio(path: str) -> AudioInfo:
    """16-bit PCM mono 16 kHz WAV, else BenchConfigError naming what is wrong."""
    p = Path(path)
    if not p.is_file():
        raise BenchConfigError(f"{path}: no such audio file")
    try:
        with wave.open(str(p), "rb") as wav:
            rate, channels, width, frames = wav.getframerate(), wav.getnchannels(), wav.getsampwidth(), wav.getnframes()
    except (wave.Error, EOFError) as e:
        raise BenchConfigError(f"{path}: not a PCM WAV file ({e})") from None
    if (rate, channels, width) != (SAMPLE_RATE, 1, 2) or frames == 0:
        raise BenchConfigError(f"{path}: {rate} Hz, {channels} channel(s), {8 * width}-bit, {frames} frames; the "
                               f"bench takes 16 kHz mono 16-bit PCM WAV (convert it first, e.g. with ffmpeg/sox)")
    return AudioInfo(str(p.resolve()), p.stem, frames / rate)


def check_config(config: BenchConfig) -> None:
    if not config.models:
        raise BenchConfigError("no model files given")
    if not config.audios:
        raise BenchConfigError("no audio given")
    if not config.threads or any(t < 1 for t in config.threads):
        raise BenchConfigError(f"thread counts must be >= 1, got {config.threads}")
    if config.runs < 1 or config.warmup < 0:
        raise BenchConfigError(f"need runs >= 1 and warmup >= 0, got runs {config.runs}, warmup {config.warmup}")
    if config.order not in ORDERS:
        raise BenchConfigError(f"order must be one of {ORDERS}, got {config.order!r}")
    get_runtime(config.runtime)


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def child_environment(config: BenchConfig) -> dict[str, str]:
    env = dict(os.environ)
    if config.omp_wait_policy is not None:
        env["OMP_WAIT_POLICY"] = config.omp_wait_policy
    # the child imports tarq_deploy from this checkout whatever its working directory
    env["PYTHONPATH"] = with_package_on_path(env.get("PYTHONPATH"))
    return env


def environment_knobs(env: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in sorted(env.items()) if k.startswith(ENV_KNOB_PREFIXES)}


@dataclass
class _ChildOutcome:
    result: dict | None
    wall_s: float
    ru_maxrss_mb: float
    error: str | None


def spawn_worker(spec: dict, env: dict[str, str], timeout_s: float) -> _ChildOutcome:
    """Run one child to completion; its rusage comes from wait4 (per child, unlike RUSAGE_CHILDREN)."""
    with tempfile.TemporaryDirectory(prefix="tarq-bench-") as tmp:
        work = Path(tmp)
        spec = {**spec, "result": str(work / "result.json")}
        (work / "spec.json").write_text(json.dumps(spec))
        stderr_path = work / "stderr.txt"
        started = time.perf_counter()
        with open(stderr_path, "wb") as stderr:
            proc = subprocess.Popen([sys.executable, "-c", CHILD_CODE, str(work / "spec.json")], cwd=work, env=env,
                                    stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=stderr)
        watchdog = _Watchdog(proc.pid, timeout_s)
        try:
            _, status, usage = os.wait4(proc.pid, 0)
        finally:
            watchdog.reaped()
        wall_s = time.perf_counter() - started
        proc.returncode = os.waitstatus_to_exitcode(status)  # reaped by wait4: tell Popen
        error = _child_error(proc.returncode, watchdog.killed, timeout_s, stderr_path)
        result_path = Path(spec["result"])
        result = json.loads(result_path.read_text()) if error is None and result_path.is_file() else None
        if error is None and result is None:
            error = "the worker exited without writing its result"
        return _ChildOutcome(result, wall_s, usage.ru_maxrss / 1024, error)


class _Watchdog:
    """SIGKILLs the child after ``timeout_s`` unless it was reaped first. It signals by pid and never waits: a
    Popen.kill() would poll, and a poll that reaps the child makes the main thread's wait4 fail."""

    def __init__(self, pid: int, timeout_s: float) -> None:
        self.pid, self.killed = pid, False
        self._lock, self._done = threading.Lock(), False
        self._timer = threading.Timer(timeout_s, self._kill)
        self._timer.daemon = True
        self._timer.start()

    def _kill(self) -> None:
        with self._lock:
            if not self._done:
                os.kill(self.pid, signal.SIGKILL)
                self.killed = True

    def reaped(self) -> None:
        with self._lock:
            self._done = True
        self._timer.cancel()


def _child_error(returncode: int, timed_out: bool, timeout_s: float, stderr_path: Path) -> str | None:
    if returncode == 0:
        return None
    if timed_out:
        return f"timed out after {timeout_s:g} s (killed)"
    tail = stderr_path.read_text(errors="replace").strip().splitlines()[-3:]
    detail = f": {' | '.join(tail)}" if tail else ""
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        return f"worker crashed ({name}){detail}"
    return f"worker exited with status {returncode}{detail}"


def _run_spec(runtime: BenchRuntime, config: BenchConfig, model: str | None, audio: str, threads: int) -> dict:
    return {"worker": runtime.worker, "model": model, "audio": audio, "threads": threads,
            "settings": run_settings(runtime, config)}


def run_settings(runtime: BenchRuntime, config: BenchConfig) -> dict:
    """The decode settings of every run: the profile's for this runtime (or its own bench settings), then the
    --decode KEY=VALUE overrides."""
    base = runtime.settings
    if config.profile is not None and runtime.profile_settings is not None:
        base = runtime.profile_settings(config.profile)
    return {**base, **config.decode}


def measure_baseline(runtime: BenchRuntime, config: BenchConfig, audio: AudioInfo,
                     env: dict[str, str]) -> tuple[Baseline, dict]:
    """The baseline child, and what the runtime reported about itself (versions, build) from inside it."""
    outcome = spawn_worker(_run_spec(runtime, config, None, audio.path, 1), env, config.timeout_s)
    base = Baseline(runtime.name, audio.label, wall_s=outcome.wall_s, error=outcome.error)
    result = outcome.result or {}
    base.peak_rss_mb, base.import_s = result.get("peak_rss_mb"), result.get("import_s")
    return base, result.get("runtime_info", {})


@dataclass(frozen=True)
class _CheckedModel:
    path: str  # absolute when the file exists
    label: str
    size_mb: float | None
    info: ModelInfo | None
    error: str | None


def check_model(runtime: BenchRuntime, model: str) -> _CheckedModel:
    """Validate a model file with the runtime's parser; a failure is recorded, not raised (it becomes error rows)."""
    path = Path(model)
    size = path.stat().st_size / _MB if path.is_file() else None
    name = str(path.resolve()) if path.exists() else model
    label = path.name.removesuffix(".bin")
    try:
        return _CheckedModel(name, label, size, runtime.describe_model(path), None)
    except (ValueError, OSError) as e:  # the parser's GGMLFileError is a ValueError that names the problem
        return _CheckedModel(name, label, size, None, f"invalid model file: {e}")


def new_cell(runtime: BenchRuntime, model: _CheckedModel, audio: AudioInfo, threads: int) -> CellResult:
    """A cell; one whose model failed validation is an error from the start and is never run."""
    info = model.info
    return CellResult(runtime.name, model.path, model.label, model.size_mb, info and info.backbone,
                      info and info.precision, audio.path, audio.label, audio.duration_s, threads,
                      threads > usable_cores(), status="error" if model.error else "pending", error=model.error,
                      model_details=info.details if info else {})


def run_record(outcome: _ChildOutcome, index: int, warmup: bool, loadavg_1m: float, audio_s: float) -> RunRecord:
    rec = RunRecord(index, warmup, loadavg_1m, wall_s=outcome.wall_s, ru_maxrss_mb=outcome.ru_maxrss_mb,
                    error=outcome.error)
    if outcome.result:
        for key in ("import_s", "load_s", "transcribe_s", "peak_rss_mb", "rss_after_load_mb", "tokens", "text"):
            setattr(rec, key, outcome.result.get(key))
        if rec.transcribe_s is not None:
            rec.rtf = rec.transcribe_s / audio_s
    return rec


def summarize_cell(cell: CellResult) -> None:
    """Medians (min, max) over the timed runs only; the cell is an error if any run failed."""
    timed = [r for r in cell.runs if not r.warmup]
    failed = [r for r in cell.runs if r.error]
    if failed:
        cell.status = "error"
        cell.error = f"run {failed[0].index} ({'warm-up' if failed[0].warmup else 'timed'}): {failed[0].error}"
    elif cell.status != "error":
        cell.status = "ok" if timed else "error"
        cell.error = None if timed else "no timed run"
    values: dict[str, list[float]] = {name: [] for name in SUMMARIZED_FIELDS}
    for r in timed:
        if r.error:
            continue
        for name in SUMMARIZED_FIELDS:
            value = _model_rss(r, cell.baseline_rss_mb) if name == "model_rss_mb" else getattr(r, name)
            if value is not None:
                values[name].append(float(value))
    cell.summary = {name: Stat.of(v) for name, v in values.items()}
    cell.text = next((r.text for r in reversed(timed) if r.text is not None), None)


def _model_rss(run: RunRecord, baseline_mb: float | None) -> float | None:
    if run.peak_rss_mb is None or baseline_mb is None:
        return None
    return run.peak_rss_mb - baseline_mb


def schedule(cells: list[CellResult], config: BenchConfig) -> list[tuple[CellResult, int]]:
    """(cell, run index) pairs in execution order; error cells (invalid models) are never run."""
    live = [c for c in cells if c.status != "error"]
    n = config.warmup + config.runs
    if config.order == "grouped":
        return [(c, i) for c in live for i in range(n)]
    return [(c, i) for i in range(n) for c in live]


def run_cpu_bench(config: BenchConfig, log: Callable[[str], None] = print) -> CpuBenchResult:
    """Validate, measure the baselines, run every cell's warm-ups and timed runs, summarize."""
    check_config(config)
    runtime = get_runtime(config.runtime)
    audios = [check_audio(a) for a in config.audios]
    models = [check_model(runtime, m) for m in config.models]  # before anything runs
    if all(m.error for m in models):
        raise BenchConfigError("no valid model file: " + "; ".join(f"{m.path}: {m.error}" for m in models))
    env = child_environment(config)
    started, t0 = time.strftime("%Y-%m-%dT%H:%M:%S%z"), time.perf_counter()
    load_start, cpu_start = os.getloadavg(), cpu_seconds()
    harness = harness_memory()
    baselines = {a.path: measure_baseline(runtime, config, a, env) for a in audios}
    for model in models:
        log(f"{model.label}: {model.error}" if model.error else
            f"{model.label}: {model.info.backbone} {model.info.precision}, {model.size_mb:.1f} MB")
    cells = [new_cell(runtime, m, a, t) for m in models for a in audios for t in config.threads]
    for cell in cells:
        cell.baseline_rss_mb = baselines[cell.audio][0].peak_rss_mb
    plan = schedule(cells, config)
    for step, (cell, index) in enumerate(plan, 1):
        if any(r.error for r in cell.runs):
            continue  # a crash repeats; do not spend minutes re-crashing
        warmup = index < config.warmup
        loadavg = os.getloadavg()[0]
        outcome = spawn_worker(_run_spec(runtime, config, cell.model, cell.audio, cell.threads), env, config.timeout_s)
        cell.runs.append(run_record(outcome, index, warmup, loadavg, cell.audio_s))
        log(_progress_line(step, len(plan), cell, cell.runs[-1]))
    for cell in cells:
        summarize_cell(cell)
    run_loads = [r.loadavg_1m for c in cells for r in c.runs]
    loadavg = {"start": list(load_start), "end": list(os.getloadavg()),
               "runs_1m_min": min(run_loads, default=None), "runs_1m_max": max(run_loads, default=None),
               "other_processes_cpu_share": foreign_cpu_share(cpu_start, cpu_seconds(), time.perf_counter() - t0)}
    runtime_info = next((info for _, info in baselines.values() if info), {})
    return CpuBenchResult(
        kind="cpu", config=asdict(config),
        runtime={"name": runtime.name, "description": runtime.description,
                 "settings": run_settings(runtime, config), "decode": config.profile, "info": runtime_info},
        machine=machine_description(), versions=package_versions(runtime_info), environment=environment_knobs(env),
        harness=harness, baselines=[b for b, _ in baselines.values()], cells=cells, loadavg=loadavg,
        notes=bench_notes(config, cells, loadavg["other_processes_cpu_share"]), started=started,
        finished=time.strftime("%Y-%m-%dT%H:%M:%S%z"), elapsed_s=time.perf_counter() - t0)


def _progress_line(step: int, total: int, cell: CellResult, run: RunRecord) -> str:
    what = "warm-up" if run.warmup else f"run {run.index}"
    head = f"[{step}/{total}] {cell.model_label} {cell.audio_label} threads={cell.threads} {what}:"
    if run.error:
        return f"{head} ERROR {run.error}"
    return (f"{head} transcribe {run.transcribe_s:.2f} s (RTF {run.rtf:.3f}), load {run.load_s:.2f} s, "
            f"wall {run.wall_s:.2f} s, peak RSS {run.peak_rss_mb:.0f} MB, load avg {run.loadavg_1m:.1f}")


# ------------------------------------------------------------------------------------------- machine and versions
def machine_description() -> dict:
    info: dict[str, Any] = {"cpu_model": cpu_model(), "logical_cores": os.cpu_count(), "usable_cores": usable_cores(),
                            "platform": platform.platform(), "machine": platform.machine(),
                            "python": platform.python_version()}
    try:
        import psutil

        info["physical_cores"] = psutil.cpu_count(logical=False)
        mem = psutil.virtual_memory()
        info["memory_total_mb"], info["memory_available_mb"] = mem.total / _MB, mem.available / _MB
    except ImportError:
        info["memory_total_mb"] = _meminfo_mb("MemTotal")
        info["memory_available_mb"] = _meminfo_mb("MemAvailable")
    return info


def _meminfo_mb(key: str) -> float | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


def package_versions(runtime_info: dict) -> dict:
    """Installed versions, read from package metadata (importing torch would cost the harness ~300 MB and seconds)."""
    versions = {name: dist_version(name) for name in ("pywhispercpp", "torch", "transformers", "numpy", "gguf")}
    versions["whisper.cpp"] = runtime_info.get("whisper_version")
    versions["ggml"] = runtime_info.get("ggml_version")
    versions["ggml_commit"] = runtime_info.get("ggml_commit")
    versions["tarq-deploy"] = dist_version("tarq-deploy")
    return versions


def harness_memory() -> dict:
    return {"rss_mb": proc_status_mb("VmRSS"), "peak_rss_mb": proc_status_mb("VmHWM"),
            "rss_method": "child's VmHWM from /proc/self/status read just before it exits (peak RSS of that process "
                          "alone); ru_maxrss_mb from wait4 is kept for comparison but includes the harness's own peak "
                          "at spawn time (Linux carries the pre-exec high-water mark across exec)",
            "time_method": "wall_s: harness perf_counter from spawn to reap (interpreter start, imports, audio read, "
                           "model load, transcription, exit); load_s and transcribe_s: perf_counter in the child "
                           "around Model() and transcribe(audio array)",
            "baseline": "a child that imports the runtime and reads the audio but loads no model"}


def cpu_seconds() -> tuple[float, float] | None:
    """(CPU seconds the whole machine has been busy, CPU seconds of this process and its finished children), from
    /proc/stat and getrusage; None where /proc/stat is unreadable."""
    try:
        fields = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
    except (OSError, IndexError):
        return None
    jiffies = [int(v) for v in fields[:8]]
    busy = sum(jiffies) - jiffies[3] - jiffies[4]  # all but idle and iowait
    ours = sum(getattr(resource.getrusage(who), f) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)
               for f in ("ru_utime", "ru_stime"))
    return busy / os.sysconf("SC_CLK_TCK"), ours


def foreign_cpu_share(start: tuple[float, float] | None, end: tuple[float, float] | None,
                      wall_s: float) -> float | None:
    """Share of the usable cores that other processes kept busy during the bench. The load average cannot tell:
    the bench's own oversubscribed runs raise it too."""
    if start is None or end is None or wall_s <= 0:
        return None
    other = (end[0] - start[0]) - (end[1] - start[1])
    return max(other, 0.0) / (wall_s * usable_cores())


def bench_notes(config: BenchConfig, cells: list[CellResult], foreign_share: float | None = None) -> list[str]:
    notes = []
    cores = usable_cores()
    over = sorted({c.threads for c in cells if c.oversubscribed})
    if over:
        notes.append(f"oversubscribed: threads {', '.join(map(str, over))} > {cores} usable cores on this machine")
    if config.omp_wait_policy is None:
        notes.append("OMP_WAIT_POLICY left as inherited (spinning OpenMP workers distort timings on a shared machine)")
    if foreign_share is not None and foreign_share > 0.1:
        notes.append(f"the machine was shared: other processes kept {100 * foreign_share:.0f}% of the {cores} usable "
                     "cores busy during the bench, so absolute times are pessimistic; compare cells of one run")
    elif foreign_share is not None:
        notes.append(f"other processes used {100 * foreign_share:.0f}% of the {cores} usable cores during the bench "
                     "(the load average also counts the bench's own oversubscribed runs)")
    return notes
