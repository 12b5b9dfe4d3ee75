"""Reports of a bench run: JSON (everything), CSV (one row per cell), a markdown table shaped like the paper's, and a
PNG plot.

Every function here takes the result as the plain dict that goes into the JSON (``CpuBenchResult.to_dict()`` or
``GpuBenchResult.to_dict()``, told apart by ``kind``), so a saved JSON can be re-rendered later (``tarq-deploy bench
--report-only FILE.json``). Rendering is pure (text or PNG bytes); ``write_reports`` is the only I/O, each file
written to a temporary name and renamed when complete.

CPU table: one row per (backbone, audio, threads); per model variant the median transcription latency, RTF and peak
RSS, and the speed-up of every variant over the reference (F16 when present). A variant is the file's precision
(F16, Q4_0, ...) or, when one backbone has two files of the same precision (RTN and TARQ Q4_0, say), the file name.
"""
from __future__ import annotations

import csv
import io
import json
import os
from pathlib import Path
from typing import Any, Iterable

from tarq_deploy.fileio import write_bytes_atomic

__all__ = ["cpu_markdown", "csv_text", "load_result", "markdown_report", "variant_of", "write_reports"]

CPU_STATS = ("transcribe_s", "rtf", "wall_s", "load_s", "peak_rss_mb", "model_rss_mb", "ru_maxrss_mb", "tokens")
GPU_STATS = ("generate_ms", "end_to_end_ms", "ms_per_token", "tokens", "peak_vram_mb", "nvml_used_mb", "load_s")
REFERENCE_PRECISION = "F16"


# ---------------------------------------------------------------------------------------------------- file output
def write_reports(doc: dict, out_dir: str | os.PathLike, stem: str = "bench", plot: bool = True) -> dict[str, Path]:
    """Write STEM.json, STEM.md and, when anything was measured, STEM.csv and STEM.png; returns {kind: path}."""
    out = Path(out_dir)
    written = {"json": write_bytes_atomic(out / f"{stem}.json", json_text(doc).encode()),
               "md": write_bytes_atomic(out / f"{stem}.md", markdown_report(doc).encode())}
    if doc.get("cells"):
        written["csv"] = write_bytes_atomic(out / f"{stem}.csv", csv_text(doc).encode())
        if plot:
            written["png"] = write_bytes_atomic(out / f"{stem}.png", plot_png(doc))
    return written


def load_result(path: str | os.PathLike) -> dict:
    doc = json.loads(Path(path).read_text())
    if doc.get("kind") not in ("cpu", "gpu"):
        raise ValueError(f"{path}: not a bench result (no kind 'cpu' or 'gpu')")
    return doc


def json_text(doc: dict) -> str:
    return json.dumps(doc, indent=1, sort_keys=False) + "\n"


# ------------------------------------------------------------------------------------------------------------ CSV
def flat_rows(doc: dict) -> list[dict[str, Any]]:
    """One flat dict per cell: identity, status, then median/min/max of every statistic."""
    stats = CPU_STATS if doc["kind"] == "cpu" else GPU_STATS
    rows = []
    for cell in doc["cells"]:
        row = {k: v for k, v in cell.items() if k not in ("summary", "runs", "model_details")}
        for name in stats:
            stat = (cell.get("summary") or {}).get(name) or {}
            for part in ("median", "min", "max"):
                row[f"{name}_{part}"] = stat.get(part)
        row["n_timed_runs"] = sum(1 for r in cell.get("runs", []) if not r.get("warmup"))
        rows.append(row)
    return rows


def csv_text(doc: dict) -> str:
    rows = flat_rows(doc)
    if not rows:
        return ""
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=list(rows[0]), lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
    return buffer.getvalue()


# ------------------------------------------------------------------------------------------------------- markdown
def markdown_report(doc: dict) -> str:
    return cpu_markdown(doc) if doc["kind"] == "cpu" else gpu_markdown(doc)


def variant_of(cells: list[dict]) -> dict[str, str]:
    """model path -> column name: its precision, or its file label where one backbone has two of one precision."""
    seen: dict[tuple, set[str]] = {}
    for c in cells:
        if c["backbone"] is not None:
            seen.setdefault((c["backbone"], c["precision"]), set()).add(c["model"])
    return {c["model"]: (c["precision"] if len(seen[(c["backbone"], c["precision"])]) == 1 else c["model_label"])
            for c in cells if c["backbone"] is not None}


