"""quantize's options: one schema for the command line, the sweep's ``[quantize]`` table and the pipeline.

Three steps, each in one place:

1. :class:`QuantizeArguments` -- what a user gives: one field per option of ``tarq-deploy quantize``, its flag, help,
   parser and choices in the field's metadata (:class:`Option`). The command builds its parser from these fields
   (:func:`add_quantize_arguments`) and the sweep checks its tables against them (:func:`option_value_problem`):
   one list of names, never two.
2. :meth:`QuantizeOptions.build` -- the options from the arguments and the model source, resolved once by the caller
   and handed in. Every default that depends on the method, the type or the model is settled here, and
   :meth:`QuantizeOptions.validate` checks every rule that needs no weights, before any slow work;
   :meth:`QuantizeOptions.check_machine`, that this machine has the --device (the sweep leaves that to the node).
3. :meth:`QuantizeOptions.check_backbone` -- the rules that need the loaded model: finite weights, every Linear's
   width against its lattice, an importance matrix made for this model's tensors.

Every refusal is a UserError naming the option (the CLI prints it in one line and exits 2).
"""

from __future__ import annotations

import argparse
import re
from dataclasses import MISSING, asdict, dataclass, field, fields, replace
from typing import TYPE_CHECKING, Any, Callable, Iterator, Mapping

from ..data.corpus import POOLS
from ..data.rarity import DEFAULT_LANGUAGE, DEFAULT_ZIPF_THRESHOLD, TAIL_MODES
from ..errors import UserError, nonfinite_problem
from ..model_source import ModelSource
from ..quant.choices import (ALPHA_RULES, COMPUTE_DTYPES, DATA_FREE_METHODS, DECODER_SHAPE_BY_DEFAULT, DECODER_SHAPES,
                             DEFAULT_GROUP_SIZE, DEFAULT_HEAD_IDENTITY_WEIGHT, GGML_NEEDS_IMPORTANCE, GGML_TARGETS,
                             GGML_TYPES, GGUF_TARGETS, HEAD_IDENTITY_WEIGHT_BY_DEFAULT, K_QUANT_ROW,
                             LOOKUP_PASS_BY_DEFAULT, LOOKUP_PASSES, GGML_QUANTIZER_METHODS, METHODS, PERCDAMP,
                             PRESET_TARGET, REFIT_SCALES_BY_DEFAULT, ROTATE_HEADS_BY_DEFAULT, ROTATIONS, SCALE_DTYPES,
                             SCALE_RULES, SOURCES, TARGETS)
from ..quant.presets import PRESETS, find_preset
from ..values import memory_size, thread_count

if TYPE_CHECKING:  # torch-backed: imported where used, so that building the CLI's parser imports no torch
    from ..data.corpus import Utterance
    from ..data.rarity import TailRule
    from ..data.terms import TermList
    from ..quant.lattice import LatticeSpec
    from ..quant.recipe import TypeRecipe
    from ..quant.tarq import TarqConfig

__all__ = ["Option", "QuantizeArguments", "QuantizeOptions", "Importance", "add_quantize_arguments",
           "quantize_options", "option_value_problem", "parse_option_value"]

OptionKind = str  # "value" (one value), "flag" (given or not), "switch" (--X / --no-X), "repeat" (one value per use)


@dataclass(frozen=True)
class Option:
    """How one argument is spelled and read: its flag, its help, the parser of its text and its choices."""

    flag: str
    help: str
    parse: Callable[[str], Any] | None = None  # None: the text itself
    choices: tuple[str, ...] | None = None
    kind: OptionKind = "value"
    metavar: str | None = None
    required: bool = False


def _option(flag: str, help: str, default: Any = None, **how: Any) -> Any:
    return field(default=default, metadata={"option": Option(flag, help, **how)})


