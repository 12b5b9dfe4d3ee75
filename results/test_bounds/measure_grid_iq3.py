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
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from measure_grid_iq2 import write_result  # noqa: E402
from measure_grid_iq2_in_sample import measure_rows  # noqa: E402
from measure_quantize import ROOT  # noqa: E402

sys.path.insert(0, str(ROOT / "tests"))
from helpers import calibration_clips, clips_capped_wer  # noqa: E402

TYPES = ("iq3_s", "iq3_xxs")


def held_out_clips() -> list:
    """The real clips the calibration does not see, jfk first."""
    from tarq_deploy.data.real_clips import all_real_clips

    calibrated_on = {clip.id for clip in calibration_clips()}
    return [clip for clip in all_real_clips() if clip.id not in calibrated_on]


def figures(wer: float, texts: list[tuple[str, str]]) -> dict:
    """jfk's capped WER (what the test bounds) and the nine clips' (what it bounded until 2026-12-07)."""
    jfk = held_out_clips()[0]
    assert texts[0][0] == jfk.id
    return {"capped_wer_jfk": round(clips_capped_wer([jfk], [texts[0][1]]), 4), "capped_wer_held_out_9": round(wer, 4)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--types", nargs="+", default=list(TYPES), choices=TYPES)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    write_result(measure_rows(args.types, calibration_clips(), held_out_clips(), figures), args.out)


if __name__ == "__main__":
    main()
