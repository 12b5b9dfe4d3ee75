"""A user's term list (issue 63): read strictly, matched leftmost-longest, made the calibration's tail (the tagged
token positions checked on tiny.en's tokenizer), named before any work when calibration never holds a term, and
scored by `eval --terms` (recall by alignment, term-WER, the per-term table) against a model that keeps them."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from helpers import assert_user_error, forbid_loading, quantize_args, run_cli
from tarq_deploy.data.corpus import Utterance, write_manifest
from tarq_deploy.data.rarity import TailRule, decoder_text, rare_token_mask, term_match_words, written_words
from tarq_deploy.data.terms import TermsError, find_terms, read_terms
from tarq_deploy.evaluate.terms import score_terms, term_section
from tarq_deploy.evaluate.wer import score_utterance


def term_file(tmp_path: Path, text: str, name: str = "terms.txt") -> Path:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


# --------------------------------------------------------------------------------------------------- the reader
def test_a_term_list_reads_phrases_weights_and_comments(tmp_path):
    path = term_file(tmp_path, "# drugs\nwarfarin\t2\n\nJoe Keaton\nnew york\nnew york city\t1.5\n")
    terms = read_terms(path, written_words)
    assert [(t.text, t.weight, t.line) for t in terms.terms] == [
        ("warfarin", 2.0, 2), ("Joe Keaton", 1.0, 4), ("new york", 1.0, 5), ("new york city", 1.5, 6)]
    assert len(terms.sha256) == 64 and terms.record()["terms"] == 4


@pytest.mark.parametrize("text, problem", [
    ("warfarin\t-1\n", ":1: the weight after the tab must be a positive number"),
    ("warfarin\tlots\n", ":1: the weight after the tab must be a positive number"),
    ("warfarin\tnan\n", ":1: the weight after the tab must be a positive number"),
    ("aspirin\nWarfarin\nwarfarin\n", ":3: 'warfarin' is the term of line 2 again"),
    ("aspirin\n...\n", ":2: '...' holds no word"),
    ("# only a comment\n\n", ": no terms"),
    ("aspirin\nwar\x00farin\n", ":2: holds a NUL byte"),
])
def test_a_bad_term_list_is_refused_naming_file_and_line(tmp_path, text, problem):
    path = term_file(tmp_path, text)
    with pytest.raises(TermsError) as error:
        read_terms(path, written_words)
    assert str(error.value).startswith(str(path)) and problem in str(error.value), error.value


def test_a_term_list_that_is_not_utf8_or_a_folder_is_refused(tmp_path):
    path = tmp_path / "latin1.txt"
    path.write_bytes("aspirin\ncaf\xe9\n".encode("latin-1"))
    with pytest.raises(TermsError, match=r"latin1.txt:2: not UTF-8"):
        read_terms(path, written_words)
    with pytest.raises(TermsError, match="is a folder"):
        read_terms(tmp_path, written_words)


def test_matching_is_leftmost_longest_and_whole():
    forms = [("new", "york"), ("new", "york", "city"), ("york",), ("joe", "keaton")]
    words = "in new york city hall joe met york and joe keaton".split()
    assert [(o.term, o.start, o.end) for o in find_terms(words, forms)] == [(1, 1, 4), (2, 7, 8), (3, 9, 11)]


# ------------------------------------------------------------------------------------- the tail calibration reads
def test_the_terms_tokens_are_the_tail_with_their_weight(tmp_path, tiny):
    """--tail terms: exactly the tokens of every occurrence of a term are tagged (a multi-word term whole, a
    possessive's stem found), weighted by the term's weight; the Zipf-rare word outside any term is not. --tail
    both adds it back at weight 1."""
    _, processor, generation_config = tiny
    terms = read_terms(term_file(tmp_path, "Keaton Brothers\t3\nquokka\n"), written_words)
    text = decoder_text("The quokka met Keaton Brothers and a serendipitous Keaton's quokka.")
    tagged = {mode: rare_token_mask(processor.tokenizer, [50257], text, TailRule(mode=mode, terms=terms),
                                    eos_token_id=generation_config.eos_token_id) for mode in ("terms", "both")}
    by_word = {mode: {w.normalized: (w.rare, w.weight) for w in t.words if w.rare} for mode, t in tagged.items()}
    assert by_word["terms"] == {"quokka": (True, 1.0), "keaton": (True, 3.0), "brothers": (True, 3.0)}
    assert by_word["both"] == {**by_word["terms"], "serendipitous": (True, 1.0)}
    t = tagged["terms"]
    # mask[p] is True iff input_ids[p + 1] is a token of a tagged word
    expected = sorted(p - 1 for w in t.words if w.rare for p in w.token_positions)
    assert [p for p, m in enumerate(t.mask) if m] == expected and len(expected) >= 4
    assert all(t.weights[p] == 3.0 for w in t.words if w.normalized in ("keaton", "brothers")
               for p in (q - 1 for q in w.token_positions))
    # "Keaton's" alone is no occurrence of the two-word term "Keaton Brothers"
    assert [o.term for o in find_terms(term_match_words(text), terms.word_forms(term_match_words))] == [1, 0, 1]


# -------------------------------------------------------------------------------------------- quantize --terms
@pytest.fixture(scope="module")
def term_corpus(tmp_path_factory) -> Path:
    from helpers import write_wav

    root = tmp_path_factory.mktemp("term_corpus")
    texts = ["the quick brown fox jumps over the lazy dog", "a serendipitous quokka ate the persimmon",
             "the lazy dog saw a quokka"]
    return write_manifest([Utterance(f"u{i}", str(write_wav(root / f"u{i}.wav", 1.0, seed=i)), text)
                           for i, text in enumerate(texts)], root / "calib.jsonl")


def test_quantize_names_the_terms_calibration_never_holds_before_any_work(models, term_corpus, tmp_path, capsys):
    terms = term_file(tmp_path, "quokka\nlazy dog\nkangaroo\nplatypus\n")
    out = tmp_path / "ck"
    status, printed, err = run_cli(capsys, *quantize_args(models["clean"], out, "--method", "tarq", "--terms",
                                                          str(terms), "--tail", "terms", calib=term_corpus))
    assert status == 0, err
    line = next(line for line in printed.splitlines() if line.startswith("terms:"))
    assert line == "terms: 2 of 4 occur in the 3 calibration utterances; never: kangaroo, platypus"
    assert printed.index(line) < printed.index("wrote "), printed
    log = json.loads(out.with_name(out.name + ".log.json").read_text())
    assert log["options"]["tail"] == "terms" and log["options"]["terms_sha256"] == read_terms(
        terms, written_words).sha256
    assert log["terms_absent"] == ["kangaroo", "platypus"]


def test_a_tail_of_terms_none_of_which_occurs_is_refused_before_the_model_loads(models, term_corpus, tmp_path,
                                                                                capsys, monkeypatch):
    forbid_loading(monkeypatch)
    terms = term_file(tmp_path, "kangaroo\nplatypus\n")
    out = tmp_path / "ck"
    status, _, err = run_cli(capsys, *quantize_args(models["clean"], out, "--method", "tarq", "--terms", str(terms),
                                                    "--tail", "terms", calib=term_corpus))
    assert_user_error(status, err, "--terms", str(terms), "none of its 2 terms occurs", "--tail both")
    assert not out.exists()


def test_a_bad_term_list_is_a_user_error_naming_its_line(models, term_corpus, tmp_path, capsys):
    terms = term_file(tmp_path, "quokka\nquokka\n")
    status, _, err = run_cli(capsys, *quantize_args(models["clean"], tmp_path / "ck", "--method", "tarq", "--terms",
                                                    str(terms), calib=term_corpus))
    assert_user_error(status, err, f"--terms {terms}:2:", "again")


# ----------------------------------------------------------------------------------------------- eval --terms
def test_term_recall_needs_every_word_of_a_term_back_to_back():
    forms = [("joe", "keaton"), ("quokka",)]
    cases = {"joe keaton fed the quokka": (True, True), "jo kitson fed the quokka": (False, True),
             "joe the keaton fed a quokka": (False, True), "joe keaton fed the koala": (True, False)}
    for hypothesis, found in cases.items():
        score = score_utterance("u", "Joe Keaton fed the quokka.", hypothesis)
        assert score_terms(score, forms).found == found, hypothesis


def test_the_term_section_pairs_models_and_names_what_each_loses():
    from tarq_deploy.data.terms import Term, TermList

    terms = TermList("t.txt", (Term("Joe Keaton"), Term("quokka"), Term("wombat")), "0" * 64)
    refs = ["Joe Keaton fed the quokka.", "The quokka slept.", "Joe Keaton left."]
    good = ["joe keaton fed the quokka", "the quokka slept", "joe keaton left"]
    bad = ["jo kitson fed the quokka", "the koala slept", "joe keaton left"]
    runs = {key: [score_utterance(f"u{i}", r, h) for i, (r, h) in enumerate(zip(refs, hyps))]
            for key, hyps in (("f16", good), ("q4", bad))}
    section = term_section(terms, runs, [("q4", "f16")], ["u0", "u1", "u2"], 200, 0)
    assert section["occurring_terms"] == 2 and section["occurrences"] == 4
    assert section["models"]["f16"]["term_recall"]["value"] == 1.0
    assert section["models"]["q4"]["term_recall"]["value"] == 0.5
    assert section["differences"][0]["term_recall"]["value"] == -0.5
    lost = {row["term"]: row["lost"] for row in section["per_term"]}
    assert lost == {"Joe Keaton": {"q4 vs f16": ["u0"]}, "quokka": {"q4 vs f16": ["u1"]}}


def test_eval_terms_reports_recall_and_the_per_term_table(models, jfk_wav, tmp_path, capsys):
    """tiny.en keeps jfk's terms; the random model of the same tokenizer loses them: the report says which."""
    from tarq_deploy.data.real_clips import JFK_TEXT

    manifest = write_manifest([Utterance("jfk", jfk_wav, JFK_TEXT)], tmp_path / "jfk.jsonl")
    terms = term_file(tmp_path, "fellow Americans\ncountry\nmoonbeam\n")
    out = tmp_path / "eval"
    status, _, err = run_cli(capsys, "eval", "--data", str(manifest), "--model", "f32=packaged:tiny.en",
                             "--model", f"random={models['clean']}", "--backend", "torch", "--tokenizer",
                             "packaged:tiny.en", "--decode", "greedy", "--reference", "f32", "--terms", str(terms),
                             "--resamples", "50", "-o", str(out), "--quiet")
    assert status == 0, err
    section = json.loads((out / "report.json").read_text())["datasets"][0]["terms"]
    assert section["occurring_terms"] == 2 and section["occurrences"] == 3  # "country" twice, "moonbeam" never
    f32, random = "f32 [torch]", "random [torch]"  # a run is its label and backend
    assert section["models"][f32]["term_recall"]["value"] == 1.0
    assert section["models"][random]["term_recall"]["value"] < 1.0
    assert section["differences"][0]["a"] == random and section["differences"][0]["b"] == f32
    rows = {row["term"]: row for row in section["per_term"]}
    assert set(rows) == {"fellow Americans", "country"} and rows["country"]["found"][f32] == 2
    assert any(uids == ["jfk"] for row in rows.values() for uids in row["lost"].values())
    markdown = (out / "report.md").read_text()
    assert "### Terms" in markdown and "term recall" in markdown


def test_eval_refuses_a_bad_term_list_before_decoding(jfk_wav, tmp_path, capsys):
    from tarq_deploy.data.real_clips import JFK_TEXT

    manifest = write_manifest([Utterance("jfk", jfk_wav, JFK_TEXT)], tmp_path / "jfk.jsonl")
    terms = term_file(tmp_path, "country\t0\n")
    status, _, err = run_cli(capsys, "eval", "--data", str(manifest), "--model", "packaged:tiny.en", "--terms",
                             str(terms), "-o", str(tmp_path / "eval"))
    assert_user_error(status, err, f"--terms {terms}:1:", "positive number")
    assert not (tmp_path / "eval").exists()


def test_teacher_forced_figures_at_term_positions(models, jfk_wav, tmp_path, capsys):
    """eval --teacher-forced-only --terms: the tagged group is the terms' token positions (their count is the tokens
    of jfk's three occurrences), and the report names them term positions."""
    from tarq_deploy.data.real_clips import JFK_TEXT

    manifest = write_manifest([Utterance("jfk", jfk_wav, JFK_TEXT)], tmp_path / "jfk.jsonl")
    terms_path = term_file(tmp_path, "fellow Americans\ncountry\n")
    out = tmp_path / "tf"
    status, _, err = run_cli(capsys, "eval", "--data", str(manifest), "--model", "f32=packaged:tiny.en",
                             "--model", f"random={models['clean']}", "--backend", "torch", "--tokenizer",
                             "packaged:tiny.en", "--reference", "f32", "--teacher-forced-only", "--terms",
                             str(terms_path), "--resamples", "20", "-o", str(out), "--quiet")
    assert status == 0, err
    section = json.loads((out / "report.json").read_text())["datasets"][0]["teacher_forced"]
    assert section["tagged"] == "term"
    from tarq_deploy.formats.model_loader import load_whisper

    tokenizer = load_whisper("packaged:tiny.en")[1].tokenizer
    terms = read_terms(terms_path, written_words)
    tagged = rare_token_mask(tokenizer, [0], decoder_text(JFK_TEXT), TailRule(mode="terms", terms=terms))
    expected = sum(len(w.token_positions) for w in tagged.words if w.rare)
    (row,) = section["models"]
    assert row["positions"]["rare"] == expected >= 4 and row["kld_rare"]["value"] > 0
    assert "| model | KLD term | KLD common |" in (out / "report.md").read_text()


def test_two_spellings_the_normaliser_makes_one_are_one_term(tmp_path):
    """quantize reads "analyse" and "analyze" as two terms; eval's normaliser spells both "analyze": one term, the
    first, is counted (the same file is accepted by both commands)."""
    from tarq_deploy.evaluate.terms import term_forms

    terms = read_terms(term_file(tmp_path, "analyse\nanalyze\nquokka\n"), written_words)
    assert term_forms(terms) == [("analyze",), (), ("quokka",)]
    score = score_utterance("u", "We analyse the quokka.", "we analyze the quokka")
    section = term_section(terms, {"m": [score]}, [], ["u"], 20, 0)
    assert section["occurring_terms"] == 2 and [row["term"] for row in section["per_term"]] == ["analyse", "quokka"]
