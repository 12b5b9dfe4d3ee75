"""The synthetic corpus's text side: OSIS cleaning, sentence splitting, filters, disjoint splits (no TTS here; the
end-to-end test synthesises a small corpus)."""
from __future__ import annotations

import io
import wave

import numpy as np
import pytest

from tarq_deploy.data.synth import (Sentence, SynthError, SynthOptions, check_options, deal_splits,
                                    encode_wav_pcm16, osis_to_text, sentence_problem, split_sentences,
                                    strip_quotation_marks)


def test_osis_markup_loses_notes_and_headings_with_their_content():
    markup = ('<title type="x-gen">Psalm 23</title><w lemma="strong:H3068">Yahweh</w> is my shepherd'
              '<note type="x-footnote">Or, <catchWord>shepherd</catchWord> keeper</note>; I shall lack nothing.')
    assert osis_to_text(markup) == "Yahweh is my shepherd ; I shall lack nothing."


def test_sentences_split_after_stops_but_not_after_abbreviations():
    text = "Mr. Dashwood came home. Was he late? Yes! he said \u201cNo.\u201d Then he slept."
    assert split_sentences(text) == ["Mr. Dashwood came home.", "Was he late?", "Yes! he said \u201cNo.\u201d",
                                     "Then he slept."]


def test_quotation_marks_are_dropped_but_apostrophes_kept():
    assert strip_quotation_marks("He said, \u201cAbednego\u2019s sons don\u2019t know.\u201d") == \
        "He said, Abednego\u2019s sons don\u2019t know."
    assert strip_quotation_marks("\u2018Yes,\u2019 she said.") == "Yes, she said."


@pytest.mark.parametrize("sentence, problem", [
    ("The quixotic archivist catalogued every palimpsest in the old library.", None),
    ("The archivist (a quixotic man) catalogued every palimpsest in the library.", "brackets"),
    ("The archivist catalogued 1847 palimpsests in the old quixotic library.", "digits"),
    ("The quixotic archivist catalogued every palimpsest at the NASA library.", "all-caps word"),
    ("The quixotic archivist catalogued every palimpsst in the old library.", "unknown lower-case word"),
    ("The quixotic archivist catalogued every palimpsest.", "length"),
    ("the quixotic archivist catalogued every palimpsest in the old library.", "not a whole sentence"),
    ("The quixotic archivist catalogued every palimpsest in the old library", "not a whole sentence"),
    ("The quixotic archivist catalogued every palimpsest & scroll in the library.", "unusual characters"),
    ("Zuriel the son of Abihail catalogued every palimpsest in the old library.", None),  # names are welcome
])
def test_sentence_filters(sentence: str, problem: str | None):
    assert sentence_problem(sentence) == problem


def test_splits_are_disjoint_balanced_and_seeded():
    sentences = [Sentence(f"{source} sentence {i}.", source, 10, 2) for source in ("a", "b", "c") for i in range(20)]
    evaluation, calibration = deal_splits(sentences, 12, 9, seed=5)
    assert len(evaluation) == 12 and len(calibration) == 9
    assert not {s.text for s in evaluation} & {s.text for s in calibration}
    assert {s.source: sum(x.source == s.source for x in evaluation) for s in evaluation} == {"a": 4, "b": 4, "c": 4}
    assert deal_splits(sentences, 12, 9, seed=5) == (evaluation, calibration)
    assert deal_splits(sentences, 12, 9, seed=6) != (evaluation, calibration)
    with pytest.raises(SynthError, match="only 60 sentences"):
        deal_splits(sentences, 50, 20, seed=0)


def test_unknown_voices_and_sources_are_refused_up_front():
    with pytest.raises(SynthError, match="unknown voice.*bob"):
        check_options(SynthOptions(voices=("slt", "bob")))
    with pytest.raises(SynthError, match="unknown text source.*koran"):
        check_options(SynthOptions(sources=("web", "koran")))


def test_wav_encoding_is_16_khz_16_bit_mono_and_clips_peaks():
    data = encode_wav_pcm16(np.array([0.0, 0.5, -1.5, 2.0], dtype=np.float32))
    with wave.open(io.BytesIO(data)) as w:
        assert (w.getframerate(), w.getnchannels(), w.getsampwidth(), w.getnframes()) == (16000, 1, 2, 4)
        samples = np.frombuffer(w.readframes(4), dtype="<i2")
    assert samples.tolist() == [0, 16384, -32768, 32767]
