"""Every bad input a clear error (issue #14): exit status 2, one line on stderr naming the file or option and the
problem, and nothing left behind. Tiny random Whisper models (d_model 32, one layer each side) keep every case to
seconds."""

from __future__ import annotations

import errno
import json
import os
import shutil
import struct
import subprocess
import sys
import wave
from pathlib import Path

import numpy as np
import pytest
import torch

from tarq_deploy import cli
from tarq_deploy.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from tarq_deploy.data.corpus import AudioDecodeError, Utterance, decode_wav, write_manifest
from tarq_deploy.errors import CalibrationDataError, NonFiniteError

REPO = Path(__file__).resolve().parents[1]
NAN_TENSOR = "model.encoder.layers.0.fc1.weight"


# ----------------------------------------------------------------------------------------------------- fixtures
pytestmark = pytest.mark.usefixtures("one_torch_thread")  # conftest.py: small torch ops, one thread


def _tiny_whisper():
    """A random 1+1-layer Whisper (d_model 32) with tiny.en's real tokenizer, feature extractor and generation
    config, so every part of the pipeline runs as on a real model."""
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


def _save(model, processor, directory: Path) -> Path:
    model.save_pretrained(directory)
    processor.save_pretrained(directory)
    model.generation_config.save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    """A tiny transformers Whisper directory, the same with one NaN weight, and a checkpoint of the first."""
    root = tmp_path_factory.mktemp("tiny_whisper")
    model, processor = _tiny_whisper()
    clean = _save(model, processor, root / "clean")
    with torch.no_grad():
        model.get_parameter(NAN_TENSOR)[3, 5] = float("nan")
    nan = _save(model, processor, root / "nan")
    return {"clean": clean, "nan": nan}


