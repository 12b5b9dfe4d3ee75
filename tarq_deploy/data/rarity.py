"""Rare-word tagging: reference words -> wordfreq Zipf -> rare flags -> decoder token positions.

A reference word is **rare** when its English ``wordfreq`` Zipf score is below ``k`` (default 3.0, i.e. fewer
than one occurrence per million words), as in the paper.  The deliberate choices on top of that rule:

* **Words** are maximal runs of letters/digits joined by internal apostrophes or hyphens (``don't``,
  ``cold-hearted``), or digits joined by ``.``/``,`` (``3.5``, ``1,000``).  Everything else (sentence punctuation,
  quotes, dashes between words, leading/trailing apostrophes) is not part of a word.
* **Normalisation** before lookup: Unicode NFKC, lowercase, curly apostrophes made straight.
* **Hyphenated words** are rare iff *any* hyphen-separated part is rare.  The Whisper English normaliser used for
  WER splits hyphens, so a hyphenated calibration word is tagged exactly when rare-WER would count one of its
  parts as rare.  (wordfreq's own score for the whole is a harmonic combination of the parts, so it is at most
  the rarest part's score and would give the same answer in almost every case.)
* **Possessives / clitics** (``'s 'd 'll 're 've 'm 't``) score the larger of the whole form and the stem before
  the apostrophe: wordfreq rates ``kitchen's`` 2.3 and does not know ``dashwood's`` at all, but whether a
  recogniser finds the word hard depends on ``kitchen`` (common) and ``dashwood`` (rare).
* **Numerals** (words containing a digit) are scored by wordfreq like any word, by default (``numerals="zipf"``):
  wordfreq models digit strings deliberately (``10`` -> 5.3, year-like ``1847`` -> 3.3, ``2934`` -> 1.9), this is
  the paper's literal rule, and it keeps the tail share of read speech at the paper's ~7 %.  ``numerals="rare"``
  tags every numeral rare instead (numerals are an error-prone class whose written frequency says little about
  how hard the spoken form is); use it only consistently for calibration and evaluation.

**The tail** is what calibration re-weights and evaluation scores apart: by default the rare words above
(:class:`TailRule` mode ``zipf``); with a user's term list (data/terms.py) the words of every occurrence of a term
(mode ``terms``), or both. Words of a term carry the term's weight (:attr:`Word.weight`).

**Languages**: Zipf scores come from wordfreq's table of the transcript's language (``TailRule.language``). A
language written without spaces between words (:data:`UNSPACED_LANGUAGES`: Chinese, Japanese, Thai, ...) is split
into characters, each a unit of its own, scored by the character's Zipf -- the units its character error rate counts.

Token positions follow teacher forcing: the decoder input at position ``t`` predicts the token at ``t + 1``, so
``mask[t]`` is True iff the token at ``t + 1`` belongs to a rare word (the mask is over *input* positions,
shifted by one against the label tokens).  Works with any Hugging Face *fast* tokenizer (character offsets).
"""
from __future__ import annotations

import functools
import re
import unicodedata
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Literal, NamedTuple, Sequence

if TYPE_CHECKING:
    from .terms import TermList

__all__ = ["DEFAULT_LANGUAGE", "DEFAULT_ZIPF_THRESHOLD", "NumeralPolicy", "TAIL_MODES", "TailRule", "UNSPACED_LANGUAGES",
           "count_rare_words", "decoder_text", "is_rare_word", "language_problem", "normalize_word", "rare_token_mask",
           "reference_words", "tail_rule", "term_match_words", "written_words", "zipf"]

DEFAULT_ZIPF_THRESHOLD = 3.0
DEFAULT_LANGUAGE = "en"
NumeralPolicy = Literal["zipf", "rare"]
TailMode = Literal["zipf", "terms", "both"]
TAIL_MODES = ("zipf", "terms", "both")
# Written without spaces between words: scored by characters (CER), each character a unit of its own.
UNSPACED_LANGUAGES = frozenset({"zh", "ja", "th", "lo", "km", "my", "yue", "bo"})

# letters/digits ([^\W_]), joined by single internal apostrophes or hyphens, or by . , between two digits
_WORD = re.compile(r"[^\W_]+(?:(?:['\-]|(?<=\d)[.,](?=\d))[^\W_]+)*")
_APOSTROPHES = str.maketrans({"\u2019": "'", "\u2018": "'", "\u02bc": "'", "\u2010": "-", "\u2011": "-"})
_THOUSANDS_SEPARATOR = re.compile(r"(?<=\d),(?=\d{3}\b)")
_CLITIC = re.compile(r"^(?P<stem>.+?)'(?:s|d|ll|re|ve|m|t)$")


