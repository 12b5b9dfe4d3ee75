"""Shared fixtures: real English speech clips with transcripts (see tarq_deploy/data/real_clips.py).

The clips are found offline (Debian's pocketsphinx-testdata) or fetched once into the tarq-deploy cache through
pip's configured indexes; a missing source fails the test with a message saying how to provide it.
"""
from __future__ import annotations

import os

# Before torch starts OpenMP: busy-waiting worker threads make small ops crawl on a shared 2-core machine.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest

from tarq_deploy.data.real_clips import Clip, RealClipError, all_real_clips, jfk_wav_path, librivox_clips as _librivox


@pytest.fixture(scope="module")
def one_torch_thread():
    """One torch thread for a module of small, memory-bound ops: two OpenMP threads spinning on a shared 2-core
    machine made them several times slower than one."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def tiny():
    """Whisper tiny.en as (model, processor, generation_config), from the packaged copy; loaded once per module
    (the modules that use it change nothing in it)."""
    from tarq_deploy.models.loader import load_whisper

    return load_whisper("packaged:tiny.en")


def _or_fail(what: str, error: RealClipError) -> None:
    pytest.fail(f"real clip source unavailable ({what}): {error}", pytrace=False)


@pytest.fixture(scope="session")
def jfk_wav() -> str:
    """Path of jfk.wav (11.0 s, 16 kHz mono); transcript in tarq_deploy.data.real_clips.JFK_TEXT."""
    try:
        return str(jfk_wav_path())
    except RealClipError as error:
        _or_fail("jfk.wav", error)
        raise


@pytest.fixture(scope="session")
def librivox_clips() -> list[tuple[str, str]]:
    """The five LibriVox clips as (wav_path, transcript); transcripts are lowercase without punctuation."""
    try:
        return [(clip.path, clip.text) for clip in _librivox()]
    except RealClipError as error:
        _or_fail("LibriVox clips", error)
        raise


@pytest.fixture(scope="session")
def real_clips() -> list[Clip]:
    """All 12 real clips (jfk, 5 LibriVox, 5 cards, goforward) as Clip(id, path, text, source)."""
    try:
        return all_real_clips()
    except RealClipError as error:
        _or_fail("real clips", error)
        raise
