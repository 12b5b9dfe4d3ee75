"""Paired differences between two files of a probe.py output, per figure (shape/kind), with 95 % bootstrap
intervals over windows: python results/cliform/compare_probe.py PROBE.json A B [A B ...]."""
import json
import sys

import numpy as np

FIGURES = [("plain", "text"), ("stamped", "text"), ("carried", "text"), ("stamped", "stamp"), ("carried", "stamp"),
           ("stamped", "eot"), ("carried", "eot")]


def per_window(rows: dict, label: str, shape: str, kind: str) -> np.ndarray:
    return np.array([(s, n) for _, s, n in rows[label][shape][kind]], dtype=np.float64)


def main() -> None:
    probe = json.load(open(sys.argv[1]))
    rows, pairs = probe["rows"], sys.argv[2:]
    rng = np.random.default_rng(0)
    print("| A − B | " + " | ".join(f"{kind}, {shape}" for shape, kind in FIGURES) + " |")
    print("|---" * (len(FIGURES) + 1) + "|")
    for a, b in zip(pairs[::2], pairs[1::2]):
        cells = []
        for shape, kind in FIGURES:
            x, y = per_window(rows, a, shape, kind), per_window(rows, b, shape, kind)
            idx = rng.integers(0, len(x), size=(2000, len(x)))
            diff = x[idx, 0].sum(1) / x[idx, 1].sum(1) - y[idx, 0].sum(1) / y[idx, 1].sum(1)
            point = x[:, 0].sum() / x[:, 1].sum() - y[:, 0].sum() / y[:, 1].sum()
            low, high = np.quantile(diff, [0.025, 0.975])
            star = " \\*" if low > 0 or high < 0 else ""
            cells.append(f"{point:+.3f} [{low:+.3f}, {high:+.3f}]{star}")
        print(f"| {a} − {b} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