# ------------------------------------------------------------------------------------------ words and rarity


def _canonical_chars(text: str) -> str:
    """Fold apostrophe/hyphen look-alikes to ASCII, one character for one (so character offsets survive)."""
    return text.translate(_APOSTROPHES)


# The word functions below are pure and called for every word of every transcript, several times a word (a corpus synth
# judges ~1.1 M words of its text sources: 31 s under cProfile, most of it normalising the same words again): cached.
WORD_CACHE = 1 << 18


@functools.lru_cache(maxsize=WORD_CACHE)
def normalize_word(word: str) -> str:
    """Lowercase, NFKC, straight apostrophes, outer punctuation stripped; internal ' and - kept.

    Thousands separators are dropped (``1,000`` -> ``1000``) as the Whisper normaliser does; wordfreq would
    otherwise score the comma form as very rare.
    """
    folded = _canonical_chars(unicodedata.normalize("NFKC", word)).lower()
    match = _WORD.search(folded)
    return _THOUSANDS_SEPARATOR.sub("", match.group(0)) if match else ""


def written_words(text: str) -> list[str]:
    """The words of ``text`` as written, each as ``normalize_word`` gives it (spelled-out numbers stay words, unlike
    under Whisper's normaliser)."""
    return [normalize_word(match.group(0)) for match in _WORD.finditer(_canonical_chars(text))]


@functools.lru_cache(maxsize=WORD_CACHE)
def zipf(word: str, language: str = DEFAULT_LANGUAGE) -> float:
    """wordfreq Zipf score of a normalised word in ``language`` (0.0 when unknown)."""
    from wordfreq import zipf_frequency  # imported lazily: wordfreq loads its tables on first use

    if language == "zh":
        _quiet_jieba()
    return float(zipf_frequency(word, language))


@functools.lru_cache(maxsize=1)
def _quiet_jieba() -> None:
    """wordfreq segments Chinese with jieba, which logs its dictionary's loading at INFO on first use."""
    import logging

    try:
        import jieba
    except ImportError:  # wordfreq names the missing package itself (language_problem)
        return
    jieba.setLogLevel(logging.WARNING)


@functools.lru_cache(maxsize=64)
def language_problem(language: str) -> str | None:
    """Why Zipf rarity cannot be read in ``language`` (None: it can): wordfreq has no table of it, or the table needs
    a segmenter that is not installed."""
    from wordfreq import available_languages

    if language not in available_languages():
        return f"wordfreq has no word frequencies of {language!r} (it has: {', '.join(sorted(available_languages()))})"
    try:
        zipf("a", language)
    except ImportError as error:  # Japanese needs MeCab, Chinese jieba
        return f"wordfreq needs the package {error.name!r} to segment {language!r} text"
    return None


def _part_zipf(part: str, language: str) -> float:
    score = zipf(part, language)
    clitic = _CLITIC.match(part) if language == "en" else None
    if clitic:  # "kitchen's" scores 2.3, "dashwood's" 0.0: the written clitic form says little, the stem decides
        return max(score, zipf(clitic["stem"], language))
    return score


@functools.lru_cache(maxsize=WORD_CACHE)
def word_zipf(word: str, language: str = DEFAULT_LANGUAGE) -> float:
    """Zipf score used for the rare decision: the minimum over hyphen-separated parts (see module doc)."""
    parts = [p for p in normalize_word(word).split("-") if p]
    return min((_part_zipf(p, language) for p in parts), default=0.0)


def is_numeral(word: str) -> bool:
    return any(ch.isdigit() for ch in word)


@functools.lru_cache(maxsize=WORD_CACHE)
def is_rare_word(word: str, k: float = DEFAULT_ZIPF_THRESHOLD, numerals: NumeralPolicy = "zipf",
                 language: str = DEFAULT_LANGUAGE) -> bool:
    """True iff the (normalised) word is rare: Zipf < k for some hyphen part, or a numeral under ``"rare"``."""
    normalized = normalize_word(word)
    if not normalized:
        return False
    if numerals == "rare" and is_numeral(normalized):
        return True
    return word_zipf(normalized, language) < k


@dataclass(frozen=True)
class Word:
    """One reference word: character span in the transcript, its normalised form, score and rare flag."""

    index: int
    text: str
    start: int
    end: int
    normalized: str
    zipf: float
    rare: bool  # in the tail (see TailRule): a rare word, or a word of a term
    token_positions: tuple[int, ...] = field(default=())
    weight: float = 1.0  # the tail weight of its positions: a term's weight, 1 for a rare word