@dataclass(frozen=True)
class QuantizeArguments:
    """What the user asked of ``tarq-deploy quantize`` (or a sweep cell of it), as given: nothing resolved yet."""

    model: str = _option(
        "--model", "packaged:tiny.en | packaged:base | a whisper.cpp model file (ggml-base.bin, F16 or F32) | a "
        "transformers or CTranslate2 directory | a hub id (e.g. openai/whisper-base), or a transformers Voxtral or "
        "Qwen3-ASR directory", default="", required=True)
    calib: str | None = _option(
        "--calib", "calibration corpus: a JSONL manifest (NeMo's too: audio_filepath, offset, duration, language), a "
        "Kaldi/ESPnet data folder (wav.scp, text, segments), a saved datasets folder or a LibriSpeech-layout folder "
        "(needed by every method but rtn)")
    audio_column: str | None = _option(
        "--audio-column", "--calib is a saved datasets folder: its audio column (default 'audio')", metavar="NAME")
    text_column: str | None = _option(
        "--text-column", "--calib is a saved datasets folder: its transcript column (default: the first of text, "
        "sentence, transcript, transcription, normalized_text, raw_text)", metavar="NAME")
    method: str = _option(
        "--method", "solver: rtn (nearest codes, no data; ggml's own bytes for q4_0..q8_0), ggml (ggml's own "
        "quantizer of the type, no data), gptq, rarebal (metric only), residual (solver only), tarq (both), imatrix "
        "(ggml's importance-weighted rounding of the type)", default="tarq", choices=METHODS)
    target: str = _option("--target", "where the checkpoint will be exported; sets the default group size",
                          default="whisper.cpp", choices=TARGETS)
    type: str | None = _option(
        "--type", "ggml type of the weight matrices (ggml targets): sets the lattice's bits, grouping and scheme to "
        "exactly what that type stores; default q4_0 (the K-quants need rows of a multiple of 256 values)",
        choices=tuple(sorted(GGML_TYPES)))
    tensor_type: tuple[str, ...] = _option(
        "--tensor-type", "GGUF targets: weights whose name contains a match of the regular expression PATTERN take "
        "ggml type TYPE (repeatable, first match wins), e.g. 'audio_tower=q8_0'; or 'auto': spend --size-budget "
        "where --recipe-from's measured losses are highest; or, for --target transcribe.cpp, its preset q4_k_m or "
        "q5_k_m (any case): its own per-tensor types (attention outputs q8_0, token embedding q6_k, q8_0 where a row "
        "does not divide 256), each tensor calibrated", default=(), kind="repeat", metavar="PATTERN=TYPE")
    recipe_from: str | None = _option(
        "--recipe-from", "--tensor-type auto: a checkpoint of this model calibrated (gptq/tarq/...) at --type, whose "
        "per-layer losses rank the tensors", metavar="CHECKPOINT_DIR")
    size_budget: float | None = _option("--size-budget", "--tensor-type auto: MiB the file may grow over the uniform "
                                        "--type", parse=float, metavar="MIB")
    promote_to: str = _option("--promote-to", "--tensor-type auto: the type chosen tensors take (default q8_0)",
                              default="q8_0", choices=tuple(sorted(GGML_TYPES)))
    bits: int | None = _option("--bits", "bits per weight code of a symmetric lattice (2 to 8; default 4, or the "
                               "--type's)", parse=int)
    group_size: int | None = _option("--group-size", "input columns per scale (32, 64, 128, or -1 per channel); "
                                     "default 32 for ggml targets, 128 for GPU formats", parse=int)
    scale_dtype: str = _option(
        "--scale-dtype", "values the (fp16-stored) group scales may take: bfloat16 keeps every scale exact in bfloat16 "
        "too, so runtimes computing in bf16 (Voxtral served in bf16, PyTorch's tinygemm INT4 kernel) hold the "
        "lattice exactly; symmetric lattices only", default="float16", choices=SCALE_DTYPES)
    zipf_threshold: float = _option("--zipf-threshold", "a word is rare if its Zipf score is below k",
                                    default=DEFAULT_ZIPF_THRESHOLD, parse=float)
    terms: str | None = _option(
        "--terms", "a term list (one term per line, multi-word terms allowed, an optional tab and weight): every "
        "token of every occurrence of a term in the calibration transcripts, and its aligned encoder frames, is "
        "tail; terms the calibration utterances never hold are named before any work starts", metavar="FILE")
    tail: str | None = _option(
        "--tail", "which positions are the tail that rareBAL re-weights: zipf (rare words: Zipf < k), terms (the "
        "--terms' words), both; default zipf, both with --terms (the terms' words and every other rare word: "
        "unseen terms are rare words too)", choices=TAIL_MODES)
    language: str | None = _option(
        "--language", "the calibration transcripts' language: its wordfreq table decides which words are rare, and "
        "a multilingual Whisper's decoder prompt names it (default: the manifest's language when its entries give "
        "one, else en)", metavar="LANG")
    cost_ratio: float = _option("--cost-ratio", "c in lam = c tr(H_common) / tr(H_tail)", default=1.0, parse=float)
    reweight_source: str = _option("--reweight-source", "positions re-weighted as the tail", default="rare",
                                   choices=SOURCES)
    n_calib: int = _option("--n-calib", "calibration utterances (at most; fewer if the corpus holds fewer)",
                           default=128, parse=int)
    pool: str = _option("--pool", "how calibration utterances are chosen", default="random", choices=POOLS)
    seed: int = _option("--seed", "seed of the utterance selection and random reweighting", default=0, parse=int)
    encoder_tagging: str = _option(
        "--encoder-tagging", "tag rare words' encoder frames through the alignment heads, or tag no frames; auto: "
        "align for the methods that re-weight rare positions (tarq, rarebal), none for the others, whose metric sums "
        "the tags away", default="auto", choices=("auto", "align", "none"))
    no_pack: bool = _option("--no-pack", "one utterance per 30 s window instead of packing", default=False,
                            kind="flag")
    decoder_shape: str | None = _option(
        "--decoder-shape", "Whisper: the token shape the decoder is calibrated on: plain (<|notimestamps|>, no carried "
        "text: the research protocol's), cli (timestamps, and the previous window's tokens after <|startofprev|>: "
        "how whisper-cli decodes a recording) or both, alternating by window; read where a method calibrates on "
        f"a corpus (default {DECODER_SHAPE_BY_DEFAULT}: results/cliform)", choices=DECODER_SHAPES)
    nonspeech_share: float | None = _option(
        "--nonspeech-share", "Whisper: add windows of 30 s without speech (silence, low noise, white, pink, babble, "
        "music), this share of the speech windows in number, whose decoder prompt predicts the end of text at once "
        "(models/whisper.py); read where a method calibrates on a corpus (default 0: none)", parse=float,
        metavar="F")
    head_identity_weight: float | None = _option(
        "--head-identity-weight", "mu: weight of the token-lookup role in the tied head's metric (default 1; 4 for "
        "tarq at iq2_s and iq2_xs, where the dev split measured it better)", parse=float)
    scale_rule: str = _option(
        "--scale-rule", "group scales: max (ggml's rule, all 2^b levels) or search (candidate scales scored by the "
        "metric-diagonal-weighted error)", default="search", choices=SCALE_RULES)
    act_order: bool = _option(
        "--act-order", "sweep columns by decreasing H diagonal (group scales fixed up front, groups stay "
        "contiguous)", default=True, kind="switch")
    alpha_rule: str = _option(
        "--alpha-rule", "residual step: closed-form (the paper's alpha* of Algorithm 1, fitted to the metric) or one "
        "(the shipped default: alpha = 1, i.e. the exact least-squares target W + W H_delta H^-1, H_delta weighted "
        "like the metric)", default="one", choices=ALPHA_RULES)
    refit_scales: bool = _option(
        "--refit-scales", "two-level types (the K-quants, IQ4_XS, the IQ grid types): once the sweep has chosen every "
        "code, move each group's scale (and min) code by the integer step that lowers the metric's loss most, group "
        "by group, twice over (default on: TARQ of base on the dev split, rare KLD -12 %% at Q3_K and -5 %% at Q2_K, "
        "common KLD -12 %% at Q4_K, none worse; held out: Q2_K rare KLD -14 %%, Q3_K's gain not replicated; "
        "results/refit)", default=True, kind="switch")
    rotate: str = _option(
        "--rotate", "Whisper: before calibrating, rotate every attention head's query/key and value/output weights by "
        "a random orthogonal matrix that the head undoes (heads: the model's outputs stay the same in every runtime; "
        "outliers spread across each head's 64 columns), or not (none); auto (default): heads where the dev split "
        "showed it helps (tarq at iq3_s, iq3_xxs, iq2_s, iq2_xs, for Whisper), none elsewhere", default="auto",
        choices=ROTATIONS)
    lookup_pass: str = _option(
        "--lookup-pass", "Whisper (its output head is its token embedding): calibrate the decoder a second time with "
        "the first head's lattice as the quantized decoder's token lookup, and keep that head, so the decoder is "
        "calibrated against the lookup the runtime will do (on), or once (off); auto (default): on for tarq at iq2_xs "
        "(dev split: common KLD -11 %%, rare level; results/lookup-pass), off elsewhere. The second pass starts from "
        "the first's encoder: base, 128 utterances, 131 s in all", default="auto", choices=LOOKUP_PASSES)
    compute_dtype: str = _option(
        "--compute-dtype", "precision of the calibration's forward passes (the second moments and the solver stay "
        "float32/float64): bfloat16 autocast takes TARQ of Whisper base from 82 to 60 s where the CPU multiplies "
        "bfloat16 natively (AVX512-BF16, AMX), but raised the dev split's common-word KLD by 4-7 %% in two of four "
        "cells (bench/results/precision), so it is not the default; auto: bfloat16 on such a CPU, float32 elsewhere "
        "and on a GPU", default="float32", choices=COMPUTE_DTYPES)
    quantize_audio_tower: bool = _option(
        "--quantize-audio-tower", "Voxtral: also quantize the audio encoder (default: kept in 16-bit, as "
        "vLLM/GPTQModel do)", default=False, kind="flag")
    device: str = _option("--device", "where to calibrate: cpu, cuda or cuda:N", default="cpu")
    imatrix: str | None = _option(
        "--imatrix", "--method imatrix: take the importance matrix from this llama.cpp-format imatrix GGUF (one saved "
        "by --save-imatrix, or written by llama.cpp's tools with this model's weight names) instead of calibrating; "
        "--calib is then not needed", metavar="FILE")
    save_imatrix: str | None = _option(
        "--save-imatrix", "--method imatrix: also write the importance matrix it gathered as a llama.cpp-format "
        "imatrix GGUF (reusable with --imatrix; such a run does not resume)", metavar="FILE")
    max_memory: int | None = _option(
        "--max-memory", "memory the calibration may use, e.g. 8GB or 6GiB (default: 8 GB or half the machine's, the "
        "smaller): where the work of one pass fits in it, it is kept for reuse instead of being computed again "
        "(Whisper + tarq/rarebal: the alignment pass's encoder). It never changes the result", parse=memory_size,
        metavar="SIZE")
    threads: int | None = _option(
        "--threads", "CPU threads of the calibration (default: torch's, one per core); the same inputs, seed, "
        "processor kind and threads give the same bytes", parse=thread_count, metavar="N")

    @classmethod
    def from_values(cls, values: Mapping[str, Any]) -> "QuantizeArguments":
        """The arguments from parsed values by field name (the command's parsed options; unknown names ignored)."""
        known = {f.name for f in fields(cls)}
        given = {name: value for name, value in values.items() if name in known}
        if given.get("tensor_type") is not None:
            given["tensor_type"] = tuple(given["tensor_type"])
        return cls(**given)

    def inputs(self) -> list[tuple[str, str | None]]:
        """What quantize reads, by option: no output may lie over them."""
        return [("--model", self.model), ("--calib", self.calib), ("--recipe-from", self.recipe_from),
                ("--imatrix", self.imatrix), ("--terms", self.terms)]


