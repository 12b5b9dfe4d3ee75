"""A user's term list: the words that must survive quantization (drug names, products, streets, a lecture's terms).

The file is UTF-8 text, one term per line; a term may be several words ("Joe Keaton", "ventricular fibrillation").
A line may end in a tab and a positive weight (``warfarin<TAB>2``): the term's positions then count that many times
in the tail's second moments (default 1). Blank lines and lines starting with ``#`` are skipped. Every problem names
the file and line: no text, a weight that is not a positive finite number, the same term twice (after normalisation).

A term *occurs* in a transcript where its words appear back to back, each compared after the same word normalisation
that reads the transcript (``words_of``: the calibration tagger's :func:`written_words`, or the evaluation's
normaliser), so "Keaton's" matches the term "Keaton" where the normaliser strips the clitic and "Joe Keaton" is found
only whole. Matching is leftmost-longest and non-overlapping: with the terms "new york" and "new york city", the
words "new york city hall" hold one occurrence, of "new york city".
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, NamedTuple, Sequence

from ..hashing import sha256_hex

__all__ = ["MAX_TERMS", "Term", "TermList", "TermOccurrence", "TermsError", "find_terms", "read_terms"]

# A list a person writes or a glossary exports; a file far larger than this is not a term list (and the matcher's
# first-word index would be the least of its costs).
MAX_TERMS = 100_000
MAX_TERM_WORDS = 16

WordsOf = Callable[[str], list[str]]


class TermsError(ValueError):
    """A term list that cannot be read; the message names the file and line."""


@dataclass(frozen=True)
class Term:
    """One term: as written, its weight and the line it came from."""

    text: str
    weight: float = 1.0
    line: int = 0


@dataclass(frozen=True)
class TermList:
    """The terms of one file, in file order, and the file's digest (what a result records of it)."""

    path: str
    terms: tuple[Term, ...]
    sha256: str

    def __len__(self) -> int:
        return len(self.terms)

    def record(self) -> dict:
        return {"file": self.path, "terms": len(self.terms), "sha256": self.sha256}

    def word_forms(self, words_of: WordsOf) -> list[tuple[str, ...]]:
        """Each term's words under ``words_of`` (empty where the normaliser leaves none)."""
        return [tuple(words_of(term.text)) for term in self.terms]


class TermOccurrence(NamedTuple):
    """Words ``start``..``end - 1`` of a word sequence are an occurrence of term number ``term``."""

    term: int
    start: int
    end: int


def read_terms(path: str | Path, words_of: WordsOf) -> TermList:
    """The term list in ``path`` (TermsError naming file and line). ``words_of`` (the calibration tagger's word split,
    or the evaluation's normaliser) decides which terms are the same term and that every term has a word."""
    source = Path(path)
    data = _read_bytes(source)
    terms: list[Term] = []
    seen: dict[tuple[str, ...], int] = {}
    for number, line in enumerate(_text_lines(source, data), start=1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        term = _parse_line(source, number, line)
        words = tuple(words_of(term.text))
        _check_words(source, number, term.text, words, seen)
        seen[words] = number
        terms.append(term)
        if len(terms) > MAX_TERMS:
            raise TermsError(f"{source}:{number}: more than {MAX_TERMS} terms; a term list names the words that "
                             f"must survive, not a lexicon")
    if not terms:
        raise TermsError(f"{source}: no terms (one term per line; '#' starts a comment)")
    return TermList(str(source), tuple(terms), sha256_hex(data))


def _read_bytes(source: Path) -> bytes:
    try:
        return source.read_bytes()
    except IsADirectoryError:
        raise TermsError(f"{source}: is a folder, not a term list") from None
    except OSError as error:
        raise TermsError(f"{source}: cannot be read ({error.strerror or error})") from None


def _text_lines(source: Path, data: bytes) -> list[str]:
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as error:
        line = data[: error.start].count(b"\n") + 1
        raise TermsError(f"{source}:{line}: not UTF-8 text ({error.reason} at byte {error.start})") from None
    if "\x00" in text:
        line = text[: text.index("\x00")].count("\n") + 1
        raise TermsError(f"{source}:{line}: holds a NUL byte; a term list is plain text")
    return text.splitlines()


def _parse_line(source: Path, number: int, line: str) -> Term:
    text, tab, weight_text = line.partition("\t")
    weight = 1.0
    if tab:
        try:
            weight = float(weight_text.strip())
        except ValueError:
            weight = math.nan
        if not (math.isfinite(weight) and weight > 0):
            raise TermsError(f"{source}:{number}: the weight after the tab must be a positive number, got "
                             f"{weight_text.strip()!r}")
    return Term(text.strip(), weight, number)


def _check_words(source: Path, number: int, text: str, words: tuple[str, ...],
                 seen: dict[tuple[str, ...], int]) -> None:
    if not words:
        raise TermsError(f"{source}:{number}: {text!r} holds no word (letters or digits)")
    if len(words) > MAX_TERM_WORDS:
        raise TermsError(f"{source}:{number}: {len(words)} words; a term has at most {MAX_TERM_WORDS}")
    if words in seen:
        raise TermsError(f"{source}:{number}: {text!r} is the term of line {seen[words]} again")


def find_terms(words: Sequence[str], forms: Sequence[tuple[str, ...]]) -> list[TermOccurrence]:
    """The occurrences of the terms (their word ``forms``) in ``words``: leftmost-longest, non-overlapping."""
    by_first: dict[str, list[int]] = {}
    for index, form in enumerate(forms):
        if form:
            by_first.setdefault(form[0], []).append(index)
    for candidates in by_first.values():
        candidates.sort(key=lambda i: -len(forms[i]))  # the longest term starting with that word is tried first
    found, position = [], 0
    while position < len(words):
        match = next((i for i in by_first.get(words[position], ())
                      if tuple(words[position: position + len(forms[i])]) == forms[i]), None)
        if match is None:
            position += 1
            continue
        found.append(TermOccurrence(match, position, position + len(forms[match])))
        position += len(forms[match])
    return found
