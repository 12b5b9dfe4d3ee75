"""`tarq-deploy verify MODEL --against CHECKPOINT_DIR`: prove an exported file holds the lattice exactly.

MODEL is a whisper.cpp model file or a Qwen3-ASR GGUF (qwen3-asr.cpp or CrispASR flavour), told apart by its magic.
"""

from __future__ import annotations

import argparse
import json

from . import export_whispercpp

HELP = "decode every tensor of a whisper.cpp or Qwen3-ASR GGUF file and compare it with a lattice checkpoint's values"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    export_whispercpp.add_verify_arguments(parser)


def run(args: argparse.Namespace) -> int:
    from tarq_deploy.formats.gguf_common import is_gguf_file

    if is_gguf_file(args.model_file):
        return _run_gguf_verify(args)
    return export_whispercpp.run_verify(args)


def _run_gguf_verify(args: argparse.Namespace) -> int:
    from tarq_deploy.formats.gguf_common import GGUFExportError, GGUFFileError, GGUFVerifyError, read_gguf, verify_gguf

    try:
        diffs = verify_gguf(args.model_file, args.against)
        tensors = read_gguf(args.model_file).tensors
    except (GGUFFileError, GGUFVerifyError, GGUFExportError, *export_whispercpp.input_errors()) as e:
        return export_whispercpp._error("verify", e)
    if args.json:
        print(json.dumps(diffs, indent=2))
    else:
        export_whispercpp._print_diffs(diffs, tensors)
    differing = {name: d for name, d in diffs.items() if d != 0.0}
    if differing:
        worst = max(differing, key=differing.get)
        print(f"MISMATCH: {len(differing)} of {len(diffs)} arrays differ from {args.against} "
              f"(largest max|diff| {differing[worst]:.3g} in {worst})")
        return export_whispercpp.EXIT_MISMATCH
    print(f"OK: all {len(diffs)} arrays of {args.model_file} equal {args.against}'s exact values (max|diff| = 0)")
    return export_whispercpp.EXIT_OK
