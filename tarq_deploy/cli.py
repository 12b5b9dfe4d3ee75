"""The `tarq-deploy` command line: one subcommand per step of the flow (calibrate, export, check, measure, publish)."""

from __future__ import annotations

import os

# Must precede the OpenMP runtime start (torch import): busy-waiting threads make small ops crawl on a shared CPU.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse
import importlib
import sys
from types import ModuleType

from . import __version__
from .errors import UserError

# subcommand -> module under tarq_deploy.commands; each module has HELP, add_arguments(parser) and run(args).
COMMANDS: dict[str, str] = {
    "quantize": "quantize",
    "export": "export",
    "verify": "verify",
    "bench": "bench",
    "eval": "eval",
    "corpus": "corpus",
    "inspect": "inspect_checkpoint",
    "publish": "publish",
    "demo": "demo",
}


def _command_module(name: str) -> ModuleType:
    return importlib.import_module(f"tarq_deploy.commands.{COMMANDS[name]}")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tarq-deploy",
        description="Tail-aware 4-bit quantization (TARQ) of speech recognisers, exported bit-exactly to the runtimes "
                    "people deploy.",
    )
    parser.add_argument("--version", action="version", version=f"tarq-deploy {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMANDS:
        module = _command_module(name)
        module.add_arguments(sub.add_parser(name, help=module.HELP, description=module.HELP))
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    try:
        return _command_module(args.command).run(args)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except _user_errors() as e:
        print(f"tarq-deploy {args.command}: error: {e}", file=sys.stderr)
        return 2


def _user_errors() -> tuple[type[BaseException], ...]:
    """Errors that describe bad input (they name the file and the problem): no traceback for these."""
    from .checkpoint import CheckpointError

    errors: list[type[BaseException]] = [UserError, CheckpointError, FileNotFoundError]
    try:
        from .data.corpus import CorpusError
        errors.append(CorpusError)
    except ImportError:
        pass
    return tuple(errors)


if __name__ == "__main__":
    sys.exit(main())