def quantize_options() -> Iterator[tuple[str, Option, Any]]:
    """(name, how it is spelled, default) of every argument of QuantizeArguments, in their order."""
    for f in fields(QuantizeArguments):
        yield f.name, f.metadata["option"], (None if f.default is MISSING else f.default)


def add_quantize_arguments(parser: argparse.ArgumentParser) -> None:
    """The schema's options on an argparse parser (the command line's spelling of QuantizeArguments)."""
    for name, option, default in quantize_options():
        how: dict[str, Any] = {"dest": name, "help": option.help}
        if option.kind == "flag":
            how["action"] = "store_true"
        elif option.kind == "switch":
            how.update(action=argparse.BooleanOptionalAction, default=default)
        else:
            how.update(type=option.parse, choices=option.choices, metavar=option.metavar)
            if option.kind == "repeat":
                how.update(action="append", default=[])
            elif option.required:
                how["required"] = True
            else:
                how["default"] = default
        parser.add_argument(option.flag, **{k: v for k, v in how.items() if v is not None or k == "default"})


def parse_option_value(option: Option, text: str) -> Any:
    """``text`` read as the command line reads it: ValueError naming the problem."""
    if option.choices is not None and text not in option.choices:
        raise ValueError(f"{text!r} is not one of {', '.join(option.choices)}")
    try:
        return (option.parse or str)(text)
    except (TypeError, ValueError, argparse.ArgumentTypeError) as e:
        detail = str(e) if isinstance(e, argparse.ArgumentTypeError) else "not a valid value"
        raise ValueError(f"{text!r}: {detail}") from None


def option_value_problem(option: Option, value: Any) -> str | None:
    """Why a table's ``value`` (TOML: true/false for a flag or switch, one string or number otherwise) would not be
    read as the option reads it, or None. False of a flag is its default; of a switch it is --no-NAME."""
    if option.kind in ("flag", "switch"):
        if not isinstance(value, bool):
            return f"is a flag: true or false, not {value!r}"
        if value is False and option.kind == "flag":
            return "false is the default: leave it out"
        return None
    if isinstance(value, (bool, list, dict)):
        return f"takes one value (a string or number), not {value!r}"
    try:
        parse_option_value(option, str(value))
    except ValueError as e:
        return str(e)
    return None


@dataclass
class Importance:
    """A ready-made importance matrix (weight name -> float32 [n_in]) and where it came from, for the record."""

    vectors: dict[str, Any]
    origin: dict

    def of(self, name: str) -> Any:
        if name not in self.vectors:
            raise UserError(f"the importance matrix ({self.origin.get('file', 'given')}) has no entry for {name}: it "
                            f"was made for another model")
        return self.vectors[name]


