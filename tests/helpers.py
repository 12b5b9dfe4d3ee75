"""What several test modules share, defined once: the in-process CLI run, the options a quantize would build, and
the fixtures' small builders. Test modules import from here, never from one another; the fixtures they share are in
conftest.py.

conftest.py imports this module before any test module, so what it imports at the top stays light (no torch, no model
code): the rest is imported where it is used."""

from __future__ import annotations

import itertools
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import wave
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator, NamedTuple

import numpy as np
import pytest
from hypothesis import event
from hypothesis import strategies as st

from tarq_deploy import cli

if TYPE_CHECKING:
    import torch

    from tarq_deploy.calibration.options import QuantizeOptions
    from tarq_deploy.checkpoint import LatticeCheckpoint
    from tarq_deploy.quant.lattice import LatticeSpec
    from tarq_deploy.quant.stats import LayerStats


def quantize_options_for(model: str = "packaged:base", **given: Any) -> QuantizeOptions:
    """The options `tarq-deploy quantize --model MODEL ...` builds (the schema's own rules and defaults), without
    loading the model; a method that calibrates is given a placeholder --calib unless one is named."""
    from tarq_deploy.calibration.options import QuantizeArguments, QuantizeOptions
    from tarq_deploy.model_source import resolve_source

    given.setdefault("calib", None if given.get("method") in ("rtn", "ggml") else "calib.jsonl")
    return QuantizeOptions.build(QuantizeArguments(model=model, **given), resolve_source(model), log=lambda _: None)


# ------------------------------------------------------------------------------------------------ the in-process CLI
class CliRun(NamedTuple):
    """One in-process `tarq-deploy` run: its exit status, stdout and the raw stderr (progress bars and logs included);
    ``message`` is what the CLI itself reported there (see ``reported``)."""

    status: int
    out: str
    err: str

    @property
    def message(self) -> str:
        return reported(self.err)


def reported(err: str) -> str:
    """The lines of a stderr that name tarq-deploy (its error and bug messages), each from "tarq-deploy" on. Split on
    \\r as well as \\n: a progress bar cut short leaves no newline before the message."""
    lines = [line[line.index("tarq-deploy"):] for line in err.replace("\r", "\n").splitlines() if "tarq-deploy" in line]
    return "\n".join(lines)


def run_cli(capsys, *argv) -> CliRun:
    """``tarq-deploy ARGV`` in this process (each argument given as str), what it printed captured by ``capsys``."""
    capsys.readouterr()
    status = cli.main([str(a) for a in argv])
    captured = capsys.readouterr()
    return CliRun(status, captured.out, captured.err)


def assert_user_error(status: int, err: str, *fragments: str) -> None:
    """Exit status 2, no traceback, and one line reported on ``err`` (a raw stderr) that holds every fragment."""
    message = reported(err)
    assert status == 2, err
    assert len(message.splitlines()) == 1, err
    assert "Traceback" not in err, err
    for fragment in fragments:
        assert fragment in message, (fragment, message)


# ------------------------------------------------------------------- bad inputs: a tiny random Whisper, its inputs
NAN_TENSOR = "model.encoder.layers.0.fc1.weight"  # the weight the "nan" model of the `models` fixture spoils


def tiny_random_whisper():
    """(model, processor): a random 1+1-layer Whisper (d_model 32) with tiny.en's real tokenizer, feature extractor
    and generation config, so every part of the pipeline runs as on a real model."""
    import torch
    from transformers import WhisperConfig, WhisperForConditionalGeneration

    from tarq_deploy.models import ct2
    from tarq_deploy.models.packaged import resolve_packaged

    real = resolve_packaged("packaged:tiny.en")
    processor = ct2.build_processor(ct2.build_tokenizer(real, 51864), 80)
    token_ids = ct2._added_token_ids(ct2._read_json(real / "tokenizer.json"), real / "tokenizer.json")
    torch.manual_seed(0)
    config = WhisperConfig(vocab_size=51864, d_model=32, encoder_layers=1, decoder_layers=1,
                           encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=128,
                           decoder_ffn_dim=128, pad_token_id=50256, bos_token_id=50257, eos_token_id=50256,
                           decoder_start_token_id=50257)
    model = WhisperForConditionalGeneration(config).eval()
    model.generation_config = ct2.build_generation_config(config, token_ids, {v: k for k, v in token_ids.items()},
                                                          ct2._read_json(real / "config.json"))
    return model, processor


