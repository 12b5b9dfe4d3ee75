"""`tarq-deploy quantize`: calibrate a model on a corpus and write a lattice checkpoint."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Sequence

from ..data.corpus import POOLS
from ..errors import UserError
from ..model_source import PACKAGED_PREFIX, ModelSource, SourceKind, resolve_source
from ..quant.choices import (ALPHA_RULES, COMPUTE_DTYPES, DATA_FREE_METHODS, DEFAULT_GROUP_SIZE,
                             DEFAULT_HEAD_IDENTITY_WEIGHT, GGML_NEEDS_IMPORTANCE, GGML_TARGETS, GGML_TYPES, GGUF_TARGETS,
                             HEAD_IDENTITY_WEIGHT_BY_DEFAULT, K_QUANT_ROW, LOOKUP_PASS_BY_DEFAULT, LOOKUP_PASSES,
                             METHODS, ROTATE_HEADS_BY_DEFAULT, ROTATIONS, SCALE_RULES, SOURCES)
from ..quant.presets import PRESETS, find_preset
from .options import add_out, memory_size, thread_count

HELP = "calibrate a model (RTN, GPTQ, rareBAL, residual or TARQ) and write a lattice checkpoint"
EXAMPLE = """  tarq-deploy corpus real -o clips
  tarq-deploy quantize --model packaged:base --calib clips/eval.jsonl --method tarq --type q4_0 -o base-q4_0"""
SUPPORTED_MODEL_TYPES = ("whisper", "voxtral", "qwen3_asr")
PRESET_TARGET = "transcribe.cpp"  # whose presets --tensor-type q4_k_m / q5_k_m follow


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True,
                   help="packaged:tiny.en | packaged:base | a whisper.cpp model file (ggml-base.bin, F16 or F32) | "
                        "a transformers or CTranslate2 directory | a hub id (e.g. openai/whisper-base), or a "
                        "transformers Voxtral or Qwen3-ASR directory")
    p.add_argument("--calib", help="calibration corpus: JSONL manifest, LibriSpeech-layout or saved datasets "
                                   "directory (needed by every method but rtn)")
    p.add_argument("--method", choices=METHODS, default="tarq",
                   help="solver: rtn (nearest codes, no data; ggml's own bytes for q4_0..q8_0), ggml (ggml's own "
                        "quantizer of the type, no data), gptq, rarebal (metric only), residual (solver only), "
                        "tarq (both), imatrix (ggml's importance-weighted rounding of the type)")
    p.add_argument("--target", choices=sorted(DEFAULT_GROUP_SIZE), default="whisper.cpp",
                   help="where the checkpoint will be exported; sets the default group size")
    p.add_argument("--type", choices=sorted(GGML_TYPES),
                   help="ggml type of the weight matrices (ggml targets): sets the lattice's bits, grouping and "
                        "scheme to exactly what that type stores; default q4_0 (the K-quants need rows of a "
                        "multiple of 256 values)")
    p.add_argument("--tensor-type", action="append", default=[], metavar="PATTERN=TYPE",
                   help="GGUF targets: weights whose name contains a match of the regular expression PATTERN take "
                        "ggml type TYPE (repeatable, first match wins), e.g. 'audio_tower=q8_0'; or 'auto': "
                        "spend --size-budget where --recipe-from's measured losses are highest; or, for --target "
                        "transcribe.cpp, its preset q4_k_m or q5_k_m (any case): its own per-tensor types "
                        "(attention outputs q8_0, token embedding q6_k, q8_0 where a row does not divide 256), "
                        "each tensor calibrated")
    p.add_argument("--recipe-from", metavar="CHECKPOINT_DIR",
                   help="--tensor-type auto: a checkpoint of this model calibrated (gptq/tarq/...) at --type, whose "
                        "per-layer losses rank the tensors")
    p.add_argument("--size-budget", type=float, metavar="MIB",
                   help="--tensor-type auto: MiB the file may grow over the uniform --type")
    p.add_argument("--promote-to", choices=sorted(GGML_TYPES), default="q8_0",
                   help="--tensor-type auto: the type chosen tensors take (default q8_0)")
    p.add_argument("--bits", type=int, help="bits per weight code of a symmetric lattice (2 to 8; default 4, or the "
                                            "--type's)")
    p.add_argument("--group-size", type=int, help="input columns per scale (32, 64, 128, or -1 per channel); "
                                                  "default 32 for ggml targets, 128 for GPU formats")
    p.add_argument("--scale-dtype", choices=["float16", "bfloat16"], default="float16",
                   help="values the (fp16-stored) group scales may take: bfloat16 keeps every scale exact in bfloat16 "
                        "too, so runtimes computing in bf16 (Voxtral served in bf16, PyTorch's tinygemm INT4 kernel) "
                        "hold the lattice exactly; symmetric lattices only")
    p.add_argument("--zipf-threshold", type=float, default=3.0, help="a word is rare if its Zipf score is below k")
    p.add_argument("--cost-ratio", type=float, default=1.0, help="c in lam = c tr(H_common) / tr(H_tail)")
    p.add_argument("--reweight-source", choices=SOURCES, default="rare", help="positions re-weighted as the tail")
    p.add_argument("--n-calib", type=int, default=128, help="calibration utterances (at most; fewer if the corpus "
                                                            "holds fewer)")
    p.add_argument("--pool", choices=POOLS, default="random", help="how calibration utterances are chosen")
    p.add_argument("--seed", type=int, default=0, help="seed of the utterance selection and random reweighting")
    p.add_argument("--encoder-tagging", choices=["auto", "align", "none"], default="auto",
                   help="tag rare words' encoder frames through the alignment heads, or tag no frames; auto: align "
                        "for the methods that re-weight rare positions (tarq, rarebal), none for the others, whose "
                        "metric sums the tags away")
    p.add_argument("--no-pack", action="store_true", help="one utterance per 30 s window instead of packing")
    p.add_argument("--head-identity-weight", type=float, default=None,
                   help="mu: weight of the token-lookup role in the tied head's metric (default 1; 4 for tarq at "
                        "iq2_s and iq2_xs, where the dev split measured it better)")
    p.add_argument("--scale-rule", choices=SCALE_RULES, default="search",
                   help="group scales: max (ggml's rule, all 2^b levels) or search (candidate scales scored by the "
                        "metric-diagonal-weighted error)")
    p.add_argument("--act-order", action=argparse.BooleanOptionalAction, default=True,
                   help="sweep columns by decreasing H diagonal (group scales fixed up front, groups stay contiguous)")
    p.add_argument("--alpha-rule", choices=ALPHA_RULES, default="one",
                   help="residual step: the paper's closed-form alpha*, or one (the exact least-squares target "
                        "W + W H_delta H^-1, H_delta weighted like the metric)")
    p.add_argument("--refit-scales", action=argparse.BooleanOptionalAction, default=True,
                   help="two-level types (the K-quants, IQ4_XS, the IQ grid types): once the sweep has chosen every "
                        "code, move each group's scale (and min) code by the integer step that lowers the metric's "
                        "loss most, group by group, twice over (default on: TARQ of base on the dev split, rare KLD "
                        "-12 %% at Q3_K and -5 %% at Q2_K, common KLD -12 %% at Q4_K, none worse; held out: Q2_K rare "
                        "KLD -14 %%, Q3_K's gain not replicated; results/refit)")
    p.add_argument("--rotate", choices=ROTATIONS, default="auto",
                   help="Whisper: before calibrating, rotate every attention head's query/key and value/output "
                        "weights by a random orthogonal matrix that the head undoes (heads: the model's outputs "
                        "stay the same in every runtime; outliers spread across each head's 64 columns), or not "
                        "(none); auto (default): heads where the dev split showed it helps (tarq at iq3_s, "
                        "iq3_xxs, iq2_s, iq2_xs, for Whisper), none elsewhere")
    p.add_argument("--lookup-pass", choices=LOOKUP_PASSES, default="auto",
                   help="Whisper (its output head is its token embedding): calibrate the decoder a second time with "
                        "the first head's lattice as the quantized decoder's token lookup, and keep that head, so the "
                        "decoder is calibrated against the lookup the runtime will do (on), or once (off); auto "
                        "(default): on for tarq at iq2_xs (dev split: common KLD -11 %%, rare level; "
                        "results/lookup-pass), off elsewhere. The second pass starts from the first's encoder: base, "
                        "128 utterances, 131 s in all")
    p.add_argument("--compute-dtype", choices=COMPUTE_DTYPES, default="float32",
                   help="precision of the calibration's forward passes (the second moments and the solver stay "
                        "float32/float64): bfloat16 autocast takes TARQ of Whisper base from 82 to 60 s where the CPU "
                        "multiplies bfloat16 natively (AVX512-BF16, AMX), but raised the dev split's common-word KLD "
                        "by 4-7 %% in two of four cells (bench/results/precision), so it is not the default; auto: "
                        "bfloat16 on such a CPU, float32 elsewhere and on a GPU")
    p.add_argument("--quantize-audio-tower", action="store_true",
                   help="Voxtral: also quantize the audio encoder (default: kept in 16-bit, as vLLM/GPTQModel do)")
    p.add_argument("--device", default="cpu", help="where to calibrate: cpu, cuda or cuda:N")
    p.add_argument("--imatrix", metavar="FILE",
                   help="--method imatrix: take the importance matrix from this llama.cpp-format imatrix GGUF (one "
                        "saved by --save-imatrix, or written by llama.cpp's tools with this model's weight names) "
                        "instead of calibrating; --calib is then not needed")
    p.add_argument("--save-imatrix", metavar="FILE",
                   help="--method imatrix: also write the importance matrix it gathered as a llama.cpp-format imatrix "
                        "GGUF (reusable with --imatrix; such a run does not resume)")
    p.add_argument("--max-memory", type=memory_size, metavar="SIZE",
                   help="memory the calibration may use, e.g. 8GB or 6GiB (default: 8 GB or half the machine's, the "
                        "smaller): where the work of one pass fits in it, it is kept for reuse instead of being "
                        "computed again (Whisper + tarq/rarebal: the alignment pass's encoder). It never changes the "
                        "result")
    p.add_argument("--threads", type=thread_count, metavar="N",
                   help="CPU threads of the calibration (default: torch's, one per core); the same inputs, seed, "
                        "processor kind and threads give the same bytes")
    add_out(p, "checkpoint directory to write (a new path, or an earlier checkpoint to replace); OUT.partial/ holds "
               "resumable work, OUT.log.json the log", required=True)


def options_from(args: argparse.Namespace):
    from ..quant.pipeline import QuantizeOptions

    preset = preset_choice(args)
    preset_type = PRESETS[preset].main if preset else None
    type_name = args.type or preset_type
    scheme, bits, group = lattice_choice(args, preset_type)
    tensor_types = () if preset else tensor_type_choice(args)  # a preset's are resolved by shape once loaded
    return QuantizeOptions(
        method=args.method, bits=bits, group_size=group, scheme=scheme, scale_grid=args.scale_dtype,
        tensor_types=tensor_types, preset=preset,
        zipf_threshold=args.zipf_threshold,
        cost_ratio=args.cost_ratio, source=args.reweight_source, n_calib=args.n_calib, pool=args.pool,
        seed=args.seed, encoder_tagging=args.encoder_tagging, pack=not args.no_pack,
        head_identity_weight=head_identity_choice(args, type_name), scale_rule=args.scale_rule,
        act_order=args.act_order,
        alpha_rule=args.alpha_rule, refit_scales=args.refit_scales,
        device=args.device, max_memory=args.max_memory, rotate=rotation_choice(args, type_name),
        lookup_pass=lookup_pass_choice(args, type_name),
        compute_dtype=compute_dtype_choice(args),
    )


def compute_dtype_choice(args: argparse.Namespace) -> str:
    """--compute-dtype resolved (auto: bfloat16 where the processor multiplies it natively); float32 for a run
    that computes nothing (rtn, ggml, imatrix from a file), so that its manifest names no precision it did not use."""
    from ..quant.precision import resolve_compute_dtype

    if args.method in DATA_FREE_METHODS or args.imatrix:
        return "float32"
    return resolve_compute_dtype(args.compute_dtype, args.device)


def head_identity_choice(args: argparse.Namespace, type_name: str | None) -> float:
    """--head-identity-weight as given, else the default measured for the method and type (choices.py)."""
    if args.head_identity_weight is not None:
        return args.head_identity_weight
    return HEAD_IDENTITY_WEIGHT_BY_DEFAULT.get((args.method, type_name), DEFAULT_HEAD_IDENTITY_WEIGHT)


def rotation_choice(args: argparse.Namespace, type_name: str | None) -> str:
    """--rotate as given, or for auto: heads where the dev split measured it (ROTATE_HEADS_BY_DEFAULT), else none."""
    if args.rotate != "auto":
        return args.rotate
    return "heads" if _measured_for_whisper(args, type_name, ROTATE_HEADS_BY_DEFAULT) else "none"


def lookup_pass_choice(args: argparse.Namespace, type_name: str | None) -> bool:
    """--lookup-pass as given, or for auto: on where the dev split measured it (LOOKUP_PASS_BY_DEFAULT)."""
    if args.lookup_pass != "auto":
        return args.lookup_pass == "on"
    return _measured_for_whisper(args, type_name, LOOKUP_PASS_BY_DEFAULT)


def _measured_for_whisper(args: argparse.Namespace, type_name: str | None, pairs: frozenset) -> bool:
    """Whether an ``auto`` Whisper-only step is on: ``pairs`` names the method and type, and the model is Whisper."""
    if (args.method, type_name) not in pairs:
        return False
    from ..models.registry import is_whisper_source

    return is_whisper_source(args.model)


def lattice_choice(args: argparse.Namespace, preset_type: str | None = None) -> tuple[str, int, int]:
    """(scheme, bits, group size) from --type (or the main type of a --tensor-type preset), --bits, --group-size and
    --target; a contradiction is a UserError."""
    group = args.group_size if args.group_size is not None else DEFAULT_GROUP_SIZE[args.target]
    type_name = args.type or preset_type
    if type_name is None:
        return "symmetric", args.bits if args.bits is not None else 4, group
    if args.target not in GGML_TARGETS:
        raise UserError(f"--type {type_name}: ggml types are for the ggml targets ({', '.join(GGML_TARGETS)}); "
                        f"--target {args.target} stores a 4-bit symmetric lattice (use --bits / --group-size)")
    scheme, bits, native_group = GGML_TYPES[type_name]
    if args.bits is not None and args.bits != bits:
        raise UserError(f"--bits {args.bits}: --type {type_name} stores {bits}-bit codes (leave --bits out)")
    if scheme != "symmetric" and args.group_size is not None and args.group_size != native_group:
        raise UserError(f"--group-size {args.group_size}: --type {type_name} has one group of {native_group} values "
                        f"per scale (leave --group-size out)")
    return scheme, bits, group if scheme == "symmetric" else native_group


def preset_choice(args: argparse.Namespace) -> str | None:
    """--tensor-type q4_k_m / q5_k_m (any case): transcribe.cpp's preset, whose per-tensor types need the model's
    shapes (resolved by with_preset_types); checked here against the target, the model and --type."""
    named = [(text, key) for text in args.tensor_type if (key := find_preset(text))]
    if not named:
        return None
    given, key = named[0]
    preset = PRESETS[key]
    if len(args.tensor_type) > 1:
        raise UserError(f"--tensor-type {given}: a preset writes the whole recipe; give it alone")
    if args.target != PRESET_TARGET:
        raise UserError(f"--tensor-type {given}: the presets are {PRESET_TARGET}'s bucket policy; use --target "
                        f"{PRESET_TARGET}")
    if args.type is not None and args.type != preset.main:
        raise UserError(f"--type {args.type}: preset {preset.name} quantizes weight matrices to {preset.main} "
                        f"(leave --type out)")
    from ..models.registry import is_whisper_source

    if not is_whisper_source(args.model):
        raise UserError(f"--tensor-type {given}: {PRESET_TARGET} files are written for Whisper models only so far; "
                        f"--model {args.model} is not one")
    return key


def with_preset_types(options, backbone):
    """The options with a preset resolved into per-tensor types by the loaded model's shapes (a row that a K-quant
    block does not divide falls back to q8_0, as transcribe.cpp's own quantizer does)."""
    from dataclasses import replace

    from ..formats.transcribe_whisper import preset_tensor_types

    if options.preset is None:
        return options
    try:
        types = preset_tensor_types(PRESETS[options.preset], backbone.model.config.to_dict())
    except ValueError as e:
        raise UserError(f"--tensor-type {options.preset}: {e}") from None
    return replace(options, tensor_types=types)


