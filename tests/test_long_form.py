"""Long recordings (tarq_deploy/data/long_form.py): the spans tile the audio and index the transcript's words, speech
is the source utterances' own samples, lengths stay in range, one seed gives one corpus; the manifest they are
written to, its strict span reader (fuzzed), and `tarq-deploy corpus long`."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from helpers import JSON_VALUES, Seed, fresh_path, hang_guard, mutated, run_cli, write_wav
from hypothesis import event, given
from hypothesis import strategies as st

from tarq_deploy import cli
from tarq_deploy.data.corpus import Utterance, load_audio, load_corpus, write_manifest
from tarq_deploy.data.long_form import (GAP_KINDS, LONG_MANIFEST, LongFormError, build_long_recordings,
                                        load_long_spans, plan_long_recordings, render_long_recording,
                                        write_long_corpus)
from tarq_deploy.data.nonspeech import rms_dbfs
from tarq_deploy.data.normalize import normalized_words

RATE = 16_000
TEXTS = ["The quick brown fox jumps over the lazy dog.", "A serendipitous quokka ate the persimmon.",
         "She sells sea shells by the shore.", "Colourful kites rose above the harbour.",
         "I am twenty", "One more time, please.", "He said...", "What a day it was!",
         "Mr. Dashwood's estate was large.", "Rain fell on the quiet village.", "They walked home slowly.",
         "An old clock ticked in the hall.", "Bright stars shone over the hills.", "We baked bread at dawn."]
RANGE = (20.0, 35.0)


def _bursts(seconds: float, hz: float) -> np.ndarray:
    """A sine with a 3 Hz on-off rhythm: speech-like enough for the plumbing, built in microseconds."""
    t = np.arange(round(RATE * seconds)) / RATE
    return (0.3 * (np.sin(2 * np.pi * 3 * t) > 0) * np.sin(2 * np.pi * hz * t)).astype(np.float32)


@pytest.fixture(scope="module")
def pool() -> tuple[list[Utterance], list[np.ndarray]]:
    utterances = [Utterance(f"u{i:02d}", "", text) for i, text in enumerate(TEXTS)]
    audios = [_bursts(1.0 + 0.25 * (i % 6), 150.0 + 20 * i) for i in range(len(TEXTS))]
    return utterances, audios


@pytest.fixture(scope="module")
def recordings(pool) -> list:
    return build_long_recordings(*pool, RANGE, seed=11, n_recordings=6)


# ------------------------------------------------------------------------------------------------ the recordings
def test_spans_tile_each_recording_exactly(recordings) -> None:
    for recording in recordings:
        spans = recording.spans
        assert spans[0].start_s == 0.0 and spans[-1].end_s == len(recording.audio) / RATE
        assert all(a.end_s == b.start_s for a, b in zip(spans, spans[1:]))
        ranges = [span.sample_range() for span in spans]
        assert ranges[0][0] == 0 and ranges[-1][1] == len(recording.audio)
        assert all(a[1] == b[0] and a[0] < a[1] for a, b in zip(ranges, ranges[1:]))


def test_speech_spans_hold_the_source_samples(pool, recordings) -> None:
    source = {u.id: audio for u, audio in zip(*pool)}
    for recording in recordings:
        for span in (s for s in recording.spans if s.kind == "speech"):
            start, end = span.sample_range()
            assert np.array_equal(recording.audio[start:end], source[span.utterance_id])


def test_word_indices_are_the_transcripts_words(pool, recordings) -> None:
    text_of = {u.id: u.text for u in pool[0]}
    for recording in recordings:
        words = normalized_words(recording.transcript)
        speech = [s for s in recording.spans if s.kind == "speech"]
        assert recording.transcript == " ".join(text_of[s.utterance_id] for s in speech)
        assert len({s.utterance_id for s in speech}) == len(speech)  # no utterance twice in one recording
        position = 0
        for span in recording.spans:
            assert span.first_word == position
            if span.kind == "speech":
                assert words[position: position + span.n_words] == normalized_words(text_of[span.utterance_id])
            else:
                assert span.n_words == 0 and span.utterance_id is None
            position += span.n_words
        assert position == len(words)


def test_utterances_whose_words_merge_never_meet(recordings) -> None:
    """"I am twenty" + "One more time" normalise to "i am 21 more time"; "He said..." keeps its "." only last."""
    placed = set()
    for recording in recordings:
        ids = [s.utterance_id for s in recording.spans if s.kind == "speech"]
        assert ("u04", "u05") not in set(zip(ids, ids[1:]))
        assert "u06" not in ids[:-1]
        placed |= set(ids)
    assert {"u04", "u05", "u06"} <= placed  # the rule was put to the test


def test_lengths_stay_in_range_and_gaps_are_what_they_say(recordings) -> None:
    assert all(RANGE[0] <= r.seconds <= RANGE[1] for r in recordings)
    gaps = [(r, s) for r in recordings for s in r.spans if s.kind in GAP_KINDS]
    assert {s.kind for _, s in gaps} == set(GAP_KINDS)  # this seed draws every kind
    for recording, span in gaps:
        start, end = span.sample_range()
        audio, seconds = recording.audio[start:end], span.end_s - span.start_s
        if span.kind == "pause":
            assert 0.3 <= seconds <= 1.5 and rms_dbfs(audio) == pytest.approx(-70, abs=0.1)
        else:
            assert 3.0 <= seconds <= 12.0
        if span.detail == "digital":
            assert not np.any(audio) and span.level_dbfs is None
        elif span.kind == "noise":
            assert -40 <= span.level_dbfs <= -25 and rms_dbfs(audio) == pytest.approx(span.level_dbfs, abs=0.1)
        elif span.kind == "silence":
            assert rms_dbfs(audio) == pytest.approx(-60, abs=0.1)
    assert all(np.max(np.abs(r.audio)) <= 1.0 for r in recordings)


def test_one_seed_gives_one_corpus_and_another_seed_another(pool, recordings) -> None:
    again = build_long_recordings(*pool, RANGE, seed=11, n_recordings=6)
    assert [(r.spans, r.transcript, r.audio.tobytes()) for r in again] == \
        [(r.spans, r.transcript, r.audio.tobytes()) for r in recordings]
    other = build_long_recordings(*pool, RANGE, seed=12, n_recordings=6)
    assert [r.spans for r in other] != [r.spans for r in recordings]
    fewer = build_long_recordings(*pool, RANGE, seed=11, n_recordings=2)  # recording i does not depend on n
    assert [r.audio.tobytes() for r in fewer] == [r.audio.tobytes() for r in recordings[:2]]


def test_too_little_speech_or_mismatched_audio_is_refused(pool) -> None:
    utterances, audios = pool
    durations = [len(a) / RATE for a in audios]
    with pytest.raises(LongFormError, match="fill only"):
        plan_long_recordings(utterances[:3], durations[:3], (60.0, 90.0), seed=0)
    with pytest.raises(LongFormError, match="minimum <= maximum"):
        plan_long_recordings(utterances, durations, (30.0, 20.0), seed=0)
    plan = plan_long_recordings(utterances, durations, RANGE, seed=0)[0]
    shorter = {u.id: a[:-1] for u, a in zip(utterances, audios)}
    with pytest.raises(LongFormError, match="samples, the plan counted"):
        render_long_recording(plan, shorter, seed=0)


# -------------------------------------------------------------------------------------------------------- files
def test_the_corpus_round_trips_through_the_manifest_readers(recordings, tmp_path: Path) -> None:
    manifest = write_long_corpus(tmp_path, recordings)
    assert manifest == tmp_path / LONG_MANIFEST
    entries = load_corpus(manifest)  # the ordinary manifest reader takes it: extra fields are ignored
    assert [(e.id, e.text) for e in entries] == [(r.id, r.transcript) for r in recordings]
    assert load_long_spans(manifest) == {r.id: list(r.spans) for r in recordings}
    decoded = load_audio(entries[0])
    assert len(decoded) == len(recordings[0].audio)
    assert np.max(np.abs(decoded - recordings[0].audio)) < 2 / 32768  # 16-bit: within a step


def _record(manifest: Path) -> dict:
    return json.loads(manifest.read_text().splitlines()[0])


@pytest.mark.parametrize(("edit", "problem"), [
    (lambda r: r["spans"][1].update(start_s=r["spans"][1]["start_s"] + 0.5), "must start where the last ended"),
    (lambda r: r["spans"][0].update(n_words=r["spans"][0]["n_words"] + 1), "must start at word"),
    (lambda r: r.update(words=r["words"] + 1), "the spans cover"),
    (lambda r: r.update(seconds=r["seconds"] + 1), "the spans cover"),
    (lambda r: r.update(text="extra " + r["text"]), "after normalisation"),
    (lambda r: r["spans"][0].update(kind="music"), "unknown kind"),
    (lambda r: r["spans"][0].update(first_word=True), "integer"),
    (lambda r: r.update(spans={}), "must be a list"),
])
def test_a_bad_record_is_refused_naming_file_and_line(recordings, tmp_path: Path, edit, problem: str) -> None:
    manifest = write_long_corpus(tmp_path, recordings[:1])
    record = _record(manifest)
    edit(record)
    manifest.write_text(manifest.read_text() + json.dumps(record).replace(record["id"], "second", 1) + "\n")
    with pytest.raises(LongFormError, match=problem) as caught:
        load_long_spans(manifest)
    assert str(caught.value).startswith(f"{manifest}:2") and "\n" not in str(caught.value)


# ------------------------------------------------------------------------------------------------------ fuzzing
@pytest.fixture(scope="module")
def fuzz_dir(tmp_path_factory, recordings) -> Path:
    folder = tmp_path_factory.mktemp("long-fuzz")
    write_long_corpus(folder, recordings[:2])
    return folder


@st.composite
def edited(draw: st.DrawFn, document: object) -> object:
    """``document`` with a value somewhere inside it replaced, deleted, or joined by an unknown key."""
    document = json.loads(json.dumps(document))
    parent, key, node = None, None, document
    while isinstance(node, (dict, list)) and node and draw(st.integers(0, 4)) > 0:
        parent, key = node, draw(st.sampled_from(list(node) if isinstance(node, dict) else range(len(node))))
        node = node[key]
    if parent is None:
        return draw(JSON_VALUES)
    action = draw(st.sampled_from(("replace", "replace", "delete", "add")))
    if action == "delete":
        del parent[key]
    elif action == "add" and isinstance(parent, dict):
        parent["unknown"] = draw(JSON_VALUES)
    else:
        parent[key] = draw(JSON_VALUES)
    return document


@given(data=st.data())
def test_fuzzed_span_manifests_parse_or_raise_the_named_error(fuzz_dir, data) -> None:
    records = [json.loads(line) for line in (fuzz_dir / LONG_MANIFEST).read_text().splitlines()]
    records = [data.draw(edited(r)) if data.draw(st.booleans()) else r for r in records]
    raw = "".join(json.dumps(r, ensure_ascii=data.draw(st.booleans())) + "\n" for r in records).encode()
    if data.draw(st.booleans()):
        raw = data.draw(mutated(Seed(raw, tuple(range(len(raw))))))
    path = fresh_path(fuzz_dir, ".jsonl")
    path.write_bytes(raw)
    with hang_guard():
        try:
            load_long_spans(path)
        except LongFormError as problem:
            assert str(path) in str(problem), problem
            assert "\n" not in cli.user_error_message(problem)
            event("refused")
        else:
            event("parsed")


# ---------------------------------------------------------------------------------------------------------- CLI
@pytest.fixture
def held_out(tmp_path: Path) -> Path:
    utterances = [Utterance(f"h{i:02d}", str(write_wav(tmp_path / f"h{i:02d}.wav", 1.0 + 0.2 * (i % 4), seed=i)),
                            text) for i, text in enumerate(TEXTS)]
    return write_manifest(utterances, tmp_path / "held-out.jsonl")


def test_cli_writes_long_recordings(held_out: Path, tmp_path: Path, capsys) -> None:
    out = tmp_path / "long"
    run = run_cli(capsys, "corpus", "long", "--data", held_out, "-o", out, "--minutes", "0.3,0.5", "--n", "2",
                  "--seed", "5")
    assert run.status == 0, run.err
    spans = load_long_spans(out / LONG_MANIFEST)
    entries = load_corpus(out / LONG_MANIFEST)
    assert sorted(spans) == [e.id for e in entries] == ["long-000", "long-001"]
    for entry in entries:
        seconds = len(load_audio(entry)) / RATE
        assert 18 <= seconds <= 30 and spans[entry.id][-1].end_s == seconds
    assert "long: 2 recordings" in run.out


@pytest.mark.parametrize(("options", "named"), [
    (["--minutes", "2"], "--minutes"), (["--minutes", "5,2"], "--minutes"), (["--minutes", "a,b"], "--minutes"),
    (["--minutes", "1,inf"], "--minutes"), (["--n", "0"], "--n"),
    (["--minutes", "5,8"], "too little for one recording"),  # 14 utterances hold about 20 s
])
def test_cli_refuses_bad_options_by_name_before_writing(held_out: Path, tmp_path: Path, capsys, options: list,
                                                        named: str) -> None:
    out = tmp_path / "long"
    run = run_cli(capsys, "corpus", "long", "--data", held_out, "-o", out, *options)
    assert run.status == 2 and named in run.message and len(run.message.splitlines()) == 1, run.err
    assert not out.exists()
