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
from typing import Sequence

import numpy as np

from .wer import OK, UtteranceScore

FIGURES = ("kld", "dnll", "top1")
GROUPS = ("rare", "common")
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
class TeacherForcedScorer:
    """A Whisper model run teacher-forced on reference transcripts: logits at the scored positions."""

    def __init__(self, bundle, device: str = "cpu", k: float | None = None) -> None:
        from ..data.rarity import DEFAULT_ZIPF_THRESHOLD
        from ..models.whisper import WhisperBackbone

        model, processor, generation_config = bundle
        self.backbone = WhisperBackbone(model, processor, generation_config, device)
        self.k = DEFAULT_ZIPF_THRESHOLD if k is None else k

    def targets(self, text: str) -> tuple[list[int], list[bool], int]:
        """Decoder ids (prompt, text tokens, end), rare tags per input position, and the first scored position."""
        from ..data.rarity import decoder_text, rare_token_mask

        b = self.backbone
        tagged = rare_token_mask(b.processor.tokenizer, b.prompt_ids(), decoder_text(text), self.k,
                                 eos_token_id=b.generation_config.eos_token_id)
        return tagged.input_ids, tagged.mask, len(b.prompt_ids()) - 1

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


def score_utterances(reference: TeacherForcedScorer, models: dict[str, TeacherForcedScorer],
                     utterances: Sequence[tuple[str, np.ndarray, str]], progress=None) -> dict[str, list]:
    """Figures of every model against the reference on each (id, audio, text); the reference runs once per
    utterance. Models must share the reference's tokenizer (the same vocabulary and the same reference tokens)."""
    results: dict[str, list[UtteranceFigures]] = {name: [] for name in models}
    for utterance_id, audio, text in utterances:
        ids, mask, first = reference.targets(text)
        features = reference.features(audio)
        ref_logits = reference.logits(features, ids, first)
        labels, rare = ids[first + 1:], mask[first:-1]
        for name, scorer in models.items():
            if scorer.targets(text)[0] != ids:
                raise ValueError(f"model {name!r} tokenizes utterance {utterance_id!r} differently from the reference")
            figures = token_figures(ref_logits, scorer.logits(features, ids, first), labels, rare, utterance_id)
            results[name].append(figures)
        if progress is not None:
            progress(1)
    return results
