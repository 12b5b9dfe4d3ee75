"""`tarq-deploy quantize`: calibrate a model on a corpus and write a lattice checkpoint.

parse -> resolve the source once -> build and validate the options (calibration/options.py, the one schema) -> run.
Everything the user gave is checked before the model is loaded or any calibration starts; what needs the loaded
model (widths, finite weights, an importance file's tensors) is checked before anything is written."""

from __future__ import annotations

import argparse
from dataclasses import replace
from pathlib import Path
from typing import Sequence

from ..calibration.options import Importance, QuantizeArguments, QuantizeOptions, add_quantize_arguments
from ..errors import UserError
from ..model_source import PACKAGED_PREFIX, ModelSource, SourceKind, resolve_source
from ..quant.presets import PRESETS
from .options import add_out

__all__ = ["HELP", "EXAMPLE", "add_arguments", "run", "check_model_source", "checked_outputs", "output_paths",
           "lock_path", "SUPPORTED_MODEL_TYPES"]

HELP = "calibrate a model (RTN, GPTQ, rareBAL, residual or TARQ) and write a lattice checkpoint"
EXAMPLE = """  tarq-deploy corpus real -o clips
  tarq-deploy quantize --model packaged:base --calib clips/eval.jsonl --method tarq --type q4_0 -o base-q4_0"""
SUPPORTED_MODEL_TYPES = ("whisper", "voxtral", "qwen3_asr")


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_quantize_arguments(p)
    add_out(p, "checkpoint directory to write (a new path, or an earlier checkpoint to replace); OUT.partial/ holds "
               "resumable work, OUT.log.json the log", required=True)


def run(args: argparse.Namespace) -> int:
    from ..calibration.pipeline import quantize_backbone, quantize_with_lookup_pass
    from ..checkpoint import save_checkpoint
    from ..data.corpus import load_corpus
    from ..fileio import exclusive_writer, write_json_atomic

    arguments = QuantizeArguments.from_values(vars(args))
    source = check_model_source(arguments.model)  # the one resolution: handed down from here
    options = QuantizeOptions.build(arguments, source).check_machine()
    out, work, log_path = checked_outputs(args.out, arguments.inputs())
    saved_imatrix = checked_imatrix_output(arguments, out, work, log_path)
    importance = read_importance(arguments.imatrix) if arguments.imatrix else None
    if arguments.threads:
        import torch

        torch.set_num_threads(arguments.threads)  # before any torch work: the machine record below reports it
    # One run at a time into OUT: a second one would share OUT.partial's blocks and replace OUT under the first.
    with exclusive_writer(lock_path(work), "--out", out):
        utterances = []
        if options.needs_corpus:
            utterances = load_corpus(arguments.calib, arguments.audio_column, arguments.text_column)
            if not utterances:
                raise UserError(f"--calib {arguments.calib}: holds no utterances; method {options.method!r} cannot "
                                f"calibrate from nothing (use --method rtn for data-free rounding)")
            options = options.for_corpus(utterances)
        backbone, options = load_checked_backbone(options, importance)
        sink = {} if saved_imatrix else None
        if options.lookup_pass:  # two calibrations, each of a freshly loaded model (the first: this one)
            pending = [backbone]
            del backbone

            def fresh_backbone():
                return pending.pop() if pending else load_checked_backbone(options)[0]

            checkpoint, timing = quantize_with_lookup_pass(fresh_backbone, utterances, options, arguments.model, work)
        else:
            checkpoint, timing = quantize_backbone(backbone, utterances, options, arguments.model, work,
                                                   importance=importance, importance_sink=sink)
        save_checkpoint(checkpoint, out)
        if saved_imatrix:
            save_importance(sink, checkpoint.metadata["calibration"], arguments.calib, saved_imatrix)
        absent = {"terms_absent": list(options.terms_absent)} if options.terms is not None else {}
        write_json_atomic(log_path, {"options": options.result_knobs(), "device": options.device, **absent, **timing,
                                     "layers_full": checkpoint.metadata["layers"]}, indent=1)
        _remove_work_dir(work)
    print(f"wrote {out} ({len(checkpoint.quantized)} lattice matrices, {options.bits}-bit, group "
          f"{options.group_size}, method {options.method}); per-layer log {log_path}")
    return 0


def check_model_source(source: str) -> ModelSource:
    """--model resolved, once, for everything that follows: a packaged name that exists, a local path that exists
    and holds a supported model type (a whisper.cpp file: a float one), or a hub id."""
    from ..models.packaged import PACKAGED_MODELS

    found = resolve_source(source)
    if found.kind is SourceKind.PACKAGED:
        if found.packaged_name not in PACKAGED_MODELS:
            known = ", ".join(PACKAGED_PREFIX + name for name in PACKAGED_MODELS)
            raise UserError(f"--model {source}: unknown packaged model; available: {known}")
        return found
    if found.kind is SourceKind.MISSING:
        raise UserError(f"--model {source}: no such file or directory")
    if found.kind is SourceKind.WHISPER_CPP:  # a quantized or damaged .bin is refused before the corpus is read
        from ..formats.whisper_cpp_model import read_float_whisper_cpp

        read_float_whisper_cpp(found.path)
    if found.on_disk:
        if found.config_error is not None:
            raise UserError(f"--model {found.config_error}")
        if found.assumed_model_type not in SUPPORTED_MODEL_TYPES:
            raise UserError(f"--model {source}: model type {found.assumed_model_type!r} is not supported "
                            f"({', '.join(SUPPORTED_MODEL_TYPES)})")
    return found