# The fields of QuantizeOptions that are no knob of the result: where the work runs, and what it was built from.
NOT_RESULT_KNOBS = ("device", "max_memory", "model", "arguments", "terms", "terms_absent")
# Knobs a run without them never recorded: left out of the record (and so of the resume key) at these values.
UNRECORDED_AT = {"preset": None, "rotate": "none", "compute_dtype": "float32", "refit_scales": False,
                 "lookup_pass": False, "tail": "zipf", "language": DEFAULT_LANGUAGE, "terms_sha256": None,
                 "decoder_shape": "plain", "nonspeech_share": 0.0}


@dataclass(frozen=True)
class QuantizeOptions:
    """Everything that decides a calibration's result, and what it was built from. The same options, model, corpus
    and seed give the same checkpoint bytes."""

    method: str = "tarq"
    bits: int = 4
    group_size: int = 32
    scheme: str = "symmetric"  # the lattice scheme (lattice.py); --type picks it with bits and group size
    scale_grid: str = "float16"  # "bfloat16": scales exact in bf16 too, for bf16 runtimes (lattice.py)
    tensor_types: tuple[tuple[str, str], ...] = ()  # (pattern, ggml type) overrides, first match wins (recipe.py)
    preset: str | None = None  # transcribe.cpp's mix (quant/presets.py) that tensor_types was resolved from
    zipf_threshold: float = DEFAULT_ZIPF_THRESHOLD
    # The tail (data/rarity.py TailRule): rare words ("zipf"), the term list's words ("terms") or both, in the
    # transcripts' language. The terms are a knob by their file's digest (terms_sha256).
    tail: str = "zipf"
    language: str = DEFAULT_LANGUAGE
    terms: TermList | None = field(default=None, compare=False, repr=False)
    terms_sha256: str | None = None
    cost_ratio: float = 1.0
    source: str = "rare"  # the positions re-weighted as the tail (--reweight-source)
    n_calib: int = 128
    pool: str = "random"
    seed: int = 0
    encoder_tagging: str = "auto"  # "align", "none", or auto: align only where the metric re-weights rare positions
    pack: bool = True
    decoder_shape: str = "plain"  # Whisper: the decoder's calibration token shape (models/whisper_prompts.py)
    nonspeech_share: float = 0.0  # Whisper: non-speech windows, this share of the speech windows (models/whisper.py)
    head_identity_weight: float = DEFAULT_HEAD_IDENTITY_WEIGHT
    percdamp: float = PERCDAMP
    scale_rule: str = "search"
    act_order: bool = True
    alpha_rule: str = "one"
    # Two-level lattices: refit the sub-block scale codes after the sweep (scale_refit.py; on by the dev split,
    # results/refit). The solver's own TarqConfig takes this value from here (solver()), so there is one default.
    refit_scales: bool = REFIT_SCALES_BY_DEFAULT
    device: str = "cpu"
    # Bytes of memory the calibration may take (None: DEFAULT_MAX_MEMORY, or half the machine's memory if that is
    # less). It decides whether work is kept for reuse (Whisper: the alignment pass's fp encoder), never the result.
    max_memory: int | None = None
    # An exact rotation of the weights before anything else ("heads": per attention head, Whisper only;
    # models/whisper_rotation.py). The model computes the same function; its weights round differently.
    rotate: str = "none"
    # The forward passes' precision: "float32", or "bfloat16" autocast (precision.py; an opt-in: the dev split
    # moved by a few percent). The second moments and the solver stay float32/float64.
    compute_dtype: str = "float32"
    # Whisper's tied head: calibrate the decoder a second time with the first head's lattice as the quantized stream's
    # token lookup, and keep the first head (quantize_with_lookup_pass; results/lookup-pass).
    lookup_pass: bool = False
    # The terms of --terms no calibration utterance holds (for_corpus): said before any work, kept in the run's log.
    terms_absent: tuple[str, ...] = field(default=(), compare=False)
    # What the options were built from (build()): the model source, resolved once, and the arguments as given.
    model: ModelSource | None = field(default=None, compare=False, repr=False)
    arguments: QuantizeArguments | None = field(default=None, compare=False, repr=False)

    # -- what the pipeline reads ------------------------------------------------------------------------------------
    def solver(self) -> TarqConfig:
        from ..quant.tarq import TarqConfig

        return TarqConfig(method=self.method, source=self.source, c=self.cost_ratio, percdamp=self.percdamp,
                          scale_rule=self.scale_rule, act_order=self.act_order, alpha_rule=self.alpha_rule,
                          refit_scales=self.refit_scales)

    def tail_rule(self) -> TailRule:
        """Which reference words are the tail (calibration tags, the rare-biased pools, the summary's counts)."""
        from ..data.rarity import TailRule

        return TailRule(k=self.zipf_threshold, language=self.language, mode=self.tail, terms=self.terms)

    def calibration_utterances(self, utterances: list[Utterance]) -> list[Utterance]:
        """The utterances calibration reads: --n-calib of them by --pool and --seed, ranked by the tail."""
        from ..data.corpus import select_pool

        return select_pool(utterances, self.pool, min(self.n_calib, len(utterances)), self.seed, self.tail_rule())

    def for_corpus(self, utterances: list[Utterance], log: Callable[[str], None] = print) -> "QuantizeOptions":
        """The options settled by the calibration corpus, before any model work: the language (the manifest's own
        unless --language says), and the term list checked against the utterances calibration will read -- the
        terms they never hold named, and a tail of terms alone refused when none occurs."""
        options = self if self.arguments is None or self.arguments.language else \
            replace(self, language=_corpus_language(utterances))
        options._check_language()
        if options.terms is not None:
            absent = _report_term_coverage(options, options.calibration_utterances(utterances), log)
            options = replace(options, terms_absent=tuple(absent))
        return options

    def frame_tagging(self) -> str:
        """How encoder frames are tagged. The alignment pass (a full-precision run of the whole model per window) only
        splits H into H_common and H_tail; a method whose metric is their sum (gptq, residual, imatrix) would add
        them up again, so ``auto`` runs it only for the methods that re-weight the tail (tarq, rarebal)."""
        if self.encoder_tagging != "auto":
            return self.encoder_tagging
        return "align" if self.solver().uses_rarebal else "none"

    def spec(self) -> LatticeSpec:
        from ..quant.lattice import LatticeSpec

        return LatticeSpec(self.bits, self.group_size, self.scheme, self.scale_grid)

    def recipe(self) -> TypeRecipe:
        from ..quant.recipe import TypeRecipe

        return TypeRecipe.from_types(self.spec(), self.tensor_types)

    def result_knobs(self) -> dict:
        """The options that shape the result (not where it runs, nor what they were built from)."""
        knobs = asdict(replace(self, model=None, arguments=None, terms=None))
        for name in NOT_RESULT_KNOBS:
            knobs.pop(name)
        for knob, unset in UNRECORDED_AT.items():
            if knobs[knob] == unset:  # a run without it keeps the knobs (and so the resume key) it always had
                knobs.pop(knob)
        return knobs

    @property
    def needs_corpus(self) -> bool:
        """Whether the run reads a calibration corpus (not for data-free rounding, nor an importance file)."""
        return self.method not in DATA_FREE_METHODS and not (self.arguments and self.arguments.imatrix)

    @property
    def is_whisper(self) -> bool:
        """Whether the model is Whisper, asked of the source resolved once (a config.json that is not JSON: no)."""
        return self.model is not None and self.model.config_error is None and \
            self.model.assumed_model_type == "whisper"

    # -- built from the arguments ---------------------------------------------------------------------------------
    @classmethod
    def build(cls, arguments: QuantizeArguments, model: ModelSource,
              log: Callable[[str], None] = print) -> "QuantizeOptions":
        """The options ``arguments`` ask for on ``model`` (resolved by the caller), every default settled and every
        rule that needs no weights checked (UserError naming the option)."""
        a = arguments
        options = cls(model=model, arguments=a)  # what the choices below ask of the model
        preset = options._preset_choice()
        type_name = a.type or (PRESETS[preset].main if preset else None)
        scheme, bits, group = options._lattice_choice(type_name)
        options = replace(
            options, method=a.method, bits=bits, group_size=group, scheme=scheme, scale_grid=a.scale_dtype,
            tensor_types=() if preset else options._tensor_type_choice(log),  # a preset's: by shape, once loaded
            preset=preset, zipf_threshold=a.zipf_threshold, **_tail_choice(a), cost_ratio=a.cost_ratio,
            source=a.reweight_source,
            n_calib=a.n_calib, pool=a.pool, seed=a.seed, encoder_tagging=a.encoder_tagging, pack=not a.no_pack,
            head_identity_weight=_head_identity_choice(a, type_name), scale_rule=a.scale_rule,
            act_order=a.act_order, alpha_rule=a.alpha_rule, refit_scales=a.refit_scales, device=a.device,
            max_memory=a.max_memory)
        options = replace(options, rotate=options._rotation_choice(type_name),
                          decoder_shape=options._decoder_shape_choice(),
                          nonspeech_share=options._nonspeech_share_choice(),
                          lookup_pass=options._lookup_pass_choice(type_name),
                          compute_dtype=options._compute_dtype_choice())
        options.validate()
        return options

    def _measured_for_whisper(self, type_name: str | None, pairs: frozenset) -> bool:
        """Whether an ``auto`` Whisper-only step is on: ``pairs`` names the method and type, and the model is
        Whisper."""
        return (self.arguments.method, type_name) in pairs and self.is_whisper

    def _rotation_choice(self, type_name: str | None) -> str:
        """--rotate as given, or for auto: heads where the dev split measured it (ROTATE_HEADS_BY_DEFAULT), else
        none."""
        if self.arguments.rotate != "auto":
            return self.arguments.rotate
        return "heads" if self._measured_for_whisper(type_name, ROTATE_HEADS_BY_DEFAULT) else "none"

    def _lookup_pass_choice(self, type_name: str | None) -> bool:
        """--lookup-pass as given, or for auto: on where the dev split measured it (LOOKUP_PASS_BY_DEFAULT)."""
        if self.arguments.lookup_pass != "auto":
            return self.arguments.lookup_pass == "on"
        return self._measured_for_whisper(type_name, LOOKUP_PASS_BY_DEFAULT)

    def _compute_dtype_choice(self) -> str:
        """--compute-dtype resolved (auto: bfloat16 where the processor multiplies it natively); float32 for a run
        that computes nothing (rtn, ggml, imatrix from a file), so its manifest names no precision it did not use."""
        from ..quant.precision import resolve_compute_dtype

        if not self.needs_corpus:
            return "float32"
        return resolve_compute_dtype(self.arguments.compute_dtype, self.arguments.device)

    def _lattice_choice(self, type_name: str | None) -> tuple[str, int, int]:
        """(scheme, bits, group size) from --type (or a preset's main type), --bits, --group-size and --target."""
        a = self.arguments
        group = a.group_size if a.group_size is not None else DEFAULT_GROUP_SIZE[a.target]
        if type_name is None:
            return "symmetric", a.bits if a.bits is not None else 4, group
        if a.target not in GGML_TARGETS:
            raise UserError(f"--type {type_name}: ggml types are for the ggml targets ({', '.join(GGML_TARGETS)}); "
                            f"--target {a.target} stores a 4-bit symmetric lattice (use --bits / --group-size)")
        scheme, bits, native_group = GGML_TYPES[type_name]
        if a.bits is not None and a.bits != bits:
            raise UserError(f"--bits {a.bits}: --type {type_name} stores {bits}-bit codes (leave --bits out)")
        if scheme != "symmetric" and a.group_size is not None and a.group_size != native_group:
            raise UserError(f"--group-size {a.group_size}: --type {type_name} has one group of {native_group} values "
                            f"per scale (leave --group-size out)")
        return scheme, bits, group if scheme == "symmetric" else native_group

    def _preset_choice(self) -> str | None:
        """--tensor-type q4_k_m / q5_k_m (any case): transcribe.cpp's preset, whose per-tensor types need the model's
        shapes (resolved once it is loaded); checked here against the target, the model and --type."""
        a = self.arguments
        named = [(text, key) for text in a.tensor_type if (key := find_preset(text))]
        if not named:
            return None
        given, key = named[0]
        preset = PRESETS[key]
        if len(a.tensor_type) > 1:
            raise UserError(f"--tensor-type {given}: a preset writes the whole recipe; give it alone")
        if a.target != PRESET_TARGET:
            raise UserError(f"--tensor-type {given}: the presets are {PRESET_TARGET}'s bucket policy; use --target "
                            f"{PRESET_TARGET}")
        if a.type is not None and a.type != preset.main:
            raise UserError(f"--type {a.type}: preset {preset.name} quantizes weight matrices to {preset.main} "
                            f"(leave --type out)")
        if not self.is_whisper:
            raise UserError(f"--tensor-type {given}: {PRESET_TARGET} files are written for Whisper models only so "
                            f"far; --model {a.model} is not one")
        return key

    def _tensor_type_choice(self, log: Callable[[str], None]) -> tuple[tuple[str, str], ...]:
        """The --tensor-type overrides, each checked; a mix for whisper.cpp (one type per .bin), or for a Whisper
        model on CrispASR (which runs it from that .bin), is refused."""
        from ..quant.recipe import parse_tensor_type

        a = self.arguments
        if a.tensor_type and a.target not in GGUF_TARGETS:
            raise UserError(f"--tensor-type {a.tensor_type[0]}: --target {a.target} holds one type for all weight "
                            f"matrices; per-tensor mixes are for the GGUF targets ({', '.join(GGUF_TARGETS)})")
        if a.tensor_type and a.target == "crispasr" and self.is_whisper:
            raise UserError(f"--tensor-type {a.tensor_type[0]}: --target crispasr runs Whisper from whisper.cpp's "
                            f".bin (the crispasr wheel reads no Whisper GGUF), which holds one type for every weight "
                            f"matrix; quantize Whisper with one --type (CrispASR's per-tensor mixes are for Qwen3-ASR "
                            f"GGUF)")
        if "auto" in a.tensor_type:
            return _auto_tensor_types(a, log)
        try:
            return tuple(parse_tensor_type(text) for text in a.tensor_type)
        except ValueError as e:
            raise UserError(f"--tensor-type {e}") from None

    # -- checked before any slow work -----------------------------------------------------------------------------
    def validate(self) -> "QuantizeOptions":
        """Every rule that needs no weights (UserError naming the option); the options themselves. Whether this
        machine has the --device is asked apart (``check_machine``): a sweep validates cells another node runs."""
        from ..quant.lattice import SUPPORTED_BITS, SUPPORTED_GROUP_SIZES

        if self.scheme == "symmetric" and self.bits not in SUPPORTED_BITS:
            raise UserError(f"--bits {self.bits}: must be one of {', '.join(map(str, SUPPORTED_BITS))}")
        if self.scheme == "symmetric" and self.group_size not in SUPPORTED_GROUP_SIZES:
            raise UserError(f"--group-size {self.group_size}: must be one of "
                            f"{', '.join(map(str, SUPPORTED_GROUP_SIZES))} (-1: one scale per row)")
        if self.scale_grid != "float16":
            self._check_scale_grid()
        if not self.cost_ratio > 0:
            raise UserError(f"--cost-ratio {self.cost_ratio}: must be positive")
        if self.method in GGML_QUANTIZER_METHODS:
            self._check_ggml_quantizer()
        if self.arguments is not None:
            self._check_inputs()
        if self.rotate != "none":
            self._check_rotation()
        if self.lookup_pass:
            self._check_lookup_pass()
        if self.head_identity_weight < 0:
            raise UserError(f"--head-identity-weight {self.head_identity_weight}: must not be negative")
        self._check_tail()
        if self.decoder_shape != "plain":
            self._check_decoder_shape()
        if self.nonspeech_share != 0.0:
            self._check_nonspeech_share()
        return self

    def _decoder_shape_choice(self) -> str:
        """--decoder-shape as given, else DECODER_SHAPE_BY_DEFAULT for a Whisper model; plain wherever no corpus is
        read (the rounding methods, an --imatrix file: no calibration decoder runs, so a sweep's shape for every
        cell leaves theirs as it was)."""
        given = self.arguments.decoder_shape if self.arguments is not None else None
        if not self.needs_corpus:
            return "plain"
        if given is not None:
            return given
        return DECODER_SHAPE_BY_DEFAULT if self.is_whisper else "plain"

    def _check_decoder_shape(self) -> None:
        """--decoder-shape: Whisper's token shapes only."""
        if self.model is not None and not self.is_whisper:
            raise UserError(f"--decoder-shape {self.decoder_shape}: only Whisper's decoder has timestamp tokens and a "
                            f"carried prompt; --model {self.model.text} is not a Whisper model")

    def _nonspeech_share_choice(self) -> float:
        """--nonspeech-share as given, else 0; 0 wherever no corpus is read (no calibration window is built)."""
        given = self.arguments.nonspeech_share if self.arguments is not None else None
        return 0.0 if given is None or not self.needs_corpus else given

    def _check_nonspeech_share(self) -> None:
        """--nonspeech-share: a share in [0, 1] (finite), for Whisper, whose decoder predicts the end of text."""
        if not (0.0 <= self.nonspeech_share <= 1.0):
            raise UserError(f"--nonspeech-share {self.nonspeech_share}: must be between 0 and 1 (a share of the "
                            f"speech windows)")
        if self.model is not None and not self.is_whisper:
            raise UserError(f"--nonspeech-share {self.nonspeech_share}: non-speech windows are built for Whisper "
                            f"only; --model {self.model.text} is not a Whisper model")

    def _check_tail(self) -> None:
        """--tail and --terms: a tail of terms needs the list, and only a method that re-weights the tail reads it."""
        if self.tail != "zipf" and self.terms is None:
            raise UserError(f"--tail {self.tail}: needs --terms FILE (the term list whose words are the tail)")
        if self.terms is not None and not self.solver().uses_rarebal:
            raise UserError(f"--terms {self.terms.path}: method {self.method!r} does not re-weight the tail, so the "
                            f"term list would change nothing (use --method tarq or rarebal)")
        if self.arguments is not None and self.arguments.language:
            self._check_language()

    def _check_language(self) -> None:
        """The language names a wordfreq table this machine can read, where the tail reads Zipf scores."""
        from ..data.rarity import language_problem

        if not _LANGUAGE_CODE.fullmatch(self.language):
            raise UserError(f"--language {self.language}: not a language code (e.g. en, de, zh)")
        problem = language_problem(self.language) if self.tail != "terms" else None
        if problem is not None:
            raise UserError(f"--language {self.language}: {problem}; rare words cannot be told (use --tail terms "
                            f"with --terms FILE)")

    def check_machine(self) -> "QuantizeOptions":
        """This machine can run them: the --device is here (UserError naming it)."""
        from ..checks import check_device

        check_device(self.device)
        return self

    def _check_inputs(self) -> None:
        """--calib, --imatrix and --save-imatrix: what the method reads and writes."""
        a = self.arguments
        for flag, value in (("--imatrix", a.imatrix), ("--save-imatrix", a.save_imatrix)):
            if value and self.method != "imatrix":
                raise UserError(f"{flag} {value}: an importance matrix is for --method imatrix, not {self.method}")
        if a.imatrix and a.save_imatrix:
            raise UserError("--save-imatrix: with --imatrix the matrix is read, not gathered; give one of the two")
        if a.imatrix and a.calib:
            raise UserError(f"--calib {a.calib}: with --imatrix nothing is calibrated; leave --calib out")
        if self.needs_corpus:
            if not a.calib:
                raise UserError(f"--calib is required for method {self.method!r}")
            if self.n_calib < 1:
                raise UserError(f"--n-calib {self.n_calib}: method {self.method!r} needs at least 1 calibration "
                                f"utterance (use --method rtn for data-free rounding)")

    def _check_scale_grid(self) -> None:
        """A bf16 scale grid is a property of one symmetric lattice that our solvers choose."""
        grid = f"--scale-dtype {self.scale_grid}"
        if self.scheme != "symmetric":
            type_name = self.arguments.type if self.arguments else None
            raise UserError(f"{grid}: --type {type_name}'s lattice is {self.scheme}; the grid is for symmetric "
                            f"lattices (q4_0, q5_0, q8_0, or --bits)")
        if self.tensor_types:
            raise UserError(f"{grid}: applies to one lattice, not to a --tensor-type mix")
        if self.method in GGML_QUANTIZER_METHODS:
            raise UserError(f"{grid}: --method {self.method} is ggml's own quantizer, whose scales are plain float16")

    def _check_ggml_quantizer(self) -> None:
        """imatrix and ggml call ggml's own quantizer, which writes one ggml type at its own grouping."""
        native = {(scheme, bits): (name, group) for name, (scheme, bits, group) in GGML_TYPES.items()}
        found = native.get((self.scheme, self.bits))
        if found is None:
            raise UserError(f"--method {self.method}: ggml's quantizer writes ggml types only; a {self.bits}-bit "
                            f"{self.scheme} lattice is none of them (pick --type)")
        if self.group_size != found[1]:
            raise UserError(f"--method {self.method}: ggml's {found[0]} quantizer writes groups of {found[1]}; got "
                            f"--group-size {self.group_size}")
        if self.method == "ggml" and found[0] in GGML_NEEDS_IMPORTANCE:
            raise UserError(f"--method ggml: ggml's {found[0]} quantizer needs an importance matrix (use --method "
                            f"imatrix)")

    def _check_rotation(self) -> None:
        """--rotate rotates Whisper's attention heads; Qwen3-ASR and Voxtral have no exact rotation here."""
        a = self.arguments or QuantizeArguments()
        if a.imatrix:
            raise UserError(f"--rotate {self.rotate}: --imatrix {a.imatrix} holds importances of the unrotated "
                            f"model's inputs (out_proj's inputs turn with the rotation); calibrate with --method "
                            f"imatrix instead")
        if a.save_imatrix:
            raise UserError(f"--rotate {self.rotate}: --save-imatrix {a.save_imatrix} would hold the rotated model's "
                            f"importances, which fit no other run; save it from an unrotated run")
        if self.model is not None and not self.is_whisper:
            raise UserError(f"--rotate {self.rotate}: rotates Whisper's attention heads; --model {self.model.text} is "
                            f"not a Whisper model (use --rotate none)")

    def _check_lookup_pass(self) -> None:
        """--lookup-pass on calibrates a Whisper model's decoder twice: it needs a calibration and a tied head."""
        if self.method in DATA_FREE_METHODS or self.method == "imatrix":
            raise UserError(f"--lookup-pass on: method {self.method!r} calibrates no decoder block against the "
                            f"lookup (use gptq, rarebal, residual or tarq, or --lookup-pass off)")
        if self.model is not None and not self.is_whisper:
            raise UserError(f"--lookup-pass on: only Whisper's head is its token lookup; --model {self.model.text} is "
                            f"not a Whisper model (use --lookup-pass off)")

    # -- checked once the model is loaded --------------------------------------------------------------------------
    def check_backbone(self, backbone: Any, importance: Importance | None = None) -> None:
        """The rules that need the loaded model (UserError naming the tensor): finite weights, every Linear's width
        divisible by its lattice's groups, and an importance matrix (--imatrix) holding this model's tensors."""
        model_text = self.model.text if self.model is not None else "the model"
        for name, tensor in backbone.model.state_dict().items():
            problem = nonfinite_problem(tensor)
            if problem is not None:
                raise UserError(f"--model {model_text}: tensor {name} holds {problem}; refusing to quantize "
                                f"non-finite weights")
        recipe = self.recipe()
        for block, rel in _linears(backbone):
            columns, name = block.linear(rel).in_features, block.full_name(rel)
            spec = recipe.spec_for(f"{name}.weight")
            try:
                spec.check_columns(columns)
            except ValueError:
                raise UserError(self._width_problem(spec, name, columns)) from None
            if importance is not None:
                _check_importance(importance, f"{name}.weight", columns)

    def _width_problem(self, spec: LatticeSpec, layer: str, columns: int) -> str:
        """The one-line refusal for a Linear whose width the lattice cannot split, naming the types that would
        work."""
        if spec.two_level:
            fitting = [name for name, (scheme, _, group) in GGML_TYPES.items()
                       if not scheme.startswith(("k-", "grid-")) and columns % group == 0]
            name = next(n for n, (scheme, bits, _) in GGML_TYPES.items() if (scheme, bits) == (spec.scheme, spec.bits))
            given = self.arguments.type if self.arguments else None
            option = f"--type {given}" if given == name else f"--tensor-type (type {name})"
            return (f"{option}: {layer} has {columns} input columns, not a multiple of {K_QUANT_ROW} (the K-quant "
                    f"super-block); types that fit this model: {', '.join(fitting)}")
        return (f"--group-size {spec.group_size}: {layer} has {columns} input columns, not a multiple of it "
                f"(try 32 or -1)")


