"""Spread of the capped WER that tests/test_grid_whisper_cpp_2bit.py bounds: TARQ of real Whisper base at IQ2_S and
IQ2_XS, calibrated on four real clips (jfk and the three of tests/helpers.calibration_clips) and transcribed by
whisper.cpp on those same four clips (the test now bounds jfk's alone: the texts are in the rows), over what
legitimately varies between runs; and the same chain with the uncalibrated nearest grid points (``--method rtn``),
which the bound must refuse.

    python results/test_bounds/measure_grid_iq2_in_sample.py [--types iq2_s iq2_xs] [--out FILE.json]

Each configuration is the test's own chain of commands in fresh processes: `quantize --method tarq --type T --calib
<the four clips> --n-calib 4 --seed S`, `export`, `verify`, then whisper.cpp (pywhispercpp, greedy, 2 threads) on
the four clips, scored by the test's capped WER. Varied: quantize's seed 0 (the test's) and 1 (the order in which
the clips are packed into windows); torch threads 2 (the test's) and 1; on an AVX-512 processor the AVX2 kernels
(ATEN_CPU_CAPABILITY=avx2, ONEDNN_MAX_CPU_ISA=AVX2, MKL_ENABLE_INSTRUCTIONS=AVX2).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

sys.path.insert(0, str(Path(__file__).resolve().parent))
from measure_grid_iq2 import TYPES, _cli, capped_wer_of, write_result  # noqa: E402
from measure_quantize import AVX2, ROOT  # noqa: E402

sys.path.insert(0, str(ROOT / "tests"))
from helpers import clips_manifest, in_sample_2bit_clips  # noqa: E402

Figures = Callable[[float, list[tuple[str, str]]], dict]  # (capped WER of the scored clips, their texts) -> row fields


def variant_runs(types: list[str]) -> list[tuple[str, str, int, int, str]]:
    """(type, method, seed, torch threads, isa) of every configuration: seeds 0/1, one thread, AVX2 kernels on an
    AVX-512 processor, then the nearest grid points."""
    runs = [(t, "tarq", s, 2, "native") for t in types for s in (0, 1)]
    runs += [(t, "tarq", 0, 1, "native") for t in types]
    if "avx512f" in Path("/proc/cpuinfo").read_text():
        runs += [(t, "tarq", 0, 2, "avx2") for t in types]
    return runs + [(t, "rtn", 0, 2, "native") for t in types]


def measure_rows(types: list[str], calibration: list, scored: list, figures: Figures) -> list[dict]:
    """Every configuration of ``types``: base calibrated on the clips ``calibration``, whisper.cpp on ``scored``."""
    with tempfile.TemporaryDirectory() as tmp:
        manifest = clips_manifest(calibration, Path(tmp) / "calib.jsonl")
        return [one(Path(tmp), manifest, len(calibration), scored, figures, *run) for run in variant_runs(types)]


def one(work: Path, manifest: Path, n_calib: int, scored: list, figures: Figures, type_name: str, method: str,
        seed: int, threads: int, isa: str) -> dict:
    tag = f"{type_name}-{method}-{seed}-t{threads}-{isa}"
    env = {"OMP_NUM_THREADS": str(threads), **(AVX2 if isa == "avx2" else {})}
    started = time.monotonic()
    _cli("quantize", "--model", "packaged:base", "--method", method, "--type", type_name, "--calib", str(manifest),
         "--n-calib", str(n_calib), "--seed", str(seed), "--out", str(work / tag), env=env)
    seconds = time.monotonic() - started
    _cli("export", "--target", "whisper.cpp", str(work / tag), "-o", str(work / f"{tag}.bin"), "--quiet")
    _cli("verify", str(work / f"{tag}.bin"), "--against", str(work / tag))
    wer, texts = capped_wer_of(work / f"{tag}.bin", scored)
    row = {"type": type_name, "method": method, "seed": seed, "torch_threads": threads, "isa": isa,
           **figures(wer, texts), "quantize_seconds": round(seconds, 1), "texts": texts}
    print(json.dumps({k: v for k, v in row.items() if k != "texts"}), flush=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--types", nargs="+", default=list(TYPES), choices=TYPES)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    clips = in_sample_2bit_clips()
    write_result(measure_rows(args.types, clips, clips, lambda wer, _: {"capped_wer": round(wer, 4)}), args.out)


if __name__ == "__main__":
    main()
