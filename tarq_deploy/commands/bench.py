"""`tarq-deploy bench`: latency, RTF and max-RSS of runtime model files on CPU; FP16 vs INT4 on a GPU.

    tarq-deploy bench --model a-f16.bin --model a-q4_0.bin --audio jfk.wav --threads 4,8,16
    tarq-deploy bench --model a-q4_0.bin --threads 1,2 --warmup 0 --runs 1 --out /tmp/quick
    tarq-deploy bench --gpu --model packaged:tiny.en --checkpoint CKPT_DIR --audio jfk.wav
    tarq-deploy bench --report-only runs/bench/bench-cpu.json      # re-render table, CSV and plot

Writes STEM.json / .csv / .md / .png under --out (default runs/bench, STEM bench-cpu or bench-gpu) and prints the
markdown table; a run that measured nothing writes nothing, so earlier results there are never replaced by an empty
report. Exit status: 0 when every row was measured (or the GPU bench found no CUDA and measured nothing), 1 when some
rows are errors (an invalid model file, a crashed or timed-out run: the other rows are still measured and reported),
2 when the bench cannot start (no such audio, no valid model file, bad thread list, unknown runtime, an --out that
cannot be written).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from tarq_deploy.bench.cpu import (DEFAULT_OMP_WAIT_POLICY, DEFAULT_RUNS, DEFAULT_THREADS, DEFAULT_TIMEOUT_S, DEFAULT_WARMUP,
                       ORDERS, RUNTIMES, BenchConfig, BenchConfigError, run_cpu_bench)

from ..checks import Output, check_outputs_apart
from ..errors import UserError
from ..values import thread_list
from .options import add_checkpoint, add_out

__all__ = ["bench_inputs", "bench_outputs"]

HELP = "benchmark runtime model files: CPU latency/RTF/max-RSS over a thread ladder, or FP16 vs INT4 on a GPU"
EXAMPLE = """  tarq-deploy bench --model base-f16.bin --model base-q4_0.bin --audio jfk.wav --threads 1,2 -o runs/bench"""
DEFAULT_OUT = "runs/bench"  # never into the committed results/
EXIT_OK, EXIT_ROW_ERRORS, EXIT_ERROR = 0, 1, 2
INHERIT = "inherit"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", action="append", default=[], metavar="FILE",
                        help="model file to measure (repeat for each); with --gpu: the float model source "
                             "(packaged:NAME, a CTranslate2 or transformers directory)")
    parser.add_argument("--audio", action="append", default=[], metavar="WAV",
                        help="16 kHz mono 16-bit WAV, or a built-in clip: 'jfk' (11 s) or 'lecture-30s' (30 s of a "
                             "real lecture) (repeatable; default: jfk)")
    parser.add_argument("--threads", type=thread_list, default=list(DEFAULT_THREADS), metavar="N,N,...",
                        help=f"thread ladder (default {','.join(map(str, DEFAULT_THREADS))}: up to this machine's "
                             f"cores); more threads than cores is measured and marked as oversubscribed")
    runtimes = ", ".join(RUNTIMES)
    parser.add_argument("--runtime", default="whisper.cpp", help=f"CPU runtime: {runtimes}")
    parser.add_argument("--warmup", type=int, default=DEFAULT_WARMUP, help="warm-up runs per cell (not reported "
                                                                            "in the medians)")
    parser.add_argument("--runs", type=int, default=DEFAULT_RUNS, help="timed runs per cell (median, min, max)")
    parser.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S, help="seconds before a run is killed")
    parser.add_argument("--omp-wait-policy", default=DEFAULT_OMP_WAIT_POLICY,
                        help=f"OMP_WAIT_POLICY for the runs (default {DEFAULT_OMP_WAIT_POLICY}: spinning workers "
                             f"distort timings on a shared machine); '{INHERIT}' leaves the environment alone")
    parser.add_argument("--order", choices=ORDERS, default="interleaved",
                        help="interleaved: run i of every cell before run i+1 of any (spreads load drift); grouped: "
                             "all runs of one cell in a row")
    parser.add_argument("--decode", action="append", default=[], metavar="PROFILE|KEY=VALUE",
                        help="decode profile (cli: whisper-cli's defaults, the default; greedy: temperature 0 "
                             "without fallback), or override one runtime decode setting (value parsed as JSON, e.g. "
                             "no_timestamps=true); repeatable")
    add_out(parser, f"output directory (default {DEFAULT_OUT})", default=DEFAULT_OUT)
    parser.add_argument("--name", help="output file stem (default bench-cpu / bench-gpu)")
    parser.add_argument("--no-plot", action="store_true", help="skip the PNG")
    parser.add_argument("--report-only", metavar="RESULT.json", help="re-render the reports of a saved result")
    gpu = parser.add_argument_group("GPU (FP16 transformers vs the INT4 lattice)")
    gpu.add_argument("--gpu", action="store_true", help="run the GPU bench instead (exits 0, measuring nothing, "
                                                        "when no CUDA device is present)")
    add_checkpoint(gpu, "lattice checkpoint for the INT4 rows")
    gpu.add_argument("--kernels", type=lambda s: [k for k in s.split(",") if k],
                     default=["tinygemm", "triton", "marlin"],
                     help="INT4 kernels: tinygemm (torch _weight_int4pack_mm), triton (our W4A16 Triton kernel, "
                          "needs triton), marlin (needs vLLM or GPTQModel)")
    gpu.add_argument("--max-new-tokens", type=int, default=128, help="decoder token limit for the GPU runs")


def decode_profile(values: list[str]) -> str:
    """The one profile name among the --decode values (default cli); two different ones are refused."""
    from ..runtimes.decoding import DECODE_PROFILES, DEFAULT_DECODE_PROFILE

    named = {v for v in values if v in DECODE_PROFILES}
    if len(named) > 1:
        raise BenchConfigError(f"--decode: one profile, got {', '.join(sorted(named))}")
    return named.pop() if named else DEFAULT_DECODE_PROFILE


def decode_overrides(pairs: list[str]) -> dict[str, Any]:
    from ..runtimes.decoding import DECODE_PROFILES

    overrides = {}
    for pair in pairs:
        if pair in DECODE_PROFILES:
            continue
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise BenchConfigError(f"--decode expects KEY=VALUE, got {pair!r}")
        try:
            overrides[key] = json.loads(value)
        except json.JSONDecodeError:
            overrides[key] = value  # a bare string such as language=de
    return overrides


def run(args: argparse.Namespace) -> int:
    from tarq_deploy.bench.bench_report import load_result, markdown_report, write_reports

    from ..checks import probe_writable

    stem = args.name or ("bench-gpu" if args.gpu else "bench-cpu")
    try:
        check_outputs_apart(bench_outputs(args), bench_inputs(args))
        probe_writable("--out", Path(args.out) / f"{stem}.json")
        if args.report_only:
            doc = load_result(args.report_only)
        elif args.gpu:
            doc = _run_gpu(args)
        else:
            doc = run_cpu_bench(_cpu_config(args), log=_log).to_dict()
    except (BenchConfigError, UserError, ValueError, FileNotFoundError) as e:
        print(f"tarq-deploy bench: error: {e}", file=sys.stderr)
        return EXIT_ERROR
    if not args.report_only and not any(c.get("status") == "ok" for c in doc["cells"]):
        print(markdown_report(doc))
        print(f"tarq-deploy bench: nothing was measured, so nothing was written ({args.out} is left as it was)",
              file=sys.stderr)
        return EXIT_OK if doc.get("status") == "skipped" else EXIT_ROW_ERRORS
    written = write_reports(doc, args.out, args.name or f"bench-{doc['kind']}", plot=not args.no_plot)
    print(markdown_report(doc))
    print("wrote " + ", ".join(str(p) for p in written.values()))
    return EXIT_ROW_ERRORS if any(c["status"] == "error" for c in doc["cells"]) else EXIT_OK


REPORT_SUFFIXES = (".json", ".csv", ".md", ".png")


def bench_outputs(args: argparse.Namespace) -> list[Output]:
    """--out is a folder the reports are written into (STEM.json/.csv/.md/.png; STEM from --name, else from the
    result's kind); inputs may lie in it beside them."""
    out = Path(args.out)
    stems = [args.name] if args.name else ["bench-cpu", "bench-gpu"]
    reports = [out / f"{stem}{suffix}" for stem in stems for suffix in REPORT_SUFFIXES]
    if args.report_only:  # re-rendering a saved result in place rewrites it with the document just read from it
        reports = [path for path in reports if not _same_file(path, args.report_only)]
    return [Output("--out", out, whole=False), *(Output("--out", path) for path in reports)]


def _same_file(a: str | Path, b: str | Path) -> bool:
    return Path(a).exists() and Path(b).exists() and Path(a).samefile(b)


def bench_inputs(args: argparse.Namespace) -> list[tuple[str, str | None]]:
    return [*(("--model", m) for m in args.model), *(("--audio", a) for a in args.audio),
            ("--checkpoint", args.checkpoint), ("--report-only", args.report_only)]


def _cpu_config(args: argparse.Namespace) -> BenchConfig:
    return BenchConfig(models=args.model, audios=_audio_paths(args.audio), threads=args.threads,
                       runtime=args.runtime, warmup=args.warmup, runs=args.runs, timeout_s=args.timeout,
                       omp_wait_policy=None if args.omp_wait_policy == INHERIT else args.omp_wait_policy,
                       order=args.order, decode=decode_overrides(args.decode),
                       profile=decode_profile(args.decode))


def _run_gpu(args: argparse.Namespace) -> dict:
    from tarq_deploy.bench.gpu import GpuBenchConfig, run_gpu_bench

    if len(args.model) != 1:
        raise BenchConfigError("--gpu takes exactly one --model (the float model source, e.g. packaged:tiny.en)")
    config = GpuBenchConfig(model=args.model[0], audios=_audio_paths(args.audio), checkpoint=args.checkpoint,
                            kernels=args.kernels, warmup=args.warmup, runs=args.runs,
                            max_new_tokens=args.max_new_tokens)
    return run_gpu_bench(config, log=_log).to_dict()


def _audio_paths(given: list[str]) -> list[str]:
    """Paths of the --audio arguments, with the built-in clip names resolved (fetched into the clips cache)."""
    from tarq_deploy.data.real_clips import jfk_wav_path, lecture_wav_path

    builtin = {"jfk": jfk_wav_path, "lecture-30s": lecture_wav_path}
    return [str(builtin[a]()) if a in builtin and not Path(a).exists() else a for a in given or ["jfk"]]


def _log(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    """Stand-alone entry until cli.py registers the subcommand: ``python -m tarq_deploy.commands.bench ...``."""
    parser = argparse.ArgumentParser(prog="python -m tarq_deploy.commands.bench", description=HELP)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
