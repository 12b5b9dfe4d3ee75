"""A sweep file, read into cells and content-addressed steps.

A sweep is the grid models × calibration corpora × methods × types. A *cell* is one point of the grid; its chain of
*steps* (quantize → export → verify → eval / score) each have a *key*: the sha256 of everything the step's output depends
on (the model's bytes, the corpus's bytes, the options, the code version and the keys of the steps before it). A step's
output lives under ``OUT/steps/STEP/KEY`` and is final once its ``done.json`` exists, so a re-run finds finished steps
by their key and an interrupted sweep resumes where it stopped. Steps with the same key are one step: ``rtn`` does not
read the calibration corpus, so its cells under two corpora share their steps.

    [sweep]
    target = "whisper.cpp"            # export target of every cell (whisper.cpp, crispasr or transcribe.cpp)
    methods = ["gptq", "tarq"]        # quantize --method values
    types = ["q4_0", "q8_0"]          # lattice types (see TYPES); "q4_0-g128": a symmetric type whose lattice has
                                      # one scale per 128 input columns (quantize --group-size 128; the file holds
                                      # q4_0 blocks, each carrying its group's scale); for transcribe.cpp
                                      # also its presets "q4_k_m", "q5_k_m" (quantize --tensor-type q4_k_m)
                                      # and the names of [mixes]
    type_methods = { q8_0 = ["ggml"] } # the methods that make a type where not all of `methods` should (a type
                                      # not named here is made by every method)
    baseline = "gptq"                 # the report's paired differences: every method minus this one (or a list:
                                      # every method minus each of them)
    steps = ["quantize", "export", "verify", "eval", "score", "bench"]
    reference = true                  # also export and evaluate each model's F16 file (retention, the bench's F16)

The ``score`` step is the teacher-forced figures of a cell's file against its model's F16 file (KLD, ΔNLL, top-1 on
rare and common positions, both files loaded in PyTorch; ``eval --teacher-forced-only``): it needs
``reference = true``. ``eval`` decodes through the target's runtime.

    [models]                          # name = source (as for `tarq-deploy quantize --model`)
    "tiny.en" = "packaged:tiny.en"

    [calibration]                     # name = manifest, or {manifest = ..., n = 128}
    synth = { manifest = "corpora/synth/calib.jsonl", n = 128 }

    [evaluation]                      # name = manifest
    dev = "corpora/synth/eval.jsonl"

    [mixes]                           # GGUF targets: name = {type = body type, tensor_type = [PATTERN=TYPE,
                                      # ...]} (quantize --type, --tensor-type each; first match wins); a name
                                      # listed in [sweep] types is one grid type
    "q4_k-emb_q6_k" = { type = "q4_k", tensor_type = ["proj_out=q6_k"] }

    [quantize]                        # more `quantize` options for every cell (option = value; true = a flag)
    seed = 0
    [eval]                            # limit, threads, resamples, seed, zipf_threshold, decode, nonspeech,
                                      # terms (a term list: term recall in the report), language, and backends: the
                                      # runtimes each cell's file is decoded by (default: the target's; "torch"
                                      # too loads the same file in PyTorch: backend agreement in the report)
    [bench]                           # audio, threads, runs, warmup

Relative paths are taken from the sweep file's folder. The file is read strictly: a table or key not listed above
(for [quantize]: not an option of `tarq-deploy quantize`) is an error naming it, the keys allowed there and the
nearest one, so a misspelt optional key never leaves its default silently in force.
"""
from __future__ import annotations

import difflib
import functools
import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping

__all__ = ["Cell", "REFERENCE_METHOD", "STEPS", "Step", "Sweep", "TARGETS", "corpus_hash", "ggml_type_of", "load_sweep",
           "model_hash", "plan_cells"]

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

from .. import __version__
from ..errors import UserError
from ..hashing import files_sha256, json_fingerprint
from ..model_source import SourceKind, resolve_source
from ..quant.choices import (DATA_FREE_METHODS, GGML_QUANTIZER_METHODS, GGML_TYPES, GGUF_TARGETS, METHODS,
                             PRESET_TARGET, TARGET_FILE_SUFFIX)

STEPS = ("quantize", "export", "verify", "eval", "score", "bench")
REFERENCE_METHOD = "f16"
METHODS_WITHOUT_DATA = frozenset(DATA_FREE_METHODS)


