"""`tarq-deploy export --target whisper.cpp` (`tarq-deploy verify` checks the file: commands/verify.py).

    tarq-deploy export --target whisper.cpp --checkpoint CHECKPOINT_DIR -o model-q5_1.bin [--type q5_1|...|f16]
    tarq-deploy export --target whisper.cpp --model SOURCE -o model-f16.bin [--type f16]
    tarq-deploy export --target whisper.cpp --model SOURCE --baseline ggml -o model-ggml-q4_0.bin [--type q4_0|...]

Errors name the file and the problem, exit with status 2 and leave no output file behind.
"""
from __future__ import annotations

import argparse
import sys
import time
from typing import Sequence

from .options import add_checkpoint, add_out

__all__ = ["add_export_arguments", "run_export"]

TARGETS = ("whisper.cpp",)
EXIT_OK, EXIT_ERROR = 0, 2
# The converters (and torch behind them) are imported when a command runs, not to build `--help`; these names
# mirror tarq_deploy.formats.whisper_cpp.TARGET_TYPES / BASELINES (tests/test_bad_inputs.py checks that they agree).
WEIGHT_TYPES = ("f16", "q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "q4_k", "q5_k", "q6_k", "q3_k", "q2_k", "iq4_nl",
                "iq4_xs", "iq3_s", "iq3_xxs", "iq2_s", "iq2_xs")
BASELINES = ("rtn",)
# --baseline on the command line: "ggml" (ggml's own quantizer, as `quantize --method ggml`); "rtn", its first
# spelling, is kept as an alias for one release (`quantize --method rtn` means our lattice's nearest codes).
BASELINE_CHOICES = {"ggml": "rtn", "rtn": "rtn"}


def input_errors() -> tuple[type[BaseException], ...]:
    """Errors that name a bad input file or option: reported in one line, exit status 2."""
    from tarq_deploy.formats.ggml_blocks import LatticeNotRepresentable
    from tarq_deploy.formats.model_files import ModelFilesError

    from ..checkpoint import CheckpointError

    return (ModelFilesError, LatticeNotRepresentable, CheckpointError, FileNotFoundError)


# ------------------------------------------------------------------------------------------------------- export
def add_export_arguments(parser: argparse.ArgumentParser, targets: Sequence[str] = TARGETS) -> None:
    """The export options; ``targets`` are the --target choices (the export command adds its other runtimes)."""
    add_checkpoint(parser, "lattice checkpoint directory", positional=True)
    parser.add_argument("--target", choices=targets, default="whisper.cpp", help="runtime file format")
    add_out(parser, "model file to write (replaced atomically; GPU targets: a directory)", required=True,
            aliases=("--output",), dest="output")
    parser.add_argument("--type", choices=WEIGHT_TYPES, dest="weight_type",
                        help="ggml type of the weight matrices (default: the checkpoint's lattice's type, e.g. q5_1; "
                             "f16 for --model; q4_0 for --baseline); a checkpoint exports only to its own type or "
                             "f16: nothing re-quantizes")
    parser.add_argument("--model", metavar="SOURCE",
                        help="export a float model instead of a checkpoint (packaged:NAME, a CTranslate2 or "
                             "transformers directory; see tarq_deploy.formats.model_loader)")
    parser.add_argument("--baseline", choices=tuple(BASELINE_CHOICES), type=_baseline,
                        help="ggml: ggml's own rounding of the float --model (what whisper.cpp's quantize tool "
                             "makes); rtn: the same, its older spelling")
    parser.add_argument("--quiet", action="store_true", help="no progress bars")


def _baseline(text: str) -> str:
    """Both spellings of ggml's rounding; the formats layer knows it as "rtn"."""
    return BASELINE_CHOICES.get(text, text)


def run_export(args: argparse.Namespace, crispasr: bool = False) -> int:
    """Write the whisper.cpp model file; ``crispasr``: for CrispASR's whisper backend, which reads this very file
    (the same bytes; a mix of types is refused naming CrispASR, see formats/crispasr_whisper.py)."""
    from tarq_deploy.formats.crispasr_whisper import build_crispasr_whisper
    from tarq_deploy.formats.whisper_cpp import build_whisper_cpp, default_target, write_whisper_cpp

    from ..fileio import naming_os_errors

    try:
        _check_export_arguments(args)
        started = time.perf_counter()
        source = _export_source(args)
        if crispasr:
            built, target = build_crispasr_whisper(source, args.weight_type, args.baseline, progress=not args.quiet)
        else:
            target = args.weight_type or default_target(source, args.baseline)
            built = build_whisper_cpp(source, target, args.baseline, progress=not args.quiet)
        with naming_os_errors(args.output):  # a full disk names the file it could not write
            out = write_whisper_cpp(built, args.output, progress=not args.quiet)
    except input_errors() as e:
        return _error("export", e)
    what = f"{target} (ggml rounding of the float model)" if args.baseline else target
    kind = ("CrispASR whisper backend (a whisper.cpp .bin: the crispasr wheel reads no Whisper GGUF)" if crispasr
            else "whisper.cpp")
    print(f"wrote {out}: {kind} {what}, {len(built.tensors)} tensors, {out.stat().st_size / 1e6:.1f} MB "
          f"in {time.perf_counter() - started:.1f} s")
    return EXIT_OK


def _check_export_arguments(args: argparse.Namespace) -> None:
    from tarq_deploy.formats.whisper_cpp import WhisperExportError

    if (args.checkpoint is None) == (args.model is None):
        raise WhisperExportError("give either CHECKPOINT_DIR or --model SOURCE (exactly one)")
    if args.baseline and args.model is None:
        raise WhisperExportError(f"--baseline {args.baseline} rounds a float model: give it with --model SOURCE")
    if args.model and not args.baseline and args.weight_type not in (None, "f16"):
        raise WhisperExportError(f"--type {args.weight_type} from a float model needs --baseline ggml (ggml's own "
                                 f"rounding); a lattice is exported from its checkpoint directory")


def _export_source(args: argparse.Namespace):
    from tarq_deploy.formats.whisper_cpp import WhisperExportError, as_source, model_source

    if args.checkpoint is not None:
        return as_source(args.checkpoint)
    from ..formats.model_loader import load_whisper

    try:
        model, processor, _ = load_whisper(args.model)
    except (ValueError, OSError) as e:
        raise WhisperExportError(f"--model {args.model}: cannot load it ({e})") from None
    return model_source(model, processor, origin=args.model)


def _error(command: str, e: BaseException) -> int:
    print(f"tarq-deploy {command}: error: {e}", file=sys.stderr)
    return EXIT_ERROR
