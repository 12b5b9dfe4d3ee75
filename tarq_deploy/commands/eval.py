"""`tarq-deploy eval`: WER, rare-WER and the rare-word recovery section for any number of models on any number of
datasets, through PyTorch and the real runtimes.

    tarq-deploy eval --data corpora/synth/eval.jsonl --data corpora/real/eval.jsonl \\
        --model F16=packaged:tiny.en --model F16=tiny-f16.bin \\
        --model "TARQ g32=ckpt-tarq-g32" --model "TARQ g32=tiny-tarq-g32-q4_0.bin" --out results/eval

``--model [LABEL=]SOURCE``: a packaged name, a transformers / CTranslate2 directory or hub id, a lattice checkpoint
directory, or a whisper.cpp model file. The backend is inferred from the source (a whisper.cpp file runs in
whisper.cpp, anything else in PyTorch) unless a ``--backend`` follows the ``--model`` (``--model RTN=rtn.bin
--backend torch`` runs ggml's rounding in PyTorch); a ``--backend`` before every ``--model`` is the default for all.
The same label through two backends is the same model; their texts are compared. Hypotheses are cached
under OUT/hypotheses, so an interrupted run resumes where it stopped.

This module parses the arguments and runs the steps in order; the steps live in ``tarq_deploy/evaluate/``
(transcribe.py, near_ties.py, teacher_forced_runs.py, report.py, with their caches in cache.py).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ..checks import Output, check_outputs_apart
from ..data.corpus import TARGET_SAMPLE_RATE, load_audio, load_corpus, refuse_longer_than
from ..data.long_form import manifest_spans
from ..data.rarity import DEFAULT_ZIPF_THRESHOLD, TailRule
from ..data.terms import TermList
from ..errors import UserError
from ..runtimes.base import BackendError, DecodeOptions, ModelSpec
from ..runtimes.decoding import profile_named
from ..runtimes.registry import BY_NAME, infer_runtime
from ..evaluate.dataset import Dataset
from ..evaluate.failure_runs import NonspeechSet, failure_section, nonspeech_section
from ..evaluate.near_ties import near_tie_margins
from ..evaluate.report import (DEFAULT_CONTEXT_WORDS, DEFAULT_EXAMPLES, DEFAULT_NEAR_TIE_MARGIN, DatasetRuns,
                               ModelRun, ReportOptions, build_report, render_markdown)
from ..evaluate.teacher_forced import TEACHER_FORCED_LINES
from ..evaluate.teacher_forced_runs import teacher_forced_figures
from ..evaluate.transcribe import transcribe_models
from ..evaluate.wer import DEFAULT_RESAMPLES, normalizer_description, score_utterance
from ..fileio import write_text_atomic
from ..machine import machine_record
from ..model_source import ModelSource, SourceKind, resolve_source
from ..values import thread_count
from .options import add_decode, add_out

__all__ = ["default_label"]

HELP = "score models (WER, rare-WER, loops, rare-word recovery) on datasets, in PyTorch and in the real runtimes"
EXAMPLE = """  tarq-deploy eval --data clips/eval.jsonl --model f16=base-f16.bin --model tarq=base-q4_0.bin -o runs/eval"""
GENERIC_STEMS = {"eval", "test", "manifest", "data", "calib"}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--data", action="append", required=True, metavar="[NAME=]MANIFEST",
                   help="evaluation corpus (JSONL manifest, NeMo's too; Kaldi/ESPnet data folder; saved datasets "
                        "folder; LibriSpeech folder); repeatable")
    p.add_argument("--audio-column", metavar="NAME",
                   help="the audio column of the --data that are saved datasets folders (default 'audio')")
    p.add_argument("--text-column", metavar="NAME",
                   help="the transcript column of the --data that are saved datasets folders (default: the first "
                        "of text, sentence, transcript, transcription, normalized_text, raw_text)")
    p.add_argument("--model", action=_ModelAction, dest="models", required=True, metavar="[LABEL=]SOURCE",
                   help="model to score; repeatable (label defaults to the source's name)")
    p.add_argument("--backend", action=_BackendAction, dest="models", choices=("auto", *BY_NAME),
                   help="after a --model: that model's backend; before every --model: the default for all; "
                        "default: inferred from the source (a whisper.cpp file -> whisper.cpp, else torch)")
    p.add_argument("--tokenizer", metavar="SOURCE",
                   help="torch backend on a whisper.cpp file: model whose tokenizer and config to use (default: the "
                        "first non-whisper.cpp model given)")
    add_out(p, "directory for report.md, report.json, utterances.jsonl", required=True)
    p.add_argument("--threads", type=thread_count, default=1, metavar="N", help="CPU threads per backend (fixed, for comparable runs)")
    p.add_argument("--jobs", type=int, default=1,
                   help="models transcribed at the same time (e.g. 2 on two cores: a whisper.cpp worker beside a "
                        "PyTorch model); texts do not depend on it, decode times do")
    p.add_argument("--device", default="cpu", help="torch backend device")
    add_decode(p)
    p.add_argument("--limit", type=int, help="only the first N utterances of each dataset")
    p.add_argument("--nonspeech", metavar="MANIFEST",
                   help="non-speech clips (tarq-deploy corpus nonspeech): words each model invents per minute of "
                        "silence, noise, babble and music, against its baseline's")
    p.add_argument("--zipf-threshold", type=float, default=DEFAULT_ZIPF_THRESHOLD, help="rare: Zipf below k")
    p.add_argument("--terms", metavar="FILE",
                   help="a term list (one term per line, as quantize --terms reads it): term recall (occurrences kept "
                        "whole, by alignment), term-WER and the terms each model loses that its baseline keeps, with "
                        "paired intervals; the teacher-forced figures are then taken at the terms' positions")
    p.add_argument("--language", metavar="LANG",
                   help="the datasets' language: the language every backend decodes in, its wordfreq table for "
                        "rarity and its normaliser (CER for a language written without spaces); default: the "
                        "manifests' own language when their entries give one, else en")
    p.add_argument("--resamples", type=int, default=DEFAULT_RESAMPLES, help="bootstrap resamples")
    p.add_argument("--seed", type=int, default=0, help="bootstrap seed")
    p.add_argument("--compare", action="append", default=[], metavar="LABEL_A:LABEL_B",
                   help="extra paired difference A - B within each backend (every model is compared with the first "
                        "model of its backend anyway)")
    p.add_argument("--focus", metavar="LABEL", help="recovery examples: words this label keeps and others drop")
    p.add_argument("--examples", type=int, default=DEFAULT_EXAMPLES, help="recovery examples per dataset")
    p.add_argument("--context", type=int, default=DEFAULT_CONTEXT_WORDS, help="words of context each side")
    p.add_argument("--near-tie-margin", type=float, default=DEFAULT_NEAR_TIE_MARGIN,
                   help="nats: a backend disagreement whose two first differing tokens the PyTorch model scores "
                        "within this margin of each other counts as a near-tie")
    p.add_argument("--reference", metavar="LABEL",
                   help="the full-precision model's label: adds rare-word retention against it (and, with "
                        "--teacher-forced, KLD / delta-NLL / top-1 figures)")
    p.add_argument("--teacher-forced", action="store_true",
                   help="score every label teacher-forced against --reference on the reference transcripts (PyTorch, "
                        "no decoding): KLD, delta-NLL and top-1 agreement on rare and common token positions")
    p.add_argument("--teacher-forced-only", action="store_true",
                   help="only the teacher-forced figures (no decoding): a quick figure to steer calibration by")
    p.add_argument("--quiet", action="store_true", help="no progress bars")


# ---------------------------------------------------------------------------------------------- argument parsing
DEFAULT_ENTRY = ""  # the models list's entry for a --backend given before any --model


class _ModelAction(argparse.Action):
    """--model appends [source, backends given after it]."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        entries = list(getattr(namespace, self.dest, None) or [])
        entries.append([values, []])
        setattr(namespace, self.dest, entries)


