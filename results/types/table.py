"""The size / quality table and plot of issue 16, from the eval report of the retired run_types.sh (commit 284d6a5) and model files.

Per whisper.cpp type and method: file size (MiB), WER, rare-WER and capped rare-WER (95% bootstrap intervals), the
teacher-forced rare-token KLD against F16, and TARQ's paired differences against ggml's own rounding and imatrix
of the same type (WER, rare-WER, rare-word retention and rare KLD; * = the interval excludes 0). Writes table.md
and size_quality.png (raw rare-WER, capped rare-WER and rare KLD against file size).

    python results/types/table.py REPORT.json BIN_DIR OUT_DIR
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

MIB = 1 << 20
METHODS = ("ggml", "imatrix", "tarq")
MARKERS = {"ggml": "o", "imatrix": "s", "tarq": "^", "F16": "*"}


def pct(figure: dict) -> str:
    return f"{100 * figure['value']:.1f} [{100 * figure['low']:.1f}, {100 * figure['high']:.1f}]"


def diff(figure: dict | None, scale: float, digits: int) -> str:
    if figure is None:
        return "–"
    star = " *" if figure.get("significant") else ""
    v, lo, hi = (scale * figure[k] for k in ("value", "low", "high"))
    return f"{v:+.{digits}f} [{lo:+.{digits}f}, {hi:+.{digits}f}]{star}"


def _label(key: str) -> str:
    """A model's label from the report's "label [backend]" key."""
    return key.split(" [")[0]


def rows(report: dict, bin_dir: Path) -> list[dict]:
    dataset = report["datasets"][0]
    tf = {m["label"]: m for m in dataset["teacher_forced"]["models"]}
    kept = {_label(r["model"]): r for r in dataset.get("retention", {}).get("models", [])}
    out = []
    for m in dataset["models"]:
        label = m["label"]
        method, _, type_name = label.partition("-") if label != "F16" else ("F16", "", "f16")
        out.append({"label": label, "method": method, "type": type_name,
                    "mib": (bin_dir / f"{label}.bin").stat().st_size / MIB, "wer": m["wer"],
                    "rare_wer": m["rare_wer"], "capped_rare_wer": m["capped_rare_wer"], "loops": m["loops"],
                    "kld_rare": tf.get(label, {}).get("kld_rare"), "retention": kept.get(label)})
    return out


def differences(report: dict) -> dict[tuple[str, str], dict]:
    """(model label, versus label) -> {"rare_wer": ..., "kld_rare": ...}."""
    dataset = report["datasets"][0]
    out: dict[tuple[str, str], dict] = {}
    for d in dataset["differences"]:
        out.setdefault((_label(d["model"]), _label(d["versus"])), {}).update(rare_wer=d["rare_wer"], wer=d["wer"])
    for d in dataset.get("retention", {}).get("differences", []):
        out.setdefault((_label(d["model"]), _label(d["versus"])), {})["retention"] = d["retention"]
    for d in dataset["teacher_forced"].get("differences", []):
        out.setdefault((d["model"], d["versus"]), {})["kld_rare"] = d["kld_rare"]
    return out


def table(report: dict, bin_dir: Path) -> str:
    dataset = report["datasets"][0]
    found = rows(report, bin_dir)
    diffs = differences(report)
    lines = [f"Whisper base, test split: {dataset['utterances']} utterances, {dataset['words']} words, "
             f"{dataset['rare_words']} rare (Zipf < {report['settings']['zipf_threshold']}); whisper.cpp greedy, "
             f"1 thread. Rates in %, 95% bootstrap intervals ({report['settings']['bootstrap_resamples']} "
             f"resamples); rare KLD in nats, teacher-forced against F16.", "",
             "Retention: of the rare reference words F16 transcribes correctly, the share the model keeps "
             "(kept / known).", "",
             "| type | method | MiB | WER | rare-WER | capped rare-WER | retention | rare KLD | loops |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in found:
        kld = f"{r['kld_rare']['value']:.4f}" if r["kld_rare"] else "–"
        ret = r["retention"]
        kept = f"{pct(ret['retention'])} ({ret['kept']}/{ret['known']})" if ret else "–"
        lines.append(f"| {r['type']} | {r['method']} | {r['mib']:.1f} | {pct(r['wer'])} | {pct(r['rare_wer'])} | "
                     f"{pct(r['capped_rare_wer'])} | {kept} | {kld} | {r['loops']} |")
    lines += ["", "TARQ minus the baseline of the same type (paired over the same utterances; * = interval excludes 0; "
                  "negative = TARQ better, except retention, where positive is):", "",
              "| type | Δ WER vs ggml | Δ WER vs imatrix | Δ rare-WER vs ggml | Δ rare-WER vs imatrix "
              "| Δ retention vs ggml | Δ retention vs imatrix | Δ rare KLD vs ggml | Δ rare KLD vs imatrix |",
              "|---|---|---|---|---|---|---|---|---|"]
    for type_name in sorted({r["type"] for r in found if r["method"] == "tarq"}, key=_type_order):
        cells = []
        for figure, scale, digits in (("wer", 100, 1), ("rare_wer", 100, 1), ("retention", 100, 1),
                                      ("kld_rare", 1, 4)):
            for base in ("ggml", "imatrix"):
                cells.append(diff(diffs.get((f"tarq-{type_name}", f"{base}-{type_name}"), {}).get(figure), scale,
                                  digits))
        lines.append(f"| {type_name} | {' | '.join(cells)} |")
    return "\n".join(lines) + "\n"


def _type_order(name: str) -> tuple[int, str]:
    return (int(name[1]) if name[1].isdigit() else 99, name)


def plot(report: dict, bin_dir: Path, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    found = rows(report, bin_dir)
    fig, axes = plt.subplots(1, 3, figsize=(17, 4.8))
    # raw rare-WER beside the capped one: a single repetition loop moves the raw figure by points
    panels = ((axes[0], "rare_wer", "rare-WER (%)"), (axes[1], "capped_rare_wer", "capped rare-WER (%)"),
              (axes[2], "kld_rare", "rare-token KLD (nats)"))
    for ax, key, title in panels:
        for method in ("F16", *METHODS):
            pts = [r for r in found if r["method"] == method and r[key]]
            scale = 1 if key == "kld_rare" else 100
            ax.scatter([r["mib"] for r in pts], [scale * r[key]["value"] for r in pts], marker=MARKERS[method],
                       label=method, s=60 if method != "F16" else 120)
            for r in pts:
                ax.annotate(r["type"], (r["mib"], scale * r[key]["value"]), fontsize=7, xytext=(3, 3),
                            textcoords="offset points")
        ax.set_xlabel("whisper.cpp file (MiB)")
        ax.set_ylabel(title)
        ax.grid(alpha=0.3)
    axes[0].legend()
    fig.suptitle("Whisper base, test split: size against rare-word quality, per type and method")
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("report")
    parser.add_argument("bin_dir")
    parser.add_argument("out")
    args = parser.parse_args()
    report = json.loads(Path(args.report).read_text())
    out = Path(args.out)
    (out / "table.md").write_text(table(report, Path(args.bin_dir)))
    plot(report, Path(args.bin_dir), out / "size_quality.png")
    print(f"wrote {out / 'table.md'} and {out / 'size_quality.png'}")


if __name__ == "__main__":
    main()
