"""`tarq-deploy quantize`: calibrate a model on a corpus and write a lattice checkpoint."""

from __future__ import annotations

import argparse
from pathlib import Path

from ..checkpoint import save_checkpoint
from ..fileio import write_json_atomic
from ..data.corpus import POOLS, load_corpus
from ..models.registry import load_backbone
from ..quant.tarq import METHODS, SOURCES
from ..quantize import DEFAULT_GROUP_SIZE, QuantizeOptions, quantize_backbone

HELP = "calibrate a model (RTN, GPTQ, rareBAL, residual or TARQ) and write a lattice checkpoint"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True,
                   help="packaged:tiny.en | packaged:base | a transformers or CTranslate2 directory | a hub id "
                        "(e.g. openai/whisper-base), or a transformers Voxtral directory")
    p.add_argument("--calib", help="calibration corpus: JSONL manifest, LibriSpeech-layout or saved datasets "
                                   "directory (not needed for rtn)")
    p.add_argument("--method", choices=METHODS, default="tarq")
    p.add_argument("--target", choices=sorted(DEFAULT_GROUP_SIZE), default="whisper.cpp",
                   help="where the checkpoint will be exported; sets the default group size")
    p.add_argument("--bits", type=int, default=4)
    p.add_argument("--group-size", type=int, help="input columns per scale (32, 64, 128, or -1 per channel); "
                                                  "default 32 for ggml targets, 128 for GPU formats")
    p.add_argument("--zipf-threshold", type=float, default=3.0, help="a word is rare if its Zipf score is below k")
    p.add_argument("--cost-ratio", type=float, default=1.0, help="c in lam = c tr(H_common) / tr(H_tail)")
    p.add_argument("--reweight-source", choices=SOURCES, default="rare", help="positions re-weighted as the tail")
    p.add_argument("--n-calib", type=int, default=128, help="calibration utterances")
    p.add_argument("--pool", choices=POOLS, default="random", help="how calibration utterances are chosen")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--encoder-tagging", choices=["align", "none"], default="align",
                   help="tag rare words' encoder frames through the alignment heads, or tag no frames")
    p.add_argument("--no-pack", action="store_true", help="one utterance per 30 s window instead of packing")
    p.add_argument("--head-identity-weight", type=float, default=1.0,
                   help="mu: weight of the token-lookup role in the tied head's metric")
    p.add_argument("--quantize-audio-tower", action="store_true",
                   help="Voxtral: also quantize the audio encoder (default: kept in 16-bit, as vLLM/GPTQModel do)")
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--out", required=True, help="checkpoint directory to write")


def options_from(args: argparse.Namespace) -> QuantizeOptions:
    group = args.group_size if args.group_size is not None else DEFAULT_GROUP_SIZE[args.target]
    return QuantizeOptions(
        method=args.method, bits=args.bits, group_size=group, zipf_threshold=args.zipf_threshold,
        cost_ratio=args.cost_ratio, source=args.reweight_source, n_calib=args.n_calib, pool=args.pool,
        seed=args.seed, encoder_tagging=args.encoder_tagging, pack=not args.no_pack,
        head_identity_weight=args.head_identity_weight, device=args.device,
    )


def run(args: argparse.Namespace) -> int:
    from ..errors import UserError

    options = options_from(args)
    options.spec()  # reject a bad lattice before loading anything
    if options.method != "rtn" and not args.calib:
        raise UserError(f"--calib is required for method {options.method!r}")
    utterances = load_corpus(args.calib) if options.method != "rtn" else []
    backbone = load_backbone(args.model, options.device, options.head_identity_weight, args.quantize_audio_tower)
    out = Path(args.out)
    work = out.with_name(out.name + ".partial")
    checkpoint, timing = quantize_backbone(backbone, utterances, options, args.model, work)
    save_checkpoint(checkpoint, out)
    log_path = out.with_name(out.name + ".log.json")
    write_json_atomic(log_path, {"options": options.result_knobs(), "device": options.device, **timing,
                                 "layers_full": checkpoint.metadata["layers"]}, indent=1)
    _remove_work_dir(work)
    print(f"wrote {out} ({len(checkpoint.quantized)} lattice matrices, {options.bits}-bit, group "
          f"{options.group_size}, method {options.method}); per-layer log {log_path}")
    return 0


def _remove_work_dir(work: Path) -> None:
    if work.is_dir():
        for f in work.iterdir():
            f.unlink()
        work.rmdir()
