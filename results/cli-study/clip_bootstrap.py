"""Paired bootstrap over non-speech clips of the words-per-minute difference between two models of an eval report
(its nonspeech section's per-clip counts): a clip is the unit, as one clip's burst decides a small set.

    python results/cli-study/clip_bootstrap.py REPORT.json A:B [A:B ...]
"""
from __future__ import annotations

import json
import sys

import numpy as np


def main(report_path: str, pairs: list[str], resamples: int = 2000) -> None:
    section = json.load(open(report_path))["nonspeech"]
    counts = {key.split(" [")[0]: model["by_clip"] for key, model in section["models"].items()}
    rng = np.random.default_rng(0)
    for pair in pairs:
        a, b = pair.split(":")
        clips = sorted(counts[a])
        minutes = {clip: 0.5 for clip in clips}  # the clips are 30 s each in this study
        x = np.array([(counts[a][c] - counts[b][c]) / minutes[c] for c in clips])
        means = np.array([x[rng.integers(0, len(x), len(x))].mean() for _ in range(resamples)])
        bursts = (sum(counts[a][c] > 0 for c in clips), sum(counts[b][c] > 0 for c in clips))
        print(f"{a} - {b}: {x.mean():+.1f} [{np.percentile(means, 2.5):+.1f}, {np.percentile(means, 97.5):+.1f}] "
              f"words/min over {len(clips)} clips; clips with invented words {bursts[0]} vs {bursts[1]}")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
