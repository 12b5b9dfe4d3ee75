"""The lookup pass (quant/pipeline.py quantize_with_lookup_pass; `quantize --lookup-pass`): Whisper calibrated twice,
the second time with the first head's lattice as the quantized stream's token lookup, keeping the first head.

Whether it helps is measured in results/lookup-pass (dev split) and checked on the real clips in
tests/test_grid_whisper_cpp_2bit.py (IQ2_XS); here: which stream looks up in which table, what each pass contributes to
the checkpoint, the work directory, and the option's resolution and refusals."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tarq_deploy.data.corpus import Utterance
from tarq_deploy.data.real_clips import all_real_clips
from tarq_deploy.formats.model_loader import load_whisper
from tarq_deploy.models.whisper import WhisperBackbone
from tarq_deploy.quant.backbone import STREAM_KIND, Window
from tarq_deploy.calibration.options import QuantizeOptions
from tarq_deploy.calibration import pipeline
from tarq_deploy.calibration.pipeline import quantize_backbone, quantize_with_lookup_pass
from tarq_deploy.quant.precision import freed_memory_held

pytestmark = pytest.mark.usefixtures("one_torch_thread")
HEAD = WhisperBackbone.tied_head


def tiny_en() -> WhisperBackbone:
    return WhisperBackbone(*load_whisper("packaged:tiny.en"))


def test_only_the_quantized_stream_looks_up_in_the_quantized_table() -> None:
    backbone = tiny_en()
    decoder = backbone.stages()[1]
    ids = torch.tensor([[50257, 50362, 400, 1049]])
    window = Window(inputs={"decoder_input_ids": ids}, masks={})
    positions = backbone.model.model.decoder.embed_positions.weight[:4].float()
    table = backbone.model.model.decoder.embed_tokens.weight.float()
    own = (table[ids] + positions).float()
    assert torch.equal(decoder.enter(window, {STREAM_KIND: "q"}).float(), own)  # no lookup given: the model's own
    backbone.quantized_lookup = torch.full_like(table, 0.5)
    assert torch.equal(decoder.enter(window, {STREAM_KIND: "q"}).float(), (0.5 + positions)[None])
    for stream in ({STREAM_KIND: "fp"}, {}):  # the fp stream, and the alignment pass's streams (no kind)
        assert torch.equal(decoder.enter(window, stream).float(), own)


def test_the_second_pass_recalibrates_the_decoder_against_the_first_head(tmp_path: Path, monkeypatch) -> None:
    """The checkpoint: the encoder as one pass makes it (the lookup does not reach it), the decoder blocks of the
    second pass (calibrated against another lookup, so other codes), the head of the first pass (which is what one
    pass makes, with its log record); each pass resumes from its own folder of the work directory; both passes
    calibrate inside one precision.freed_memory_returned block, which takes glibc's 4 MB mmap threshold once resident
    memory passes its mark (set to 1 byte here: at the first check, after the windows) and keeps it for both."""
    clips = [Utterance(c.id, str(c.path), c.text) for c in all_real_clips()[:3]]
    options = QuantizeOptions(method="tarq", n_calib=3)
    single, _ = quantize_backbone(tiny_en(), clips, options, "packaged:tiny.en", log=lambda _: None)
    loads = []

    def load() -> WhisperBackbone:
        loads.append(tiny_en())
        return loads[-1]

    work = tmp_path / "out.partial"
    threshold_held, said = [], []

    def calibrate(*args, **kwargs):
        threshold_held.append(freed_memory_held())
        return calibrate_as_is(*args, **kwargs)

    calibrate_as_is = pipeline._calibrate
    monkeypatch.setattr(pipeline, "_calibrate", calibrate)
    monkeypatch.setattr(pipeline, "_scarce_from", lambda _model, _options: 1)  # tiny.en never nears half the budget
    twice, timing = quantize_with_lookup_pass(load, clips, QuantizeOptions(method="tarq", n_calib=3, lookup_pass=True),
                                              "packaged:tiny.en", work, log=said.append)
    assert len(loads) == 2 and loads[0].quantized_lookup is None
    assert threshold_held == [True, True] and not freed_memory_held()
    assert [line.split(" after ")[1] for line in said if "resident memory past the mark" in line] == [
        "windows: freed tensors go back to the system from here on (glibc's 4 MB mmap threshold)"]
    assert torch.equal(loads[1].quantized_lookup, single.quantized[HEAD].dequantize())
    assert sorted(p.name for p in work.iterdir()) == ["pass1", "pass2"]
    codes = {name: torch.equal(q.codes, single.quantized[name].codes) for name, q in twice.quantized.items()}
    assert all(same for name, same in codes.items() if ".encoder." in name)
    assert codes[HEAD]
    assert not all(same for name, same in codes.items() if ".decoder." in name)
    head_record = next(r for r in single.metadata["layers"] if r["name"] == "proj_out")
    assert head_record in twice.metadata["layers"]
    assert twice.metadata["method"]["lookup_pass"] is True and "lookup_pass" not in single.metadata["method"]
    assert twice.metadata["lookup_pass"] == {"head": "the first calibration's", "recalibrated": ["decoder"]}
    assert timing["seconds"] > timing["lookup_pass"]["first_pass"]["seconds"] > 0

    # The second pass starts from the first's encoder: the same bytes as a whole second calibration with the lookup
    reference = tiny_en()
    reference.quantized_lookup = single.quantized[HEAD].dequantize()
    whole, _ = quantize_backbone(reference, clips, options, "packaged:tiny.en", log=lambda _: None)
    for name, q in twice.quantized.items():
        if name != HEAD:
            assert torch.equal(q.codes, whole.quantized[name].codes), name
            assert all(torch.equal(v, whole.quantized[name].params()[k]) for k, v in q.params().items()), name


def _lookup_pass(method: str, type_name: str | None, lookup_pass: str = "auto") -> bool:
    from helpers import quantize_options_for

    return quantize_options_for(method=method, type=type_name, lookup_pass=lookup_pass).lookup_pass


def test_auto_is_on_where_the_dev_split_measured_it_and_a_choice_given_wins() -> None:
    assert _lookup_pass("tarq", "iq2_xs") is True
    for method, type_name in (("gptq", "iq2_xs"), ("tarq", "iq2_s"), ("tarq", "q4_0"), ("tarq", None)):
        assert _lookup_pass(method, type_name) is False
    assert _lookup_pass("gptq", "q4_0", "on") is True
    assert _lookup_pass("tarq", "iq2_xs", "off") is False


@pytest.mark.parametrize("extra, problem", [
    (["--method", "rtn"], "--lookup-pass on: method 'rtn'"),
    (["--method", "imatrix", "--calib", "x.jsonl"], "--lookup-pass on: method 'imatrix'"),
])
def test_a_lookup_pass_without_a_calibration_is_refused_in_one_line(tmp_path: Path, extra, problem) -> None:
    out = tmp_path / "out"
    run = subprocess.run([sys.executable, "-m", "tarq_deploy.cli", "quantize", "--model", "packaged:tiny.en",
                          "--lookup-pass", "on", *extra, "--out", str(out)], capture_output=True, text=True,
                         cwd=tmp_path, timeout=300)
    assert run.returncode == 2 and problem in run.stderr and len(run.stderr.strip().splitlines()) == 1, run.stderr
    assert not out.exists()
