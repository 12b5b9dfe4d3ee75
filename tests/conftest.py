"""Shared fixtures: real English speech clips with transcripts (see tarq_deploy/data/real_clips.py).

The clips are found offline (Debian's pocketsphinx-testdata) or fetched once into the tarq-deploy cache through
pip's configured indexes; a missing source fails the test with a message saying how to provide it.
"""
from __future__ import annotations

import os

# Before torch starts OpenMP: busy-waiting worker threads make small ops crawl on a shared 2-core machine.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def _no_cuda_device() -> bool:
    """No NVIDIA device node and no CUDA_VISIBLE_DEVICES: read without importing torch (which this must precede)."""
    return not os.path.exists("/dev/nvidia0") or os.environ.get("CUDA_VISIBLE_DEVICES") == ""


# Without a GPU, our Triton W4A16 kernel still runs: Triton's interpreter executes it on CPU tensors
# (tests/test_triton_w4a16.py). It is chosen when a kernel is defined, so it must be set before any import of it.
if _no_cuda_device():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from pathlib import Path

import pytest
from helpers import NAN_TENSOR, calibration_clips, clips_manifest, save_whisper, tiny_random_whisper, write_wav

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
    from tarq_deploy.formats.model_loader import load_whisper

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


# Hypothesis profiles of the reader fuzzing (tests/test_fuzz_readers.py): "fast" in `make test` (derandomized, so a CI
# run is reproducible; a few seconds per reader), HYPOTHESIS_PROFILE=long on demand (thousands of examples per reader,
# a fresh random draw each run). No example database; hypothesis still keeps a small cache in .hypothesis/, which
# git ignores through the .gitignore hypothesis writes there.
def _register_hypothesis_profiles() -> None:
    from datetime import timedelta

    from hypothesis import HealthCheck, settings

    relaxed = [HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much]
    settings.register_profile("fast", max_examples=150, derandomize=True, database=None,
                              deadline=timedelta(seconds=2), suppress_health_check=relaxed)
    settings.register_profile("long", max_examples=5000, database=None, deadline=timedelta(seconds=5),
                              suppress_health_check=relaxed)
    settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "fast"))


_register_hypothesis_profiles()


@pytest.fixture(scope="session")
def tarq_base_q3_k(tmp_path_factory) -> Path:
    """TARQ Q3_K of real Whisper base, calibrated through the CLI on 3 real clips (jfk not among them): one ~60 s
    calibration shared by the tests that run the lattice in whisper.cpp and in CrispASR -- across pytest-xdist
    workers too (made once under a lock in the run's shared temporary folder)."""
    from filelock import FileLock

    from tarq_deploy.cli import main

    root = shared_temp_root(tmp_path_factory) / "tarq_base_q3_k"
    with FileLock(str(root) + ".lock"):
        if not (root / "ck" / "manifest.json").is_file():
            root.mkdir(exist_ok=True)
            manifest = clips_manifest(calibration_clips(), root / "calib.jsonl")
            argv = ["quantize", "--model", "packaged:base", "--method", "tarq", "--type", "q3_k", "--calib",
                    str(manifest), "--n-calib", "3", "--out", str(root / "ck")]
            assert main(argv) == 0, argv
    return root / "ck"


# A tiny random Whisper and what the bad-input and output-safety modules feed it (tests/test_bad_inputs.py,
# test_output_safety.py, test_resume.py, test_atomic_outputs.py, test_checkpoint.py): built once per session (each
# pytest-xdist worker), not once per module. The tests copy what they change.
@pytest.fixture(scope="session")
def models(tmp_path_factory) -> dict[str, Path]:
    """A tiny transformers Whisper directory ("clean") and the same with one NaN weight ("nan", at NAN_TENSOR)."""
    import torch

    root = tmp_path_factory.mktemp("tiny_whisper")
    model, processor = tiny_random_whisper()
    clean = save_whisper(model, processor, root / "clean")
    with torch.no_grad():
        model.get_parameter(NAN_TENSOR)[3, 5] = float("nan")
    nan = save_whisper(model, processor, root / "nan")
    return {"clean": clean, "nan": nan}


@pytest.fixture(scope="session")
def corpus(tmp_path_factory) -> Path:
    """A calibration manifest of two short tone-and-noise WAVs (1 s and 2 s)."""
    from tarq_deploy.data.corpus import Utterance, write_manifest

    root = tmp_path_factory.mktemp("corpus")
    texts = ["the quick brown fox jumps over the lazy dog", "a serendipitous quokka ate the persimmon"]
    utterances = [Utterance(f"u{i}", str(write_wav(root / f"u{i}.wav", 1.0 + i, seed=i)), text)
                  for i, text in enumerate(texts)]
    return write_manifest(utterances, root / "calib.jsonl")


@pytest.fixture(scope="session")
def checkpoint(models, tmp_path_factory) -> Path:
    """The RTN checkpoint of the clean tiny Whisper, made by the CLI."""
    from tarq_deploy import cli

    out = tmp_path_factory.mktemp("ckpt") / "rtn"
    assert cli.main(["quantize", "--model", str(models["clean"]), "--method", "rtn", "--out", str(out)]) == 0
    return out


def shared_temp_root(tmp_path_factory) -> Path:
    """The run's temporary folder that every pytest-xdist worker sees (a worker's own base folder sits in it)."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


# The modules that take minutes, slowest first (measured: 2-core AMD EPYC and Intel Xeon, `make test` with 2 workers):
# run first, so that pytest-xdist (`--dist loadfile --no-loadscope-reorder`, see the Makefile) never ends on one long
# module while the other worker idles. The rest keep their order.
SLOW_MODULES_FIRST = ("test_grid_whisper_cpp_2bit.py", "test_sweep.py", "test_eval_e2e.py", "test_long_form_decode.py",
                      "test_whisper_cpp_types.py", "test_grid_whisper_cpp.py", "test_ggml_source.py",
                      "test_qwen3_asr.py", "test_readme.py", "test_quantize_whisper.py", "test_transcribe_cpp.py",
                      "test_crispasr_whisper.py", "test_whisper_v3_sources.py", "test_transcribe_models.py",
                      "test_gpu_calibration_dryrun.py", "test_voxtral_cli.py")


# What a whole run needs free in the temporary folder at its peak (measured: ~5 GB with the "failed" retention policy
# of pyproject.toml, 2 workers), with margin. A full disk otherwise shows as hundreds of unrelated setup errors.
MIN_FREE_TEMP_GIB = 10


def pytest_sessionstart(session) -> None:
    if hasattr(session.config, "workerinput"):
        return  # the controller checked once for every pytest-xdist worker
    import shutil
    import tempfile

    folder = os.environ.get("PYTEST_DEBUG_TEMPROOT") or tempfile.gettempdir()
    free_gib = shutil.disk_usage(folder).free / 2**30
    if free_gib < MIN_FREE_TEMP_GIB:
        pytest.exit(f"{folder}: {free_gib:.1f} GiB free, the suite needs {MIN_FREE_TEMP_GIB} GiB for its model files "
                    "(free space there, or point TMPDIR at a larger disk)", returncode=2)


def pytest_collection_modifyitems(config, items) -> None:
    rank = {name: i for i, name in enumerate(SLOW_MODULES_FIRST)}
    order = {id(item): i for i, item in enumerate(items)}
    items.sort(key=lambda item: (rank.get(item.path.name, len(rank)), order[id(item)]))