def tensor_type_choice(args: argparse.Namespace) -> tuple[tuple[str, str], ...]:
    """The --tensor-type overrides, each checked; a mix for whisper.cpp (one type per .bin), or for a Whisper model on
    CrispASR (which runs it from that .bin), is a UserError."""
    from ..models.registry import is_whisper_source
    from ..quant.recipe import parse_tensor_type

    if args.tensor_type and args.target not in GGUF_TARGETS:
        raise UserError(f"--tensor-type {args.tensor_type[0]}: --target {args.target} holds one type for all weight "
                        f"matrices; per-tensor mixes are for the GGUF targets ({', '.join(GGUF_TARGETS)})")
    if args.tensor_type and args.target == "crispasr" and is_whisper_source(args.model):
        raise UserError(f"--tensor-type {args.tensor_type[0]}: --target crispasr runs Whisper from whisper.cpp's .bin "
                        f"(the crispasr wheel reads no Whisper GGUF), which holds one type for every weight matrix; "
                        f"quantize Whisper with one --type (CrispASR's per-tensor mixes are for Qwen3-ASR GGUF)")
    if "auto" in args.tensor_type:
        return auto_tensor_types(args)
    try:
        return tuple(parse_tensor_type(text) for text in args.tensor_type)
    except ValueError as e:
        raise UserError(f"--tensor-type {e}") from None


