"""The text normalisation word error rates are computed under, and the word test built on it: one definition of "the
words of a transcript" for the corpus readers (a transcript with none is refused) and for WER scoring
(tarq_deploy.evaluate.wer re-exports these names).

Reference and hypothesis both go through Whisper's English text normaliser (transformers' ``EnglishTextNormalizer``:
lowercase, punctuation and bracketed text removed, contractions and spelled-out numbers standardised) with Whisper's
British-to-American spelling map when the ``whisper_normalizer`` package supplies it (:func:`normalizer_description`
says which). Words are the whitespace-separated tokens of the normalised text.

Other languages (:func:`normalizer_for`): Whisper's basic normaliser (transformers' ``BasicTextNormalizer``:
lowercase, bracketed text and punctuation removed, diacritics kept); a language written without spaces
(``rarity.UNSPACED_LANGUAGES``) is split into characters, so its word error rate is the character error rate.
"""
from __future__ import annotations

import functools
import importlib.util
import json
import re
import sys
from pathlib import Path
from types import ModuleType
from typing import Callable

__all__ = ["Normalizer", "english_spelling_mapping", "normalized_words", "normalizer_description", "normalizer_for",
           "spoken_words", "whisper_english_normalizer"]

Normalizer = Callable[[str], str]

# A token that holds a letter or a digit: something a recogniser can be asked to say.
_SPOKEN = re.compile(r"[^\W_]")


@functools.lru_cache(maxsize=1)
def english_spelling_mapping() -> tuple[dict[str, str], str]:
    """Whisper's British -> American spelling map and where it came from ({} and "none" when unavailable)."""
    try:
        from importlib.resources import files

        data = files("whisper_normalizer").joinpath("normalizers/english.json").read_text(encoding="utf-8")
    except (ImportError, FileNotFoundError, OSError):
        return {}, "none"
    return json.loads(data), "whisper_normalizer/normalizers/english.json"


@functools.lru_cache(maxsize=1)
def whisper_english_normalizer() -> Normalizer:
    return _whisper_normalizers().EnglishTextNormalizer(english_spelling_mapping()[0])


NORMALIZER_MODULE = "transformers.models.whisper.english_normalizer"


@functools.lru_cache(maxsize=1)
def _whisper_normalizers() -> ModuleType:
    """transformers' module of Whisper's normalisers. It needs only re, unicodedata, fractions and regex, but an
    import by name first runs transformers' package __init__ (a second a process: the scoring of a whisper.cpp
    file has no other use for transformers). So, unless transformers is loaded already, its file is run on its
    own, from the installed package: the same code, the same normalisation."""
    if "transformers" in sys.modules:
        return importlib.import_module(NORMALIZER_MODULE)
    package = importlib.util.find_spec("transformers")  # locates the package without running it
    path = Path(package.origin).parent.joinpath(*NORMALIZER_MODULE.split(".")[1:]).with_suffix(".py") \
        if package is not None and package.origin else None
    if path is None or not path.is_file():
        return importlib.import_module(NORMALIZER_MODULE)
    spec = importlib.util.spec_from_file_location(f"{__name__}._whisper_normalizers", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@functools.lru_cache(maxsize=32)
def normalizer_for(language: str = "en") -> Normalizer:
    """The normaliser of transcripts in ``language``: Whisper's English one, else its basic one (split into
    characters where words are written without spaces: CER)."""
    from .rarity import UNSPACED_LANGUAGES

    if language == "en":
        return whisper_english_normalizer()
    return _whisper_normalizers().BasicTextNormalizer(remove_diacritics=False,
                                                      split_letters=language in UNSPACED_LANGUAGES)


def normalizer_description(language: str = "en") -> str:
    from .rarity import UNSPACED_LANGUAGES

    if language != "en":
        units = "characters (CER)" if language in UNSPACED_LANGUAGES else "words"
        return f"transformers BasicTextNormalizer ({language}: diacritics kept, scored by {units})"
    mapping, source = english_spelling_mapping()
    spelling = f"spelling map of {len(mapping)} entries ({source})" if mapping else "no spelling map"
    return f"transformers EnglishTextNormalizer, {spelling}"


def normalized_words(text: str, normalizer: Normalizer | None = None) -> list[str]:
    return (normalizer or whisper_english_normalizer())(text).split()


def spoken_words(text: str, normalizer: Normalizer | None = None) -> list[str]:
    """The normalised words that hold a letter or a digit. Whisper's normaliser leaves some punctuation standing as
    a token of its own (``"..."`` -> ``"."``), which no recogniser says: a transcript of only such tokens has no word
    to score or to calibrate on."""
    return [word for word in normalized_words(text, normalizer) if _SPOKEN.search(word)]
