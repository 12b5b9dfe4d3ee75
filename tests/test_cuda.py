"""The CUDA paths on Whisper tiny.en: calibration on the GPU against the same calibration on the CPU, and PyTorch's
tinygemm INT4 kernel serving a calibrated checkpoint. They need a CUDA GPU and are skipped without one (CI has none).

``TARQ_CUDA_TEST_WHISPER`` names another Whisper source (default ``packaged:tiny.en``): a GPU machine without the
weights package can run them on a real-architecture model with random weights; every assertion holds for any
weights, except the transcript check, which needs the real ones."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from tarq_deploy.bench.gpu import build_variant
from tarq_deploy.checkpoint import LatticeCheckpoint, save_checkpoint
from tarq_deploy.data.corpus import Utterance, load_audio
from tarq_deploy.data.real_clips import JFK_TEXT, all_real_clips
from tarq_deploy.formats.model_loader import load_whisper
from tarq_deploy.models.whisper import WhisperBackbone
from tarq_deploy.quant.lattice import check_on_lattice, on_scale_grid
from tarq_deploy.calibration.options import QuantizeOptions
from tarq_deploy.calibration.pipeline import quantize_backbone
from tarq_deploy.runtimes.int4_linear import Int4Linear

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
SOURCE = os.environ.get("TARQ_CUDA_TEST_WHISPER", "packaged:tiny.en")


@pytest.fixture(scope="module")
def calib() -> list[Utterance]:
    clips = [c for c in all_real_clips() if c.id != "jfk"][:4]
    return [Utterance(c.id, str(c.path), c.text) for c in clips]


def calibrate(device: str, calib: list[Utterance], **options) -> LatticeCheckpoint:
    model, processor, generation_config = load_whisper(SOURCE)
    backbone = WhisperBackbone(model, processor, generation_config, device)
    opts = QuantizeOptions(device=device, n_calib=len(calib), **options)
    ckpt, _ = quantize_backbone(backbone, calib, opts, SOURCE, log=lambda _: None)
    return ckpt


def final_losses(ckpt: LatticeCheckpoint) -> dict[str, float]:
    return {row["name"]: row["loss_final"] for row in ckpt.metadata["layers"]}


@pytest.mark.parametrize("method", ["gptq", "tarq"])
def test_calibration_on_cuda_agrees_with_the_cpu(calib: list[Utterance], method: str) -> None:
    """The same calibration on the GPU chooses (nearly) the same codes and reaches the same per-layer losses: the
    GPU is a faster place to run the solver, not a different solver. Float32 sums in another order move a few
    near-tie roundings, and those propagate through the sweep, so agreement is high, not total."""
    cpu, cuda = calibrate("cpu", calib, method=method), calibrate("cuda", calib, method=method)
    assert sorted(cuda.quantized) == sorted(cpu.quantized)
    agree = total = 0
    for name, q in cuda.quantized.items():
        check_on_lattice(q)
        assert q.codes.device.type == "cpu"  # the checkpoint is device-free
        agree += int((q.codes == cpu.quantized[name].codes).sum())
        total += q.codes.numel()
    cpu_loss, cuda_loss = final_losses(cpu), final_losses(cuda)
    assert cuda_loss.keys() == cpu_loss.keys()
    ratio = sum(cuda_loss.values()) / sum(cpu_loss.values())
    print(f"{method}: codes agree on {agree / total:.4f}; summed layer loss CUDA / CPU = {ratio:.4f}")
    assert 0.98 < ratio < 1.02, f"summed layer loss on CUDA / CPU = {ratio:.4f}"
    assert agree / total > 0.85, f"codes agree on {agree / total:.4f} only"
    if method == "tarq":
        assert all(row.get("lam") for row in cuda.metadata["layers"] if row.get("fallback") is None)


def test_tinygemm_serves_a_bfloat16_grid_checkpoint(calib: list[Utterance], tmp_path: Path) -> None:
    """A TARQ checkpoint calibrated on the GPU with --scale-dtype bfloat16 runs every lattice Linear on tinygemm:
    each INT4 layer holds the lattice (in bf16) exactly, the whole model's logits follow the same model with its
    lattice dequantized to bf16, and (real weights) it still transcribes jfk.wav."""
    ckpt = calibrate("cuda", calib, method="tarq", scale_grid="bfloat16")
    assert all(on_scale_grid(q.scales, q.spec) for q in ckpt.quantized.values())
    directory = save_checkpoint(ckpt, tmp_path / "ckpt")
    # float32 around the INT4 layers (Int4Linear casts to bf16 for the kernel): the backbone feeds float32 features
    model, processor, generation_config = build_variant(SOURCE, str(directory), "tinygemm", "cuda", torch.float32)
    layers = {name: m for name, m in model.named_modules() if isinstance(m, Int4Linear)}
    assert len(layers) == len(ckpt.quantized)
    for name, layer in layers.items():
        if layer.bias is None:  # identity in, the weight out, bit for bit
            eye = torch.eye(layer.in_features, device="cuda", dtype=torch.bfloat16)
            expected = ckpt.quantized[f"{name}.weight"].dequantize().to(torch.bfloat16)
            assert torch.equal(layer(eye).T.cpu(), expected), name

    reference, _, _ = build_variant(SOURCE, str(directory), "cublas-fp16", "cuda", torch.float32)
    for name, _ in layers.items():  # the same lattice, dequantized to bf16 in a plain Linear
        reference.get_submodule(name).weight.data = ckpt.quantized[f"{name}.weight"].dequantize().to(
            torch.bfloat16).float().cuda()
    audio = load_audio(str(next(c for c in all_real_clips() if c.id == "jfk").path))
    backbone = WhisperBackbone(model, processor, generation_config, "cuda")
    features = processor.feature_extractor(audio, sampling_rate=16000, return_tensors="pt").input_features.cuda()
    tokens = torch.tensor([backbone.prompt_ids() + processor.tokenizer.encode(JFK_TEXT, add_special_tokens=False)],
                          device="cuda")
    with torch.inference_mode():
        got = model(input_features=features, decoder_input_ids=tokens).logits.float()
        want = reference(input_features=features, decoder_input_ids=tokens).logits.float()
    assert (got - want).norm() / want.norm() < 2e-2  # bf16 activations into the kernel vs float32 into the Linear
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() > 0.9
    if SOURCE == "packaged:tiny.en":
        text = backbone.transcribe(audio)
        assert "ask not what your country can do for you" in text.lower().replace(",", ""), text