@dataclass(frozen=True)
class LatticeType:
    """A target type as the quantizer sees it: bits per code and input columns per scale. ``name`` is the grid's
    coordinate: the ggml type, or ``TYPE-gN`` for a symmetric type calibrated at a group size N other than its own
    (``group_option`` is then the quantize --group-size)."""

    name: str
    bits: int
    group_size: int
    body: str = ""  # a preset's or mix's --type (its weight matrices' type, less the overrides); "" = from name
    tensor_types: tuple[str, ...] = ()  # its --tensor-type values: a preset's name, or PATTERN=TYPE rules

    @property
    def ggml_type(self) -> str:
        return self.body or ggml_type_of(self.name)

    @property
    def group_option(self) -> int | None:
        return None if self.body or self.name == self.ggml_type else self.group_size


# The ggml types a lattice is made for (quant/choices.py; each written bit-exactly, quant/ggml_types.py).
TYPES: dict[str, LatticeType] = {name: LatticeType(name, bits, group) for name, (_, bits, group) in GGML_TYPES.items()}
GROUP_SUFFIX = "-g"


def ggml_type_of(type_name: str) -> str:
    """The ggml type a grid type's file holds: q4_0 for q4_0 and for q4_0-g128."""
    return type_name.partition(GROUP_SUFFIX)[0]


# methods that run ggml's own quantizer, which writes each type at its own grouping only
NATIVE_GROUP_METHODS = frozenset(GGML_QUANTIZER_METHODS)
# target -> (runtime that evaluates its files, file suffix): the ggml targets whose runtime runs in a sweep cell
TARGETS: dict[str, tuple[str, str]] = {target: (target, TARGET_FILE_SUFFIX[target])
                                       for target in ("whisper.cpp", "crispasr", "transcribe.cpp")}
MIX_TARGETS = tuple(t for t in GGUF_TARGETS if t in TARGETS)  # the sweep targets whose files hold a type per tensor
MIX_KEYS = ("type", "tensor_type")
EVAL_OPTIONS = {"limit": int, "threads": int, "resamples": int, "seed": int, "zipf_threshold": float, "backends": list,
                "decode": str, "nonspeech": str, "terms": str, "language": str}
BENCH_OPTIONS = {"audio": list, "threads": list, "runs": int, "warmup": int, "decode": str}


@dataclass(frozen=True)
class Corpus:
    name: str
    manifest: Path
    n: int | None = None


@dataclass(frozen=True)
class Step:
    """One unit of work: ``kind`` (a STEPS entry), its key, what it runs, the steps whose outputs it reads (part of
    its key) and the steps it merely waits for (a gate such as verify, not part of its key)."""

    kind: str
    key: str
    params: Mapping[str, Any]
    needs: tuple[str, ...] = ()
    after: tuple[str, ...] = ()

    @property
    def short(self) -> str:
        return f"{self.kind}/{self.key[:16]}"


@dataclass(frozen=True)
class Cell:
    """One grid point: its coordinates and the keys of its steps (in chain order)."""

    model: str
    corpus: str  # "-" for methods that read no corpus and for the reference
    method: str
    type: str
    steps: dict[str, str] = field(default_factory=dict, compare=False)

    @property
    def name(self) -> str:
        return f"{self.model}/{self.corpus}/{self.method}/{self.type}"

    @property
    def slug(self) -> str:
        return "-".join(part.replace("/", "_").replace(" ", "_") for part in (self.model, self.corpus, self.method,
                                                                                self.type))


@dataclass(frozen=True)
class Sweep:
    """The parsed sweep file."""

    path: Path
    target: str
    models: dict[str, str]
    corpora: tuple[Corpus, ...]
    evaluation: dict[str, Path]
    methods: tuple[str, ...]
    types: tuple[LatticeType, ...]
    steps: tuple[str, ...]
    baselines: tuple[str, ...]
    reference: bool
    quantize_options: dict[str, Any]
    eval_options: dict[str, Any]
    bench_options: dict[str, Any]
    type_methods: dict[str, tuple[str, ...]] = field(default_factory=dict)  # type -> its methods, where restricted

    def makes(self, method: str, type_name: str) -> bool:
        """Whether the grid has a cell of ``method`` at ``type_name`` ([sweep] type_methods)."""
        return method in self.type_methods.get(type_name, self.methods)

    @property
    def runtime(self) -> str:
        return TARGETS[self.target][0]

    @property
    def backends(self) -> tuple[str, ...]:
        """The backends every cell's file is decoded by: the target's runtime unless [eval] backends lists others."""
        return tuple(self.eval_options.get("backends", [self.runtime]))


