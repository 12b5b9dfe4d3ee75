"""Evaluation tables: per dataset, plain / rare / common / capped WER with bootstrap CIs for any number of models,
paired differences, repetition loops, whisper.cpp-vs-PyTorch text agreement, and a rare-word recovery section like
the paper's qualitative boxes. ``build_report`` is pure (scores in, JSON-ready dict out); ``render_markdown`` turns
that dict into markdown.
"""
from __future__ import annotations

import itertools
import math

import numpy as np
from dataclasses import dataclass, field
from typing import Sequence

from .failure_runs import render_failures, render_nonspeech
from .terms import render_terms
from .teacher_forced import TF_METRICS, UtteranceFigures, figure_counts, retention_counts
from .wer import (CONFIDENCE_LEVEL, DEFAULT_RESAMPLES, DEFAULT_SEED, METRICS, OK, UtteranceScore,
                  bootstrap_indices, bootstrap_interval, check_same_references, metric_counts, paired_difference,
                  totals)

__all__ = ["DEFAULT_CONTEXT_WORDS", "DEFAULT_EXAMPLES", "DEFAULT_NEAR_TIE_MARGIN", "DatasetRuns", "decoding_line",
           "ModelRun",
           "ReportOptions", "build_report", "render_dataset", "render_markdown", "render_teacher_forced",
           "retention_section", "teacher_forced_section"]

DIFFERENCE_METRICS = ("wer", "rare_wer", "capped_wer", "capped_rare_wer")
DEFAULT_EXAMPLES = 8
DEFAULT_NEAR_TIE_MARGIN = 0.5  # nats: the PyTorch model prefers its own token by a factor below e^0.5 = 1.65
DEFAULT_CONTEXT_WORDS = 5
MIN_EXAMPLE_CHARS = 4  # the paper's qualitative examples: rare words of at least four characters


@dataclass(frozen=True)
class ModelRun:
    """One model on one dataset: its identity and every utterance's score (in dataset order)."""

    key: str
    label: str
    backend: str
    source: str
    scores: Sequence[UtteranceScore]
    decode_seconds: float = 0.0
    audio_seconds: float = 0.0
    info: dict = field(default_factory=dict)


@dataclass(frozen=True)
class DatasetRuns:
    """A dataset's runs; ``margins[key]`` = {utterance id: continuation margin} of the run ``key`` against the same
    label's PyTorch run, for the utterances whose texts differ (see TorchTranscriber.continuation_margin)."""

    name: str
    manifest: str
    runs: Sequence[ModelRun]
    margins: dict[str, dict[str, float | None]] = field(default_factory=dict)
    teacher_forced: dict[str, Sequence[UtteranceFigures]] = field(default_factory=dict)  # label -> figures


@dataclass(frozen=True)
class ReportOptions:
    n_resamples: int = DEFAULT_RESAMPLES
    seed: int = DEFAULT_SEED
    comparisons: tuple[tuple[str, str], ...] = ()  # extra (label A, label B) pairs, per backend
    focus: str | None = None  # recovery examples where this label keeps the word
    examples: int = DEFAULT_EXAMPLES
    context_words: int = DEFAULT_CONTEXT_WORDS
    min_example_chars: int = MIN_EXAMPLE_CHARS
    near_tie_margin: float = DEFAULT_NEAR_TIE_MARGIN
    reference: str | None = None  # label of the full-precision model: retention and teacher-forced figures


# ------------------------------------------------------------------------------------------------------ building
def build_report(datasets: Sequence[DatasetRuns], options: ReportOptions = ReportOptions(),
                 settings: dict | None = None) -> dict:
    return {"settings": {**(settings or {}), "bootstrap_resamples": options.n_resamples, "bootstrap_seed": options.seed,
                         "confidence_level": CONFIDENCE_LEVEL},
            "datasets": [dataset_report(d, options) for d in datasets]}


