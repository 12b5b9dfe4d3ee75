"""The dev-split ablation table (issue 18): teacher-forced figures of every calibration variant against F16, with
paired bootstrap differences against a baseline variant, read from `tarq-deploy eval --teacher-forced` caches.

    python results/rarewords/ablation.py --baseline GPTQ-max LABEL=EVAL_OUT/teacher-forced/LABEL.jsonl ... > table.md

Every cache must come from the same dev dataset and reference (its identity line says so; checked)."""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from tarq_deploy.evaluate.teacher_forced import TF_METRICS, UtteranceFigures, figure_counts
from tarq_deploy.evaluate.wer import bootstrap_indices, bootstrap_interval, paired_difference


def load(path: Path) -> tuple[dict, dict[str, UtteranceFigures]]:
    lines = path.read_text().splitlines()
    identity = json.loads(lines[0])
    rows = [json.loads(line) for line in lines[1:] if line.strip()]
    return identity, {r["key"]: UtteranceFigures.from_record(r["figures"]) for r in rows}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("caches", nargs="+", metavar="LABEL=PATH")
    parser.add_argument("--baseline", required=True)
    parser.add_argument("--resamples", type=int, default=2000)
    args = parser.parse_args()
    variants = {}
    for item in args.caches:
        label, _, path = item.partition("=")
        variants[label] = load(Path(path))
    references = {identity["reference"] for identity, _ in variants.values()}
    if len(references) != 1:
        raise SystemExit(f"caches were made against different references: {references}")
    keys = sorted(set.intersection(*(set(rows) for _, rows in variants.values())))
    indices = bootstrap_indices(len(keys), args.resamples, 0)
    counts = {label: figure_counts([rows[k] for k in keys]) for label, (_, rows) in variants.items()}
    base = counts[args.baseline]
    print(f"{len(keys)} dev utterances; figures against F16; Δ = variant − {args.baseline} (paired bootstrap 95%, "
          f"{args.resamples} resamples; * = excludes 0)\n")
    print("| variant | KLD rare | KLD common | ΔNLL rare | top-1 rare % | Δ KLD rare | Δ KLD common | Δ ΔNLL rare |")
    print("|---|---|---|---|---|---|---|---|")
    for label, c in counts.items():
        value = {m: bootstrap_interval(*c[m], indices).value for m in TF_METRICS}
        cells = []
        for metric in ("kld_rare", "kld_common", "dnll_rare"):
            if label == args.baseline:
                cells.append("—")
                continue
            d = paired_difference(c[metric], base[metric], indices)
            cells.append(f"{d.value:+.4f} [{d.low:+.4f}, {d.high:+.4f}]{' *' if d.significant else ''}")
        print(f"| {label} | {value['kld_rare']:.4f} | {value['kld_common']:.4f} | {value['dnll_rare']:.4f} | "
              f"{100 * value['top1_rare']:.1f} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
