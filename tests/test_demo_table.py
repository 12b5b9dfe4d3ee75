"""The demo's final table, rendered from an eval report made by the real report code (the demo itself runs for
minutes; `make demo` is its end-to-end check)."""
from __future__ import annotations

import json
from pathlib import Path

from tarq_deploy.commands.demo import final_table
from tarq_deploy.evaluate.report import DatasetRuns, ModelRun, ReportOptions, build_report
from tarq_deploy.evaluate.wer import score_utterance


def test_final_table_has_every_model_with_capped_wer_and_loops(tmp_path: Path) -> None:
    reference = "the abbot of dunfermline spoke"
    hypotheses = {"f16": reference, "tarq": "the abbot of dunfermline spoke",
                  "gptq": "the abbot of the the the the the the the the"}
    runs = [ModelRun(f"{label} [whisper.cpp]", label, "whisper.cpp", f"{label}.bin",
                     [score_utterance("u0", reference, text)], 1.0, 3.0) for label, text in hypotheses.items()]
    report = build_report([DatasetRuns("synth", "eval.jsonl", runs)], ReportOptions(n_resamples=20))
    (tmp_path / "eval").mkdir()
    (tmp_path / "eval" / "report.json").write_text(json.dumps(report))
    files = {}
    for label in hypotheses:
        files[label] = tmp_path / f"{label}.bin"
        files[label].write_bytes(b"\0" * 2**20)
    table = final_table(tmp_path, files, 125.0)
    rows = {line.split()[0]: line.split() for line in table.splitlines() if line.split()[:1] in (["f16"], ["tarq"],
                                                                                                  ["gptq"])}
    assert rows["f16"][1:] == ["1.0", "0.0%", "0.0%", "0.0%", "0"]  # file MiB, WER, rare-WER, capped WER, loops
    assert rows["gptq"][-1] == "1" and rows["gptq"][4] == "100.0%"  # the loop is counted; capped at the reference
    assert "finished in 2.1 min" in table and "publish staging" in table


def test_final_table_shows_teacher_forced_figures_and_retention(tmp_path: Path) -> None:
    import torch

    from tarq_deploy.evaluate.teacher_forced import token_figures

    reference = "the abbot of dunfermline spoke"
    hypotheses = {"f16": reference, "tarq": "the abbot of dunfermline spoke", "gptq": "the abbot of dumb line spoke"}
    runs = [ModelRun(f"{label} [whisper.cpp]", label, "whisper.cpp", f"{label}.bin",
                     [score_utterance("u0", reference, text)], 1.0, 3.0) for label, text in hypotheses.items()]
    p = torch.log(torch.tensor([[0.5, 0.5]]))
    q = torch.log(torch.tensor([[0.9, 0.1]]))
    figures = {"tarq": [token_figures(p, p, torch.tensor([0]), torch.tensor([True]), "u0")],
               "gptq": [token_figures(p, q, torch.tensor([0]), torch.tensor([True]), "u0")]}
    report = build_report([DatasetRuns("synth", "eval.jsonl", runs, teacher_forced=figures)],
                          ReportOptions(n_resamples=20, reference="f16"))
    (tmp_path / "eval").mkdir()
    (tmp_path / "eval" / "report.json").write_text(json.dumps(report))
    files = {label: tmp_path / f"{label}.bin" for label in hypotheses}
    for path in files.values():
        path.write_bytes(b"\0" * 1024)
    table = final_table(tmp_path, files, 60.0).splitlines()
    tarq = next(line for line in table if line.startswith("tarq") and "[" in line)
    gptq = next(line for line in table if line.startswith("gptq") and "[" in line)
    assert tarq.split()[1] == "0.0000" and "100.0%" in tarq  # identical distributions; keeps F16's rare word
    assert float(gptq.split()[1]) > 0.1 and "0.0%" in gptq  # dunfermline lost