def dataset_report(dataset: DatasetRuns, options: ReportOptions) -> dict:
    runs = list(dataset.runs)
    if not runs:
        raise ValueError(f"dataset {dataset.name!r}: no models")
    for run in runs[1:]:
        check_same_references(runs[0].scores, run.scores)
    indices = bootstrap_indices(len(runs[0].scores), options.n_resamples, options.seed)
    counts = {run.key: metric_counts(run.scores) for run in runs}
    first = totals(runs[0].scores)
    return {
        "name": dataset.name, "manifest": dataset.manifest, "utterances": first.utterances, "words": first.words,
        "rare_words": first.rare_words, "rare_share": first.rare_words / first.words if first.words else math.nan,
        "models": [_model_row(run, counts[run.key], indices) for run in runs],
        "differences": [_difference_row(a, b, counts, indices) for a, b in comparison_pairs(runs, options.comparisons)],
        "backend_agreement": backend_agreement(runs, dataset.margins, options.near_tie_margin),
        "recovery": recovery_section(runs, options),
        **({"retention": retention_section(runs, options, indices)} if options.reference else {}),
        **({"teacher_forced": teacher_forced_section(dataset.teacher_forced, options, indices)}
           if dataset.teacher_forced else {}),
    }


def _model_row(run: ModelRun, counts: dict, indices) -> dict:
    t = totals(run.scores)
    return {
        "key": run.key, "label": run.label, "backend": run.backend, "source": run.source,
        **{metric: bootstrap_interval(*counts[metric], indices).as_dict() for metric in METRICS},
        "errors": t.errors, "rare_errors": t.rare_errors, "common_errors": t.common_errors,
        "substitutions": t.substitutions, "deletions": t.deletions, "insertions": t.insertions,
        "loops": t.loops, "loop_ids": list(t.loop_ids), "decode_seconds": round(run.decode_seconds, 2),
        "real_time_factor": run.decode_seconds / run.audio_seconds if run.audio_seconds else None, "info": run.info,
    }


def comparison_pairs(runs: Sequence[ModelRun],
                     extra: Sequence[tuple[str, str]] = ()) -> list[tuple[ModelRun, ModelRun]]:
    """Every model against the first model of its backend (the baseline), plus the requested label pairs within
    each backend, without repeats."""
    pairs: list[tuple[ModelRun, ModelRun]] = []
    baselines: dict[str, ModelRun] = {}
    for run in runs:
        baseline = baselines.setdefault(run.backend, run)
        if run is not baseline:
            pairs.append((run, baseline))
    by_key = {(r.label, r.backend): r for r in runs}
    for label_a, label_b in extra:
        for backend in dict.fromkeys(r.backend for r in runs):
            a, b = by_key.get((label_a, backend)), by_key.get((label_b, backend))
            if a and b and (a, b) not in pairs:
                pairs.append((a, b))
    return pairs


def _difference_row(a: ModelRun, b: ModelRun, counts: dict, indices) -> dict:
    return {"model": a.key, "versus": b.key,
            **{metric: paired_difference(counts[a.key][metric], counts[b.key][metric], indices).as_dict()
               for metric in DIFFERENCE_METRICS}}


def backend_agreement(runs: Sequence[ModelRun], margins: dict[str, dict[str, float | None]] | None = None,
                      near_tie_margin: float = DEFAULT_NEAR_TIE_MARGIN) -> list[dict]:
    """For a label run through several backends: on how many utterances the normalised texts are identical, and how
    many of the differences start at a near-tie of the PyTorch model (|margin| <= near_tie_margin: it scores the two
    runtimes' first differing tokens within that many nats of each other)."""
    margins = margins or {}
    rows = []
    by_label: dict[str, list[ModelRun]] = {}
    for run in runs:
        by_label.setdefault(run.label, []).append(run)
    for label, group in by_label.items():
        for a, b in itertools.combinations(group, 2):
            same = sum(x.hypothesis_words == y.hypothesis_words for x, y in zip(a.scores, b.scores))
            n = len(a.scores)
            differing = [x.id for x, y in zip(a.scores, b.scores) if x.hypothesis_words != y.hypothesis_words]
            margin_key = b.key if a.backend == "torch" else a.key if b.backend == "torch" else None
            scored = margin_key in margins  # margins were computed for this pair (possibly none differ)
            pair_margins = margins.get(margin_key, {}) if scored else {}
            near = [i for i in differing
                    if pair_margins.get(i) is not None and abs(pair_margins[i]) <= near_tie_margin]
            rows.append({"label": label, "backends": [a.backend, b.backend], "identical": same, "utterances": n,
                         "share": same / n if n else math.nan, "differing_ids": differing,
                         "margins": {i: pair_margins.get(i) for i in differing} if scored else {},
                         "near_ties": len(near) if scored else None,
                         "share_near_ties_aside": same / (n - len(near)) if scored and n > len(near) else None})
    return rows


