"""A lattice checkpoint made of two others of the same model and lattice: every quantized weight from BODY except
the ones whose name matches --take, which come from DONOR (codes and scales as they are: nothing is re-quantized).
The causal check of results/iq4_xs: ggml's and TARQ's IQ4_XS files with their token embedding / head exchanged,
still one-type IQ4_XS files that stock whisper.cpp loads.

    python results/iq4_xs/splice.py BODY DONOR --take '^proj_out\\.' -o OUT
"""
from __future__ import annotations

import argparse
import re
import sys
from dataclasses import replace

from tarq_deploy.checkpoint import LatticeWeights, load_checkpoint, save_checkpoint


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("body")
    parser.add_argument("donor")
    parser.add_argument("--take", required=True, help="regular expression of the weight names DONOR gives")
    parser.add_argument("-o", "--out", required=True)
    args = parser.parse_args(argv)
    body, donor = load_checkpoint(args.body), load_checkpoint(args.donor)
    if body.spec != donor.spec or set(body.quantized) != set(donor.quantized):
        print(f"splice: {args.body} and {args.donor} hold different lattices or weights", file=sys.stderr)
        return 2
    taken = [name for name in body.quantized if re.search(args.take, name)]
    if not taken:
        print(f"splice: --take {args.take!r} matches no quantized weight", file=sys.stderr)
        return 2
    weights = LatticeWeights({name: (donor if name in taken else body).quantized[name] for name in body.quantized})
    metadata = {**body.metadata, "spliced": {"body": args.body, "donor": args.donor, "taken": taken}}
    save_checkpoint(replace(body, quantized=weights, metadata=metadata, digests=None), args.out)
    print(f"{args.out}: {len(taken)} weight(s) from {args.donor}: {', '.join(taken)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