def save_whisper(model, processor, directory: Path) -> Path:
    """A transformers Whisper folder: weights, processor files and generation config."""
    model.save_pretrained(directory)
    processor.save_pretrained(directory)
    model.generation_config.save_pretrained(directory)
    return directory


def write_wav(path: Path, seconds: float = 1.0, seed: int = 0) -> Path:
    """A 16 kHz mono 16-bit WAV: a 220 Hz tone with a little noise."""
    rng = np.random.default_rng(seed)
    t = np.arange(int(16_000 * seconds)) / 16_000
    audio = 0.3 * np.sin(2 * np.pi * 220 * t) + 0.05 * rng.standard_normal(t.size)
    with wave.open(str(path), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(16_000)
        w.writeframes((audio * 32767).astype("<i2").tobytes())
    return path


def quantize_args(model: Path | str, out: Path, *extra: str, calib: Path | None = None) -> list[str]:
    args = ["quantize", "--model", str(model), "--out", str(out), "--encoder-tagging", "none"]
    return args + (["--calib", str(calib)] if calib else []) + list(extra)


def nothing_left(out: Path) -> None:
    """No --out, no .partial work directory, no log and no hidden temporary of it."""
    for path in (out, out.with_name(out.name + ".partial"), out.with_name(out.name + ".log.json")):
        assert not path.exists(), path
    assert not [p for p in out.parent.iterdir() if p.name.startswith(f".{out.name}")], list(out.parent.iterdir())


def forbid_loading(monkeypatch) -> None:
    """Fail the test if the model is loaded or calibration starts: these errors must come first."""
    import tarq_deploy.formats.backbones as registry

    def forbidden(*args, **kwargs):
        raise AssertionError("the model was loaded before the bad input was refused")

    monkeypatch.setattr(registry, "load_backbone", forbidden)


# ---------------------------------------------------------------------------------------- an interrupted calibration
class CalibrationInterrupted(Exception):
    """What ``calibration_interrupted_at`` raises in place of a block's calibration (a Ctrl-C, a killed run)."""


@contextmanager
def calibration_interrupted_at(call: int) -> Iterator[None]:
    """The calibration driver stopped at its ``call``-th block (1-based), before calibrating it; the body must end
    in that interruption. Block calibration is restored on leaving, so the next run resumes from the work directory."""
    from tarq_deploy.calibration import driver

    original = driver.SequentialCalibrator._calibrate_block
    calls = 0

    def interrupted(self, *args, **kwargs):
        nonlocal calls
        calls += 1
        if calls == call:
            raise CalibrationInterrupted
        return original(self, *args, **kwargs)

    with pytest.MonkeyPatch.context() as patch, pytest.raises(CalibrationInterrupted):
        patch.setattr(driver.SequentialCalibrator, "_calibrate_block", interrupted)
        yield


# --------------------------------------------------------------------------------------- real clips, whisper.cpp
def calibration_clips() -> list:
    """The first 3 real clips other than jfk (jfk is the held-out check), as real_clips.Clip."""
    from tarq_deploy.data.real_clips import all_real_clips

    return [c for c in all_real_clips() if c.id != "jfk"][:3]


def in_sample_2bit_clips() -> list:
    """jfk and the calibration clips: what tests/test_grid_whisper_cpp_2bit.py calibrates on (it transcribes jfk)."""
    from tarq_deploy.data.real_clips import jfk_clip

    return [jfk_clip()] + calibration_clips()


def clips_manifest(clips: list, path: Path) -> Path:
    """A JSONL manifest of real clips (real_clips.Clip), written to ``path``."""
    from tarq_deploy.data.corpus import Utterance, write_manifest

    return write_manifest([Utterance(c.id, str(c.path), c.text) for c in clips], path)


N_THREADS = 2
RUNTIME_TIMEOUT_S = 180

TRANSCRIBE = """
import json, sys
from pywhispercpp.model import Model
model = Model(sys.argv[1], redirect_whispercpp_logs_to=None, n_threads=int(sys.argv[2]), language="en",
              temperature=0.0, temperature_inc=0.0, no_timestamps=True, print_progress=False, print_realtime=False)
for wav in sys.argv[3:]:
    print(json.dumps(" ".join(s.text.strip() for s in model.transcribe(wav))))
"""


def transcribe_whisper_cpp(model_file: Path, wav: str) -> str:
    """Greedy English transcription by whisper.cpp (pywhispercpp) in a fresh process."""
    return transcribe_whisper_cpp_clips(model_file, [wav])[0]


def transcribe_whisper_cpp_clips(model_file: Path, wavs: list[str]) -> list[str]:
    """Greedy English transcriptions of several clips, in their order, by one whisper.cpp (pywhispercpp) process."""
    from tarq_deploy.formats.ggml_file import read_whisper_cpp

    read_whisper_cpp(model_file)  # whisper.cpp must never see a file our parser rejects
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE"}
    run = subprocess.run([sys.executable, "-c", TRANSCRIBE, str(model_file.resolve()), str(N_THREADS), *wavs],
                         capture_output=True, text=True, timeout=RUNTIME_TIMEOUT_S + 60 * (len(wavs) - 1), env=env)
    assert run.returncode == 0, f"pywhispercpp exited with {run.returncode} on {model_file}:\n{run.stderr[-2000:]}"
    return [json.loads(line) for line in run.stdout.strip().splitlines()[-len(wavs):]]


def words(text: str) -> str:
    return " ".join(re.sub(r"[^a-z' ]", " ", text.lower()).split())


def lattice_checkpoint(bundle, spec: LatticeSpec) -> LatticeCheckpoint:
    """The lead's Whisper checkpoint convention, with plain RTN codes: every Linear (attention, MLP, proj_out) on the
    lattice, the token embedding an alias of proj_out, everything else untouched, the model files alongside."""
    import torch

    from tarq_deploy.checkpoint import LatticeCheckpoint
    from tarq_deploy.quant.lattice_fit import quantize_rtn

    model, processor, generation_config = bundle
    linear = {f"{name}.weight" for name, module in model.named_modules() if isinstance(module, torch.nn.Linear)}
    state = model.state_dict()
    quantized = {name: quantize_rtn(state[name], spec) for name in sorted(linear)}
    aliases = {"model.decoder.embed_tokens.weight": "proj_out.weight"}
    tensors = {k: v.clone() for k, v in state.items() if k not in quantized and k not in aliases}
    return LatticeCheckpoint(spec, quantized, tensors, aliases, {"method": {"name": "rtn"}}, _model_files(bundle))


def _model_files(bundle) -> dict[str, bytes]:
    model, processor, generation_config = bundle
    with tempfile.TemporaryDirectory() as tmp:
        model.config.save_pretrained(tmp)
        processor.save_pretrained(tmp)
        generation_config.save_pretrained(tmp)
        return {p.name: p.read_bytes() for p in Path(tmp).iterdir() if p.is_file()}


def exports_exactly_and_transcribes(bundle, type_name: str, work: Path, jfk_wav: str) -> str:
    """A lattice checkpoint of ``type_name`` exported to whisper.cpp in its own type, verified exact, and jfk's text
    in whisper.cpp."""
    from tarq_deploy.checkpoint import save_checkpoint
    from tarq_deploy.formats.ggml_file import read_whisper_cpp
    from tarq_deploy.formats.whisper_cpp import export_whisper_cpp, verify
    from tarq_deploy.quant.ggml_types import spec_for_type, type_by_name

    ckpt = save_checkpoint(lattice_checkpoint(bundle, spec_for_type(type_by_name(type_name))), work / type_name)
    out = export_whisper_cpp(ckpt, work / f"{type_name}.bin")  # the checkpoint's own type by default
    model = read_whisper_cpp(out)
    assert model.tensors["encoder.blocks.0.mlp.0.weight"].ggml_type == type_by_name(type_name)
    assert model.tensors["decoder.token_embedding.weight"].ggml_type == type_by_name(type_name)
    assert {name: d for name, d in verify(out, ckpt).items() if d != 0.0} == {}
    return transcribe_whisper_cpp(out, jfk_wav)


GRID_CALIBRATION_TIMEOUT_S = 1200


def quantize_tarq_of_base(type_name: str, calib: Path, n_calib: int, ckpt: Path) -> None:
    """``tarq-deploy quantize --method tarq`` of real Whisper base onto ``type_name``, in its own process on torch's
    default threads (the grid modules run their own work on one)."""
    run = subprocess.run([sys.executable, "-m", "tarq_deploy.cli", "quantize", "--model", "packaged:base", "--method",
                          "tarq", "--type", type_name, "--calib", str(calib), "--n-calib", str(n_calib), "--out",
                          str(ckpt)], capture_output=True, text=True, timeout=GRID_CALIBRATION_TIMEOUT_S)
    assert run.returncode == 0, run.stderr[-2000:]


def clips_capped_wer(clips: list, texts: list[str]) -> float:
    """The eval command's capped WER over ``clips``: word errors under Whisper's normaliser, each clip's capped at its
    word count (a loop on a two-word clip costs 2, not 100), per reference word."""
    from tarq_deploy.evaluate.wer import metric_counts, ratio, score_utterance

    return ratio(*metric_counts([score_utterance(c.id, c.text, text) for c, text in zip(clips, texts)])["capped_wer"])


def check_tarq_export(capsys, ckpt: Path, out: Path, type_name: str) -> None:
    """A TARQ checkpoint of ``type_name`` (rareBAL ran on its lattice) exports to whisper.cpp and verifies."""
    manifest = json.loads((ckpt / "manifest.json").read_text())
    assert manifest["lattice"]["ggml_type"] == type_name and manifest["method"]["name"] == "tarq"
    assert any(layer.get("lam") for layer in manifest["layers"])  # rareBAL ran, on this type's lattice
    assert run_cli(capsys, "export", "--target", "whisper.cpp", ckpt, "-o", out, "--quiet").status == 0
    assert run_cli(capsys, "verify", out, "--against", ckpt).status == 0


def tiny_gguf(path: Path, arch: str) -> Path:
    """A GGUF container with an architecture key and nothing else: enough to say which runtime claims it."""
    import gguf

    writer = gguf.GGUFWriter(str(path), arch)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


# ------------------------------------------------------------------------------- ggml types: blocks and metrics
def float_bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)  # -0.0 differs from 0.0 here


