"""`tarq-deploy export --target TARGET`: the lattice checkpoint re-arranged, bit for bit, into a runtime's format.

whisper.cpp writes one model file (see tarq_deploy.commands.export_whispercpp); qwen3-asr.cpp and CrispASR one
Qwen3-ASR GGUF file each (tarq_deploy/formats/qwen3_asr_targets.py); CrispASR runs Whisper from whisper.cpp's model
file (its whisper backend reads no GGUF: tarq_deploy/formats/crispasr_whisper.py); transcribe.cpp one Whisper,
Qwen3-ASR or Voxtral GGUF whose matrices keep their own types (formats/transcribe_whisper.py, transcribe_llm.py); the
GPU targets write a transformers checkpoint directory (GPTQ v1, compressed-tensors pack-quantized, or legacy
pre-packed Marlin) that runtimes repack to Marlin at load. Nothing re-quantizes: a lattice a target cannot hold
exactly is refused with the reason.
"""

from __future__ import annotations

import argparse

from . import export_whispercpp

HELP = ("export a lattice checkpoint (or a float model) to whisper.cpp, qwen3-asr.cpp, CrispASR, GPTQ, "
        "compressed-tensors or Marlin, bit-exactly")
EXAMPLE = """  tarq-deploy export --checkpoint base-q4_0 --target whisper.cpp -o base-q4_0.bin
  tarq-deploy export --model packaged:base --target whisper.cpp -o base-f16.bin
  tarq-deploy export --model packaged:base --baseline ggml --type q4_0 -o base-ggml-q4_0.bin"""
GPU_TARGETS = ("gptq", "compressed-tensors", "marlin")
CRISPASR = "crispasr"
GGUF_TARGETS = ("qwen3-asr.cpp", CRISPASR)
TRANSCRIBE = "transcribe.cpp"  # Whisper / Qwen3-ASR / Voxtral GGUF with per-tensor types (transcribe_whisper/_llm.py)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    targets = (*export_whispercpp.TARGETS, *GGUF_TARGETS, TRANSCRIBE, *GPU_TARGETS)
    export_whispercpp.add_export_arguments(parser, targets=targets)
    parser.add_argument("--serve-dtype", choices=["float16", "bfloat16"],
                        help="GPU targets: the dtype the runtime will cast scales to (default: the model config's)")
    parser.add_argument("--overwrite", action="store_true",
                        help="kept for one release: every export replaces its own earlier output without it (a model "
                             "file, or a GPU export folder) and refuses to replace anything else")


def run(args: argparse.Namespace) -> int:
    _check_output(args)
    if args.target in GPU_TARGETS:
        return _export_gpu(args)
    if args.target == CRISPASR and _is_whisper(args):
        return export_whispercpp.run_export(args, crispasr=True)  # CrispASR runs Whisper from whisper.cpp's .bin
    if args.target == CRISPASR and _is_voxtral(args):
        return _export_gguf(args, voxtral=True)  # CrispASR's voxtral backend (formats/crispasr_voxtral.py)
    if args.target == TRANSCRIBE:
        return _export_transcribe(args)
    if args.target in GGUF_TARGETS:
        return _export_gguf(args)
    return export_whispercpp.run_export(args)


def _is_whisper(args: argparse.Namespace) -> bool:
    """Whether the export's source is a Whisper model (a checkpoint's saved config, or --model's kind); a checkpoint
    that cannot be read is not (the exporter then reports what is wrong with it)."""
    from ..model_source import SourceKind, resolve_source
    from ..formats.backbones import is_whisper_source

    if args.checkpoint is not None:
        found = resolve_source(args.checkpoint)
        return found.kind is SourceKind.CHECKPOINT and found.model_type == "whisper"
    return args.model is not None and is_whisper_source(args.model)


