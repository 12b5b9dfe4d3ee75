"""`quantize` end to end on real Whisper tiny.en: every method, held-out error, resume, the CLI."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import jiwer
import pytest
import torch
from helpers import calibration_interrupted_at, transcribe_whisper_cpp

from tarq_deploy.checkpoint import load_checkpoint, save_checkpoint
from tarq_deploy.data.corpus import Utterance, load_audio, write_manifest
from tarq_deploy.data.real_clips import all_real_clips
from tarq_deploy.models.from_checkpoint import load_dequantized_whisper
from tarq_deploy.formats.model_loader import load_whisper
from tarq_deploy.models.common import TextAudio
from tarq_deploy.models.whisper import WhisperBackbone
from tarq_deploy.calibration import driver
from tarq_deploy.quant.gptq import weighted_loss
from tarq_deploy.calibration.options import QuantizeOptions
from tarq_deploy.calibration.pipeline import quantize_backbone

HELD_OUT = ("jfk", "cards-004", "cards-005", "goforward")
# rarebal (metric only) and residual (solver only) are TARQ's two halves: their arithmetic is tested in
# test_solvers.py, and TARQ runs both through this pipeline
METHODS = ("rtn", "gptq", "tarq")



def word_error_rate(reference: str, hypothesis: str) -> float:
    clean = lambda t: " ".join(re.sub(r"[^a-z0-9' ]+", " ", t.lower()).split())  # noqa: E731
    return jiwer.wer(clean(reference), clean(hypothesis))


@pytest.fixture(scope="module")
def clips() -> dict[str, list]:
    every = all_real_clips()
    held = [c for c in every if c.id in HELD_OUT]
    calib = [c for c in every if c.id not in HELD_OUT]
    assert len(held) == len(HELD_OUT) and len(calib) >= 6
    return {"calib": [Utterance(c.id, str(c.path), c.text) for c in calib], "held": held}


@pytest.fixture(scope="module")
def checkpoints(clips: dict, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Each method's checkpoint path, under "milestones" what each quantize_backbone announced, and under "solved" /
    "prepared" the Linears TARQ solved and those whose solve prepared a metric, in order."""
    out = tmp_path_factory.mktemp("ckpts")
    paths: dict = {"milestones": {}, "solved": [], "prepared": []}
    for method in METHODS:
        model, processor, gc = load_whisper("packaged:tiny.en")
        backbone = WhisperBackbone(model, processor, gc)
        heard = paths["milestones"][method] = []
        with pytest.MonkeyPatch.context() as patch:
            if method == "tarq":
                _count_metric_preparations(patch, paths["solved"], paths["prepared"])
            ckpt, _ = quantize_backbone(backbone, clips["calib"], QuantizeOptions(method=method), "packaged:tiny.en",
                                       log=lambda _: None, milestone=heard.append)
        paths[method] = save_checkpoint(ckpt, out / method)
    return paths


def _count_metric_preparations(patch: pytest.MonkeyPatch, solved: list[str], prepared: list[str]) -> None:
    """Record each Linear the driver solves, and each one whose solve prepares (damps, inverts, factors) a metric."""
    from tarq_deploy.quant import tarq

    solve, prepare = driver.solve_layer, tarq.rebalanced_metric

    def named_solve(name, *args, **kwargs):
        solved.append(name)
        return solve(name, *args, **kwargs)

    def counted_prepare(*args, **kwargs):
        prepared.append(solved[-1])
        return prepare(*args, **kwargs)

    patch.setattr(driver, "solve_layer", named_solve)
    patch.setattr(tarq, "rebalanced_metric", counted_prepare)


def test_the_stages_are_announced_in_order(checkpoints: dict) -> None:
    """bench.calibration clocks its stages by these: windows once built, then every block of the model (4 encoder
    blocks, 4 decoder blocks, the head); rtn builds no windows and calibrates no block."""
    blocks = [f"block {i}/9" for i in range(1, 10)]
    assert checkpoints["milestones"] == {method: ([] if method == "rtn" else ["windows", *blocks])
                                         for method in METHODS}


@pytest.mark.parametrize("method", METHODS)
def test_each_method_still_transcribes_jfk(checkpoints: dict, clips: dict, method: str) -> None:
    model, processor, gc = load_dequantized_whisper(checkpoints[method])
    jfk = next(c for c in clips["held"] if c.id == "jfk")
    hypothesis = WhisperBackbone(model, processor, gc).transcribe(load_audio(str(jfk.path)))
    assert word_error_rate(jfk.text, hypothesis) < 0.20, hypothesis  # measured 0.0 for all three (results/test_bounds)


