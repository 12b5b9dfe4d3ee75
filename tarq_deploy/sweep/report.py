"""The merged report of a sweep: every cell's status, then per model the evaluation tables of all its cells (paired
differences against the baseline method, rare-word retention against F16) and its bench table, and the size /
quality plot. The tables are made by the same code as `tarq-deploy eval` (evaluate/report.py, from each cell's
per-utterance hypotheses, re-scored) and `tarq-deploy bench` (bench/bench_report.py).

Decode times are left out of the merged evaluation tables: in a sweep the evaluations share the machine with other
cells, so their times say nothing about the models; speed is the bench's job, which runs alone on its node. What is
left depends only on the hypotheses, so a resumed sweep writes the same bytes as an uninterrupted one.
"""
from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any, Sequence

from ..bench.bench_report import cpu_markdown
from ..evaluate.report import DatasetRuns, ModelRun, ReportOptions, build_report, render_dataset
from ..evaluate.wer import score_utterance
from ..fileio import write_bytes_atomic, write_text_atomic
from .driver import SweepRun, describe
from .plan import REFERENCE_METHOD, Cell, Sweep

MIB = 1024 * 1024
TIMING_FIELDS = ("decode_seconds", "real_time_factor")


def build_sweep_report(sweep: Sweep, run: SweepRun) -> dict[str, Any]:
    status = describe(run.cells, run.results)
    return {"sweep": {"file": sweep.path.name, "target": sweep.target, "methods": list(sweep.methods),
                      "types": [t.name for t in sweep.types], "baseline": sweep.baseline, "steps": list(sweep.steps),
                      "eval_options": sweep.eval_options},
            "cells": [{**status(c), "file_mib": _file_mib(c, run)} for c in run.cells],
            "models": [_model_section(sweep, run, model) for model in sweep.models]}


def _file_mib(cell: Cell, run: SweepRun) -> float | None:
    result = run.results.get(cell.steps.get("export", ""))
    return round(int(result.outputs["bytes"]) / MIB, 2) if result and result.ok else None


def _model_section(sweep: Sweep, run: SweepRun, model: str) -> dict[str, Any]:
    cells = [c for c in run.cells if c.model == model and _eval_ok(c, run)]
    reference = next((c.name for c in cells if c.method == REFERENCE_METHOD), None)
    options = ReportOptions(sweep.eval_options.get("resamples", 1000), sweep.eval_options.get("seed", 0),
                            _baseline_pairs(sweep, cells), reference=reference)
    evaluation = None
    if cells:
        zipf = sweep.eval_options.get("zipf_threshold", 3.0)
        datasets = [DatasetRuns(name, str(path), [_model_run(c, run, name, zipf, sweep.runtime) for c in cells])
                    for name, path in sweep.evaluation.items()]
        evaluation = _without_timings(build_report(datasets, options, {"zipf_threshold": zipf}))
    bench = run.results.get(next((c.steps["bench"] for c in run.cells if c.model == model and "bench" in c.steps), ""))
    return {"model": model, "source": sweep.models[model], "evaluation": evaluation,
            "bench": json.loads(Path(bench.outputs["bench"]).read_text()) if bench and bench.ok else None}


def _eval_ok(cell: Cell, run: SweepRun) -> bool:
    result = run.results.get(cell.steps.get("eval", ""))
    return bool(result and result.ok)


def _baseline_pairs(sweep: Sweep, cells: Sequence[Cell]) -> tuple[tuple[str, str], ...]:
    """Every cell against the baseline method's cell of the same corpus and type (a method that reads no corpus,
    such as rtn, against the baseline of every corpus)."""
    baselines = [c for c in cells if c.method == sweep.baseline]
    return tuple((c.name, b.name) for c in cells if c.method not in (sweep.baseline, REFERENCE_METHOD)
                 for b in baselines if b.type == c.type and c.corpus in (b.corpus, "-"))


def _model_run(cell: Cell, run: SweepRun, dataset: str, zipf: float, runtime: str) -> ModelRun:
    """A cell's run on a dataset, re-scored from its per-utterance hypotheses (as `eval` scored them)."""
    result = run.results[cell.steps["eval"]]
    rows = [json.loads(line) for line in Path(result.outputs["utterances"]).read_text(encoding="utf-8").splitlines()
            if line.strip()]
    scores = [score_utterance(r["id"], r["reference"], r["hypothesis"], zipf) for r in rows if r["dataset"] == dataset]
    export = run.results[cell.steps["export"]]
    return ModelRun(cell.name, cell.name, runtime, Path(export.outputs["file"]).name, scores)


