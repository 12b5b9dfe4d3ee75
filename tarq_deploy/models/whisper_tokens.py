"""Whisper's tokenizer and generation-time token lists rebuilt from raw token bytes (the vocabulary a whisper.cpp model
file stores), so that a model read from such a file tokenizes exactly as the transformers and CTranslate2 copies do.

Whisper's text tokens are a byte-level BPE ranked like tiktoken's: token ``i`` is a byte string and its id is its merge
priority. A whisper.cpp file stores the bytes by id but no merge list; the merges follow from the ranks, since every
token of two bytes or more is the merge of the two parts that BPE reduces its bytes to when it may use only the tokens
ranked below it. The control tokens after the text tokens (end of text, start of transcript, the languages, the
tasks, no-timestamps, then 1501 timestamps) have one layout per vocabulary size, which whisper.cpp assigns by
n_vocab in the same way: 51864 English-only, 51865 multilingual, 51866 large-v3 (one language more, <|yue|>).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

from ..vocabulary import BYTE_DECODER
from .ct2 import END_OF_TEXT, MULTILINGUAL_MIN_VOCAB, NO_TIMESTAMPS, START_OF_TRANSCRIPT, TIMESTAMP_TOKEN_COUNT

__all__ = ["ControlTokens", "begin_suppressed_tokens", "suppressed_tokens", "text_tokens", "tokenizer_json"]

ENGLISH_END_OF_TEXT = 50256  # <|endoftext|> of the English-only vocabulary; multilingual ones have one text token more
BYTE_TOKENS = 256  # a byte-level BPE's first tokens: every single byte, so that any text can be encoded
AFTER_LANGUAGES = ("<|translate|>", "<|transcribe|>", "<|startoflm|>", "<|startofprev|>", "<|nocaptions|>",
                   NO_TIMESTAMPS)
# transformers' multilingual Whisper tokenizers (the hub's openai/whisper-* and faster-whisper's copies of them, the
# packaged base among them) have no merge for token 256, "Ġt": they encode " the" as "Ġ" + "the". Leaving it out
# keeps a model read from a whisper.cpp file on the token ids those tokenizers give (tests/test_ggml_source.py).
MULTILINGUAL_MISSING_MERGE = 256
# transformers' English-only Whisper tokenizers name Hebrew's language token by its old code, as tiny.en's does
ENGLISH_ONLY_NAMES = {"<|he|>": "<|iw|>"}

_BYTE_TO_CHAR = {byte: char for char, byte in BYTE_DECODER.items()}

# Whisper never lets generation begin with, or produce, tokens that spell only punctuation, brackets or music signs:
# the symbols below, where one token spells the symbol (alone or after a space), and the first token of each music
# sign however it is split; also " -" and " '" (its "non-speech" tokens, listed in every Whisper generation config).
NON_SPEECH_SYMBOLS = (*'"#()*+/:;<=>@[\\]^_`{|}~「」『』', "<<", ">>", "<<<", ">>>", "--", "---", "-(", "-[", "('",
                      '("', "((", "))", "(((", ")))", "[[", "]]", "{{", "}}", "♪♪", "♪♪♪")
MUSIC_SIGNS = tuple("♩♪♫♬♭♮♯")
ALWAYS_SUPPRESSED = (" -", " '")

Encode = Callable[[str], list[int]]


@dataclass(frozen=True)
class ControlTokens:
    """Whisper's control tokens for one vocabulary size: their names in id order, from <|endoftext|> on (the 1501
    timestamp tokens follow them)."""

    end_of_text: int
    names: tuple[str, ...]

    @classmethod
    def for_vocab_size(cls, n_vocab: int) -> "ControlTokens":
        """The layout of a Whisper vocabulary of ``n_vocab`` tokens; ValueError for a size no Whisper has."""
        from transformers.models.whisper.tokenization_whisper import LANGUAGES  # Whisper's language order

        end_of_text = ENGLISH_END_OF_TEXT + (n_vocab >= MULTILINGUAL_MIN_VOCAB)
        n_languages = n_vocab - end_of_text - 2 - len(AFTER_LANGUAGES) - TIMESTAMP_TOKEN_COUNT
        if not 1 <= n_languages <= len(LANGUAGES):
            raise ValueError(f"n_vocab {n_vocab} is no Whisper vocabulary (51864 English-only, 51865 multilingual, "
                             f"51866 large-v3)")
        languages = tuple(f"<|{code}|>" for code in list(LANGUAGES)[:n_languages])
        if end_of_text == ENGLISH_END_OF_TEXT:
            languages = tuple(ENGLISH_ONLY_NAMES.get(name, name) for name in languages)
        return cls(end_of_text, (END_OF_TEXT, START_OF_TRANSCRIPT, *languages, *AFTER_LANGUAGES))

    @property
    def ids(self) -> dict[str, int]:
        return {name: self.end_of_text + offset for offset, name in enumerate(self.names)}

    @property
    def languages(self) -> tuple[str, ...]:
        return self.names[2:-len(AFTER_LANGUAGES)]

    @property
    def multilingual(self) -> bool:
        return self.end_of_text > ENGLISH_END_OF_TEXT


# ------------------------------------------------------------------------------------------------- text tokens
def text_tokens(stored: Sequence[bytes], control: ControlTokens) -> list[bytes]:
    """The text tokens (ids below <|endoftext|>) of a stored vocabulary, which may end with <|endoftext|> itself (as
    this project's exporter writes it); ValueError when it is not a whole byte-level BPE vocabulary."""
    tokens = list(stored)
    if len(tokens) == control.end_of_text + 1 and tokens[-1] == END_OF_TEXT.encode():
        tokens.pop()
    if len(tokens) != control.end_of_text:
        raise ValueError(f"the vocabulary holds {len(stored)} tokens; a Whisper of this n_vocab has "
                         f"{control.end_of_text} text tokens (then, optionally, {END_OF_TEXT})")
    if sorted(tokens[:BYTE_TOKENS]) != [bytes([b]) for b in range(BYTE_TOKENS)]:
        raise ValueError(f"the first {BYTE_TOKENS} tokens are not the {BYTE_TOKENS} single bytes: not a byte-level "
                         f"BPE vocabulary")
    if len(set(tokens)) != len(tokens):
        raise ValueError("the vocabulary holds a token twice")
    return tokens


def bpe_merges(tokens: Sequence[bytes]) -> list[tuple[int, bytes, bytes]]:
    """(merged id, left, right) for every token that BPE over the lower-ranked tokens builds from two parts, in id
    order: the merge list whose priorities are the ranks (a token no such pair builds gets no merge)."""
    rank = {token: i for i, token in enumerate(tokens)}
    merges = []
    for i, token in enumerate(tokens):
        if len(token) < 2:
            continue
        parts = _merge_below(token, rank, i)
        if len(parts) == 2:
            merges.append((i, parts[0], parts[1]))
    return merges


def _merge_below(token: bytes, rank: dict[bytes, int], limit: int) -> list[bytes]:
    """``token``'s bytes merged pairwise, the lowest-ranked pair first, using only tokens ranked below ``limit``,
    until two parts are left or no pair merges."""
    parts = [token[j:j + 1] for j in range(len(token))]
    while len(parts) > 2:
        best, at = min((rank.get(left + right, limit), j) for j, (left, right) in enumerate(zip(parts, parts[1:])))
        if best >= limit:
            break
        parts[at:at + 2] = [parts[at] + parts[at + 1]]
    return parts


def _chars(token: bytes) -> str:
    """A token as byte-level BPE writes it: one printable character per byte."""
    return "".join(_BYTE_TO_CHAR[b] for b in token)


# --------------------------------------------------------------------------------------------------- tokenizer
def tokenizer_json(tokens: Sequence[bytes], control: ControlTokens) -> dict:
    """tokenizer.json (the ``tokenizers`` library's format) of the text tokens and control tokens, laid out as
    transformers' Whisper tokenizers are: byte-level pre-tokenizer and decoder, <|endoftext|> in the BPE vocabulary
    too, every control token special and not normalized, the transcript template as post-processor. The timestamp
    tokens are added with the other sources' (ct2.whisper_tokenizer)."""
    vocab = {_chars(token): i for i, token in enumerate(tokens)}
    vocab[END_OF_TEXT] = control.end_of_text
    skipped = MULTILINGUAL_MISSING_MERGE if control.multilingual else None
    merges = [f"{_chars(left)} {_chars(right)}" for i, left, right in bpe_merges(tokens) if i != skipped]
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
    return {"version": "1.0", "truncation": None, "padding": None,
            "added_tokens": [_added_token(i, name) for name, i in control.ids.items()],
            "normalizer": None, "pre_tokenizer": byte_level, "post_processor": _transcript_template(control),
            "decoder": {**byte_level, "add_prefix_space": True},
            "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": "",
                      "end_of_word_suffix": "", "fuse_unk": False, "vocab": vocab, "merges": merges}}