def test_checkpoint_records_the_method_and_tied_head(checkpoints: dict) -> None:
    ckpt = load_checkpoint(checkpoints["tarq"])
    assert ckpt.aliases == {"model.decoder.embed_tokens.weight": "proj_out.weight"}
    assert len(ckpt.quantized) == 4 * 6 + 4 * 10 + 1  # encoder 6 Linears, decoder 10 per block, the head
    assert ckpt.spec.group_size == 32 and ckpt.metadata["method"]["name"] == "tarq"
    layers = {row["name"]: row for row in ckpt.metadata["layers"]}
    assert layers["proj_out"]["lam"] > 1 and layers["model.encoder.layers.0.fc1"]["alpha"] is not None
    calibration = ckpt.metadata["calibration"]
    assert calibration["rare_words"] > 0 and 0 < calibration["tail_share"]["decoder_tokens"] < 0.5
    assert calibration["tail_share"]["encoder_frames"] > 0  # rare words found through the alignment heads
    machine = ckpt.metadata["machine"]  # the same-bytes promise holds per processor kind and thread count
    assert machine["cpu_model"] and machine["torch_threads"] >= 1 and machine["torch_cpu_capability"]


def held_out_second_moments(clips: dict) -> dict[str, torch.Tensor]:
    """H = sum x x^T of every Linear's input in the full-precision model on held-out speech."""
    model, processor, gc = load_whisper("packaged:tiny.en")
    backbone = WhisperBackbone(model, processor, gc)
    windows = backbone.build_windows([TextAudio(c.id, load_audio(str(c.path)), c.text) for c in clips["held"]],
                                     pack=False, encoder_tagging="none")
    H: dict[str, torch.Tensor] = {}

    def hook(name: str):
        def fold(_m, args):
            x = args[0].reshape(-1, args[0].shape[-1]).double()
            H[name] = H.get(name, 0) + x.T @ x
        return fold

    handles = [m.register_forward_pre_hook(hook(f"{n}.weight")) for n, m in model.named_modules()
               if isinstance(m, torch.nn.Linear)]
    with torch.no_grad():
        for w in windows:
            model(input_features=w.inputs["input_features"], decoder_input_ids=w.inputs["decoder_input_ids"])
    for h in handles:
        h.remove()
    return H


def test_gptq_and_tarq_beat_rtn_on_held_out_speech(checkpoints: dict, clips: dict) -> None:
    """Aggregate held-out losses, not a count of layers: which of 24 encoder layers beat RTN moves with the processor
    (TARQ won 24/24 on AMD EPYC, 21/24 on Intel Xeon AVX-512, 22/24 with torch forced to AVX2), the summed loss does
    not. Spread over threads 1/2, seeds 0/1 and AVX-512/AVX2 on an Intel Xeon (results/test_bounds/quantize-intel.json):

    |                          | loss ratio  | encoder loss ratio | layers winning |
    | GPTQ                     | 0.364-0.368 | 0.228-0.231        | 0.877-0.908    |
    | TARQ                     | 0.454-0.463 | 0.354-0.367        | 0.815-0.862    |
    | broken: RTN as GPTQ      | 1.000       | 1.000              | 0.000          |
    | broken: identity metric  | 0.790-0.791 | 0.744-0.745        | 1.000          |

    The bounds sit 0.14 / 0.13 above the worst measured run and catch both broken solvers (the layer count alone
    misses the second: GPTQ with its Hessian damped into the identity wins every layer by searching scales)."""
    H = held_out_second_moments(clips)
    model, _, _ = load_whisper("packaged:tiny.en")
    W = {n: p.detach().float() for n, p in model.state_dict().items()}
    rtn = load_checkpoint(checkpoints["rtn"]).quantized
    rtn_loss = {n: weighted_loss(W[n] - q.dequantize(), H[n]) for n, q in rtn.items()}
    for method in ("gptq", "tarq"):
        solved = load_checkpoint(checkpoints[method]).quantized
        loss = {n: weighted_loss(W[n] - q.dequantize(), H[n]) for n, q in solved.items()}
        encoder = [n for n in loss if ".encoder." in n]
        loss_ratio = sum(loss.values()) / sum(rtn_loss[n] for n in loss)
        encoder_ratio = sum(loss[n] for n in encoder) / sum(rtn_loss[n] for n in encoder)
        wins = sum(loss[n] < rtn_loss[n] for n in loss) / len(loss)
        assert loss_ratio < 0.6, (method, loss_ratio)
        assert encoder_ratio < 0.5, (method, encoder_ratio)
        # decoder Linears see ~90 tokens in this tiny calibration set and overfit on some layers
        assert wins >= 0.7, (method, wins)