def _without_timings(report: dict) -> dict:
    for dataset in report["datasets"]:
        for row in dataset["models"]:
            for name in TIMING_FIELDS:
                row.pop(name, None)
    return report


# ------------------------------------------------------------------------------------------------------ output
def render_sweep_markdown(report: dict) -> str:
    head = report["sweep"]
    lines = ["# Sweep report", "",
             f"`{head['file']}`: target {head['target']}; methods {', '.join(head['methods'])}; types "
             f"{', '.join(head['types'])}; steps {', '.join(head['steps'])}; paired differences against "
             f"{head['baseline'] or 'no baseline'} (same corpus and type), retention against each model's F16.", "",
             "| cell | " + " | ".join(head["steps"]) + " | file MiB |", "|---|" + "---|" * (len(head["steps"]) + 1)]
    for cell in report["cells"]:
        statuses = [cell["steps"].get(step, "—") for step in head["steps"]]
        mib = "—" if cell["file_mib"] is None else f"{cell['file_mib']:.2f}"
        lines.append(f"| {cell['cell']} | " + " | ".join(statuses) + f" | {mib} |")
    failures = [c for c in report["cells"] if "error" in c]
    if failures:
        lines += ["", "## Failed cells", ""] + [f"- **{c['cell']}** ({c['failed_step']}): {c['error']}"
                                                for c in failures]
    for model in report["models"]:
        lines += ["", f"## {model['model']} (`{model['source']}`)", ""]
        if model["evaluation"]:
            for dataset in model["evaluation"]["datasets"]:
                lines += [line.replace("## ", "### ", 1) if line.startswith("## ") else line
                          for line in render_dataset(dataset)]
        else:
            lines.append("_no cell of this model was evaluated_")
        if model["bench"]:
            lines += ["", cpu_markdown(model["bench"]).replace("## ", "### ", 1)]
    return "\n".join(lines).rstrip() + "\n"


def size_quality_points(report: dict) -> list[dict[str, Any]]:
    """(file MiB, rare-WER) of every evaluated cell, per dataset: the plot's data, also in report.json."""
    mib = {c["cell"]: c["file_mib"] for c in report["cells"]}
    return [{"model": m["model"], "dataset": d["name"], "cell": row["label"], "file_mib": mib[row["label"]],
             "rare_wer": row["rare_wer"]["value"], "wer": row["wer"]["value"]}
            for m in report["models"] if m["evaluation"] for d in m["evaluation"]["datasets"] for row in d["models"]]


def size_quality_png(points: list[dict[str, Any]]) -> bytes | None:
    if not points:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = sorted({(p["model"], p["dataset"]) for p in points})
    figure, axes = plt.subplots(1, len(groups), figsize=(5.5 * len(groups), 4.2), squeeze=False)
    for axis, (model, dataset) in zip(axes[0], groups):
        mine = [p for p in points if (p["model"], p["dataset"]) == (model, dataset)]
        axis.scatter([p["file_mib"] for p in mine], [100 * p["rare_wer"] for p in mine])
        for p in mine:
            axis.annotate("/".join(p["cell"].split("/")[2:]), (p["file_mib"], 100 * p["rare_wer"]), fontsize=7,
                          xytext=(3, 3), textcoords="offset points")
        axis.set(xlabel="file size (MiB)", ylabel="rare-WER (%)", title=f"{model} on {dataset}")
        axis.grid(alpha=0.3)
    figure.tight_layout()
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=110, metadata={"Software": None})
    plt.close(figure)
    return buffer.getvalue()


def write_sweep_report(sweep: Sweep, run: SweepRun, out: Path) -> dict[str, Path]:
    report = build_sweep_report(sweep, run)
    report["size_quality"] = size_quality_points(report)
    written = {"json": write_text_atomic(out / "report.json", json.dumps(report, indent=1, ensure_ascii=False) + "\n"),
               "md": write_text_atomic(out / "report.md", render_sweep_markdown(report))}
    png = size_quality_png(report["size_quality"])
    if png:
        written["png"] = write_bytes_atomic(out / "size-quality.png", png)
    return written
