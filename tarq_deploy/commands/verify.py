"""`tarq-deploy verify MODEL.bin --against CHECKPOINT_DIR`: prove an exported file holds the lattice exactly."""

from __future__ import annotations

import argparse

from . import export_whispercpp

HELP = export_whispercpp.VERIFY_HELP


def add_arguments(parser: argparse.ArgumentParser) -> None:
    export_whispercpp.add_verify_arguments(parser)


def run(args: argparse.Namespace) -> int:
    return export_whispercpp.run_verify(args)
