"""Paired differences across types from a finished frontier sweep: is a smaller file as good as the one people ship?

The sweep's report pairs cells of the same type only. This reads the sweep's own step outputs (each cell's
per-utterance hypotheses and teacher-forced figures, found through OUT/cells.log.jsonl) and pairs any two cells on the
same utterances, e.g. TARQ's Q3_K against ggml's Q4_0:

    python results/frontier/cross_type.py runs/frontier base/synth/tarq/q3_k:base/-/ggml/q4_0 ... \\
        --out results/frontier/cross-type.md

Intervals: 95 % paired bootstrap over utterances, the sweep's resamples and seed (2000, 0).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from tarq_deploy.evaluate.teacher_forced import UtteranceFigures, figure_counts
from tarq_deploy.evaluate.wer import bootstrap_indices, metric_counts, paired_difference, score_utterance

DECODED = ("wer", "rare_wer", "capped_wer", "capped_rare_wer")
FIGURES = ("kld_rare", "kld_common")


def step_outputs(out: Path) -> dict[tuple[str, str], Path]:
    """(cell, step kind) -> the step's folder, for every step that finished (done or found cached)."""
    found: dict[tuple[str, str], Path] = {}
    for line in (out / "cells.log.jsonl").read_text().splitlines():
        event = json.loads(line)
        if event["event"] in ("done", "cached"):
            for cell in event["cells"]:
                found[(cell, event["step"])] = out / "steps" / event["step"] / event["key"]
    return found


def cell_scores(folder: Path, dataset: str, zipf: float = 3.0) -> list:
    rows = [json.loads(line) for line in (folder / "utterances.jsonl").read_text().splitlines() if line.strip()]
    return [score_utterance(r["id"], r["reference"], r["hypothesis"], zipf) for r in rows if r["dataset"] == dataset]


def cell_figures(folder: Path, dataset: str, cell: str) -> list[UtteranceFigures]:
    rows = [json.loads(line) for line in (folder / "teacher-forced.jsonl").read_text().splitlines() if line.strip()]
    return [UtteranceFigures.from_record(r) for r in rows if r["dataset"] == dataset and r["label"] == cell]


def compare(out: Path, a: str, b: str, dataset: str, resamples: int, seed: int) -> dict:
    steps = step_outputs(out)
    scores = {c: cell_scores(steps[(c, "eval")], dataset) for c in (a, b)}
    if [s.id for s in scores[a]] != [s.id for s in scores[b]]:
        raise SystemExit(f"{a} and {b} were not evaluated on the same utterances")
    indices = bootstrap_indices(len(scores[a]), resamples, seed)
    counts = {c: metric_counts(s) for c, s in scores.items()}
    row = {"model": a, "versus": b, "utterances": len(scores[a]),
           **{m: paired_difference(counts[a][m], counts[b][m], indices).as_dict() for m in DECODED}}
    if all((c, "score") in steps for c in (a, b)):
        figures = {c: figure_counts(cell_figures(steps[(c, "score")], dataset, c)) for c in (a, b)}
        row.update({m: paired_difference(figures[a][m], figures[b][m], indices).as_dict() for m in FIGURES})
    return row


def _cell(d: dict | None, scale: float, digits: int) -> str:
    if d is None:
        return "—"
    f = f"{{:+.{digits}f}}"
    return f"{f.format(scale * d['value'])} [{f.format(scale * d['low'])}, {f.format(scale * d['high'])}]" + \
        (" *" if d["significant"] else "")


def render(rows: list[dict], command: str) -> str:
    lines = [f"`{command}`", "", "| model | versus | utterances | Δ WER | Δ rare-WER | Δ capped WER | Δ capped rare-WER | "
             "Δ KLD rare | Δ KLD common |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['model']} | {r['versus']} | {r['utterances']} | " + " | ".join(
            _cell(r.get(m), 100, 1) for m in DECODED) + " | " + " | ".join(_cell(r.get(m), 1, 4) for m in FIGURES)
            + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("out", type=Path, help="the sweep's --out folder")
    p.add_argument("pairs", nargs="+", help="CELL_A:CELL_B (cell names as in the report)")
    p.add_argument("--dataset", default="test")
    p.add_argument("--resamples", type=int, default=2000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out-md", type=Path)
    args = p.parse_args(argv)
    rows = [compare(args.out, *pair.split(":"), args.dataset, args.resamples, args.seed) for pair in args.pairs]
    text = render(rows, "python results/frontier/cross_type.py " + " ".join(argv or sys.argv[1:]))
    if args.out_md:
        args.out_md.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
