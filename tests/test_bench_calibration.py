"""bench.calibration's grid: every (dims, n, method) is a row, a calibration over --max-seconds is stopped and
recorded rather than waited for, and TARQ/GPTQ ratios pair rows of the same dims and n only."""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
import torch

from tarq_deploy.bench.calibration import (DIMS, _progress, beyond_a_stopped_cell, cell_figures, child_launch, main,
                                         speedups_over_baseline, tarq_over_gptq)


def test_the_six_whisper_sizes_have_their_real_dimensions():
    assert list(DIMS) == ["tiny", "base", "small", "medium", "large-v3-turbo", "large-v3"]
    assert [DIMS[d]["d_model"] for d in DIMS] == [384, 512, 768, 1024, 1280, 1280]
    assert [DIMS[d]["decoder_layers"] for d in DIMS] == [4, 6, 12, 24, 4, 32]
    assert [DIMS[d]["encoder_layers"] for d in DIMS] == [4, 6, 12, 24, 32, 32]
    assert [DIMS[d]["num_mel_bins"] for d in DIMS] == [80, 80, 80, 80, 128, 128]


def test_ratios_pair_the_same_dims_and_n():
    rows = [{"dims": "tiny", "n": 32, "method": "gptq", "wall_s": 10.0},
            {"dims": "tiny", "n": 32, "method": "tarq", "wall_s": 12.0},
            {"dims": "tiny", "n": 128, "method": "gptq", "wall_s": 30.0},
            {"dims": "tiny", "n": 128, "method": "tarq", "stopped_after_s": 5.0},
            {"dims": "base", "n": 32, "method": "tarq", "wall_s": 99.0}]
    assert tarq_over_gptq(rows) == [{"dims": "tiny", "n": 32, "ratio": pytest.approx(1.2)}]


def test_a_calibration_over_the_limit_is_a_stopped_row_and_larger_cells_are_skipped(tmp_path):
    out = tmp_path / "cal.json"
    assert main(["--settle-seconds", "0", "--dims", "tiny,base", "--n", "2,1", "--methods", "gptq", "--max-seconds",
                 "0.01", "--type", "q4_0", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["dims"], r["n"]) for r in rows] == [("tiny", 1), ("tiny", 2), ("base", 1), ("base", 2)]  # smallest first
    assert rows[0]["stopped_after_s"] == 0.01 and rows[0]["reached"] == "start"  # stopped before its model was built
    assert rows[2]["stopped_after_s"] == 0.01  # every model is tried at the smallest set
    assert [r.get("skipped") for r in rows[1::2]] == ["tiny at 1 was already over the limit"] * 2
    assert json.loads(out.read_text())["ratios_tarq_over_gptq"] == []


def test_only_a_cell_no_larger_in_model_and_data_of_the_same_method_skips_one():
    stopped = [{"method": "tarq", "dims": "base", "n": 128, "stopped_after_s": 60.0},
               {"method": "gptq", "dims": "tiny", "n": 512, "failed": "exit -9 (killed: out of memory?)"}]
    assert beyond_a_stopped_cell(stopped, "tarq", "small", 128) is stopped[0]
    assert beyond_a_stopped_cell(stopped, "tarq", "base", 512) is stopped[0]
    assert beyond_a_stopped_cell(stopped, "tarq", "small", 32) is None  # less data: it may finish
    assert beyond_a_stopped_cell(stopped, "tarq", "tiny", 512) is None  # a smaller model
    assert beyond_a_stopped_cell(stopped, "gptq", "base", 128) is None  # the other method's row
    assert beyond_a_stopped_cell(stopped, "gptq", "large-v3", 512) is stopped[1]


def test_a_stopped_child_reports_its_last_stage():
    stdout = ('noise\nSTAGE {"stage": "model", "at_s": 4.0, "peak_rss_mb": 800}\n'
              'STAGE {"stage": "block 3/9", "at_s": 41.5, "peak_rss_mb": 990}\n')
    assert _progress(stdout) == {"reached": "block 3/9", "reached_at_s": 41.5}
    assert _progress("") == {"reached": "start"}


