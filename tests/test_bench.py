"""The benchmark harness: the CPU runner on real Whisper tiny.en whisper.cpp files (F16 and ggml's Q4_0) in fresh
pywhispercpp processes, its error rows (a truncated file, a crashing worker), the reports, and the GPU runner's
no-CUDA path.

One short bench (threads 1,2; 1 warm-up + 1 timed run per cell) runs once per module through the CLI glue and the
tests read its JSON, CSV, markdown and PNG.
"""
from __future__ import annotations

import argparse
import csv
import io
import json
import os
import statistics
import wave
from pathlib import Path

import pytest
import torch
from helpers import assert_user_error, run_cli, write_wav

from tarq_deploy import cli
from tarq_deploy.bench.cpu import (RUNTIMES, BenchConfig, BenchConfigError, CellResult, RunRecord, check_audio,
                                   run_cpu_bench, schedule, summarize_cell)
from tarq_deploy.bench.gpu import GpuBenchConfig, KernelUnavailable, build_variant, generated_token_count, run_gpu_bench
from tarq_deploy.bench.bench_report import csv_text, markdown_report, variant_of
from tarq_deploy.formats.whisper_cpp import export_whisper_cpp
from tarq_deploy.checkpoint import LatticeCheckpoint, save_checkpoint
from tarq_deploy.commands import bench as bench_command
from tarq_deploy.quant.lattice import LatticeSpec
from tarq_deploy.quant.lattice_fit import quantize_rtn
from tarq_deploy.runtimes.base import BenchRuntime, ModelInfo
from tarq_deploy.runtimes.int4_linear import Int4Linear
from tarq_deploy.runtimes.whisper_cpp import whisper_backbone

THREADS = "1,2"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    bench_command.add_arguments(parser)
    return parser.parse_args(argv)


# ----------------------------------------------------------------------------------------------------- fixtures
pytestmark = pytest.mark.usefixtures("one_torch_thread")  # conftest.py: small torch ops, one thread


