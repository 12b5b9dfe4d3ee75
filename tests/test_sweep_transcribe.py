"""The sweep on target transcribe.cpp, without running a model: its presets (q4_k_m, q5_k_m) and [mixes] are types
of the grid, each quantized with --type BODY and its --tensor-type values; [sweep] type_methods limits which methods
make a type; the F16 reference is a .gguf export; bad values are refused with one line naming the file and the key."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from tarq_deploy.errors import UserError
from tarq_deploy.sweep import steps as sweep_steps
from tarq_deploy.sweep.plan import load_sweep
from tarq_deploy.sweep.report import frontier_rows
from tarq_deploy.sweep.steps import StepResult
from helpers import sweep_plan  # the plan of a sweep file, over placeholder hashes

SWEEP = """
[sweep]
target = "transcribe.cpp"
methods = ["ggml", "tarq"]
types = ["q8_0", "q4_k_m", "q4_k-emb_q6_k"]
type_methods = { q8_0 = ["ggml"] }
baseline = "ggml"
steps = ["quantize", "export", "verify", "eval", "score"]

[mixes]
"q4_k-emb_q6_k" = { type = "q4_k", tensor_type = ["^proj_out\\\\.weight$=q6_k"] }

[models]
base = "packaged:base"

[calibration]
synth = { manifest = "calib.jsonl", n = 128 }