def _ordered(values: Iterable[Any]) -> list[Any]:
    return list(dict.fromkeys(values))


def _median(cell: dict | None, name: str) -> float | None:
    if cell is None or cell["status"] != "ok":
        return None
    stat = cell["summary"].get(name)
    return stat["median"] if stat else None


def _fmt(value: float | None, digits: int, cell: dict | None = None) -> str:
    if cell is not None and cell["status"] != "ok":
        return cell["status"]  # "error" / "skipped": the reason is listed under the table
    return "—" if value is None else f"{value:.{digits}f}"


def cpu_table(doc: dict) -> str:
    cells = [c for c in doc["cells"] if c["backbone"] is not None]
    if not cells:
        return "_no valid model file: nothing measured_\n"
    variant = variant_of(cells)
    variants = _ordered(variant[c["model"]] for c in cells)
    reference = REFERENCE_PRECISION if REFERENCE_PRECISION in variants else variants[0]
    others = [v for v in variants if v != reference]
    header = (["Backbone", "Audio", "Threads"] + [f"{v} latency (s)" for v in variants]
              + [f"{v} speed-up vs {reference}" for v in others] + [f"{v} RTF" for v in variants]
              + [f"{v} max-RSS (MB)" for v in variants])
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * 3 + "---:|" * (len(header) - 3)]
    by_key = {(c["backbone"], c["audio_label"], c["threads"], variant[c["model"]]): c for c in cells}
    for backbone in _ordered(c["backbone"] for c in cells):
        for audio in _ordered(c["audio_label"] for c in cells if c["backbone"] == backbone):
            sample = next(c for c in cells if c["backbone"] == backbone and c["audio_label"] == audio)
            for threads in sorted({c["threads"] for c in cells if c["backbone"] == backbone}):
                row = {v: by_key.get((backbone, audio, threads, v)) for v in variants}
                lines.append("| " + " | ".join(_cpu_row(backbone, audio, sample["audio_s"], threads, row, reference,
                                                        others, doc)) + " |")
    return "\n".join(lines) + "\n"


def _cpu_row(backbone: str, audio: str, audio_s: float, threads: int, row: dict[str, dict | None], reference: str,
             others: list[str], doc: dict) -> list[str]:
    cores = doc["machine"].get("usable_cores") or 0
    cells = [backbone, f"{audio} ({audio_s:.1f} s)", f"{threads}{'*' if threads > cores else ''}"]
    cells += [_fmt(_median(c, "transcribe_s"), 2, c) for c in row.values()]
    ref = _median(row[reference], "transcribe_s")
    for v in others:
        mine = _median(row[v], "transcribe_s")
        cells.append(f"{ref / mine:.2f}×" if ref and mine else "—")
    cells += [_fmt(_median(c, "rtf"), 3, c) for c in row.values()]
    cells += [_fmt(_median(c, "peak_rss_mb"), 0, c) for c in row.values()]
    return cells


def cpu_markdown(doc: dict) -> str:
    cfg, rt, machine, versions = doc["config"], doc["runtime"], doc["machine"], doc["versions"]
    runs = f"median of {cfg['runs']} timed run(s) after {cfg['warmup']} warm-up(s), each a fresh process"
    parts = [f"## {rt['name']} on CPU: transcription latency, RTF and max-RSS\n",
             f"{runs}; latency = transcription only (model load excluded), RTF = latency / audio duration, "
             f"max-RSS = peak RSS of the whole process (VmHWM). `*` = more threads than the "
             f"{machine.get('usable_cores')} usable cores (oversubscribed).\n",
             cpu_table(doc), _model_files(doc["cells"]), _errors_section(doc["cells"]), "### Conditions\n",
             _conditions(doc, machine, versions)]
    return "\n".join(p for p in parts if p)


