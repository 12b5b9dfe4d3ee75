"""`tarq-deploy types`: every weight type a lattice can be made for, with its size and the targets that write it.

Bits per weight come from ggml's block layouts (gguf-py's GGML_QUANT_SIZES: bytes per block of weights), the lattice
from quant/choices.py, the targets from the writers' own type tables, so the list cannot drift from what export does.
Which type to ship for which goal is measured in results/types and results/frontier (README's table).
"""

from __future__ import annotations

import argparse
import json

from .options import add_out

HELP = "list the weight types: bits per weight, block, lattice, and the export targets and runtimes that load each"
EXAMPLE = """  tarq-deploy types
  tarq-deploy types --json -o types.json"""

# Runtimes behind each export target (what loads the file the target writes).
TARGET_RUNTIMES = {"whisper.cpp": "whisper.cpp, CrispASR (its whisper backend reads the same .bin, one type per file)",
                   "qwen3-asr.cpp": "qwen3-asr.cpp (with our loader patch)", "crispasr": "CrispASR (GGUF backends)",
                   "gptq": "transformers/vLLM (GPTQ, Marlin at load)", "compressed-tensors": "vLLM",
                   "marlin": "vLLM (pre-packed Marlin)",
                   "transcribe.cpp": "transcribe.cpp (Whisper, Qwen3-ASR, Voxtral GGUF, a type per tensor)"}
GPU_TARGETS = ("gptq", "compressed-tensors", "marlin")
GPU_BITS = 4  # the GPU targets hold symmetric 4-bit lattices (groups 32, 64, 128)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print the table as JSON")
    add_out(parser, "also write the table as JSON to this file")


def type_rows() -> list[dict]:
    """One row per type, smallest bits per weight first."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    from ..formats.qwen3_asr_gguf import TARGET_TYPES as GGUF_TYPES
    from ..formats.transcribe_whisper import TARGET_TYPES as TRANSCRIBE_TYPES
    from ..formats.whisper_cpp import TARGET_TYPES as BIN_TYPES
    from ..quant.choices import GGML_TYPES, GGUF_TARGETS

    rows = []
    for name in ("f16", *GGML_TYPES):
        block, size = GGML_QUANT_SIZES[GGMLQuantizationType[name.upper()]]
        scheme, bits, group = GGML_TYPES.get(name, ("float", 16, 1))
        # every GGUF target writes the GGUF types, but transcribe.cpp's loader takes fewer
        tables = {"whisper.cpp": BIN_TYPES, **dict.fromkeys(GGUF_TARGETS, GGUF_TYPES),
                  "transcribe.cpp": TRANSCRIBE_TYPES}
        targets = [t for t, table in tables.items() if name in table]
        if scheme == "symmetric" and bits == GPU_BITS:
            targets += list(GPU_TARGETS)
        rows.append({"type": name, "bits_per_weight": round(8 * size / block, 4), "block": block,
                     "lattice": "none (float)" if name == "f16" else f"{bits}-bit {scheme}, groups of {group}",
                     "targets": targets, "runtimes": [TARGET_RUNTIMES[t] for t in targets]})
    return sorted(rows, key=lambda row: row["bits_per_weight"])


def run(args: argparse.Namespace) -> int:
    from ..fileio import write_json_atomic

    rows = type_rows()
    if args.out:
        write_json_atomic(args.out, {"types": rows}, indent=1)
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    print(f"{'type':<8} {'bits/weight':>11} {'block':>6}  {'lattice':<32} targets")
    for row in rows:
        print(f"{row['type']:<8} {row['bits_per_weight']:>11.4g} {row['block']:>6}  {row['lattice']:<32} "
              f"{', '.join(row['targets'])}")
    print("\nruntimes per target: " + "; ".join(f"{t}: {r}" for t, r in TARGET_RUNTIMES.items()))
    print("which to ship: README.md ('Which file to ship'), measured in results/types and results/frontier")
    return 0