@pytest.fixture(scope="module")
def model_files(tiny, tmp_path_factory) -> dict[str, Path]:
    """tiny.en as whisper.cpp F16 and Q4_0 (ggml's own rounding, what its quantize tool makes), and a Q4_0 file
    cut in half (what an interrupted copy leaves)."""
    work = tmp_path_factory.mktemp("bench_models")
    model, processor, _ = tiny
    f16 = export_whisper_cpp((model, processor), work / "tiny.en-f16.bin", "f16")
    q4_0 = export_whisper_cpp((model, processor), work / "tiny.en-q4_0.bin", "q4_0", baseline="rtn")
    data = q4_0.read_bytes()
    broken = work / "tiny.en-broken.bin"
    broken.write_bytes(data[:len(data) // 2])
    return {"f16": f16, "q4_0": q4_0, "broken": broken}


@pytest.fixture(scope="module")
def bench_run(model_files, jfk_wav, tmp_path_factory) -> tuple[int, dict, Path]:
    out = tmp_path_factory.mktemp("bench_out")
    args = parse(["--model", str(model_files["f16"]), "--model", str(model_files["q4_0"]),
                  "--model", str(model_files["broken"]), "--audio", jfk_wav, "--threads", THREADS,
                  "--warmup", "1", "--runs", "1", "--out", str(out)])
    status = bench_command.run(args)
    return status, json.loads((out / "bench-cpu.json").read_text()), out


def ok_cells(doc: dict) -> list[dict]:
    return [c for c in doc["cells"] if c["status"] == "ok"]


# ------------------------------------------------------------------------------------------- the real short run
def test_every_valid_cell_is_measured_with_all_fields(bench_run, model_files):
    status, doc, _ = bench_run
    cells = ok_cells(doc)
    assert status == 1  # the broken file's rows are errors; the bench itself completed
    assert {(c["precision"], c["threads"]) for c in cells} == {(p, t) for p in ("F16", "Q4_0") for t in (1, 2)}
    baseline = doc["baselines"][0]["peak_rss_mb"]
    for c in cells:
        s = {name: stat["median"] for name, stat in c["summary"].items()}
        assert c["backbone"] == "tiny.en"
        assert all(v is not None for v in s.values()), s
        assert s["rtf"] > 0 and s["transcribe_s"] > 0 and s["load_s"] > 0
        assert s["rtf"] == pytest.approx(s["transcribe_s"] / c["audio_s"])
        assert s["wall_s"] > s["load_s"] + s["transcribe_s"]  # the whole process, interpreter start to exit
        assert s["peak_rss_mb"] > baseline > 0
        assert s["model_rss_mb"] == pytest.approx(s["peak_rss_mb"] - baseline)
        assert s["tokens"] > 0
        assert c["model_size_mb"] == pytest.approx(Path(c["model"]).stat().st_size / 2**20)
        assert "ask not what your country can do for you" in c["text"].lower().replace(",", "").replace(".", "")
        assert c["oversubscribed"] == (c["threads"] > doc["machine"]["usable_cores"])
    rss = {c["precision"]: c["summary"]["peak_rss_mb"]["median"] for c in cells}
    assert rss["Q4_0"] < rss["F16"]
    # VmHWM is the child's own peak: this pytest process holds torch and a model, far above tiny.en's ~190 MB,
    # and ru_maxrss (wait4) inherits that figure across exec
    assert max(rss.values()) < 400


def test_medians_come_from_the_timed_runs_only(bench_run):
    _, doc, _ = bench_run
    for c in ok_cells(doc):
        runs = c["runs"]
        assert [r["warmup"] for r in runs] == [True, False]
        timed = [r for r in runs if not r["warmup"]]
        for name in ("transcribe_s", "load_s", "wall_s", "rtf", "peak_rss_mb", "tokens"):
            assert c["summary"][name]["median"] == statistics.median(r[name] for r in timed)
            assert c["summary"][name]["n"] == 1


def test_a_file_that_fails_validation_is_an_error_row(bench_run):
    _, doc, out = bench_run
    broken = [c for c in doc["cells"] if c["model_label"] == "tiny.en-broken"]
    assert len(broken) == 2 and all(c["status"] == "error" and not c["runs"] for c in broken)
    assert all("invalid model file" in c["error"] and "truncated" in c["error"] for c in broken)
    assert "tiny.en-broken: invalid model file" in (out / "bench-cpu.md").read_text()
    rows = list(csv.DictReader(io.StringIO((out / "bench-cpu.csv").read_text())))
    assert sorted(r["status"] for r in rows) == ["error"] * 2 + ["ok"] * 4


def test_outputs_describe_machine_versions_and_environment(bench_run):
    _, doc, out = bench_run
    assert (out / "bench-cpu.png").read_bytes().startswith(PNG_MAGIC)
    machine, versions = doc["machine"], doc["versions"]
    assert machine["cpu_model"] and machine["logical_cores"] >= 1 and machine["memory_total_mb"] > 0
    assert versions["whisper.cpp"] and versions["ggml"] and versions["torch"] and versions["pywhispercpp"]
    assert doc["environment"]["OMP_WAIT_POLICY"] == "PASSIVE"
    # the default decode profile is whisper-cli's: beam search, fallback by 0.2, English
    settings = doc["runtime"]["settings"]
    assert doc["runtime"]["decode"] == "cli" and settings["params_sampling_strategy"] == 1
    assert settings["temperature_inc"] == 0.2 and settings["language"] == "en"
    assert len(doc["loadavg"]["start"]) == 3 and doc["harness"]["rss_mb"] > 0
    table = (out / "bench-cpu.md").read_text()
    assert "| F16 latency (s) | Q4_0 latency (s) | Q4_0 speed-up vs F16 |" in table
    assert table.count("| tiny.en | jfk (11.0 s) |") == 2


def test_report_only_rerenders_a_saved_result(bench_run, tmp_path):
    _, doc, out = bench_run
    status = bench_command.run(parse(["--report-only", str(out / "bench-cpu.json"), "--out", str(tmp_path),
                                      "--no-plot"]))
    assert status == 1
    assert (tmp_path / "bench-cpu.md").read_text() == (out / "bench-cpu.md").read_text()
    assert (tmp_path / "bench-cpu.csv").read_text() == csv_text(doc)
    assert not (tmp_path / "bench-cpu.png").exists()


# -------------------------------------------------------------------------------------------- harness behaviour
def test_a_crashing_worker_is_an_error_row_and_the_bench_goes_on(monkeypatch, tmp_path, jfk_wav):
    """pywhispercpp segfaults on a model it could not load; a runtime whose worker segfaults stands in for it."""
    fake_model = tmp_path / "fake.bin"
    fake_model.write_bytes(b"x")
    (tmp_path / "crashing_worker.py").write_text("import ctypes\n\ndef measure(spec):\n    ctypes.string_at(0)\n")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))  # the child finds the worker module there
    crashing = BenchRuntime("crashing", lambda path: ModelInfo("fake", "F16"), "crashing_worker:measure", {})
    monkeypatch.setitem(RUNTIMES, "crashing", crashing)
    result = run_cpu_bench(BenchConfig([str(fake_model)], [jfk_wav], threads=[1], runtime="crashing", warmup=1,
                                       runs=3), log=lambda line: None)
    (cell,) = result.cells
    assert cell.status == "error" and "SIGSEGV" in cell.error
    assert len(cell.runs) == 1  # a crash repeats: the remaining runs are not spent on it
    assert result.baselines[0].error and "SIGSEGV" in result.baselines[0].error


