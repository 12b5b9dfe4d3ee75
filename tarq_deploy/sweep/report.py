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
from ..evaluate.failure_runs import failure_section, rate_difference, render_nonspeech
from ..evaluate.report import DatasetRuns, ModelRun, ReportOptions, build_report, render_dataset
from ..evaluate.teacher_forced import UtteranceFigures
from ..evaluate.wer import score_utterance
from ..fileio import write_bytes_atomic, write_text_atomic
from .driver import SweepRun, describe
from .plan import REFERENCE_METHOD, Cell, Sweep, ggml_type_of

__all__ = ["build_sweep_report", "frontier_rows", "render_frontier", "render_sweep_markdown", "size_quality_png",
           "type_bits_per_weight", "write_sweep_report"]

MIB = 1024 * 1024
TIMING_FIELDS = ("decode_seconds", "real_time_factor")


def build_sweep_report(sweep: Sweep, run: SweepRun) -> dict[str, Any]:
    status = describe(run.cells, run.results)
    return {"sweep": {"file": sweep.path.name, "target": sweep.target, "methods": list(sweep.methods),
                      "types": [t.name for t in sweep.types], "baseline": list(sweep.baselines), "steps": list(sweep.steps),
                      "eval_options": sweep.eval_options,
                      **({"bodies": bodies} if (bodies := {t.name: t.body for t in sweep.types if t.body}) else {})},
            "cells": [{**status(c), "file_mib": _file_mib(c, run)} for c in run.cells],
            "models": [_model_section(sweep, run, model) for model in sweep.models]}


def _add_failures(evaluation: dict, datasets: Sequence[DatasetRuns], sweep: Sweep, reference: str | None,
                  options: ReportOptions) -> None:
    """Each dataset's failure figures (evaluate/failure_runs.py) from the cells' hypotheses, every cell against the
    F16 cell of its backend; a long-recording manifest's spans are read from it."""
    from ..data.long_form import manifest_spans

    for entry, d in zip(evaluation["datasets"], datasets):
        runs = {r.key: r for r in d.runs}
        references = [(s.id, s.reference) for s in d.runs[0].scores]
        texts = {key: [s.hypothesis for s in r.scores] for key, r in runs.items()}
        against_f16 = [(key, next(k for k, b in runs.items() if b.label == reference and b.backend == r.backend))
                       for key, r in runs.items() if reference is not None and r.label != reference]
        by_label = {(r.label, r.backend): key for key, r in runs.items()}
        against_baselines = [(by_label[(a, r.backend)], by_label[(b, r.backend)]) for a, b in options.comparisons
                             for r in runs.values() if (a, r.backend) in by_label and (b, r.backend) in by_label
                             and r.label == a]
        spans = manifest_spans(Path(d.manifest), {uid for uid, _ in references})
        entry["failures"] = failure_section(references, texts, spans, [*against_f16, *against_baselines],
                                            options.n_resamples, options.seed)


def _nonspeech(cells: Sequence[Cell], run: SweepRun, reference: str | None, several: bool) -> dict | None:
    """The non-speech section ([eval] nonspeech) merged from the cells' own eval reports: words per minute of every
    cell (by backend where the sweep has several), and each one's excess over the F16 cell's of its backend."""
    sections = {}
    for cell in cells:
        report = run.results[cell.steps["eval"]].outputs.get("report")  # a result that names no report has none
        section = json.loads(Path(report).read_text()).get("nonspeech") if report else None
        if section is not None:
            sections[cell.name] = section
    if not sections:
        return None
    models: dict[str, dict] = {}
    cell_of: dict[str, tuple[str, str]] = {}  # merged key: (cell, backend suffix " [BACKEND]")
    for name, section in sections.items():
        for key, figures in section["models"].items():  # a cell's report keys its runs "LABEL [BACKEND]"
            merged = key if several else name
            models[merged], cell_of[merged] = figures, (name, key[len(name):])
    excess = {key: rate_difference(figures, models.get(reference + cell_of[key][1] if several else reference))
              for key, figures in models.items() if reference is not None and cell_of[key][0] != reference}
    first = next(iter(sections.values()))
    return {"manifest": first["manifest"], "clips": first["clips"], "minutes": first["minutes"], "models": models,
            "excess_over_baseline": excess}