def _model_files(cells: list[dict]) -> str:
    files = {c["model"]: c for c in cells if c["backbone"] is not None}
    if not files:
        return ""
    lines = ["Model files: " + "; ".join(f"`{c['model_label']}` = {c['backbone']} {c['precision']}, "
                                         f"{c['model_size_mb']:.1f} MB" for c in files.values())]
    return "\n".join(lines) + "\n"


def _errors_section(cells: list[dict]) -> str:
    errors: dict[str, list[dict]] = {}
    for c in cells:
        if c["status"] == "error":
            errors.setdefault(f"{c['model_label']}: {c['error']}", []).append(c)
    if not errors:
        return ""
    lines = ["### Errors\n"]
    for message, group in errors.items():
        where = ", ".join(_ordered(f"{c['audio_label']}/{c['threads']}t" for c in group))
        lines.append(f"- {message} (cells: {where})")
    return "\n".join(lines) + "\n"


def _conditions(doc: dict, machine: dict, versions: dict) -> str:
    baselines = ", ".join(f"{b['audio']} {b['peak_rss_mb']:.0f} MB" for b in doc["baselines"]
                          if b.get("peak_rss_mb") is not None)
    load = doc["loadavg"]
    lines = [
        f"- Machine: {machine.get('cpu_model')}, {machine.get('usable_cores')} usable / {machine.get('logical_cores')} "
        f"logical cores, {(machine.get('memory_total_mb') or 0) / 1024:.1f} GiB RAM, {machine.get('platform')}",
        f"- Versions: whisper.cpp {versions.get('whisper.cpp')}, ggml {versions.get('ggml')} "
        f"({versions.get('ggml_commit')}), pywhispercpp {versions.get('pywhispercpp')}, torch {versions.get('torch')}, "
        f"Python {machine.get('python')}",
        f"- Load average (1 min): {load['start'][0]:.2f} at start, {load['end'][0]:.2f} at end, "
        f"{_range(load.get('runs_1m_min'), load.get('runs_1m_max'))} over the runs",
        f"- Harness baseline RSS (interpreter + runtime + audio, no model): {baselines or 'not measured'}; the harness "
        f"process itself: {doc['harness'].get('rss_mb') or 0:.0f} MB",
        f"- Environment: {', '.join(f'{k}={v}' for k, v in doc['environment'].items()) or 'no knobs set'}",
        f"- Decode settings: {json.dumps(doc['runtime']['settings'])}; order of runs: {doc['config']['order']}",
    ]
    lines += [f"- Note: {n}" for n in doc.get("notes", [])]
    return "\n".join(lines) + "\n"


def _range(low: float | None, high: float | None) -> str:
    return "—" if low is None else f"{low:.2f}–{high:.2f}"


def gpu_markdown(doc: dict) -> str:
    title = "## GPU: FP16 (transformers) vs INT4 lattice kernels\n"
    if doc.get("status") != "ran":
        return f"{title}\n**Nothing measured**: {doc.get('reason')}\n"
    header = ["Backbone", "Audio", "Variant", "Kernel", "latency (ms)", "end-to-end (ms)", "tokens", "ms/token",
              "peak VRAM torch (MB)", "NVML used (MB)"]
    lines = [title, "| " + " | ".join(header) + " |", "|---|---|---|---|" + "---:|" * (len(header) - 4)]
    for c in doc["cells"]:
        stats = [_fmt(_median(c, n), d, c) for n, d in (("generate_ms", 1), ("end_to_end_ms", 1), ("tokens", 0),
                                                       ("ms_per_token", 2), ("peak_vram_mb", 0), ("nvml_used_mb", 0))]
        lines.append("| " + " | ".join([c["backbone"], f"{c['audio_label']} ({c['audio_s']:.1f} s)", c["variant"],
                                         c["kernel"], *stats]) + " |")
    problems = _ordered(f"- {c['variant']} {c['kernel']} ({c['audio_label']}): {c['status']}: {c['error']}"
                        for c in doc["cells"] if c["status"] != "ok")
    if problems:
        lines += ["", "### Errors and skipped rows\n", *problems]
    lines.append("")
    lines += [f"- Device: {doc['machine'].get('gpu')}; versions: {json.dumps(doc['versions'])}"]
    lines += [f"- Note: {n}" for n in doc.get("notes", [])]
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------------------------------------- plot
def plot_png(doc: dict) -> bytes:
    """CPU: latency vs threads (median, min-max bars) and peak-RSS bars against the harness baseline. GPU: latency
    and peak-VRAM bars per variant."""
    import matplotlib

    matplotlib.use("Agg")  # no display; must precede pyplot
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5), gridspec_kw={"width_ratios": [3, 2]})
    if doc["kind"] == "cpu":
        _plot_cpu_latency(left, doc)
        _plot_cpu_rss(right, doc)
    else:
        _plot_gpu(left, right, doc)
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=110)
    plt.close(fig)
    return buffer.getvalue()


