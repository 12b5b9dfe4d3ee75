"""Every bad input to quantize a clear error (issue #14): exit status 2, one line on stderr naming the file or
option and the problem, and nothing left behind; and the solvers' own refusals of non-finite weights and statistics.
Tiny random Whisper models (conftest.py's `models`, d_model 32, one layer each side) keep every case to seconds. What
the commands write (exports, checkpoints, atomic files) is pinned in test_output_safety.py, resuming in
test_workdir_resume.py, bench's and the CLI's own errors in test_bench.py and test_cli_conventions.py."""

from __future__ import annotations

import errno
import json
import os
import shutil
import struct

import pytest
import torch
from helpers import (NAN_TENSOR, assert_user_error, forbid_loading, nothing_left, quantize_args, run_cli,
                     write_wav)

from tarq_deploy import cli
from tarq_deploy.data.corpus import AudioDecodeError, Utterance, decode_wav, write_manifest
from tarq_deploy.errors import CalibrationDataError, NonFiniteError

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # conftest.py: small torch ops, one thread


# --------------------------------------------------------------------------------------- NaN / Inf weights and stats
@pytest.mark.parametrize("method", ["gptq", "tarq"])
def test_nan_weight_is_refused_with_its_name(models, corpus, tmp_path, capsys, method):
    out = tmp_path / "ckpt"
    status, _, err = run_cli(capsys, *quantize_args(models["nan"], out, "--method", method, calib=corpus))
    assert_user_error(status, err, NAN_TENSOR, "NaN", "--model")
    nothing_left(out)


def test_nan_weight_rtn_is_refused_with_its_name(models, tmp_path, capsys):
    out = tmp_path / "ckpt"
    status, _, err = run_cli(capsys, *quantize_args(models["nan"], out, "--method", "rtn"))
    assert_user_error(status, err, NAN_TENSOR, "NaN")
    nothing_left(out)


def test_solver_refuses_non_finite_weights_and_statistics():
    from tarq_deploy.quant.lattice import LatticeSpec
    from tarq_deploy.quant.stats import LayerStats
    from tarq_deploy.quant.layer_solve import solve_layer
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
    from tarq_deploy.formats.backbones import load_backbone
    from tarq_deploy.calibration.options import QuantizeOptions
    from tarq_deploy.calibration.pipeline import quantize_backbone

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
    forbid_loading(monkeypatch)
    out = tmp_path / "ckpt"
    status, _, err = run_cli(capsys, *quantize_args(models["clean"], out, "--method", "gptq", calib=empty))
    assert_user_error(status, err, str(empty), "no utterances")
    nothing_left(out)


def test_n_calib_zero_is_refused(models, corpus, tmp_path, capsys, monkeypatch):
    forbid_loading(monkeypatch)
    out = tmp_path / "ckpt"
    status, _, err = run_cli(capsys, *quantize_args(models["clean"], out, "--n-calib", "0", calib=corpus))
    assert_user_error(status, err, "--n-calib 0")
    nothing_left(out)


@pytest.mark.parametrize("extra, message", [
    (["--target", "crispasr", "--type", "q4_1"], "--type q4_1's lattice is affine"),
    (["--target", "qwen3-asr.cpp", "--tensor-type", "fc1=q8_0"], "not to a --tensor-type mix"),
    (["--method", "imatrix"], "ggml's own quantizer"),
])
def test_a_bfloat16_scale_grid_is_refused_where_it_cannot_hold(models, corpus, tmp_path, capsys, monkeypatch,
                                                                extra, message):
    forbid_loading(monkeypatch)
    out = tmp_path / "ckpt"
    status, _, err = run_cli(capsys, *quantize_args(models["clean"], out, "--scale-dtype", "bfloat16", *extra,
                                                 calib=corpus))
    assert_user_error(status, err, message)
    nothing_left(out)


def test_a_layer_no_position_reached_is_an_error_and_no_tail_keeps_its_fallback():
    from tarq_deploy.quant.lattice import LatticeSpec
    from tarq_deploy.quant.stats import LayerStats
    from tarq_deploy.quant.layer_solve import solve_layer
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
    status, _, err = run_cli(capsys, *quantize_args(models["clean"], out, "--method", "gptq", calib=manifest))
    assert_user_error(status, err, str(wav), "truncated")
    nothing_left(out)


def test_streamed_wav_with_placeholder_size_still_decodes(tmp_path):
    data = bytearray(write_wav(tmp_path / "s.wav", 0.5).read_bytes())
    data_at = data.index(b"data")
    for placeholder in (0, 0xFFFFFFFF):
        struct.pack_into("<I", data, data_at + 4, placeholder)
        samples, rate = decode_wav(bytes(data))
        assert rate == 16_000 and samples.shape == (8000, 1)



def test_non_utf8_manifest(models, tmp_path, capsys, monkeypatch):
    manifest = tmp_path / "latin1.jsonl"
    manifest.write_bytes('{"id": "a", "audio": "a.wav", "text": "caf\u00e9"}\n'.encode("latin-1"))
    forbid_loading(monkeypatch)
    out = tmp_path / "ckpt"
    status, _, err = run_cli(capsys, *quantize_args(models["clean"], out, calib=manifest))
    assert_user_error(status, err, f"{manifest}:1", "UTF-8")
    nothing_left(out)