def _added_token(token_id: int, content: str) -> dict:
    return {"id": token_id, "content": content, "single_word": False, "lstrip": False, "rstrip": False,
            "normalized": False, "special": True}


def _transcript_template(control: ControlTokens) -> dict:
    """<|startoftranscript|> <|notimestamps|> text <|endoftext|>: what encoding with special tokens adds."""
    ids = control.ids

    def special(name: str, type_id: int = 0) -> dict:
        return {"SpecialToken": {"id": name, "type_id": type_id}}

    def sequence(name: str, type_id: int) -> dict:
        return {"Sequence": {"id": name, "type_id": type_id}}

    head = [special(START_OF_TRANSCRIPT), special(NO_TIMESTAMPS)]
    return {"type": "TemplateProcessing",
            "single": [*head, sequence("A", 0), special(END_OF_TEXT)],
            "pair": [*head, sequence("A", 0), sequence("B", 1), special(END_OF_TEXT, 1)],
            "special_tokens": {name: {"id": name, "ids": [ids[name]], "tokens": [name]}
                               for name in sorted((END_OF_TEXT, NO_TIMESTAMPS, START_OF_TRANSCRIPT))}}


# ------------------------------------------------------------------------------------------- generation tokens
def suppressed_tokens(encode: Encode, control: ControlTokens) -> list[int]:
    """Tokens generation never produces: the non-speech tokens and the control tokens that only a prompt holds
    (start of transcript, the tasks, start of LM / previous text, no captions)."""
    found = {encode(text)[0] for text in ALWAYS_SUPPRESSED}
    for symbol in (*NON_SPEECH_SYMBOLS, *MUSIC_SIGNS):
        for text in (symbol, " " + symbol):
            ids = encode(text)
            if len(ids) == 1 or symbol in MUSIC_SIGNS:
                found.add(ids[0])
    ids = control.ids
    found.update(ids[name] for name in (START_OF_TRANSCRIPT, *AFTER_LANGUAGES) if name != NO_TIMESTAMPS)
    return sorted(found)


def begin_suppressed_tokens(encode: Encode, control: ControlTokens) -> list[int]:
    """Tokens a transcript may not start with: a lone space and <|endoftext|> (an empty transcript)."""
    return [encode(" ")[0], control.end_of_text]
