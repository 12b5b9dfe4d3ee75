"""The study's tables (results/terms/README.md) from the eval reports results/terms/run.sh wrote:
runs/terms/eval-{cli,greedy}-{all,seen,unseen}/report.json (and runs/terms/dev-cli/report.json when present).

    python results/terms/summarize.py runs/terms > results/terms/tables.md
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

PAIRS = [("tarq-terms-q4_0", "gptq-q4_0"), ("tarq-terms-q3_k", "gptq-q3_k"), ("tarq-terms-q4_0", "ggml-q4_0"),
         ("tarq-terms-q3_k", "ggml-q3_k"), ("tarq-terms-q4_0", "tarq-q4_0"), ("tarq-terms-q3_k", "tarq-q3_k"),
         ("tarq-q4_0", "gptq-q4_0"), ("tarq-q3_k", "gptq-q3_k")]
MODELS = ["f16", "ggml-q4_0", "gptq-q4_0", "tarq-q4_0", "tarq-terms-q4_0", "ggml-q3_k", "gptq-q3_k", "tarq-q3_k",
          "tarq-terms-q3_k"]


def key(label: str) -> str:
    return f"{label} [whisper.cpp]"


def pct(x: dict, signed: bool = False) -> str:
    if x is None or x.get("value") is None or x["value"] != x["value"]:
        return "n/a"
    sign = "+" if signed else ""
    star = " \\*" if signed and x.get("significant") else ""
    return f"{100 * x['value']:{sign}.1f} [{100 * x['low']:{sign}.1f}, {100 * x['high']:{sign}.1f}]{star}"


def load(runs: Path, profile: str, terms: str) -> dict | None:
    path = runs / f"eval-{profile}-{terms}" / "report.json"
    return json.loads(path.read_text()) if path.is_file() else None


def model_table(report: dict, by_list: dict[str, dict]) -> list[str]:
    d = report["datasets"][0]
    rows = {m["label"]: m for m in d["models"]}
    term_models = {name: r["datasets"][0]["terms"]["models"] for name, r in by_list.items() if r}
    lines = ["| file | WER | rare-WER | capped rare-WER | loops | term recall: all | seen | unseen | term-WER: all |",
             "|---|---|---|---|---|---|---|---|---|"]
    for label in MODELS:
        m = rows.get(label)
        if m is None:
            continue
        recall = [pct(term_models[n].get(key(label), {}).get("term_recall")) if n in term_models else "n/a"
                  for n in ("all", "seen", "unseen")]
        term_wer = pct(term_models["all"].get(key(label), {}).get("term_wer")) if "all" in term_models else "n/a"
        lines.append(f"| {label} | {pct(m['wer'])} | {pct(m['rare_wer'])} | {pct(m['capped_rare_wer'])} | "
                     f"{m['loops']} | {' | '.join(recall)} | {term_wer} |")
    return lines


def pair_table(report: dict, by_list: dict[str, dict]) -> list[str]:
    d = report["datasets"][0]
    diffs = {(r["model"], r["versus"]): r for r in d["differences"]}
    term_diffs = {name: {(r["a"], r["b"]): r for r in rep["datasets"][0]["terms"]["differences"]}
                  for name, rep in by_list.items() if rep}
    lines = ["| A − B | Δ term recall: all | seen | unseen | Δ term-WER: all | Δ capped rare-WER | Δ WER |",
             "|---|---|---|---|---|---|---|"]
    for a, b in PAIRS:
        row = diffs.get((key(a), key(b)), {})
        recall = [pct(term_diffs[n].get((key(a), key(b)), {}).get("term_recall"), True) if n in term_diffs else "n/a"
                  for n in ("all", "seen", "unseen")]
        term_wer = pct(term_diffs["all"].get((key(a), key(b)), {}).get("term_wer"), True) \
            if "all" in term_diffs else "n/a"
        lines.append(f"| {a} − {b} | {' | '.join(recall)} | {term_wer} | {pct(row.get('capped_rare_wer'), True)} | "
                     f"{pct(row.get('wer'), True)} |")
    return lines


def term_counts(by_list: dict[str, dict]) -> list[str]:
    out = []
    for name, rep in by_list.items():
        if rep:
            t = rep["datasets"][0]["terms"]
            out.append(f"- `{name}`: {t['occurring_terms']} of the list's {t['terms']} terms occur in the test split, "
                       f"{t['occurrences']} occurrences ({t['file']})")
    return out


def main(runs: Path) -> int:
    for profile in ("cli", "greedy"):
        by_list = {name: load(runs, profile, name) for name in ("all", "seen", "unseen")}
        if by_list["all"] is None:
            continue
        machine = by_list["all"]["settings"]["machine"]
        print(f"## Test split, decoded `{profile}`\n")
        print(f"Machine: {machine.get('cpu', machine)}; threads {by_list['all']['settings']['threads']}.\n")
        print("\n".join(term_counts(by_list)) + "\n")
        print("\n".join(model_table(by_list["all"], by_list)) + "\n")
        print("\n".join(pair_table(by_list["all"], by_list)) + "\n")
    dev = runs / "dev-cli" / "report.json"
    if dev.is_file():
        report = json.loads(dev.read_text())
        terms = report["datasets"][0]["terms"]
        print("## Dev split (the --tail default), decoded `cli`\n")
        print(f"{terms['occurring_terms']} terms occur, {terms['occurrences']} occurrences.\n")
        print("| file | term recall | term-WER |\n|---|---|---|")
        for label, m in terms["models"].items():
            print(f"| {label} | {pct(m['term_recall'])} | {pct(m['term_wer'])} |")
        print("\n| A − B | Δ term recall | Δ term-WER |\n|---|---|---|")
        for r in terms["differences"]:
            print(f"| {r['a']} − {r['b']} | {pct(r['term_recall'], True)} | {pct(r['term_wer'], True)} |")
    return 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1] if len(sys.argv) > 1 else "runs/terms")))