def auto_tensor_types(args: argparse.Namespace) -> tuple[tuple[str, str], ...]:
    """--tensor-type auto: the promotions that fit --size-budget, ranked by --recipe-from's measured losses."""
    from ..checkpoint import CheckpointError, read_manifest
    from ..quant.recipe import auto_recipe, promotion_patterns

    if args.tensor_type != ["auto"]:
        raise UserError("--tensor-type auto: give it alone (it writes the whole recipe)")
    if args.recipe_from is None or args.size_budget is None:
        raise UserError("--tensor-type auto needs --recipe-from CHECKPOINT_DIR and --size-budget MIB")
    if not args.size_budget >= 0:
        raise UserError(f"--size-budget {args.size_budget}: must be a non-negative number of MiB")
    try:
        manifest = read_manifest(args.recipe_from)
    except CheckpointError as e:
        raise UserError(f"--recipe-from {e}") from None
    base = args.type or "q4_0"
    measured_at = manifest.get("lattice", {}).get("ggml_type")
    if measured_at != base or manifest.get("lattice_overrides"):
        raise UserError(f"--recipe-from {args.recipe_from}: its losses were measured on {measured_at or 'no ggml type'}"
                        f"{' with a mix' if manifest.get('lattice_overrides') else ''}, not on a uniform {base}: "
                        f"calibrate it with --type {base}")
    try:
        chosen = auto_recipe(manifest.get("layers", []), manifest.get("quantized", {}), base, args.promote_to,
                             args.size_budget * (1 << 20))
    except ValueError as e:
        raise UserError(f"--recipe-from {args.recipe_from}: {e}") from None
    spent = sum(c.extra_bytes for c in chosen) / (1 << 20)
    print(f"auto recipe: {len(chosen)} tensors to {args.promote_to} for {spent:.2f} of {args.size_budget:g} MiB"
          + "".join(f"\n  {c.name} (loss {c.score:.4g}, +{c.extra_bytes / (1 << 20):.2f} MiB)" for c in chosen))
    return promotion_patterns(chosen, args.promote_to)