def test_a_finished_cell_splits_its_time_by_stage():
    stages = {"model": {"at_s": 5.0, "peak_rss_mb": 800.0}, "windows": {"at_s": 11.0, "peak_rss_mb": 990.0},
              **{f"block {i}/2": {"at_s": 11.0 + 30 * i, "peak_rss_mb": 1100.0} for i in (1, 2)},
              "done": {"at_s": 72.0, "peak_rss_mb": 1150.0}}
    timing = {"seconds": 60.0, "layers": [{"name": "a", "seconds": 40.0}, {"name": "b", "seconds": 15.0}]}
    args = argparse.Namespace(method="gptq", dims="tiny", model="packaged:base", n=32, type="q3_k", device="cpu")
    row = cell_figures(args, stages, timing, torch.nn.Linear(3, 2))
    assert row["stage_s"] == {"model": 5.0, "windows": 6.0, "propagate": 5.0, "solve": 55.0}
    assert row["wall_s"] == 72.0 and row["blocks"] == 2 and row["parameters"] == 8
    assert row["peak_rss_mb_after"] == {"model": 800.0, "windows": 990.0, "done": 1150.0}


@pytest.mark.parametrize("args, message", [(["--dims", "huge"], "--dims: unknown huge"),
                                           (["--n", "3,x"], "--n 3,x: comma-separated whole numbers")])
def test_bad_grids_are_named(args, message, capsys):
    with pytest.raises(SystemExit) as stop:
        main(args)
    assert stop.value.code == 2 and message in capsys.readouterr().err


def test_speedups_pair_each_cell_with_its_baseline_run():
    rows = [{"dims": "base", "n": 128, "method": "gptq", "wall_s": 50.0, "calibration_s": 40.0, "peak_rss_mb": 1000.0},
            {"dims": "base", "n": 128, "method": "gptq", "code": "baseline", "wall_s": 100.0, "calibration_s": 90.0,
             "peak_rss_mb": 1500.0},
            {"dims": "base", "n": 128, "method": "tarq", "wall_s": 60.0, "calibration_s": 50.0, "peak_rss_mb": 1.0},
            {"dims": "base", "n": 128, "method": "tarq", "code": "baseline", "stopped_after_s": 5.0}]
    assert speedups_over_baseline(rows) == [{"dims": "base", "n": 128, "method": "gptq", "wall": 2.0,
                                             "calibration": 2.25, "peak_rss": 1.5}]
    assert tarq_over_gptq([r for r in rows if r.get("code") != "baseline"]) == [
        {"dims": "base", "n": 128, "ratio": pytest.approx(1.2)}]


def test_a_baseline_child_imports_the_baseline_package(tmp_path, monkeypatch):
    """Started from this repository's root (where `python -m` would find the current package first), the baseline
    cell's child imports the package of --baseline-code: here a stand-in whose calibration module names itself."""
    stand_in = tmp_path / "old-checkout" / "tarq_deploy"
    (stand_in / "bench").mkdir(parents=True)
    (stand_in / "__init__.py").write_text("")
    (stand_in / "bench" / "__init__.py").write_text("")
    (stand_in / "bench" / "calibration.py").write_text("import tarq_deploy\nprint('PACKAGE', tarq_deploy.__file__)\n")
    monkeypatch.chdir(Path(__file__).resolve().parents[1])
    args = argparse.Namespace(model="packaged:base", processor="packaged:tiny.en", device="cpu", group_size=32,
                              threads=1, type=None, source_dtype="float16", baseline_code=str(stand_in.parent),
                              max_memory=None, compute_dtype="float32")
    for baseline, expected in ((True, stand_in), (False, Path(__file__).resolve().parents[1] / "tarq_deploy")):
        cmd, env, cwd = child_launch(args, "gptq", tmp_path / "calib.jsonl", None, 8, baseline)
        done = subprocess.run(cmd if baseline else [sys.executable, "-c", "import tarq_deploy; print('PACKAGE', "
                                                    "tarq_deploy.__file__)"],
                              env=env, cwd=cwd, capture_output=True, text=True, timeout=120)
        printed = next(line for line in done.stdout.splitlines() if line.startswith("PACKAGE"))
        assert Path(printed.split(" ", 1)[1]).resolve().parent == expected.resolve(), (baseline, done.stdout)


@pytest.mark.parametrize("shape, message", [("qwen3-asr-9B", "--write-random: unknown shape 'qwen3-asr-9B'"),
                                            ("voxtral-mini-3B", "exists and is not empty")])
def test_write_random_refuses_an_unknown_shape_and_a_used_folder(shape, message, tmp_path, capsys):
    (tmp_path / "keep.txt").write_text("a user's file")
    with pytest.raises(SystemExit) as stop:
        main(["--write-random", shape, str(tmp_path)])
    assert stop.value.code == 2 and message in capsys.readouterr().err
    assert [p.name for p in tmp_path.iterdir()] == ["keep.txt"]