def random_blocks(t, rows: int, supers: int, seed: int) -> np.ndarray:
    """Every byte random except the fp16 fields (finite, of both signs and many magnitudes): every such block is a
    valid block of the low-bit and grid types."""
    from gguf.constants import GGML_QUANT_SIZES

    from tarq_deploy.quant.ggml_types import FP16_FIELDS

    rng = np.random.default_rng(seed)
    size = GGML_QUANT_SIZES[t][1]
    raw = rng.integers(0, 256, (rows, supers, size), dtype=np.uint8)
    for at in FP16_FIELDS[t]:
        d = rng.standard_normal((rows, supers)) * rng.choice([1e-6, 1e-3, 1.0, 100.0], (rows, supers))
        d[0, 0] = 0.0
        raw[:, :, at:at + 2] = d.astype(np.float16).view(np.uint8).reshape(rows, supers, 2)
    return raw.reshape(rows, -1)


def random_weights(seed: int, m: int = 32, n: int = 512) -> torch.Tensor:
    """An m x n weight matrix with every 37th column six times larger (outlier columns)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    w = torch.randn(m, n, generator=g) * 0.04
    w[:, ::37] *= 6
    return w


def random_metric(seed: int, n: int = 512) -> torch.Tensor:
    """X^T X of 4n correlated activations of uneven scales."""
    import torch

    g = torch.Generator().manual_seed(seed)
    x = torch.randn(4 * n, n, generator=g) * torch.linspace(0.2, 2.0, n) + 0.3 * torch.randn(4 * n, 1, generator=g)
    return x.T @ x


def layer_stats(H: torch.Tensor, tail: torch.Tensor) -> LayerStats:
    """One Linear's statistics: common and tail second moments, no paired residual (H_delta = 0)."""
    from tarq_deploy.quant.stats import LayerStats

    stats = LayerStats(H.shape[0])
    stats.H_common, stats.H_tail, stats.H_delta, stats.H_delta_tail = H, tail, 0.0 * H, 0.0 * H
    stats.n_common, stats.n_tail, stats.n_delta = 2000, 100, 2100
    return stats


