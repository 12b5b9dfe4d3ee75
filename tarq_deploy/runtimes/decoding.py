"""Decode profiles: how a Whisper file is decoded when it is scored, benchmarked or published.

Two profiles, the same in every Whisper backend as far as each binding allows:

``greedy``
    The research protocol every figure before this module was measured with: temperature 0 and no fallback, one
    beam, no timestamps, no context, non-speech tokens suppressed (so whisper.cpp and PyTorch greedy paths agree).
    Kept byte for byte for comparisons with earlier results.
``cli``
    What a whisper.cpp user gets from ``whisper-cli -m FILE -f AUDIO``: beam search with 5 beams, best_of 5 for
    the sampled fallbacks, temperature 0 rising by 0.2 whenever a window fails the entropy (2.4) or log-probability
    (-1.0) test, a no-speech threshold of 0.6, timestamps on, each file started without context while the windows of
    a long file carry the previous window's text. Every value below is cited from whisper.cpp v1.8.5 (the library
    pywhispercpp 1.5.1 loads): ``examples/cli/cli.cpp`` (``struct whisper_params`` and the ``wparams.* =`` lines
    of ``main``) over ``src/whisper.cpp``'s ``whisper_full_default_params(WHISPER_SAMPLING_GREEDY)``, which cli.cpp
    starts from.

The default is ``cli``: a user who asks "how good is this file?" means "when I run it", and the published claims hold
under the decoding users get (docs/cli.md says so). ``greedy`` stays one flag away for research comparisons.
"""
from __future__ import annotations

from dataclasses import dataclass

__all__ = ["CLI", "DECODE_PROFILES", "DEFAULT_DECODE_PROFILE", "DecodeProfile", "GREEDY", "PROFILES", "WHISPER_CLI_PARAMS",
           "WHISPER_GREEDY_PARAMS", "WHISPER_CLI_FLAGS", "PYWHISPERCPP_ARGUMENTS", "check_profile", "fresh_state_per_item",
           "profile_named"]

GREEDY = "greedy"
CLI = "cli"
DECODE_PROFILES = (GREEDY, CLI)
DEFAULT_DECODE_PROFILE = CLI

# pywhispercpp names (they are whisper_full_params' field names). The greedy profile is the one every earlier
# figure was decoded with (runtimes/whisper_cpp.py's WHISPER_CPP_PARAMS): do not change it.
WHISPER_GREEDY_PARAMS: dict = {"language": "en", "translate": False, "temperature": 0.0, "temperature_inc": 0.0,
                               "no_timestamps": True, "no_context": True, "suppress_nst": True}

# whisper-cli's defaults, field by field (cli.cpp v1.8.5; "default" = whisper_full_default_params(GREEDY), which
# cli.cpp does not override for that field)
WHISPER_CLI_PARAMS: dict = {
    "language": "en",           # whisper_params.language = "en"
    "detect_language": False,   # whisper_params.detect_language = false
    "translate": False,         # whisper_params.translate = false
    "temperature": 0.0,         # whisper_params.temperature = 0.0f
    "temperature_inc": 0.2,     # whisper_params.temperature_inc = 0.2f (no_fallback = false)
    "entropy_thold": 2.4,       # whisper_params.entropy_thold = 2.40f
    "logprob_thold": -1.0,      # whisper_params.logprob_thold = -1.00f
    "no_speech_thold": 0.6,     # whisper_params.no_speech_thold = 0.6f
    "no_timestamps": False,     # whisper_params.no_timestamps = false (so timestamps are decoded)
    "suppress_nst": False,      # whisper_params.suppress_nst = false
    "suppress_blank": True,     # default
    "no_context": True,         # default, cli.cpp leaves it: each file starts afresh, windows within it carry text
    "n_max_text_ctx": 16384,    # default (whisper_params.max_context = -1 keeps it)
    "single_segment": False,    # default
    "token_timestamps": False,  # cli.cpp: output_wts || output_jsn_full || max_len > 0, all off by default
    "max_len": 0,               # whisper_params.max_len = 0
    "split_on_word": False,     # whisper_params.split_on_word = false
    "audio_ctx": 0,             # whisper_params.audio_ctx = 0
    "max_initial_ts": 1.0,      # default
    "length_penalty": -1.0,     # default
    # whisper_params.best_of = whisper_full_default_params(GREEDY).greedy.best_of = 5 (used by the sampled
    # fallbacks); beam_size = whisper_full_default_params(BEAM_SEARCH).beam_search.beam_size = 5, patience default
    "greedy": {"best_of": 5},
    "beam_search": {"beam_size": 5, "patience": -1.0},
}
WHISPER_CLI_BEAM_SEARCH = True  # cli.cpp: strategy = beam_size > 1 ? WHISPER_SAMPLING_BEAM_SEARCH : GREEDY
WHISPER_CLI_FLASH_ATTN = True   # whisper_params.flash_attn = true -> cparams.flash_attn (a context parameter)