def check_rotation(args: argparse.Namespace) -> None:
    """--rotate rotates Whisper's attention heads; Qwen3-ASR and Voxtral have no exact rotation here."""
    if args.imatrix:
        raise UserError(f"--rotate {args.rotate}: --imatrix {args.imatrix} holds importances of the unrotated model's "
                        f"inputs (out_proj's inputs turn with the rotation); calibrate with --method imatrix instead")
    if args.save_imatrix:
        raise UserError(f"--rotate {args.rotate}: --save-imatrix {args.save_imatrix} would hold the rotated model's "
                        f"importances, which fit no other run; save it from an unrotated run")
    from ..models.registry import is_whisper_source

    if not is_whisper_source(args.model):  # as the preset check: a config that cannot be read is no Whisper's
        raise UserError(f"--rotate {args.rotate}: rotates Whisper's attention heads; --model {args.model} is not a "
                        f"Whisper model (use --rotate none)")


def check_lookup_pass(args: argparse.Namespace, options) -> None:
    """--lookup-pass on calibrates a Whisper model's decoder twice: it needs a calibration and a tied head."""
    if options.method in DATA_FREE_METHODS or options.method == "imatrix":
        raise UserError(f"--lookup-pass on: method {options.method!r} calibrates no decoder block against the lookup "
                        f"(use gptq, rarebal, residual or tarq, or --lookup-pass off)")
    from ..models.registry import is_whisper_source

    if not is_whisper_source(args.model):
        raise UserError(f"--lookup-pass on: only Whisper's head is its token lookup; --model {args.model} is not a "
                        f"Whisper model (use --lookup-pass off)")