def write_wav(path: Path, seconds: float = 1.0, seed: int = 0) -> Path:
    rng = np.random.default_rng(seed)
    t = np.arange(int(16_000 * seconds)) / 16_000
    audio = 0.3 * np.sin(2 * np.pi * 220 * t) + 0.05 * rng.standard_normal(t.size)
    with wave.open(str(path), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(16_000)
        w.writeframes((audio * 32767).astype("<i2").tobytes())
    return path


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("corpus")
    texts = ["the quick brown fox jumps over the lazy dog", "a serendipitous quokka ate the persimmon"]
    utterances = [Utterance(f"u{i}", str(write_wav(root / f"u{i}.wav", 1.0 + i, seed=i)), text)
                  for i, text in enumerate(texts)]
    return write_manifest(utterances, root / "calib.jsonl")


@pytest.fixture(scope="module")
def checkpoint(models, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("ckpt") / "rtn"
    assert cli.main(["quantize", "--model", str(models["clean"]), "--method", "rtn", "--out", str(out)]) == 0
    return out


def run_cli(capsys, *argv: str) -> tuple[int, str]:
    """In-process CLI run: (exit status, stderr lines that are not progress bars)."""
    capsys.readouterr()
    status = cli.main([str(a) for a in argv])
    err = capsys.readouterr().err
    lines = [line[line.index("tarq-deploy"):] for line in err.replace("\r", "\n").splitlines()
             if "tarq-deploy" in line]  # a progress bar cut short leaves no newline before the message
    return status, "\n".join(lines)


def assert_user_error(status: int, err: str, *fragments: str) -> None:
    assert status == 2, err
    assert len(err.splitlines()) == 1, err
    assert "Traceback" not in err
    for fragment in fragments:
        assert fragment in err, (fragment, err)


def quantize_args(model: Path | str, out: Path, *extra: str, calib: Path | None = None) -> list[str]:
    args = ["quantize", "--model", str(model), "--out", str(out), "--encoder-tagging", "none"]
    return args + (["--calib", str(calib)] if calib else []) + list(extra)


def nothing_left(out: Path) -> None:
    for path in (out, out.with_name(out.name + ".partial"), out.with_name(out.name + ".log.json")):
        assert not path.exists(), path
    assert not [p for p in out.parent.iterdir() if p.name.startswith(f".{out.name}")], list(out.parent.iterdir())


# --------------------------------------------------------------------------------------- NaN / Inf weights and stats
@pytest.mark.parametrize("method", ["gptq", "tarq"])
def test_nan_weight_is_refused_with_its_name(models, corpus, tmp_path, capsys, method):
    out = tmp_path / "ckpt"
    status, err = run_cli(capsys, *quantize_args(models["nan"], out, "--method", method, calib=corpus))
    assert_user_error(status, err, NAN_TENSOR, "NaN", "--model")
    nothing_left(out)


def test_nan_weight_rtn_is_refused_with_its_name(models, tmp_path, capsys):
    out = tmp_path / "ckpt"
    status, err = run_cli(capsys, *quantize_args(models["nan"], out, "--method", "rtn"))
    assert_user_error(status, err, NAN_TENSOR, "NaN")
    nothing_left(out)


def test_solver_refuses_non_finite_weights_and_statistics():
    from tarq_deploy.quant.lattice import LatticeSpec
    from tarq_deploy.quant.stats import LayerStats
    from tarq_deploy.quant.calibrate import solve_layer
    from tarq_deploy.quant.tarq import TarqConfig

    W = torch.randn(8, 32)
    stats = LayerStats(32)
    stats.add(torch.randn(40, 32), torch.zeros(40, dtype=torch.bool))
    bad = W.clone()
    bad[1, 2] = float("inf")
    for method in ("rtn", "gptq", "tarq"):
        with pytest.raises(NonFiniteError, match=r"layer\.x\.weight: 0 NaN and 1 Inf"):
            solve_layer("layer.x", bad, stats, LatticeSpec(4, 32), TarqConfig(method=method))
    stats.H_common[0, 0] = float("nan")
    with pytest.raises(NonFiniteError, match="layer.x: calibration statistic H_common"):
        solve_layer("layer.x", W, stats, LatticeSpec(4, 32), TarqConfig(method="gptq"))


def test_rtn_library_path_names_the_tensor(models):
    from tarq_deploy.models.registry import load_backbone
    from tarq_deploy.quant.pipeline import QuantizeOptions, quantize_backbone

    backbone = load_backbone(str(models["nan"]))
    with pytest.raises(NonFiniteError, match=NAN_TENSOR):
        quantize_backbone(backbone, [], QuantizeOptions(method="rtn"), "nan", log=lambda _: None)


@pytest.mark.parametrize("kind", ["nan", "inf", "zero", "rank1"])
def test_cholesky_retry_terminates_on_every_input(kind):
    from tarq_deploy.quant.gptq import _cholesky

    n = 16
    v = torch.arange(1, n + 1, dtype=torch.float64)
    A = {"nan": torch.full((n, n), float("nan"), dtype=torch.float64),
         "inf": torch.eye(n, dtype=torch.float64) * float("inf"),
         "zero": torch.zeros(n, n, dtype=torch.float64),
         "rank1": torch.outer(v, v)}[kind]
    if kind in ("nan", "inf"):
        with pytest.raises(torch.linalg.LinAlgError, match="NaN or Inf"):
            _cholesky(A)
        return
    L = _cholesky(A)
    assert torch.isfinite(L).all()
    jitter = (L @ L.T - A).diagonal()
    assert torch.allclose(L @ L.T - A, torch.diag(jitter)) and (jitter > 0).all()


# ------------------------------------------------------------------------------------------ calibration from nothing
def test_empty_manifest_is_refused_before_loading(models, tmp_path, capsys, monkeypatch):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    _forbid_loading(monkeypatch)
    out = tmp_path / "ckpt"
    status, err = run_cli(capsys, *quantize_args(models["clean"], out, "--method", "gptq", calib=empty))
    assert_user_error(status, err, str(empty), "no utterances")
    nothing_left(out)


def test_n_calib_zero_is_refused(models, corpus, tmp_path, capsys, monkeypatch):
    _forbid_loading(monkeypatch)
    out = tmp_path / "ckpt"
    status, err = run_cli(capsys, *quantize_args(models["clean"], out, "--n-calib", "0", calib=corpus))
    assert_user_error(status, err, "--n-calib 0")
    nothing_left(out)


@pytest.mark.parametrize("extra, message", [
    (["--target", "crispasr", "--type", "q4_1"], "--type q4_1's lattice is affine"),
    (["--target", "qwen3-asr.cpp", "--tensor-type", "fc1=q8_0"], "not to a --tensor-type mix"),
    (["--method", "imatrix"], "ggml's own quantizer"),
])
def test_a_bfloat16_scale_grid_is_refused_where_it_cannot_hold(models, corpus, tmp_path, capsys, monkeypatch,
                                                                extra, message):
    _forbid_loading(monkeypatch)
    out = tmp_path / "ckpt"
    status, err = run_cli(capsys, *quantize_args(models["clean"], out, "--scale-dtype", "bfloat16", *extra,
                                                 calib=corpus))
    assert_user_error(status, err, message)
    nothing_left(out)


def test_a_layer_no_position_reached_is_an_error_and_no_tail_keeps_its_fallback():
    from tarq_deploy.quant.lattice import LatticeSpec
    from tarq_deploy.quant.stats import LayerStats
    from tarq_deploy.quant.calibrate import solve_layer
    from tarq_deploy.quant.tarq import TarqConfig

    W = torch.randn(8, 32)
    with pytest.raises(CalibrationDataError, match="layer.y: no calibration positions"):
        solve_layer("layer.y", W, LayerStats(32), LatticeSpec(4, 32), TarqConfig(method="gptq"))
    common_only = LayerStats(32)
    common_only.add(torch.randn(50, 32), torch.zeros(50, dtype=torch.bool))
    _, record = solve_layer("layer.y", W, common_only, LatticeSpec(4, 32), TarqConfig(method="rarebal"))
    assert record.fallback and "no tail positions" in record.fallback


# ------------------------------------------------------------------------------------------------------------ audio
def test_truncated_wav_is_refused_with_its_file(models, corpus, tmp_path, capsys, monkeypatch):
    wav = write_wav(tmp_path / "cut.wav", 2.0)
    data = wav.read_bytes()
    wav.write_bytes(data[: len(data) // 2])  # what an interrupted copy leaves: the header still says 2 s
    with pytest.raises(AudioDecodeError, match="truncated"):
        decode_wav(wav.read_bytes())
    manifest = write_manifest([Utterance("cut", str(wav), "hello there general kenobi")], tmp_path / "cut.jsonl")
    out = tmp_path / "ckpt"
    status, err = run_cli(capsys, *quantize_args(models["clean"], out, "--method", "gptq", calib=manifest))
    assert_user_error(status, err, str(wav), "truncated")
    nothing_left(out)


def test_streamed_wav_with_placeholder_size_still_decodes(tmp_path):
    data = bytearray(write_wav(tmp_path / "s.wav", 0.5).read_bytes())
    data_at = data.index(b"data")
    for placeholder in (0, 0xFFFFFFFF):
        struct.pack_into("<I", data, data_at + 4, placeholder)
        samples, rate = decode_wav(bytes(data))
        assert rate == 16_000 and samples.shape == (8000, 1)


# ---------------------------------------------------------------------------------- inputs and options, up front
def _forbid_loading(monkeypatch) -> None:
    """Fail the test if the model is loaded or calibration starts: these errors must come first."""
    import tarq_deploy.models.registry as registry

    def forbidden(*args, **kwargs):
        raise AssertionError("the model was loaded before the bad input was refused")

    monkeypatch.setattr(registry, "load_backbone", forbidden)


def test_non_utf8_manifest(models, tmp_path, capsys, monkeypatch):
    manifest = tmp_path / "latin1.jsonl"
    manifest.write_bytes('{"id": "a", "audio": "a.wav", "text": "caf\u00e9"}\n'.encode("latin-1"))
    _forbid_loading(monkeypatch)
    out = tmp_path / "ckpt"
    status, err = run_cli(capsys, *quantize_args(models["clean"], out, calib=manifest))
    assert_user_error(status, err, f"{manifest}:1", "UTF-8")
    nothing_left(out)


@pytest.mark.parametrize("model, fragment", [("packaged:tiny.nl", "unknown packaged model"),
                                             ("./no/such/model", "no such file or directory")])
def test_unknown_model_names(tmp_path, capsys, monkeypatch, model, fragment):
    _forbid_loading(monkeypatch)
    out = tmp_path / "ckpt"
    status, err = run_cli(capsys, *quantize_args(model, out, "--method", "rtn"))
    assert_user_error(status, err, "--model", fragment)
    nothing_left(out)


def test_unsupported_model_type(tmp_path, capsys, monkeypatch):
    bert = tmp_path / "bert"
    bert.mkdir()
    (bert / "config.json").write_text(json.dumps({"model_type": "bert"}))
    _forbid_loading(monkeypatch)
    out = tmp_path / "ckpt"
    status, err = run_cli(capsys, *quantize_args(bert, out, "--method", "rtn"))
    assert_user_error(status, err, str(bert), "'bert' is not supported")
    nothing_left(out)


@pytest.mark.parametrize("option, value", [("--group-size", "48"), ("--bits", "9"), ("--bits", "1"),
                                           ("--cost-ratio", "0")])
def test_bad_lattice_options(models, corpus, tmp_path, capsys, monkeypatch, option, value):
    _forbid_loading(monkeypatch)
    out = tmp_path / "ckpt"
    status, err = run_cli(capsys, *quantize_args(models["clean"], out, option, value, calib=corpus))
    assert_user_error(status, err, f"{option} {value}")
    nothing_left(out)


@pytest.mark.parametrize("value", ["8XB", "-1GB", "lots", "nan"])
def test_bad_max_memory_is_refused_by_name(models, corpus, tmp_path, capsys, monkeypatch, value):
    _forbid_loading(monkeypatch)
    out = tmp_path / "ckpt"
    capsys.readouterr()
    with pytest.raises(SystemExit) as stopped:  # argparse refuses it (cli.Parser: one line, exit 2)
        cli.main([str(a) for a in quantize_args(models["clean"], out, f"--max-memory={value}", calib=corpus)])
    assert_user_error(stopped.value.code, capsys.readouterr().err.strip(), "--max-memory", repr(value))
    nothing_left(out)


def test_group_size_that_does_not_divide_a_layer(models, corpus, tmp_path, capsys):
    out = tmp_path / "ckpt"  # d_model 32: a 64-column group fits no attention projection
    status, err = run_cli(capsys, *quantize_args(models["clean"], out, "--group-size", "64", calib=corpus))
    assert_user_error(status, err, "--group-size 64", "32 input columns")
    nothing_left(out)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA path")
@pytest.mark.parametrize("device", ["cuda", "cuda:1", "tpu"])
def test_device_not_available(models, corpus, tmp_path, capsys, monkeypatch, device):
    _forbid_loading(monkeypatch)
    out = tmp_path / "ckpt"
    status, err = run_cli(capsys, *quantize_args(models["clean"], out, "--device", device, calib=corpus))
    assert_user_error(status, err, f"--device {device}")
    nothing_left(out)


# -------------------------------------------------------------------------------------------------------- --out
def test_out_that_is_someone_elses_directory_is_refused_before_calibration(models, corpus, tmp_path, capsys,
                                                                           monkeypatch):
    _forbid_loading(monkeypatch)
    out = tmp_path / "photos"
    out.mkdir()
    (out / "holiday.jpg").write_bytes(b"\xff\xd8")
    status, err = run_cli(capsys, *quantize_args(models["clean"], out, calib=corpus))
    assert_user_error(status, err, f"--out {out}", "refusing to replace it")
    assert [p.name for p in out.iterdir()] == ["holiday.jpg"]
    assert not out.with_name("photos.partial").exists()
    a_file = tmp_path / "a-file"
    a_file.write_text("mine")
    status, err = run_cli(capsys, *quantize_args(models["clean"], a_file / "ckpt", calib=corpus))
    assert_user_error(status, err, "--out", "not a directory")


def test_read_only_out_is_refused_before_calibration(models, corpus, tmp_path, capsys, monkeypatch):
    import tarq_deploy.checks as checks

    def read_only(*args, **kwargs):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), kwargs.get("dir"))

    _forbid_loading(monkeypatch)
    monkeypatch.setattr(checks.tempfile, "TemporaryFile", read_only)
    out = tmp_path / "ckpt"
    status, err = run_cli(capsys, *quantize_args(models["clean"], out, calib=corpus))
    assert_user_error(status, err, f"--out {out}", "Read-only file system")
    nothing_left(out)


def test_earlier_checkpoint_at_out_is_replaced(models, checkpoint, tmp_path, capsys):
    out = tmp_path / "again"
    shutil.copytree(checkpoint, out)
    status, _ = run_cli(capsys, *quantize_args(models["clean"], out, "--method", "rtn"))
    assert status == 0
    assert (out / "lattice.safetensors").read_bytes() == (checkpoint / "lattice.safetensors").read_bytes()


# ------------------------------------------------------------------------------------------------------- export
def test_export_to_a_directory_target_writes_a_named_file_inside(checkpoint, tmp_path, capsys):
    target = tmp_path / "models"
    target.mkdir()
    status, _ = run_cli(capsys, "export", "--target", "whisper.cpp", checkpoint, "-o", target)
    assert status == 0
    assert [p.name for p in target.iterdir()] == ["clean-rtn-q4_0.bin"]  # MODEL-METHOD-TYPE, llama.cpp style


def test_export_to_a_read_only_target(checkpoint, tmp_path, capsys, monkeypatch):
    import tarq_deploy.checks as checks

    def denied(*args, **kwargs):
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), kwargs.get("dir"))

    monkeypatch.setattr(checks.tempfile, "TemporaryFile", denied)
    status, err = run_cli(capsys, "export", "--target", "whisper.cpp", checkpoint, "-o", tmp_path / "m.bin")
    assert_user_error(status, err, str(tmp_path / "m.bin"), "Permission denied")
    assert list(tmp_path.iterdir()) == []