def test_write_random_whisper_writes_a_folder_quantize_loads_in_float16(tmp_path):
    """--write-random whisper-DIMS (for bench.peers at sizes with no offline checkpoint): a transformers folder with
    the real dimensions, float16 weights as the hub stores them, the packaged multilingual tokenizer."""
    from tarq_deploy.formats.backbones import load_backbone

    folder = tmp_path / "whisper-tiny"
    assert main(["--write-random", "whisper-tiny", str(folder)]) == 0
    backbone = load_backbone(str(folder))
    config = backbone.model.config
    assert (config.d_model, config.encoder_layers, config.decoder_layers) == (384, 4, 4)
    assert {p.dtype for p in backbone.model.parameters()} == {torch.float16}
    assert len(backbone.processor.tokenizer) == config.vocab_size > 51864  # multilingual: base's vocabulary


def test_a_non_whisper_folder_is_measured_as_quantize_loads_it(tmp_path):
    """A bfloat16 Qwen3-ASR folder (tiny, real architecture) through the grid: the child loads it as quantize does,
    held in bfloat16, and finishes a TARQ row with its stages."""
    from transformers import AutoTokenizer

    from tarq_deploy.models import qwen3_asr_shapes as shapes

    folder = tmp_path / "qwen3-bf16"
    shapes.random_model(shapes.tiny_config()).to(torch.bfloat16).save_pretrained(folder)
    shapes.processor_for(AutoTokenizer.from_pretrained(shapes.qwen_tokenizer_dir())).save_pretrained(folder)
    out = tmp_path / "cal.json"
    assert main(["--settle-seconds", "0", "--model", str(folder), "--n", "2", "--methods", "tarq", "--threads", "1",
                 "--out", str(out)]) == 0
    (row,) = json.loads(out.read_text())["rows"]
    assert row["weights_dtype"] == "bfloat16" and row["dims"] == str(folder), row
    assert row["blocks"] == 6 and row["stage_s"]["solve"] > 0  # frontend, 2 encoder, 2 decoder layers, the head


def _fake_cell(calls: list, interrupt_at: int | None = None):
    """A run_child that records the cell and returns a finished row without calibrating (KeyboardInterrupt at the
    ``interrupt_at``-th call: a grid killed mid-way)."""
    def run(args, method, manifest, dims, n, baseline=False):
        calls.append((method, dims, n))
        if len(calls) == interrupt_at:
            raise KeyboardInterrupt
        return {"method": method, "dims": dims, "n": n, "type": "", "wall_s": 10.0 * len(calls),
                "calibration_s": 5.0, "stage_s": {"model": 1.0, "windows": 2.0, "propagate": 3.0, "solve": 4.0},
                "peak_rss_mb_after": {"model": 100.0, "windows": 200.0, "done": 300.0}, "peak_rss_mb": 300.0,
                "load_average_at_start": [0.1, 0.2, 0.3], "idle_at_start": True}
    return run


GRID = ["--settle-seconds", "0", "--dims", "tiny,base", "--n", "1", "--methods", "gptq,tarq"]


def test_an_interrupted_grid_resumes_at_the_first_cell_it_had_not_finished(tmp_path, monkeypatch):
    import tarq_deploy.bench.calibration as bench

    out, calls = tmp_path / "grid.json", []
    monkeypatch.setattr(bench, "run_child", _fake_cell(calls, interrupt_at=3))
    with pytest.raises(KeyboardInterrupt):
        main([*GRID, "--out", str(out)])
    assert [(r["method"], r["dims"]) for r in json.loads(out.read_text())["rows"]] == [("gptq", "tiny"),
                                                                                        ("tarq", "tiny")]
    assert "| tiny | 1 | tarq | 20 |" in out.with_suffix(".md").read_text()  # the table is written with the JSON
    calls.clear()
    monkeypatch.setattr(bench, "run_child", _fake_cell(calls))
    assert main([*GRID, "--out", str(out), "--resume"]) == 0
    assert calls == [("gptq", "base", 1), ("tarq", "base", 1)]  # the finished cells were kept, not measured again
    grid = json.loads(out.read_text())
    assert [r["wall_s"] for r in grid["rows"]] == [10.0, 20.0, 10.0, 20.0]
    assert all("measured_at" in r and "code_version" in r and "git_commit" in r for r in grid["rows"])
    assert [r["dims"] for r in grid["ratios_tarq_over_gptq"]] == ["tiny", "base"]
    calls.clear()
    assert main([*GRID, "--out", str(out)]) == 0  # without --resume the grid is measured again
    assert len(calls) == 4