def test_interrupted_run_resumes_to_identical_bytes(clips: dict, tmp_path: Path, monkeypatch) -> None:
    """Also: the fp stream kept from the alignment pass (a budget it fits, whatever the machine's memory) and the
    one recomputed block by block (--max-memory 0) give the same bytes."""
    options = QuantizeOptions(method="tarq", n_calib=2, max_memory=1 << 40)
    kept_blocks: list[str] = []
    take_kept = driver.SequentialCalibrator._kept_fp_stream

    def spy(self, block):
        kept = take_kept(self, block)
        if kept is not None:
            kept_blocks.append(block.name)
        return kept

    monkeypatch.setattr(driver.SequentialCalibrator, "_kept_fp_stream", spy)

    def run(work: Path | None, out: Path, options: QuantizeOptions = options) -> Path:
        model, processor, gc = load_whisper("packaged:tiny.en")
        ckpt, _ = quantize_backbone(WhisperBackbone(model, processor, gc), clips["calib"], options, "packaged:tiny.en",
                                   work, log=lambda _: None)
        return save_checkpoint(ckpt, out)

    reference = run(tmp_path / "ref.partial", tmp_path / "ref")
    # tiny.en's whole encoder and decoder were reused from the alignment pass
    assert kept_blocks == [f"model.{stack}.layers.{i}" for stack in ("encoder", "decoder") for i in range(4)]
    kept_blocks.clear()
    recomputed = run(None, tmp_path / "recomputed", QuantizeOptions(method="tarq", n_calib=2, max_memory=0))
    assert kept_blocks == []
    for name in ("manifest.json", "lattice.safetensors", "tensors.safetensors"):
        assert (recomputed / name).read_bytes() == (reference / name).read_bytes(), name
    with calibration_interrupted_at(4):
        run(tmp_path / "res.partial", tmp_path / "res")
    assert (tmp_path / "res.partial" / "progress.json").is_file() and not (tmp_path / "res").exists()
    resumed = run(tmp_path / "res.partial", tmp_path / "res")
    for name in ("manifest.json", "lattice.safetensors", "tensors.safetensors"):
        assert (resumed / name).read_bytes() == (reference / name).read_bytes(), name


def test_cli_quantize_rtn_and_bad_corpus(tmp_path: Path, clips: dict) -> None:
    cli = [sys.executable, "-m", "tarq_deploy.cli", "quantize", "--model", "packaged:tiny.en"]
    done = subprocess.run(cli + ["--method", "rtn", "--out", str(tmp_path / "rtn")], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert load_checkpoint(tmp_path / "rtn").metadata["method"]["name"] == "rtn"
    manifest = tmp_path / "bad.jsonl"
    write_manifest([Utterance("ghost", str(tmp_path / "missing.wav"), "hello there")], manifest)
    done = subprocess.run(cli + ["--calib", str(manifest), "--out", str(tmp_path / "bad")], capture_output=True, text=True)
    assert done.returncode != 0
    assert "ghost" in done.stderr and "missing.wav" in done.stderr and "Traceback" not in done.stderr
    assert not (tmp_path / "bad").exists()


@pytest.mark.parametrize("method", ["tarq", "gptq"])
def test_calibrated_checkpoint_exports_losslessly_to_whisper_cpp(checkpoints: dict, clips: dict, tmp_path: Path,
                                                                 method: str) -> None:
    from tarq_deploy.formats.whisper_cpp import verify
    from tarq_deploy.formats.whisper_cpp import export_whisper_cpp

    model_file = export_whisper_cpp(checkpoints[method], tmp_path / f"{method}-q4_0.bin", "q4_0")
    diffs = verify(model_file, checkpoints[method])
    assert diffs and max(diffs.values()) == 0.0
    jfk = next(c for c in clips["held"] if c.id == "jfk")
    assert word_error_rate(jfk.text, transcribe_whisper_cpp(model_file, str(jfk.path))) < 0.20


def test_cross_attention_metric_is_prepared_once_per_decoder(checkpoints: dict) -> None:
    """The decoder's cross-attention k/v read the encoder output in every block, so they share one LayerStats for
    the stage: its metric is damped, inverted and factored in the first block and reused by the other three."""
    solved, prepared = checkpoints["solved"], checkpoints["prepared"]
    cross = [name for name in solved if ".encoder_attn.k_proj" in name or ".encoder_attn.v_proj" in name]
    assert len(cross) == 8  # k and v of tiny.en's four decoder blocks were all solved
    assert [name for name in prepared if name in cross] == ["model.decoder.layers.0.encoder_attn.k_proj"]
    assert len(prepared) == len(set(prepared))  # and no other Linear prepared a metric twice
