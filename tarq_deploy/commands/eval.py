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
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..data.corpus import Utterance, load_audio, load_corpus
from ..data.rarity import DEFAULT_ZIPF_THRESHOLD
from ..errors import UserError
from ..evaluate.backends import (BACKENDS, WHISPER_CPP_PARAMS, BackendError, DecodeOptions, ModelSpec,
                                 infer_backend, is_whisper_cpp_file, open_transcriber)
from ..evaluate.report import (DEFAULT_CONTEXT_WORDS, DEFAULT_EXAMPLES, DEFAULT_NEAR_TIE_MARGIN, DatasetRuns,
                               ModelRun, ReportOptions, build_report, render_markdown)
from ..evaluate.wer import DEFAULT_RESAMPLES, normalized_words, normalizer_description, score_utterance

HELP = "score models (WER, rare-WER, loops, rare-word recovery) on datasets, in PyTorch and in the real runtimes"
GENERIC_STEMS = {"eval", "test", "manifest", "data", "calib"}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--data", action="append", required=True, metavar="[NAME=]MANIFEST",
                   help="evaluation corpus (JSONL manifest, LibriSpeech folder or saved datasets folder); repeatable")
    p.add_argument("--model", action=_ModelAction, dest="models", required=True, metavar="[LABEL=]SOURCE",
                   help="model to score; repeatable (label defaults to the source's name)")
    p.add_argument("--backend", action=_BackendAction, dest="models", choices=("auto", *BACKENDS),
                   help="after a --model: that model's backend; before every --model: the default for all; "
                        "default: inferred from the source (a whisper.cpp file -> whisper.cpp, else torch)")
    p.add_argument("--tokenizer", metavar="SOURCE",
                   help="torch backend on a whisper.cpp file: model whose tokenizer and config to use (default: the "
                        "first non-whisper.cpp model given)")
    p.add_argument("--out", required=True, help="directory for report.md, report.json, utterances.jsonl")
    p.add_argument("--threads", type=int, default=1, help="CPU threads per backend (fixed, for comparable runs)")
    p.add_argument("--jobs", type=int, default=1,
                   help="models transcribed at the same time (e.g. 2 on two cores: a whisper.cpp worker beside a "
                        "PyTorch model); texts do not depend on it, decode times do")
    p.add_argument("--device", default="cpu", help="torch backend device")
    p.add_argument("--limit", type=int, help="only the first N utterances of each dataset")
    p.add_argument("--zipf-threshold", type=float, default=DEFAULT_ZIPF_THRESHOLD, help="rare: Zipf below k")
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


def default_label(source: str) -> str:
    if source.startswith("packaged:"):
        return source.split(":", 1)[1]
    path = Path(source.rstrip("/"))
    return path.stem if path.suffix == ".bin" else path.name


def model_specs(args: argparse.Namespace) -> list[ModelSpec]:
    entries = [(source, backends) for source, backends in args.models]
    default = "auto"
    if entries and entries[0][0] == DEFAULT_ENTRY:
        default = entries.pop(0)[1][-1]
    for source, backends in entries:
        if len(backends) > 1:
            raise UserError(f"--model {source}: --backend given {len(backends)} times ({', '.join(backends)})")
    parsed = [(_split_named(source), backends) for source, backends in entries]
    tokenizer = args.tokenizer or next((s for (_, s), _ in parsed if not is_whisper_cpp_file(s)), None)
    specs = []
    for (label, source), backends in parsed:
        if not source.startswith("packaged:") and ("/" in source or source.endswith(".bin")) and \
                not Path(source).expanduser().exists():
            raise UserError(f"--model {source}: no such file or directory")
        chosen = backends[0] if backends else default
        backend = infer_backend(source) if chosen == "auto" else chosen
        specs.append(ModelSpec(label or default_label(source), source, backend, tokenizer))
    keys = [s.key for s in specs]
    duplicates = sorted({k for k in keys if keys.count(k) > 1})
    if duplicates:
        raise UserError(f"two models share a label and backend: {', '.join(duplicates)}; label them LABEL=SOURCE")
    return specs


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
@dataclass
class Dataset:
    name: str
    manifest: str
    utterances: list[Utterance]
    audio: list[np.ndarray]

    @property
    def audio_seconds(self) -> float:
        return sum(len(a) for a in self.audio) / 16_000


