"""`tarq-deploy sweep SWEEP.toml`: models × calibration corpora × methods × types, every step a Ray task.

    tarq-deploy sweep sweeps/tiny.toml --out runs/tiny                 # an embedded single-node Ray
    tarq-deploy sweep sweeps/tiny.toml --out runs/tiny --address auto  # the Ray cluster this machine belongs to
    tarq-deploy sweep sweeps/tiny.toml --out runs/tiny --plan          # the cells and their keys, nothing run

Steps are content-addressed by their inputs (tarq_deploy/sweep/plan.py), so a re-run skips what is finished and an
interrupted sweep resumes. A failed cell is reported with its error and the others carry on; the exit status is 1
when any cell failed, 0 otherwise. OUT gets report.md, report.json, size-quality.png, cells.log.jsonl (one line per
step event: start, done, failed, cached) and steps/ (every step's outputs and log).
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from .options import add_out

HELP = "run a grid of models × corpora × methods × types (quantize, export, verify, eval, bench) on Ray"
EXAMPLE = """  tarq-deploy sweep results/types/sweep.toml --plan -o runs/types
  tarq-deploy sweep results/types/sweep.toml -o runs/types"""
EXIT_OK, EXIT_CELLS_FAILED = 0, 1


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("sweep_file", metavar="SWEEP.toml", help="the sweep (see tarq_deploy/sweep/plan.py)")
    add_out(p, "output folder (shared by every node on a cluster); re-use it to resume", required=True)
    p.add_argument("--address", help="an existing Ray cluster ('auto', or ray://HOST:10001); default: start an "
                                     "embedded single-node Ray")
    p.add_argument("--cpus", type=int, help="embedded Ray: CPUs it may use (default: all)")
    p.add_argument("--calibration-cpus", type=int, default=1,
                   help="CPUs each calibration task holds (and its torch threads) when calibrating on CPU")
    p.add_argument("--plan", action="store_true", help="print the cells and step keys, run nothing")
    p.add_argument("--quiet", action="store_true", help="no progress bars")


def run(args: argparse.Namespace) -> int:
    from ..checks import check_outputs_apart, probe_writable
    from ..errors import UserError
    from ..fileio import exclusive_writer
    from ..sweep.driver import LOCK, plan, run_sweep, sweep_inputs, sweep_outputs
    from ..sweep.plan import load_sweep
    from ..sweep.report import write_sweep_report

    sweep = load_sweep(args.sweep_file)
    if args.cpus is not None and args.cpus < 1 or args.calibration_cpus < 1:
        raise UserError("--cpus and --calibration-cpus must be at least 1")
    out = Path(args.out)
    check_outputs_apart(sweep_outputs(out), sweep_inputs(sweep))
    if args.plan:
        cells, steps = plan(sweep)
        for cell in cells:
            print(json.dumps({"cell": cell.name, "steps": {k: v[:16] for k, v in cell.steps.items()}}))
        return EXIT_OK
    probe_writable("--out", out / "report.json")
    # One sweep at a time into OUT (every node's steps and the report land there); a second is refused at once.
    with exclusive_writer(out / LOCK, "--out", out):
        result = run_sweep(sweep, out, args.address, args.cpus, args.calibration_cpus, not args.quiet)
        written = write_sweep_report(sweep, result, out)
    print(written["md"].read_text(encoding="utf-8"))
    print("wrote " + ", ".join(str(p) for p in written.values()))
    failed = any(r.status in ("failed", "skipped") for r in result.results.values())
    return EXIT_CELLS_FAILED if failed else EXIT_OK