def _is_voxtral(args: argparse.Namespace) -> bool:
    """Whether the export's source is a Voxtral model (a checkpoint's saved config, or --model's kind)."""
    from ..model_source import SourceKind, resolve_source

    if args.checkpoint is not None:
        found = resolve_source(args.checkpoint)
        return found.kind is SourceKind.CHECKPOINT and found.model_type == "voxtral"
    return args.model is not None and resolve_source(args.model).model_type == "voxtral"


def default_file_name(args: argparse.Namespace) -> str:
    """The file name an export takes when -o is a folder, llama.cpp style: MODEL-METHOD-TYPE.EXT (base-tarq-q3_k.bin;
    base-f16.bin, base-ggml-q4_0.bin from a float --model), MODEL being the source's last name part."""
    from ..checkpoint import read_manifest
    from ..model_source import SourceKind, resolve_source

    if args.checkpoint is not None:
        manifest = read_manifest(args.checkpoint)
        source = str(manifest.get("source_model", {}).get("id", "model"))
        method = str(manifest.get("method", {}).get("name", ""))
        lattice_type = (manifest.get("lattice") or {}).get("ggml_type") or "int4"
        weight_type = args.weight_type or ("mix" if manifest.get("lattice_overrides") else lattice_type)
    else:
        source, method = args.model, "ggml" if args.baseline else ""
        weight_type = args.weight_type or ("q4_0" if args.baseline else "f16")
    found = resolve_source(source)
    model = found.packaged_name if found.kind is SourceKind.PACKAGED else source.rstrip("/").rsplit("/", 1)[-1]
    model = model.removesuffix(".bin")
    gguf = args.target == TRANSCRIBE or (args.target in GGUF_TARGETS and not _is_whisper(args))
    extension = ".gguf" if gguf else ".bin"
    return "-".join(part for part in (model, method, weight_type) if part) + extension


def _check_output(args: argparse.Namespace) -> None:
    """Before anything is loaded or packed: the output can be written where the user pointed it (a folder for a
    file: the file inside it, named by default_file_name)."""
    from pathlib import Path

    from ..checks import Output, check_output_file, check_outputs_apart, probe_writable
    from ..errors import UserError
    from ..model_source import SourceKind, resolve_source

    if args.target not in GPU_TARGETS and Path(args.output).is_dir():
        args.output = str(Path(args.output) / default_file_name(args))

    # A GPU target's folder is built beside it and renamed over it, so an input inside it would go too.
    check_outputs_apart([Output("--output", args.output)],
                        [("CHECKPOINT_DIR", args.checkpoint), ("--model", args.model)])
    if args.target not in GPU_TARGETS:
        out = check_output_file("--output", args.output)
        if out.is_file() and resolve_source(out).kind not in (SourceKind.WHISPER_CPP, SourceKind.GGUF):
            raise UserError(f"--output {out}: exists and is not a model file; refusing to replace it (choose a new "
                            f"path or remove it)")
        return
    out = Path(args.output)
    if out.exists() and not out.is_dir():
        raise UserError(f"--output {out}: exists and is not a directory (--target {args.target} writes a directory)")
    # The house rule (checks.check_output_dir): a writer replaces what it wrote before, nothing else. An earlier GPU
    # export is a folder whose config.json carries a quantization_config; --overwrite is no longer needed for it.
    if out.is_dir() and any(out.iterdir()):
        if not resolve_source(out).quantized:
            raise UserError(f"--output {out}: exists and is not an earlier export (no quantization_config in a "
                            f"config.json); refusing to replace it (choose a new path or remove it)")
        args.overwrite = True
    probe_writable("--output", out)



