"""How well each teacher-forced figure tracks rare-WER across quantized models (issue 18, item 1).

Reads an eval report.json made with --reference and --teacher-forced (one dataset), and writes tracking.md (per
model: rare-WER, capped rare-WER, rare KLD, rare delta-NLL, rare top-1, retention; then the Pearson and Spearman
correlation of each figure with rare-WER and with capped rare-WER across the models) and tracking.png.

    python results/rarewords/tracking.py REPORT.json OUT_DIR [--backend whisper.cpp] [--title TEXT]
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
from scipy.stats import pearsonr, spearmanr

FIGURES = (("kld_rare", "KLD rare (nats)"), ("dnll_rare", "ΔNLL rare (nats)"), ("top1_rare", "top-1 rare"),
           ("retention", "rare-word retention"), ("kld_common", "KLD common (nats)"))


def rows(report: dict, backend: str) -> list[dict]:
    dataset = report["datasets"][0]
    tf = {m["label"]: m for m in dataset["teacher_forced"]["models"]}
    retention = {r["model"]: r["retention"]["value"] for r in dataset["retention"]["models"]}
    out = []
    for m in dataset["models"]:
        if m["backend"] != backend or m["label"] not in tf:
            continue
        t = tf[m["label"]]
        out.append({"label": m["label"], "rare_wer": m["rare_wer"]["value"], "capped_rare_wer": m["capped_rare_wer"]["value"],
                    "wer": m["wer"]["value"], "loops": m["loops"], "retention": retention.get(m["key"], np.nan),
                    **{k: t[k]["value"] for k, _ in FIGURES if k in t}})
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("report")
    parser.add_argument("out")
    parser.add_argument("--backend", default="whisper.cpp")
    parser.add_argument("--title", default="Teacher-forced figures against rare-WER (whisper.cpp Q4_0)")
    args = parser.parse_args()
    table = rows(json.loads(Path(args.report).read_text()), args.backend)
    out = Path(args.out)
    lines = ["| model | WER | rare-WER | capped rare-WER | loops | KLD rare | ΔNLL rare | top-1 rare | retention | KLD common |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in sorted(table, key=lambda r: r["kld_rare"]):
        lines.append(f"| {r['label']} | {100 * r['wer']:.1f} | {100 * r['rare_wer']:.1f} | {100 * r['capped_rare_wer']:.1f} "
                     f"| {r['loops']} | {r['kld_rare']:.4f} | {r['dnll_rare']:.4f} | {100 * r['top1_rare']:.1f} | "
                     f"{100 * r['retention']:.1f} | {r['kld_common']:.4f} |")
    lines += ["", f"Correlation across the {len(table)} quantized models (Pearson r / Spearman ρ):", "",
              "| figure | vs rare-WER | vs capped rare-WER |", "|---|---|---|"]
    for key, name in FIGURES:
        x = np.array([r[key] for r in table])
        cells = []
        for target in ("rare_wer", "capped_rare_wer"):
            y = np.array([r[target] for r in table])
            cells.append(f"{pearsonr(x, y)[0]:+.2f} / {spearmanr(x, y)[0]:+.2f}")
        lines.append(f"| {name} | {cells[0]} | {cells[1]} |")
    (out / "tracking.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    for ax, (key, name) in zip(axes, FIGURES[:2] + FIGURES[3:4]):
        for target, marker in (("rare_wer", "o"), ("capped_rare_wer", "s")):
            ax.scatter([r[key] for r in table], [100 * r[target] for r in table], marker=marker,
                       label=target.replace("_", " "))
        for r in table:
            ax.annotate(r["label"], (r[key], 100 * r["capped_rare_wer"]), fontsize=7)
        ax.set_xlabel(name)
        ax.set_ylabel("rare-WER (%)")
    axes[0].legend(fontsize=8)
    fig.suptitle(args.title)
    fig.tight_layout()
    fig.savefig(out / "tracking.png", dpi=110)


if __name__ == "__main__":
    main()
