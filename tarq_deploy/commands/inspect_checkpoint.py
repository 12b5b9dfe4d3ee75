"""`tarq-deploy inspect CHECKPOINT`: validate a lattice checkpoint and summarise what it holds."""

from __future__ import annotations

import argparse
import json

from .options import add_checkpoint, add_out, require

HELP = ("validate a lattice checkpoint (sha256 and xxh3 digests, code ranges, scales) and print its lattice, method "
        "and per-layer figures")
EXAMPLE = """  tarq-deploy inspect --checkpoint base-q4_0
  tarq-deploy inspect --checkpoint base-q4_0 --json -o base-q4_0.summary.json"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_checkpoint(parser, "lattice checkpoint directory", positional=True)
    parser.add_argument("--json", action="store_true", help="print the summary as JSON")
    add_out(parser, "also write the summary as JSON to this file")


def summarise(checkpoint_dir: str) -> dict:
    from ..checkpoint import ggml_type_name, load_checkpoint

    ckpt = load_checkpoint(checkpoint_dir, sha256=True)  # both digests; decoding below checks every lattice
    n_weights = sum(q.codes.numel() for q in ckpt.quantized.values())
    return {
        "checkpoint": checkpoint_dir,
        "bits": ckpt.spec.bits,
        "group_size": ckpt.spec.group_size,
        "scheme": ckpt.spec.scheme,
        "ggml_type": ggml_type_name(ckpt.spec),
        "overrides": {name: ggml_type_name(q.spec) or f"{q.spec.bits}-bit {q.spec.scheme}"
                      for name, q in sorted(ckpt.quantized.items()) if q.spec != ckpt.spec},
        "quantized_matrices": len(ckpt.quantized),
        "quantized_weights": n_weights,
        "untouched_tensors": len(ckpt.tensors),
        "aliases": ckpt.aliases,
        "method": ckpt.metadata.get("method"),
        "source_model": ckpt.metadata.get("source_model"),
        "layers": ckpt.metadata.get("layers", []),
    }


def run(args: argparse.Namespace) -> int:
    from ..fileio import write_json_atomic

    summary = summarise(require(args, "checkpoint", "--checkpoint (or CHECKPOINT_DIR)"))
    if args.out:
        write_json_atomic(args.out, summary)
    if args.json:
        print(json.dumps(summary, indent=2))
        return 0
    kind = f" ({summary['ggml_type']})" if summary["ggml_type"] else ""
    mix = f", {len(summary['overrides'])} on other types" if summary["overrides"] else ""
    print(f"{summary['checkpoint']}: {summary['bits']}-bit {summary['scheme']} lattice{kind}, group "
          f"{summary['group_size']}, {summary['quantized_matrices']} matrices{mix} ({summary['quantized_weights']:,} "
          f"weights), {summary['untouched_tensors']} untouched tensors; all files match their hashes")
    for name, type_name in summary["overrides"].items():
        print(f"  {name}: {type_name}")
    if summary["method"]:
        print(f"method: {json.dumps(summary['method'], sort_keys=True)}")
    for row in summary["layers"]:
        lam = "-" if row.get("lam") is None else f"{row['lam']:.2f}"
        alpha = "-" if row.get("alpha") is None else f"{row['alpha']:+.3f}"
        p = "-" if row.get("p") is None else f"{row['p']:.3f}"
        print(f"  {row['name']:<55} lam {lam:>7}  alpha {alpha:>7}  p {p:>6}")
    return 0