@dataclass(frozen=True)
class TailRule:
    """Which reference words are the tail: ``zipf`` (Zipf < k in ``language``), ``terms`` (the words of every
    occurrence of a term of ``terms``) or ``both``."""

    k: float = DEFAULT_ZIPF_THRESHOLD
    numerals: NumeralPolicy = "zipf"
    language: str = DEFAULT_LANGUAGE
    mode: TailMode = "zipf"
    terms: "TermList | None" = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if self.mode not in TAIL_MODES:
            raise ValueError(f"tail mode must be one of {TAIL_MODES}, got {self.mode!r}")
        if self.mode != "zipf" and self.terms is None:
            raise ValueError(f"tail mode {self.mode!r} needs a term list")

    def for_language(self, language: str) -> "TailRule":
        """The rule for a transcript in ``language`` (an utterance's own; empty: the rule's)."""
        return self if not language or language == self.language else replace(self, language=language)

    @functools.cached_property
    def term_forms(self) -> list[tuple[str, ...]]:
        return self.terms.word_forms(term_match_words) if self.terms is not None else []

    def tag(self, words: list[Word]) -> list[Word]:
        """``words`` with the rule's tail flags and weights."""
        from .terms import find_terms

        zipf_tail = [self.mode != "terms" and w.rare for w in words]
        weights = [1.0] * len(words)
        in_term = [False] * len(words)
        if self.mode != "zipf":
            for found in find_terms([_match_form(w.normalized) for w in words], self.term_forms):
                for i in range(found.start, found.end):
                    in_term[i] = True
                    weights[i] = max(weights[i], self.terms.terms[found.term].weight)
        return [replace(w, rare=z or t, weight=wt if (z or t) else 1.0)
                for w, z, t, wt in zip(words, zipf_tail, in_term, weights)]


def _match_form(word: str) -> str:
    """A word as a term is matched: its stem before a clitic ("keaton's" -> "keaton"), which the tagger keeps."""
    clitic = _CLITIC.match(word)
    return clitic["stem"] if clitic else word


def term_match_words(text: str) -> list[str]:
    """The words of ``text`` as terms are matched in calibration transcripts (written words, clitics dropped)."""
    return [_match_form(word) for word in written_words(text)]


def tail_rule(rule: "TailRule | float") -> TailRule:
    """A rule from a rule or a bare Zipf threshold (the callers that know only k)."""
    return rule if isinstance(rule, TailRule) else TailRule(k=float(rule))


def _units(text: str, language: str) -> list[tuple[int, int]]:
    """Character spans of the scored units of ``text``: words, or each character in an unspaced language."""
    spans = [(m.start(), m.end()) for m in _WORD.finditer(_canonical_chars(text))]
    if language not in UNSPACED_LANGUAGES:
        return spans
    return [(i, i + 1) for start, end in spans for i in range(start, end)]


def reference_words(
    text: str, k: "float | TailRule" = DEFAULT_ZIPF_THRESHOLD, numerals: NumeralPolicy = "zipf"
) -> list[Word]:
    """Split a transcript into words with character spans (into ``text`` itself) and tail flags: Zipf-rare words
    for a bare threshold ``k``, the rule's tail for a :class:`TailRule` (whose numeral policy then applies)."""
    rule = tail_rule(k) if isinstance(k, TailRule) else TailRule(k=float(k), numerals=numerals)
    words = []
    for index, (start, end) in enumerate(_units(text, rule.language)):
        normalized = normalize_word(text[start:end])
        words.append(Word(index=index, text=text[start:end], start=start, end=end, normalized=normalized,
                          zipf=word_zipf(normalized, rule.language),
                          rare=is_rare_word(normalized, rule.k, rule.numerals, rule.language)))
    return rule.tag(words) if rule.mode != "zipf" else words


@dataclass(frozen=True)
class RarityCounts:
    words: int
    rare_words: int

    @property
    def rare_share(self) -> float:
        return self.rare_words / self.words if self.words else 0.0


def count_rare_words(
    text: str, k: "float | TailRule" = DEFAULT_ZIPF_THRESHOLD, numerals: NumeralPolicy = "zipf"
) -> RarityCounts:
    words = reference_words(text, k, numerals)
    return RarityCounts(words=len(words), rare_words=sum(w.rare for w in words))


# ----------------------------------------------------------------------------------- words -> token positions


class _Encoding(NamedTuple):
    ids: list[int]
    offsets: list[tuple[int, int]]