class _BackendAction(argparse.Action):
    """--backend belongs to the --model before it; before any --model it sets the default for all."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        entries = list(getattr(namespace, self.dest, None) or [])
        if not entries:
            entries.append([DEFAULT_ENTRY, []])
        entries[-1][1].append(values)
        setattr(namespace, self.dest, entries)


def _split_named(value: str) -> tuple[str | None, str]:
    """'NAME=SOURCE' -> (NAME, SOURCE); a bare source (which may itself contain '=' only if it exists) -> (None, it)."""
    if "=" in value and not Path(value).exists():
        name, _, source = value.partition("=")
        if not name.strip() or not source.strip():
            raise UserError(f"{value!r}: expected LABEL=SOURCE")
        return name.strip(), source.strip()
    return None, value


def default_label(source: str | ModelSource) -> str:
    found = resolve_source(source)
    if found.kind is SourceKind.PACKAGED:
        return found.packaged_name
    path = Path(found.text.rstrip("/"))
    return path.stem if path.suffix == ".bin" else path.name


def model_specs(args: argparse.Namespace) -> list[ModelSpec]:
    entries = [(source, backends) for source, backends in args.models]
    default = "auto"
    if entries and entries[0][0] == DEFAULT_ENTRY:
        default = entries.pop(0)[1][-1]
    for source, backends in entries:
        if len(backends) > 1:
            raise UserError(f"--model {source}: --backend given {len(backends)} times ({', '.join(backends)})")
    parsed = [(label, resolve_source(text), backends)  # each source resolved once, for every question below
              for (label, text), backends in ((_split_named(source), backends) for source, backends in entries)]
    tokenizer = args.tokenizer or next((f.text for _, f, _ in parsed if f.kind is not SourceKind.WHISPER_CPP), None)
    specs = []
    for label, found, backends in parsed:
        if _not_here(found):
            raise UserError(f"--model {found.text}: no such file or directory")
        chosen = backends[0] if backends else default
        backend = infer_runtime(found) if chosen == "auto" else chosen
        specs.append(ModelSpec(label or default_label(found), found.text, backend, tokenizer))
    keys = [s.key for s in specs]
    duplicates = sorted({k for k in keys if keys.count(k) > 1})
    if duplicates:
        raise UserError(f"two models share a label and backend: {', '.join(duplicates)}; label them LABEL=SOURCE")
    return specs


def _not_here(found: ModelSource) -> bool:
    """A source eval cannot run: a path that names nothing, or a name not on this disk that reads like one (a '/' or
    a .bin ending: a mistyped path is said to be missing here, not looked up on the Hub after the other models ran)."""
    if found.kind is SourceKind.MISSING:
        return True
    return found.kind is SourceKind.HUB and ("/" in found.text or found.text.endswith(".bin"))


def dataset_name(source: str, given: str | None) -> str:
    if given:
        return given
    path = Path(source.rstrip("/"))
    return path.parent.name if path.stem in GENERIC_STEMS and path.parent.name else path.stem


def comparisons(values: list[str]) -> tuple[tuple[str, str], ...]:
    pairs = []
    for value in values:
        a, sep, b = value.partition(":")
        if not sep or not a or not b:
            raise UserError(f"--compare {value!r}: expected LABEL_A:LABEL_B")
        pairs.append((a, b))
    return tuple(pairs)


# ------------------------------------------------------------------------------------------------------ datasets
def load_datasets(values: list[str], limit: int | None, audio_column: str | None = None,
                  text_column: str | None = None) -> list[Dataset]:
    """The --data corpora; the column names go to those that are saved datasets folders (and are refused when
    none is: they would name nothing)."""
    from ..data.corpus import corpus_kind

    kinds = [corpus_kind(_split_named(value)[1]) for value in values]
    if (audio_column or text_column) and "datasets" not in kinds:
        flags = " and ".join(f for f, v in (("--audio-column", audio_column), ("--text-column", text_column)) if v)
        raise UserError(f"{flags}: no --data is a saved datasets folder (the columns would name nothing)")
    datasets = []
    for value, kind in zip(values, kinds):
        given, source = _split_named(value)
        utterances = load_corpus(source, *((audio_column, text_column) if kind == "datasets" else ()))
        if limit is not None:
            utterances = utterances[:limit]
        if not utterances:
            raise UserError(f"--data {value}: no utterances")
        name = dataset_name(source, given)
        if any(d.name == name for d in datasets):
            raise UserError(f"two datasets are named {name!r}; name them NAME=MANIFEST")
        datasets.append(Dataset(name, source, utterances, [load_audio(u) for u in utterances],
                                manifest_spans(Path(source), {u.id for u in utterances})))
    return datasets


NONSPEECH_DATASET = "nonspeech"


def load_nonspeech(manifest: str | None) -> tuple[Dataset, NonspeechSet] | None:
    """The non-speech clips as a dataset to decode (no words to score) and what their figures need."""
    if manifest is None:
        return None
    from ..data.corpus import Utterance
    from ..data.nonspeech import load_nonspeech_manifest

    entries = load_nonspeech_manifest(manifest)
    if not entries:
        raise UserError(f"--nonspeech {manifest}: no clips")
    utterances = [Utterance(e.id, e.audio, "", NONSPEECH_DATASET) for e in entries]
    audio = [load_audio(u) for u in utterances]
    clips = NonspeechSet(manifest, {e.id: len(a) / TARGET_SAMPLE_RATE for e, a in zip(entries, audio)},
                         {e.id: e.kind for e in entries})
    return Dataset(NONSPEECH_DATASET, manifest, utterances, audio), clips


def refuse_long_audio_for_teacher_forcing(datasets: list[Dataset], teacher_forced: bool) -> None:
    """The teacher-forced figures read one 30 s window (the feature extractor drops the rest), so a longer
    utterance is refused by name before any model runs rather than scored against words it never heard. Decoding
    takes it whole: whisper.cpp and CrispASR window after window, PyTorch by transformers' long-form generation."""
    from ..models.common import WINDOW_SECONDS

    if teacher_forced:
        for dataset in datasets:
            refuse_longer_than(dataset.utterances, dataset.audio, WINDOW_SECONDS, "PyTorch Whisper (--teacher-forced)")