def check_ggml_quantizer(options) -> None:
    """imatrix and ggml call ggml's own quantizer, which writes one ggml type at its own grouping."""
    native = {(scheme, bits): (name, group) for name, (scheme, bits, group) in GGML_TYPES.items()}
    found = native.get((options.scheme, options.bits))
    if found is None:
        raise UserError(f"--method {options.method}: ggml's quantizer writes ggml types only; a {options.bits}-bit "
                        f"{options.scheme} lattice is none of them (pick --type)")
    if options.group_size != found[1]:
        raise UserError(f"--method {options.method}: ggml's {found[0]} quantizer writes groups of {found[1]}; got "
                        f"--group-size {options.group_size}")
    if options.method == "ggml" and found[0] in GGML_NEEDS_IMPORTANCE:
        raise UserError(f"--method ggml: ggml's {found[0]} quantizer needs an importance matrix (use --method "
                        f"imatrix)")


def _width_problem(args: argparse.Namespace, spec, layer: str, columns: int) -> str:
    """The one-line refusal for a Linear whose width the lattice cannot split, naming the types that would work."""
    if spec.two_level:
        fitting = [name for name, (scheme, _, group) in GGML_TYPES.items()
                   if not scheme.startswith(("k-", "grid-")) and columns % group == 0]
        name = next(n for n, (scheme, bits, _) in GGML_TYPES.items() if (scheme, bits) == (spec.scheme, spec.bits))
        option = f"--type {args.type}" if args.type == name else f"--tensor-type (type {name})"
        return (f"{option}: {layer} has {columns} input columns, not a multiple of {K_QUANT_ROW} (the K-quant "
                f"super-block); types that fit this model: {', '.join(fitting)}")
    return (f"--group-size {spec.group_size}: {layer} has {columns} input columns, not a multiple of it "
            f"(try 32 or -1)")


