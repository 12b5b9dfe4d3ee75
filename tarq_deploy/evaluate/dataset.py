"""One evaluation corpus as the scorers see it: its utterances and their audio, decoded once."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..data.corpus import Utterance

__all__ = ["Dataset"]


@dataclass
class Dataset:
    name: str
    manifest: str
    utterances: list[Utterance]
    audio: list[np.ndarray]  # float32 16 kHz, one per utterance
    spans: dict = field(default_factory=dict)  # id -> data.long_form spans, for a long-recording manifest

    @property
    def audio_seconds(self) -> float:
        return sum(len(a) for a in self.audio) / 16_000
