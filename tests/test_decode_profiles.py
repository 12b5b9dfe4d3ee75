"""Decode profiles (runtimes/decoding.py): ``cli`` is whisper-cli's decoding, read back from the structs the bindings
build; ``greedy`` is the research protocol every earlier figure was decoded with, text for text.

whisper-cli (whisper.cpp v1.8.5 examples/cli/cli.cpp, the library pywhispercpp 1.5.1 loads) starts from
``whisper_full_default_params(WHISPER_SAMPLING_GREEDY)`` and assigns the fields below from its own defaults; every
other field keeps the library's default. The test repeats those assignments on the binding's own default struct and
compares, field by field, with the struct our worker's ``Model`` holds.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tarq_deploy import cli
from tarq_deploy.data.corpus import load_audio, load_corpus
from tarq_deploy.runtimes.base import DecodeOptions, ModelSpec
from tarq_deploy.runtimes.decoding import PROFILES, WHISPER_GREEDY_PARAMS, check_profile
from tarq_deploy.runtimes.registry import open_transcriber
from tarq_deploy.runtimes.whisper_cpp import WHISPER_CPP_PARAMS, whisper_cpp_model_arguments

# cli.cpp's ``wparams.X = params.Y`` lines with whisper_params' defaults (struct whisper_params)
CLI_ASSIGNMENTS = {"language": "en", "detect_language": False, "translate": False, "n_max_text_ctx": None,
                   "offset_ms": 0, "duration_ms": 0, "token_timestamps": False, "thold_pt": 0.01, "max_len": 0,
                   "split_on_word": False, "audio_ctx": 0, "debug_mode": False, "tdrz_enable": False,
                   "temperature": 0.0, "temperature_inc": 0.2, "entropy_thold": 2.4, "logprob_thold": -1.0,
                   "no_speech_thold": 0.6, "no_timestamps": False, "suppress_nst": False, "print_special": False,
                   "carry_initial_prompt": False}
# the greedy profile before decode profiles existed (runtimes/whisper_cpp.py's WHISPER_CPP_PARAMS then)
HISTORICAL_GREEDY = {"language": "en", "translate": False, "temperature": 0.0, "temperature_inc": 0.0,
                     "no_timestamps": True, "no_context": True, "suppress_nst": True}
# fields that are callbacks, pointers or printing: not decoding
NOT_DECODING = {"n_threads", "progress_callback", "print_progress", "print_realtime", "print_timestamps", "initial_prompt",
                "prompt_tokens", "prompt_n_tokens", "suppress_regex", "vad_model_path", "vad_params"}


@pytest.fixture(scope="module")
def tiny_f16(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("profiles") / "tiny.en-f16.bin"
    assert cli.main(["export", "--model", "packaged:tiny.en", "-o", str(out), "--quiet"]) == 0
    return out


@pytest.fixture(scope="module")
def clips(tmp_path_factory) -> tuple[list, list[np.ndarray]]:
    out = tmp_path_factory.mktemp("profile_clips")
    assert cli.main(["corpus", "real", "-o", str(out)]) == 0
    utterances = load_corpus(out / "eval.jsonl")[:4]
    return utterances, [load_audio(u) for u in utterances]


def _decoding_fields(params) -> dict:
    """Every decoding field of a whisper_full_params (pywhispercpp's binding), nested dicts included."""
    names = [n for n in dir(params) if not n.startswith("_") and n not in NOT_DECODING
             and not n.endswith(("callback", "user_data")) and not callable(getattr(type(params), n, None))]
    return {n: getattr(params, n) for n in names}


def _whisper_cli_struct():
    import _pywhispercpp as pw

    strategy = pw.whisper_sampling_strategy
    expected = pw.whisper_full_default_params(strategy.WHISPER_SAMPLING_GREEDY)
    for name, value in CLI_ASSIGNMENTS.items():
        if value is not None:  # None: cli.cpp assigns the default back (max_context -1)
            setattr(expected, name, value)
    best_of = pw.whisper_full_default_params(strategy.WHISPER_SAMPLING_GREEDY).greedy["best_of"]
    beam_size = pw.whisper_full_default_params(strategy.WHISPER_SAMPLING_BEAM_SEARCH).beam_search["beam_size"]
    expected.greedy = {**expected.greedy, "best_of": best_of}
    expected.beam_search = {**expected.beam_search, "beam_size": beam_size}
    expected.strategy = strategy.WHISPER_SAMPLING_BEAM_SEARCH if beam_size > 1 else strategy.WHISPER_SAMPLING_GREEDY
    return expected


def _worker_struct(model_file: Path, profile: str):
    from pywhispercpp.model import Model

    return Model(str(model_file), **whisper_cpp_model_arguments(profile, threads=1))._params


def _close(a, b) -> bool:
    if isinstance(a, float) or isinstance(b, float):
        return abs(float(a) - float(b)) < 1e-6
    return a == b


def test_cli_profile_is_whisper_clis_defaults_field_by_field(tiny_f16: Path):
    ours, expected = _decoding_fields(_worker_struct(tiny_f16, "cli")), _decoding_fields(_whisper_cli_struct())
    assert ours.keys() == expected.keys()
    differing = {n: (ours[n], expected[n]) for n in ours if not _close(ours[n], expected[n])}
    assert not differing, differing
    assert str(ours["strategy"]).endswith("BEAM_SEARCH") and ours["beam_search"]["beam_size"] == 5
    assert ours["greedy"]["best_of"] == 5 and ours["temperature_inc"] == pytest.approx(0.2)


def test_greedy_profile_struct_is_the_historical_one(tiny_f16: Path):
    from pywhispercpp.model import Model

    assert WHISPER_GREEDY_PARAMS == HISTORICAL_GREEDY and WHISPER_CPP_PARAMS == HISTORICAL_GREEDY
    before = Model(str(tiny_f16), redirect_whispercpp_logs_to=None, n_threads=1, print_progress=False,
                   print_realtime=False, print_timestamps=False, **HISTORICAL_GREEDY)._params
    assert _decoding_fields(_worker_struct(tiny_f16, "greedy")) == _decoding_fields(before)


def test_greedy_reproduces_the_historical_hypotheses(tiny_f16: Path, clips):
    """Text for text, whisper.cpp (the worker vs the old Model call) and PyTorch (the transcriber vs a direct greedy
    generate with the fixed prompt)."""
    import torch
    from pywhispercpp.model import Model

    from tarq_deploy.formats.model_loader import load_whisper
    from tarq_deploy.model_source import resolve_source
    from tarq_deploy.models.whisper import WhisperBackbone

    utterances, audios = clips
    old = Model(str(tiny_f16), redirect_whispercpp_logs_to=None, n_threads=1, print_progress=False,
                print_realtime=False, print_timestamps=False, **HISTORICAL_GREEDY)
    before = [" ".join(s.text.strip() for s in old.transcribe(a)).strip() for a in audios]
    worker = open_transcriber(ModelSpec("f16", str(tiny_f16), "whisper.cpp"), DecodeOptions(profile="greedy"))
    try:
        assert [worker.transcribe(a, u.id) for a, u in zip(audios, utterances)] == before
    finally:
        worker.close()

    model, processor, generation_config = load_whisper(resolve_source("packaged:tiny.en"))
    backbone = WhisperBackbone(model, processor, generation_config, "cpu")
    config = generation_config.__class__.from_dict(generation_config.to_dict())
    config.do_sample, config.num_beams, config.max_new_tokens, config.max_length, config.temperature = \
        False, 1, 224, None, None
    prompt = torch.tensor([backbone.prompt_ids()])
    direct = []
    for audio in audios:
        features = processor.feature_extractor(audio, sampling_rate=16000, return_tensors="pt").input_features
        with torch.inference_mode():
            ids = model.generate(features, decoder_input_ids=prompt, generation_config=config)
        direct.append(processor.tokenizer.decode(ids[0], skip_special_tokens=True).strip())
    torch_run = open_transcriber(ModelSpec("f16", "packaged:tiny.en", "torch"), DecodeOptions(profile="greedy"))
    assert [torch_run.transcribe(a, u.id) for a, u in zip(audios, utterances)] == direct


def test_cli_profile_decodes_in_every_whisper_backend(tiny_f16: Path, clips):
    """The cli profile runs in whisper.cpp, CrispASR's whisper backend and PyTorch, gives text, and says so."""
    utterances, audios = clips
    for backend, source in (("whisper.cpp", str(tiny_f16)), ("crispasr", str(tiny_f16)),
                            ("torch", "packaged:tiny.en")):
        run = open_transcriber(ModelSpec("f16", source, backend), DecodeOptions(profile="cli"))
        try:
            texts = [run.transcribe(a, u.id) for a, u in zip(audios[:2], utterances[:2])]
            described = run.describe()
        finally:
            run.close()
        assert all(len(t.split()) >= 3 for t in texts), (backend, texts)
        assert described.get("decode") == "cli", (backend, described)


def test_transcribe_cpp_cli_options_reach_its_run_options():
    import transcribe_cpp

    from tarq_deploy.runtimes.transcribe_cpp import profile_settings

    settings = profile_settings("cli")
    options = transcribe_cpp.WhisperRunOptions(temperature=settings["temperature"],
                                               temperature_inc=settings["temperature_inc"],
                                               **settings["whisper_options"])
    assert options.temperature_inc == pytest.approx(0.2) and options.logprob_thold == pytest.approx(-1.0)
    assert options.no_speech_thold == pytest.approx(0.6) and options.condition_on_prev_tokens is True
    assert settings["timestamps"] == "segment" and profile_settings("greedy")["temperature_inc"] == 0.0


def test_profiles_are_named_in_the_cache_key_and_refused_when_unknown(tmp_path: Path):
    from tarq_deploy.evaluate.cache import HypothesisCache
    from tarq_deploy.evaluate.dataset import Dataset

    spec = ModelSpec("f16", "packaged:tiny.en", "torch")
    dataset = Dataset("d", "m.jsonl", [], [])
    keys = {p: HypothesisCache(tmp_path, spec, dataset, DecodeOptions(profile=p)) for p in PROFILES}
    assert keys["greedy"].path != keys["cli"].path
    assert keys["greedy"].identity["decode"] != keys["cli"].identity["decode"]
    with pytest.raises(ValueError, match="unknown decode profile 'beam'"):
        check_profile("beam")


def test_the_model_cards_pywhispercpp_line_builds_the_profiles_struct(tiny_f16: Path):
    """A card's usage line (hub.py) decodes as the figures were measured: the same whisper_full_params."""
    from pywhispercpp.model import Model

    from tarq_deploy.runtimes.decoding import PYWHISPERCPP_ARGUMENTS

    for profile, arguments in PYWHISPERCPP_ARGUMENTS.items():
        card_line = Model(str(tiny_f16), redirect_whispercpp_logs_to=None, **arguments)._params
        assert _decoding_fields(card_line) == _decoding_fields(_worker_struct(tiny_f16, profile)), profile


@pytest.fixture(scope="module")
def tiny_q4_0_and_noise(tmp_path_factory) -> tuple[Path, np.ndarray]:
    """ggml's Q4_0 of tiny.en and 10 s of white noise: the pair on which one long-lived state sampled differently (4
    decodes in one state: pywhispercpp '', an invented sentence, '', ''; CrispASR '', '', '', '[BLANK_AUDIO]')."""
    out = tmp_path_factory.mktemp("fallback_rng")
    assert cli.main(["export", "--model", "packaged:tiny.en", "--type", "q4_0", "--baseline", "ggml",
                     "-o", str(out / "tiny-q4_0.bin"), "--quiet"]) == 0
    assert cli.main(["corpus", "nonspeech", "-o", str(out / "ns"), "--seconds", "10", "--per-kind", "1",
                     "--seed", "0"]) == 0
    return out / "tiny-q4_0.bin", load_audio(str(out / "ns" / "audio" / "white-00.wav"))


@pytest.mark.parametrize("backend", ["whisper.cpp", "crispasr"])
def test_cli_decodes_an_item_the_same_whatever_the_worker_decoded_before(tiny_q4_0_and_noise, backend: str):
    """whisper.cpp draws its fallback temperatures' samples from an RNG in the state, seeded once: in one long-lived
    worker the same noise clip came back "" twice and as an invented sentence the third time (tiny.en Q4_0; in
    pywhispercpp and in CrispASR's whisper backend alike). whisper-cli makes one state per file; each worker makes one
    per item, so a text depends on its audio alone and a cached hypothesis is the one a fresh run would write."""
    model, noise = tiny_q4_0_and_noise
    worker = open_transcriber(ModelSpec("q4_0", str(model), backend), DecodeOptions(profile="cli"))
    try:
        texts = [worker.transcribe(noise, f"white-{i}") for i in range(4)]
        described = worker.describe()
    finally:
        worker.close()
    assert len(set(texts)) == 1, texts
    assert described["state"] == "fresh per item"


def test_beam_search_skips_only_a_cross_attention_reorder_that_changes_nothing(tiny, jfk_wav):
    """runtimes/torch_whisper.reorder_beams: beam search with it gives transformers' own beams token for token; it
    leaves the cross-attention cache unreordered for one utterance (every beam's rows the same bits) and reorders
    it for a batch of two different utterances, where the rows differ."""
    import torch
    from transformers.cache_utils import EncoderDecoderCache

    from tarq_deploy.runtimes.torch_whisper import reorder_beams

    model, processor, generation_config = tiny
    audio = load_audio(jfk_wav)
    single = processor.feature_extractor(audio, sampling_rate=16000, return_tensors="pt").input_features
    pair = torch.cat([single, processor.feature_extractor(audio[::-1].copy(), sampling_rate=16000,
                                                          return_tensors="pt").input_features])
    verdicts: list[bool] = []
    original = EncoderDecoderCache.reorder_cache

    def hook(cache, beam_idx):
        cache = reorder_beams(cache, beam_idx)
        verdicts.append(cache._tarq_cross_rows_shared)
        return cache

    for features in (single, pair):
        with torch.inference_mode():
            plain = model.generate(features, num_beams=5, max_new_tokens=10)
            model._reorder_cache = hook
            try:
                hooked = model.generate(features, num_beams=5, max_new_tokens=10)
            finally:
                del model._reorder_cache
        assert torch.equal(plain, hooked)
    assert EncoderDecoderCache.reorder_cache is original  # nothing patched beyond the model instance
    assert True in verdicts and False in verdicts  # skipped for one utterance, done for the differing pair
    assert verdicts.index(False) > verdicts.index(True) and all(verdicts[:verdicts.index(False)])
