"""Where a greedy advantage goes under whisper-cli's decoding, utterance by utterance (issue 61, item 6).

    python results/decoding/flips.py runs/decoding-greedy runs/decoding-cli tarq-q4_0 ggml-q4_0 [--dataset test]

For two files A and B decoded under both profiles on the same utterances, each utterance's rare-word errors
(evaluate/wer.py's, from utterances.jsonl) are compared: what the beams and fallback fix and cause for each file,
and the utterances where A's greedy edge over B vanishes (or grows) under cli, with whether B got better or A got
worse there. Prints a markdown summary; nothing is tuned here.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path


def rows(folder: Path, dataset: str) -> dict[str, dict[str, dict]]:
    """{label: {utterance id: record}} of one eval output folder."""
    found: dict[str, dict[str, dict]] = {}
    for line in (folder / "utterances.jsonl").read_text(encoding="utf-8").splitlines():
        if line.strip():
            r = json.loads(line)
            if r["dataset"] == dataset:
                found.setdefault(r["model"].split(" [")[0], {})[r["id"]] = r
    return found


def changes(greedy: dict[str, dict], cli: dict[str, dict], field: str) -> dict[str, int]:
    """Per utterance, cli minus greedy in ``field``; summed over the ones it lowers (fixed) and raises (caused)."""
    deltas = [cli[i][field] - greedy[i][field] for i in greedy if i in cli]
    return {"fixed": -sum(d for d in deltas if d < 0), "caused": sum(d for d in deltas if d > 0),
            "net": sum(deltas), "utterances_changed": sum(d != 0 for d in deltas)}


def edge_moves(a_greedy, a_cli, b_greedy, b_cli, field: str) -> dict[str, int]:
    """How A's edge over B (B's errors minus A's) moves from greedy to cli, split by which file moved."""
    moved = {"edge_lost_b_improved": 0, "edge_lost_a_worsened": 0, "edge_gained_b_worsened": 0,
             "edge_gained_a_improved": 0}
    for i in a_greedy:
        da, db = a_cli[i][field] - a_greedy[i][field], b_cli[i][field] - b_greedy[i][field]
        if db - da < 0:  # the edge shrank on this utterance
            moved["edge_lost_b_improved"] += max(0, -db)
            moved["edge_lost_a_worsened"] += max(0, da)
        elif db - da > 0:
            moved["edge_gained_b_worsened"] += max(0, db)
            moved["edge_gained_a_improved"] += max(0, -da)
    return moved


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("greedy", type=Path)
    parser.add_argument("cli", type=Path)
    parser.add_argument("a")
    parser.add_argument("b")
    parser.add_argument("--dataset", default="test")
    args = parser.parse_args()
    g, c = rows(args.greedy, args.dataset), rows(args.cli, args.dataset)
    print(f"## {args.a} against {args.b} on {args.dataset}: greedy -> cli\n")
    print("| file | figure | greedy | cli | fixed by cli | caused by cli | utterances changed |")
    print("|---|---|---|---|---|---|---|")
    for label in (args.a, args.b):
        for field in ("rare_errors", "errors"):
            moved = changes(g[label], c[label], field)
            print(f"| {label} | {field} | {sum(r[field] for r in g[label].values())} | "
                  f"{sum(r[field] for r in c[label].values())} | {moved['fixed']} | {moved['caused']} | "
                  f"{moved['utterances_changed']} |")
    print()
    for field in ("rare_errors", "errors"):
        moved = edge_moves(g[args.a], c[args.a], g[args.b], c[args.b], field)
        print(f"- {field}: where {args.a}'s edge shrank, {moved['edge_lost_b_improved']} of {args.b}'s errors were "
              f"fixed and {moved['edge_lost_a_worsened']} of {args.a}'s caused; where it grew, "
              f"{moved['edge_gained_b_worsened']} of {args.b}'s caused and {moved['edge_gained_a_improved']} of "
              f"{args.a}'s fixed")


if __name__ == "__main__":
    main()