def metric_loss(W: torch.Tensor, q, H: torch.Tensor) -> float:
    """tr((W - Q) H (W - Q)^T) in float64."""
    import torch

    d = (W - q.dequantize()).double()
    return float(torch.einsum("ij,jk,ik->", d, H.double(), d))


# ------------------------------------------------------------------------------------------ sweeps, planned only
def sweep_plan(path: Path):
    """(sweep, cells, steps) of a sweep file, planned over placeholder hashes (model "base", code "code")."""
    from tarq_deploy.sweep.plan import load_sweep, plan_cells

    sweep = load_sweep(path)
    corpora = {p: f"hash-{p.name}" for p in [*(c.manifest for c in sweep.corpora), *sweep.evaluation.values()]}
    cells, steps = plan_cells(sweep, {"base": "model-hash"}, corpora, "code")
    return sweep, cells, steps


# ------------------------------------------------------------------------------- fuzzing a reader (hypothesis)
HANG_GUARD_S = 30  # far beyond any example (milliseconds); only a reader stuck in a loop reaches it
# values a field edit writes: the edges of every integer width, the WAV streaming placeholders, small counts
INTERESTING = (0, 1, 2, 3, 4, 7, 8, 16, 31, 32, 255, 256, 0x7FFF, 0x8000, 0xFFFF, 0x7FFFF000, 0x7FFFFFFF,
               0x80000000, 0xFFFFFFFF, 1 << 32, (1 << 63) - 1, 1 << 63, (1 << 64) - 1)