def test_export_to_a_full_disk(checkpoint, tmp_path, capsys, monkeypatch):
    import tarq_deploy.formats.whisper_cpp as whisper_cpp

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(whisper_cpp, "write_buffers", full)
    out = tmp_path / "m.bin"
    status, err = run_cli(capsys, "export", "--target", "whisper.cpp", checkpoint, "-o", out, "--quiet")
    assert_user_error(status, err, str(out), "No space left on device")
    assert list(tmp_path.iterdir()) == []


# ------------------------------------------------------------------------------------------------- checkpoints
def test_tampered_manifest_shape_is_a_checkpoint_error(checkpoint, tmp_path, capsys):
    tampered = tmp_path / "tampered"
    shutil.copytree(checkpoint, tampered)
    manifest = json.loads((tampered / "manifest.json").read_text())
    name = sorted(manifest["quantized"])[0]
    manifest["quantized"][name] = [manifest["quantized"][name][0], 96]
    (tampered / "manifest.json").write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    with pytest.raises(CheckpointError, match="manifest.json: content does not match its own manifest_sha256"):
        load_checkpoint(tampered)
    with pytest.raises(CheckpointError, match=f"blocks of {name} are stored as"):  # no reshape traceback either
        load_checkpoint(tampered, verify_hashes=False)
    status, err = run_cli(capsys, "inspect", tampered)
    assert_user_error(status, err, str(tampered / "manifest.json"), "manifest_sha256")


