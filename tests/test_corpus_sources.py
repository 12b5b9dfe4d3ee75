"""The data people have (issue 63): Kaldi/ESPnet data folders, `datasets` folders with their own column names, NeMo
manifests with a language -- read as a JSONL manifest is, by quantize --calib and eval --data alike -- and the
user's language: its wordfreq table for rarity, its normaliser, CER where words are written without spaces; and
`corpus synth --terms`, the corpus of a term list."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from helpers import assert_user_error, quantize_args, run_cli, write_wav
from tarq_deploy.data import corpus as cp
from tarq_deploy.data.rarity import TailRule, reference_words
from tarq_deploy.evaluate.wer import score_utterance


def kaldi_folder(root: Path, wav_scp: str, text: str, segments: str | None = None) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "wav.scp").write_text(wav_scp)
    (root / "text").write_text(text)
    if segments is not None:
        (root / "segments").write_text(segments)
    return root


@pytest.fixture
def two_recordings(tmp_path) -> Path:
    write_wav(tmp_path / "rec-a.wav", 4.0, seed=1)
    write_wav(tmp_path / "rec-b.wav", 2.0, seed=2)
    return tmp_path


# --------------------------------------------------------------------------------------------------------- Kaldi
def test_a_kaldi_folder_with_segments_reads_as_the_same_manifest_does(two_recordings):
    folder = kaldi_folder(two_recordings / "data", f"A {two_recordings / 'rec-a.wav'}\nB ../rec-b.wav\n",
                          "A-1 the quick brown fox\nA-2 jumps over the dog\nB-1 a serendipitous quokka\n",
                          "A-1 A 0.0 1.5\nA-2 A 1.5 -1\nB-1 B 0.25 1.75\n")
    utterances = cp.load_corpus(folder, decode=True)
    assert [(u.id, u.text, u.offset, u.duration) for u in utterances] == [
        ("A-1", "the quick brown fox", 0.0, 1.5), ("A-2", "jumps over the dog", 1.5, None),
        ("B-1", "a serendipitous quokka", 0.25, 1.5)]
    assert [len(cp.load_audio(u)) for u in utterances] == [24_000, 40_000, 24_000]
    # the same entries as a NeMo manifest give the same samples
    nemo = two_recordings / "nemo.jsonl"
    nemo.write_text("".join(json.dumps({"audio_filepath": u.audio, "text": u.text, "offset": u.offset,
                                        "duration": u.duration or 2.5}) + "\n" for u in utterances))
    for kaldi, manifest in zip(utterances, cp.load_corpus(nemo)):
        assert np.array_equal(cp.load_audio(kaldi), cp.load_audio(manifest))


def test_a_kaldi_folder_without_segments_is_one_utterance_per_recording(two_recordings):
    folder = kaldi_folder(two_recordings / "data", "A ../rec-a.wav\nB ../rec-b.wav\n", "B a quokka\nA the fox\n")
    assert [(u.id, u.duration) for u in cp.load_corpus(folder)] == [("B", None), ("A", None)]


@pytest.mark.parametrize("wav_scp, text, segments, problem", [
    ("A sox a.sph -t wav - |\n", "A the fox\n", None, "wav.scp:1: 'sox a.sph -t wav - |' is a command"),
    ("A feats.ark:1234\n", "A the fox\n", None, "wav.scp:1: 'feats.ark:1234' is an archive offset"),
    ("A ../rec-a.wav\nA ../rec-b.wav\n", "A the fox\n", None, "wav.scp:2: id 'A' again (first on line 1)"),
    ("A ../rec-a.wav\n", "A the fox\nC the dog\n", None, "text:2: utterance 'C': its recording 'C' is not in"),
    ("A ../rec-a.wav\n", "A-1 the fox\n", "A-1 A 2.0 1.0\n", "segments:1: expected '<utterance> <recording>"),
    ("A ../rec-a.wav\n", "A-1 the fox\n", "A-1 A zero 1.0\n", "segments:1: expected '<utterance> <recording>"),
    ("A ../rec-a.wav\n", "A-1 the fox\nA-2 a dog\n", "A-1 A 0 1\n", "text:2: utterance 'A-2' has no line in"),
    ("A ../rec-a.wav\n", "A-1 the fox\n", "A-1 A 0 1\nA-9 A 1 2\n", "segments:2: segment 'A-9' has no transcript"),
    ("A ../rec-a.wav\n", "A ...\n", None, "'A' (", ),
    ("A ../missing.wav\n", "A the fox\n", None, "audio file does not exist"),
])
def test_a_bad_kaldi_folder_is_refused_naming_file_and_line(two_recordings, wav_scp, text, segments, problem):
    folder = kaldi_folder(two_recordings / "data", wav_scp, text, segments)
    with pytest.raises(cp.CorpusError) as error:
        cp.load_corpus(folder)
    assert problem in str(error.value), error.value


def test_quantize_calibrates_from_a_kaldi_folder(models, two_recordings, tmp_path, capsys):
    folder = kaldi_folder(two_recordings / "data", "A ../rec-a.wav\n", "A-1 the quick brown fox\nA-2 a quokka\n",
                          "A-1 A 0 2\nA-2 A 2 -1\n")
    status, printed, err = run_cli(capsys, *quantize_args(models["clean"], tmp_path / "ck", "--method", "gptq",
                                                          calib=folder))
    assert status == 0, err
    log = json.loads((tmp_path / "ck.log.json").read_text())
    assert log["options"]["method"] == "gptq" and (tmp_path / "ck" / "manifest.json").is_file()


# ------------------------------------------------------------------------------------- datasets with their columns
@pytest.fixture
def datasets_folder(tmp_path) -> Path:
    import datasets

    stored = {"bytes": datasets.Value("binary"), "path": datasets.Value("string")}
    features = datasets.Features({"speech": stored, "transcript_text": datasets.Value("string")})
    rows = {"speech": [{"path": str(write_wav(tmp_path / f"d{i}.wav", 1.0, seed=i)), "bytes": None} for i in range(2)],
            "transcript_text": ["the quick brown fox", "a serendipitous quokka"]}
    folder = tmp_path / "hf"
    datasets.Dataset.from_dict(rows, features=features).save_to_disk(folder)
    return folder


def test_a_datasets_folder_reads_with_the_columns_named(datasets_folder):
    with pytest.raises(cp.CorpusError, match="no transcript column among speech, transcript_text; name it with "
                                             "--text-column"):
        cp.load_corpus(datasets_folder)
    with pytest.raises(cp.CorpusError, match="no audio column 'audio' .*; name it with --audio-column"):
        cp.load_corpus(datasets_folder, text_column="transcript_text")
    utterances = cp.load_corpus(datasets_folder, audio_column="speech", text_column="transcript_text")
    assert [u.text for u in utterances] == ["the quick brown fox", "a serendipitous quokka"]
    with pytest.raises(cp.CorpusError, match="--audio-column name a datasets folder's columns; this is a kaldi"):
        cp.load_corpus(kaldi_folder(datasets_folder.parent / "k", "A d0.wav\n", "A fox\n"), audio_column="speech")


def test_quantize_and_eval_take_the_column_options(models, datasets_folder, tmp_path, capsys):
    from tarq_deploy.commands.eval import load_datasets

    status, _, err = run_cli(capsys, *quantize_args(models["clean"], tmp_path / "ck", "--method", "gptq",
                                                    "--audio-column", "speech", "--text-column", "transcript_text",
                                                    calib=datasets_folder))
    assert status == 0, err
    (loaded,) = load_datasets([f"hf={datasets_folder}"], None, "speech", "transcript_text")
    assert loaded.name == "hf" and len(loaded.audio) == 2
    manifest = cp.write_manifest(loaded.utterances, tmp_path / "m.jsonl")
    status, _, err = run_cli(capsys, "eval", "--data", str(manifest), "--model", "packaged:tiny.en",
                             "--audio-column", "speech", "-o", str(tmp_path / "eval"))
    assert_user_error(status, err, "--audio-column", "no --data is a saved datasets folder")


# ----------------------------------------------------------------------------------------------- the language
def test_a_manifest_names_its_language_and_keeps_it_when_written(tmp_path):
    write_wav(tmp_path / "a.wav")
    manifest = tmp_path / "m.jsonl"
    manifest.write_text(json.dumps({"audio_filepath": "a.wav", "text": "Der Patient hat Fieber.", "lang": "de-DE",
                                    "offset": 0.0, "duration": 0.5}) + "\n")
    (utterance,) = cp.load_corpus(manifest)
    assert utterance.language == "de" and utterance.duration == 0.5
    again = cp.load_corpus(cp.write_manifest([utterance], tmp_path / "again.jsonl"))
    assert again[0].language == "de" and again[0].duration == 0.5 and again[0].offset == 0.0
    manifest.write_text(json.dumps({"audio": "a.wav", "text": "x y", "language": 7}) + "\n")
    with pytest.raises(cp.CorpusError, match=r"m.jsonl:1: 'language' must be a language code"):
        cp.load_corpus(manifest)


def test_rarity_reads_the_transcripts_language():
    """German: 'Thrombozytopenie' is rare in German's table, 'Krankenhaus' is not -- and English's table would call
    every German word rare or unknown. Chinese: each character is a unit with its own Zipf."""
    german = {w.normalized: w.rare for w in reference_words("Im Krankenhaus wurde eine Thrombozytopenie gefunden.",
                                                            TailRule(language="de"))}
    assert german == {"im": False, "krankenhaus": False, "wurde": False, "eine": False, "thrombozytopenie": True,
                      "gefunden": False}
    assert sum(w.rare for w in reference_words("Im Krankenhaus wurde eine Thrombozytopenie gefunden.")) >= 3
    chinese = reference_words("我去银行取钱", TailRule(language="zh"))
    assert [w.text for w in chinese] == list("我去银行取钱") and not any(w.rare for w in chinese)


def test_a_language_without_spaces_is_scored_by_characters_and_others_by_words():
    chinese = score_utterance("zh", "我去银行取钱。", "我去很行取钱", language="zh")
    assert chinese.n_words == 6 and chinese.substitutions == 1  # CER 1/6, not one wrong "word" of one
    german = score_utterance("de", "Der Patient hat eine Thrombozytopenie.", "der patient hat eine thrombose",
                             language="de")
    assert german.n_words == 5 and german.substitutions == 1 and german.n_rare == 1
    assert german.rare_errors == 1  # the one rare word is the one lost
    # Whisper's English normaliser would spell out nothing here, but its spelling map must not touch German words
    assert score_utterance("de", "Die Farbe ist grau.", "die farbe ist grau", language="de").substitutions == 0


def test_quantize_tags_by_the_manifests_language(models, tmp_path, capsys):
    write_wav(tmp_path / "a.wav", 1.0)
    manifest = tmp_path / "de.jsonl"
    manifest.write_text(json.dumps({"id": "a", "audio": "a.wav", "text": "Im Krankenhaus wurde eine "
                                    "Thrombozytopenie gefunden.", "language": "de"}) + "\n")
    status, _, err = run_cli(capsys, *quantize_args(models["clean"], tmp_path / "ck", "--method", "tarq",
                                                    calib=manifest))
    assert status == 0, err
    log = json.loads((tmp_path / "ck.log.json").read_text())
    assert log["options"]["language"] == "de"
    manifest.write_text(json.dumps({"id": "a", "audio": "a.wav", "text": "x y", "language": "de"}) + "\n"
                        + json.dumps({"id": "b", "audio": "a.wav", "text": "x y", "language": "fr"}) + "\n")
    status, _, err = run_cli(capsys, *quantize_args(models["clean"], tmp_path / "ck2", "--method", "tarq",
                                                    calib=manifest))
    assert_user_error(status, err, "--calib", "2 languages (de, fr)")


# ------------------------------------------------------------------------------------------ corpus synth --terms
def test_term_sentences_split_seen_and_unseen_terms():
    """Calibration holds no held-out term; the held-out splits hold both kinds; no sentence is in two splits."""
    from tarq_deploy.data.synth import Sentence, deal_term_sentences

    sentences = [Sentence(f"s{i}", "web", 10, 1, (i % 8,) if i % 3 else (i % 8, (i + 1) % 8)) for i in range(80)]
    deal = deal_term_sentences(sentences, {"eval": 12, "test": 12, "calib": 30}, 0.25, seed=3)
    assert len(deal.unseen) == 2 and set(deal.seen) | set(deal.unseen) == set(range(8))
    calib_terms = {t for s in deal.splits["calib"] for t in s.terms}
    assert not calib_terms & set(deal.unseen) and calib_terms == set(deal.seen)
    for split in ("eval", "test"):
        held = {t for s in deal.splits[split] for t in s.terms}
        assert held & set(deal.unseen) and held & set(deal.seen)
    texts = [s.text for split in deal.splits.values() for s in split]
    assert len(texts) == len(set(texts)) == 54
    assert deal == deal_term_sentences(sentences, {"eval": 12, "test": 12, "calib": 30}, 0.25, seed=3)


def test_corpus_synth_terms_writes_a_corpus_of_the_terms(tmp_path, capsys):
    from tarq_deploy.data.rarity import term_match_words
    from tarq_deploy.data.terms import find_terms, read_terms

    terms = tmp_path / "terms.txt"
    terms.write_text("physician\nleprosy\nvinegar\nhyssop\nointment\nmyrrh\nfrankincense\nzyzzyva\n")
    out = tmp_path / "corpus"
    status, printed, err = run_cli(capsys, "corpus", "synth", "-o", str(out), "--terms", str(terms), "--n", "2",
                                   "--n-calib", "3", "--sources", "web", "--voices", "slt", "--unseen-terms", "0.3")
    assert status == 0, err
    assert printed.rstrip().endswith("never in the sources: zyzzyva"), printed
    seen = read_terms(out / "terms-seen.txt", term_match_words)
    unseen = read_terms(out / "terms-unseen.txt", term_match_words)
    for split, expected in (("calib", seen), ("eval", None)):
        for u in cp.load_corpus(out / f"{split}.jsonl"):
            held = {t for t in (seen, unseen) for _ in find_terms(term_match_words(u.text), t.word_forms(
                term_match_words))}
            assert held, (split, u.text)
            if expected is not None:
                assert not find_terms(term_match_words(u.text), unseen.word_forms(term_match_words)), u.text
    summary = json.loads((out / "corpus.json").read_text())
    assert summary["terms"]["absent_from_sources"] == ["zyzzyva"] and summary["options"]["terms"]["terms"] == 8


# ------------------------------------------------------------------------------------ decoding in the language
@pytest.fixture(scope="module")
def german_clip(tmp_path_factory) -> Path:
    """One German sentence spoken by espeak-ng (Debian's package; no offline German voice of better quality)."""
    import subprocess

    root = tmp_path_factory.mktemp("german")
    wav = root / "de1.wav"
    subprocess.run(["espeak-ng", "-v", "de", "-w", str(wav), GERMAN], check=True, timeout=60)
    manifest = root / "de.jsonl"
    manifest.write_text(json.dumps({"id": "de1", "audio": str(wav), "text": GERMAN, "language": "de"},
                                   ensure_ascii=False) + "\n")
    return manifest


GERMAN = "Der Arzt verschrieb dem Patienten ein Antibiotikum gegen die Lungenentzündung."


def test_eval_decodes_scores_and_tags_in_the_manifests_language(german_clip, tmp_path, capsys):
    """Whisper base in PyTorch decodes the German clip in German (told by the manifest), scored with the basic
    normaliser and German's Zipf table; measured: 4 errors in 10 words (espeak-ng's voice, greedy)."""
    out = tmp_path / "eval"
    status, _, err = run_cli(capsys, "eval", "--data", str(german_clip), "--model", "packaged:base", "--backend",
                             "torch", "--decode", "greedy", "--resamples", "20", "-o", str(out), "--quiet")
    assert status == 0, err
    report = json.loads((out / "report.json").read_text())
    assert report["settings"]["language"] == "de" and "BasicTextNormalizer (de" in report["settings"]["normalizer"]
    (row,) = [json.loads(line) for line in (out / "utterances.jsonl").read_text().splitlines()]
    assert "lungenentzündung" in row["hypothesis_normalized"]  # German heard, not English
    assert row["words"] == 10 and row["errors"] <= 6 and row["rare_words"] == 2  # antibiotikum, lungenentzündung


def test_every_backend_is_told_the_language():
    from tarq_deploy.runtimes.base import DecodeOptions
    from tarq_deploy.runtimes.transcribe_cpp import profile_settings
    from tarq_deploy.runtimes.whisper_cpp import whisper_cpp_model_arguments

    assert whisper_cpp_model_arguments("cli", 1, "de")["language"] == "de"
    assert profile_settings("cli", "de")["language"] == "de" and profile_settings("cli")["language"] == "en"
    assert profile_settings("cli", "de")["temperature_inc"] == profile_settings("cli")["temperature_inc"]
    assert DecodeOptions().language == "en"
