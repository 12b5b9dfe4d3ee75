"""WER, rare-WER and common-WER on hand-made alignments (exact values), capped WER, loops, bootstrap, the report."""
from __future__ import annotations

import math

import numpy as np
import pytest

from tarq_deploy.evaluate.report import DatasetRuns, ModelRun, ReportOptions, build_report, render_markdown
from tarq_deploy.evaluate.wer import (DELETED, OK, SUBSTITUTED, align_words, bootstrap_indices, bootstrap_interval,
                                      is_repetition_loop, longest_repetition, metric_counts, paired_difference, ratio,
                                      score_utterance, totals)

REF = ["the", "quixotic", "cat", "sat"]
RARE = [False, True, False, False]


def errors_of(reference, hypothesis, rare) -> tuple[int, int, int]:
    """(rare errors, common errors, unattached insertions) of one hand-made alignment."""
    alignment = align_words(reference, hypothesis, rare)
    rare_errors = sum(o.errors for o in alignment.outcomes if o.rare)
    common_errors = sum(o.errors for o in alignment.outcomes if not o.rare)
    return rare_errors, common_errors, alignment.unattached_insertions


# ------------------------------------------------------------------------------------------ hand-made alignments
def test_substitution_of_a_rare_word_is_a_rare_error():
    alignment = align_words(REF, ["the", "quick", "cat", "sat"], RARE)
    assert [o.op for o in alignment.outcomes] == [OK, SUBSTITUTED, OK, OK]
    assert alignment.outcomes[1].hypothesis_word == "quick"
    assert errors_of(REF, ["the", "quick", "cat", "sat"], RARE) == (1, 0, 0)


def test_substitution_of_a_common_word_is_a_common_error():
    assert errors_of(REF, ["a", "quixotic", "cat", "sat"], RARE) == (0, 1, 0)


def test_deletion_of_the_rare_word():
    alignment = align_words(REF, ["the", "cat", "sat"], RARE)
    assert [o.op for o in alignment.outcomes] == [OK, DELETED, OK, OK]
    assert alignment.outcomes[1].hypothesis_index == -1
    assert errors_of(REF, ["the", "cat", "sat"], RARE) == (1, 0, 0)


def test_insertion_right_after_a_rare_word_is_charged_to_it():
    # quixotic -> "quick sotic": kept? no: substituted by "quick" plus one insertion, both at the rare position
    assert errors_of(REF, ["the", "quick", "sotic", "cat", "sat"], RARE) == (2, 0, 0)
    # kept, and an extra word between it and a common neighbour: still the rare word's error
    alignment = align_words(REF, ["the", "quixotic", "uh", "cat", "sat"], RARE)
    assert alignment.outcomes[1].op == OK and alignment.outcomes[1].inserted == 1
    assert errors_of(REF, ["the", "quixotic", "uh", "cat", "sat"], RARE) == (1, 0, 0)


def test_insertion_right_before_a_rare_word_is_charged_to_it():
    assert errors_of(REF, ["the", "uh", "quixotic", "cat", "sat"], RARE) == (1, 0, 0)


def test_insertion_between_common_words_goes_to_the_left_neighbour():
    alignment = align_words(REF, ["the", "quixotic", "cat", "uh", "sat"], RARE)
    assert [o.inserted for o in alignment.outcomes] == [0, 0, 1, 0]
    assert errors_of(REF, ["the", "quixotic", "cat", "uh", "sat"], RARE) == (0, 1, 0)


def test_insertions_at_the_edges():
    before = align_words(REF, ["so", "the", "quixotic", "cat", "sat"], RARE)
    assert [o.inserted for o in before.outcomes] == [1, 0, 0, 0]
    assert [o.inserted for o in align_words(REF, REF + ["ok", "ok"], RARE).outcomes] == [0, 0, 0, 2]
    # a rare first word takes the insertions before it
    assert [o.inserted for o in align_words(["zymurgy", "is", "fun"], ["uh", "zymurgy", "is", "fun"],
                                            [True, False, False]).outcomes] == [1, 0, 0]


def test_all_common_reference_has_no_rare_denominator():
    score = score_utterance("u", "The cat sat on the mat.", "the cat sat on a mat")
    assert (score.n_words, score.n_rare, score.errors, score.rare_errors, score.common_errors) == (6, 0, 1, 0, 1)
    counts = metric_counts([score])
    assert ratio(*counts["wer"]) == pytest.approx(1 / 6)
    assert math.isnan(ratio(*counts["rare_wer"]))
    assert ratio(*counts["common_wer"]) == pytest.approx(1 / 6)