def load_checked_backbone(options: QuantizeOptions, importance: Importance | None = None):
    """The backbone adapter of the options' model (resolved once, by check_model_source) and the options with a
    preset resolved by its shapes; the rules that need the weights checked (QuantizeOptions.check_backbone)."""
    from ..formats.backbones import load_backbone
    from ..models.packaged import PackagedModelError

    try:
        backbone = load_backbone(options.model, options.device, options.head_identity_weight,
                                 options.arguments.quantize_audio_tower)
    except (ValueError, OSError, PackagedModelError) as e:
        raise UserError(f"--model {options.model.text}: cannot load it ({e})") from None
    options = with_preset_types(options, backbone)
    options.check_backbone(backbone, importance)
    return backbone, options


def with_preset_types(options: QuantizeOptions, backbone) -> QuantizeOptions:
    """The options with a preset resolved into per-tensor types by the loaded model's shapes (a row that a K-quant
    block does not divide falls back to q8_0, as transcribe.cpp's own quantizer does)."""
    from ..formats.transcribe_whisper import preset_tensor_types

    if options.preset is None:
        return options
    try:
        types = preset_tensor_types(PRESETS[options.preset], backbone.model.config.to_dict())
    except ValueError as e:
        raise UserError(f"--tensor-type {options.preset}: {e}") from None
    return replace(options, tensor_types=types)


def checked_imatrix_output(arguments: QuantizeArguments, out: Path, work: Path, log: Path) -> Path | None:
    """--save-imatrix's file: writable, and none of quantize's inputs or other outputs."""
    from ..checks import Output, check_output_file, check_outputs_apart

    if not arguments.save_imatrix:
        return None
    check_outputs_apart([Output("--save-imatrix", arguments.save_imatrix)],
                        [*arguments.inputs(), ("--out", str(out)), ("--out", str(work)), ("--out", str(log))])
    return check_output_file("--save-imatrix", arguments.save_imatrix)


def read_importance(path: str) -> Importance:
    """The importance matrix of an imatrix GGUF, as the calibration's ready-made statistics."""
    import torch

    from ..formats.imatrix_gguf import read_imatrix

    imatrix = read_imatrix(path)
    vectors = {name: torch.from_numpy(imatrix.importance(name)) for name in imatrix.sums}
    return Importance(vectors, {"file": path, "datasets": imatrix.datasets, "chunk_count": imatrix.chunk_count})


def save_importance(sink: dict, calibration: dict, calib: str, path: Path) -> None:
    """What the imatrix run gathered, as llama.cpp's imatrix GGUF (chunks: our calibration windows)."""
    from ..formats.imatrix_gguf import Imatrix, write_imatrix

    imatrix = Imatrix(datasets=[calib], chunk_count=int(calibration.get("windows", 0)))
    for name, (sums, count) in sorted(sink.items()):
        imatrix.add(name, sums.numpy(), count)
    write_imatrix(imatrix, path)


def output_paths(out_arg: str) -> tuple[Path, Path, Path]:
    """OUT, its work directory OUT.partial and its log OUT.log.json."""
    out = Path(out_arg)
    return out, out.with_name(out.name + ".partial"), out.with_name(out.name + ".log.json")


def lock_path(work: Path) -> Path:
    """The lock of OUT.partial: beside it, not in it, since the folder is removed at the end while the lock is held."""
    return work.with_name(work.name + ".lock")


def checked_outputs(out_arg: str, inputs: Sequence[tuple[str, str | None]] = ()) -> tuple[Path, Path, Path]:
    """OUT (a new path, an empty directory or an earlier checkpoint), OUT.partial and OUT.log.json, all writable,
    none of them over one of ``inputs`` ((option, path) pairs)."""
    from ..checkpoint import MANIFEST
    from ..checks import Output, check_output_dir, check_output_file, check_outputs_apart

    out, work, log = output_paths(out_arg)
    check_outputs_apart([Output("--out", path) for path in (out, work, log, lock_path(work))], inputs)
    out = check_output_dir("--out", out_arg, replaceable=MANIFEST)
    if work.exists() and not work.is_dir():
        raise UserError(f"--out {out}: its work path {work} exists and is not a directory")
    return out, work, check_output_file("--out", log)


def _remove_work_dir(work: Path) -> None:
    """OUT.partial and what it holds: block files, and a lookup pass's pass1/ and pass2/ folders of them."""
    if work.is_dir():
        for f in work.iterdir():
            _remove_work_dir(f) if f.is_dir() else f.unlink()
        work.rmdir()
