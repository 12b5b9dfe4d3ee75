"""The sweep's score step and the frontier report, without running a model: the plan gives every quantized cell a
score step reading its own file and its model's F16 file (the reference cell's export, one step), checks the file's
choices strictly, and the merged report re-scores the steps' per-utterance figures with paired intervals against
every listed baseline, ending with the frontier table (file size, bits per weight, decoded and teacher-forced
figures) and its plot."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import sweep_plan

from tarq_deploy.errors import UserError
from tarq_deploy.evaluate.teacher_forced import TF_METRICS
from tarq_deploy.evaluate.wer import score_utterance
from tarq_deploy.sweep.driver import SweepRun
from tarq_deploy.sweep.plan import load_sweep
from tarq_deploy.sweep.report import (build_sweep_report, frontier_rows, render_frontier, render_sweep_markdown,
                                      size_quality_png)
from tarq_deploy.sweep.steps import StepResult

SWEEP = """
[sweep]
methods = ["ggml", "gptq", "tarq"]
types = ["q3_k", "q4_0"]
baseline = {baseline}
steps = {steps}
reference = {reference}

[models]
base = "packaged:base"

[calibration]
synth = "calib.jsonl"

[evaluation]
test = "test.jsonl"
"""
UTTERANCES = [("u1", "the quixotic zeugma of aardvarks"), ("u2", "a plain sentence of common words"),
              ("u3", "name the xylophonist please"), ("u4", "we went home")]


def _write(tmp_path: Path, baseline: str = '["ggml", "gptq"]', steps: str = '["quantize", "export", "eval", "score"]',
           reference: str = "true") -> Path:
    for name in ("calib.jsonl", "test.jsonl"):
        (tmp_path / name).write_text("".join(json.dumps({"id": i, "audio": "x.wav", "text": t}) + "\n"
                                             for i, t in UTTERANCES))
    path = tmp_path / "sweep.toml"
    path.write_text(SWEEP.format(baseline=baseline, steps=steps, reference=reference))
    return path


def test_every_quantized_cell_is_scored_against_the_one_f16_export(tmp_path):
    _, cells, steps = sweep_plan(_write(tmp_path))
    reference = next(c for c in cells if c.method == "f16")
    assert "score" not in reference.steps  # the reference is what the others are scored against
    scored = [c for c in cells if c.method != "f16"]
    assert len(scored) == 6 and all("score" in c.steps for c in scored)
    for cell in scored:
        needs = steps[cell.steps["score"]].needs
        assert needs == (cell.steps["export"], reference.steps["export"])
    assert len({c.steps["score"] for c in scored}) == 6  # one score per file


@pytest.mark.parametrize("baseline, steps, reference, message", [
    ('["ggml", "awq"]', '["quantize", "export", "eval", "score"]', "true", "baseline 'awq' is not one of"),
    ("3", '["quantize", "export", "eval", "score"]', "true", "baseline must be a method or a list"),
    ('"gptq"', '["quantize", "export", "eval", "score"]', "false", "it needs reference = true"),
    ('"gptq"', '["quantize", "export", "score"]', "true", "add eval"),
])
def test_bad_score_and_baseline_choices_are_named(tmp_path, baseline, steps, reference, message):
    with pytest.raises(UserError, match=message):
        load_sweep(_write(tmp_path, baseline, steps, reference))


def _fake_results(tmp_path: Path, cells, steps) -> dict[str, StepResult]:
    """Finished steps with outputs shaped like eval's and score's: every method loses the rare words in proportion
    to its quality (ggml worst), so the paired differences have a known sign."""
    quality = {"f16": 0, "tarq": 1, "gptq": 2, "ggml": 3}
    results: dict[str, StepResult] = {}
    for cell in cells:
        worse = quality[cell.method] + (1 if cell.type == "q3_k" else 0)
        folder = tmp_path / "out" / cell.slug
        folder.mkdir(parents=True)
        size = {"f16": 140, "q4_0": 44, "q3_k": 35}[cell.type] * 1024 * 1024
        results[cell.steps["export"]] = StepResult("export", cell.steps["export"], "done",
                                                   {"file": str(folder / f"{cell.slug}.bin"), "bytes": str(size)})
        rows = []
        for index, (uid, text) in enumerate(UTTERANCES):
            words = text.split()
            hypothesis = " ".join(words[: max(1, len(words) - (worse if index % 2 == 0 else 0))])
            rows.append(json.dumps({"dataset": "test", **score_utterance(uid, text, hypothesis).record()}))
        (folder / "utterances.jsonl").write_text("\n".join(rows) + "\n")
        results[cell.steps["eval"]] = StepResult("eval", cell.steps["eval"], "done",
                                                 {"utterances": str(folder / "utterances.jsonl")})
        if "score" in cell.steps:
            figures = [{"dataset": "test", "label": cell.name, "id": uid,
                        "sums": {m: (0.01 * worse * (index + 1) if "kld" in m or "dnll" in m else 3.0)
                                 for m in TF_METRICS},
                        "counts": {"rare": 3, "common": 3}} for index, (uid, _) in enumerate(UTTERANCES)]
            figures.append({"dataset": "test", "label": "F16", "id": "u1", "sums": {m: 9.0 for m in TF_METRICS},
                            "counts": {"rare": 3, "common": 3}})  # the reference's own line is not a cell's
            (folder / "teacher-forced.jsonl").write_text("".join(json.dumps(f) + "\n" for f in figures))
            results[cell.steps["score"]] = StepResult("score", cell.steps["score"], "done",
                                                      {"figures": str(folder / "teacher-forced.jsonl")})
    for key, step in steps.items():
        results.setdefault(key, StepResult(step.kind, key, "done"))
    return results


def test_the_report_merges_figures_against_every_baseline_and_ends_with_the_frontier(tmp_path):
    sweep, cells, steps = sweep_plan(_write(tmp_path))
    run = SweepRun(cells, steps, _fake_results(tmp_path, cells, steps))
    report = build_sweep_report(sweep, run)
    report["frontier"] = frontier_rows(report)
    dataset = report["models"][0]["evaluation"]["datasets"][0]
    tf = dataset["teacher_forced"]
    assert {m["label"] for m in tf["models"]} == {c.name for c in cells if c.method != "f16"}
    pairs = {(d["model"], d["versus"]) for d in tf["differences"]}
    assert ("base/synth/tarq/q3_k", "base/-/ggml/q3_k") in pairs
    assert ("base/synth/tarq/q3_k", "base/synth/gptq/q3_k") in pairs
    assert ("base/synth/gptq/q3_k", "base/-/ggml/q3_k") in pairs  # a later baseline against an earlier one
    assert ("base/-/ggml/q3_k", "base/synth/gptq/q3_k") not in pairs  # ... not the other way round
    assert not any(a.split("/")[3] != b.split("/")[3] for a, b in pairs)  # only within a type
    tarq_vs_ggml = next(d for d in tf["differences"]
                        if (d["model"], d["versus"]) == ("base/synth/tarq/q3_k", "base/-/ggml/q3_k"))
    assert tarq_vs_ggml["kld_rare"]["value"] < 0  # TARQ's fake figures are lower
    rows = {r["cell"]: r for r in report["frontier"]}
    assert rows["base/-/f16/f16"]["kld_rare"] is None and rows["base/-/f16/f16"]["type_bpw"] == 16
    assert rows["base/synth/tarq/q3_k"]["type_bpw"] == pytest.approx(3.4375)
    assert rows["base/synth/tarq/q3_k"]["file_mib"] == 35
    assert rows["base/-/ggml/q3_k"]["kld_rare"] > rows["base/synth/tarq/q3_k"]["kld_rare"] > 0
    markdown = render_sweep_markdown(report)
    assert "## The size / quality frontier" in markdown and "| base | test | whisper.cpp | q3_k | tarq | 35.0 | 3.438 |" in markdown
    png = size_quality_png(report["frontier"])
    assert png and png.startswith(b"\x89PNG")


def test_cells_decoded_by_two_backends_are_compared_within_each(tmp_path):
    path = _write(tmp_path)
    path.write_text(path.read_text() + '\n[eval]\nbackends = ["whisper.cpp", "torch"]\n')
    sweep, cells, steps = sweep_plan(path)
    assert sweep.backends == ("whisper.cpp", "torch")
    assert all(steps[c.steps["eval"]].params["tokenizer"] == "packaged:base" for c in cells)  # torch reads the .bin
    results = _fake_results(tmp_path, cells, steps)
    for cell in cells:  # each backend's lines carry its key, as eval writes them; torch drops one more word
        path = Path(results[cell.steps["eval"]].outputs["utterances"])
        lines = []
        for line in path.read_text().splitlines():
            row = json.loads(line)
            lines.append(json.dumps({**row, "model": f"{cell.name} [whisper.cpp]"}))
            shorter = " ".join(row["hypothesis"].split()[:-1])
            lines.append(json.dumps({**score_utterance(row["id"], row["reference"], shorter).record(),
                                     "dataset": "test", "model": f"{cell.name} [torch]"}))
        path.write_text("\n".join(lines) + "\n")
    report = build_sweep_report(sweep, SweepRun(cells, steps, results))
    dataset = report["models"][0]["evaluation"]["datasets"][0]
    assert {m["backend"] for m in dataset["models"]} == {"whisper.cpp", "torch"}
    agreement = {row["label"]: row for row in dataset["backend_agreement"]}
    assert agreement["base/synth/tarq/q3_k"]["identical"] == 0  # every torch text lost a word
    assert all(" [torch]" in d["model"] and " [torch]" in d["versus"] or " [whisper.cpp]" in d["model"]
               and " [whisper.cpp]" in d["versus"] for d in dataset["differences"])
    torch_rows = [r for r in dataset["models"] if r["backend"] == "torch"]
    cpp_rows = {r["label"]: r for r in dataset["models"] if r["backend"] == "whisper.cpp"}
    assert all(r["wer"]["value"] > cpp_rows[r["label"]]["wer"]["value"] for r in torch_rows)


@pytest.mark.parametrize("backends", ['["crispasr"]', "[]", '["torch", "torch"]'])
def test_backends_outside_the_target_are_refused(tmp_path, backends):
    path = _write(tmp_path)
    path.write_text(path.read_text() + f"\n[eval]\nbackends = {backends}\n")
    with pytest.raises(UserError, match=r"\[eval\] backends must list distinct backends among whisper.cpp, torch"):
        load_sweep(path)


def test_a_group_size_is_a_coordinate_of_the_type_axis(tmp_path):
    """q4_0-g128 is a q4_0 file calibrated with one scale per 128 columns: its own cells, quantized with
    --group-size 128, paired with the baseline's q4_0-g128 cell, and counted at q4_0's bits per weight."""
    from tarq_deploy.sweep.report import type_bits_per_weight

    path = _write(tmp_path)
    path.write_text(path.read_text().replace('["ggml", "gptq", "tarq"]', '["rtn", "gptq", "tarq"]')
                    .replace('["q3_k", "q4_0"]', '["q4_0-g128", "q4_0"]').replace('["ggml", "gptq"]', '"rtn"'))
    sweep, cells, steps = sweep_plan(path)
    grouped = [c for c in cells if c.type == "q4_0-g128"]
    assert [c.method for c in grouped] == ["rtn", "gptq", "tarq"]
    for cell in grouped:
        params = steps[cell.steps["quantize"]].params
        assert params["type"] == "q4_0" and params["group_size"] == 128
    native = [c for c in cells if c.type == "q4_0" and c.method != "f16"]
    assert all("group_size" not in steps[c.steps["quantize"]].params for c in native)
    assert len({c.steps["quantize"] for c in cells if "quantize" in c.steps}) == 6
    assert type_bits_per_weight("q4_0-g128") == type_bits_per_weight("q4_0") == 4.5


@pytest.mark.parametrize("types, methods, quantize, message", [
    ('["q4_0-g48"]', '["gptq"]', "", "TYPE-gN with N one of"),
    ('["q4_k-g128"]', '["gptq"]', "", "a group size is for the symmetric types"),
    ('["q4_0-g128"]', '["ggml", "gptq"]', "", "ggml run ggml's own quantizer"),
    ('["q4_0-g128"]', '["gptq"]', "\n[quantize]\ngroup_size = 64\n", "both set a group size"),
])
def test_bad_group_sizes_are_named(tmp_path, types, methods, quantize, message):
    path = _write(tmp_path, baseline='"gptq"')
    path.write_text(path.read_text().replace('["q3_k", "q4_0"]', types).replace('["ggml", "gptq", "tarq"]', methods)
                    + quantize)
    with pytest.raises(UserError, match=message):
        load_sweep(path)


def _fake_bench(tmp_path: Path, cells, results: dict[str, StepResult]) -> dict:
    """A bench of every exported file as `tarq-deploy bench` writes it (medians per cell), at 1 and 2 threads: the
    smaller the file, the faster; one row failed (its file is missing from the table, not invented)."""
    rows = []
    for cell in cells:
        file = results[cell.steps["export"]].outputs["file"]
        mib = int(results[cell.steps["export"]].outputs["bytes"]) / 2**20
        for threads in (1, 2):
            latency = mib / 100 / threads
            failed = cell.method == "gptq" and cell.type == "q4_0" and threads == 2
            rows.append({"model": "/elsewhere/" + Path(file).name, "audio_label": "jfk", "threads": threads,
                         "status": "error" if failed else "ok", "error": "boom" if failed else None,
                         "summary": {"transcribe_s": {"median": latency}, "rtf": {"median": latency / 11},
                                     "peak_rss_mb": {"median": 50 + mib}}})
    return {"cells": rows}


def test_the_frontier_carries_each_files_bench_figures_and_plots_latency(tmp_path):
    """The bench's medians join the frontier by the file's name (the sweep's folder may have moved since), one column
    per thread count; a failed bench row leaves its cell's column empty."""
    sweep, cells, steps = sweep_plan(_write(tmp_path, steps='["quantize", "export", "eval", "score", "bench"]'))
    results = _fake_results(tmp_path, cells, steps)
    bench_file = tmp_path / "bench.json"
    bench_file.write_text(json.dumps(_fake_bench(tmp_path, cells, results)))
    bench_key = cells[0].steps["bench"]
    results[bench_key] = StepResult("bench", bench_key, "done", {"bench": str(bench_file)})
    report = build_sweep_report(sweep, SweepRun(cells, steps, results))
    report["models"][0]["bench"] = json.loads(bench_file.read_text())  # cpu_markdown's fields are not faked
    report["frontier"] = frontier_rows(report)
    rows = {r["cell"]: r for r in report["frontier"]}
    tarq = {(s["audio"], s["threads"]): s for s in rows["base/synth/tarq/q3_k"]["speed"]}
    assert tarq[("jfk", 1)]["latency_s"] == pytest.approx(0.35) and tarq[("jfk", 2)]["latency_s"] == pytest.approx(0.175)
    assert tarq[("jfk", 1)]["max_rss_mb"] == pytest.approx(85)
    assert len(rows["base/synth/gptq/q4_0"]["speed"]) == 1  # its 2-thread row failed
    lines = [line for line in render_frontier(report["frontier"]) if line.startswith("| ")]
    assert lines[0].endswith("| latency s jfk 1t | latency s jfk 2t | RTF jfk 1t | RTF jfk 2t | max-RSS MB jfk 1t |"
                             " max-RSS MB jfk 2t |")
    gptq_row = next(line for line in lines if "| q4_0 | gptq |" in line)
    assert gptq_row.endswith("| 0.440 | — | 0.040 | — | 94 | — |")
    png = size_quality_png(report["frontier"])
    assert png and png.startswith(b"\x89PNG")


def test_a_frontier_without_a_bench_has_no_speed_columns(tmp_path):
    sweep, cells, steps = sweep_plan(_write(tmp_path))
    report = build_sweep_report(sweep, SweepRun(cells, steps, _fake_results(tmp_path, cells, steps)))
    rows = frontier_rows(report)
    assert all(r["speed"] == [] for r in rows)
    header = next(line for line in render_frontier(rows) if line.startswith("| model"))
    assert header.endswith("| KLD rare | KLD common |")
