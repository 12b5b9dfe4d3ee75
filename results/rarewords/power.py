"""How large a rare-WER difference can a test split resolve, and how large a one does a rare-KLD difference predict?
(issue 18: why decoded rare-WER cannot separate TARQ from GPTQ)

From an eval report.json made with --reference and --teacher-forced (one dataset, whisper.cpp backend):

1. The rare-KLD -> rare-WER slope across the quantized models (least squares), i.e. how many rare-WER points one
   nat of rare-token KLD costs on this split when the methods differ.
2. For every requested pair: the paired bootstrap interval of Δ rare-WER, its standard error (half-width / 1.96),
   the smallest difference the split detects with 80 % power at 5 % (2.80 SE), the Δ rare-WER that the pair's
   measured Δ rare-KLD predicts through the slope, and how many utterances a split of the same kind would need to
   detect that predicted difference (n x (2.80 SE / predicted)^2).

    python results/rarewords/power.py REPORT.json [--backend whisper.cpp] [--out power.md]
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

Z_POWER = 1.96 + 0.84  # two-sided 5 %, 80 % power


def slope(points: list[tuple[float, float]]) -> tuple[float, float]:
    """Least-squares slope of rare-WER on rare KLD, and Pearson r."""
    x, y = np.array(points).T
    b = float(np.polyfit(x, y, 1)[0])
    return b, float(np.corrcoef(x, y)[0, 1])


def analyse(report: dict, backend: str) -> str:
    d = report["datasets"][0]
    n = d["utterances"]
    tf = {m["label"]: m for m in d["teacher_forced"]["models"]}
    rows = {m["label"]: m for m in d["models"] if m["backend"] == backend}
    points = [(tf[label]["kld_rare"]["value"], 100 * rows[label]["rare_wer"]["value"]) for label in tf if label in rows]
    b, r = slope(points)
    tf_diff = {(x["model"], x["versus"]): x for x in d["teacher_forced"]["differences"]}
    lines = [f"Split: {n} utterances, {d.get('rare_words')} rare words. Across the {len(points)} quantized models the "
             f"least-squares slope of rare-WER on rare KLD is {b:.1f} points per nat (Pearson r = {r:.2f}).", "",
             "| pair | Δ rare KLD | Δ rare-WER [95 %] | SE | detectable (80 % power) | predicted by Δ KLD "
             "| utterances to detect the predicted |",
             "|---|---|---|---|---|---|---|"]
    for diff in d["differences"]:
        a, v = (s.split(" [")[0] for s in (diff["model"], diff["versus"]))
        kld = tf_diff.get((a, v))
        if kld is None or v == d["teacher_forced"]["reference"]:
            continue
        w = diff["rare_wer"]
        se = 100 * (w["high"] - w["low"]) / 2 / 1.96
        predicted = b * kld["kld_rare"]["value"]
        needed = n * (Z_POWER * se / predicted) ** 2 if predicted else float("inf")
        lines.append(f"| {a} − {v} | {kld['kld_rare']['value']:+.4f} | {100 * w['value']:+.1f} "
                     f"[{100 * w['low']:+.1f}, {100 * w['high']:+.1f}] | {se:.1f} | {Z_POWER * se:.1f} | "
                     f"{predicted:+.1f} | {needed:,.0f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("report")
    p.add_argument("--backend", default="whisper.cpp")
    p.add_argument("--out")
    args = p.parse_args()
    text = analyse(json.loads(Path(args.report).read_text()), args.backend)
    if args.out:
        Path(args.out).write_text(text)
    print(text)


if __name__ == "__main__":
    main()
