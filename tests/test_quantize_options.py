"""quantize's options schema (calibration/options.py): the command line and the sweep read one list of options; a
quantize resolves its source once; an importance file made for another model is refused naming the tensor."""

from __future__ import annotations

import argparse
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import assert_user_error, quantize_options_for, run_cli

from tarq_deploy import model_source
from tarq_deploy.calibration.options import QuantizeArguments, option_value_problem, quantize_options
from tarq_deploy.commands import quantize
from tarq_deploy.errors import UserError


def test_the_command_line_is_built_from_the_schema() -> None:
    parser = argparse.ArgumentParser()
    quantize.add_arguments(parser)
    dests = {a.dest for a in parser._actions if a.option_strings} - {"help", "out"}
    assert dests == {name for name, _, _ in quantize_options()}
    parsed = QuantizeArguments.from_values(vars(parser.parse_args(["--model", "m", "--out", "o"])))
    assert parsed == QuantizeArguments(model="m")  # the parser's defaults are the schema's


@pytest.mark.parametrize("name, value, problem", [
    ("no_pack", False, "false is the default"), ("act_order", "yes", "is a flag"), ("seed", [1], "takes one value"),
    ("pool", "best", "is not one of"), ("max_memory", "lots", "expected a size"), ("seed", "x", "not a valid value"),
])
def test_a_table_value_is_read_as_the_command_reads_it(name, value, problem) -> None:
    option = dict((n, o) for n, o, _ in quantize_options())[name]
    assert problem in option_value_problem(option, value)
    assert option_value_problem(dict((n, o) for n, o, _ in quantize_options())["act_order"], False) is None


def test_the_schema_refuses_what_the_command_refused() -> None:
    with pytest.raises(UserError, match="^--bits 3: --type q4_0 stores 4-bit codes"):
        quantize_options_for(method="gptq", type="q4_0", bits=3)
    with pytest.raises(UserError, match="^--calib is required for method 'tarq'"):
        quantize_options_for(method="tarq", calib=None)
    with pytest.raises(UserError, match="^--tensor-type q4_k_m: the presets are transcribe.cpp's"):
        quantize_options_for(method="gptq", tensor_type=("q4_k_m",))
    assert quantize_options_for(method="rtn").refit_scales is True  # the one default, also the solver's
    assert quantize_options_for(method="rtn").solver().refit_scales is True


def test_a_sweep_cell_the_schema_refuses_fails_when_the_file_is_read(tmp_path: Path) -> None:
    from tarq_deploy.sweep.plan import load_sweep

    sweep = tmp_path / "sweep.toml"
    sweep.write_text(textwrap.dedent("""
        [sweep]
        methods = ["rtn"]
        types = ["q4_0"]
        steps = ["quantize", "export"]
        [models]
        tiny = "packaged:tiny.en"
        [quantize]
        bits = 3
    """))
    with pytest.raises(UserError, match=r"cell tiny / rtn / q4_0: --bits 3: --type q4_0 stores 4-bit codes"):
        load_sweep(sweep)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a device this machine lacks")
def test_a_sweep_leaves_the_device_to_the_node_and_quantize_asks_it_of_this_machine(tmp_path: Path) -> None:
    """A GPU cell is planned on a head without CUDA (it runs on the node that declares a GPU); the same options
    given to quantize here are refused, before anything is loaded."""
    from tarq_deploy.sweep.plan import load_sweep

    sweep = tmp_path / "sweep.toml"
    sweep.write_text(textwrap.dedent("""
        [sweep]
        methods = ["rtn"]
        types = ["q4_0"]
        steps = ["quantize"]
        [models]
        tiny = "packaged:tiny.en"
        [quantize]
        device = "cuda"
    """))
    assert load_sweep(sweep).quantize_options["device"] == "cuda"
    options = quantize_options_for("packaged:tiny.en", method="rtn", type="q4_0", device="cuda")
    with pytest.raises(UserError, match="--device cuda"):
        options.check_machine()


@pytest.fixture(scope="module")
def tiny_transformers(tmp_path_factory) -> Path:
    """Whisper tiny.en saved as a transformers folder (config.json + safetensors)."""
    from tarq_deploy.formats.model_loader import load_whisper

    model, processor, generation_config = load_whisper("packaged:tiny.en")
    folder = tmp_path_factory.mktemp("tiny-hf") / "tiny.en"
    model.save_pretrained(folder)
    processor.save_pretrained(folder)
    generation_config.save_pretrained(folder)
    return folder


def test_a_quantize_resolves_its_source_once_and_reads_its_config_once(tiny_transformers, tmp_path, capsys,
                                                                       monkeypatch) -> None:
    looks, configs = [], []
    resolve, read_config = model_source._resolved_text, model_source._config_model_type
    monkeypatch.setattr(model_source, "_resolved_text", lambda text: looks.append(text) or resolve(text))
    monkeypatch.setattr(model_source, "_config_model_type", lambda path: configs.append(path) or read_config(path))
    status, _, err = run_cli(capsys, "quantize", "--model", tiny_transformers, "--method", "rtn", "--type", "q4_0",
                             "--rotate", "auto", "--lookup-pass", "auto", "-o", tmp_path / "out")
    assert status == 0, err
    assert looks == [str(tiny_transformers)]  # every "is it Whisper?" asked of that one resolution
    assert configs == [tiny_transformers / "config.json"]


def _importance_file(path: Path, widths: dict[str, int]) -> Path:
    from tarq_deploy.formats.imatrix_gguf import Imatrix, write_imatrix

    imatrix = Imatrix(datasets=["calib.jsonl"], chunk_count=1)
    for name, width in widths.items():
        imatrix.add(name, np.ones(width, dtype=np.float32), 1.0)
    return write_imatrix(imatrix, path)


@pytest.fixture(scope="module")
def tiny_widths() -> dict[str, int]:
    """tiny.en's calibrated weights and their input widths."""
    from tarq_deploy.formats.backbones import load_backbone

    backbone = load_backbone("packaged:tiny.en")
    return {f"{block.full_name(rel)}.weight": block.linear(rel).in_features
            for stage in backbone.stages() for block in stage.blocks for group in block.groups for rel in group}


WIDENED = "model.encoder.layers.0.self_attn.q_proj.weight"


@pytest.mark.parametrize("change, fragments", [
    ("widen", [f"tensor {WIDENED} has 512 importance values, the model's Linear has 384 input columns",
               "made for another model"]),
    ("drop", [f"holds no importance for tensor {WIDENED}", "made for another model"]),
])
def test_an_importance_file_of_another_model_is_refused_naming_the_tensor(tiny_widths, tmp_path, capsys, change,
                                                                          fragments) -> None:
    """A base-sized entry (512 wide) or a missing one: exit 2 naming the file and the tensor, nothing written (it was
    exit 3, "importance must be 384 finite non-negative values", from inside ggml's quantizer)."""
    widths = dict(tiny_widths)
    if change == "widen":
        widths[WIDENED] = 512
    else:
        del widths[WIDENED]
    file = _importance_file(tmp_path / "other.imatrix.gguf", widths)
    out = tmp_path / "out"
    status, _, err = run_cli(capsys, "quantize", "--model", "packaged:tiny.en", "--method", "imatrix", "--type",
                             "q4_0", "--imatrix", file, "-o", out)
    assert_user_error(status, err, f"--imatrix {file}", *fragments)
    assert sorted(p.name for p in tmp_path.iterdir()) == [file.name]  # no OUT, OUT.partial, log or lock