def run(args: argparse.Namespace) -> int:
    from ..checkpoint import save_checkpoint
    from ..data.corpus import load_corpus
    from ..fileio import exclusive_writer, write_json_atomic
    from ..quant.pipeline import quantize_backbone, quantize_with_lookup_pass

    # Everything the user gave is checked before the model is loaded or any calibration starts.
    options = checked_options(args)
    out, work, log_path = checked_outputs(args.out, model_inputs(args))
    saved_imatrix = checked_imatrix_output(args, out, work, log_path)
    importance = read_importance(args.imatrix) if args.imatrix else None
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)  # before any torch work: the machine record below reports it
    # One run at a time into OUT: a second one would share OUT.partial's blocks and replace OUT under the first.
    with exclusive_writer(lock_path(work), "--out", out):
        source = check_model_source(args.model)
        utterances = []
        if options.method not in DATA_FREE_METHODS and importance is None:
            utterances = load_corpus(args.calib)
            if not utterances:
                raise UserError(f"--calib {args.calib}: holds no utterances; method {options.method!r} cannot "
                                f"calibrate from nothing (use --method rtn for data-free rounding)")
        backbone, options = load_checked_backbone(args, options, source)
        sink = {} if saved_imatrix else None
        if options.lookup_pass:  # two calibrations, each of a freshly loaded model (the first: this one)
            pending = [backbone]
            del backbone

            def fresh_backbone():
                return pending.pop() if pending else load_checked_backbone(args, options, source)[0]

            checkpoint, timing = quantize_with_lookup_pass(fresh_backbone, utterances, options, args.model, work)
        else:
            checkpoint, timing = quantize_backbone(backbone, utterances, options, args.model, work,
                                                   importance=importance, importance_sink=sink)
        save_checkpoint(checkpoint, out)
        if saved_imatrix:
            save_importance(sink, checkpoint.metadata["calibration"], args.calib, saved_imatrix)
        write_json_atomic(log_path, {"options": options.result_knobs(), "device": options.device, **timing,
                                     "layers_full": checkpoint.metadata["layers"]}, indent=1)
        _remove_work_dir(work)
    print(f"wrote {out} ({len(checkpoint.quantized)} lattice matrices, {options.bits}-bit, group "
          f"{options.group_size}, method {options.method}); per-layer log {log_path}")
    return 0


