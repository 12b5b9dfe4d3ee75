"""The study's tables for results/cli-study/README.md and the project README, from the two reports report.sh writes
(runs/cli-study-cli/report.json, runs/cli-study-greedy/report.json) and the files' sizes. Prints markdown.

    python results/cli-study/table.py runs/cli-study-cli/report.json runs/cli-study-greedy/report.json
    python results/cli-study/table.py --pairs runs/cli-study-cli/report.json runs/cli-study-greedy/report.json
    python results/cli-study/table.py --readme runs/cli-study-cli/report.json runs/cli-study-greedy/report.json
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

TYPES = ("q5_0", "q4_0", "q3_k", "iq3_s")
ORDER = [f"{m}-{t}" for t in TYPES for m in ("ggml", "imatrix", "gptq", "tarq")]
NAMES = {"ggml": "ggml", "imatrix": "imatrix", "gptq": "GPTQ", "tarq": "TARQ"}


def pct(x: float | None) -> str:
    return "—" if x is None else f"{100 * x:.1f}"


def interval(d: dict) -> str:
    star = " \\*" if d.get("significant") else ""
    text = f"{100 * d['value']:+.1f} [{100 * d['low']:+.1f}, {100 * d['high']:+.1f}]"
    return text.replace("-", "\u2212") + star


def dataset(report: dict, name: str) -> dict | None:
    return next((d for d in report["datasets"] if d["name"] == name), None)


def by_label(ds: dict) -> dict[str, dict]:
    return {m["label"]: m for m in ds["models"]}


def difference(ds: dict, a: str, b: str, figure: str) -> dict | None:
    for d in ds["differences"]:
        if d["model"] == f"{a} [whisper.cpp]" and d["versus"] == f"{b} [whisper.cpp]":
            return d[figure]
    return None


def retention(ds: dict) -> dict[str, dict]:
    return {r["model"].split(" [")[0]: r["retention"] for r in ds["retention"]["models"]}


def failure(ds: dict, label: str) -> dict:
    return ds["failures"]["models"][f"{label} [whisper.cpp]"]


def title(label: str) -> str:
    if label == "f16":
        return "F16"
    method, type_name = label.split("-", 1)
    return f"{type_name.upper()} {NAMES[method]}"


def long_cells(long: dict | None, label: str) -> str:
    """The long recordings' WER · rare-WER · loops · invented words a minute; a dash where none were decoded."""
    if long is None:
        return "—"
    lrun, lf = by_label(long)[label], failure(long, label)
    invented = lf.get("gap_invented_words", 0) / lf["gap_minutes"] if lf.get("gap_minutes") else None
    return (f"{pct(lrun['wer']['value'])} · {pct(lrun['rare_wer']['value'])} · {lrun['loops']} / {lf['items']} · "
            f"{'—' if invented is None else f'{invented:.1f}'}")


def main(cli_path: str, greedy_path: str | None) -> None:
    cli = json.loads(Path(cli_path).read_text())
    greedy = json.loads(Path(greedy_path).read_text()) if greedy_path else None
    test, long = dataset(cli, "test"), dataset(cli, "long")
    g_test = dataset(greedy, "test") if greedy else None
    runs = by_label(test)
    g_runs = by_label(g_test) if g_test else {}
    nonspeech = cli["nonspeech"]["models"]
    kept = retention(test)
    labels = ["f16"] + [x for x in ORDER if x in runs]
    print("| file | MiB | cli test: WER · rare-WER · capped rare-WER · kept | greedy test: WER · capped rare-WER "
          "| cli, vs ggml same type: Δ rare-WER · Δ capped rare-WER | long (3 recordings): WER · rare-WER · loops "
          "· invented/min | non-speech words/min | RTF cli · greedy |")
    print("|---|---|---|---|---|---|---|---|")
    for label in labels:
        run = runs[label]
        size = Path(run["source"]).stat().st_size / 2**20
        keep = kept.get(label)
        keep_text = "—" if keep is None else f"{100 * keep['value']:.0f} %"
        g = g_runs.get(label)
        g_text = "—" if g is None else f"{pct(g['wer']['value'])} · {pct(g['capped_rare_wer']['value'])}"
        method, type_name = (label.split("-", 1) + [""])[:2]
        versus = ""
        if method not in ("f16", "ggml"):
            rare = difference(test, label, f"ggml-{type_name}", "rare_wer")
            capped = difference(test, label, f"ggml-{type_name}", "capped_rare_wer")
            if rare and capped:
                versus = f"{interval(rare)} · {interval(capped)}"
        ns = nonspeech.get(f"{label} [whisper.cpp]", {}).get("words_per_minute")
        g_rtf = "—" if g is None else f"{g['real_time_factor']:.2f}"
        bold = "**" if method == "tarq" else ""
        print(f"| {bold}{title(label)}{bold} | {size:.1f} | {pct(run['wer']['value'])} · {pct(run['rare_wer']['value'])}"
              f" · {pct(run['capped_rare_wer']['value'])} · {keep_text} | {g_text} | {versus} | "
              f"{long_cells(long, label)} | {'—' if ns is None else f'{ns:.1f}'} | "
              f"{run['real_time_factor']:.2f} · {g_rtf} |")


