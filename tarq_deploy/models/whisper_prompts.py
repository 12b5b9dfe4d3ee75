"""The decoder's token shapes for calibration: the research shape and the one whisper-cli decodes in.

Calibration used to run Whisper's decoder on one shape only, ``<|sot|> [<|lang|> <|transcribe|>] <|notimestamps|>
text <|eot|>``. whisper-cli decodes with timestamps on, and within a recording every window after the first starts
with ``<|startofprev|>`` and the previous window's tokens. A GPTQ-family solver keeps the error small along the
activations it is shown; the timestamp tokens, the carried prompt and the end-of-text decision after a timestamp
were never shown, and results/cliform measured the cost: teacher-forced on whisper-cli's shape, GPTQ's and TARQ's
Q3_K mispredict the end of text 8-15x worse than ggml's plain rounding does, while they beat it on text tokens.

``stamped_window`` rewrites a window's plain token sequence into whisper-cli's shape, keeping every text token's
tail tag: the timestamps are the packing's own utterance boundaries (each utterance one segment), and the carried
prompt is the previous window's stamped tokens, as whisper.cpp carries them.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ..quant.choices import DECODER_SHAPES

__all__ = ["SECONDS_PER_TIMESTAMP", "ShapedWindow", "shape_of_window", "stamped_window"]

SECONDS_PER_TIMESTAMP = 0.02  # Whisper's timestamp tokens: <|0.00|> .. <|30.00|> in steps of 20 ms
MAX_TIMESTAMP_INDEX = 1500


@dataclass(frozen=True)
class ShapedWindow:
    """A window's full token sequence (the last token only a label), the tail tag and weight of each input position
    (position t predicts ids[t + 1]), and the positions that predict the text tokens and the end token, in order
    (the alignment reads its rows there)."""

    ids: list[int]
    mask: list[bool]
    weights: list[float]
    text_rows: list[int]
    carried: list[int]  # what the next window carries: this window's tokens after the task prompt, before <|eot|>


def shape_of_window(shape: str, index: int) -> str:
    """The shape the ``index``-th calibration window takes under ``shape`` (both: plain first, then alternating)."""
    if shape not in DECODER_SHAPES:
        raise ValueError(f"decoder shape must be one of {', '.join(DECODER_SHAPES)}, got {shape!r}")
    if shape == "both":
        return "plain" if index % 2 == 0 else "cli"
    return shape


def stamped_window(ids: Sequence[int], mask: Sequence[bool], weights: Sequence[float], n_prompt: int,
                   token_counts: Sequence[int], seconds: Sequence[float], gap_seconds: float, timestamp_begin: int,
                   previous: Sequence[int], start_of_previous: int, max_positions: int) -> ShapedWindow:
    """Whisper-cli's shape of a plain window: ``ids`` = prompt (ending in <|notimestamps|>) + the utterances' text
    tokens (``token_counts`` each, spoken for ``seconds`` each with ``gap_seconds`` between) + <|eot|>; ``mask`` and
    ``weights`` tag its input positions. The result drops <|notimestamps|>, puts each utterance between its start
    and end timestamps and, when ``previous`` holds tokens, starts with <|startofprev|> and as many of them (the
    last ones) as ``max_positions`` leaves room for. Timestamp and prompt positions are never tail."""
    text = len(ids) - n_prompt - 1
    if sum(token_counts) != text or len(token_counts) != len(seconds) or len(mask) != len(ids):
        raise ValueError("the utterances' token counts do not add up to the window's text tokens")
    body: list[int] = []
    where: list[int] = []  # the new index (within body) of each plain text token, then of <|eot|>
    start, at = 0.0, n_prompt
    for count, length in zip(token_counts, seconds):
        body.append(timestamp_begin + _timestamp_index(start))
        where.extend(range(len(body), len(body) + count))
        body.extend(ids[at:at + count])
        body.append(timestamp_begin + _timestamp_index(start + length))
        at += count
        start += length + gap_seconds
    where.append(len(body))
    body.append(ids[-1])
    task = list(ids[:n_prompt - 1])
    room = max_positions - len(task) - len(body)  # the inputs (all but the last token) fill at most max_positions
    carried = list(previous[-room:]) if previous and room > 0 else []
    head = ([start_of_previous] + carried if carried else []) + task
    new_ids = head + body
    new_mask, new_weights = [False] * len(new_ids), [1.0] * len(new_ids)
    for plain, new in enumerate(where, start=n_prompt):  # plain position plain - 1 predicted token ``plain``
        new_mask[len(head) + new - 1] = bool(mask[plain - 1])
        new_weights[len(head) + new - 1] = float(weights[plain - 1])
    return ShapedWindow(new_ids, new_mask, new_weights, [len(head) + new - 1 for new in where], body[:-1])


def _timestamp_index(seconds: float) -> int:
    return min(MAX_TIMESTAMP_INDEX, max(0, round(seconds / SECONDS_PER_TIMESTAMP)))