def _teacher_forced_only(args: argparse.Namespace, specs: list[ModelSpec], datasets: list[Dataset],
                         pairs: tuple[tuple[str, str], ...], out: Path, tail: TailRule | None) -> int:
    from ..evaluate.report import render_teacher_forced, teacher_forced_section
    from ..evaluate.wer import bootstrap_indices

    figures = teacher_forced_figures(specs, datasets, args.reference, args.zipf_threshold, args.device,
                                     out / "teacher-forced", not args.quiet, tail)
    options = ReportOptions(args.resamples, args.seed, pairs, reference=args.reference)
    report = {"settings": {"zipf_threshold": args.zipf_threshold, "bootstrap_resamples": args.resamples,
                           "bootstrap_seed": args.seed, "teacher_forced_only": True},
              "datasets": [{"name": d.name, "manifest": d.manifest, "utterances": len(d.utterances),
                            "teacher_forced": teacher_forced_section(
                                figures[d.name], options, bootstrap_indices(len(d.utterances), args.resamples,
                                                                            args.seed))}
                           for d in datasets]}
    if tail is not None:
        mark_term_positions(report)
    markdown = "\n".join(line for d in report["datasets"]
                          for line in [f"## {d['name']}", *render_teacher_forced(d["teacher_forced"]), ""]) + "\n"
    write_text_atomic(out / "report.json", json.dumps(report, indent=1, ensure_ascii=False) + "\n")
    write_text_atomic(out / "report.md", markdown)
    write_text_atomic(out / TEACHER_FORCED_LINES, figure_lines(figures))
    sys.stdout.write(markdown)
    return 0