def _decoding(sweep: Sweep) -> dict:
    from ..runtimes.decoding import DEFAULT_DECODE_PROFILE, profile_named

    return profile_named(sweep.eval_options.get("decode", DEFAULT_DECODE_PROFILE)).record()


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
        datasets = [DatasetRuns(name, str(path), [_model_run(c, run, name, zipf, backend, len(sweep.backends) > 1)
                                                  for c in cells for backend in sweep.backends],
                                teacher_forced=_figures(cells, run, name))
                    for name, path in sweep.evaluation.items()]
        evaluation = _without_timings(build_report(datasets, options, {"zipf_threshold": zipf,
                                                                       "decoding": _decoding(sweep)}))
        _add_failures(evaluation, datasets, sweep, reference, options)
        nonspeech = _nonspeech(cells, run, reference, len(sweep.backends) > 1)
        if nonspeech is not None:
            evaluation["nonspeech"] = nonspeech
    bench = run.results.get(next((c.steps["bench"] for c in run.cells if c.model == model and "bench" in c.steps), ""))
    return {"model": model, "source": sweep.models[model], "evaluation": evaluation,
            "bench": json.loads(Path(bench.outputs["bench"]).read_text()) if bench and bench.ok else None}


def _eval_ok(cell: Cell, run: SweepRun) -> bool:
    result = run.results.get(cell.steps.get("eval", ""))
    return bool(result and result.ok)


def _baseline_pairs(sweep: Sweep, cells: Sequence[Cell]) -> tuple[tuple[str, str], ...]:
    """Every cell against each baseline method's cell of the same type and corpus (a method that reads no corpus,
    such as rtn, against the baseline of every corpus; a baseline that reads none against every cell). A baseline
    is compared with the baselines listed before it, not after."""
    pairs = []
    for rank, baseline in enumerate(sweep.baselines):
        skipped = (baseline, REFERENCE_METHOD, *sweep.baselines[:rank])
        pairs += [(c.name, b.name) for b in cells if b.method == baseline for c in cells
                  if c.method not in skipped and c.type == b.type and (c.corpus == b.corpus or "-" in (c.corpus,
                                                                                                     b.corpus))]
    return tuple(dict.fromkeys(pairs))


def _figures(cells: Sequence[Cell], run: SweepRun, dataset: str) -> dict[str, list[UtteranceFigures]]:
    """The teacher-forced figures of every cell whose score step finished, by cell name (the F16 cell has none:
    it is the reference)."""
    figures: dict[str, list[UtteranceFigures]] = {}
    for cell in cells:
        result = run.results.get(cell.steps.get("score", ""))
        if not (result and result.ok):
            continue
        lines = Path(result.outputs["figures"]).read_text(encoding="utf-8").splitlines()
        rows = [json.loads(line) for line in lines if line.strip()]
        figures[cell.name] = [UtteranceFigures.from_record(r) for r in rows
                              if r["dataset"] == dataset and r["label"] == cell.name]
    return figures


def _model_run(cell: Cell, run: SweepRun, dataset: str, zipf: float, backend: str, several: bool) -> ModelRun:
    """A cell's run on a dataset through one backend, re-scored from its per-utterance hypotheses (as `eval` scored
    them; eval keys each run "LABEL [BACKEND]"). The report keys a run by its cell's name alone when the sweep has
    one backend, by name and backend when it has several."""
    result = run.results[cell.steps["eval"]]
    rows = [json.loads(line) for line in Path(result.outputs["utterances"]).read_text(encoding="utf-8").splitlines()
            if line.strip()]
    key = f"{cell.name} [{backend}]"
    scores = [score_utterance(r["id"], r["reference"], r["hypothesis"], zipf) for r in rows
              if r["dataset"] == dataset and r.get("model", key) == key]
    export = run.results[cell.steps["export"]]
    return ModelRun(key if several else cell.name, cell.name, backend, Path(export.outputs["file"]).name, scores)


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
             f"{head['baseline'] or 'no baseline'} (same corpus and type), retention against each model's F16. "
             f"Decoding: `{head['eval_options'].get('decode', 'greedy')}` (runtimes/decoding.py).", "",
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
            if "nonspeech" in model["evaluation"]:
                lines += [line.replace("## ", "### ", 1) if line.startswith("## ") else line
                          for line in render_nonspeech(model["evaluation"]["nonspeech"])]
        else:
            lines.append("_no cell of this model was evaluated_")
        if model["bench"]:
            lines += ["", cpu_markdown(model["bench"]).replace("## ", "### ", 1)]
    lines += render_frontier(report.get("frontier", []))
    return "\n".join(lines).rstrip() + "\n"


