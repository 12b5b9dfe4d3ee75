"""Teacher-forced quality figures, split by rarity: how far a quantized model's next-token distributions move from
the full-precision model's on the reference transcript (the way the ggml community grades quantizations with
llama.cpp's KL-divergence statistics), plus rare-word retention from decoded transcripts.

On the reference transcript (the prompt, the text tokens, end of text), at every position that predicts a text token
or the end token, with P the reference (full-precision) model's next-token distribution and Q the quantized one's:

* ``kld``  = KL(P || Q) = sum_v P(v) (log P(v) - log Q(v))                 (nats)
* ``dnll`` = -log Q(y) + log P(y), y the reference token                    (nats; > 0: the model lost confidence)
* ``top1`` = 1 if argmax Q = argmax P else 0                                 (agreement with full precision)

Each is summed per utterance over *rare* positions (those predicting a token of a rare reference word, the same
tags calibration uses: :func:`tarq_deploy.data.rarity.rare_token_mask`) and over *common* positions (all others). A
corpus figure is a ratio of sums (sum over utterances / positions), so the utterance-level bootstrap of
:mod:`.wer` gives its interval and paired differences between models. No decoding is involved: one forward pass per
model and utterance, so one repetition loop cannot move the figure by points.

Rare-word retention: of the rare reference words the reference model transcribes correctly (aligned ``ok``), the
share the quantized model also gets right, on the same utterances (a ratio of per-utterance sums as well).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

import numpy as np

from .wer import OK, UtteranceScore

if TYPE_CHECKING:
    from ..data.rarity import TailRule

__all__ = ["TEACHER_FORCED_LINES", "TF_METRICS", "TeacherForcedScorer", "UtteranceFigures", "figure_counts",
           "pack_windows", "retention_counts", "score_utterances", "token_figures"]

FIGURES = ("kld", "dnll", "top1")
GROUPS = ("rare", "common")
TEACHER_FORCED_LINES = "teacher-forced.jsonl"  # eval's per-utterance figures, one JSON line each
TF_METRICS = tuple(f"{figure}_{group}" for figure in FIGURES for group in GROUPS)  # kld_rare, kld_common, ...


@dataclass(frozen=True)
class UtteranceFigures:
    """One model against the reference on one utterance: per-group sums of each figure and position counts."""

    id: str
    sums: dict[str, float]  # TF_METRICS -> sum over that group's positions
    counts: dict[str, int]  # GROUPS -> positions

    def record(self) -> dict:
        return {"id": self.id, "sums": self.sums, "counts": self.counts}

    @classmethod
    def from_record(cls, record: dict) -> "UtteranceFigures":
        return cls(record["id"], dict(record["sums"]), {k: int(v) for k, v in record["counts"].items()})


def token_figures(reference_logits, model_logits, labels, rare, utterance_id: str = "") -> UtteranceFigures:
    """Figures of one utterance from logits [T, V] of both models at the scored positions, the reference tokens
    ``labels`` [T] they predict and the rare tags [T]. Computed in float64 (torch tensors or numpy arrays)."""
    import torch

    ref = torch.as_tensor(reference_logits).double()
    mod = torch.as_tensor(model_logits).double()
    labels = torch.as_tensor(labels).long()
    rare = torch.as_tensor(rare).bool()
    if ref.shape != mod.shape or ref.dim() != 2 or labels.shape != ref.shape[:1] or rare.shape != ref.shape[:1]:
        raise ValueError(f"shapes differ: logits {tuple(ref.shape)} / {tuple(mod.shape)}, labels "
                         f"{tuple(labels.shape)}, rare {tuple(rare.shape)}")
    log_p, log_q = torch.log_softmax(ref, dim=-1), torch.log_softmax(mod, dim=-1)
    per_position = {
        "kld": (log_p.exp() * (log_p - log_q)).sum(dim=-1),
        "dnll": (log_p - log_q).gather(1, labels[:, None])[:, 0],
        "top1": (ref.argmax(dim=-1) == mod.argmax(dim=-1)).double(),
    }
    sums = {f"{figure}_{group}": float(values[mask].sum())
            for figure, values in per_position.items() for group, mask in (("rare", rare), ("common", ~rare))}
    return UtteranceFigures(utterance_id, sums, {"rare": int(rare.sum()), "common": int((~rare).sum())})


def figure_counts(figures: Sequence[UtteranceFigures]) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Per-utterance (numerator, denominator) arrays of every teacher-forced metric (like wer.metric_counts)."""
    counts = {}
    for metric in TF_METRICS:
        group = metric.rsplit("_", 1)[1]
        counts[metric] = (np.array([f.sums[metric] for f in figures], dtype=np.float64),
                          np.array([f.counts[group] for f in figures], dtype=np.float64))
    return counts


def retention_counts(reference: Sequence[UtteranceScore], model: Sequence[UtteranceScore]) -> tuple[np.ndarray,
                                                                                                      np.ndarray]:
    """Per utterance: rare reference words both models transcribe correctly, and those the reference model does."""
    kept, known = [], []
    for ref, mod in zip(reference, model, strict=True):
        if ref.reference_words != mod.reference_words:
            raise ValueError(f"utterance {ref.id!r}: the two runs have different reference words")
        right = [o.rare and o.op == OK for o in ref.outcomes]
        kept.append(sum(r and o.op == OK for r, o in zip(right, mod.outcomes)))
        known.append(sum(right))
    return np.array(kept, dtype=np.float64), np.array(known, dtype=np.float64)