@dataclass(frozen=True)
class DecodeProfile:
    """One decoding, in the terms each backend speaks.

    ``whisper_cpp``: pywhispercpp keyword arguments (whisper_full_params fields); ``beam_search``: whether the
    whisper_full strategy is beam search. ``torch``: transformers ``generate`` options for Whisper (the long-form
    options apply when the input is longer than one 30 s window). ``crispasr_whisper``: CrispASR whisper-backend
    settings. ``transcribe_cpp``: transcribe.cpp's WhisperRunOptions and run() arguments (its binding exposes
    temperature and temperature_inc, not beams: the rest is its runtime's own)."""

    name: str
    description: str
    whisper_cpp: dict
    beam_search: bool
    torch: dict
    crispasr_whisper: dict
    transcribe_cpp: dict

    def record(self) -> dict:
        """What a report, cache key, sweep cell or model card says of the decoding."""
        return {"profile": self.name, "description": self.description}


# transformers' Whisper generate: the closest match of each whisper-cli setting. transformers has OpenAI's
# compression-ratio test where whisper.cpp has a token-entropy test; both flag the same failure (a repetitive window)
# at the same 2.4 value, so the OpenAI one stands in. Sampled fallbacks are seeded per utterance (runtimes/
# torch_whisper.py) so the same audio gives the same text.
TORCH_GREEDY: dict = {"num_beams": 1, "do_sample": False, "temperature": None, "return_timestamps": False}
TORCH_CLI: dict = {"num_beams": 5, "do_sample": False, "temperature": (0.0, 0.2, 0.4, 0.6, 0.8, 1.0),
                   "compression_ratio_threshold": 2.4, "logprob_threshold": -1.0, "no_speech_threshold": 0.6,
                   "condition_on_prev_tokens": True, "return_timestamps": True}

# CrispASR's whisper backend (a whisper.cpp .bin): its Session setters. Greedy: what the adapter always sent.
CRISPASR_GREEDY: dict = {"temperature_inc": 0.0, "suppress_nst": True, "beam_size": None, "best_of": None}
CRISPASR_CLI: dict = {"temperature_inc": WHISPER_CLI_PARAMS["temperature_inc"], "suppress_nst": False,
                      "beam_size": 5, "best_of": 5}
# transcribe.cpp: WhisperRunOptions has temperature, temperature_inc, thresholds and context, no beams (its
# Whisper runtime decodes greedily with sampled fallbacks): "cli" there is as near as the binding allows.
TRANSCRIBE_CPP_GREEDY: dict = {"timestamps": "none", "options": {"temperature": 0.0, "temperature_inc": 0.0}}
TRANSCRIBE_CPP_CLI: dict = {"timestamps": "segment",
                            "options": {"temperature": 0.0, "temperature_inc": 0.2, "compression_ratio_thold": 2.4,
                                        "logprob_thold": -1.0, "no_speech_thold": 0.6,
                                        "condition_on_prev_tokens": True, "seed": 0}}

PROFILES: dict[str, DecodeProfile] = {
    GREEDY: DecodeProfile(
        GREEDY, "greedy, temperature 0 without fallback, no timestamps, no context (research protocol)",
        WHISPER_GREEDY_PARAMS, False, TORCH_GREEDY,
        CRISPASR_GREEDY, TRANSCRIBE_CPP_GREEDY),
    CLI: DecodeProfile(
        CLI, "whisper-cli's defaults: beam search 5, best_of 5, temperature fallback +0.2 (entropy 2.4, logprob -1.0, "
             "no-speech 0.6), timestamps, context carried across a file's windows",
        WHISPER_CLI_PARAMS, WHISPER_CLI_BEAM_SEARCH, TORCH_CLI,
        CRISPASR_CLI, TRANSCRIBE_CPP_CLI),
}


# How a model card's usage lines reproduce a profile. whisper-cli's own flags (cli.cpp v1.8.5: -bs beam size, -nf no
# fallback, -nt no timestamps, -sns suppress non-speech tokens, -l language); pywhispercpp's Model arguments (its
# defaults are whisper_full_default_params of the strategy it is given, which are not whisper-cli's).
WHISPER_CLI_FLAGS = {GREEDY: "-l en -bs 1 -nf -nt -sns", CLI: ""}
PYWHISPERCPP_ARGUMENTS = {
    GREEDY: {"language": "en", "temperature_inc": 0.0, "no_timestamps": True, "suppress_nst": True},
    CLI: {"params_sampling_strategy": 1, "greedy": {"best_of": 5}, "beam_search": {"beam_size": 5, "patience": -1.0}},
}


def check_profile(name: str) -> str:
    """``name`` if it is a decode profile; else ValueError naming the choices (the CLI's argparse ``type``)."""
    if name not in PROFILES:
        raise ValueError(f"unknown decode profile {name!r} (choose {', '.join(DECODE_PROFILES)})")
    return name


def profile_named(name: str) -> DecodeProfile:
    return PROFILES[check_profile(name)]


def fresh_state_per_item(profile_name: str) -> bool:
    """Whether a whisper.cpp worker (pywhispercpp, or CrispASR's whisper backend, which is whisper.cpp inside)
    decodes each utterance in a new state. whisper.cpp draws a fallback temperature's samples from an RNG in the
    state, seeded when the state is made and never again: in one long-lived state an utterance's text would depend on
    what was decoded before it (tiny.en Q4_0 gave one white-noise clip "" twice, then an invented sentence, in both
    runtimes). whisper-cli makes one state per file; the workers make one per utterance when the profile samples at
    all (greedy never does, so it keeps one). transcribe.cpp seeds each run itself (WhisperRunOptions.seed)."""
    return profile_named(profile_name).whisper_cpp.get("temperature_inc", 0.0) > 0
