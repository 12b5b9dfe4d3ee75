"""quantize --decoder-shape: Whisper's decoder calibrated in whisper-cli's token shape (timestamps, the previous
window's tokens carried after <|startofprev|>), every text token keeping its tail tag (models/whisper_prompts.py)."""
from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from helpers import assert_refused_for_a_model_that_is_not_whisper, quantize_options_for

from tarq_deploy.models.whisper_prompts import shape_of_window, stamped_window

SOT, NO_TIMESTAMPS, EOT, PREV, STAMP0 = 50257, 50362, 50256, 50360, 50363


def plain_window(counts: list[int], tags: list[bool]) -> tuple[list[int], list[bool], list[float]]:
    """A plain window (prompt <|sot|> <|notimestamps|>, text tokens 1.., <|eot|>) whose input positions predicting
    text token j carry tags[j]."""
    text = list(range(1, sum(counts) + 1))
    ids = [SOT, NO_TIMESTAMPS] + text + [EOT]
    mask = [False] + list(tags) + [False, False]  # position t predicts ids[t + 1]
    return ids, mask, [2.0 if m else 1.0 for m in mask]


def test_stamped_window_puts_each_utterance_between_its_timestamps():
    ids, mask, weights = plain_window([2, 1], [True, False, True])
    shaped = stamped_window(ids, mask, weights, 2, [2, 1], [1.0, 0.5], 0.3, STAMP0, [7, 8, 9], PREV, 448)
    # <|startofprev|> carried <|sot|> <|0.00|> 1 2 <|1.00|> <|1.30|> 3 <|1.80|> <|eot|>
    assert shaped.ids == [PREV, 7, 8, 9, SOT, STAMP0, 1, 2, STAMP0 + 50, STAMP0 + 65, 3, STAMP0 + 90, EOT]
    assert [shaped.ids[r + 1] for r in shaped.text_rows] == [1, 2, 3, EOT]
    assert [i for i, m in enumerate(shaped.mask) if m] == [5, 9]  # the positions predicting tokens 1 and 3
    assert [shaped.weights[i] for i in (5, 9)] == [2.0, 2.0] and shaped.weights.count(2.0) == 2
    assert shaped.carried == shaped.ids[5:-1]  # the next window carries the stamped tokens, not the prompt


def test_the_carried_tokens_are_cut_to_the_decoder_length_keeping_the_last():
    ids, mask, weights = plain_window([3], [False, False, False])
    shaped = stamped_window(ids, mask, weights, 2, [3], [2.0], 0.3, STAMP0, list(range(100, 200)), PREV, 20)
    assert len(shaped.ids) - 1 == 20  # max_positions inputs (the last token is only a label)
    assert shaped.ids[0] == PREV and shaped.ids[1:shaped.ids.index(SOT)] == list(range(187, 200))
    first_window = stamped_window(ids, mask, weights, 2, [3], [2.0], 0.3, STAMP0, [], PREV, 20)
    assert first_window.ids[0] == SOT  # nothing carried: no <|startofprev|>


def test_stamped_window_refuses_counts_that_are_not_the_windows():
    ids, mask, weights = plain_window([2, 1], [False] * 3)
    with pytest.raises(ValueError, match="token counts"):
        stamped_window(ids, mask, weights, 2, [2, 2], [1.0, 0.5], 0.3, STAMP0, [], PREV, 448)


@given(st.lists(st.integers(1, 6), min_size=1, max_size=5), st.data())
def test_every_tail_tag_moves_with_its_token(counts, data):
    tags = data.draw(st.lists(st.booleans(), min_size=sum(counts), max_size=sum(counts)))
    seconds = data.draw(st.lists(st.floats(0.1, 5.0), min_size=len(counts), max_size=len(counts)))
    previous = data.draw(st.lists(st.integers(100, 200), max_size=30))
    ids, mask, weights = plain_window(counts, tags)
    shaped = stamped_window(ids, mask, weights, 2, counts, seconds, 0.3, STAMP0, previous, PREV, 448)
    assert [shaped.ids[r + 1] for r in shaped.text_rows] == ids[2:]  # every text token and the end, in order
    assert [shaped.mask[r] for r in shaped.text_rows[:-1]] == tags
    assert sum(shaped.mask) == sum(tags) and len(shaped.mask) == len(shaped.ids)
    stamps = [t for t in shaped.ids if t >= STAMP0]
    assert len(stamps) == 2 * len(counts) and stamps == sorted(stamps)