def frontier_rows(report: dict) -> list[dict[str, Any]]:
    """One row per evaluated cell and dataset: its type, method, file size and bits per weight of its type beside the
    decoded figures (WER, rare-WER raw and capped, loops), retention, the teacher-forced KLDs, when measured, and the
    bench's figures of its file (``speed``: latency, RTF and max-RSS per audio and thread count): the size / quality
    / speed frontier as a table."""
    mib = {c["cell"]: c["file_mib"] for c in report["cells"]}
    bodies = report["sweep"].get("bodies", {})  # a preset's or mix's body type: its bits/weight column
    rows = []
    for model in report["models"]:
        speed = bench_speed(model.get("bench"))
        for dataset in (model["evaluation"] or {}).get("datasets", []):
            retention = {r["model"]: r["retention"]["value"] for r in dataset.get("retention", {}).get("models", [])}
            figures = {m["label"]: m for m in dataset.get("teacher_forced", {}).get("models", [])}
            for row in dataset["models"]:
                _, _, method, type_name = row["label"].split("/")
                tf = figures.get(row["label"], {})
                rows.append({"model": model["model"], "dataset": dataset["name"], "cell": row["label"],
                             "backend": row["backend"], "type": type_name, "method": method, "file_mib": mib[row["label"]],
                             "type_bpw": type_bits_per_weight(bodies.get(type_name, type_name)),
                             **{k: row[k]["value"] for k in ("wer", "rare_wer", "capped_wer", "capped_rare_wer")},
                             "loops": row["loops"], "retention": retention.get(row["key"]),
                             **{k: tf[k]["value"] if k in tf else None for k in ("kld_rare", "kld_common")},
                             "speed": speed.get(Path(row["source"]).name, [])})
    return sorted(rows, key=lambda r: (r["model"], r["dataset"], r["backend"], -r["type_bpw"], r["method"]))


def bench_speed(bench: dict | None) -> dict[str, list[dict[str, Any]]]:
    """The bench's medians per model file name: [{audio, threads, latency_s, rtf, max_rss_mb}] for every cell it
    measured (errors left out; the bench table lists them). Keyed by the file's name, not its path: the sweep's
    output folder may have moved since the bench ran."""
    speed: dict[str, list[dict[str, Any]]] = {}
    for cell in (bench or {}).get("cells", []):
        if cell.get("status") != "ok":
            continue
        summary = cell["summary"]
        speed.setdefault(Path(cell["model"]).name, []).append(
            {"audio": cell["audio_label"], "threads": cell["threads"],
             "latency_s": summary["transcribe_s"]["median"], "rtf": summary["rtf"]["median"],
             "max_rss_mb": summary["peak_rss_mb"]["median"]})
    return speed


def speed_columns(rows: list[dict[str, Any]]) -> list[tuple[str, int]]:
    """The (audio, threads) the frontier table and plot show: the first benched audio, at each thread count."""
    points = [(s["audio"], s["threads"]) for r in rows for s in r.get("speed", [])]
    if not points:
        return []
    first_audio = points[0][0]
    return sorted({p for p in points if p[0] == first_audio}, key=lambda p: p[1])


def speed_of(row: dict[str, Any], audio: str, threads: int) -> dict[str, Any] | None:
    return next((s for s in row.get("speed", []) if (s["audio"], s["threads"]) == (audio, threads)), None)


