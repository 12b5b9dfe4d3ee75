"""The `tarq-deploy` command line: one subcommand per step of the flow (calibrate, export, check, measure, publish)."""

from __future__ import annotations

import os

__all__ = ["main"]

# Must precede the OpenMP runtime start (torch import): busy-waiting threads make small ops crawl on a shared CPU.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse
import errno
import gc
import importlib
import re
import sys
import tempfile
import time
import traceback
from pathlib import Path
from types import ModuleType
from typing import NoReturn

from . import __version__
from .commands.options import EXIT_BUG, EXIT_INTERRUPTED, EXIT_USER_ERROR, merge_spellings

# subcommand -> module under tarq_deploy.commands; each module has HELP, EXAMPLE (shown at the end of its --help),
# add_arguments(parser) and run(args).
# Building the parser imports every one of them: their top level and add_arguments import nothing heavy (no torch,
# no transformers), so that `tarq-deploy --help` answers at once; run() imports what the command needs.
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
    "sweep": "sweep",
    "types": "types",
}

# Exceptions that describe bad input, by class (module.qualname, matched through the MRO so that the modules defining
# them need not be imported to recognise them): each message names the file or option and the problem.
USER_ERROR_CLASSES = frozenset({
    "tarq_deploy.errors.UserError",
    "tarq_deploy.checkpoint.CheckpointError",
    "tarq_deploy.data.corpus.CorpusError",
    "tarq_deploy.data.terms.TermsError",
    "tarq_deploy.models.packaged.PackagedModelError",
    "tarq_deploy.data.real_clips.RealClipError",
    "tarq_deploy.data.synth.SynthError",
    "tarq_deploy.runtimes.base.BackendError",
    "tarq_deploy.quant.ggml_quants.GgmlUnavailable",
    "tarq_deploy.formats.model_files.ModelFilesError",
    "tarq_deploy.formats.ggml_file.GGMLFileError",
    "tarq_deploy.formats.ggml_tensors.VerifyError",
    "tarq_deploy.formats.ggml_blocks.LatticeNotRepresentable",
    "tarq_deploy.formats.int4_checkpoint.ExportError",
    "tarq_deploy.bench.cpu.BenchConfigError",
})
# OSErrors the user's machine causes (a full, read-only or missing place to write): a message, not a traceback.
USER_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM, errno.EISDIR,
                         errno.ENOTDIR, errno.ENOENT, errno.EEXIST, errno.ENOTEMPTY, errno.EFBIG, errno.ENAMETOOLONG,
                         errno.ELOOP, errno.EIO})
OUR_PACKAGES = ("tarq_deploy",)
REPORT_BUG = ("this is a bug in tarq-deploy, not in your input: please report it with the command line and the "
              "traceback in {path}")
EXIT_STATUSES = """exit status: 0 done; 1 a check failed (verify mismatch, a failed bench row or sweep cell);
  2 bad input (one line naming the file or option; nothing written); 3 an internal error (its traceback's file
  is named)"""


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Shows each option's default, unless its help already says it or there is none to show (None, a flag); the
    example epilogue keeps its lines as written."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if action.default in (None, [], ()) or action.default is argparse.SUPPRESS or action.nargs == 0 \
                or _STATES_DEFAULT.search(text):
            return text
        return super()._get_help_string(action)


# Help text that already states its default: "(default 4,8,16)", "default: x", "...; default 32 for ggml targets".
_STATES_DEFAULT = re.compile(r"\(default\b|\bdefault:|;\s*default\b|%\(default\)", re.IGNORECASE)


class Parser(argparse.ArgumentParser):
    """A bad option is one line naming it, exit 2 (argparse's own error prints its usage block first)."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USER_ERROR, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _command_module(name: str) -> ModuleType:
    return importlib.import_module(f"tarq_deploy.commands.{COMMANDS[name]}")


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="tarq-deploy",
        description="Tail-aware 4-bit quantization (TARQ) of speech recognisers, exported bit-exactly to the runtimes "
                    "people deploy.",
    )
    parser.add_argument("--version", action="version", version=f"tarq-deploy {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMANDS:
        module = _command_module(name)
        command = sub.add_parser(name, help=module.HELP, description=module.HELP, formatter_class=HelpFormatter,
                                 epilog=f"example:\n{module.EXAMPLE.rstrip()}\n\n{EXIT_STATUSES}")
        module.add_arguments(command)
        _show_defaults(command)
    return parser


def _show_defaults(parser: argparse.ArgumentParser) -> None:
    """HelpFormatter for a command's own sub-commands too (corpus synth, corpus real)."""
    parser.formatter_class = HelpFormatter
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for child in action.choices.values():
                _show_defaults(child)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    try:
        merge_spellings(args)
        return _command_module(args.command).run(args)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except Exception as e:  # noqa: BLE001 -- the one place that decides between a message and a traceback
        message = user_error_message(e)
        if message is None:
            traceback.print_exc()
            path = save_traceback(args.command)
            print(f"tarq-deploy {args.command}: {REPORT_BUG.format(path=path)}", file=sys.stderr)
            return EXIT_BUG
        print(f"tarq-deploy {args.command}: error: {message}", file=sys.stderr)
        return EXIT_USER_ERROR


def save_traceback(command: str) -> Path:
    """The traceback being handled, with the command line, in a file of the temporary folder (its path goes into
    the bug message: a report can attach it whole, not what a terminal kept)."""
    text = f"tarq-deploy {__version__}: {' '.join(sys.argv)}\n{traceback.format_exc()}"
    with tempfile.NamedTemporaryFile("w", prefix=f"tarq-deploy-{command}-{time.strftime('%Y%m%dT%H%M%S')}-",
                                     suffix=".txt", delete=False) as handle:
        handle.write(text)
    return Path(handle.name)


def user_error_message(e: BaseException) -> str | None:
    """One line naming the file or option and the problem when ``e`` is the user's (bad input, a full or read-only
    disk, a missing optional package); None when it is our own bug."""
    names = {f"{c.__module__}.{c.__qualname__}" for c in type(e).__mro__}
    if names & USER_ERROR_CLASSES:
        return _one_line(str(e))
    if isinstance(e, OSError) and e.errno in USER_ERRNOS:
        return _one_line(_os_error_text(e))
    if isinstance(e, ModuleNotFoundError) and e.name and e.name.split(".")[0] not in OUR_PACKAGES:
        return (f"this needs the Python package {e.name.split('.')[0]!r}, which is not installed "
                f"(pip install it, or install tarq-deploy with its extras: pip install 'tarq-deploy[models]')")
    return None


def _os_error_text(e: OSError) -> str:
    problem = e.strerror or str(e)
    if e.filename is None:
        return problem
    if e.filename2 is not None:
        return f"{e.filename} -> {e.filename2}: {problem}"
    return f"{e.filename}: {problem}"


def _one_line(text: str) -> str:
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return "; ".join(lines) if lines else "(no message)"


def console_main() -> int:
    """``main`` for a process of its own (the ``tarq-deploy`` command, ``python -m tarq_deploy.cli``). Before the
    interpreter ends, every live object is frozen out of the garbage collector: its last collection at shutdown
    walked all of them (torch's and transformers' modules, a calibration's tensors) for about a second of every
    command (0.96 -> 0.17 s after a quantize's imports, 2-core EPYC). Nothing is skipped: atexit handlers run and
    objects are still released. Not for in-process callers (tests): frozen objects are never collected again."""
    try:
        return main()
    finally:
        gc.freeze()


if __name__ == "__main__":
    sys.exit(console_main())