class ReaderHang(Exception):
    """A reader ran past HANG_GUARD_S."""


@contextmanager
def hang_guard(seconds: float = HANG_GUARD_S) -> Iterator[None]:
    """SIGALRM interrupts a reader stuck in a Python loop (the deadline only judges examples that return)."""
    def interrupt(signum, frame):
        raise ReaderHang(f"no answer after {seconds} s")

    previous = signal.signal(signal.SIGALRM, interrupt)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def parses_or_refuses(read: Callable[[], object], *named: type[BaseException]) -> None:
    """``read()`` returns, or raises one of ``named`` -- an error the CLI reports as the user's (exit 2), not as our
    bug. Anything else propagates and fails the example."""
    with hang_guard():
        try:
            read()
        except named as error:
            assert cli.user_error_message(error) is not None, f"{type(error).__name__} would print a traceback"
            event(f"{type(error).__name__}: {_problem_kind(error)}")
        else:
            event("parsed")


def _problem_kind(error: BaseException) -> str:
    """The first words of an error's problem, without the file name: what --hypothesis-show-statistics tallies."""
    problem = str(error).rsplit(": ", 1)[-1] if ": " in str(error) else str(error)
    return " ".join(problem.split()[:3])


def fresh_path(folder: Path, suffix: str) -> Path:
    """A new name for each example's file (or checkpoint folder), the previous example's removed. New, not reused:
    the readers memory-map what they read, and overwriting a file that an earlier example's result still maps would
    kill the process with SIGBUS when that map is next touched (pytest shows a failing example's locals). Removing is
    safe: a mapped file that is unlinked stays readable."""
    previous = _LATEST_PATHS.pop((folder, suffix), None)
    if previous is not None:
        shutil.rmtree(previous) if previous.is_dir() else previous.unlink(missing_ok=True)
    path = _LATEST_PATHS[folder, suffix] = folder / f"fuzz-{next(_EXAMPLE_NUMBERS)}{suffix}"
    return path