def checked_options(args: argparse.Namespace):
    """The options, with every value checked that can be checked without the model."""
    from ..checks import check_device
    from ..quant.lattice import SUPPORTED_BITS, SUPPORTED_GROUP_SIZES

    options = options_from(args)
    if options.scheme == "symmetric" and options.bits not in SUPPORTED_BITS:
        raise UserError(f"--bits {options.bits}: must be one of {', '.join(map(str, SUPPORTED_BITS))}")
    if options.scheme == "symmetric" and options.group_size not in SUPPORTED_GROUP_SIZES:
        raise UserError(f"--group-size {options.group_size}: must be one of "
                        f"{', '.join(map(str, SUPPORTED_GROUP_SIZES))} (-1: one scale per row)")
    if options.scale_grid != "float16":
        check_scale_grid(args, options)
    if not options.cost_ratio > 0:
        raise UserError(f"--cost-ratio {options.cost_ratio}: must be positive")
    if options.method in ("imatrix", "ggml"):
        check_ggml_quantizer(options)
    check_imatrix_options(args, options)
    if options.method not in DATA_FREE_METHODS and not args.imatrix:
        if not args.calib:
            raise UserError(f"--calib is required for method {options.method!r}")
        if options.n_calib < 1:
            raise UserError(f"--n-calib {options.n_calib}: method {options.method!r} needs at least 1 calibration "
                            f"utterance (use --method rtn for data-free rounding)")
    if options.rotate != "none":
        check_rotation(args)
    if options.lookup_pass:
        check_lookup_pass(args, options)
    if options.head_identity_weight < 0:
        raise UserError(f"--head-identity-weight {options.head_identity_weight}: must not be negative")
    check_device(options.device)
    return options


def checked_imatrix_output(args: argparse.Namespace, out: Path, work: Path, log: Path) -> Path | None:
    """--save-imatrix's file: writable, and none of quantize's inputs or other outputs."""
    from ..checks import Output, check_output_file, check_outputs_apart

    if not args.save_imatrix:
        return None
    check_outputs_apart([Output("--save-imatrix", args.save_imatrix)],
                        [*model_inputs(args), ("--out", str(out)), ("--out", str(work)), ("--out", str(log))])
    return check_output_file("--save-imatrix", args.save_imatrix)


def read_importance(path: str):
    """The importance matrix of an imatrix GGUF, as the calibration's ready-made statistics."""
    import torch

    from ..formats.imatrix_gguf import read_imatrix
    from ..quant.pipeline import Importance

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


