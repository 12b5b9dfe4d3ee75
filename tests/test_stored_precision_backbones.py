"""Qwen3-ASR and Voxtral sources stored in bfloat16, as the hub's are (issue 37 item 4): ``load_backbone`` holds them in
bfloat16 (half a float32 copy's memory: Voxtral-Mini-3B is 9.4 GB so, not 19 GB) and calibration computes with a
float32 copy's arithmetic, so a bfloat16 folder gives byte for byte the lattice of the same values saved in float32,
and its exported files hold the same lattice bytes (a GGUF file is the same file).
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tarq_deploy.cli import main as cli
from tarq_deploy.checkpoint import save_checkpoint
from tarq_deploy.data.corpus import Utterance
from tarq_deploy.models import qwen3_asr_shapes, voxtral_shapes
from tarq_deploy.formats.backbones import load_backbone
from tarq_deploy.calibration.options import QuantizeOptions
from tarq_deploy.calibration.pipeline import quantize_backbone

pytestmark = pytest.mark.usefixtures("one_torch_thread")

CLIP_SUFFIXES = ("0870", "0930")  # rare words: dashwood, prudently | amiable


def bfloat16_values(model: torch.nn.Module) -> torch.nn.Module:
    """Every floating parameter and buffer rounded to bfloat16 values (kept in float32): the two folders then hold
    the same numbers, so any difference in the lattices comes from how they are held and computed."""
    with torch.no_grad():
        for tensor in [*model.parameters(), *model.buffers()]:
            if tensor.is_floating_point():
                tensor.copy_(tensor.to(torch.bfloat16).float())
    return model


def save_both(model: torch.nn.Module, processor, root: Path) -> dict[str, Path]:
    folders = {"float32": root / "float32", "bfloat16": root / "bfloat16"}
    model.save_pretrained(folders["float32"])
    model.to(torch.bfloat16).save_pretrained(folders["bfloat16"])
    for folder in folders.values():
        processor.save_pretrained(folder)
    return folders


@pytest.fixture(scope="module")
def qwen3_folders(tmp_path_factory) -> dict[str, Path]:
    from transformers import AutoTokenizer

    model = bfloat16_values(qwen3_asr_shapes.random_model(qwen3_asr_shapes.tiny_config()))
    tokenizer = AutoTokenizer.from_pretrained(qwen3_asr_shapes.qwen_tokenizer_dir())
    return save_both(model, qwen3_asr_shapes.processor_for(tokenizer), tmp_path_factory.mktemp("qwen3_stored"))


@pytest.fixture(scope="module")
def voxtral_folders(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("voxtral_stored")
    model, processor = voxtral_shapes.load_tiny_voxtral(voxtral_shapes.write_tiny_voxtral(root / "source"))
    return save_both(bfloat16_values(model), processor, root)


@pytest.fixture(scope="module")
def corpus(librivox_clips) -> list[Utterance]:
    chosen = [Utterance(Path(path).stem, path, text) for path, text in librivox_clips
              if Path(path).stem.endswith(CLIP_SUFFIXES)]
    assert len(chosen) == len(CLIP_SUFFIXES)
    return chosen


def held(model: torch.nn.Module) -> dict[str, torch.dtype]:
    return {name: p.dtype for name, p in model.named_parameters()}


def held_bytes(model: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def calibrated(folder: Path, corpus: list[Utterance], group_size: int):
    """(bytes the loaded weights hold, whether every parameter kept its dtype through calibration, checkpoint)."""
    backbone = load_backbone(str(folder))
    before, size = held(backbone.model), held_bytes(backbone.model)
    options = QuantizeOptions(method="tarq", group_size=group_size, n_calib=len(corpus))
    checkpoint, _ = quantize_backbone(backbone, corpus, options, str(folder), log=lambda _: None)
    return size, held(backbone.model) == before, checkpoint


def assert_same_lattice(a, b) -> None:
    assert a.quantized.keys() == b.quantized.keys() and a.quantized
    for name, q in a.quantized.items():
        assert torch.equal(q.codes, b.quantized[name].codes), name
        assert torch.equal(q.scales, b.quantized[name].scales), name


@pytest.mark.parametrize("architecture", ["qwen3_asr", "voxtral"])
def test_a_bfloat16_source_is_held_in_bfloat16_and_calibrates_to_the_float32_lattice(
        architecture, qwen3_folders, voxtral_folders, corpus, tmp_path, capsys):
    folders, group_size, target = {"qwen3_asr": (qwen3_folders, 32, "qwen3-asr.cpp"),
                                   "voxtral": (voxtral_folders, 128, "gptq")}[architecture]
    size_32, _, reference = calibrated(folders["float32"], corpus, group_size)
    size_16, kept_dtypes, stored = calibrated(folders["bfloat16"], corpus, group_size)
    # held narrow (transformers keeps a few small tensors, Voxtral's positions, in float32), narrowed back after
    # each block
    assert size_16 < 0.55 * size_32 and kept_dtypes
    assert_same_lattice(reference, stored)
    exported = {}
    for name, checkpoint in (("float32", reference), ("bfloat16", stored)):
        save_checkpoint(checkpoint, tmp_path / f"ck-{name}")
        out = tmp_path / f"{name}-{target}"
        serve = ["--serve-dtype", "float16"] if target == "gptq" else []  # a bfloat16 source serves in bfloat16
        capsys.readouterr()
        assert cli(["export", str(tmp_path / f"ck-{name}"), "--target", target, *serve, "-o", str(out)]) == 0, \
            capsys.readouterr().err
        exported[name] = out
    if target == "gptq":  # the lattice tensors byte for byte; the others keep the source's dtype, with its values
        reference_tensors, stored_tensors = (load_file(str(exported[n] / "model.safetensors")) for n in exported)
        assert reference_tensors.keys() == stored_tensors.keys()
        for name, tensor in reference_tensors.items():
            if name.endswith((".qweight", ".qzeros", ".scales", ".g_idx")):
                assert tensor.dtype == stored_tensors[name].dtype and torch.equal(tensor, stored_tensors[name]), name
            else:
                assert torch.equal(tensor.float(), stored_tensors[name].float()), name
    else:  # a GGUF file holds every float tensor in its own type: the same bytes
        assert exported["float32"].read_bytes() == exported["bfloat16"].read_bytes()