def failure_baselines(specs: list[ModelSpec], reference: str | None) -> dict[str, str]:
    """Run key -> the run it is compared with in the failure figures: the reference label's run of the same
    backend (else the backend's first model); a baseline is not compared with itself."""
    baselines = {}
    for spec in specs:
        same = [s for s in specs if s.backend == spec.backend]
        base = next((s for s in same if s.label == reference), same[0])
        if base.key != spec.key:
            baselines[spec.key] = base.key
    return baselines


def compared_keys(specs: list[ModelSpec], compare: list[str]) -> list[tuple[str, str]]:
    """--compare A:B as run-key pairs, within each backend that ran both labels."""
    pairs = []
    for a, b in comparisons(compare):
        for spec in specs:
            other = next((s for s in specs if s.label == b and s.backend == spec.backend), None)
            if spec.label == a and other is not None:
                pairs.append((spec.key, other.key))
    return pairs


def add_failure_figures(report: dict, specs: list[ModelSpec], datasets: list[Dataset], hypotheses: dict,
                        nonspeech: tuple[Dataset, NonspeechSet] | None, args: argparse.Namespace) -> None:
    """Each dataset's failure section, and the non-speech section, into the report."""
    baselines = failure_baselines(specs, args.reference)
    for entry, d in zip(report["datasets"], datasets):
        texts = {s.key: [row["text"] for row in hypotheses[s.key][d.name]] for s in specs}
        entry["failures"] = failure_section([(u.id, u.text) for u in d.utterances], texts, d.spans,
                                            [*baselines.items(), *compared_keys(specs, args.compare)],
                                            args.resamples, args.seed)
    if nonspeech:
        clips = nonspeech[1]
        report["nonspeech"] = nonspeech_section(
            clips, {s.key: [row["text"] for row in hypotheses[s.key][NONSPEECH_DATASET]] for s in specs}, baselines)