def type_bits_per_weight(type_name: str) -> float:
    """Bits per weight of a ggml type's blocks (f16: 16), from gguf-py's block sizes."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    block, size = GGML_QUANT_SIZES[GGMLQuantizationType[ggml_type_of(type_name).upper()]]
    return size * 8 / block


def render_frontier(rows: list[dict[str, Any]]) -> list[str]:
    if not rows:
        return []
    columns = speed_columns(rows)
    speed_head = "".join(f" {label} {audio} {t}t |" for label in ("latency s", "RTF", "max-RSS MB")
                         for audio, t in columns)
    lines = ["", "## The size / quality frontier", "",
             "Every evaluated cell: file size, bits per weight of its type's blocks, decoded figures (%), rare-word "
             "retention against F16 (%) and teacher-forced KLD against F16 (nats; the paired intervals are in the "
             "tables above)" + (", and the bench's medians of its file (latency = transcription alone, RTF, max-RSS "
                                "of the process; the bench table above has their spread and conditions)"
                                if columns else "") + ".", "",
             "| model | dataset | backend | type | method | MiB | bits/weight | WER | rare-WER | capped WER | "
             "capped rare-WER | loops | retention | KLD rare | KLD common |" + speed_head,
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|" + "---|" * (3 * len(columns))]

    def pct(x: float | None) -> str:
        return "—" if x is None else f"{100 * x:.1f}"

    def nats(x: float | None) -> str:
        return "—" if x is None else f"{x:.4f}"

    def measured(row: dict[str, Any], field: str, form: str) -> str:
        cells = [speed_of(row, audio, t) for audio, t in columns]
        return "".join(" — |" if c is None else f" {c[field]:{form}} |" for c in cells)

    for r in rows:
        mib = "—" if r["file_mib"] is None else f"{r['file_mib']:.1f}"
        lines.append(f"| {r['model']} | {r['dataset']} | {r['backend']} | {r['type']} | {r['method']} | {mib} | "
                     f"{r['type_bpw']:.4g} | "
                     f"{pct(r['wer'])} | {pct(r['rare_wer'])} | {pct(r['capped_wer'])} | {pct(r['capped_rare_wer'])} | "
                     f"{r['loops']} | {pct(r['retention'])} | {nats(r['kld_rare'])} | {nats(r['kld_common'])} |"
                     + measured(r, "latency_s", ".3f") + measured(r, "rtf", ".3f") + measured(r, "max_rss_mb", ".0f"))
    return lines


def size_quality_points(report: dict) -> list[dict[str, Any]]:
    """(file MiB, rare-WER raw and capped, WER) of every evaluated cell, per dataset, also in report.json."""
    mib = {c["cell"]: c["file_mib"] for c in report["cells"]}
    return [{"model": m["model"], "dataset": d["name"], "cell": row["label"], "file_mib": mib[row["label"]],
             "rare_wer": row["rare_wer"]["value"], "capped_rare_wer": row["capped_rare_wer"]["value"],
             "wer": row["wer"]["value"]}
            for m in report["models"] if m["evaluation"] for d in m["evaluation"]["datasets"] for row in d["models"]]


def size_quality_png(rows: list[dict[str, Any]]) -> bytes | None:
    """The frontier: file size against capped rare-WER, rare KLD (where scored) and the bench's latency (where
    benched: the first audio, one panel per thread count), one line per method through its types, the F16 file as a
    point; one row of panels per model, dataset and backend."""
    if not rows:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = sorted({(r["model"], r["dataset"], r["backend"]) for r in rows})
    colour = {method: f"C{i}" for i, method in enumerate(sorted({r["method"] for r in rows}))}  # alike in every panel
    metrics = [("capped rare-WER (%)", lambda r: _scaled(r["capped_rare_wer"], 100.0))]
    if any(r["kld_rare"] is not None for r in rows):
        metrics.append(("rare KLD vs F16 (nats)", lambda r: r["kld_rare"]))
    for audio, threads in speed_columns(rows):
        metrics.append((f"latency on {audio}, {threads} thread{'s' if threads > 1 else ''} (s)",
                        lambda r, a=audio, t=threads: (speed_of(r, a, t) or {}).get("latency_s")))
    figure, axes = plt.subplots(len(groups), len(metrics), figsize=(5.8 * len(metrics), 4.2 * len(groups)),
                                squeeze=False)
    for line, (model, dataset, backend) in zip(axes, groups):
        mine = [r for r in rows if (r["model"], r["dataset"], r["backend"]) == (model, dataset, backend)
                and r["file_mib"] is not None]
        for axis, (label, value) in zip(line, metrics):
            for method in sorted({r["method"] for r in mine}):
                points = sorted((r["file_mib"], value(r), r["type"]) for r in mine
                                if r["method"] == method and value(r) is not None)
                if not points:
                    continue
                xs, ys, _ = zip(*points)
                axis.plot(xs, ys, marker="o", label=method, color=colour[method])
                for x, y, type_name in points:
                    axis.annotate(type_name, (x, y), fontsize=7, xytext=(3, 3), textcoords="offset points")
            axis.set(xlabel="file size (MiB)", ylabel=label, title=f"{model} on {dataset} ({backend})")
            axis.grid(alpha=0.3)
            axis.legend(fontsize=8)
    figure.tight_layout()
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=110, metadata={"Software": None})
    plt.close(figure)
    return buffer.getvalue()


def _scaled(value: float | None, scale: float) -> float | None:
    return None if value is None else scale * value


def write_sweep_report(sweep: Sweep, run: SweepRun, out: Path) -> dict[str, Path]:
    report = build_sweep_report(sweep, run)
    report["size_quality"] = size_quality_points(report)
    report["frontier"] = frontier_rows(report)
    written = {"json": write_text_atomic(out / "report.json", json.dumps(report, indent=1, ensure_ascii=False) + "\n"),
               "md": write_text_atomic(out / "report.md", render_sweep_markdown(report))}
    png = size_quality_png(report["frontier"])
    if png:
        written["png"] = write_bytes_atomic(out / "size-quality.png", png)
    return written