def _ok_cells(doc: dict) -> list[dict]:
    return [c for c in doc["cells"] if c["status"] == "ok"]


def _plot_cpu_latency(ax: Any, doc: dict) -> None:
    """One colour per (backbone, audio), one line style per variant: F16 and its INT4 file side by side."""
    cells = _ok_cells(doc)
    variant = variant_of(cells)
    keys = _ordered((c["backbone"], c["audio_label"]) for c in cells)
    variants = _ordered(variant[c["model"]] for c in cells)
    styles = ["-", "--", ":", "-."]
    for key in keys:
        for v in variants:
            line = sorted((c for c in cells if (c["backbone"], c["audio_label"]) == key and variant[c["model"]] == v),
                          key=lambda c: c["threads"])
            if not line:
                continue
            stats = [c["summary"]["transcribe_s"] for c in line]
            y = [s["median"] for s in stats]
            err = [[s["median"] - s["min"] for s in stats], [s["max"] - s["median"] for s in stats]]
            ax.errorbar([c["threads"] for c in line], y, yerr=err, marker="o", capsize=3,
                        color=f"C{keys.index(key) % 10}", linestyle=styles[variants.index(v) % len(styles)],
                        label=f"{key[0]} {v} {key[1]}")
    cores = doc["machine"].get("usable_cores")
    if cores:
        ax.axvline(cores, color="grey", linestyle=":", label=f"{cores} usable cores")
    ax.set_xscale("log", base=2)
    threads = sorted({c["threads"] for c in doc["cells"]})
    ax.set_xticks(threads, [str(t) for t in threads])
    ax.set_xlabel("threads")
    ax.set_ylabel("transcription latency (s), median, min–max")
    ax.set_title(f"{doc['runtime']['name']}: latency vs threads")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7)


def _plot_cpu_rss(ax: Any, doc: dict) -> None:
    cells = _ok_cells(doc)
    variant = variant_of(cells)
    models = _ordered((c["backbone"], variant[c["model"]]) for c in cells)
    peaks = [max(c["summary"]["peak_rss_mb"]["max"] for c in cells if (c["backbone"], variant[c["model"]]) == m)
             for m in models]
    bars = ax.bar([f"{b}\n{v}" for b, v in models], peaks, color="tab:blue")
    ax.bar_label(bars, fmt="%.0f", fontsize=8)
    baseline = max((b["peak_rss_mb"] for b in doc["baselines"] if b.get("peak_rss_mb") is not None), default=None)
    if baseline is not None:
        ax.axhline(baseline, color="tab:red", linestyle="--", label=f"harness baseline {baseline:.0f} MB")
        ax.legend(fontsize=7)
    ax.set_ylabel("max-RSS (MB), max over audios and threads")
    ax.set_title("peak RSS per model file")


def _plot_gpu(left: Any, right: Any, doc: dict) -> None:
    cells = _ok_cells(doc)
    labels = [f"{c['backbone']} {c['variant']}\n{c['audio_label']}" for c in cells]
    left.bar(labels, [c["summary"]["generate_ms"]["median"] for c in cells], color="tab:green")
    left.set_ylabel("latency (ms), CUDA events")
    left.set_title("GPU latency")
    right.bar(labels, [c["summary"]["peak_vram_mb"]["median"] for c in cells], color="tab:purple")
    right.set_ylabel("peak VRAM (MB), torch.cuda.max_memory_allocated")
    right.set_title("GPU peak memory")
    for ax in (left, right):
        ax.tick_params(axis="x", labelsize=7)