def test_outputs_get_the_usual_permissions(checkpoint, tmp_path):
    from tarq_deploy.fileio import write_bytes_atomic

    umask = os.umask(0o022)
    os.umask(umask)
    file_mode, dir_mode = 0o666 & ~umask, 0o777 & ~umask
    assert os.stat(write_bytes_atomic(tmp_path / "x.bin", b"x")).st_mode & 0o777 == file_mode
    assert os.stat(checkpoint).st_mode & 0o777 == dir_mode
    for path in checkpoint.rglob("*"):
        assert os.stat(path).st_mode & 0o777 == (dir_mode if path.is_dir() else file_mode), path


def test_atomic_file_writes_through_the_temporary_it_made(tmp_path, monkeypatch):
    """Outputs are written through the descriptor that created them: opening an existing temporary again with "wb"
    truncated it, and ext4 flushes a file truncated to zero when it closes, which doubled the time to write a model
    file. Text and binary modes both work, and a failed writer leaves nothing."""
    import builtins

    from tarq_deploy.fileio import atomic_file

    def no_reopen(*args, **kwargs):
        raise AssertionError(f"atomic_file opened {args[0]!r} again")

    monkeypatch.setattr(builtins, "open", no_reopen)
    with atomic_file(tmp_path / "model.bin") as f:
        f.write(b"\x00model")
    with atomic_file(tmp_path / "card.md", "w") as f:
        f.write("# card\n")
    with pytest.raises(RuntimeError), atomic_file(tmp_path / "broken.bin") as f:
        f.write(b"half")
        raise RuntimeError("writer failed")
    monkeypatch.undo()
    assert (tmp_path / "model.bin").read_bytes() == b"\x00model"
    assert (tmp_path / "card.md").read_text() == "# card\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["card.md", "model.bin"]