def read_eval_terms(path: str | None) -> TermList | None:
    """--terms read as quantize reads it (the file one command takes, the other takes too): UserError naming the
    file and line. Its terms are matched under the evaluation's normaliser (evaluate/terms.py), where two spellings
    of one term ("analyse", "analyze") are one term."""
    from ..data.rarity import written_words
    from ..data.terms import TermsError, read_terms

    if path is None:
        return None
    try:
        return read_terms(path, written_words)
    except TermsError as e:
        raise UserError(f"--terms {e}") from None


def term_tail(terms: TermList | None, k: float, language: str) -> TailRule | None:
    """With --terms, the teacher-forced figures' tagged positions are the terms' (KLD at term positions)."""
    return None if terms is None else TailRule(k=k, language=language, mode="terms", terms=terms)


def mark_term_positions(report: dict) -> None:
    """Name the teacher-forced sections' tagged positions as term positions (the report's reader and markdown)."""
    for entry in report["datasets"]:
        if "teacher_forced" in entry:
            entry["teacher_forced"]["tagged"] = "term"


def datasets_language(datasets: list[Dataset], given: str | None) -> str:
    """The language of the run: --language, else the one the datasets' entries name (en when none does); every
    backend decodes in it."""
    from ..data.rarity import language_problem

    named = sorted({u.language for d in datasets for u in d.utterances if u.language})
    if given is None and len(named) > 1:
        raise UserError(f"--data: the entries are in {len(named)} languages ({', '.join(named)}); evaluate one "
                        f"language at a time or give --language")
    language = (given or (named[0] if named else "en")).lower()
    problem = language_problem(language)
    if problem is not None:
        raise UserError(f"--language {language}: {problem}")
    return language


def add_term_figures(report: dict, specs: list[ModelSpec], dataset_runs: list[DatasetRuns], terms: TermList,
                     args: argparse.Namespace, language: str) -> None:
    """Each dataset's term section (recall, term-WER, per-term table) from its runs' scores, its pairs those of the
    failure figures."""
    from ..data.normalize import normalizer_for
    from ..evaluate.terms import term_section

    pairs = [*failure_baselines(specs, args.reference).items(), *compared_keys(specs, args.compare)]
    for entry, d in zip(report["datasets"], dataset_runs):
        scores = {run.key: run.scores for run in d.runs}
        ids = [s.id for s in d.runs[0].scores]
        entry["terms"] = term_section(terms, scores, pairs, ids, args.resamples, args.seed, normalizer_for(language))


def figure_lines(figures: dict[str, dict[str, list]]) -> str:
    """The per-utterance teacher-forced figures, one JSON line each ({dataset, label, id, sums, counts}): what a
    merged report (the sweep's) re-scores with its own pairs and resamples, as utterances.jsonl is for the words."""
    return "".join(json.dumps({"dataset": dataset, "label": label, **row.record()}, ensure_ascii=False) + "\n"
                   for dataset, by_label in figures.items() for label, rows in by_label.items() for row in rows)


# ------------------------------------------------------------------------------------------------------ outputs
REPORT_FILES = ("report.json", "report.md", "utterances.jsonl", TEACHER_FORCED_LINES)
CACHE_DIRS = ("hypotheses", "teacher-forced")


def eval_outputs(out: Path) -> list[Output]:
    """OUT is a folder eval writes its reports and caches into; inputs may lie in it beside them."""
    return [Output("--out", out, whole=False), *(Output("--out", out / name) for name in REPORT_FILES + CACHE_DIRS)]


def eval_inputs(args: argparse.Namespace, specs: list[ModelSpec]) -> list[tuple[str, str | None]]:
    return [*(("--data", _split_named(value)[1]) for value in args.data),
            *(("--model", spec.source) for spec in specs), ("--tokenizer", args.tokenizer), ("--terms", args.terms)]


