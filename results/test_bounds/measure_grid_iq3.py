"""Spread of the capped WER that tests/test_grid_whisper_cpp.py bounds: TARQ of real Whisper base at IQ3_S and
IQ3_XXS, calibrated on the three real clips of tests/helpers.calibration_clips and transcribed by whisper.cpp on the
nine real clips the calibration did not see, over what legitimately varies between runs; and the same chain with the
uncalibrated nearest grid points (``--method rtn``). Each row gives the capped WER on jfk alone (what the test
bounds) and on all nine held-out clips (what it bounded until 2026-12-07), with every transcript.

    python results/test_bounds/measure_grid_iq3.py [--types iq3_s iq3_xxs] [--out FILE.json]

Each configuration is the test's own chain of commands in fresh processes: `quantize --method tarq --type T --calib
<the three clips> --n-calib 3 --seed S`, `export`, `verify`, then whisper.cpp (pywhispercpp, greedy, 2 threads).
Varied: quantize's seed 0 (the test's) and 1; torch threads 2 (the test's) and 1; on an AVX-512 processor the AVX2
kernels (ATEN_CPU_CAPABILITY=avx2, ONEDNN_MAX_CPU_ISA=AVX2, MKL_ENABLE_INSTRUCTIONS=AVX2).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from measure_grid_iq2 import _cli, capped_wer_of, write_result  # noqa: E402
from measure_quantize import AVX2, ROOT  # noqa: E402

sys.path.insert(0, str(ROOT / "tests"))
from helpers import calibration_clips, clips_capped_wer, clips_manifest  # noqa: E402

TYPES = ("iq3_s", "iq3_xxs")


def held_out_clips() -> list:
    """The real clips the calibration does not see, jfk first."""
    from tarq_deploy.data.real_clips import all_real_clips

    calibrated_on = {clip.id for clip in calibration_clips()}
    return [clip for clip in all_real_clips() if clip.id not in calibrated_on]


def one(work: Path, manifest: Path, type_name: str, method: str, seed: int, threads: int, isa: str) -> dict:
    tag = f"{type_name}-{method}-{seed}-t{threads}-{isa}"
    env = {"OMP_NUM_THREADS": str(threads), **(AVX2 if isa == "avx2" else {})}
    started = time.monotonic()
    _cli("quantize", "--model", "packaged:base", "--method", method, "--type", type_name, "--calib", str(manifest),
         "--n-calib", "3", "--seed", str(seed), "--out", str(work / tag), env=env)
    seconds = time.monotonic() - started
    _cli("export", "--target", "whisper.cpp", str(work / tag), "-o", str(work / f"{tag}.bin"), "--quiet")
    _cli("verify", str(work / f"{tag}.bin"), "--against", str(work / tag))
    clips = held_out_clips()
    wer, texts = capped_wer_of(work / f"{tag}.bin", clips)
    jfk_wer = clips_capped_wer(clips[:1], [texts[0][1]])
    row = {"type": type_name, "method": method, "seed": seed, "torch_threads": threads, "isa": isa,
           "capped_wer_jfk": round(jfk_wer, 4), "capped_wer_held_out_9": round(wer, 4),
           "quantize_seconds": round(seconds, 1), "texts": texts}
    print(json.dumps({k: v for k, v in row.items() if k != "texts"}), flush=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--types", nargs="+", default=list(TYPES), choices=TYPES)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    runs = [(t, "tarq", s, 2, "native") for t in args.types for s in (0, 1)]
    runs += [(t, "tarq", 0, 1, "native") for t in args.types]
    if "avx512f" in Path("/proc/cpuinfo").read_text():
        runs += [(t, "tarq", 0, 2, "avx2") for t in args.types]
    runs += [(t, "rtn", 0, 2, "native") for t in args.types]
    with tempfile.TemporaryDirectory() as tmp:
        manifest = clips_manifest(calibration_clips(), Path(tmp) / "calib.jsonl")
        rows = [one(Path(tmp), manifest, *run) for run in runs]
    write_result(rows, args.out)


if __name__ == "__main__":
    main()