def test_summary_uses_timed_runs_and_any_failure_marks_the_cell():
    cell = CellResult("whisper.cpp", "m.bin", "m", 1.0, "tiny.en", "F16", "a.wav", "a", 10.0, 1, False,
                      baseline_rss_mb=50.0)
    for i, t in enumerate([100.0, 1.0, 9.0, 2.0]):
        cell.runs.append(RunRecord(i, i == 0, 0.0, wall_s=t + 1, load_s=0.1, transcribe_s=t, rtf=t / 10,
                                   peak_rss_mb=150.0 + i, tokens=20))
    summarize_cell(cell)
    assert cell.status == "ok"
    assert (cell.summary["transcribe_s"].median, cell.summary["transcribe_s"].min,
            cell.summary["transcribe_s"].max, cell.summary["transcribe_s"].n) == (2.0, 1.0, 9.0, 3)
    assert cell.summary["model_rss_mb"].median == 102.0
    cell.runs.append(RunRecord(4, False, 0.0, error="worker crashed (SIGSEGV)"))
    summarize_cell(cell)
    assert cell.status == "error" and "run 4 (timed)" in cell.error


def test_runs_are_interleaved_across_cells_by_default():
    cells = [CellResult("r", f"m{i}", f"m{i}", 1.0, "b", "F16", "a", "a", 1.0, 1, False) for i in range(2)]
    cells.append(CellResult("r", "bad", "bad", None, None, None, "a", "a", 1.0, 1, False, status="error"))
    config = BenchConfig(["m0", "m1"], ["a"], warmup=1, runs=2)
    assert [(c.model, i) for c, i in schedule(cells, config)] == [("m0", 0), ("m1", 0), ("m0", 1), ("m1", 1),
                                                                 ("m0", 2), ("m1", 2)]
    config.order = "grouped"
    assert [(c.model, i) for c, i in schedule(cells, config)][:3] == [("m0", 0), ("m0", 1), ("m0", 2)]


def test_bad_input_stops_the_bench_before_anything_runs(tmp_path, model_files, capsys):
    missing_audio = parse(["--model", str(model_files["f16"]), "--audio", str(tmp_path / "none.wav")])
    assert bench_command.run(missing_audio) == 2
    unknown = parse(["--model", str(model_files["f16"]), "--audio", str(tmp_path / "none.wav"),
                     "--runtime", "sherpa-onnx"])
    assert bench_command.run(unknown) == 2
    assert "unknown runtime 'sherpa-onnx'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse(["--threads", "4,0"])
    stereo = tmp_path / "stereo.wav"
    with wave.open(str(stereo), "wb") as w:
        w.setnchannels(2)
        w.setsampwidth(2)
        w.setframerate(44100)
        w.writeframes(b"\0" * 400)
    with pytest.raises(BenchConfigError, match="16 kHz mono"):
        check_audio(str(stereo))


def test_backbone_and_variant_names():
    assert whisper_backbone(4, 384, 4, 51864, 80) == "tiny.en"
    assert whisper_backbone(6, 512, 6, 51865, 80) == "base"
    assert whisper_backbone(32, 1280, 4, 51866, 128) == "large-v3-turbo"
    cells = [{"model": m, "model_label": m, "backbone": "base", "precision": p}
             for m, p in (("a", "F16"), ("rtn", "Q4_0"), ("tarq", "Q4_0"))]
    assert variant_of(cells) == {"a": "F16", "rtn": "rtn", "tarq": "tarq"}