_EXAMPLE_NUMBERS = itertools.count()
_LATEST_PATHS: dict[tuple[Path, str], Path] = {}


@dataclass(frozen=True)
class Seed:
    """A valid file and the offsets where its fields begin (sizes, counts, types, names: field edits and most bit flips
    land there; a field edit writes a whole integer at one)."""

    data: bytes = field(repr=False)
    fields: tuple[int, ...] = field(repr=False)

    def _repr_pretty_(self, printer, cycle: bool) -> None:  # how hypothesis shows a failing example's draws
        printer.text(f"Seed({len(self.data)} bytes)")


@st.composite
def mutated(draw: st.DrawFn, seed: Seed) -> bytes:
    """One to three edits of ``seed``: a truncation, a bit flip, an integer field overwritten, a span deleted or
    inserted (shifting everything after it)."""
    data = bytearray(seed.data)
    for _ in range(draw(st.integers(1, 3))):
        if not data:
            break
        edit = draw(st.sampled_from(("truncate", "flip", "field", "field", "delete", "insert")))
        field_at = draw(st.sampled_from(seed.fields)) + draw(st.sampled_from((0, 0, 0, 1, 2, 3, 4, 7)))
        at = (field_at if draw(st.integers(0, 3)) else draw(st.integers(0, len(data) - 1))) % len(data)
        if edit == "truncate":
            del data[draw(st.integers(0, len(data) - 1)):]
        elif edit == "flip":
            data[at] ^= 1 << draw(st.integers(0, 7))
        elif edit == "field":
            width = draw(st.sampled_from((1, 2, 4, 8)))
            value = draw(st.sampled_from(INTERESTING) | st.integers(0, (1 << 64) - 1)) % (1 << (8 * width))
            data[at:at + width] = value.to_bytes(width, "little")[: len(data) - at]
        elif edit == "delete":
            del data[at:at + draw(st.integers(1, 16))]
        else:
            data[at:at] = draw(st.binary(min_size=1, max_size=16))
    return bytes(data)


# Any JSON value a hostile manifest line may hold in a field, for the manifest readers' fuzz tests.
JSON_VALUES = st.none() | st.booleans() | st.integers(-(1 << 40), 1 << 40) | st.floats() | st.text(max_size=12) | \
    st.lists(st.integers(), max_size=2) | st.dictionaries(st.text(max_size=4), st.integers(), max_size=2)


def assert_refused_for_a_model_that_is_not_whisper(capsys, tmp_path: Path, corpus: Path, option: list[str],
                                                   *expected: str) -> None:
    """`quantize` with a Whisper-only ``option`` on a (config-only) Voxtral folder: exit 2 naming ``expected``, and
    nothing written beside the folder. The caller has changed into ``tmp_path``."""
    source = tmp_path / "voxtral"
    source.mkdir()
    (source / "config.json").write_text(json.dumps({"model_type": "voxtral"}))
    status, _, err = run_cli(capsys, "quantize", "--model", str(source), "--method", "gptq", "--calib", str(corpus),
                             *option, "--out", "o")
    assert_user_error(status, err, *expected)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["voxtral"]
