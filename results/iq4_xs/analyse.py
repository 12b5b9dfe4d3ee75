"""Where the IQ4_XS rare-word gap between TARQ's and ggml's files comes from, per utterance (results/iq4_xs).

For each backend: the paired per-utterance difference in rare-word errors (A - B), how many utterances carry it
and how concentrated it is, and whether the same utterances carry it in the other backend (one model file, two
runtimes: a gap that the weights cause shows in both; one made by near-tie flips of greedy decoding moves around).

    python results/iq4_xs/analyse.py runs/iq4_xs/eval/utterances.jsonl tarq:ggml [A:B ...]
"""
from __future__ import annotations

import json
import sys
from collections import defaultdict

import numpy as np


def load(path: str) -> dict[tuple[str, str], dict[str, dict]]:
    """(label, backend) -> utterance id -> row."""
    rows: dict[tuple[str, str], dict[str, dict]] = defaultdict(dict)
    for line in open(path, encoding="utf-8"):
        if line.strip():
            r = json.loads(line)
            label, _, backend = r["model"].rpartition(" [")
            rows[(label, backend.rstrip("]"))][r["id"]] = r
    return rows


def paired(rows: dict, a: str, b: str, backend: str) -> dict[str, int] | None:
    """Per utterance: rare errors of a minus those of b, capped at the utterance's rare words (a loop's insertions
    do not count twice)."""
    ra, rb = rows.get((a, backend)), rows.get((b, backend))
    if not ra or not rb:
        return None
    return {i: min(ra[i]["rare_errors"], ra[i]["rare_words"]) - min(rb[i]["rare_errors"], rb[i]["rare_words"])
            for i in ra if i in rb}


def describe(diff: dict[str, int], rare_words: int) -> str:
    values = np.array(list(diff.values()))
    net = int(values.sum())
    ranked = np.sort(values)[::-1] if net >= 0 else np.sort(values)
    top5 = int(ranked[:5].sum())
    return (f"net {net:+d} rare errors ({100 * net / rare_words:+.1f} points of capped rare-WER) over {len(values)} "
            f"utterances; {int((values > 0).sum())} worse, {int((values < 0).sum())} better, "
            f"{int((values == 0).sum())} equal; the 5 largest carry {top5:+d}")


def main(argv: list[str]) -> int:
    path, pairs = argv[0], [p.split(":") for p in argv[1:]]
    rows = load(path)
    backends = sorted({b for _, b in rows})
    for a, b in pairs:
        print(f"## {a} - {b}")
        diffs = {}
        for backend in backends:
            diff = paired(rows, a, b, backend)
            if diff is None:
                continue
            rare_words = sum(r["rare_words"] for r in rows[(a, backend)].values())
            diffs[backend] = diff
            print(f"- {backend}: {describe(diff, rare_words)}")
        if len(diffs) == 2:
            (n1, d1), (n2, d2) = diffs.items()
            ids = sorted(set(d1) & set(d2))
            x, y = np.array([d1[i] for i in ids]), np.array([d2[i] for i in ids])
            moved = [i for i in ids if d1[i] or d2[i]]
            same = sum(1 for i in moved if d1[i] == d2[i])
            corr = float(np.corrcoef(x, y)[0, 1]) if x.std() and y.std() else float("nan")
            print(f"- {n1} vs {n2}: per-utterance differences correlate r = {corr:.2f}; of the {len(moved)} "
                  f"utterances where either differs, {same} differ by the same amount in both")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