# --------------------------------------------------------------------------------- retention, teacher forcing
def _label_pairs(labels: Sequence[str], options: ReportOptions) -> list[tuple[str, str]]:
    """The requested label pairs whose labels are both present (the reference is not a model to compare here)."""
    return [(a, b) for a, b in options.comparisons if a in labels and b in labels and options.reference not in (a, b)]


def retention_section(runs: Sequence[ModelRun], options: ReportOptions, indices) -> dict:
    """Rare-word retention of every run against the reference label's run on the same backend (or its first run)."""
    references = {run.backend: run for run in runs if run.label == options.reference}
    if not references:
        return {"reference": options.reference, "models": [], "differences": [], "missing": True}
    counts, rows = {}, []
    for run in runs:
        if run.label == options.reference:
            continue
        reference = references.get(run.backend, next(iter(references.values())))
        counts[run.key] = retention_counts(reference.scores, run.scores)
        rows.append({"model": run.key, "versus": reference.key, "kept": int(counts[run.key][0].sum()),
                     "known": int(counts[run.key][1].sum()),
                     "retention": bootstrap_interval(*counts[run.key], indices).as_dict()})
    by_label = {(run.label, run.backend): run.key for run in runs}
    differences = []
    for a, b in _label_pairs([run.label for run in runs], options):
        for backend in dict.fromkeys(run.backend for run in runs):
            key_a, key_b = by_label.get((a, backend)), by_label.get((b, backend))
            if key_a in counts and key_b in counts and np.array_equal(counts[key_a][1], counts[key_b][1]):
                differences.append({"model": key_a, "versus": key_b,
                                    "retention": paired_difference(counts[key_a], counts[key_b], indices).as_dict()})
    return {"reference": options.reference, "models": rows, "differences": differences}


def teacher_forced_section(figures: dict[str, Sequence[UtteranceFigures]], options: ReportOptions, indices) -> dict:
    """KLD, delta-NLL and top-1 agreement against the reference, rare and common positions, with paired
    differences for the requested label pairs."""
    counts = {label: figure_counts(rows) for label, rows in figures.items()}
    models = [{"label": label, "positions": {"rare": int(c["kld_rare"][1].sum()), "common": int(c["kld_common"][1].sum())},
               **{metric: bootstrap_interval(*c[metric], indices).as_dict() for metric in TF_METRICS}}
              for label, c in counts.items()]
    differences = [{"model": a, "versus": b,
                    **{metric: paired_difference(counts[a][metric], counts[b][metric], indices).as_dict()
                       for metric in TF_METRICS}}
                   for a, b in _label_pairs(list(counts), options)]
    return {"reference": options.reference, "models": models, "differences": differences}


# ------------------------------------------------------------------------------------------- rare-word recovery
def recovery_section(runs: Sequence[ModelRun], options: ReportOptions) -> dict:
    """Rare reference words (at least ``min_example_chars`` long) that some models keep and others drop."""
    candidates = []
    for u in range(len(runs[0].scores)):
        for outcome in runs[0].scores[u].outcomes:
            if not outcome.rare or len(outcome.word) < options.min_example_chars:
                continue
            kept = [run.scores[u].outcomes[outcome.index].op == OK for run in runs]
            if any(kept) and not all(kept):
                candidates.append((u, outcome.index, kept))
    summary = _recovery_summary(runs, candidates)
    chosen = _choose_examples(runs, candidates, options)
    return {"contested_words": len(candidates), "summary": summary,
            "examples": [_example(runs, u, j, options.context_words) for u, j, _ in chosen]}