def test_empty_hypothesis_deletes_everything():
    alignment = align_words(REF, [], RARE)
    assert [o.op for o in alignment.outcomes] == [DELETED] * 4
    assert errors_of(REF, [], RARE) == (1, 3, 0)
    score = score_utterance("u", "The quixotic cat sat.", "")
    assert (score.errors, score.deletions, score.rare_errors) == (4, 4, 1)


def test_empty_reference_insertions_count_only_in_plain_wer():
    assert errors_of([], ["hello", "there"], []) == (0, 0, 2)
    score = score_utterance("u", "[music]", "hello there")  # the normaliser deletes bracketed text
    assert (score.n_words, score.errors, score.insertions, score.rare_errors) == (0, 2, 2, 0)


def test_real_normaliser_and_rarity():
    # wordfreq 3.1: quixotic 2.33, archivist 2.80, palimpsests 1.18 (rare at k = 3); the, read common
    score = score_utterance("u", "The quixotic archivist read palimpsests!", "the quick archivist read palimpsest")
    assert score.reference_words == ("the", "quixotic", "archivist", "read", "palimpsests")
    assert [o.rare for o in score.outcomes] == [False, True, True, False, True]
    assert (score.errors, score.rare_errors, score.common_errors) == (2, 2, 0)
    counts = metric_counts([score])
    assert ratio(*counts["wer"]) == pytest.approx(2 / 5)
    assert ratio(*counts["rare_wer"]) == pytest.approx(2 / 3)
    assert ratio(*counts["common_wer"]) == 0.0
    assert score.record()["rare_lost"] == ["quixotic", "palimpsests"]


def test_rare_and_common_errors_add_up_to_all_errors():
    rng = np.random.default_rng(1)
    vocabulary = ["a", "b", "c", "d", "e"]
    for _ in range(200):
        reference = list(rng.choice(vocabulary, size=rng.integers(0, 8)))
        hypothesis = list(rng.choice(vocabulary, size=rng.integers(0, 8)))
        rare = list(rng.random(len(reference)) < 0.3)
        rare_errors, common_errors, unattached = errors_of(reference, hypothesis, rare)
        import jiwer

        expected = (len(hypothesis) if not reference else
                    sum(jiwer.process_words(" ".join(reference), " ".join(hypothesis)).__dict__[k]
                        for k in ("substitutions", "deletions", "insertions")) if hypothesis else len(reference))
        assert rare_errors + common_errors + unattached == expected


# ---------------------------------------------------------------------------------------------- capped WER, loops
def test_capped_wer_limits_each_utterance_to_its_reference_length():
    looping = score_utterance("a", "go on", "go on on on on on on on")
    clean = score_utterance("b", "ten of clubs now", "ten of clubs now")
    assert looping.errors == 6
    counts = metric_counts([looping, clean])
    assert ratio(*counts["wer"]) == pytest.approx(6 / 6)
    assert ratio(*counts["capped_wer"]) == pytest.approx(2 / 6)


def test_repetition_loops_are_counted():
    assert longest_repetition("the cat the cat the cat sat".split()) == 3
    assert longest_repetition("a b c".split()) == 1
    assert longest_repetition([]) == 0
    assert is_repetition_loop("and then and then and then and then".split())
    assert not is_repetition_loop("and then and then and then".split())  # three copies: not yet a loop
    assert not is_repetition_loop("no no no no".split(), "no no no no".split())  # the reference says it
    scores = [score_utterance("a", "we went home", "we went home home home home home"),
              score_utterance("b", "we went home", "we went home"),
              score_utterance("c", "go", "to the to the to the to the to the")]
    summary = totals(scores)
    assert (summary.loops, summary.loop_ids) == (2, ("a", "c"))


def test_a_loop_of_number_words_is_a_loop_although_the_normaliser_joins_them():
    # what whisper.cpp said for "five five" from one 2-bit base: normalised, "55" against "5555...5", one substitution
    looping = score_utterance("cards-004", "five five", "Five, five, five, five, five, five, five, five, five.")
    assert looping.hypothesis_words == ("555555555",) and looping.errors == 1
    assert looping.loop
    assert not score_utterance("n", "five five five five", "Five, five, five, five.").loop  # the reference says it
    assert not score_utterance("t", "twenty five", "twenty-five").loop