# ------------------------------------------------------------------------------------------------------ running
@dataclass(frozen=True)
class WindowTargets:
    """A packed window's decoder ids (prompt, every utterance's text tokens, end token) and, for each scored
    position (``first`` .. len(ids) - 2, each predicting ids[t + 1]), its rare tag and the utterance it belongs to."""

    ids: list[int]
    first: int
    rare: list[bool]
    owner: list[int]


class TeacherForcedScorer:
    """A Whisper model run teacher-forced on reference transcripts: logits at the scored positions.

    Utterances are packed into 30 s windows (0.3 s of silence between them, transcripts joined), as calibration
    packs them: Whisper encodes 30 s whatever the input, so packing makes the figures ~5x cheaper. Each window's
    token sequence is the concatenation of its utterances' own tokenizations (exact for byte-level BPE, whose
    pieces never cross the space before a word), so every scored position belongs to one utterance."""

    def __init__(self, bundle, device: str = "cpu", k: "float | TailRule | None" = None) -> None:
        from ..data.rarity import DEFAULT_ZIPF_THRESHOLD
        from ..models.whisper import WhisperBackbone

        model, processor, generation_config = bundle
        self.backbone = WhisperBackbone(model, processor, generation_config, device)
        self.k = DEFAULT_ZIPF_THRESHOLD if k is None else k

    def targets(self, texts: Sequence[str]) -> WindowTargets:
        from ..data.rarity import decoder_text, rare_token_mask

        b = self.backbone
        prompt = b.prompt_ids()
        ids, rare, owner = list(prompt), [], []
        for index, text in enumerate(texts):
            # one dummy prefix token: mask[j] then tags token j of the text itself (the mask looks one ahead)
            tagged = rare_token_mask(b.processor.tokenizer, prompt[-1:], decoder_text(text), self.k)
            tokens = tagged.input_ids[1:]
            ids += tokens
            rare += tagged.mask[: len(tokens)]
            owner += [index] * len(tokens)
        ids.append(b.generation_config.eos_token_id)
        return WindowTargets(ids, len(prompt) - 1, rare + [False], owner + [len(texts) - 1])

    def logits(self, features, ids: list[int], first: int):
        """float32 logits [T, V] at positions first .. len(ids) - 2 (each predicting ids[t + 1])."""
        import torch

        b = self.backbone
        with torch.inference_mode():
            out = b.model(input_features=features.to(b.device),
                          decoder_input_ids=torch.tensor([ids[:-1]], device=b.device), use_cache=False)
        return out.logits[0, first:].float().cpu()

    def features(self, audio: np.ndarray):
        from ..data.corpus import TARGET_SAMPLE_RATE

        extractor = self.backbone.processor.feature_extractor
        return extractor(audio, sampling_rate=TARGET_SAMPLE_RATE, return_tensors="pt").input_features


def pack_windows(utterances: Sequence[tuple[str, np.ndarray, str]]) -> list[list[int]]:
    """Indices of the utterances in each window: greedy, in order, at most 30 s of audio and 0.3 s gaps."""
    from ..models.common import TextAudio, pack_utterances

    items = [TextAudio(str(i), audio, text) for i, (_, audio, text) in enumerate(utterances)]
    return [[int(u.id) for u in window] for window in pack_utterances(items, pack=True)]


def score_utterances(reference: TeacherForcedScorer, models: dict[str, TeacherForcedScorer],
                     utterances: Sequence[tuple[str, np.ndarray, str]], progress=None) -> dict[str, list]:
    """Figures of every model against the reference for each (id, audio, text), in order; the reference runs once
    per window. Models must share the reference's tokenizer (the same vocabulary and the same reference tokens)."""
    import torch

    from ..models.common import TextAudio, joined

    results: dict[str, list[UtteranceFigures]] = {name: [] for name in models}
    for window in pack_windows(utterances):
        members = [utterances[i] for i in window]
        audio, _ = joined([TextAudio(u, a, t) for u, a, t in members])
        target = reference.targets([text for _, _, text in members])
        features = reference.features(audio)
        ref_logits = reference.logits(features, target.ids, target.first)
        labels = torch.tensor(target.ids[target.first + 1:])
        rare, owner = torch.tensor(target.rare), torch.tensor(target.owner)
        for name, scorer in models.items():
            if scorer.targets([text for _, _, text in members]) != target:
                raise ValueError(f"model {name!r} tokenizes utterance {members[0][0]!r} differently from the reference")
            model_logits = scorer.logits(features, target.ids, target.first)
            for index, (utterance_id, _, _) in enumerate(members):
                at = owner == index
                results[name].append(token_figures(ref_logits[at], model_logits[at], labels[at], rare[at],
                                                   utterance_id))
        if progress is not None:
            progress(len(window))
    return results
