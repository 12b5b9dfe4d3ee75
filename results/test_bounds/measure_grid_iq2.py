"""Spread of the held-out capped WER of TARQ IQ2_S and IQ2_XS of base (what tests/test_grid_whisper_cpp_2bit.py
bounded until 2026-12-07; now a measurement only), over what legitimately varies between runs, for a given size of
the synthetic calibration corpus.

    python results/test_bounds/measure_grid_iq2.py --n-calib 32 [--corpus 128] [--types iq2_s] [--seeds 0 1 2 3]
        [--out FILE.json]

Each configuration is the test's own chain of commands in fresh processes: `corpus synth --n 1 --n-calib C --seed S`
(voices slt and joe; C is --corpus, by default N), `quantize --method tarq --type T --n-calib N` of real Whisper base
on it (N < C: quantize's own draw of N of the C utterances), `export`, `verify`, then whisper.cpp (pywhispercpp,
greedy, 2 threads) on the 12 real clips, scored by the test's capped WER. Varied: the corpus seed; torch threads 2
(the test's: the quantize child runs on torch's default) and 1; on an AVX-512 processor the AVX2 kernels
(ATEN_CPU_CAPABILITY=avx2, ONEDNN_MAX_CPU_ISA=AVX2, MKL_ENABLE_INSTRUCTIONS=AVX2) for the test's seed.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from measure_quantize import AVX2, ROOT, cpu_model  # noqa: E402

TYPES = ("iq2_s", "iq2_xs")


def _cli(*argv: str, env: dict | None = None) -> None:
    run = subprocess.run([sys.executable, "-m", "tarq_deploy.cli", *argv], capture_output=True, text=True,
                         env={**os.environ, **(env or {})})
    if run.returncode != 0:
        raise SystemExit(f"{' '.join(argv[:2])} failed: {run.stderr[-1500:]}")


def capped_wer_of(model_file: Path, clips: list | None = None) -> tuple[float, list[tuple[str, str]]]:
    """The test's capped WER of whisper.cpp's transcripts of ``clips`` (default: the 12 real clips), with the texts."""
    sys.path.insert(0, str(ROOT / "tests"))
    from helpers import clips_capped_wer, transcribe_whisper_cpp_clips

    from tarq_deploy.data.real_clips import all_real_clips

    clips = all_real_clips() if clips is None else clips
    texts = transcribe_whisper_cpp_clips(model_file, [str(c.path) for c in clips])
    return clips_capped_wer(clips, texts), [(c.id, t) for c, t in zip(clips, texts)]


def one(work: Path, type_name: str, n_calib: int, size: int, seed: int, threads: int, isa: str) -> dict:
    """One configuration: N = ``n_calib`` of a synthetic corpus of ``size`` utterances (made once per size and seed)."""
    corpus = work / f"synth-{size}-{seed}"
    if not (corpus / "calib.jsonl").exists():
        _cli("corpus", "synth", "--out", str(corpus), "--n", "1", "--n-calib", str(size), "--seed", str(seed))
    tag = f"{type_name}-{n_calib}-{seed}-t{threads}-{isa}"
    env = {"OMP_NUM_THREADS": str(threads), **(AVX2 if isa == "avx2" else {})}
    started = time.monotonic()
    _cli("quantize", "--model", "packaged:base", "--method", "tarq", "--type", type_name, "--calib",
         str(corpus / "calib.jsonl"), "--n-calib", str(n_calib), "--out", str(work / tag), env=env)
    seconds = time.monotonic() - started
    _cli("export", "--target", "whisper.cpp", str(work / tag), "-o", str(work / f"{tag}.bin"), "--quiet")
    _cli("verify", str(work / f"{tag}.bin"), "--against", str(work / tag))
    wer, texts = capped_wer_of(work / f"{tag}.bin")
    row = {"type": type_name, "n_calib": n_calib, "corpus": size, "seed": seed, "torch_threads": threads, "isa": isa,
           "capped_wer": round(wer, 4), "quantize_seconds": round(seconds, 1), "texts": texts}
    print(json.dumps({k: v for k, v in row.items() if k != "texts"}), flush=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n-calib", type=int, required=True)
    parser.add_argument("--corpus", type=int, default=0, help="utterances synthesized (default: --n-calib)")
    parser.add_argument("--types", nargs="+", default=list(TYPES), choices=TYPES)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3])
    parser.add_argument("--test-seed", type=int, default=2, help="the seed varied over threads and kernels")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    size = args.corpus or args.n_calib
    if size < args.n_calib:
        parser.error(f"--corpus {size}: fewer utterances than --n-calib {args.n_calib} draws")
    runs = [(t, s, 2, "native") for t in args.types for s in args.seeds]
    runs += [(t, args.test_seed, 1, "native") for t in args.types]
    if "avx512f" in Path("/proc/cpuinfo").read_text():
        runs += [(t, args.test_seed, 2, "avx2") for t in args.types]
    with tempfile.TemporaryDirectory() as tmp:
        rows = [one(Path(tmp), type_name, args.n_calib, size, seed, threads, isa)
                for type_name, seed, threads, isa in runs]
    write_result(rows, args.out)


def write_result(rows: list[dict], out: Path | None) -> None:
    """The rows with the machine they ran on, as JSON to ``out`` (stdout without one)."""
    result = {"cpu_model": cpu_model(), "machine": platform.machine(), "load_average_at_end": os.getloadavg(),
              "rows": rows}
    text = json.dumps(result, indent=1)
    if out:
        out.write_text(text + "\n")
    else:
        print(text)


if __name__ == "__main__":
    main()