def test_atomic_path_hands_a_writer_a_path_that_does_not_exist_yet(tmp_path):
    """A writer that opens the file itself creates it (no truncation of a temporary made for it), under the target's
    own name and suffix; the result gets the usual permissions, and nothing else is left. A writer that makes no
    file is an error naming the target, not an empty output."""
    from tarq_deploy.fileio import atomic_path, default_file_mode

    with atomic_path(tmp_path / "model.gguf") as tmp:
        assert not tmp.exists() and tmp.name == "model.gguf" and tmp.parent.parent == tmp_path
        tmp.write_bytes(b"GGUF")
    assert (tmp_path / "model.gguf").read_bytes() == b"GGUF"
    assert os.stat(tmp_path / "model.gguf").st_mode & 0o777 == default_file_mode()
    with pytest.raises(OSError, match="the writer made no file") as made_nothing, atomic_path(tmp_path / "x.bin"):
        pass
    assert made_nothing.value.filename == str(tmp_path / "x.bin")
    with pytest.raises(RuntimeError), atomic_path(tmp_path / "y.bin") as tmp:
        tmp.write_bytes(b"half")
        raise RuntimeError("writer failed")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.gguf"]


# ------------------------------------------------------------------------------------------------------- resume
class _Interrupt(Exception):
    pass