def test_a_narrower_resumed_run_measures_its_cells_and_keeps_the_others(tmp_path, monkeypatch):
    import tarq_deploy.bench.calibration as bench

    out, calls = tmp_path / "grid.json", []
    monkeypatch.setattr(bench, "run_child", _fake_cell(calls, interrupt_at=2))
    with pytest.raises(KeyboardInterrupt):
        main([*GRID, "--out", str(out)])  # only tiny's GPTQ finished
    calls.clear()
    monkeypatch.setattr(bench, "run_child", _fake_cell(calls))
    narrow = ["--settle-seconds", "0", "--dims", "base", "--n", "1", "--methods", "tarq"]
    assert main([*narrow, "--out", str(out), "--resume"]) == 0  # the cell that matters first
    assert calls == [("tarq", "base", 1)]
    grid = json.loads(out.read_text())
    assert [(r["method"], r["dims"]) for r in grid["rows"]] == [("gptq", "tiny"), ("tarq", "base")]
    assert grid["model"] == "tiny,base" and "| tiny | 1 | gptq |" in out.with_suffix(".md").read_text()
    calls.clear()
    monkeypatch.setattr(bench, "run_child", _fake_cell(calls, interrupt_at=2))
    with pytest.raises(KeyboardInterrupt):  # the whole grid, stopped in base's GPTQ, before base's kept TARQ
        main([*GRID, "--out", str(out), "--resume"])
    assert [(r["method"], r["dims"]) for r in json.loads(out.read_text())["rows"]] == [
        ("gptq", "tiny"), ("tarq", "tiny"), ("tarq", "base")]  # a kept cell not reached yet stays in the file
    calls.clear()
    monkeypatch.setattr(bench, "run_child", _fake_cell(calls))
    assert main([*GRID, "--out", str(out), "--resume"]) == 0  # the whole grid again: only the cell never run
    assert calls == [("gptq", "base", 1)]
    assert [(r["method"], r["dims"]) for r in json.loads(out.read_text())["rows"]] == [
        ("gptq", "tiny"), ("tarq", "tiny"), ("gptq", "base"), ("tarq", "base")]


@pytest.mark.parametrize("change, named", [(["--group-size", "128"], "group_size"),
                                           (["--max-seconds", "60"], "max_seconds")])
def test_resume_refuses_a_grid_of_other_settings(tmp_path, monkeypatch, capsys, change, named):
    import tarq_deploy.bench.calibration as bench

    out, calls = tmp_path / "grid.json", []
    monkeypatch.setattr(bench, "run_child", _fake_cell(calls))
    assert main([*GRID, "--out", str(out)]) == 0
    before = out.read_bytes()
    with pytest.raises(SystemExit) as stop:
        main([*GRID, *change, "--out", str(out), "--resume"])
    assert stop.value.code == 2 and len(calls) == 4
    message = capsys.readouterr().err.strip().splitlines()[-1]
    assert str(out) in message and named in message
    assert out.read_bytes() == before  # nothing written over it


@pytest.mark.parametrize("text", ["", "not json", "[1, 2]", '{"benchmark": "peers", "rows": []}',
                                  '{"benchmark": "calibration", "rows": "x", "settings": {}}',
                                  '{"benchmark": "calibration", "rows": [], "settings": {"\\n": false}}'])
def test_resume_refuses_a_file_it_did_not_write(tmp_path, capsys, text):
    out = tmp_path / "grid.json"
    out.write_text(text)
    with pytest.raises(SystemExit) as stop:
        main([*GRID, "--out", str(out), "--resume"])
    assert stop.value.code == 2 and str(out) in capsys.readouterr().err
    assert out.read_text() == text


def test_resume_with_a_baseline_is_refused(capsys):
    with pytest.raises(SystemExit) as stop:
        main([*GRID, "--resume", "--baseline-code", "."])
    assert stop.value.code == 2 and "--resume" in capsys.readouterr().err


json_values = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
                           lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                                        max_size=4), max_leaves=12)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.one_of(st.binary(max_size=64).map(lambda b: b),
                      st.fixed_dictionaries({"benchmark": st.just("calibration"), "rows": st.lists(json_values, max_size=3),
                                             "settings": json_values}).map(lambda d: json.dumps(d).encode())))
def test_resumed_rows_reads_any_file_or_refuses_it_in_one_line(tmp_path, data):
    from tarq_deploy.bench.calibration import resumed_rows
    from tarq_deploy.errors import UserError

    out = tmp_path / "grid.json"
    out.write_bytes(data)
    try:
        rows = resumed_rows(out, {"threads": 2})
    except UserError as error:
        assert str(out) in str(error) and "\n" not in str(error)
    else:
        assert all(isinstance(r, dict) for r in rows)
