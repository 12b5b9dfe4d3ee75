"""Voxtral end to end on a tiny random model (tarq_deploy/models/voxtral_shapes.py) and real speech: transcription prompt and rare
tags, stages that reproduce the model's own forward, TARQ / RTN calibration of the language model's Linears only,
the lattice checkpoint, and GPTQ / compressed-tensors exports that hold the lattice exactly and load in transformers.

Loaders. The compressed-tensors export is loaded by transformers + compressed-tensors (installed here). The GPTQ
export needs transformers + optimum + gptqmodel, which do not install next to this environment's torch: its config
is checked field by field against what that loader reads, and a real load runs only where the stack is importable.
(vLLM serves Voxtral from Mistral-format checkpoints only -- consolidated.safetensors + params.json, Mistral tensor
names, compressed-tensors -- which these HF-format exports are not.)
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tarq_deploy.formats.compressed_tensors import compressed_tensors_dequantize, write_compressed_tensors_checkpoint
from tarq_deploy.formats.gptq_safetensors import gptq_dequantize, write_gptq_checkpoint
from tarq_deploy.formats.marlin import check_marlin_shape
from tarq_deploy.checkpoint import load_checkpoint, save_checkpoint
from tarq_deploy.data.corpus import load_audio
from tarq_deploy.data.rarity import reference_words
from tarq_deploy.models.voxtral import VoxtralBackbone, load_dequantized_voxtral, voxtral_checkpoint
from tarq_deploy.models.common import TextAudio
from tarq_deploy.calibration.driver import CalibrationConfig, SequentialCalibrator
from tarq_deploy.quant.lattice import LatticeSpec
from tarq_deploy.quant.tarq import TarqConfig

sys.path.insert(0, str(Path(__file__).parent))
from tarq_deploy.models.voxtral_shapes import load_tiny_voxtral, write_tiny_voxtral  # noqa: E402

SPEC = LatticeSpec(4, 128)
CLIP_SUFFIXES = ("0870", "0880", "0930")  # rare words: dashwood, prudently | none | amiable
LAYERS = 2
LM_LINEARS = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
              "mlp.up_proj", "mlp.down_proj"]
LM_MODULES = sorted(f"model.language_model.layers.{i}.{rel}" for i in range(LAYERS) for rel in LM_LINEARS)
AUDIO_LINEARS = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.out_proj", "fc1", "fc2"]


# ------------------------------------------------------------------------------------------------------ fixtures
@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    return write_tiny_voxtral(tmp_path_factory.mktemp("voxtral") / "tiny")


@pytest.fixture(scope="module")
def utterances(librivox_clips) -> list[TextAudio]:
    chosen = [(path, text) for path, text in librivox_clips if Path(path).stem.endswith(CLIP_SUFFIXES)]
    assert len(chosen) == len(CLIP_SUFFIXES)
    return [TextAudio(Path(path).stem, load_audio(path), text) for path, text in chosen]


def fresh_backbone(tiny_dir: Path, **options) -> VoxtralBackbone:
    model, processor = load_tiny_voxtral(tiny_dir)
    return VoxtralBackbone(model, processor, **options)


def logits(model, window) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=window.inputs["input_ids"], input_features=window.inputs["input_features"]).logits


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


class Calibrated:
    """One calibration run: the backbone (weights now on the lattice), the state before, windows, checkpoint."""

    def __init__(self, tiny_dir: Path, utterances: list[TextAudio], method: str, pack: bool, **options) -> None:
        self.backbone = fresh_backbone(tiny_dir, **options)
        self.original = {k: v.clone() for k, v in self.backbone.model.state_dict().items()}
        self.windows = self.backbone.build_windows(utterances, pack=pack)
        config = CalibrationConfig(SPEC, TarqConfig(method=method), seed=0)
        self.result = SequentialCalibrator(self.backbone.stages(), self.windows, config, log=lambda _: None).run()
        metadata = {"method": {"name": method}, "layers": self.result.records,
                    "source_model": {"id": "tiny-voxtral", "architecture": "voxtral"}}
        self.checkpoint = voxtral_checkpoint(self.backbone, self.result.lattice, SPEC, metadata)


@pytest.fixture(scope="module")
def tarq_run(tiny_dir, utterances) -> Calibrated:
    return Calibrated(tiny_dir, utterances, "tarq", pack=True)


@pytest.fixture(scope="module")
def rtn_run(tiny_dir, utterances) -> Calibrated:
    return Calibrated(tiny_dir, utterances, "rtn", pack=True)


# ------------------------------------------------------------------------------------------- prompt and windows
def test_transcription_prompt_layout(tiny_dir):
    backbone = fresh_backbone(tiny_dir)
    lang = backbone.tokenizer.encode("lang:en", add_special_tokens=False)
    # <s> [INST] [BEGIN_AUDIO] [AUDIO]*375 [/INST] lang:en [TRANSCRIBE], with Tekken's control-token ids
    assert backbone.prompt_ids(375) == [1, 3, 25] + [24] * 375 + [4] + lang + [34]
    assert backbone.tokenizer.decode(lang) == "lang:en"
    assert VoxtralBackbone(backbone.model, backbone.processor, language=None).prompt_ids(2) == [1, 3, 25, 24, 24, 4, 34]
    features = backbone.audio_features(torch.zeros(31 * 16000).numpy())  # 31 s: two 30 s chunks
    assert tuple(features.shape) == (2, 128, 3000)
    assert backbone.audio_token_count(2) == 750


def test_windows_tag_only_rare_transcript_tokens(tiny_dir, utterances):
    backbone = fresh_backbone(tiny_dir)
    windows = backbone.build_windows(utterances, pack=False)
    assert [w.info["ids"] for w in windows] == [[u.id] for u in utterances]
    prompt_length = len(backbone.prompt_ids(375))
    tokenizer = backbone.tokenizer
    for window, utterance in zip(windows, utterances):
        ids, mask = window.inputs["input_ids"][0], window.masks["tokens"]
        transcript = tokenizer.encode(utterance.text, add_special_tokens=False)
        assert ids.tolist() == backbone.prompt_ids(375) + transcript  # teacher forcing: </s> is only a label
        assert mask.shape == ids.shape and not mask[: prompt_length - 1].any()
        assert window.masks["frames"].shape == (1500,) and not window.masks["frames"].any()
        predicted = [tokenizer.decode([int(ids[t + 1])]) for t in torch.nonzero(mask[:-1]).flatten()]
        assert window.info["rare_tokens"] == int(mask.sum())
        rare_words = [w.normalized for w in reference_words(utterance.text) if w.rare]
        assert "".join(predicted).split() == rare_words
    assert windows[0].info["rare_words"] == 2 and windows[1].info["rare_tokens"] == 0  # dashwood, prudently; none


def test_stages_reproduce_the_models_own_forward(tiny_dir, utterances):
    backbone = fresh_backbone(tiny_dir, quantize_audio_tower=True)
    model = backbone.model
    window = backbone.build_windows(utterances[:1], pack=False)[0]
    audio_stage, decoder_stage = backbone.stages()
    stream: dict = {}
    h = audio_stage.enter(window, stream)
    with torch.no_grad():
        for block in audio_stage.blocks:
            h = audio_stage.call_block(block.module, h, window, stream)
        audio_stage.leave(h, window, stream)
        assert torch.equal(stream["audio_embeds"], backbone.audio_embeddings(window.inputs["input_features"]))
        h = decoder_stage.enter(window, stream)
        for block in decoder_stage.blocks:
            h = decoder_stage.call_block(block.module, h, window, stream)
        ours = model.lm_head(model.model.language_model.norm(h))
    assert torch.allclose(ours, logits(model, window), rtol=0, atol=1e-5)
    assert isinstance(backbone.transcribe(utterances[0].audio, max_new_tokens=3), str)


# ---------------------------------------------------------------------------------------------------- calibration
@pytest.mark.parametrize("run_name", ["tarq_run", "rtn_run"])
def test_calibration_quantizes_the_language_model_linears_only(run_name, request):
    run: Calibrated = request.getfixturevalue(run_name)
    lattice, state = run.result.lattice, run.backbone.model.state_dict()
    assert sorted(lattice) == [f"{m}.weight" for m in LM_MODULES]
    assert len(run.result.records) == len(LM_MODULES)
    for name, q in lattice.items():
        assert torch.equal(state[name], q.dequantize()), name  # the model now holds the lattice values
        assert not torch.equal(state[name], run.original[name]), name
    untouched = [name for name in state if name not in lattice]
    assert any(n.startswith("model.audio_tower.") for n in untouched) and "lm_head.weight" in untouched
    for name in untouched:
        assert torch.equal(state[name], run.original[name]), name
        assert torch.equal(run.checkpoint.tensors[name], run.original[name]), name
    assert sorted(run.checkpoint.quantized) == sorted(lattice) and not run.checkpoint.aliases
    assert {"config.json", "generation_config.json", "tokenizer.json", "processor_config.json"} <= set(
        run.checkpoint.model_files)


def test_tarq_uses_the_rare_tags(tarq_run):
    assert len(tarq_run.windows) == 1 and tarq_run.windows[0].info["rare_tokens"] > 0  # the three clips packed
    first = tarq_run.result.records[0]
    assert first["method"] == "tarq" and first["n_tail"] > 0 and first["lam"] is not None
    assert all(r["loss_final"] <= r["loss_rtn"] for r in tarq_run.result.records)


def test_quantize_audio_tower_option(tiny_dir, utterances):
    run = Calibrated(tiny_dir, utterances[:1], "rtn", pack=False, quantize_audio_tower=True)
    audio = [f"model.audio_tower.layers.{i}.{rel}.weight" for i in range(2) for rel in AUDIO_LINEARS]
    assert sorted(run.result.lattice) == sorted(audio + [f"{m}.weight" for m in LM_MODULES])
    assert [r["name"] for r in run.result.records[:6]] == [n.removesuffix(".weight") for n in audio[:6]]


def test_checkpoint_round_trip_gives_the_calibrated_model(tarq_run, tmp_path):
    saved = save_checkpoint(tarq_run.checkpoint, tmp_path / "ckpt")
    model, processor = load_dequantized_voxtral(load_checkpoint(saved))
    window = tarq_run.windows[0]
    assert torch.equal(logits(model, window), logits(tarq_run.backbone.model, window))
    assert processor.tokenizer.convert_tokens_to_ids("[TRANSCRIBE]") == 34


# -------------------------------------------------------------------------------------------------------- exports
def test_gptq_export_holds_the_lattice_and_the_config_loaders_need(tarq_run, tmp_path):
    ckpt = tarq_run.checkpoint
    out = write_gptq_checkpoint(ckpt, tmp_path / "gptq", serve_dtype="float16")
    tensors = load_file(str(out / "model.safetensors"))
    for name, q in ckpt.quantized.items():
        prefix = name.removesuffix(".weight")
        parts = {s: tensors[f"{prefix}.{s}"] for s in ("qweight", "qzeros", "scales", "g_idx")}
        assert torch.equal(gptq_dequantize(**parts), q.dequantize()), name
        assert name not in tensors
        check_marlin_shape(q.codes.shape[1], q.codes.shape[0], SPEC.group_size, name)  # vLLM gptq_marlin serves it
    for name, t in ckpt.tensors.items():
        assert tensors[name].dtype == t.dtype and torch.equal(tensors[name], t), name
    config = json.loads((out / "config.json").read_text())
    # What transformers' GPTQ path (optimum / gptqmodel) reads to pick and configure the int4 layers (vLLM's
    # gptq_marlin reads bits / group_size / desc_act / sym, but its Voxtral loads Mistral-format checkpoints only).
    assert config["quantization_config"] == {
        "quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False, "sym": True,
        "checkpoint_format": "gptq", "lm_head": False,
        "modules_in_block_to_quantize": [LM_MODULES], "block_name_to_quantize": "model.language_model.layers"}
    assert json.loads((out / "quantize_config.json").read_text()) == config["quantization_config"]
    assert config["model_type"] == "voxtral" and config["architectures"] == ["VoxtralForConditionalGeneration"]
    assert config["dtype"] == "float16" and config["text_config"]["dtype"] == "float16"
    assert config["audio_token_id"] == 24
    assert {"tokenizer.json", "processor_config.json", "generation_config.json"} <= {p.name for p in out.iterdir()}


@pytest.mark.filterwarnings("ignore:You passed `quantization_config`")
def test_gptq_export_loads_with_the_gptq_stack(tarq_run, tmp_path):
    """Runs only where optimum + gptqmodel import (their CPU install lives in a separate environment)."""
    pytest.importorskip("optimum")
    pytest.importorskip("gptqmodel")
    from transformers import GPTQConfig, VoxtralForConditionalGeneration

    out = write_gptq_checkpoint(tarq_run.checkpoint, tmp_path / "gptq", serve_dtype="float16")
    model = VoxtralForConditionalGeneration.from_pretrained(
        out, dtype=torch.float16, device_map="cpu", quantization_config=GPTQConfig(bits=4, backend="torch"))
    for name, q in tarq_run.checkpoint.quantized.items():
        layer = model.get_submodule(name.removesuffix(".weight"))
        with torch.no_grad():
            weight = layer(torch.eye(q.codes.shape[1], dtype=torch.float16)).T
        assert torch.equal(weight, q.dequantize().to(torch.float16)), name


@pytest.mark.filterwarnings("ignore:You passed `quantization_config`")
def test_compressed_tensors_export_loads_in_transformers(tarq_run, tmp_path):
    pytest.importorskip("compressed_tensors")
    from transformers import CompressedTensorsConfig, VoxtralForConditionalGeneration, VoxtralProcessor

    ckpt = tarq_run.checkpoint
    out = write_compressed_tensors_checkpoint(ckpt, tmp_path / "ct", serve_dtype="float16")
    tensors = load_file(str(out / "model.safetensors"))
    for name, q in ckpt.quantized.items():
        prefix = name.removesuffix(".weight")
        parts = {s: tensors[f"{prefix}.{s}"] for s in ("weight_packed", "weight_scale", "weight_shape")}
        assert torch.equal(compressed_tensors_dequantize(**parts), q.dequantize()), name
    ignore = json.loads((out / "config.json").read_text())["quantization_config"]["ignore"]
    assert "lm_head" in ignore and "model.multi_modal_projector.linear_1" in ignore
    assert not set(LM_MODULES) & set(ignore)

    model = VoxtralForConditionalGeneration.from_pretrained(
        out, quantization_config=CompressedTensorsConfig(dequantize=True), dtype=torch.float32)
    loaded = model.state_dict()
    for name, q in ckpt.quantized.items():  # the library multiplies codes and scales in the scale dtype (fp16)
        assert torch.equal(loaded[name], q.dequantize().to(torch.float16).float()), name
    for name, t in ckpt.tensors.items():
        assert torch.equal(loaded[name].float(), t.float()), name
    window = tarq_run.windows[0]
    assert relative_error(logits(model, window), logits(tarq_run.backbone.model, window)) < 1e-2
    assert VoxtralProcessor.from_pretrained(out).tokenizer.convert_tokens_to_ids("[AUDIO]") == 24