PAIRS = [("tarq", t, "ggml", t) for t in TYPES] + [("tarq", "q3_k", "ggml", "q4_0"),
         ("tarq", "q4_0", "ggml", "q5_0")] + [("tarq", t, o, t) for o in ("gptq", "imatrix") for t in TYPES]


def long_pair(long: dict | None, a: str, b: str) -> str:
    """The long recordings' WER A / B · loops A / B · invented words A / B; a dash where none were decoded."""
    if long is None:
        return "—"
    la, lb, lr = failure(long, a), failure(long, b), by_label(long)
    return (f"{pct(lr[a]['wer']['value'])} / {pct(lr[b]['wer']['value'])} · {la['loops']} / {lb['loops']} · "
            f"{la['gap_invented_words']} / {lb['gap_invented_words']}")


def retention_difference(ds: dict, a: str, b: str) -> dict | None:
    for d in ds["retention"].get("differences", []):
        if d["model"] == f"{a} [whisper.cpp]" and d["versus"] == f"{b} [whisper.cpp]":
            return d["retention"]
    return None


def pairs(cli_path: str, greedy_path: str | None) -> None:
    """The paired differences, A − B: test split under cli (and greedy, rare-WER), long recordings as counts."""
    cli = json.loads(Path(cli_path).read_text())
    greedy = json.loads(Path(greedy_path).read_text()) if greedy_path else None
    test, long = dataset(cli, "test"), dataset(cli, "long")
    g_test = dataset(greedy, "test") if greedy else None
    runs = by_label(test)
    print("| A − B | greedy: Δ rare-WER · Δ capped rare-WER | cli: Δ rare-WER | cli: Δ capped rare-WER | cli: Δ WER "
          "| cli: Δ kept | test loops A / B | long: WER A / B · loops A / B · invented A / B |")
    print("|---|---|---|---|---|---|---|---|")
    for ma, ta, mb, tb in PAIRS:
        a, b = f"{ma}-{ta}", f"{mb}-{tb}"
        if a not in runs or b not in runs or difference(test, a, b, "wer") is None:
            continue
        g = "—"
        if g_test is not None and difference(g_test, a, b, "rare_wer") is not None:
            g = f"{interval(difference(g_test, a, b, 'rare_wer'))} · {interval(difference(g_test, a, b, 'capped_rare_wer'))}"
        kept = retention_difference(test, a, b)
        print(f"| {title(a)} − {title(b)} | {g} | {interval(difference(test, a, b, 'rare_wer'))} | "
              f"{interval(difference(test, a, b, 'capped_rare_wer'))} | {interval(difference(test, a, b, 'wer'))} | "
              f"{'—' if kept is None else interval(kept)} | {runs[a]['loops']} / {runs[b]['loops']} | "
              f"{long_pair(long, a, b)} |")


README_ROWS = ["f16", "ggml-q5_0", "tarq-q5_0", "ggml-q4_0", "imatrix-q4_0", "gptq-q4_0", "tarq-q4_0", "ggml-q3_k",
               "gptq-q3_k", "tarq-q3_k"]


def readme(cli_path: str, greedy_path: str | None) -> None:
    """The project README's shorter table: its rows, and the columns a user chooses a file by."""
    cli = json.loads(Path(cli_path).read_text())
    greedy = json.loads(Path(greedy_path).read_text()) if greedy_path else None
    test, long = dataset(cli, "test"), dataset(cli, "long")
    runs, long_runs = by_label(test), by_label(long)
    g_runs = by_label(dataset(greedy, "test")) if greedy else {}
    nonspeech = cli["nonspeech"]["models"]
    print("| file | MiB | test, cli: WER · rare-WER · capped | test, greedy: WER · rare-WER | cli Δ rare-WER vs ggml, "
          "same type | long: WER · loops | non-speech words/min |")
    print("|---|---|---|---|---|---|---|")
    for label in (x for x in README_ROWS if x in runs):
        run, lrun, g = runs[label], long_runs[label], g_runs.get(label)
        method, type_name = (label.split("-", 1) + [""])[:2]
        rare = difference(test, label, f"ggml-{type_name}", "rare_wer") if method not in ("f16", "ggml") else None
        bold = "**" if method == "tarq" else ""
        g_text = "—" if g is None else f"{pct(g['wer']['value'])} · {pct(g['rare_wer']['value'])}"
        ns = nonspeech.get(f"{label} [whisper.cpp]", {}).get("words_per_minute")
        print(f"| {bold}{title(label)}{bold} | {Path(run['source']).stat().st_size / 2**20:.1f} | "
              f"{pct(run['wer']['value'])} · {pct(run['rare_wer']['value'])} · {pct(run['capped_rare_wer']['value'])} | "
              f"{g_text} | {interval(rare) if rare else ''} | {pct(lrun['wer']['value'])} · "
              f"{lrun['loops']} / {failure(long, label)['items']} | {'—' if ns is None else f'{ns:.1f}'} |")


if __name__ == "__main__":
    if sys.argv[1] == "--readme":
        readme(sys.argv[2], sys.argv[3] if len(sys.argv) > 3 else None)
    elif sys.argv[1] == "--pairs":
        pairs(sys.argv[2], sys.argv[3] if len(sys.argv) > 3 else None)
    else:
        main(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else None)