def _linears(backbone: Any) -> Iterator[tuple[Any, str]]:
    """(block, Linear name within it) of every Linear the backbone calibrates, in calibration order."""
    for stage in backbone.stages():
        for block in stage.blocks:
            for group in block.groups:
                for rel in group:
                    yield block, rel


def _check_importance(importance: Importance, name: str, columns: int) -> None:
    """An importance file's entry for weight ``name``: present, ``columns`` values, finite and non-negative."""
    file = importance.origin.get("file", "the importance matrix")
    vector = importance.vectors.get(name)
    if vector is None:
        raise UserError(f"--imatrix {file}: holds no importance for tensor {name}; it was made for another model")
    values = vector.reshape(-1)
    if values.numel() != columns:
        raise UserError(f"--imatrix {file}: tensor {name} has {values.numel()} importance values, the model's Linear "
                        f"has {columns} input columns; it was made for another model")
    if not bool(values.isfinite().all()) or bool((values < 0).any()):
        raise UserError(f"--imatrix {file}: tensor {name}'s importance values are not all finite and non-negative")


_LANGUAGE_CODE = re.compile(r"[a-z]{2,3}")


def _tail_choice(a: QuantizeArguments) -> dict:
    """--tail, --terms and --language as options: the term list read (TermsError -> a UserError naming it)."""
    from ..data.rarity import written_words
    from ..data.terms import TermsError, read_terms

    terms = None
    if a.terms:
        try:
            terms = read_terms(a.terms, written_words)
        except TermsError as e:
            raise UserError(f"--terms {e}") from None
    tail = a.tail or ("both" if terms is not None else "zipf")
    return {"tail": tail, "terms": terms, "terms_sha256": terms.sha256 if terms else None,
            "language": (a.language or DEFAULT_LANGUAGE).lower()}