def test_corrupted_block_in_the_work_dir_is_recomputed(models, corpus, tmp_path, monkeypatch):
    from tarq_deploy.data.corpus import load_corpus
    from tarq_deploy.models.registry import load_backbone
    from tarq_deploy.quant import calibrate
    from tarq_deploy.quant.pipeline import QuantizeOptions

    options = QuantizeOptions(method="tarq", encoder_tagging="none")
    utterances = load_corpus(corpus)
    logged: list[str] = []

    def run(work: Path, out: Path) -> Path:
        from tarq_deploy.quant.pipeline import quantize_backbone

        ckpt, _ = quantize_backbone(load_backbone(str(models["clean"])), utterances, options, "tiny", work,
                                    log=logged.append)
        return save_checkpoint(ckpt, out)

    reference = run(tmp_path / "ref.partial", tmp_path / "ref")
    original = calibrate.SequentialCalibrator._calibrate_block
    calls = {"n": 0}

    def interrupted_at_the_head(self, *args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 3:
            raise _Interrupt
        return original(self, *args, **kwargs)

    work = tmp_path / "res.partial"
    monkeypatch.setattr(calibrate.SequentialCalibrator, "_calibrate_block", interrupted_at_the_head)
    with pytest.raises(_Interrupt):
        run(work, tmp_path / "res")
    monkeypatch.setattr(calibrate.SequentialCalibrator, "_calibrate_block", original)
    block = work / "block-0001.safetensors"
    data = bytearray(block.read_bytes())
    data[-5] ^= 0x40  # one flipped bit in the last codes: still a readable safetensors file
    block.write_bytes(bytes(data))
    logged.clear()
    resumed = run(work, tmp_path / "res")
    warnings = [line for line in logged if line.startswith("warning")]
    assert len(warnings) == 1 and str(block) in warnings[0] and "recomputing from block 1" in warnings[0]
    for name in ("manifest.json", "lattice.safetensors", "tensors.safetensors"):
        assert (resumed / name).read_bytes() == (reference / name).read_bytes(), name

    (work / "block-0000.safetensors").write_bytes(b"not safetensors")  # unreadable, and no hash to compare
    progress = json.loads((work / "progress.json").read_text())
    progress["block_sha256"] = []
    (work / "progress.json").write_text(json.dumps(progress))
    logged.clear()
    again = run(work, tmp_path / "again")
    assert any("block-0000.safetensors: not a readable safetensors file" in line for line in logged)
    assert (again / "lattice.safetensors").read_bytes() == (reference / "lattice.safetensors").read_bytes()


# -------------------------------------------------------------------------------------------------------- bench
def test_bench_with_only_bad_model_files_keeps_earlier_results(tmp_path, capsys):
    out = tmp_path / "results"
    out.mkdir()
    earlier = out / "bench-cpu.json"
    earlier.write_text('{"kind": "cpu", "cells": ["an earlier, real run"]}\n')
    broken = tmp_path / "broken.bin"
    broken.write_bytes(b"lmgg" + b"\0" * 40)
    wav = write_wav(tmp_path / "a.wav", 0.5)
    status, err = run_cli(capsys, "bench", "--model", broken, "--audio", wav, "--threads", "1", "--out", out)
    assert_user_error(status, err, str(broken), "invalid model file")
    assert earlier.read_text() == '{"kind": "cpu", "cells": ["an earlier, real run"]}\n'
    assert sorted(p.name for p in out.iterdir()) == ["bench-cpu.json"]


def test_bench_that_measured_nothing_writes_nothing(tmp_path, capsys, monkeypatch):
    import tarq_deploy.commands.bench as bench_command

    def all_rows_failed(config, log):
        class Result:
            def to_dict(self):
                return {"kind": "cpu", "cells": [{"status": "error", "error": "worker crashed"}]}
        return Result()

    import tarq_deploy.bench.bench_report

    monkeypatch.setattr(bench_command, "run_cpu_bench", all_rows_failed)
    monkeypatch.setattr(tarq_deploy.bench.bench_report, "markdown_report", lambda doc: "")
    out = tmp_path / "results"
    status = cli.main(["bench", "--model", "x.bin", "--audio", str(write_wav(tmp_path / "a.wav", 0.5)),
                       "--out", str(out)])
    assert status == 1 and not out.exists()
    assert "nothing was measured" in capsys.readouterr().err


def test_bench_default_threads_fit_the_machine():
    from tarq_deploy.bench.cpu import DEFAULT_THREADS, default_threads

    assert default_threads(2) == (1, 2) and default_threads(6) == (2, 4, 6) and default_threads(16) == (4, 8, 16)
    assert max(DEFAULT_THREADS) == len(os.sched_getaffinity(0))


def test_bench_out_that_is_a_file(tmp_path, capsys):
    a_file = tmp_path / "results"
    a_file.write_text("mine")
    status, err = run_cli(capsys, "bench", "--model", "x.bin", "--audio", write_wav(tmp_path / "a.wav", 0.5),
                          "--out", a_file)
    assert_user_error(status, err, "--out", "not a directory")


# --------------------------------------------------------------------------------------------- eval backends
def test_qwen3_asr_cpp_output_with_broken_utf8_is_kept(tmp_path):
    from tarq_deploy.runtimes.qwen3_asr_cpp import run_qwen3_asr_cpp

    fake = tmp_path / "qwen3-asr-cli"
    fake.write_text("#!/bin/sh\nprintf 'caf\\303 au lait\\n'\nprintf 'tokens: 1 2\\342\\202\\n' >&2\n")
    fake.chmod(0o755)
    done = run_qwen3_asr_cpp(fake, tmp_path / "m.gguf", tmp_path / "a.wav", 1, 8, 30)
    assert done.returncode == 0 and done.stdout == "caf\ufffd au lait\n" and "\ufffd" in done.stderr


# ---------------------------------------------------------------------------------------- the CLI's error policy
def test_our_own_bugs_get_a_traceback_and_a_request_to_report(capsys, monkeypatch):
    import tarq_deploy.commands.inspect_checkpoint as inspect_command

    def bug(args):
        raise KeyError("an internal table lost its key")

    monkeypatch.setattr(inspect_command, "run", bug)
    assert cli.main(["inspect", "anything"]) == 3  # 3: ours, not the input's (2) nor a failed check (1)
    err = capsys.readouterr().err
    assert "Traceback" in err and "please report it" in err
    saved = Path(err.strip().rsplit("traceback in ", 1)[1])  # the file the message names holds the whole traceback
    assert "KeyError: 'an internal table lost its key'" in saved.read_text()
    saved.unlink()


def test_missing_optional_package_is_a_user_error(capsys, monkeypatch):
    import tarq_deploy.commands.inspect_checkpoint as inspect_command

    def needs(args):
        raise ModuleNotFoundError("No module named 'pywhispercpp'", name="pywhispercpp")

    monkeypatch.setattr(inspect_command, "run", needs)
    status, err = run_cli(capsys, "inspect", "anything")
    assert_user_error(status, err, "'pywhispercpp'", "not installed")


def test_help_imports_nothing_heavy_and_shows_every_default():
    code = ("import sys, time; t = time.perf_counter(); from tarq_deploy.cli import build_parser; build_parser(); "
            "print(time.perf_counter() - t, 'torch' in sys.modules, 'transformers' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, check=True)
    seconds, torch_loaded, transformers_loaded = done.stdout.split()
    assert (torch_loaded, transformers_loaded) == ("False", "False"), done.stdout

    import argparse

    def check(name: str, parser: argparse.ArgumentParser) -> None:
        assert parser.formatter_class is cli.HelpFormatter, name
        for action in parser._actions:
            if isinstance(action, argparse._HelpAction):
                continue
            if isinstance(action, argparse._SubParsersAction):
                for child_name, child in action.choices.items():
                    check(f"{name} {child_name}", child)
                continue
            assert action.help, f"{name} {action.option_strings or action.dest}: no help text"
            if action.default not in (None, False, [], ()) and action.nargs != 0:
                shown = cli.HelpFormatter("tarq-deploy")._get_help_string(action)
                assert "default" in shown.lower(), f"{name} {action.option_strings}: default not shown"

    parser = cli.build_parser()
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    for name, sub in commands.choices.items():
        check(name, sub)


def test_export_help_names_agree_with_the_converters():
    from tarq_deploy.formats.whisper_cpp import BASELINES, TARGET_TYPES

    from tarq_deploy.commands import export_whispercpp

    assert set(export_whispercpp.WEIGHT_TYPES) == set(TARGET_TYPES)
    assert tuple(export_whispercpp.BASELINES) == tuple(BASELINES)


# ------------------------------------------------------------------------------------------- docs and the patch
def test_readme_says_how_to_load_compressed_tensors():
    assert "CompressedTensorsConfig(dequantize=True)" in (REPO / "README.md").read_text()


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
def test_loader_patch_refuses_to_apply_without_unidiff_zero(tmp_path):
    patch = REPO / "third_party" / "qwen3-asr.cpp" / "loader-patch.diff"
    src = tmp_path / "src"
    src.mkdir()
    for name in ("gguf_loader.cpp", "text_decoder.cpp"):  # stand-ins: the hunks carry no context to match
        (src / name).write_text("".join(f"// upstream line {i}\n" for i in range(1, 301)))
    git = ["git", "-C", str(tmp_path)]
    subprocess.run(git + ["init", "-q"], check=True)
    plain = subprocess.run(git + ["apply", "--check", str(patch)], capture_output=True, text=True)
    assert plain.returncode != 0 and "patch does not apply" in plain.stderr
    subprocess.run(git + ["apply", "--unidiff-zero", str(patch)], check=True)
    lines = (src / "gguf_loader.cpp").read_text().splitlines()
    assert "--unidiff-zero" in lines[0] and lines[2] == "// upstream line 1"
    assert lines[lines.index("// upstream line 5") + 1] == "#include <map>"


@pytest.mark.parametrize("text, fragment", [
    (None, "no such sweep file"),
    ("[sweep\n", "not a readable TOML sweep file"),
    ('[sweep]\nmethods = ["gptq"]\n[models]\na = "packaged:tiny.en"\n', "[calibration] names no corpus"),
    ('[sweep]\nmethods = ["gptq"]\ntarget = "marlin"\n[models]\na = "packaged:tiny.en"\n', "target 'marlin'"),
    ('[sweep]\nmethods = ["gptq"]\nsteps = ["quantize"]\n[models]\na = "packaged:tiny.en"\n[calibration]\n'
     'c = "missing.jsonl"\n',
     "missing.jsonl does not exist"),
])
def test_bad_sweep_file_is_one_line_before_any_work(tmp_path, capsys, text, fragment):
    sweep = tmp_path / "sweep.toml"
    if text is not None:
        sweep.write_text(text)
    status, err = run_cli(capsys, "sweep", sweep, "--out", tmp_path / "out")
    assert_user_error(status, err, fragment)
    assert not (tmp_path / "out").exists()
