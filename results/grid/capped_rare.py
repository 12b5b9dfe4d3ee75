"""Capped rare-WER paired differences between models of one eval run, which report.md's paired table leaves out.

Per utterance a model's rare errors are capped at its rare words (a loop counts once per word, as eval's capped
columns do); the difference is in percentage points with a 95 % bootstrap interval over utterances (eval's own
resampling: 2,000 resamples, seed 0). Usage:

    python results/grid/capped_rare.py utterances.jsonl A:B [C:D ...]    (labels as given to eval --model; the
                                                                            whisper.cpp run's, or "A [torch]:B [torch]")
"""
from __future__ import annotations

import json
import sys

import numpy as np

from tarq_deploy.evaluate.wer import bootstrap_indices

BACKEND = " [whisper.cpp]"


def capped_rare(rows: dict[str, dict], ids: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """(capped rare errors, rare words) per utterance, in ``ids`` order."""
    errors = np.array([min(rows[i]["rare_errors"], rows[i]["rare_words"]) for i in ids], dtype=float)
    words = np.array([rows[i]["rare_words"] for i in ids], dtype=float)
    return errors, words


def main(path: str, pairs: list[str]) -> None:
    by_model: dict[str, dict[str, dict]] = {}
    with open(path) as f:
        for line in f:
            row = json.loads(line)
            by_model.setdefault(row["model"], {})[row["id"]] = row
    ids = sorted(next(iter(by_model.values())))
    resamples = bootstrap_indices(len(ids), 2000, 0)
    for pair in pairs:
        a, b = (label if label.endswith("]") else label + BACKEND for label in pair.split(":"))  # "X [torch]": as is
        errors_a, words = capped_rare(by_model[a], ids)
        errors_b, _ = capped_rare(by_model[b], ids)
        point = (errors_a.sum() - errors_b.sum()) / words.sum() * 100
        boot = (errors_a[resamples].sum(1) - errors_b[resamples].sum(1)) / words[resamples].sum(1) * 100
        low, high = np.percentile(boot, [2.5, 97.5])
        mark = " *" if low > 0 or high < 0 else ""
        print(f"{a} - {b}: capped rare-WER {point:+.1f} [{low:+.1f}, {high:+.1f}]{mark}")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
