"""Teacher-forced figures (KLD, delta-NLL, top-1 agreement by rarity) and rare-word retention: exact values on
hand-made logits and alignments, and the report sections built from them."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from tarq_deploy.evaluate.report import ReportOptions, retention_section, teacher_forced_section, ModelRun
from tarq_deploy.evaluate.teacher_forced import figure_counts, retention_counts, token_figures
from tarq_deploy.evaluate.wer import bootstrap_indices, score_utterance

LN2 = math.log(2.0)


def _logits(*probabilities: tuple[float, ...]) -> torch.Tensor:
    return torch.log(torch.tensor(probabilities, dtype=torch.float64))


def test_token_figures_exact_values() -> None:
    reference = _logits((0.5, 0.25, 0.25), (0.2, 0.3, 0.5), (0.1, 0.1, 0.8))
    model = _logits((0.25, 0.5, 0.25), (0.2, 0.3, 0.5), (0.3, 0.2, 0.5))
    labels = torch.tensor([0, 2, 2])
    rare = torch.tensor([True, False, True])
    f = token_figures(reference, model + 7.0, labels, rare, "u1")  # logits shift: same distributions
    kl_third = 0.1 * math.log(0.1 / 0.3) + 0.1 * math.log(0.1 / 0.2) + 0.8 * math.log(0.8 / 0.5)
    assert f.sums["kld_rare"] == pytest.approx(0.25 * LN2 + kl_third, abs=1e-12)
    assert f.sums["kld_common"] == pytest.approx(0.0, abs=1e-12)
    assert f.sums["dnll_rare"] == pytest.approx(LN2 + math.log(0.8 / 0.5), abs=1e-12)  # label 0, then label 2
    assert f.sums["dnll_common"] == pytest.approx(0.0, abs=1e-12)
    assert f.sums["top1_rare"] == 1.0  # first: argmax 0 vs 1 (disagree); third: 2 vs 2 (agree)
    assert f.counts == {"rare": 2, "common": 1}
    assert f.sums["top1_common"] == 1.0


def test_token_figures_refuse_mismatched_shapes() -> None:
    with pytest.raises(ValueError, match="shapes differ"):
        token_figures(torch.zeros(2, 3), torch.zeros(3, 3), torch.tensor([0, 1]), torch.tensor([True, False]))


def test_figure_counts_are_ratios_of_sums() -> None:
    a = token_figures(_logits((0.5, 0.5)), _logits((0.5, 0.5)), torch.tensor([0]), torch.tensor([True]), "a")
    b = token_figures(_logits((0.5, 0.5), (0.9, 0.1)), _logits((0.9, 0.1), (0.9, 0.1)), torch.tensor([1, 0]),
                      torch.tensor([True, False]), "b")
    counts = figure_counts([a, b])
    numerator, denominator = counts["dnll_rare"]
    assert denominator.tolist() == [1.0, 1.0]
    assert numerator[1] == pytest.approx(math.log(0.5 / 0.1))
    assert counts["top1_common"][0].tolist() == [0.0, 1.0] and counts["top1_common"][1].tolist() == [0.0, 1.0]


def test_retention_counts_exact() -> None:
    refs = ["the zymurgy of kvass", "blorft and frinkle"]
    f16 = [score_utterance("1", refs[0], "the zymurgy of kvass"), score_utterance("2", refs[1], "blorft and sprinkle")]
    model = [score_utterance("1", refs[0], "the zymurgy of class"), score_utterance("2", refs[1], "blort and frinkle")]
    assert [o.rare for o in f16[0].outcomes] == [False, True, False, True]
    kept, known = retention_counts(f16, model)
    assert kept.tolist() == [1.0, 0.0] and known.tolist() == [2.0, 1.0]
    with pytest.raises(ValueError, match="different reference words"):
        retention_counts(f16[:1], [score_utterance("1", "other words here", "other words here")])


def test_report_sections_pair_models_on_the_same_utterances() -> None:
    refs = ["the zymurgy of kvass", "blorft and frinkle"]
    runs = []
    for label, hyps in (("F16", ["the zymurgy of kvass", "blorft and frinkle"]),
                        ("A", ["the zymurgy of class", "blorft and frinkle"]),
                        ("B", ["the zymurgy of kvass", "blorft and frinkle"])):
        scores = [score_utterance(str(i), r, h) for i, (r, h) in enumerate(zip(refs, hyps))]
        runs.append(ModelRun(f"{label} [torch]", label, "torch", label, scores))
    options = ReportOptions(n_resamples=50, comparisons=(("B", "A"),), reference="F16")
    indices = bootstrap_indices(2, 50, 0)
    section = retention_section(runs, options, indices)
    assert [(r["model"], r["kept"], r["known"]) for r in section["models"]] == [("A [torch]", 3, 4),
                                                                                 ("B [torch]", 4, 4)]
    assert section["differences"][0]["retention"]["value"] == pytest.approx(0.25)
    same = token_figures(_logits((0.5, 0.5)), _logits((0.5, 0.5)), torch.tensor([0]), torch.tensor([True]))
    worse = token_figures(_logits((0.5, 0.5)), _logits((0.9, 0.1)), torch.tensor([0]), torch.tensor([True]))
    tf = teacher_forced_section({"A": [worse, worse], "B": [same, same]}, options, indices)
    assert tf["models"][1]["kld_rare"]["value"] == 0.0
    assert tf["differences"][0]["kld_rare"]["value"] < 0  # B - A: B is closer to the reference
    assert np.isclose(tf["models"][0]["dnll_rare"]["value"], math.log(0.5 / 0.9))


def test_window_targets_concatenate_each_utterance_tokens() -> None:
    """A packed window's reference tokens are its utterances' own tokens back to back, equal to tokenizing the joined
    transcript (byte-level BPE never merges across the space before a word); each position has one owner."""
    from tarq_deploy.evaluate.teacher_forced import TeacherForcedScorer
    from tarq_deploy.formats.model_loader import load_whisper

    scorer = TeacherForcedScorer(load_whisper("packaged:tiny.en"))
    texts = ["The abbot of Dunfermline spoke.", "Zymurgy, quoth he!", "and so on"]
    target = scorer.targets(texts)
    tokenizer = scorer.backbone.processor.tokenizer
    prompt = scorer.backbone.prompt_ids()
    joined = tokenizer.encode(" " + " ".join(texts), add_special_tokens=False)
    assert target.ids == prompt + joined + [scorer.backbone.generation_config.eos_token_id]
    assert len(target.rare) == len(target.owner) == len(target.ids) - 1 - target.first
    assert target.owner[0] == 0 and target.owner[-1] == 2 and sorted(set(target.owner)) == [0, 1, 2]
    rare_text = tokenizer.decode([t for t, r in zip(target.ids[target.first + 1:], target.rare) if r])
    assert "Dunfermline" in rare_text.replace(" ", "") and "Zymurgy" in rare_text.replace(" ", "")
    assert not target.rare[-1]  # the end token is never rare
