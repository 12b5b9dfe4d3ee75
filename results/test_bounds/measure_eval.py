"""Spread of the figures tests/test_eval_e2e.py bounds, over what legitimately varies between runs.

    python results/test_bounds/measure_eval.py [--out results/test_bounds/eval-<cpu>.json]

The test's own commands (same corpora, sizes and options; its GPTQ g128 column, whose rows it only checked for
presence, left it on 2026-12-07): F16, ggml's RTN Q4_0 and a TARQ g32 lattice calibrated on 4 synthetic utterances, each through
PyTorch and whisper.cpp, on the 12 real clips and 8 synthetic utterances. Varied: threads 1 and 2 (`eval --threads`
and torch's threads in `quantize`), the calibration seed 0 and 1, and on AVX-512 processors torch forced to AVX2.
Figures: the F16 torch / whisper.cpp agreement (identical normalised text, near-ties aside) and each row's capped
WER on the real clips.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from measure_quantize import AVX2, ROOT, config_key, configurations, cpu_model, reused_runs  # noqa: E402

N_SYNTH_EVAL, N_SYNTH_CALIB = 8, 4


def cli(env: dict, *argv) -> None:
    subprocess.run([sys.executable, "-m", "tarq_deploy.cli", *map(str, argv)], env=env, check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def corpora(work: Path, env: dict) -> dict[str, Path]:
    cli(env, "corpus", "real", "--out", work / "real")
    cli(env, "corpus", "synth", "--out", work / "synth", "--n", N_SYNTH_EVAL, "--n-calib", N_SYNTH_CALIB, "--seed", 1)
    return {"real": work / "real" / "eval.jsonl", "synth": work / "synth" / "eval.jsonl",
            "calib": work / "synth" / "calib.jsonl"}


def one_configuration(config: dict, data: dict[str, Path], work: Path) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS=str(config["threads"]), PYTHONPATH=str(ROOT))
    if config["isa"] == "avx2":
        env.update(AVX2)
    here = work / f"t{config['threads']}-s{config['seed']}-{config['isa']}"
    cli(env, "export", "--target", "whisper.cpp", "--model", "packaged:tiny.en", "-o", here / "f16.bin", "--quiet")
    cli(env, "export", "--target", "whisper.cpp", "--model", "packaged:tiny.en", "--baseline", "rtn", "--type", "q4_0",
        "-o", here / "rtn.bin", "--quiet")
    cli(env, "quantize", "--model", "packaged:tiny.en", "--calib", data["calib"], "--method", "tarq", "--group-size",
        32, "--n-calib", N_SYNTH_CALIB, "--seed", config["seed"], "--out", here / "tarq")
    cli(env, "export", "--target", "whisper.cpp", here / "tarq", "-o", here / "tarq.bin", "--quiet")
    models = [("F16", "packaged:tiny.en", "torch"), ("F16", here / "f16.bin", "whisper.cpp"),
              ("RTN Q4_0", here / "rtn.bin", "torch"), ("RTN Q4_0", here / "rtn.bin", "whisper.cpp"),
              ("TARQ g32", here / "tarq", "torch"), ("TARQ g32", here / "tarq.bin", "whisper.cpp")]
    argv = ["eval", "--data", data["real"], "--data", data["synth"], "--out", here / "eval", "--jobs", 2,
            "--threads", config["threads"], "--resamples", 200, "--quiet"]
    for label, source, backend in models:
        argv += ["--model", f"{label}={source}", "--backend", backend]
    cli(env, *argv)
    report = json.loads((here / "eval" / "report.json").read_text())
    rows = [r for d in report["datasets"] for r in d["backend_agreement"] if r["label"] == "F16"]
    identical, total = sum(r["identical"] for r in rows), sum(r["utterances"] for r in rows)
    near_ties = sum(r["near_ties"] for r in rows)
    real = report["datasets"][0]
    return {**config, "f16_agreement": identical / (total - near_ties), "f16_identical": identical,
            "f16_near_ties": near_ties, "utterances": total,
            "capped_wer_real": {row["key"]: row["capped_wer"]["value"] for row in real["models"]}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path)
    parser.add_argument("--reuse", type=Path, help="JSON lines of configurations already measured: kept")
    args = parser.parse_args()
    vendor = "intel" if "Intel" in cpu_model() else "amd" if "AMD" in cpu_model() else "cpu"
    out = args.out or ROOT / "results" / "test_bounds" / f"eval-{vendor}.json"
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        data = corpora(work, dict(os.environ, PYTHONPATH=str(ROOT)))
        runs = []
        reused = reused_runs(args.reuse)
        for config in [c for c in configurations() if c["n_calib"] == 128]:  # quantize --n-calib 4: the whole pool
            runs.append(reused.get(config_key(config)) or one_configuration(config, data, work))
            print(json.dumps(runs[-1]), flush=True)
    out.write_text(json.dumps({"cpu_model": cpu_model(), "command": "python results/test_bounds/measure_eval.py",
                               "runs": runs}, indent=1) + "\n")


if __name__ == "__main__":
    main()