# ----------------------------------------------------------------------------------------------------------- GPU
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA path")
def test_gpu_runner_without_cuda_measures_nothing_and_says_so(jfk_wav, tmp_path):
    result = run_gpu_bench(GpuBenchConfig("packaged:tiny.en", [jfk_wav]), log=lambda line: None).to_dict()
    assert result["status"] == "skipped" and result["cells"] == [] and "no CUDA device" in result["reason"]
    assert "Nothing measured" in markdown_report(result)
    status = bench_command.run(parse(["--gpu", "--model", "packaged:tiny.en", "--audio", jfk_wav,
                                      "--out", str(tmp_path)]))
    assert status == 0
    assert not any(tmp_path.iterdir())  # an empty report never replaces earlier results


def test_the_gpu_int4_variant_holds_the_checkpoint(tiny, tmp_path):
    """The INT4 model the GPU runner builds, built here on the CPU (Int4Linear runs torch's CPU int4 kernel): every
    lattice Linear swapped, each computing x @ (s * q).T, the other tensors the checkpoint's. Nothing is timed (and
    no transcription: torch's CPU int4 matmul took 27 s for one jfk.wav on this machine)."""
    model, _, _ = tiny
    spec = LatticeSpec(bits=4, group_size=128)
    state = model.state_dict()
    # every block Linear on the lattice; proj_out (tied to the embedding) stays float here: torch's CPU int4 packer
    # needs N % 16 == 0 and tiny.en's 51864-token head is only a multiple of 8 (Int4Linear pads to 8, CUDA's tile)
    linear = sorted(f"{n}.weight" for n, m in model.named_modules()
                    if isinstance(m, torch.nn.Linear) and n != "proj_out")
    quantized = {name: quantize_rtn(state[name], spec) for name in linear}
    tensors = {k: v.clone() + (0.5 if k.endswith("layer_norm.bias") else 0.0) for k, v in state.items()
               if k not in quantized}  # shifted: the model must take the checkpoint's values, not --model's
    ckpt = save_checkpoint(LatticeCheckpoint(spec, quantized, tensors, {}, {"method": {"name": "rtn"}}),
                           tmp_path / "ckpt")
    int4, _, _ = build_variant("packaged:tiny.en", str(ckpt), "tinygemm", "cpu", torch.float32)
    assert sum(isinstance(m, Int4Linear) for m in int4.modules()) == len(linear)
    name = "model.decoder.layers.0.fc1"
    layer = int4.get_submodule(name)
    eye = torch.eye(layer.in_features)
    with torch.no_grad():
        weight_t = layer(eye) - layer.bias  # rows of x @ W.T for x = I
    assert torch.allclose(weight_t, quantized[f"{name}.weight"].dequantize().T, atol=1e-6)
    ln = "model.encoder.layer_norm.bias"
    assert torch.equal(int4.state_dict()[ln], tensors[ln])
    with pytest.raises(KernelUnavailable):  # Marlin: skipped with its reason, before any model is loaded
        build_variant("packaged:tiny.en", str(ckpt), "marlin", "cpu", torch.float32)


def test_generated_token_count_with_and_without_the_prompt():
    assert generated_token_count([50257, 50362, 1, 2, 3], [50257, 50362]) == 3
    assert generated_token_count([1, 2, 3], [50257, 50362]) == 3


# ------------------------------------------------------------------------------- bad inputs, nothing measured
def test_bench_with_only_bad_model_files_keeps_earlier_results(tmp_path, capsys):
    out = tmp_path / "results"
    out.mkdir()
    earlier = out / "bench-cpu.json"
    earlier.write_text('{"kind": "cpu", "cells": ["an earlier, real run"]}\n')
    broken = tmp_path / "broken.bin"
    broken.write_bytes(b"lmgg" + b"\0" * 40)
    wav = write_wav(tmp_path / "a.wav", 0.5)
    status, _, err = run_cli(capsys, "bench", "--model", broken, "--audio", wav, "--threads", "1", "--out", out)
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
    status, _, err = run_cli(capsys, "bench", "--model", "x.bin", "--audio", write_wav(tmp_path / "a.wav", 0.5),
                          "--out", a_file)
    assert_user_error(status, err, "--out", "not a directory")
