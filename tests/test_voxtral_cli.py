"""Voxtral through the command line: quantize a tiny real-architecture model, export GPTQ and compressed-tensors."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tarq_deploy.formats.gptq_safetensors import gptq_dequantize
from safetensors.torch import load_file
from tarq_deploy.checkpoint import load_checkpoint
from tarq_deploy.data.corpus import Utterance, write_manifest

from tarq_deploy.models.voxtral_shapes import write_tiny_voxtral


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tarq_deploy.cli", *args], capture_output=True, text=True)


def test_quantize_and_export_tiny_voxtral(tmp_path: Path, librivox_clips: list) -> None:
    model_dir = write_tiny_voxtral(tmp_path / "voxtral")
    manifest = tmp_path / "calib.jsonl"
    write_manifest([Utterance(f"c{i}", wav, text) for i, (wav, text) in enumerate(librivox_clips[:3])], manifest)
    done = cli("quantize", "--model", str(model_dir), "--calib", str(manifest), "--method", "tarq",
               "--target", "gptq", "--out", str(tmp_path / "ckpt"))
    assert done.returncode == 0, done.stderr[-2000:]
    ckpt = load_checkpoint(tmp_path / "ckpt")
    assert ckpt.spec.group_size == 128 and ckpt.metadata["source_model"]["architecture"] == "voxtral"
    assert all(".language_model.layers." in name for name in ckpt.quantized)
    assert any(row.get("lam") for row in ckpt.metadata["layers"])

    done = cli("export", str(tmp_path / "ckpt"), "--target", "gptq", "--serve-dtype", "float16",
               "-o", str(tmp_path / "gptq"))
    assert done.returncode == 0, done.stderr[-2000:]
    config = json.loads((tmp_path / "gptq" / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == "gptq"
    tensors = load_file(str(tmp_path / "gptq" / "model.safetensors"))
    name = next(iter(ckpt.quantized))
    prefix = name.removesuffix(".weight")
    weight = gptq_dequantize(tensors[f"{prefix}.qweight"], tensors[f"{prefix}.qzeros"], tensors[f"{prefix}.scales"],
                             tensors[f"{prefix}.g_idx"])
    assert torch.equal(weight, ckpt.quantized[name].dequantize())

    done = cli("export", str(tmp_path / "ckpt"), "--target", "compressed-tensors", "--serve-dtype", "float16",
               "-o", str(tmp_path / "ct"))
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads((tmp_path / "ct" / "config.json").read_text())["quantization_config"]["format"] == "pack-quantized"


def test_export_refuses_a_bad_checkpoint_dir(tmp_path: Path) -> None:
    done = cli("export", str(tmp_path / "nothing"), "--target", "gptq", "-o", str(tmp_path / "out"))
    assert done.returncode == 2 and "not a lattice checkpoint" in done.stderr and "Traceback" not in done.stderr
    assert not (tmp_path / "out").exists()


def test_a_bfloat16_scale_grid_is_served_in_bfloat16_exactly(tmp_path: Path) -> None:
    """--scale-dtype bfloat16 puts every scale on values exact in bf16, so a bf16 export holds the lattice; the
    default fp16 grid is refused for bf16 serving, with the option that fixes it named."""
    from tarq_deploy.formats.compressed_tensors import write_compressed_tensors_checkpoint
    from tarq_deploy.formats.int4_checkpoint import ExportError
    from tarq_deploy.formats.backbones import load_backbone
    from tarq_deploy.calibration.options import QuantizeOptions
    from tarq_deploy.calibration.pipeline import quantize_backbone

    model_dir = write_tiny_voxtral(tmp_path / "voxtral")
    done = cli("quantize", "--model", str(model_dir), "--method", "rtn", "--target", "compressed-tensors",
               "--scale-dtype", "bfloat16", "--out", str(tmp_path / "bf16-grid"))
    assert done.returncode == 0, done.stderr[-2000:]
    ckpt = load_checkpoint(tmp_path / "bf16-grid")
    assert ckpt.spec.scale_grid == "bfloat16"
    out = write_compressed_tensors_checkpoint(ckpt, tmp_path / "ct", serve_dtype="bfloat16")
    tensors = load_file(str(out / "model.safetensors"))
    for name, q in ckpt.quantized.items():
        served = tensors[name.removesuffix(".weight") + ".weight_scale"]
        assert served.dtype == torch.bfloat16 and torch.equal(served.float(), q.scales.float())

    fp16_grid, _ = quantize_backbone(load_backbone(str(model_dir)), [], QuantizeOptions(method="rtn", group_size=128),
                                     str(model_dir), log=lambda _: None)
    with pytest.raises(ExportError, match="--scale-dtype bfloat16"):
        write_compressed_tensors_checkpoint(fp16_grid, tmp_path / "ct16", serve_dtype="bfloat16")
    assert not (tmp_path / "ct16").exists()