def _recovery_summary(runs: Sequence[ModelRun], candidates: list) -> list[dict]:
    rows = []
    for m, run in enumerate(runs):
        kept = [c for c in candidates if c[2][m]]
        rows.append({"model": run.key, "kept": len(kept), "dropped": len(candidates) - len(kept),
                     "kept_alone": sum(sum(c[2]) == 1 for c in kept),
                     "kept_while_most_dropped": sum(sum(c[2]) <= len(runs) // 2 for c in kept)})
    return rows


def _choose_examples(runs: Sequence[ModelRun], candidates: list, options: ReportOptions) -> list:
    """Most telling first: words kept by the focus label (if any) and by the fewest models; one per utterance."""
    focus = [m for m, run in enumerate(runs) if run.label == options.focus]
    pool = [c for c in candidates if not focus or all(c[2][m] for m in focus)]
    pool.sort(key=lambda c: (sum(c[2]), runs[0].scores[c[0]].id, c[1]))
    chosen, used = [], set()
    for c in pool:
        if c[0] not in used:
            chosen.append(c)
            used.add(c[0])
        if len(chosen) == options.examples:
            break
    return chosen


def _example(runs: Sequence[ModelRun], u: int, j: int, context: int) -> dict:
    reference = runs[0].scores[u]
    a, b = max(0, j - context), min(reference.n_words - 1, j + context)
    models = []
    for run in runs:
        score = run.scores[u]
        outcome = score.outcomes[j]
        cursor = score.alignment.hyp_cursor
        start, end = cursor[a], cursor[b + 1]
        models.append({"model": run.key, "kept": outcome.op == OK, "op": outcome.op,
                       "hypothesis_word": outcome.hypothesis_word,
                       "window": list(score.hypothesis_words[start:end]),
                       "word_at": outcome.hypothesis_index - start if outcome.hypothesis_index >= 0 else -1,
                       "loop": score.loop})
    return {"utterance": reference.id, "word": reference.outcomes[j].word,
            "reference_window": list(reference.reference_words[a: b + 1]), "word_at": j - a,
            "truncated_left": a > 0, "truncated_right": b < reference.n_words - 1, "models": models}


# ------------------------------------------------------------------------------------------------------ markdown
def _pct(x: float | None) -> str:
    return "n/a" if x is None or not math.isfinite(x) else f"{100 * x:.1f}"


def _interval(cell: dict) -> str:
    return f"{_pct(cell['value'])} [{_pct(cell['low'])}, {_pct(cell['high'])}]"


def _cell_or_dash(cell: dict | None) -> str:
    return "—" if cell is None else _signed(cell)  # a report from before capped rare-WER had its difference


def _signed(cell: dict) -> str:
    def pp(x: float) -> str:
        return "n/a" if not math.isfinite(x) else f"{100 * x:+.1f}"

    star = " *" if cell.get("significant") else ""
    return f"{pp(cell['value'])} [{pp(cell['low'])}, {pp(cell['high'])}]{star}"


def decoding_line(settings: dict) -> str:
    """The decode profile a report's figures were measured with (reports before profiles: greedy)."""
    decoding = settings.get("decoding")
    if isinstance(decoding, dict):
        return f"`{decoding['profile']}` ({decoding['description']})"
    return "`greedy` (temperature 0 without fallback, no timestamps)"


def render_markdown(report: dict) -> str:
    settings = report["settings"]
    lines = ["# Evaluation", "",
             f"Decoding: {decoding_line(settings)}{_language_note(settings)}. Normaliser: "
             f"{settings.get('normalizer', 'see report.json')}; a word is rare when its wordfreq Zipf is below "
             f"{settings.get('zipf_threshold', 3.0)}. Rates in %, with "
             f"{int(100 * settings['confidence_level'])}% bootstrap intervals over utterances "
             f"({settings['bootstrap_resamples']} resamples, seed {settings['bootstrap_seed']}). Insertions are "
             "charged to an adjacent rare reference word when there is one. Capped: each utterance's errors capped at "
             "its reference length. Loops: hypotheses with an n-gram (up to 32 words) repeated 4+ times back to back. Near-tie margin: "
             f"{settings.get('near_tie_margin', DEFAULT_NEAR_TIE_MARGIN)} nats.", ""]
    if settings.get("machine"):
        lines += [machine_line(settings["machine"], settings.get("threads")), ""]
    for dataset in report["datasets"]:
        lines += render_dataset(dataset)
    lines += render_nonspeech(report["nonspeech"]) + [""] if "nonspeech" in report else []
    return "\n".join(lines) + "\n"


def _language_note(settings: dict) -> str:
    language = settings.get("language")
    return f", language {language} (its wordfreq table for rarity)" if language else ""


def machine_line(machine: dict, threads: int | None) -> str:
    """Where the figures were made: the same inputs give the same words only on the same processor kind and threads."""
    versions = machine.get("versions", {})
    return (f"Machine: {machine.get('cpu_model')} (torch kernels {machine.get('torch_cpu_capability', 'n/a')}), "
            f"{threads if threads is not None else machine.get('torch_threads')} threads; torch "
            f"{versions.get('torch')}, transformers {versions.get('transformers')}, pywhispercpp "
            f"{versions.get('pywhispercpp')}.")


def render_dataset(d: dict) -> list[str]:
    lines = [f"## {d['name']}", "",
             f"{d['utterances']} utterances, {d['words']} reference words, {d['rare_words']} rare "
             f"({_pct(d['rare_share'])}%). Manifest: `{d['manifest']}`.", "",
             "| model | backend | WER | rare-WER | common-WER | capped WER | capped rare-WER | loops | S / D / I |",
             "|---|---|---|---|---|---|---|---|---|"]
    for m in d["models"]:
        lines.append(f"| {m['label']} | {m['backend']} | {_interval(m['wer'])} | {_interval(m['rare_wer'])} | "
                     f"{_interval(m['common_wer'])} | {_interval(m['capped_wer'])} | "
                     f"{_interval(m['capped_rare_wer'])} | "
                     f"{m['loops']} | {m['substitutions']} / {m['deletions']} / {m['insertions']} |")
    if d["differences"]:
        lines += ["", "Paired differences (percentage points, same utterances; * = interval excludes 0):", "",
                  "| model | versus | Δ WER | Δ rare-WER | Δ capped WER | Δ capped rare-WER |",
                  "|---|---|---|---|---|---|"]
        for row in d["differences"]:
            lines.append(f"| {row['model']} | {row['versus']} | {_signed(row['wer'])} | {_signed(row['rare_wer'])} | "
                         f"{_signed(row['capped_wer'])} | {_cell_or_dash(row.get('capped_rare_wer'))} |")
    if d["backend_agreement"]:
        lines += ["", "Same model, different backends: utterances with identical normalised text (near-tie: the "
                      "PyTorch model scores the two runtimes' first differing tokens within the near-tie margin):",
                  ""]
        for row in d["backend_agreement"]:
            line = (f"- {row['label']}: {' vs '.join(row['backends'])}: {row['identical']} / {row['utterances']} "
                    f"({_pct(row['share'])}%)")
            if row.get("near_ties") is not None:
                line += (f"; {row['near_ties']} of {row['utterances'] - row['identical']} differences start at a "
                         f"near-tie; {_pct(row['share_near_ties_aside'])}% identical near-ties aside")
            lines.append(line)
    lines += render_failures(d["failures"]) if "failures" in d else []
    lines += render_terms(d["terms"]) if "terms" in d else []
    lines += render_teacher_forced(d["teacher_forced"]) if "teacher_forced" in d else []
    lines += render_retention(d["retention"]) if "retention" in d else []
    return lines + [""] + render_recovery(d["recovery"]) + [""]


def _nats(cell: dict, signed: bool = False) -> str:
    fmt = "{:+.4f}" if signed else "{:.4f}"
    star = " *" if cell.get("significant") else ""
    return f"{fmt.format(cell['value'])} [{fmt.format(cell['low'])}, {fmt.format(cell['high'])}]{star}"


def render_teacher_forced(section: dict) -> list[str]:
    tagged = section.get("tagged", "rare")  # "term" under eval --terms: the tagged positions are the terms'
    lines = ["", f"### Teacher-forced figures against {section['reference']}", "",
             "On the reference transcript, per predicted token: KL(P_ref || Q) and the rise in the reference token's "
             "negative log-likelihood (nats, lower is better), top-1 agreement with the reference (%, higher is "
             f"better); {tagged} = positions predicting a token of a {tagged} word; common = all others.", "",
             f"| model | KLD {tagged} | KLD common | ΔNLL {tagged} | ΔNLL common | top-1 {tagged} | top-1 common |",
             "|---|---|---|---|---|---|---|"]
    for m in section["models"]:
        lines.append(f"| {m['label']} | {_nats(m['kld_rare'])} | {_nats(m['kld_common'])} | {_nats(m['dnll_rare'])} | "
                     f"{_nats(m['dnll_common'])} | {_interval(m['top1_rare'])} | {_interval(m['top1_common'])} |")
    if section["differences"]:
        lines += ["", f"| model | versus | Δ KLD {tagged} | Δ KLD common | Δ ΔNLL {tagged} | Δ top-1 {tagged} (pp) |",
                  "|---|---|---|---|---|---|"]
        for row in section["differences"]:
            lines.append(f"| {row['model']} | {row['versus']} | {_nats(row['kld_rare'], True)} | "
                         f"{_nats(row['kld_common'], True)} | {_nats(row['dnll_rare'], True)} | "
                         f"{_signed(row['top1_rare'])} |")
    return lines


def render_retention(section: dict) -> list[str]:
    lines = ["", f"### Rare-word retention against {section['reference']}", "",
             "Of the rare reference words the reference model transcribes correctly, the share each model also gets "
             "right (%).", "", "| model | versus | kept / known | retention |", "|---|---|---|---|"]
    for row in section["models"]:
        lines.append(f"| {row['model']} | {row['versus']} | {row['kept']} / {row['known']} | "
                     f"{_interval(row['retention'])} |")
    if section["differences"]:
        lines += ["", "| model | versus | Δ retention (pp) |", "|---|---|---|"]
        for row in section["differences"]:
            lines.append(f"| {row['model']} | {row['versus']} | {_signed(row['retention'])} |")
    return lines


def render_recovery(recovery: dict) -> list[str]:
    lines = ["### Rare-word recovery", "",
             f"{recovery['contested_words']} rare reference words (4+ letters) are kept by some models and dropped by "
             "others.", "", "| model | kept | dropped | kept alone | kept while most dropped |",
             "|---|---|---|---|---|"]
    for row in recovery["summary"]:
        lines.append(f"| {row['model']} | {row['kept']} | {row['dropped']} | {row['kept_alone']} | "
                     f"{row['kept_while_most_dropped']} |")
    for example in recovery["examples"]:
        lines += ["", f"**`{example['word']}`** — utterance `{example['utterance']}`", "",
                  f"- REF: {_window(example['reference_window'], example['word_at'], True, example)}"]
        for m in example["models"]:
            mark = "✓" if m["kept"] else "✗"
            shown = _window(m["window"], m["word_at"], m["kept"], example) if m["window"] else "∅"
            note = " (deleted)" if m["op"] == "del" else ""
            note += " (loop)" if m["loop"] else ""
            lines.append(f"- {mark} {m['model']}: {shown}{note}")
    return lines


def _window(words: Sequence[str], at: int, kept: bool, example: dict) -> str:
    shown = [(f"**{w}**" if kept else f"_{w}_") if i == at else w for i, w in enumerate(words)]
    left = "… " if example["truncated_left"] else ""
    right = " …" if example["truncated_right"] else ""
    return left + " ".join(shown) + right