@pytest.mark.parametrize("model, fragment", [("packaged:tiny.nl", "unknown packaged model"),
                                             ("./no/such/model", "no such file or directory")])
def test_unknown_model_names(tmp_path, capsys, monkeypatch, model, fragment):
    forbid_loading(monkeypatch)
    out = tmp_path / "ckpt"
    status, _, err = run_cli(capsys, *quantize_args(model, out, "--method", "rtn"))
    assert_user_error(status, err, "--model", fragment)
    nothing_left(out)


def test_unsupported_model_type(tmp_path, capsys, monkeypatch):
    bert = tmp_path / "bert"
    bert.mkdir()
    (bert / "config.json").write_text(json.dumps({"model_type": "bert"}))
    forbid_loading(monkeypatch)
    out = tmp_path / "ckpt"
    status, _, err = run_cli(capsys, *quantize_args(bert, out, "--method", "rtn"))
    assert_user_error(status, err, str(bert), "'bert' is not supported")
    nothing_left(out)


@pytest.mark.parametrize("option, value", [("--group-size", "48"), ("--bits", "9"), ("--bits", "1"),
                                           ("--cost-ratio", "0")])
def test_bad_lattice_options(models, corpus, tmp_path, capsys, monkeypatch, option, value):
    forbid_loading(monkeypatch)
    out = tmp_path / "ckpt"
    status, _, err = run_cli(capsys, *quantize_args(models["clean"], out, option, value, calib=corpus))
    assert_user_error(status, err, f"{option} {value}")
    nothing_left(out)


@pytest.mark.parametrize("value", ["8XB", "-1GB", "lots", "nan"])
def test_bad_max_memory_is_refused_by_name(models, corpus, tmp_path, capsys, monkeypatch, value):
    forbid_loading(monkeypatch)
    out = tmp_path / "ckpt"
    capsys.readouterr()
    with pytest.raises(SystemExit) as stopped:  # argparse refuses it (cli.Parser: one line, exit 2)
        cli.main([str(a) for a in quantize_args(models["clean"], out, f"--max-memory={value}", calib=corpus)])
    assert_user_error(stopped.value.code, capsys.readouterr().err.strip(), "--max-memory", repr(value))
    nothing_left(out)


def test_group_size_that_does_not_divide_a_layer(models, corpus, tmp_path, capsys):
    out = tmp_path / "ckpt"  # d_model 32: a 64-column group fits no attention projection
    status, _, err = run_cli(capsys, *quantize_args(models["clean"], out, "--group-size", "64", calib=corpus))
    assert_user_error(status, err, "--group-size 64", "32 input columns")
    nothing_left(out)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA path")
@pytest.mark.parametrize("device", ["cuda", "cuda:1", "tpu"])
def test_device_not_available(models, corpus, tmp_path, capsys, monkeypatch, device):
    forbid_loading(monkeypatch)
    out = tmp_path / "ckpt"
    status, _, err = run_cli(capsys, *quantize_args(models["clean"], out, "--device", device, calib=corpus))
    assert_user_error(status, err, f"--device {device}")
    nothing_left(out)


# -------------------------------------------------------------------------------------------------------- --out
def test_out_that_is_someone_elses_directory_is_refused_before_calibration(models, corpus, tmp_path, capsys,
                                                                           monkeypatch):
    forbid_loading(monkeypatch)
    out = tmp_path / "photos"
    out.mkdir()
    (out / "holiday.jpg").write_bytes(b"\xff\xd8")
    status, _, err = run_cli(capsys, *quantize_args(models["clean"], out, calib=corpus))
    assert_user_error(status, err, f"--out {out}", "refusing to replace it")
    assert [p.name for p in out.iterdir()] == ["holiday.jpg"]
    assert not out.with_name("photos.partial").exists()
    a_file = tmp_path / "a-file"
    a_file.write_text("mine")
    status, _, err = run_cli(capsys, *quantize_args(models["clean"], a_file / "ckpt", calib=corpus))
    assert_user_error(status, err, "--out", "not a directory")


def test_read_only_out_is_refused_before_calibration(models, corpus, tmp_path, capsys, monkeypatch):
    import tarq_deploy.checks as checks

    def read_only(*args, **kwargs):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), kwargs.get("dir"))

    forbid_loading(monkeypatch)
    monkeypatch.setattr(checks.tempfile, "TemporaryFile", read_only)
    out = tmp_path / "ckpt"
    status, _, err = run_cli(capsys, *quantize_args(models["clean"], out, calib=corpus))
    assert_user_error(status, err, f"--out {out}", "Read-only file system")
    nothing_left(out)


def test_earlier_checkpoint_at_out_is_replaced(models, checkpoint, tmp_path, capsys):
    out = tmp_path / "again"
    shutil.copytree(checkpoint, out)
    status, _, _ = run_cli(capsys, *quantize_args(models["clean"], out, "--method", "rtn"))
    assert status == 0
    assert (out / "lattice.safetensors").read_bytes() == (checkpoint / "lattice.safetensors").read_bytes()
