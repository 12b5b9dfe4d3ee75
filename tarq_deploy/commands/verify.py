"""`tarq-deploy verify MODEL --against CHECKPOINT_DIR`: prove an exported file holds the lattice exactly.

MODEL is a whisper.cpp model file or a Qwen3-ASR GGUF (qwen3-asr.cpp or CrispASR flavour), told apart by its magic
(tarq_deploy.formats.verification). Errors name the file and the problem and exit with status 2; verify exits 1
when any array differs from the checkpoint.
"""

from __future__ import annotations

import argparse
import json
import sys

from .options import add_checkpoint, add_out

__all__ = ["add_arguments", "run"]

HELP = "decode every tensor of a whisper.cpp or Qwen3-ASR GGUF file and compare it with a lattice checkpoint's values"
EXAMPLE = """  tarq-deploy verify base-q4_0.bin --checkpoint base-q4_0
  tarq-deploy verify base-q4_0.bin --checkpoint base-q4_0 -o base-q4_0.verify.json"""
EXIT_OK, EXIT_MISMATCH, EXIT_ERROR = 0, 1, 2


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model_file", metavar="MODEL.bin", help="whisper.cpp model file")
    add_checkpoint(parser, "lattice checkpoint directory", aliases=("--against",), required=True)
    parser.add_argument("--json", action="store_true", help="print {array: max |diff|} as JSON")
    add_out(parser, "also write {array: max |diff|} and the verdict as JSON to this file")


def run(args: argparse.Namespace) -> int:
    from tarq_deploy.formats.verification import VERIFY_ERRORS, verify_model_file

    try:
        result = verify_model_file(args.model_file, args.checkpoint)
    except VERIFY_ERRORS as e:
        print(f"tarq-deploy verify: error: {e}", file=sys.stderr)
        return EXIT_ERROR
    if args.out:
        from ..fileio import write_json_atomic

        write_json_atomic(args.out, {"model_file": args.model_file, "checkpoint": args.checkpoint,
                                     "exact": result.worst is None, "max_abs_diff": result.diffs})
    if args.json:
        print(json.dumps(result.diffs, indent=2))
    else:
        _print_diffs(result.diffs, result.types)
    worst = result.worst
    if worst is not None:
        print(f"MISMATCH: {len(result.differing)} of {len(result.diffs)} arrays differ from {args.checkpoint} "
              f"(largest max|diff| {result.diffs[worst]:.3g} in {worst})")
        return EXIT_MISMATCH
    print(f"OK: all {len(result.diffs)} arrays of {args.model_file} equal {args.checkpoint}'s exact values "
          f"(max|diff| = 0)")
    return EXIT_OK


def _print_diffs(diffs: dict[str, float], types: dict[str, str]) -> None:
    print(f"{'max|diff|':>10}  {'type':<5} array")
    for name, diff in diffs.items():
        print(f"{diff:>10.3g}  {types[name]:<5} {name}")