def _export_gguf(args: argparse.Namespace, voxtral: bool = False) -> int:
    """Qwen3-ASR GGUF for qwen3-asr.cpp or CrispASR, or Voxtral GGUF for CrispASR: a checkpoint (its lattice's ggml
    types) or --model (f16)."""
    from tarq_deploy.formats.crispasr_voxtral import export_voxtral_gguf
    from tarq_deploy.formats.ggml_blocks import LatticeNotRepresentable
    from tarq_deploy.formats.qwen3_asr_targets import export_qwen3_asr_gguf
    from tarq_deploy.formats.model_files import ModelFilesError

    from ..errors import UserError
    from ..fileio import naming_os_errors

    if args.baseline:
        raise UserError(f"--baseline is for whisper.cpp; --target {args.target} exports a lattice checkpoint or an "
                        f"F16 float model (--model)")
    try:
        with naming_os_errors(args.output):
            export = export_voxtral_gguf if voxtral else export_qwen3_asr_gguf
            out, summary = export(args.target, args.checkpoint, args.model, args.weight_type, args.output)
    except (ModelFilesError, LatticeNotRepresentable) as e:  # GGUFExportError is a ModelFilesError
        raise UserError(str(e)) from None
    print(f"wrote {out}: {summary}")
    return 0


def _export_transcribe(args: argparse.Namespace) -> int:
    """Whisper, Qwen3-ASR or Voxtral GGUF for transcribe.cpp: a checkpoint (each matrix in its lattice's type) or
    --model (f16)."""
    from tarq_deploy.formats.ggml_blocks import LatticeNotRepresentable
    from tarq_deploy.formats.model_files import ModelFilesError
    from tarq_deploy.formats.transcribe_llm import export_transcribe_llm
    from tarq_deploy.formats.transcribe_whisper import export_transcribe_whisper

    from ..checkpoint import CheckpointError
    from ..errors import UserError
    from ..fileio import naming_os_errors

    if args.baseline:
        raise UserError(f"--baseline is for whisper.cpp; --target {args.target} exports a lattice checkpoint or an "
                        f"F16 float model (--model)")
    try:
        with naming_os_errors(args.output):
            family = _transcribe_family(args)
            if family is None:
                out, summary = export_transcribe_whisper(args.checkpoint, args.model, args.weight_type, args.output)
            else:
                out, summary = export_transcribe_llm(family, args.checkpoint, args.model, args.weight_type,
                                                     args.output)
    except (ModelFilesError, LatticeNotRepresentable, CheckpointError) as e:
        raise UserError(str(e)) from None
    print(f"wrote {out}: {summary}")
    return 0


def _transcribe_family(args: argparse.Namespace):
    """transcribe_llm's family of the source (Qwen3-ASR, Voxtral), None for Whisper (and for a source that cannot be
    read: the Whisper exporter names what is wrong with it)."""
    from tarq_deploy.formats.transcribe_llm import MODEL_TYPES

    from ..model_source import resolve_source

    found = resolve_source(args.checkpoint if args.checkpoint is not None else args.model)
    return MODEL_TYPES.get(found.model_type or "")


def _export_gpu(args: argparse.Namespace) -> int:
    from tarq_deploy.formats.compressed_tensors import write_compressed_tensors_checkpoint
    from tarq_deploy.formats.gptq_safetensors import ExportError, write_gptq_checkpoint
    from tarq_deploy.formats.marlin import write_marlin_checkpoint

    from ..checkpoint import load_checkpoint
    from ..errors import UserError
    from ..fileio import naming_os_errors

    if not args.checkpoint:
        raise UserError(f"--target {args.target} exports a lattice checkpoint: give CHECKPOINT_DIR")
    writers = {"gptq": write_gptq_checkpoint, "compressed-tensors": write_compressed_tensors_checkpoint,
               "marlin": write_marlin_checkpoint}
    try:
        checkpoint = load_checkpoint(args.checkpoint)
        with naming_os_errors(args.output):
            out = writers[args.target](checkpoint, args.output, serve_dtype=args.serve_dtype, overwrite=args.overwrite)
    except ExportError as e:
        raise UserError(str(e)) from None
    print(f"wrote {out} ({args.target})")
    if args.target == "compressed-tensors":
        print("load it in transformers with from_pretrained(..., quantization_config=CompressedTensorsConfig("
              "dequantize=True)); a plain from_pretrained fails at the first forward pass")
    return 0