[evaluation]
test = "test.jsonl"
"""


def _write(tmp_path: Path, text: str = SWEEP) -> Path:
    for name in ("calib.jsonl", "test.jsonl"):
        (tmp_path / name).write_text(json.dumps({"id": "u1", "audio": "x.wav", "text": "a word"}) + "\n")
    path = tmp_path / "sweep.toml"
    path.write_text(text)
    return path


def test_plan_presets_and_mixes_are_types_of_the_grid(tmp_path):
    sweep, cells, steps = sweep_plan(_write(tmp_path))
    assert sweep.runtime == "transcribe.cpp" and sweep.backends == ("transcribe.cpp",)
    assert [c.name for c in cells] == ["base/-/f16/f16", "base/-/ggml/q8_0", "base/-/ggml/q4_k_m",
                                       "base/-/ggml/q4_k-emb_q6_k", "base/synth/tarq/q4_k_m",
                                       "base/synth/tarq/q4_k-emb_q6_k"]  # q8_0 by ggml only
    quantize = {c.name: steps[c.steps["quantize"]].params for c in cells if "quantize" in c.steps}
    assert quantize["base/-/ggml/q4_k_m"]["type"] == "q4_k"
    assert quantize["base/-/ggml/q4_k_m"]["tensor_type"] == ["q4_k_m"]
    assert quantize["base/synth/tarq/q4_k-emb_q6_k"]["tensor_type"] == ["^proj_out\\.weight$=q6_k"]
    assert "tensor_type" not in quantize["base/-/ggml/q8_0"]  # a plain type's key is what it was before mixes
    assert all("group_size" not in p for p in quantize.values())
    reference = steps[cells[0].steps["export"]].params
    assert reference["target"] == "transcribe.cpp" and reference["type"] == "f16"


def test_plan_quantize_step_passes_type_and_tensor_types(tmp_path, monkeypatch):
    _, cells, steps = sweep_plan(_write(tmp_path))
    calls = []
    monkeypatch.setattr(sweep_steps, "_tarq_deploy", lambda args, folder, cpus: calls.append(args))
    mix = next(c for c in cells if c.name == "base/synth/tarq/q4_k-emb_q6_k")
    sweep_steps._quantize(steps[mix.steps["quantize"]], tmp_path, [], 1)
    argv = calls[0]
    assert argv[argv.index("--target") + 1] == "transcribe.cpp" and argv[argv.index("--type") + 1] == "q4_k"
    assert argv[argv.index("--tensor-type") + 1] == "^proj_out\\.weight$=q6_k"
    assert "--group-size" not in argv


def test_plan_export_suffix_is_gguf(tmp_path, monkeypatch):
    _, cells, steps = sweep_plan(_write(tmp_path))
    calls = []

    def export(args, folder, cpus):  # stands for the command: writes the file it is told to
        calls.append(args)
        Path(args[args.index("-o") + 1]).write_bytes(b"GGUF")

    monkeypatch.setattr(sweep_steps, "_tarq_deploy", export)
    outputs = sweep_steps._export(steps[cells[0].steps["export"]], tmp_path, [], 1)
    assert outputs["file"].endswith(".gguf") and calls[0][:3] == ["export", "--target", "transcribe.cpp"]


def test_plan_report_counts_a_mix_at_its_body_types_bits(tmp_path):
    figures = {k: {"value": 0.1} for k in ("wer", "rare_wer", "capped_wer", "capped_rare_wer")}
    row = {"label": "base/-/ggml/q4_k_m", "key": "base/-/ggml/q4_k_m", "backend": "transcribe.cpp", "loops": 0,
           "source": "base-ggml-q4_k_m.gguf", **figures}
    report = {"sweep": {"bodies": {"q4_k_m": "q4_k"}}, "cells": [{"cell": "base/-/ggml/q4_k_m", "file_mib": 54.0}],
              "models": [{"model": "base", "evaluation": {"datasets": [{"name": "test", "models": [row]}]}}]}
    assert frontier_rows(report)[0]["type_bpw"] == 4.5


@pytest.mark.parametrize("old, new, message", [
    ('target = "transcribe.cpp"', 'target = "whisper.cpp"', r"\[mixes\]: target 'whisper.cpp' holds one type"),
    ('"q4_k-emb_q6_k"]\n', '"q3_k_m"]\n', r"types: unknown type 'q3_k_m' .*presets q4_k_m, q5_k_m"),
    ('type = "q4_k", tensor', 'type = "q4_k_x", tensor', r"\[mixes\] q4_k-emb_q6_k: type 'q4_k_x'"),
    ('weight$=q6_k"', 'weight$=q9_k"', r"\[mixes\] q4_k-emb_q6_k: tensor_type .*unknown type"),
    ('tensor_type = [', 'tensor_types = [', r"\[mixes\] q4_k-emb_q6_k: unknown key `tensor_types`"),
    ('"q4_k-emb_q6_k" = {', '"q4_0" = {', r"\[mixes\] q4_0: a mix needs a name of its own"),
    ('q8_0 = ["ggml"]', 'q8_0 = ["gptq"]', r"type_methods: q8_0: 'gptq' is not one of"),
    ('q8_0 = ["ggml"]', 'q6_k = ["ggml"]', r"type_methods: 'q6_k' is not one of \[sweep\] types"),
    ('q8_0 = ["ggml"]', 'q8_0 = []', "type_methods: q8_0 must be a non-empty list"),
    ('[evaluation]', '[quantize]\ntensor_type = "q4_k_m"\n\n[evaluation]', r"\[quantize\]: `tensor_type` is set"),
])
def test_plan_bad_transcribe_choices_are_named(tmp_path, old, new, message):
    assert old in SWEEP
    with pytest.raises(UserError, match=message) as refused:
        load_sweep(_write(tmp_path, SWEEP.replace(old, new)))
    assert "sweep.toml" in str(refused.value) and "\n" not in str(refused.value)


def test_plan_a_preset_needs_transcribe_cpp(tmp_path):
    text = SWEEP.replace('target = "transcribe.cpp"', 'target = "crispasr"').replace(
        '"q4_k-emb_q6_k"]\n', '"q4_k_m"]\n').replace('"q4_k-emb_q6_k" = { type', '"m" = { type')
    with pytest.raises(UserError, match=r"types: 'q4_k_m' is transcribe.cpp's preset"):
        load_sweep(_write(tmp_path, text))