def test_both_alternates_plain_and_cli_from_plain():
    assert [shape_of_window("both", i) for i in range(4)] == ["plain", "cli", "plain", "cli"]
    assert {shape_of_window("cli", i) for i in range(3)} == {"cli"}
    with pytest.raises(ValueError, match="decoder shape"):
        shape_of_window("stamped", 0)


def test_tiny_en_calibration_windows_in_whisper_clis_shape(tiny, real_clips):
    """The real tokenizer: the second window carries the first's stamped text, timestamps bracket each utterance,
    the tail tags are plain's, and the alignment still tags the rare words' frames."""
    from tarq_deploy.data.corpus import load_audio
    from tarq_deploy.models.common import TextAudio
    from tarq_deploy.models.whisper import WhisperBackbone

    model, processor, gc = tiny
    backbone = WhisperBackbone(model, processor, gc)
    clips = [TextAudio(c.id, load_audio(str(c.path)), c.text) for c in real_clips[:3]]
    plain = backbone.build_windows(clips, pack=False)
    cli = backbone.build_windows(clips, pack=False, decoder_shape="cli")
    tokenizer = processor.tokenizer
    second = cli[1].inputs["decoder_input_ids"][0].tolist()
    assert second[0] == gc.prev_sot_token_id and gc.no_timestamps_token_id not in second
    carried = second[1:second.index(gc.decoder_start_token_id)]
    assert tokenizer.decode(carried, skip_special_tokens=True).strip() == \
        tokenizer.decode(cli[0].inputs["decoder_input_ids"][0].tolist(), skip_special_tokens=True).strip()
    assert sum(t > gc.no_timestamps_token_id for t in cli[0].inputs["decoder_input_ids"][0].tolist()) == 2  # start, end
    for p, c in zip(plain, cli):
        assert c.info["rare_tokens"] == p.info["rare_tokens"]
        assert (c.info["rare_frames"] > 0) == (p.info["rare_frames"] > 0)
        assert c.info["decoder_shape"] == "cli" and "decoder_shape" not in p.info
    both = backbone.build_windows(clips, pack=False, decoder_shape="both", encoder_tagging="none")
    assert both[0].inputs["decoder_input_ids"].tolist() == plain[0].inputs["decoder_input_ids"].tolist()
    assert both[1].inputs["decoder_input_ids"].tolist() == cli[1].inputs["decoder_input_ids"].tolist()


def test_decoder_shape_is_refused_for_a_model_that_is_not_whisper(capsys, tmp_path, monkeypatch, corpus):
    monkeypatch.chdir(tmp_path)
    assert_refused_for_a_model_that_is_not_whisper(capsys, tmp_path, corpus, ["--decoder-shape", "cli"],
                                                   "--decoder-shape cli", "not a Whisper model")


def test_the_shape_is_read_only_where_a_corpus_is():
    """A method that reads no corpus keeps plain whatever is asked (a sweep sets the shape for every cell); a
    calibrating method on Whisper gets the shape given, else the default; the record keeps plain runs' knobs."""
    from tarq_deploy.quant.choices import DECODER_SHAPE_BY_DEFAULT

    rounding = quantize_options_for("packaged:tiny.en", method="ggml", type="q4_0", decoder_shape="both")
    assert rounding.decoder_shape == "plain" and "decoder_shape" not in rounding.result_knobs()
    given = quantize_options_for("packaged:tiny.en", method="gptq", type="q4_0", decoder_shape="both")
    assert given.decoder_shape == "both" and given.result_knobs()["decoder_shape"] == "both"
    default = quantize_options_for("packaged:tiny.en", method="tarq", type="q4_0")
    assert default.decoder_shape == DECODER_SHAPE_BY_DEFAULT