def load_datasets(values: list[str], limit: int | None) -> list[Dataset]:
    datasets = []
    for value in values:
        given, source = _split_named(value)
        utterances = load_corpus(source)
        if limit is not None:
            utterances = utterances[:limit]
        if not utterances:
            raise UserError(f"--data {value}: no utterances")
        name = dataset_name(source, given)
        if any(d.name == name for d in datasets):
            raise UserError(f"two datasets are named {name!r}; name them NAME=MANIFEST")
        datasets.append(Dataset(name, source, utterances, [load_audio(u) for u in utterances]))
    return datasets


# --------------------------------------------------------------------------------------------- hypothesis cache
def source_fingerprint(source: str) -> str:
    """Identifies a model's bytes: a file's sha256 (so re-exporting identical bytes keeps the cache, and changed bytes
    never reuse it), a checkpoint's manifest (it holds the sha256 of every file), or the name itself."""
    path = Path(source).expanduser()
    if path.is_file():
        digest = hashlib.sha256()
        with path.open("rb") as f:
            for chunk in iter(lambda: f.read(1 << 24), b""):
                digest.update(chunk)
        return f"sha256:{digest.hexdigest()}"
    manifest = path / "manifest.json"
    if manifest.is_file():
        return f"{path.resolve()}:{hashlib.sha256(manifest.read_bytes()).hexdigest()}"
    return source


def audio_digest(audio: np.ndarray) -> str:
    return hashlib.sha1(np.ascontiguousarray(audio, dtype="<f4").tobytes()).hexdigest()