def _corpus_language(utterances: list[Utterance]) -> str:
    """The language the corpus's entries name (DEFAULT_LANGUAGE when none does); several: refused, naming them."""
    named = sorted({u.language for u in utterances if u.language})
    if len(named) > 1:
        raise UserError(f"--calib: its entries are in {len(named)} languages ({', '.join(named)}); calibrate one "
                        f"language at a time or say which rarity table to read with --language")
    return named[0] if named else DEFAULT_LANGUAGE


SHOWN_ABSENT_TERMS = 40  # a long list's absent terms are named in full in the run's log, not on the screen


def _report_term_coverage(options: QuantizeOptions, chosen: list[Utterance],
                          log: Callable[[str], None]) -> list[str]:
    """Name the terms no calibration utterance holds (returned); refuse a tail of terms alone when none occurs."""
    from ..data.rarity import term_match_words
    from ..data.terms import find_terms

    forms = options.terms.word_forms(term_match_words)
    found = {o.term for u in chosen for o in find_terms(term_match_words(u.text), forms)}
    missing = [t.text for i, t in enumerate(options.terms.terms) if i not in found]
    if not found and options.tail == "terms":
        raise UserError(f"--terms {options.terms.path}: none of its {len(forms)} terms occurs in the {len(chosen)} "
                        f"calibration utterances, so the tail would be empty (use --tail both, or a corpus that "
                        f"holds them: tarq-deploy corpus synth --terms)")
    shown = ", ".join(missing[:SHOWN_ABSENT_TERMS])
    more = len(missing) - SHOWN_ABSENT_TERMS
    log(f"terms: {len(found)} of {len(forms)} occur in the {len(chosen)} calibration utterances"
        + (f"; never: {shown}" if missing else "")
        + (f" and {more} more (all in the run's log, terms_absent)" if more > 0 else ""))
    return missing


