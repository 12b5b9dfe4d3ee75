"""The sweep on Ray: every step a Ray task, chained by the results it needs, on an embedded single-node Ray or on a
cluster (``address``) -- one code path.

Resources say where a step may run. A calibration asks for a GPU (and calibrates on CUDA) when the cluster has GPUs
and the sweep file's [quantize] table chooses no device, or when it chooses cuda; else for ``calibration_cpus`` CPUs
(a sweep file naming ``device = "cpu"`` asks for no GPU). Export, verify and eval ask for one CPU each. A bench asks
for every CPU of the largest node, so while it runs nothing else runs beside it and its timings are undisturbed. The
output folder must be one that every node sees (a shared file system on a cluster): step folders are
content-addressed, so whichever node runs a step, the next run finds it.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, Sequence

from tqdm import tqdm

from ..checks import Output
from ..errors import UserError
from ..hashing import code_version
from .plan import STEPS, Cell, Step, Sweep, corpus_hash, model_hash, plan_cells
from .steps import LOG, StepResult, append_log, finished, run_step

__all__ = ["LOCK", "SweepRun", "describe", "plan", "run_sweep", "sweep_inputs", "sweep_outputs"]

EMBEDDED_OBJECT_STORE_BYTES = 128 * 1024 * 1024  # results are small dicts: no need for Ray's 30 % of memory
POLL_SECONDS = 1.0
LOCK = "sweep.lock"  # in OUT while a sweep runs there: its pid and host (fileio.exclusive_writer)
OUT_FILES = ("report.md", "report.json", "size-quality.png", LOG, LOCK)  # what a sweep writes in OUT, beside steps/


@dataclass(frozen=True)
class SweepRun:
    cells: list[Cell]
    steps: dict[str, Step]
    results: dict[str, StepResult]


def plan(sweep: Sweep) -> tuple[list[Cell], dict[str, Step]]:
    """Hash the inputs (models, calibration corpora, code) and lay out the cells."""
    models = {name: model_hash(source) for name, source in sweep.models.items()}
    manifests = {*(c.manifest for c in sweep.corpora), *sweep.evaluation.values()}
    corpora = {path: corpus_hash(path) for path in manifests}  # each corpus once, however many cells read it
    return plan_cells(sweep, models, corpora, code_version())


def sweep_outputs(out: Path) -> list[Output]:
    """OUT is a folder the sweep writes its report, log and steps/ into; inputs may lie in it beside them."""
    return [Output("--out", out, whole=False), Output("--out", out / "steps"),
            *(Output("--out", out / name) for name in OUT_FILES)]


def sweep_inputs(sweep: Sweep) -> list[tuple[str, Path | str]]:
    """The sweep file and the local files it names: models, calibration and evaluation manifests."""
    return [("SWEEP.toml", sweep.path), *((f"[models] {name}", source) for name, source in sweep.models.items()),
            *((f"[calibration] {c.name}", c.manifest) for c in sweep.corpora),
            *((f"[evaluation] {name}", path) for name, path in sweep.evaluation.items())]


def run_sweep(sweep: Sweep, out: Path, address: str | None = None, cpus: int | None = None,
              calibration_cpus: int = 1, progress: bool = True) -> SweepRun:
    """Run every unfinished step of the sweep; returns all step results (finished ones as 'cached')."""
    import ray

    out = out.resolve()  # workers need not share the driver's working directory
    out.mkdir(parents=True, exist_ok=True)
    _init_ray(ray, address, cpus)
    try:
        cells, steps = plan(on_gpus_if_any(sweep, ray.cluster_resources().get("GPU", 0)))
        task = ray.remote(max_retries=0)(run_step)
        users = _cells_of_steps(cells)
        refs: dict[str, Any] = {}
        results: dict[str, StepResult] = {}
        bench_cpus = _largest_node_cpus(ray)
        for key in _topological(steps):
            step = steps[key]
            upstream = [results.get(k) or refs[k] for k in (*step.needs, *step.after)]
            cached = _cached(out, step, upstream)
            if cached:
                results[key] = cached
                append_log(out, {"event": "cached", "step": step.kind, "key": key, "cells": users[key]})
                continue
            resources = _resources(step, sweep, calibration_cpus, bench_cpus)
            refs[key] = task.options(**resources).remote(out, step, users[key], int(resources.get("num_cpus", 1)),
                                                         *upstream)
        _collect(ray, refs, results, steps, cells, sweep, out, progress)
    finally:
        ray.shutdown()
    return SweepRun(cells, steps, results)


def on_gpus_if_any(sweep: Sweep, gpus: float) -> Sweep:
    """Calibrate on CUDA when the cluster has GPUs and the sweep file does not choose a device."""
    if gpus < 1 or "device" in sweep.quantize_options:
        return sweep
    return replace(sweep, quantize_options={**sweep.quantize_options, "device": "cuda"})


def _init_ray(ray: Any, address: str | None, cpus: int | None) -> None:
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    # Ray runs workers at niceness 15; a calibration or a bench is the machine's main job, not background work.
    os.environ.setdefault("RAY_worker_niceness", "0")
    try:
        if address:
            ray.init(address=address, log_to_driver=False)
        else:
            ray.init(num_cpus=cpus or os.cpu_count(), include_dashboard=False, log_to_driver=False,
                     object_store_memory=EMBEDDED_OBJECT_STORE_BYTES)
    except (ConnectionError, ValueError, RuntimeError) as error:
        raise UserError(f"--address {address}: cannot connect to a Ray cluster ({error})" if address
                        else f"cannot start a local Ray ({error})") from None


def _largest_node_cpus(ray: Any) -> float:
    return max((n["Resources"].get("CPU", 0.0) for n in ray.nodes() if n.get("Alive")), default=1.0)


def _resources(step: Step, sweep: Sweep, calibration_cpus: int, bench_cpus: float) -> dict[str, Any]:
    if step.kind == "bench":
        return {"num_cpus": bench_cpus}
    if step.kind == "quantize" and str(sweep.quantize_options.get("device", "cpu")).startswith("cuda"):
        return {"num_gpus": 1, "num_cpus": 1}
    return {"num_cpus": calibration_cpus if step.kind == "quantize" else 1}


def _cached(out: Path, step: Step, upstream: Sequence[Any]) -> StepResult | None:
    """A finished step found on disk; a bench only once its inputs are known (they are results, not refs)."""
    if step.kind == "bench":
        if not all(isinstance(r, StepResult) for r in upstream):
            return None
        return finished(out, step, [r for r in upstream if r.ok and r.key in step.needs])
    return finished(out, step)


def _cells_of_steps(cells: Sequence[Cell]) -> dict[str, list[str]]:
    users: dict[str, list[str]] = {}
    for cell in cells:
        for key in cell.steps.values():
            users.setdefault(key, []).append(cell.name)
    return users


def _topological(steps: dict[str, Step]) -> list[str]:
    """Step keys with every step after the ones it needs (the plan adds them in chain order; benches last)."""
    order: list[str] = []
    seen: set[str] = set()

    def visit(key: str) -> None:
        if key in seen or key not in steps:
            return
        seen.add(key)
        for dependency in (*steps[key].needs, *steps[key].after):
            visit(dependency)
        order.append(key)

    for key in steps:
        visit(key)
    return order


# ------------------------------------------------------------------------------------------------------ progress
def _collect(ray: Any, refs: dict[str, Any], results: dict[str, StepResult], steps: dict[str, Step],
             cells: Sequence[Cell], sweep: Sweep, out: Path, progress: bool) -> None:
    bars = _Bars(cells, [s for s in STEPS if any(s in c.steps for c in cells)], progress)
    for key, result in results.items():
        bars.finished(key, result)
    pending = {ref: key for key, ref in refs.items()}
    log = _LogTail(out / LOG)
    while pending:
        ready, _ = ray.wait(list(pending), num_returns=1, timeout=POLL_SECONDS)
        for ref in ready:
            key = pending.pop(ref)
            results[key] = _result(ray, ref, steps[key])
            bars.finished(key, results[key])
        bars.status(log.running())
    bars.close()


def _result(ray: Any, ref: Any, step: Step) -> StepResult:
    try:
        return ray.get(ref)
    except Exception as error:  # noqa: BLE001 - a worker killed (out of memory, say): the cell fails, not the sweep
        return StepResult(step.kind, step.key, "failed", error=f"{type(error).__name__}: {str(error)[:300]}")


class _Bars:
    """One bar per stage over cells, and a line with the live done / running / failed counts."""

    def __init__(self, cells: Sequence[Cell], stages: list[str], enabled: bool) -> None:
        self.cells_of: dict[str, list[tuple[str, str]]] = {}
        for cell in cells:
            for stage, key in cell.steps.items():
                self.cells_of.setdefault(key, []).append((stage, cell.name))
        totals = {s: sum(1 for c in cells if s in c.steps) for s in stages}
        self.bars = {s: tqdm(total=totals[s], desc=f"{s:>8}", unit="cell", position=i, disable=not enabled,
                             leave=True) for i, s in enumerate(stages)}
        self.counts = {"done": 0, "cached": 0, "failed": 0, "skipped": 0}

    def finished(self, key: str, result: StepResult) -> None:
        for stage, _cell in self.cells_of.get(key, []):
            self.bars[stage].update(1)
            self.counts[result.status] = self.counts.get(result.status, 0) + 1

    def status(self, running: int) -> None:
        for bar in self.bars.values():
            bar.set_postfix(done=self.counts["done"] + self.counts["cached"], running=running,
                            failed=self.counts["failed"] + self.counts["skipped"], refresh=False)
            bar.refresh()

    def close(self) -> None:
        self.status(0)
        for bar in self.bars.values():
            bar.close()


class _LogTail:
    """Steps started but not ended, read from the cell log as the workers write it."""

    def __init__(self, path: Path) -> None:
        self.path, self.offset, self.open = path, path.stat().st_size if path.exists() else 0, set()

    def running(self) -> int:
        if self.path.exists():
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                chunk = f.read()
            complete = chunk[:chunk.rfind(b"\n") + 1]
            self.offset += len(complete)
            for line in complete.splitlines():
                record = json.loads(line)
                (self.open.add if record["event"] == "start" else self.open.discard)(record["key"])
        return len(self.open)


def describe(cells: Sequence[Cell], results: dict[str, StepResult]) -> Callable[[Cell], dict[str, Any]]:
    """cell -> {stage: status, error: first failure}: the cell table of the report. A step found finished counts as
    done: the report describes the outputs, whatever run made them (the cell log tells which)."""

    def status(key: str) -> str:
        return "not run" if key not in results else "done" if results[key].ok else results[key].status

    def one(cell: Cell) -> dict[str, Any]:
        statuses = {stage: status(key) for stage, key in cell.steps.items()}
        failure = next((results[k] for k in cell.steps.values() if k in results and results[k].status == "failed"),
                       None)
        return {"cell": cell.name, "steps": statuses,
                **({"failed_step": failure.kind, "error": failure.error} if failure else {})}

    return one