# ------------------------------------------------------------------------------------------------------ reading
def load_sweep(path: str | os.PathLike[str]) -> Sweep:
    """Read and check a sweep file: every error names the file and the entry."""
    source = Path(path)
    try:
        doc = tomllib.loads(source.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise UserError(f"{source}: no such sweep file") from None
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as error:
        raise UserError(f"{source}: not a readable TOML sweep file ({error})") from None
    return _sweep_from(doc, source)


def _sweep_from(doc: dict, source: Path) -> Sweep:
    base = source.resolve().parent
    _check_layout(doc, source)  # first: a misspelt key must not surface as "methods missing" or a silent default
    head = _table(doc, "sweep", source)
    target = head.get("target", "whisper.cpp")
    if not isinstance(target, str) or target not in TARGETS:
        raise UserError(f"{source}: [sweep] target {target!r}: sweeps export to {', '.join(TARGETS)}")
    methods = tuple(_strings(head, "methods", source))
    for method in methods:
        if method not in METHODS:
            raise UserError(f"{source}: [sweep] methods: unknown method {method!r} (known: {', '.join(METHODS)})")
    mixes = _mixes(_table(doc, "mixes", source), target, source)
    types = tuple(mixes[name] if name in mixes else _lattice_type(name, target, source)
                  for name in _strings(head, "types", source, default=["q4_0"]))
    grouped = [t.name for t in types if t.group_option is not None]
    if grouped and any(k.replace("-", "_") == "group_size" for k in _table(doc, "quantize", source)):
        raise UserError(f"{source}: [quantize] group_size and [sweep] types {', '.join(grouped)} both set a group "
                        f"size; keep one")
    native_only = sorted(NATIVE_GROUP_METHODS & set(methods))
    for lattice in types:
        if lattice.group_option is not None and native_only:
            raise UserError(f"{source}: [sweep] types: {lattice.name}: {', '.join(native_only)} run ggml's own "
                            f"quantizer, which writes {lattice.ggml_type} in groups of "
                            f"{TYPES[lattice.ggml_type].group_size} only (use a separate sweep for other group sizes)")
    steps = tuple(_strings(head, "steps", source, default=list(STEPS[:4])))
    for step in steps:
        if step not in STEPS:
            raise UserError(f"{source}: [sweep] steps: unknown step {step!r} (known: {', '.join(STEPS)})")
    baselines = _baselines(head.get("baseline"), methods, source)
    reference = head.get("reference", True)
    if not isinstance(reference, bool):
        raise UserError(f"{source}: [sweep] reference must be true or false, not {reference!r}")
    if "score" in steps and "eval" not in steps:
        raise UserError(f"{source}: [sweep] steps: score's figures are reported beside eval's; add eval")
    if "score" in steps and not reference:
        raise UserError(f"{source}: [sweep] steps: score compares each cell with its model's F16 file; it needs "
                        f"reference = true")
    models = {name: _model_source(_path_text(value, f"[models] {name}", source), base, source)
              for name, value in _table(doc, "models", source).items()}
    if not models:
        raise UserError(f"{source}: [models] names no model")
    corpora = tuple(_corpus(name, value, base, source) for name, value in _table(doc, "calibration", source).items())
    if not corpora and any(m not in METHODS_WITHOUT_DATA for m in methods):
        raise UserError(f"{source}: [calibration] names no corpus, and {', '.join(methods)} need one")
    evaluation = {name: _path(_path_text(value, f"[evaluation] {name}", source), base)
                  for name, value in _table(doc, "evaluation", source).items()}
    if "eval" in steps and not evaluation:
        raise UserError(f"{source}: the eval step needs an [evaluation] table naming at least one manifest")
    for name, manifest in [*((c.name, c.manifest) for c in corpora), *evaluation.items()]:
        if not _exists(manifest, f"corpus {name!r}", source):
            raise UserError(f"{source}: corpus {name!r}: {manifest} does not exist")
    eval_options = _decode_profile(_options(_table(doc, "eval", source), EVAL_OPTIONS, "eval", source), "eval", source)
    for key in ("nonspeech", "terms"):  # a path, relative to the sweep file like every other
        if key in eval_options:
            eval_options[key] = str(_path(eval_options[key], base))  # read (and checked) by eval
    _check_backends(eval_options.get("backends"), TARGETS[target][0], source)
    if "score" in steps and not evaluation:
        raise UserError(f"{source}: the score step needs an [evaluation] table naming at least one manifest")
    sweep = Sweep(source, target, models, corpora, evaluation, methods, types, steps, baselines, reference,
                  _quantize_options(_table(doc, "quantize", source), source),
                  eval_options,
                  _decode_profile(_options(_table(doc, "bench", source), BENCH_OPTIONS, "bench", source), "bench",
                                  source),
                  _type_methods(head.get("type_methods", {}), types, methods, source))
    _check_cells(sweep)
    return sweep


# ----------------------------------------------------------------------------------------- names, read strictly
# Every table and key the reader takes; anything else is a typo that would otherwise leave a default in force.
SWEEP_KEYS = ("target", "methods", "types", "type_methods", "baseline", "steps", "reference")
TABLES = ("sweep", "models", "calibration", "evaluation", "mixes", "quantize", "eval", "bench")
CORPUS_KEYS = ("manifest", "n")
# quantize options a cell sets itself from the grid and the [calibration] table: a [quantize] value would override it
CELL_OPTIONS = frozenset({"model", "method", "target", "type", "tensor_type", "calib", "n_calib", "out"})


def _check_layout(doc: dict, source: Path) -> None:
    """Every top-level name a known table, every key of [sweep], [quantize], [eval], [bench] and of each
    [calibration] entry known; the values are checked where they are read."""
    for name, value in doc.items():
        if name in TABLES:
            continue
        if isinstance(value, dict):
            raise UserError(f"{source}: unknown table `[{name}]` (tables: {', '.join(TABLES)})"
                            f"{_nearest(name, TABLES)}")
        if name in SWEEP_KEYS:
            raise UserError(f"{source}: `{name}` stands before any table header; it belongs in [sweep] (move it "
                            f"under the [sweep] line)")
        raise UserError(f"{source}: unknown key `{name}` before any table header (keys go in a table; [sweep] takes "
                        f"{', '.join(SWEEP_KEYS)}){_nearest(name, SWEEP_KEYS)}")
    _check_keys(_table(doc, "sweep", source), SWEEP_KEYS, "[sweep]", source)
    _check_quantize_keys(_table(doc, "quantize", source), source)
    _check_keys(_table(doc, "eval", source), EVAL_OPTIONS, "[eval]", source)
    _check_keys(_table(doc, "bench", source), BENCH_OPTIONS, "[bench]", source)
    for name, value in _table(doc, "calibration", source).items():
        if isinstance(value, dict):
            _check_keys(value, CORPUS_KEYS, f"[calibration] {name}", source)
    for name, value in _table(doc, "mixes", source).items():
        if isinstance(value, dict):
            _check_keys(value, MIX_KEYS, f"[mixes] {name}", source)


def _check_keys(table: dict, allowed: Iterable[str], where: str, source: Path) -> None:
    allowed = list(allowed)
    for key in table:
        if key not in allowed:
            raise UserError(f"{source}: {where}: unknown key `{key}` (allowed: {', '.join(allowed)})"
                            f"{_nearest(key, allowed)}")


def _nearest(name: str, allowed: Iterable[str]) -> str:
    close = difflib.get_close_matches(name, list(allowed), n=1)
    return f"; did you mean `{close[0]}`?" if close else ""


def _check_quantize_keys(table: dict, source: Path) -> None:
    """[quantize] keys: `tarq-deploy quantize` options by their name (seed, n_calib or n-calib), less those each
    cell sets itself."""
    for key in table:
        if key.replace("-", "_") in CELL_OPTIONS:
            raise UserError(f"{source}: [quantize]: `{key}` is set for each cell by the sweep itself ([sweep] "
                            f"methods, types and target, [mixes], [models], [calibration] with its n); leave it out "
                            f"here")
    _check_keys({key.replace("-", "_"): value for key, value in table.items()}, sorted(_quantize_schema()),
                "[quantize]", source)


def _quantize_options(table: dict, source: Path) -> dict[str, Any]:
    """[quantize] values, each checked as the command will read it (the schema's own parsers and choices), so a bad
    one fails here and not in every cell's calibration (the keys were checked by _check_quantize_keys)."""
    from ..calibration.options import option_value_problem

    schema = _quantize_schema()
    for key, value in table.items():
        problem = option_value_problem(schema[key.replace("-", "_")], value)
        if problem:
            raise UserError(f"{source}: [quantize] {key}: {problem}")
    return dict(table)


@functools.lru_cache(maxsize=1)
def _quantize_schema() -> dict:
    """The quantize options a sweep may set, by name: the schema's (calibration/options.py), less the cell's own."""
    from ..calibration.options import quantize_options

    return {name: option for name, option, _ in quantize_options() if name not in CELL_OPTIONS}


def _check_cells(sweep: "Sweep") -> None:
    """Every cell's quantize options built and validated by the schema itself (QuantizeOptions.build), each model
    resolved once: a contradiction ([quantize] bits against a type, an option the method or the model cannot take,
    ...) fails here, naming the cell, not in every cell's calibration. The --device is not asked of this machine:
    a cell runs on the node that declares what it needs (a GPU calibration on a GPU node)."""
    from ..calibration.options import QuantizeArguments, QuantizeOptions, parse_option_value

    schema = _quantize_schema()
    given = {}
    for key, value in sweep.quantize_options.items():
        option = schema[key.replace("-", "_")]
        given[key.replace("-", "_")] = value if isinstance(value, bool) else parse_option_value(option, str(value))
    corpus = sweep.corpora[0].manifest if sweep.corpora else None
    for model, text in sweep.models.items():
        found = resolve_source(text)
        for lattice in sweep.types:
            group = {} if lattice.group_option is None else {"group_size": lattice.group_option}
            for method in sweep.type_methods.get(lattice.name, sweep.methods):
                arguments = QuantizeArguments(
                    model=text, method=method, target=sweep.target, type=lattice.ggml_type,
                    tensor_type=lattice.tensor_types, calib=None if method in METHODS_WITHOUT_DATA else str(corpus),
                    **{**given, **group})
                try:
                    QuantizeOptions.build(arguments, found, log=lambda _: None)
                except UserError as e:
                    raise UserError(f"{sweep.path}: cell {model} / {method} / {lattice.name}: {e}") from None


def _baselines(value: Any, methods: tuple[str, ...], source: Path) -> tuple[str, ...]:
    """[sweep] baseline: absent, one method or a list of methods, each one of the sweep's."""
    names = [] if value is None else [value] if isinstance(value, str) else value
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise UserError(f"{source}: [sweep] baseline must be a method or a list of methods, not {value!r}")
    for name in names:
        if name not in methods:
            raise UserError(f"{source}: [sweep] baseline {name!r} is not one of the methods")
    return tuple(dict.fromkeys(names))


def _check_backends(backends: list | None, runtime: str, source: Path) -> None:
    """[eval] backends: a non-empty list of distinct names, each the target's runtime or torch (which loads the
    target's file in PyTorch)."""
    if backends is None:
        return
    allowed = (runtime, "torch")
    if not backends or len(set(map(str, backends))) != len(backends) or any(b not in allowed for b in backends):
        raise UserError(f"{source}: [eval] backends must list distinct backends among {', '.join(allowed)} (this "
                        f"target's files run there), not {backends!r}")


def _path_text(value: Any, where: str, source: Path) -> str:
    if not isinstance(value, str):
        raise UserError(f"{source}: {where} must be a string (a path or model name), not {value!r}")
    return value


def _table(doc: dict, name: str, source: Path) -> dict:
    value = doc.get(name, {})
    if not isinstance(value, dict):
        raise UserError(f"{source}: [{name}] must be a table")
    return value


def _strings(table: dict, key: str, source: Path, default: list[str] | None = None) -> list[str]:
    value = table.get(key, default)
    if not isinstance(value, list) or not value or not all(isinstance(v, str) for v in value):
        raise UserError(f"{source}: [sweep] {key} must be a non-empty list of strings")
    return list(dict.fromkeys(value))


def _lattice_type(name: str, target: str, source: Path) -> LatticeType:
    """A ggml type by name, TYPE-gN: a symmetric type at another of the solvers' group sizes, or for transcribe.cpp
    one of its presets (q4_k_m: its per-tensor types, quantize --tensor-type q4_k_m)."""
    from ..quant.lattice import SUPPORTED_GROUP_SIZES
    from ..quant.presets import PRESETS

    if name in PRESETS:
        if target != PRESET_TARGET:
            raise UserError(f"{source}: [sweep] types: {name!r} is {PRESET_TARGET}'s preset; it needs target = "
                            f"\"{PRESET_TARGET}\" (this file's target is {target!r})")
        main = PRESETS[name].main
        return LatticeType(name, TYPES[main].bits, TYPES[main].group_size, main, (name,))
    base, _, group = name.partition(GROUP_SUFFIX)
    if base not in TYPES:
        presets = f", {PRESET_TARGET}'s presets {', '.join(PRESETS)}" if target == PRESET_TARGET else ""
        raise UserError(f"{source}: [sweep] types: unknown type {name!r} (known: {', '.join(TYPES)}{presets}, a "
                        f"[mixes] name, or TYPE-gN for a symmetric type at group size N)")
    if not group:
        return TYPES[base]
    sizes = [g for g in SUPPORTED_GROUP_SIZES if g > 0]
    if GGML_TYPES[base][0] != "symmetric" or not group.isdigit() or int(group) not in sizes:
        symmetric = [t for t, (scheme, _, _) in GGML_TYPES.items() if scheme == "symmetric"]
        raise UserError(f"{source}: [sweep] types: {name!r}: a group size is for the symmetric types "
                        f"({', '.join(symmetric)}), as TYPE-gN with N one of {', '.join(map(str, sizes))}")
    return LatticeType(name, TYPES[base].bits, int(group))


def _type_methods(value: Any, types: tuple[LatticeType, ...], methods: tuple[str, ...],
                  source: Path) -> dict[str, tuple[str, ...]]:
    """[sweep] type_methods: {type = [method, ...]}, each type one of types, each method one of methods."""
    where = f"{source}: [sweep] type_methods"
    if not isinstance(value, dict):
        raise UserError(f"{where} must be a table {{type = [method, ...]}}, not {value!r}")
    names = [t.name for t in types]
    restricted = {}
    for type_name, chosen in value.items():
        if type_name not in names:
            raise UserError(f"{where}: {type_name!r} is not one of [sweep] types ({', '.join(names)})")
        if not isinstance(chosen, list) or not chosen or not all(isinstance(m, str) for m in chosen):
            raise UserError(f"{where}: {type_name} must be a non-empty list of methods")
        for method in chosen:
            if method not in methods:
                raise UserError(f"{where}: {type_name}: {method!r} is not one of [sweep] methods")
        restricted[type_name] = tuple(dict.fromkeys(chosen))
    return restricted


def _mixes(table: dict, target: str, source: Path) -> dict[str, LatticeType]:
    """[mixes]: name = {type = BODY, tensor_type = [PATTERN=TYPE, ...]}, each rule checked as quantize checks it."""
    from ..quant.presets import PRESETS
    from ..quant.recipe import parse_tensor_type

    if table and target not in MIX_TARGETS:
        raise UserError(f"{source}: [mixes]: target {target!r} holds one type for every weight matrix; mixes are for "
                        f"{', '.join(MIX_TARGETS)}")
    mixes = {}
    for name, value in table.items():
        where = f"{source}: [mixes] {name}"
        if not isinstance(value, dict):
            raise UserError(f"{where}: expected {{type = \"q4_k\", tensor_type = [\"PATTERN=TYPE\", ...]}}")
        if name in TYPES or name in PRESETS or GROUP_SUFFIX in name or "/" in name or not name.strip():
            raise UserError(f"{where}: a mix needs a name of its own (not a type or preset, no '/' or "
                            f"'{GROUP_SUFFIX}')")
        body = value.get("type")
        if body not in TYPES:
            raise UserError(f"{where}: type {body!r} must be the body's ggml type, one of {', '.join(TYPES)}")
        rules = value.get("tensor_type")
        if not isinstance(rules, list) or not rules or not all(isinstance(r, str) for r in rules):
            raise UserError(f"{where}: tensor_type must be a non-empty list of \"PATTERN=TYPE\" strings")
        for rule in rules:
            try:
                parse_tensor_type(rule)
            except ValueError as error:
                raise UserError(f"{where}: tensor_type {error}") from None
        mixes[name] = LatticeType(name, TYPES[body].bits, TYPES[body].group_size, body, tuple(rules))
    return mixes


def _path(value: Any, base: Path) -> Path:
    path = Path(str(value)).expanduser()
    return path if path.is_absolute() else base / path


def _exists(path: Path, entry: str, source: Path) -> bool:
    """path.exists(), with a path the OS cannot even look up (a name over NAME_MAX, say) named as the entry's
    error instead of an OSError traceback."""
    try:
        return path.exists()
    except (OSError, ValueError) as error:
        raise UserError(f"{source}: {entry}: {str(path)[:120]!r} is not a usable path ({error})") from None


def _model_source(value: str, base: Path, source: Path) -> str:
    """A model folder beside the sweep file becomes an absolute path; packaged names and hub ids stay as given."""
    local = _path(value, base)
    if resolve_source(value).kind is SourceKind.PACKAGED:
        return value
    return str(local) if _exists(local, f"model {value[:60]!r}", source) else value


def _corpus(name: str, value: Any, base: Path, source: Path) -> Corpus:
    if isinstance(value, str):
        return Corpus(name, _path(value, base))
    if isinstance(value, dict) and isinstance(value.get("manifest"), str):
        n = value.get("n")
        if n is not None and (not isinstance(n, int) or isinstance(n, bool) or n < 1):
            raise UserError(f"{source}: [calibration] {name}: n must be a positive integer")
        return Corpus(name, _path(value["manifest"], base), n)
    raise UserError(f"{source}: [calibration] {name}: expected a manifest path or {{manifest = ..., n = ...}}")


def _options(table: dict, allowed: dict[str, type], name: str, source: Path) -> dict[str, Any]:
    """The values of a table whose keys _check_layout found in ``allowed``, each of its type."""
    for key, value in table.items():
        if not isinstance(value, allowed[key]) or isinstance(value, bool):
            raise UserError(f"{source}: [{name}] {key} must be {allowed[key].__name__}")
    return dict(table)


def _decode_profile(options: dict[str, Any], name: str, source: Path) -> dict[str, Any]:
    """The table's options with its decode profile checked and always present (the default written out), so the
    profile is part of every eval and bench step's identity: a changed default never reuses another's results."""
    from ..runtimes.decoding import DEFAULT_DECODE_PROFILE, check_profile

    try:
        return {**options, "decode": check_profile(options.get("decode", DEFAULT_DECODE_PROFILE))}
    except ValueError as error:
        raise UserError(f"{source}: [{name}] decode: {error}") from None


# ------------------------------------------------------------------------------------------------------ hashing
def model_hash(source: str) -> str:
    """The bytes of a local or packaged model; a hub id (not on this disk) by its name."""
    found = resolve_source(source)
    if found.kind is SourceKind.PACKAGED:
        from ..models.packaged import resolve_packaged

        return files_sha256([resolve_packaged(found.packaged_name)])
    return files_sha256([found.path]) if found.on_disk else json_fingerprint({"hub": source})


def corpus_hash(manifest: Path) -> str:
    """The manifest and every audio file it names (a changed or corrupted clip is a new corpus)."""
    from ..data.corpus import load_corpus

    try:
        utterances = load_corpus(manifest)
    except ValueError as error:  # an unreadable manifest: its bytes are the key; the step that reads it will fail
        return json_fingerprint({"unreadable": str(error), "bytes": files_sha256([manifest])})
    audio = [Path(u.audio) for u in utterances if Path(u.audio).is_file()]
    # a folder source (Kaldi, datasets, LibriSpeech): every file in it
    listed = sorted(p for p in manifest.rglob("*") if p.is_file()) if manifest.is_dir() else [manifest]
    return files_sha256([*listed, *dict.fromkeys(audio)])


# -------------------------------------------------------------------------------------------------------- cells
def plan_cells(sweep: Sweep, model_hashes: Mapping[str, str], corpus_hashes: Mapping[Path, str],
               code: str) -> tuple[list[Cell], dict[str, Step]]:
    """Every cell of the grid with the keys of the steps it runs, and those steps by key (shared steps appear once).
    ``corpus_hashes`` holds every calibration and evaluation manifest's corpus_hash, by path."""
    cells: list[Cell] = []
    steps: dict[str, Step] = {}
    for model, source in sweep.models.items():
        if sweep.reference:
            cells.append(_reference_cell(sweep, model, source, model_hashes[model], corpus_hashes, code, steps))
        for index, corpus in enumerate(sweep.corpora or (Corpus("-", Path()),)):
            for method in sweep.methods:
                if index and method in METHODS_WITHOUT_DATA:
                    continue  # one cell, whatever the corpus
                for lattice in sweep.types:
                    if not sweep.makes(method, lattice.name):
                        continue
                    cells.append(_cell(sweep, model, source, corpus, method, lattice, model_hashes[model],
                                       corpus_hashes, code, steps))
    if "bench" in sweep.steps:
        for model in sweep.models:
            _add_bench(sweep, model, [c for c in cells if c.model == model], code, steps)
    used = {key for cell in cells for key in cell.steps.values()}
    return cells, {key: step for key, step in steps.items() if key in used}  # the chain's unrequested links dropped


def _add(steps: dict[str, Step], kind: str, params: dict[str, Any], needs: tuple[str, ...], code: str,
         after: tuple[str, ...] = ()) -> str:
    key = json_fingerprint({"step": kind, "params": params, "needs": needs, "code": code})
    steps.setdefault(key, Step(kind, key, params, needs, after))
    return key


def _cell(sweep: Sweep, model: str, source: str, corpus: Corpus, method: str, lattice: LatticeType,
          model_key: str, corpus_hashes: Mapping[Path, str], code: str, steps: dict[str, Step]) -> Cell:
    uses_data = method not in METHODS_WITHOUT_DATA
    cell = Cell(model, corpus.name if uses_data else "-", method, lattice.name)
    group = {} if lattice.group_option is None else {"group_size": lattice.group_option}
    quantize = {"model": source, "model_hash": model_key, "method": method, "target": sweep.target,
                "type": lattice.ggml_type, **group, "options": sweep.quantize_options,
                **({"tensor_type": list(lattice.tensor_types)} if lattice.tensor_types else {}),
                **({"calib": str(corpus.manifest), "corpus_hash": corpus_hashes[corpus.manifest], "n_calib": corpus.n}
                   if uses_data else {})}
    chain = {"quantize": _add(steps, "quantize", quantize, (), code)}
    chain["export"] = _add(steps, "export", {"target": sweep.target, "slug": cell.slug}, (chain["quantize"],), code)
    chain["verify"] = _add(steps, "verify", {}, (chain["export"], chain["quantize"]), code)
    gate = (chain["verify"],) if "verify" in sweep.steps else ()
    _add_eval(sweep, cell, chain, (chain["export"],), corpus_hashes, code, steps, gate, source)
    _add_score(sweep, cell, chain, source, model_key, corpus_hashes, code, steps, gate)
    return _with_steps(cell, chain, sweep)


def _reference_cell(sweep: Sweep, model: str, source: str, model_key: str, corpus_hashes: Mapping[Path, str],
                    code: str, steps: dict[str, Step]) -> Cell:
    cell = Cell(model, "-", REFERENCE_METHOD, "f16")
    chain = {"export": _reference_export(sweep, model, source, model_key, code, steps)}
    _add_eval(sweep, cell, chain, (chain["export"],), corpus_hashes, code, steps, (), source)
    return _with_steps(cell, chain, sweep)


def _evaluation_data(sweep: Sweep, corpus_hashes: Mapping[Path, str]) -> dict[str, dict[str, str]]:
    """The evaluation manifests an eval or score step reads, each with its corpus hash (part of the step's key)."""
    return {name: {"manifest": str(path), "hash": corpus_hashes[path]} for name, path in sweep.evaluation.items()}


def _reference_export(sweep: Sweep, model: str, source: str, model_key: str, code: str, steps: dict[str, Step]) -> str:
    """The model's F16 file: the reference cell's export, which every cell's score step reads too."""
    slug = Cell(model, "-", REFERENCE_METHOD, "f16").slug
    return _add(steps, "export", {"target": sweep.target, "slug": slug, "model": source, "model_hash": model_key,
                                  "type": "f16"}, (), code)


def _add_eval(sweep: Sweep, cell: Cell, chain: dict[str, str], needs: tuple[str, ...],
              corpus_hashes: Mapping[Path, str], code: str, steps: dict[str, Step],
              after: tuple[str, ...] = (), source: str = "") -> None:
    if "eval" not in sweep.steps:
        return
    data = _evaluation_data(sweep, corpus_hashes)
    tokenizer = {"tokenizer": source} if "torch" in sweep.backends else {}  # torch reads the file with the model's
    chain["eval"] = _add(steps, "eval", {"label": cell.name, "runtime": sweep.runtime, "data": data,
                                         "options": sweep.eval_options, **tokenizer}, needs, code, after)


def _add_score(sweep: Sweep, cell: Cell, chain: dict[str, str], source: str, model_key: str,
               corpus_hashes: Mapping[Path, str], code: str, steps: dict[str, Step], after: tuple[str, ...]) -> None:
    """The teacher-forced figures of the cell's file against the model's F16 file (the reference cell's export, the
    same key as that cell's): both loaded in PyTorch with the model's own tokenizer."""
    if "score" not in sweep.steps:
        return
    reference = _reference_export(sweep, cell.model, source, model_key, code, steps)
    data = _evaluation_data(sweep, corpus_hashes)
    options = {k: v for k, v in sweep.eval_options.items() if k in ("limit", "zipf_threshold")}
    chain["score"] = _add(steps, "score", {"label": cell.name, "tokenizer": source, "tokenizer_hash": model_key,
                                           "data": data, "options": options}, (chain["export"], reference), code, after)


def _add_bench(sweep: Sweep, model: str, cells: list[Cell], code: str, steps: dict[str, Step]) -> None:
    """One bench per model over all its files, so that speed-ups are ratios measured in one run."""
    exports = tuple(c.steps["export"] for c in cells if "export" in c.steps)
    gates = tuple(c.steps["verify"] for c in cells if "verify" in c.steps)
    key = _add(steps, "bench", {"model": model, "options": sweep.bench_options}, exports, code, gates)
    for cell in cells:
        cell.steps["bench"] = key


def _with_steps(cell: Cell, chain: dict[str, str], sweep: Sweep) -> Cell:
    """The cell with the links of its chain that run: those the sweep asks for, plus what they need (eval needs the
    export it reads, an export the checkpoint it copies)."""
    wanted = set(sweep.steps)
    if wanted & {"verify", "eval", "score", "bench"}:
        wanted.add("export")
    if "export" in wanted:
        wanted.add("quantize")
    return Cell(cell.model, cell.corpus, cell.method, cell.type, {k: v for k, v in chain.items() if k in wanted})