def check_imatrix_options(args: argparse.Namespace, options) -> None:
    """--imatrix and --save-imatrix belong to --method imatrix, and exclude each other (a read file is not re-saved)."""
    for flag, value in (("--imatrix", args.imatrix), ("--save-imatrix", args.save_imatrix)):
        if value and options.method != "imatrix":
            raise UserError(f"{flag} {value}: an importance matrix is for --method imatrix, not {options.method}")
    if args.imatrix and args.save_imatrix:
        raise UserError("--save-imatrix: with --imatrix the matrix is read, not gathered; give one of the two")
    if args.imatrix and args.calib:
        raise UserError(f"--calib {args.calib}: with --imatrix nothing is calibrated; leave --calib out")


def check_scale_grid(args: argparse.Namespace, options) -> None:
    """A bf16 scale grid is a property of one symmetric lattice that our solvers choose (UserError otherwise)."""
    grid = f"--scale-dtype {options.scale_grid}"
    if options.scheme != "symmetric":
        raise UserError(f"{grid}: --type {args.type}'s lattice is {options.scheme}; the grid is for symmetric "
                        f"lattices (q4_0, q5_0, q8_0, or --bits)")
    if options.tensor_types:
        raise UserError(f"{grid}: applies to one lattice, not to a --tensor-type mix")
    if options.method in ("imatrix", "ggml"):
        raise UserError(f"{grid}: --method {options.method} is ggml's own quantizer, whose scales are plain float16")


def model_inputs(args: argparse.Namespace) -> list[tuple[str, str | None]]:
    """What quantize reads, by option: no output may lie over them."""
    return [("--model", args.model), ("--calib", args.calib), ("--recipe-from", args.recipe_from),
            ("--imatrix", args.imatrix)]


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


def check_model_source(source: str) -> ModelSource:
    """A packaged name that exists, a local path that exists and holds a supported model type, or a hub id; resolved
    once, for the loading that follows."""
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
        from ..models.registry import model_type

        try:
            kind = model_type(found)
        except ValueError as e:
            raise UserError(f"--model {e}") from None
        if kind not in SUPPORTED_MODEL_TYPES:
            raise UserError(f"--model {source}: model type {kind!r} is not supported "
                            f"({', '.join(SUPPORTED_MODEL_TYPES)})")
    return found


def load_checked_backbone(args: argparse.Namespace, options, source: ModelSource | None = None):
    """The backbone adapter of ``source`` (--model, resolved by check_model_source) and the options with a preset
    resolved by its shapes; refused with the tensor's name when a weight is not finite or a Linear's width does not
    fit the group size."""
    from ..errors import nonfinite_problem
    from ..models.packaged import PackagedModelError
    from ..models.registry import load_backbone

    try:
        backbone = load_backbone(args.model if source is None else source, options.device,
                                 options.head_identity_weight, args.quantize_audio_tower)
    except (ValueError, OSError, PackagedModelError) as e:
        raise UserError(f"--model {args.model}: cannot load it ({e})") from None
    for name, tensor in backbone.model.state_dict().items():
        problem = nonfinite_problem(tensor)
        if problem is not None:
            raise UserError(f"--model {args.model}: tensor {name} holds {problem}; refusing to quantize non-finite "
                            f"weights")
    options = with_preset_types(options, backbone)
    recipe = options.recipe()
    for stage in backbone.stages():
        for block in stage.blocks:
            for group in block.groups:
                for rel in group:
                    columns = block.linear(rel).in_features
                    spec = recipe.spec_for(f"{block.full_name(rel)}.weight")
                    try:
                        spec.check_columns(columns)
                    except ValueError:
                        raise UserError(_width_problem(args, spec, block.full_name(rel), columns)) from None
    return backbone, options


def _remove_work_dir(work: Path) -> None:
    """OUT.partial and what it holds: block files, and a lookup pass's pass1/ and pass2/ folders of them."""
    if work.is_dir():
        for f in work.iterdir():
            _remove_work_dir(f) if f.is_dir() else f.unlink()
        work.rmdir()