# ------------------------------------------------------------------------------------------------------- bootstrap
def test_bootstrap_is_deterministic_and_paired():
    assert np.array_equal(bootstrap_indices(50, 200, seed=3), bootstrap_indices(50, 200, seed=3))
    assert not np.array_equal(bootstrap_indices(50, 200, seed=3), bootstrap_indices(50, 200, seed=4))
    rng = np.random.default_rng(0)
    words = rng.integers(5, 20, size=50).astype(float)
    errors = np.minimum(words, rng.integers(0, 6, size=50)).astype(float)
    indices = bootstrap_indices(50, 500, seed=0)
    first = bootstrap_interval(errors, words, indices)
    again = bootstrap_interval(errors, words, bootstrap_indices(50, 500, seed=0))
    assert first == again
    assert first.low <= first.value <= first.high and first.low < first.high
    same = paired_difference((errors, words), (errors, words), indices)
    assert (same.value, same.low, same.high, same.significant) == (0.0, 0.0, 0.0, False)
    worse = paired_difference((errors + 3, words), (errors, words), indices)
    assert worse.significant and worse.low > 0 and worse.p_value == 0.0
    with pytest.raises(ValueError, match="identical references"):
        paired_difference((errors, words), (errors, words + 1), indices)


# ------------------------------------------------------------------------------------------------------- report
def _run(label: str, backend: str, hypotheses: list[str], references: list[str]) -> ModelRun:
    scores = [score_utterance(f"u{i}", r, h) for i, (r, h) in enumerate(zip(references, hypotheses))]
    return ModelRun(f"{label} [{backend}]", label, backend, f"{label}.bin", scores, 1.0, 10.0)


def test_report_tables_differences_agreement_and_recovery():
    references = ["the quixotic archivist read palimpsests", "ten of clubs", "go forward ten meters"]
    runs = [
        _run("F16", "torch", references, references),
        _run("F16", "whisper.cpp", ["the quixotic archivist read palimpsests", "ten of clubs", "go forward ten metres"],
             references),
        _run("RTN", "torch", ["the quick archivist read palimpsest", "ten of clubs", "go go go go go go"], references),
    ]
    report = build_report([DatasetRuns("toy", "toy.jsonl", runs)], ReportOptions(n_resamples=100, examples=5))
    dataset = report["datasets"][0]
    rtn = dataset["models"][2]
    assert (dataset["words"], dataset["rare_words"]) == (12, 3)
    assert rtn["rare_wer"]["value"] == pytest.approx(2 / 3) and rtn["loops"] == 1
    assert [(d["model"], d["versus"]) for d in dataset["differences"]] == [("RTN [torch]", "F16 [torch]")]
    agreement = dataset["backend_agreement"][0]
    assert (agreement["identical"], agreement["utterances"]) == (3, 3)  # the normaliser maps metres -> meters
    recovery = dataset["recovery"]
    assert recovery["contested_words"] == 2  # quixotic and palimpsests: kept by F16, lost by RTN
    example = recovery["examples"][0]
    assert example["word"] in ("quixotic", "palimpsests")
    assert [m["kept"] for m in example["models"]] == [True, True, False]
    markdown = render_markdown(report)
    assert "| RTN | torch | 58.3 [" in markdown  # (2 + 0 + 5) errors / 12 words
    assert "### Rare-word recovery" in markdown and "✗ RTN [torch]: the _quick_" in markdown


def test_the_normalisers_are_transformers_own_without_importing_transformers():
    """data/normalize.py runs transformers' english_normalizer.py on its own (the package __init__ costs a second a
    process): in a fresh interpreter it leaves transformers unimported and normalises exactly as the module imported
    the usual way."""
    import json
    import subprocess
    import sys

    texts = ["Mr. O'Neil's colour: 1,234 twenty-five [noise] can't (laughs) £5 2nd", "Grüße, Welt! ½ ¿qué?",
             "東京へ行く。"]
    code = ("import json, sys; from tarq_deploy.data.normalize import normalizer_for; "
            f"texts = {texts!r}; out = [normalizer_for(l)(t) for l in ('en', 'de', 'ja') for t in texts]; "
            "print(json.dumps({'out': out, 'transformers': 'transformers' in sys.modules}))")
    fresh = json.loads(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                                      timeout=120).stdout.strip().splitlines()[-1])
    assert fresh["transformers"] is False
    from transformers.models.whisper.english_normalizer import BasicTextNormalizer, EnglishTextNormalizer

    from tarq_deploy.data.normalize import english_spelling_mapping
    from tarq_deploy.data.rarity import UNSPACED_LANGUAGES

    english = EnglishTextNormalizer(english_spelling_mapping()[0])
    expected = [english(t) for t in texts] + [BasicTextNormalizer(remove_diacritics=False, split_letters=lang in
                                                                  UNSPACED_LANGUAGES)(t)
                                              for lang in ("de", "ja") for t in texts]
    assert fresh["out"] == expected