class _IdentityJsonl:
    """A JSONL cache whose first line is the identity of what made its records (model, settings); the records count
    only while that identity matches, and an unreadable file (a torn last line) is started over."""

    def __init__(self, path: Path, identity: dict) -> None:
        self.path = path
        self.identity = identity
        self.valid = False  # the file exists and holds this identity

    def read(self) -> list[dict]:
        if not self.path.is_file():
            return []
        lines = self.path.read_text(encoding="utf-8").splitlines()
        try:
            header = json.loads(lines[0]) if lines else {}
            records = [json.loads(line) for line in lines[1:] if line.strip()]
        except json.JSONDecodeError:
            return []
        self.valid = header == self.identity and bool(records)
        return records if self.valid else []

    def append(self, records: list[dict]) -> None:
        """Append records, starting the file (identity line first) when it holds nothing valid."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "a" if self.valid else "w", encoding="utf-8") as f:
            if not self.valid:
                f.write(json.dumps(self.identity) + "\n")
            f.writelines(json.dumps(record, ensure_ascii=False) + "\n" for record in records)
        self.valid = True


class HypothesisCache(_IdentityJsonl):
    """JSONL of {id, audio, text, seconds} per (model, dataset), valid while the model and decode settings match."""

    def __init__(self, directory: Path, spec: ModelSpec, dataset: Dataset, options: DecodeOptions) -> None:
        slug = re.sub(r"[^A-Za-z0-9._-]+", "_", f"{spec.label}__{spec.backend}__{dataset.name}")
        super().__init__(directory / f"{slug}.jsonl",
                         {"model": source_fingerprint(spec.source), "backend": spec.backend,
                          "tokenizer": spec.tokenizer if spec.backend == "torch" else None,
                          "threads": options.threads, "max_new_tokens": options.max_new_tokens,
                          "whisper_cpp": WHISPER_CPP_PARAMS if spec.backend == "whisper.cpp" else None})
        self.entries = {(r["id"], r["audio"]): r for r in self.read()}

    def get(self, utterance_id: str, digest: str) -> dict | None:
        return self.entries.get((utterance_id, digest))

    def add(self, record: dict) -> None:
        self.entries[(record["id"], record["audio"])] = record
        self.append([record])


# ------------------------------------------------------------------------------------------ teacher-forced figures
def teacher_forced_specs(specs: list[ModelSpec], reference: str) -> tuple[ModelSpec, list[ModelSpec]]:
    """One spec per label, loaded in PyTorch (a label's backends share its weights): the reference and the rest."""
    by_label: dict[str, ModelSpec] = {}
    for spec in specs:
        if spec.label not in by_label or spec.backend == "torch":
            by_label[spec.label] = spec
    if reference not in by_label:
        raise UserError(f"--reference {reference}: no model has that label ({', '.join(by_label)})")
    torch_specs = {label: ModelSpec(s.label, s.source, "torch", s.tokenizer) for label, s in by_label.items()}
    return torch_specs.pop(reference), list(torch_specs.values())


def teacher_forced_figures(specs: list[ModelSpec], datasets: list[Dataset], reference_label: str, k: float,
                           device: str, cache_dir: Path, progress: bool) -> dict[str, dict[str, list]]:
    """{dataset: {label: [UtteranceFigures]}}; cached per (reference, model, utterance), models loaded only when
    something is missing."""
    from tqdm.auto import tqdm

    from ..evaluate.backends import load_torch_bundle
    from ..evaluate.teacher_forced import TeacherForcedScorer, UtteranceFigures, score_utterances

    reference, models = teacher_forced_specs(specs, reference_label)
    identity = {spec.label: {"reference": source_fingerprint(reference.source), "model": source_fingerprint(spec.source),
                             "tokenizer": spec.tokenizer, "zipf_threshold": k, "windows": "packed 30 s"}
                for spec in models}
    caches = {spec.label: _FigureCache(cache_dir, spec.label, identity[spec.label]) for spec in models}
    # Utterances are scored in packed windows, so a figure depends on the whole dataset's composition: the cache
    # key includes it, and a dataset with anything missing is scored again whole (the same windows every time).
    keys = {d.name: _dataset_keys(d) for d in datasets}
    missing = [d for d in datasets if any(c.get(k) is None for c in caches.values() for k in keys[d.name])]
    if missing:
        scorers = {spec.label: TeacherForcedScorer(load_torch_bundle(spec)[0], device, k) for spec in models}
        ref_scorer = TeacherForcedScorer(load_torch_bundle(reference)[0], device, k)
        bar = tqdm(total=sum(len(d.utterances) for d in missing), desc="teacher-forced", unit="utt",
                   disable=not progress)
        for d in missing:
            scored = score_utterances(ref_scorer, scorers, [(u.id, a, u.text) for u, a in zip(d.utterances, d.audio)],
                                      bar.update)
            for label, rows in scored.items():
                caches[label].add_all([(key, row.record()) for key, row in zip(keys[d.name], rows)])
        bar.close()
    return {d.name: {label: [UtteranceFigures.from_record(cache.get(key)) for key in keys[d.name]]
                     for label, cache in caches.items()} for d in datasets}


def _dataset_keys(d: Dataset) -> list[str]:
    """One key per utterance: the dataset's name and every utterance's (id, audio, text), then the utterance's id."""
    items = [(u.id, audio_digest(a), u.text) for u, a in zip(d.utterances, d.audio)]
    whole = hashlib.sha256(json.dumps([d.name, items]).encode()).hexdigest()
    return [hashlib.sha256(f"{whole}:{u_id}".encode()).hexdigest() for u_id, _, _ in items]


class _FigureCache(_IdentityJsonl):
    """JSONL of teacher-forced figures per (reference, model), keyed by utterance within its whole dataset."""

    def __init__(self, directory: Path, label: str, identity: dict) -> None:
        super().__init__(directory / f"{re.sub(r'[^A-Za-z0-9._-]+', '_', label)}.jsonl", identity)
        self.entries: dict[str, dict] = {r["key"]: r["figures"] for r in self.read()}

    def get(self, key: str) -> dict | None:
        return self.entries.get(key)

    def add_all(self, rows: list[tuple[str, dict]]) -> None:
        self.entries.update(rows)
        self.append([{"key": key, "figures": figures} for key, figures in rows])


def _teacher_forced_only(args: argparse.Namespace, specs: list[ModelSpec], datasets: list[Dataset],
                         pairs: tuple[tuple[str, str], ...], out: Path) -> int:
    from ..evaluate.report import render_teacher_forced, teacher_forced_section
    from ..evaluate.wer import bootstrap_indices

    figures = teacher_forced_figures(specs, datasets, args.reference, args.zipf_threshold, args.device,
                                     out / "teacher-forced", not args.quiet)
    options = ReportOptions(args.resamples, args.seed, pairs, reference=args.reference)
    report = {"settings": {"zipf_threshold": args.zipf_threshold, "bootstrap_resamples": args.resamples,
                           "bootstrap_seed": args.seed, "teacher_forced_only": True},
              "datasets": [{"name": d.name, "manifest": d.manifest, "utterances": len(d.utterances),
                            "teacher_forced": teacher_forced_section(
                                figures[d.name], options, bootstrap_indices(len(d.utterances), args.resamples,
                                                                            args.seed))}
                           for d in datasets]}
    markdown = "\n".join(line for d in report["datasets"]
                          for line in [f"## {d['name']}", *render_teacher_forced(d["teacher_forced"]), ""]) + "\n"
    _write_atomically(out / "report.json", json.dumps(report, indent=1, ensure_ascii=False) + "\n")
    _write_atomically(out / "report.md", markdown)
    sys.stdout.write(markdown)
    return 0


# ---------------------------------------------------------------------------------------------------------- run
def transcribe_model(spec: ModelSpec, datasets: list[Dataset], options: DecodeOptions, cache_dir: Path,
                     progress: bool) -> dict[str, list[dict]]:
    """{dataset name: [{id, text, seconds}]} for one model; the model is loaded only if something is missing."""
    from tqdm.auto import tqdm

    caches = {d.name: HypothesisCache(cache_dir, spec, d, options) for d in datasets}
    digests = {d.name: [audio_digest(a) for a in d.audio] for d in datasets}
    missing = sum(caches[d.name].get(u.id, h) is None for d in datasets for u, h in zip(d.utterances, digests[d.name]))
    transcriber = open_transcriber(spec, options) if missing else None
    info = transcriber.describe() if transcriber else {}
    results: dict[str, list[dict]] = {}
    try:
        with tqdm(total=missing, desc=spec.key, unit="utt", disable=not progress or not missing) as bar:
            for d in datasets:
                rows = []
                for u, audio, digest in zip(d.utterances, d.audio, digests[d.name]):
                    record = caches[d.name].get(u.id, digest)
                    if record is None:
                        record = {**_transcribe_one(transcriber, u, audio, digest), "info": info}
                        caches[d.name].add(record)
                        bar.update()
                    rows.append(record)
                results[d.name] = rows
    finally:
        if transcriber is not None:
            transcriber.close()
    return results


def transcribe_models(specs: list[ModelSpec], datasets: list[Dataset], options: DecodeOptions, cache_dir: Path,
                      jobs: int, progress: bool) -> dict[str, dict[str, list[dict]]]:
    """Every model's hypotheses, ``jobs`` models at a time (each model's decoding is independent of the others)."""
    if jobs < 1:
        raise UserError(f"--jobs must be at least 1 (got {jobs})")
    if jobs == 1:
        return {spec.key: transcribe_model(spec, datasets, options, cache_dir, progress) for spec in specs}
    from concurrent.futures import ThreadPoolExecutor

    pool = ThreadPoolExecutor(max_workers=jobs)
    try:
        futures = {spec.key: pool.submit(transcribe_model, spec, datasets, options, cache_dir, progress)
                   for spec in specs}
        return {key: future.result() for key, future in futures.items()}
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def near_tie_margins(specs: list[ModelSpec], datasets: list[Dataset], hypotheses: dict, options: DecodeOptions,
                     cache_dir: Path) -> dict[str, dict[str, dict[str, float | None]]]:
    """{run key: {dataset: {utterance id: margin}}} for every non-PyTorch run of a label that also has a PyTorch run,
    over the utterances whose normalised texts differ; the PyTorch model is loaded only when a margin is missing
    from the cache (keyed by the PyTorch model, the audio and the other run's text)."""
    torch_runs = {s.label: s for s in specs if s.backend == "torch"}
    margins: dict[str, dict[str, dict[str, float | None]]] = {}
    for spec in specs:
        reference = torch_runs.get(spec.label)
        if spec.backend == "torch" or reference is None:
            continue
        cache = MarginCache(cache_dir, reference, spec)
        todo = []
        margins[spec.key] = {d.name: {} for d in datasets}
        for d in datasets:
            for i, u in enumerate(d.utterances):
                other = hypotheses[spec.key][d.name][i]
                if normalized_words(hypotheses[reference.key][d.name][i]["text"]) == normalized_words(other["text"]):
                    continue
                key = cache.key(d.name, u.id, other["audio"], other["text"])
                if key in cache.entries:
                    margins[spec.key][d.name][u.id] = cache.entries[key]
                else:
                    todo.append((d, i, key))
        if todo and not _score_margins(reference, options, todo, hypotheses[spec.key], margins[spec.key], cache):
            del margins[spec.key]
    return margins


def _score_margins(reference: ModelSpec, options: DecodeOptions, todo: list, other_rows: dict, into: dict,
                   cache: "MarginCache") -> bool:
    transcriber = open_transcriber(reference, options)
    try:
        if not hasattr(transcriber, "continuation_margin"):  # a runtime that cannot score a given continuation
            return False
        for d, i, key in todo:
            margin = transcriber.continuation_margin(d.audio[i], other_rows[d.name][i]["text"])
            into[d.name][d.utterances[i].id] = cache.entries[key] = margin
        cache.save()
        return True
    finally:
        transcriber.close()


class MarginCache:
    """{dataset/id/audio digest/text hash: margin} of one (PyTorch model, other run) pair, as one JSON file."""

    def __init__(self, directory: Path, reference: ModelSpec, other: ModelSpec) -> None:
        slug = re.sub(r"[^A-Za-z0-9._-]+", "_", f"margins__{other.label}__{other.backend}")
        self.path = directory / f"{slug}.json"
        self.identity = source_fingerprint(reference.source)
        stored = json.loads(self.path.read_text()) if self.path.is_file() else {}
        self.entries: dict[str, float | None] = stored.get("entries", {}) if stored.get("model") == self.identity \
            else {}

    @staticmethod
    def key(dataset: str, utterance_id: str, audio: str, text: str) -> str:
        return f"{dataset}/{utterance_id}/{audio}/{hashlib.sha1(text.encode()).hexdigest()}"

    def save(self) -> None:
        _write_atomically(self.path, json.dumps({"model": self.identity, "entries": self.entries}) + "\n")


def _transcribe_one(transcriber, utterance: Utterance, audio: np.ndarray, digest: str) -> dict:
    import time

    started = time.perf_counter()
    text = transcriber.transcribe(audio, utterance.id)
    return {"id": utterance.id, "audio": digest, "text": text, "seconds": round(time.perf_counter() - started, 4)}


def _write_atomically(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(text)
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)


def run(args: argparse.Namespace) -> int:
    specs = model_specs(args)
    pairs = comparisons(args.compare)
    out = Path(args.out)
    options = DecodeOptions(threads=args.threads, device=args.device)
    args.teacher_forced = args.teacher_forced or args.teacher_forced_only
    if args.teacher_forced and not args.reference:
        raise UserError("--teacher-forced needs --reference LABEL (the full-precision model)")
    if args.reference and args.reference not in {s.label for s in specs}:
        raise UserError(f"--reference {args.reference}: no model has that label")
    datasets = load_datasets(args.data, args.limit)
    if args.teacher_forced_only:
        return _teacher_forced_only(args, specs, datasets, pairs, out)
    try:
        hypotheses = transcribe_models(specs, datasets, options, out / "hypotheses", args.jobs, not args.quiet)
        margins = near_tie_margins(specs, datasets, hypotheses, options, out / "hypotheses")
    except BackendError as error:  # a runtime crash or timeout: the message names the model file and utterance
        raise UserError(str(error)) from None
    figures = teacher_forced_figures(specs, datasets, args.reference, args.zipf_threshold, args.device,
                                     out / "teacher-forced", not args.quiet) if args.teacher_forced else {}
    dataset_runs, utterance_lines = [], []
    for d in datasets:
        runs = []
        for spec in specs:
            rows = hypotheses[spec.key][d.name]
            scores = [score_utterance(u.id, u.text, row["text"], args.zipf_threshold)
                      for u, row in zip(d.utterances, rows)]
            info = next((row.get("info") for row in rows if row.get("info")), {})
            runs.append(ModelRun(spec.key, spec.label, spec.backend, spec.source, scores,
                                 sum(row["seconds"] for row in rows), d.audio_seconds, info))
            utterance_lines += [json.dumps({"dataset": d.name, "model": spec.key, **s.record()}, ensure_ascii=False)
                                for s in scores]
        dataset_runs.append(DatasetRuns(d.name, d.manifest, runs,
                                        {key: by_dataset[d.name] for key, by_dataset in margins.items()},
                                        figures.get(d.name, {})))
    settings = {"normalizer": normalizer_description(), "zipf_threshold": args.zipf_threshold,
                "threads": args.threads, "max_new_tokens": options.max_new_tokens, "decoding": "greedy",
                "near_tie_margin": args.near_tie_margin,
                "models": [{"key": s.key, "label": s.label, "source": s.source, "backend": s.backend} for s in specs]}
    report = build_report(dataset_runs, ReportOptions(args.resamples, args.seed, pairs, args.focus, args.examples,
                                                      args.context, near_tie_margin=args.near_tie_margin,
                                                      reference=args.reference), settings)
    markdown = render_markdown(report)
    _write_atomically(out / "report.json", json.dumps(report, indent=1, ensure_ascii=False) + "\n")
    _write_atomically(out / "report.md", markdown)
    _write_atomically(out / "utterances.jsonl", "\n".join(utterance_lines) + "\n")
    sys.stdout.write(markdown)
    print(f"wrote {out / 'report.md'}, {out / 'report.json'} and {out / 'utterances.jsonl'}")
    return 0
