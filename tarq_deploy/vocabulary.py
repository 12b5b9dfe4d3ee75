"""A byte-level BPE tokenizer's tokens as raw bytes: the table a lattice checkpoint stores beside tokenizer.json.

A byte-level BPE tokenizer (GPT-2's, Whisper's, Qwen's) writes every byte as one printable character; the runtimes
that take a token list of raw bytes (whisper.cpp's model file) need that mapping undone for ~50,000 tokens. Parsing a
4 MB tokenizer.json and translating it costs ~0.1 s, several times the I/O of a whole export, so the checkpoint
derives the table once, when it is written (checkpoint.py), and exporters read it as two arrays. tokenizer.json stays
the reference: ``verify`` compares a model file's vocabulary with the tokenizer, not with this table.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["BYTE_DECODER", "NotByteLevel", "TokenTable", "table_of_tokens", "token_strings"]


class NotByteLevel(ValueError):
    """The tokenizer's tokens use characters outside the byte-level BPE alphabet."""


def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet, inverted: character -> the byte it stands for."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + extra)
            extra += 1
    return {c: b for b, c in chars.items()}


BYTE_DECODER = _byte_decoder()
_BYTE_OF_CODE = np.full(max(map(ord, BYTE_DECODER)) + 1, -1, dtype=np.int16)  # code point -> byte (-1: none)
_BYTE_OF_CODE[[ord(c) for c in BYTE_DECODER]] = list(BYTE_DECODER.values())
TOKEN_SEPARATOR = "\0"  # no byte-level character (byte 0 is U+0100): marks where one token ends and the next begins


@dataclass(frozen=True)
class TokenTable:
    """Token id -> raw bytes for ids 0 .. n-1, held as length-prefixed records: token i is a little-endian int32 byte
    count followed by its bytes (the layout whisper.cpp's model file stores, so a prefix of ``records`` is that
    file's vocabulary section as it is). An id the tokenizer does not define is empty and ``defined[i]`` is False."""

    records: np.ndarray  # uint8 [4 n + total token bytes]
    lengths: np.ndarray  # int32 [n]: the byte count of each token (the records' own counts, for random access)
    defined: np.ndarray  # bool [n]
    source_digest: str = ""  # of the tokenizer.json it was derived from, where a checkpoint stores it

    @classmethod
    def of(cls, tokens: list[bytes]) -> "TokenTable":
        """A table of the given tokens, every id defined."""
        lengths = np.array([len(t) for t in tokens], dtype="<i4")
        return cls(length_prefixed(np.frombuffer(b"".join(tokens), np.uint8), lengths), lengths,
                   np.ones(len(tokens), dtype=bool))

    def __len__(self) -> int:
        return len(self.lengths)

    @property
    def starts(self) -> np.ndarray:
        """int64 [n + 1]: where each record starts, and the end."""
        return np.concatenate([[0], np.cumsum(self.lengths.astype(np.int64) + 4)])

    def tokens(self) -> list[bytes]:
        blob, starts = self.records.tobytes(), self.starts.tolist()
        return [blob[start + 4:end] for start, end in zip(starts[:-1], starts[1:])]

    def find(self, token: bytes) -> int | None:
        """The lowest defined id whose bytes are ``token``, or None."""
        candidates = np.flatnonzero((self.lengths == len(token)) & self.defined)
        if not len(candidates):
            return None
        at = self.starts[candidates] + 4  # each candidate's bytes, side by side: one comparison for all of them
        found = (self.records[at[:, None] + np.arange(len(token))] == np.frombuffer(token, np.uint8)).all(axis=1)
        return int(candidates[found][0]) if found.any() else None

    def prefix(self, n: int) -> "TokenTable":
        """The first ``n`` ids."""
        return TokenTable(self.records[:int(self.starts[n])], self.lengths[:n], self.defined[:n], self.source_digest)

    def check(self) -> None:
        """ValueError unless the records' own counts are ``lengths`` and they fill ``records`` exactly."""
        starts = self.starts
        if self.lengths.ndim != 1 or self.defined.shape != self.lengths.shape or (self.lengths < 0).any():
            raise ValueError("lengths and defined are not one non-negative entry per token")
        if starts[-1] != len(self.records):
            raise ValueError(f"{len(self.lengths)} tokens of {int(starts[-1])} record bytes, but {len(self.records)} "
                             f"are stored")
        if not np.array_equal(self.records[_count_bytes(starts[:-1])].view("<i4"), self.lengths):
            raise ValueError("the records' byte counts differ from lengths")