# ---------------------------------------------------------------------------------------------------------- run
def run(args: argparse.Namespace) -> int:
    specs = model_specs(args)
    pairs = comparisons(args.compare)
    out = Path(args.out)
    args.teacher_forced = args.teacher_forced or args.teacher_forced_only
    if args.teacher_forced and not args.reference:
        raise UserError("--teacher-forced needs --reference LABEL (the full-precision model)")
    if args.reference and args.reference not in {s.label for s in specs}:
        raise UserError(f"--reference {args.reference}: no model has that label")
    check_outputs_apart(eval_outputs(out), eval_inputs(args, specs))
    datasets = load_datasets(args.data, args.limit, args.audio_column, args.text_column)
    language = datasets_language(datasets, args.language)
    options = DecodeOptions(threads=args.threads, device=args.device, profile=args.decode, language=language)
    terms = read_eval_terms(args.terms)  # before any decoding: a bad list costs nothing
    nonspeech = load_nonspeech(args.nonspeech)
    if nonspeech and any(d.name == NONSPEECH_DATASET for d in datasets):
        raise UserError(f"--data: the name {NONSPEECH_DATASET!r} is --nonspeech's; name the dataset otherwise")
    refuse_long_audio_for_teacher_forcing(datasets, args.teacher_forced)
    tail = term_tail(terms, args.zipf_threshold, language)
    if args.teacher_forced_only:
        return _teacher_forced_only(args, specs, datasets, pairs, out, tail)
    try:
        decoded = datasets + ([nonspeech[0]] if nonspeech else [])
        hypotheses = transcribe_models(specs, decoded, options, out / "hypotheses", args.jobs, not args.quiet)
        margins = near_tie_margins(specs, datasets, hypotheses, options, out / "hypotheses")
    except BackendError as error:  # a runtime crash or timeout: the message names the model file and utterance
        raise UserError(str(error)) from None
    figures = teacher_forced_figures(specs, datasets, args.reference, args.zipf_threshold, args.device,
                                     out / "teacher-forced", not args.quiet, tail) if args.teacher_forced else {}
    dataset_runs, utterance_lines = [], []
    for d in datasets:
        runs = []
        for spec in specs:
            rows = hypotheses[spec.key][d.name]
            scores = [score_utterance(u.id, u.text, row["text"], args.zipf_threshold, language=language)
                      for u, row in zip(d.utterances, rows)]
            info = next((row.get("info") for row in rows if row.get("info")), {})
            runs.append(ModelRun(spec.key, spec.label, spec.backend, spec.source, scores,
                                 sum(row["seconds"] for row in rows), d.audio_seconds, info))
            utterance_lines += [json.dumps({"dataset": d.name, "model": spec.key, **s.record()}, ensure_ascii=False)
                                for s in scores]
        dataset_runs.append(DatasetRuns(d.name, d.manifest, runs,
                                        {key: by_dataset[d.name] for key, by_dataset in margins.items()},
                                        figures.get(d.name, {})))
    settings = {"normalizer": normalizer_description(language), "zipf_threshold": args.zipf_threshold,
                **({"language": language} if language != "en" else {}),
                "threads": args.threads, "max_new_tokens": options.max_new_tokens,
                "decoding": profile_named(args.decode).record(),
                "near_tie_margin": args.near_tie_margin, "reference": args.reference, "machine": machine_record(),
                "models": [{"key": s.key, "label": s.label, "source": s.source, "backend": s.backend} for s in specs]}
    report = build_report(dataset_runs, ReportOptions(args.resamples, args.seed, pairs, args.focus, args.examples,
                                                      args.context, near_tie_margin=args.near_tie_margin,
                                                      reference=args.reference), settings)
    add_failure_figures(report, specs, datasets, hypotheses, nonspeech, args)
    if terms is not None:
        add_term_figures(report, specs, dataset_runs, terms, args, language)
        mark_term_positions(report)
    markdown = render_markdown(report)
    write_text_atomic(out / "report.json", json.dumps(report, indent=1, ensure_ascii=False) + "\n")
    write_text_atomic(out / "report.md", markdown)
    write_text_atomic(out / "utterances.jsonl", "\n".join(utterance_lines) + "\n")
    if figures:
        write_text_atomic(out / TEACHER_FORCED_LINES, figure_lines(figures))
    sys.stdout.write(markdown)
    print(f"wrote {out / 'report.md'}, {out / 'report.json'} and {out / 'utterances.jsonl'}")
    return 0