def _head_identity_choice(a: QuantizeArguments, type_name: str | None) -> float:
    """--head-identity-weight as given, else the default measured for the method and type (choices.py)."""
    if a.head_identity_weight is not None:
        return a.head_identity_weight
    return HEAD_IDENTITY_WEIGHT_BY_DEFAULT.get((a.method, type_name), DEFAULT_HEAD_IDENTITY_WEIGHT)


def _auto_tensor_types(a: QuantizeArguments, log: Callable[[str], None]) -> tuple[tuple[str, str], ...]:
    """--tensor-type auto: the promotions that fit --size-budget, ranked by --recipe-from's measured losses."""
    from ..checkpoint import CheckpointError, read_manifest
    from ..quant.recipe import auto_recipe, promotion_patterns

    if a.tensor_type != ("auto",):
        raise UserError("--tensor-type auto: give it alone (it writes the whole recipe)")
    if a.recipe_from is None or a.size_budget is None:
        raise UserError("--tensor-type auto needs --recipe-from CHECKPOINT_DIR and --size-budget MIB")
    if not a.size_budget >= 0:
        raise UserError(f"--size-budget {a.size_budget}: must be a non-negative number of MiB")
    try:
        manifest = read_manifest(a.recipe_from)
    except CheckpointError as e:
        raise UserError(f"--recipe-from {e}") from None
    base = a.type or "q4_0"
    measured_at = manifest.get("lattice", {}).get("ggml_type")
    if measured_at != base or manifest.get("lattice_overrides"):
        raise UserError(f"--recipe-from {a.recipe_from}: its losses were measured on {measured_at or 'no ggml type'}"
                        f"{' with a mix' if manifest.get('lattice_overrides') else ''}, not on a uniform {base}: "
                        f"calibrate it with --type {base}")
    try:
        chosen = auto_recipe(manifest.get("layers", []), manifest.get("quantized", {}), base, a.promote_to,
                             a.size_budget * (1 << 20))
    except ValueError as e:
        raise UserError(f"--recipe-from {a.recipe_from}: {e}") from None
    spent = sum(c.extra_bytes for c in chosen) / (1 << 20)
    log(f"auto recipe: {len(chosen)} tensors to {a.promote_to} for {spent:.2f} of {a.size_budget:g} MiB"
        + "".join(f"\n  {c.name} (loss {c.score:.4g}, +{c.extra_bytes / (1 << 20):.2f} MiB)" for c in chosen))
    return promotion_patterns(chosen, a.promote_to)