def _encode_with_offsets(tokenizer: Any, text: str) -> _Encoding:
    """Token ids and character offsets of ``text`` without special tokens, for any HF fast tokenizer."""
    backend = getattr(tokenizer, "backend_tokenizer", tokenizer)  # transformers fast tokenizer -> tokenizers
    if not hasattr(backend, "encode") or not hasattr(backend, "get_vocab_size"):
        raise TypeError(
            f"{type(tokenizer).__name__} gives no character offsets; pass a `tokenizers.Tokenizer` or a "
            "transformers *fast* tokenizer (PreTrainedTokenizerFast)"
        )
    encoding = backend.encode(text, add_special_tokens=False)
    return _Encoding(list(encoding.ids), [tuple(o) for o in encoding.offsets])


def _strip_span(text: str, start: int, end: int) -> tuple[int, int]:
    # Byte-level BPE offsets include the token's leading space (" catalog"); only visible characters count.
    while start < end and text[start].isspace():
        start += 1
    while end > start and text[end - 1].isspace():
        end -= 1
    return start, end


def token_word_indices(offsets: Sequence[tuple[int, int]], text: str, words: Sequence[Word]) -> list[int]:
    """For each token, the index of the word its visible characters overlap most (-1: punctuation/space only).

    Ties go to the earlier word.  A token whose offsets are empty (e.g. a later piece of a multi-byte character
    that byte-level BPE split) inherits the word of the token before it when that word contains its offset.
    """
    result: list[int] = []
    for start, end in offsets:
        start, end = _strip_span(text, start, end)
        best, best_overlap = -1, 0
        for word in words:
            overlap = min(end, word.end) - max(start, word.start)
            if overlap > best_overlap:
                best, best_overlap = word.index, overlap
        if best == -1 and start == end and result and result[-1] >= 0:
            previous = words[result[-1]]
            best = previous.index if previous.start <= start <= previous.end else -1
        result.append(best)
    return result


class RareTokenMask(NamedTuple):
    """Decoder input ids, the rare-prediction mask over input positions, the reference words, and each input
    position's tail weight (1 where untagged; a term's weight where its next token is one of the term's)."""

    input_ids: list[int]
    mask: list[bool]
    words: list[Word]
    weights: list[float]


def rare_token_mask(
    tokenizer: Any,
    prefix_token_ids: Sequence[int],
    text: str,
    k: "float | TailRule" = DEFAULT_ZIPF_THRESHOLD,
    eos_token_id: int | None = None,
    numerals: NumeralPolicy = "zipf",
) -> RareTokenMask:
    """Tag the decoder input positions whose *next* token belongs to a rare reference word.

    ``text`` is tokenised exactly as given -- pass it as the decoder will see it (Whisper: a leading space, see
    :func:`decoder_text`).  ``input_ids = prefix_token_ids + tokens(text) + [eos_token_id]`` (eos only when
    given).  ``mask[t]`` is True iff ``input_ids[t + 1]`` is a token of a rare word; the last position is always
    False.  Teacher forcing feeds ``input_ids[:-1]`` with labels ``input_ids[1:]``, and ``mask[:-1]`` lines up
    with that input.  ``words[i].token_positions`` are positions in ``input_ids`` (not in the mask).
    """
    words = reference_words(text, k, numerals)
    encoding = _encode_with_offsets(tokenizer, text)
    owners = token_word_indices(encoding.offsets, text, words)
    offset = len(prefix_token_ids)
    positions: dict[int, list[int]] = {}
    for i, owner in enumerate(owners):
        if owner >= 0:
            positions.setdefault(owner, []).append(offset + i)
    words = [_with_positions(w, positions.get(w.index, [])) for w in words]

    input_ids = list(prefix_token_ids) + encoding.ids + ([eos_token_id] if eos_token_id is not None else [])
    token_is_rare = [False] * offset + [o >= 0 and words[o].rare for o in owners] + [False] * (
        eos_token_id is not None
    )
    token_weight = [1.0] * offset + [words[o].weight if o >= 0 else 1.0 for o in owners] + [1.0] * (
        eos_token_id is not None
    )
    mask = token_is_rare[1:] + [False]  # input position t predicts the token at t + 1
    return RareTokenMask(input_ids, mask, words, token_weight[1:] + [1.0])


def _with_positions(word: Word, positions: list[int]) -> Word:
    return Word(**{**word.__dict__, "token_positions": tuple(positions)})


def decoder_text(transcript: str) -> str:
    """A transcript as Whisper's decoder sees it after the prompt: one leading space, no outer whitespace."""
    return " " + transcript.strip()