def token_strings(tokenizer: dict) -> dict[int, str]:
    """id -> token string of a parsed tokenizer.json: the model's vocabulary, then added tokens for ids it lacks."""
    id_to_token = {i: t for t, i in tokenizer.get("model", {}).get("vocab", {}).items()}
    for added in tokenizer.get("added_tokens", []):
        id_to_token.setdefault(added["id"], added["content"])
    return id_to_token


def token_table(tokenizer: dict, n: int | None = None) -> TokenTable:
    """The raw bytes of ids 0 .. n-1 (every id the tokenizer defines, by default) of a parsed byte-level BPE
    tokenizer.json; NotByteLevel names the characters that are not in the alphabet."""
    return table_of_tokens(token_strings(tokenizer), n)


def table_of_tokens(id_to_token: dict[int, str], n: int | None = None) -> TokenTable:
    """token_table of a tokenizer's token_strings, for a caller that has them already."""
    if n is None:
        n = max(id_to_token, default=-1) + 1
    data, lengths = _token_bytes([id_to_token.get(i, "") for i in range(n)])
    ids = np.fromiter(id_to_token, dtype=np.int64, count=len(id_to_token))
    defined = np.zeros(n, dtype=bool)
    defined[ids[(ids >= 0) & (ids < n)]] = True
    return TokenTable(length_prefixed(data, lengths), lengths, defined)


def _token_bytes(tokens: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """(the bytes of all byte-level ``tokens`` concatenated, uint8; each token's byte count, int32), or NotByteLevel
    naming the characters outside the alphabet. All tokens are decoded at once, as code points in numpy (every
    character stands for one byte): a str.translate and a len() per token took half of a Whisper vocabulary's 30 ms."""
    if not tokens:
        return np.empty(0, dtype=np.uint8), np.empty(0, dtype="<i4")
    codes = np.frombuffer(TOKEN_SEPARATOR.join(tokens).encode("utf-32-le"), dtype="<u4")
    ends = np.flatnonzero(codes == ord(TOKEN_SEPARATOR))
    chars = np.delete(codes, ends)
    in_table = chars < len(_BYTE_OF_CODE)
    data = np.where(in_table, _BYTE_OF_CODE[np.where(in_table, chars, 0)], -1)
    foreign = {chr(c) for c in np.unique(chars[data < 0])} | ({TOKEN_SEPARATOR} if len(ends) != len(tokens) - 1
                                                             else set())
    if foreign:
        raise NotByteLevel(f"tokens use characters outside the byte-level BPE alphabet: {sorted(foreign)[:10]}")
    lengths = np.append(ends, len(codes)) - np.concatenate(([0], ends + 1))
    return data.astype(np.uint8), lengths.astype("<i4")


def length_prefixed(data: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """uint8 records of tokens concatenated in ``data`` with byte counts ``lengths``: each count as a little-endian
    int32, then the token's bytes; assembled with array indexing, not 50,000 Python objects."""
    n = len(lengths)
    ends = np.cumsum(lengths, dtype=np.int64)
    out = np.empty(4 * n + len(data), dtype=np.uint8)
    heads = _count_bytes(ends - lengths + 4 * np.arange(n))  # token i's record starts after i counts and i tokens
    is_token_byte = np.ones(len(out), dtype=bool)
    is_token_byte[heads] = False
    out[heads] = lengths.astype("<i4").view(np.uint8)
    out[is_token_byte] = data
    return out


def _count_bytes(record_starts: np.ndarray) -> np.ndarray:
    """The positions of the four bytes of each record's int32 count."""
    return (record_starts[:, None] + np.arange(4)).ravel()
